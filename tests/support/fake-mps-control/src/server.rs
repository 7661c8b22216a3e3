//! Fake MPS servers: real child processes (this binary run as `--fake-server`), so their pids
//! are real and `kill -0 <server pid>` works in tests. They do nothing; they exit when the
//! daemon stops them or when the daemon dies (their stdin, a pipe from the daemon, closes).

use std::fs::OpenOptions;
use std::io::Read;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, ExitCode, Stdio};

use nix::sys::signal::{SigSet, Signal};

use crate::state::{ServerLauncher, ServerProcess};

pub const FAKE_SERVER_FLAG: &str = "--fake-server";

/// Main of `fake-mps-control --fake-server --uid <uid>`.
pub fn run_fake_server(uid: &str) -> ExitCode {
    let mut signals = SigSet::empty();
    for s in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGHUP] {
        signals.add(s);
    }
    // Default actions: terminate.
    let _ = signals.thread_unblock();
    eprintln!(
        "FAKE nvidia-cuda-mps-server (gpu-mps test double; no GPU, no MPS): pid {} for user {uid}",
        std::process::id()
    );
    let mut sink = [0u8; 256];
    let mut stdin = std::io::stdin();
    // Returns at end of file: the daemon dropped its end of the pipe, or died.
    while matches!(stdin.read(&mut sink), Ok(n) if n > 0) {}
    ExitCode::SUCCESS
}

pub struct ProcessLauncher {
    pub exe: PathBuf,
    pub server_log: PathBuf,
}

impl ServerLauncher for ProcessLauncher {
    fn launch(&mut self, uid: u32) -> std::io::Result<Box<dyn ServerProcess>> {
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.server_log)?;
        let mut child = Command::new(&self.exe)
            .arg(FAKE_SERVER_FLAG)
            .arg("--uid")
            .arg(uid.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()?;
        let lifeline = child.stdin.take();
        Ok(Box::new(ChildServer { child, lifeline }))
    }
}

struct ChildServer {
    child: Child,
    /// Write end of the server's stdin: dropping it makes the server exit.
    lifeline: Option<ChildStdin>,
}

impl ServerProcess for ChildServer {
    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn has_exited(&mut self) -> bool {
        !matches!(self.child.try_wait(), Ok(None))
    }

    fn stop(&mut self) {
        self.lifeline = None;
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
