//! Fatal GPU faults on an MPS server, read from its server.log.
//!
//! Measured on the H200 (docs/gpu-results.md, faults): one client's illegal memory access makes
//! the server tear down EVERY client it serves; the server itself stays up and accepts new
//! clients. MPS says so only in server.log ("All clients belonging to error trigging process
//! <pid> will be torn down"), so the manager follows that file and reports each fault.

use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

/// What MPS writes when it tears a server's clients down after a fatal fault.
const FAULT_MARKER: &str = "All clients belonging to error trigging process ";

/// The pids MPS tears down after a fatal fault, from new server.log text. MPS calls each of them
/// "error trigging", the faulting client and its neighbours alike.
pub fn fault_pids(log_text: &str) -> Vec<u32> {
    log_text
        .lines()
        .filter_map(|l| l.split_once(FAULT_MARKER))
        .filter_map(|(_, rest)| rest.split_whitespace().next()?.parse().ok())
        .collect()
}

/// Follows one file from an offset: what was appended since the last read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LogCursor {
    pub offset: u64,
}

impl LogCursor {
    /// A cursor at the current end of `path`: faults logged before the manager started (or
    /// restarted) were reported by the manager that saw them.
    pub fn at_end(path: &Path) -> LogCursor {
        LogCursor {
            offset: std::fs::metadata(path).map(|m| m.len()).unwrap_or(0),
        }
    }

    /// The complete lines appended since the last read; a file that shrank (a new daemon, a new
    /// log) is read from its start.
    pub fn read_new(&mut self, path: &Path) -> String {
        self.read_new_at_most(path, READ_CAP)
    }

    fn read_new_at_most(&mut self, path: &Path, cap: usize) -> String {
        let Ok(mut file) = std::fs::File::open(path) else {
            return String::new();
        };
        let len = file.metadata().map(|m| m.len()).unwrap_or(0);
        if len < self.offset {
            self.offset = 0;
        }
        let mut chunk = Vec::new();
        if file.seek(SeekFrom::Start(self.offset)).is_ok() {
            let _ = file.by_ref().take(cap as u64).read_to_end(&mut chunk);
        }
        let taken = complete_lines(&chunk, chunk.len() >= cap);
        self.offset += taken as u64;
        // Lossy: one byte that is not UTF-8 must not stop the cursor for good.
        String::from_utf8_lossy(&chunk[..taken]).into_owned()
    }
}

/// Longest one read takes: a flood of log lines must not stall the reconciler.
const READ_CAP: usize = 1 << 20;

/// How much of a chunk read from the cursor to take: up to its last newline, so a line MPS is
/// still writing (or one cut by the cap) is read whole next time. A full chunk without any
/// newline is one line longer than the cap: it is taken whole, or the cursor would never move.
fn complete_lines(chunk: &[u8], full: bool) -> usize {
    match chunk.iter().rposition(|b| *b == b'\n') {
        Some(last) => last + 1,
        None if full => chunk.len(),
        None => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Lines as the H200's server.log had them (docs/gpu-runs/2026-12-03-e6ff867).
    const LOG: &str = "[2026-12-03 09:37:50.889 Server 15871] All clients belonging to error trigging process 16886 will be torn down
[2026-12-03 09:37:50.889 Server 15871] Client {PID: 16886, Context ID: 1} on the error-trigging process 16886 to be torn down
[2026-12-03 09:37:50.927 Server 15871] Client {PID: 16873, Context ID: 1} exiting. Number of active client contexts is 3.
";

    #[test]
    fn finds_the_faulting_pids() {
        assert_eq!(fault_pids(LOG), vec![16886]);
        assert!(fault_pids("[..] Client {PID: 1, Context ID: 0} connected").is_empty());
    }

    #[test]
    fn reads_only_what_was_appended() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("server.log");
        std::fs::write(&path, "old line\n").unwrap();
        let mut cursor = LogCursor::at_end(&path);
        assert_eq!(cursor.read_new(&path), "");
        std::fs::write(&path, format!("old line\n{LOG}")).unwrap();
        assert_eq!(fault_pids(&cursor.read_new(&path)), vec![16886]);
        assert_eq!(cursor.read_new(&path), "");
        std::fs::write(&path, "new daemon\n").unwrap();
        assert_eq!(
            cursor.read_new(&path),
            "new daemon\n",
            "a shorter file is read from its start"
        );
    }

    #[test]
    fn a_byte_that_is_not_utf8_does_not_stop_the_cursor() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("server.log");
        let mut bytes = b"[..] garbled \xff\xfe line\n".to_vec();
        bytes.extend_from_slice(LOG.as_bytes());
        std::fs::write(&path, &bytes).unwrap();
        let mut cursor = LogCursor::default();
        let text = cursor.read_new(&path);
        assert_eq!(fault_pids(&text), vec![16886], "{text}");
        assert_eq!(cursor.offset, bytes.len() as u64);
    }

    #[test]
    fn a_line_cut_by_the_cap_or_still_being_written_is_read_whole_next_time() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("server.log");
        let first = LOG.lines().next().unwrap();
        // A line still being written: nothing is taken yet.
        std::fs::write(&path, &first[..40]).unwrap();
        let mut cursor = LogCursor::default();
        assert_eq!(cursor.read_new(&path), "");
        std::fs::write(&path, format!("{first}\n")).unwrap();
        assert_eq!(fault_pids(&cursor.read_new(&path)), vec![16886]);
        // A cap that cuts the second line: it comes whole with the next read.
        let text = format!("short\n{first}\n");
        std::fs::write(&path, &text).unwrap();
        let mut cursor = LogCursor::default();
        assert_eq!(cursor.read_new_at_most(&path, 20), "short\n");
        assert_eq!(fault_pids(&cursor.read_new_at_most(&path, 4096)), vec![16886]);
        // One line longer than the cap is skipped, not read forever.
        std::fs::write(&path, "x".repeat(64)).unwrap();
        let mut cursor = LogCursor::default();
        assert_eq!(cursor.read_new_at_most(&path, 16).len(), 16);
        assert_eq!(cursor.offset, 16);
    }
}
