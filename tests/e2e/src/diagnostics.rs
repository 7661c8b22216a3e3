//! What a failed test prints besides its error: the tails of the logs of the daemons it ran.
//!
//! Each test runs on its own thread with a current-thread runtime, so the daemons of one test
//! drop on that thread. A daemon records its log tail here when it is dropped; the runner
//! prints the records when the test body returns an error. When the body panics, the daemon
//! prints its tail itself during the unwind.

use std::cell::RefCell;

thread_local! {
    static TAILS: RefCell<Vec<LogTail>> = const { RefCell::new(Vec::new()) };
}

/// The last lines of one daemon's log.
#[derive(Debug, Clone)]
pub struct LogTail {
    pub title: String,
    pub text: String,
}

impl LogTail {
    pub fn print(&self) {
        eprintln!(
            "----- {} -----\n{}\n----- end of {} -----",
            self.title,
            self.text.trim_end(),
            self.title
        );
    }
}

/// Lines kept from each log.
pub const TAIL_LINES: usize = 60;

/// The last `lines` lines of a log file, or why it could not be read.
pub fn tail_of(path: &std::path::Path, lines: usize) -> String {
    match std::fs::read(path) {
        Ok(bytes) => {
            let text = String::from_utf8_lossy(&bytes);
            let all: Vec<&str> = text.lines().collect();
            all[all.len().saturating_sub(lines)..].join("\n")
        }
        Err(e) => format!("({}: {e})", path.display()),
    }
}

/// Called by a daemon's Drop: prints now when the test is panicking, else keeps the tail
/// for the runner.
pub fn record(tail: LogTail) {
    if std::thread::panicking() {
        tail.print();
    }
    TAILS.with(|t| t.borrow_mut().push(tail));
}

/// Forget the records of an earlier test on this thread.
pub fn reset() {
    TAILS.with(|t| t.borrow_mut().clear());
}

/// Print every log tail recorded on this thread since [`reset`].
pub fn print_recorded() {
    TAILS.with(|t| t.borrow().iter().for_each(LogTail::print));
}
