//! Client mode (no arguments): commands from stdin, one per line, answers on stdout exactly as
//! the real CLI prints them. Exit 1 only when no daemon answers, as the real one.

use std::io::{BufRead, Write};
use std::process::ExitCode;

use crate::paths::Paths;
use crate::protocol::{self, ANSWER_PREFIX, DAEMON_HELLO, UI_HELLO};

pub const NO_DAEMON: &str = "Cannot find MPS control daemon process";

pub fn run() -> ExitCode {
    let paths = Paths::from_env();
    let stream = match protocol::connect(&paths.control()) {
        Ok(stream) => stream,
        Err(_) => return no_daemon(),
    };
    // The daemon greets each connection once it gets to it (it serves one at a time).
    match protocol::recv_message(&stream) {
        Ok(Some(hello)) if hello == DAEMON_HELLO => {}
        _ => return no_daemon(),
    }
    if protocol::send_message(&stream, UI_HELLO).is_err() {
        return no_daemon();
    }
    let mut out = std::io::stdout().lock();
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let command = line.trim();
        if command.is_empty() {
            continue;
        }
        let answer = protocol::send_message(&stream, command).and_then(|()| protocol::recv_message(&stream));
        match answer {
            Ok(Some(answer)) => {
                let text = answer.strip_prefix(ANSWER_PREFIX).unwrap_or(&answer);
                let _ = out.write_all(text.as_bytes());
                let _ = out.flush();
            }
            Ok(None) | Err(_) => {
                eprintln!(
                    "fake-mps-control: the MPS control daemon closed the connection during {command:?}"
                );
                return ExitCode::FAILURE;
            }
        }
    }
    ExitCode::SUCCESS
}

fn no_daemon() -> ExitCode {
    // The probe log captured this on stdout.
    println!("{NO_DAEMON}");
    ExitCode::FAILURE
}
