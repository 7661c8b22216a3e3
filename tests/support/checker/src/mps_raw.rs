//! `mps-raw --kind K [--socket NAME] [--wait-seconds W]`: connect, read the first message,
//! send `OUTBCRED\0` and the u32 kind K with credentials, and report everything that comes
//! back (bytes, descriptors) until the other side closes or W seconds pass with nothing. For
//! tests that a gate refuses whatever is not a CUDA client (kind 4, an unknown kind 7), and
//! that what it lets through gets the measured answer (kind 2: `OUTBCUFD` with 1 descriptor).
//! It sends no ack and no command: the bare request is the probe.

use std::time::Duration;

use gpu_mps_checker::mps_framing::{self, CREDENTIALS};
use gpu_mps_checker::{MpsRaw, RawReply};
use nix::errno::Errno;

use crate::control_connection::{self, ControlConnection};
use crate::mps_client::pipe_dir;

pub fn run(kind: u32, socket_name: &str, wait: Duration) -> MpsRaw {
    let socket = pipe_dir().join(socket_name);
    let mut line = MpsRaw {
        kind,
        socket_used: socket.to_string_lossy().into_owned(),
        hello_hex: None,
        replies: Vec::new(),
        closed: false,
        error: None,
    };
    let connection = match ControlConnection::open(&socket) {
        Ok(connection) => connection,
        Err(e) => {
            line.error = Some(e.to_string());
            return line;
        }
    };
    match connection.recv("hello") {
        Ok(Some(hello)) => line.hello_hex = Some(mps_framing::hex(&hello.bytes)),
        Ok(None) => {
            line.closed = true;
            return line;
        }
        Err(e) => {
            line.error = Some(e.to_string());
            return line;
        }
    }
    let sent = connection
        .send_with_credentials(CREDENTIALS)
        .and_then(|()| connection.send_with_credentials(&mps_framing::kind_message(kind)));
    if let Err(e) = sent {
        line.error = Some(e.to_string());
    }
    let _ = connection
        .stream
        .set_read_timeout(Some(wait.max(Duration::from_millis(1))));
    loop {
        match control_connection::receive(&connection.stream) {
            Ok(Some(m)) => line.replies.push(RawReply {
                hex: mps_framing::hex(&m.bytes),
                // Counted, then closed with the message: a raw probe holds no channel.
                descriptors: m.descriptors.len() as u32,
            }),
            Ok(None) => {
                line.closed = true;
                return line;
            }
            Err(Errno::EAGAIN) => return line,
            Err(e) => {
                line.error = Some(format!("receive: {e:?}"));
                return line;
            }
        }
    }
}
