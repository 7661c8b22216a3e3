//! `mps-processes --count N [--hold-seconds S]`: N CUDA client processes of one container
//! started at once, each this binary again as `mps-client --hold-seconds S`. The daemon tells
//! clients apart by the pid of their credentials, so they must be processes, not threads. The
//! line is printed once every child has printed its own, while they still hold their channels.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use gpu_mps_checker::{MpsClient, MpsProcesses};

/// The started children, to be waited for after the line is printed.
pub struct Children(Vec<Child>);

impl Children {
    /// Passes `signal` on to every child still running, then waits for them all.
    pub fn wait(mut self, signal: Option<nix::sys::signal::Signal>) {
        for child in &mut self.0 {
            if let Some(signal) = signal {
                let pid = nix::unistd::Pid::from_raw(child.id() as i32);
                let _ = nix::sys::signal::kill(pid, signal);
            }
            let _ = child.wait();
        }
    }
}

pub fn run(count: u32, hold_seconds: f64) -> (MpsProcesses, Children) {
    let mut line = MpsProcesses {
        count,
        hold_seconds,
        admitted: 0,
        refused: 0,
        direct_context: 0,
        failed: 0,
        children: Vec::new(),
        unreadable: Vec::new(),
    };
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => {
            line.failed = count;
            line.unreadable
                .push(format!("cannot find my own executable to start the clients: {e}"));
            return (line, Children(Vec::new()));
        }
    };
    let mut children = Vec::new();
    for _ in 0..count {
        let spawned = Command::new(&exe)
            .arg("mps-client")
            .arg(format!("--hold-seconds={hold_seconds}"))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn();
        match spawned {
            Ok(child) => children.push(child),
            Err(e) => line.unreadable.push(format!("cannot start a client: {e}")),
        }
    }
    for child in &mut children {
        let pid = child.id();
        let Some(stdout) = child.stdout.take() else {
            line.unreadable.push(format!("child {pid}: no stdout"));
            continue;
        };
        let mut first = String::new();
        match BufReader::new(stdout).read_line(&mut first) {
            Ok(_) => match serde_json::from_str::<MpsClient>(first.trim()) {
                Ok(client) => line.children.push(client),
                Err(e) => line
                    .unreadable
                    .push(format!("child {pid} printed {:?}: {e}", first.trim())),
            },
            Err(e) => line
                .unreadable
                .push(format!("child {pid}: reading its line: {e}")),
        }
    }
    for client in &line.children {
        match (client.admitted, client.refused, client.direct_context) {
            (true, _, _) => line.admitted += 1,
            (_, true, _) => line.refused += 1,
            (_, _, true) => line.direct_context += 1,
            _ => line.failed += 1,
        }
    }
    line.failed += line.unreadable.len() as u32;
    (line, Children(children))
}
