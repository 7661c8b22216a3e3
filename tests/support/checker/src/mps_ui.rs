//! `mps-ui <command...>`: what the control CLI (`nvidia-cuda-mps-control`) would get from
//! inside the pod. Like the real CLI it uses `control_privileged` when that socket is there and
//! takes the connection, else `control`, and sends one command framed as measured: credentials,
//! kind 4, the length, the command, the end of the session; then reads the answer.

use std::path::Path;

use gpu_mps_checker::mps_framing::{self, END_OF_ANSWER, END_OF_SESSION, KIND_UI};
use gpu_mps_checker::{CLI_CANNOT_SEND, CLI_NO_DAEMON, MpsUi};

use crate::control_connection::{ConnectionError, ControlConnection};
use crate::mps_client::pipe_dir;

pub fn run(command: &str) -> MpsUi {
    let pipe_dir = pipe_dir();
    let mut line = MpsUi {
        command: command.to_string(),
        socket_used: None,
        reached_daemon: false,
        answer: None,
        error: None,
        detail: None,
    };
    let connection = match open(&pipe_dir) {
        Ok(connection) => connection,
        Err(e) => {
            line.error = Some(CLI_NO_DAEMON.to_string());
            line.detail = Some(e.to_string());
            return line;
        }
    };
    line.socket_used = Some(connection.socket.to_string_lossy().into_owned());
    if let Err(e) = connection.read_hello() {
        line.error = Some(CLI_NO_DAEMON.to_string());
        line.detail = Some(e.to_string());
        return line;
    }
    // All in a row before reading, as the real CLI sends them. A session closed after the
    // request may make the later sends fail; what comes back decides.
    let (length, framed) = mps_framing::ui_command(command);
    let sent = connection
        .send_request(KIND_UI)
        .and_then(|()| connection.send(&length))
        .and_then(|()| connection.send(&framed))
        .and_then(|()| connection.send(&END_OF_SESSION));
    let mut outputs: Vec<String> = Vec::new();
    loop {
        match connection.recv("answer") {
            Ok(Some(m)) if m.bytes == END_OF_ANSWER => {
                line.reached_daemon = true;
                line.answer = Some(outputs.join("\n"));
                return line;
            }
            Ok(Some(m)) => {
                line.reached_daemon = true;
                match mps_framing::ui_output(&m.bytes) {
                    Some(text) => outputs.push(text),
                    None => {
                        line.detail = Some(format!(
                            "unexpected message {} in the answer",
                            mps_framing::hex(&m.bytes)
                        ));
                    }
                }
            }
            Ok(None) => {
                if line.reached_daemon {
                    line.answer = Some(outputs.join("\n"));
                    line.detail = Some("closed before the end of the answer".to_string());
                } else {
                    line.error = Some(CLI_CANNOT_SEND.to_string());
                    line.detail = Some(match &sent {
                        Ok(()) => "closed after the request, unanswered".to_string(),
                        Err(e) => format!("closed at the request ({e}), unanswered"),
                    });
                }
                return line;
            }
            Err(e) => {
                line.error = Some(e.to_string());
                return line;
            }
        }
    }
}

/// `control_privileged` when it takes the connection (root or the daemon's owner), else
/// `control`.
fn open(pipe_dir: &Path) -> Result<ControlConnection, ConnectionError> {
    let privileged = pipe_dir.join("control_privileged");
    if privileged.exists() {
        if let Ok(connection) = ControlConnection::open(&privileged) {
            return Ok(connection);
        }
    }
    ControlConnection::open(&pipe_dir.join("control"))
}
