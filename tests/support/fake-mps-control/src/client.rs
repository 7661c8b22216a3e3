//! Client mode (no arguments): commands from stdin, one per line, answers on stdout exactly as
//! the real CLI prints them. Like the real CLI it uses `control_privileged` when it can connect
//! to it, else `control` (where the daemon refuses changes), and frames each command as a UI
//! session of its own (protocol.rs): the real CLI sends one command per run, and a gate in
//! front of `control` sees the same shape from the fake as from the real one.

use std::io::{BufRead, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use crate::paths::Paths;
use crate::protocol;

pub const NO_DAEMON: &str = "Cannot find MPS control daemon process";
/// What the real CLI prints (on stderr) when the daemon closes after the request unanswered.
pub const CANNOT_SEND: &str = "Cannot send command to MPS control daemon process";

/// Why the CLI gives up; both exit 1, as the real one does.
#[derive(Debug)]
enum CliError {
    /// No socket, nobody listening, or closed before the hello.
    NoDaemon,
    /// The daemon closed the connection after the request without answering it.
    CannotSend,
}

pub fn run() -> ExitCode {
    let paths = Paths::from_env();
    // Connected before stdin is read, so that without a daemon the CLI fails at once.
    let (socket, first) = match open_first_session(&paths) {
        Ok(opened) => opened,
        Err(e) => return fail(e),
    };
    let mut next = Some(first);
    let mut out = std::io::stdout().lock();
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let command = line.trim();
        if command.is_empty() {
            continue;
        }
        let session = match next.take().map_or_else(|| open_session(&socket), Ok) {
            Ok(session) => session,
            Err(e) => return fail(e),
        };
        match run_command(&session, command) {
            Ok(outputs) => {
                for text in outputs {
                    let _ = writeln!(out, "{text}");
                }
                let _ = out.flush();
            }
            Err(e) => return fail(e),
        }
    }
    ExitCode::SUCCESS
}

fn fail(e: CliError) -> ExitCode {
    match e {
        // The probe log captured this one on stdout.
        CliError::NoDaemon => println!("{NO_DAEMON}"),
        CliError::CannotSend => eprintln!("{CANNOT_SEND}"),
    }
    ExitCode::FAILURE
}

/// `control_privileged` when it is there and takes the connection (root, or the daemon's
/// owner: it is mode 0755), else `control`.
fn open_first_session(paths: &Paths) -> Result<(PathBuf, UnixStream), CliError> {
    let privileged = paths.control_privileged();
    if privileged.exists() {
        if let Ok(stream) = protocol::connect(&privileged) {
            return Ok((privileged, after_hello(stream)?));
        }
    }
    let control = paths.control();
    let session = open_session(&control)?;
    Ok((control, session))
}

fn open_session(socket: &Path) -> Result<UnixStream, CliError> {
    let stream = protocol::connect(socket).map_err(|_| CliError::NoDaemon)?;
    after_hello(stream)
}

/// The daemon greets each connection once it gets to it (it serves one at a time).
fn after_hello(stream: UnixStream) -> Result<UnixStream, CliError> {
    match protocol::recv_message(&stream) {
        Ok(Some(hello)) if hello == protocol::HELLO => Ok(stream),
        _ => Err(CliError::NoDaemon),
    }
}

/// One UI session with one command, sent in a row as the real CLI does: credentials, kind,
/// length, command, end; then the answer's output texts up to its end marker.
fn run_command(session: &UnixStream, command: &str) -> Result<Vec<String>, CliError> {
    let framed = protocol::ui_command(command);
    let sent = protocol::send_with_credentials(session, protocol::CREDENTIALS)
        .and_then(|()| protocol::send_with_credentials(session, &protocol::kind_message(protocol::KIND_UI)))
        .and_then(|()| protocol::send_message(session, &protocol::u64_message(framed.len() as u64)))
        .and_then(|()| protocol::send_message(session, &framed))
        .and_then(|()| protocol::send_message(session, &protocol::u64_message(protocol::END_OF_SESSION)));
    // A daemon that closes after the request may have closed before our last sends: what it
    // answered decides, not whether those sends got through.
    let _ = sent;
    let mut outputs = Vec::new();
    loop {
        match protocol::recv_message(session) {
            Ok(Some(message)) => {
                if protocol::parse_u64(&message) == Some(protocol::END_OF_ANSWER) {
                    return Ok(outputs);
                }
                if let Some(text) = protocol::parse_ui_output(&message) {
                    outputs.push(text);
                }
            }
            Ok(None) | Err(_) => return Err(CliError::CannotSend),
        }
    }
}
