//! Finds the MPS server processes of a pipe dir, also those whose control daemon is gone.
//!
//! Measured on the H200 (docs/gpu-results.md, section 9): a server inherits
//! `CUDA_MPS_PIPE_DIRECTORY` from the control daemon that forked it, its argv[0] is
//! `nvidia-cuda-mps-server`, and it outlives a daemon killed with SIGKILL, re-parented. A new
//! daemon on the same pipe dir starts a server of its own beside it, and the old server's
//! clients fail ("the remote procedural call between the MPS server and the MPS client
//! failed"). Nothing else ever stops such a server: seen at ee40f89, one ran on after its
//! daemon, past every manager that followed. So the manager finds them by their environment.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

pub use gpu_mps_api::mps_pipe_dir::serves_pipe_dir;

const SERVER_BINARY: &str = "nvidia-cuda-mps-server";
const CONTROL_BINARY: &str = "nvidia-cuda-mps-control";

/// An MPS server process of a pipe dir.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerProcess {
    pub pid: u32,
    /// False when its parent is no MPS control daemon: the daemon that started it is gone.
    pub has_daemon: bool,
}

/// True if argv[0]'s file name is `binary`. `cmdline` is /proc/<pid>/cmdline (NUL-separated).
fn runs_binary(cmdline: &[u8], binary: &str) -> bool {
    let argv0 = cmdline.split(|b| *b == 0).next().unwrap_or_default();
    Path::new(OsStr::from_bytes(argv0)).file_name() == Some(OsStr::new(binary))
}

/// The server processes of `pipe_dir` running now. Processes whose environment cannot be read
/// (gone meanwhile, or another user's without privilege) are not counted.
pub fn servers_of(pipe_dir: &Path) -> Vec<ServerProcess> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| runs_binary(&c, SERVER_BINARY))
                && serves_pipe_dir(*pid, pipe_dir)
        })
        .map(|pid| ServerProcess {
            pid,
            has_daemon: crate::process_identity::parent_of(pid)
                .and_then(|parent| std::fs::read(format!("/proc/{parent}/cmdline")).ok())
                .is_some_and(|c| runs_binary(&c, CONTROL_BINARY)),
        })
        .collect()
}

/// Kills (SIGKILL) the servers of `pipe_dir` whose daemon is gone, and returns their pids.
pub fn kill_orphaned_servers(pipe_dir: &Path) -> Vec<u32> {
    let orphans: Vec<u32> = servers_of(pipe_dir)
        .into_iter()
        .filter(|s| !s.has_daemon)
        .map(|s| s.pid)
        .collect();
    for pid in &orphans {
        kill(*pid);
    }
    orphans
}

/// SIGKILL; a process gone meanwhile is not an error.
pub fn kill(pid: u32) {
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::{Child, Command};

    #[test]
    fn a_server_is_known_by_argv0() {
        assert!(runs_binary(b"/usr/bin/nvidia-cuda-mps-server\0", SERVER_BINARY));
        assert!(runs_binary(b"nvidia-cuda-mps-server\0\0", SERVER_BINARY));
        assert!(!runs_binary(b"nvidia-cuda-mps-control\0-d\0", SERVER_BINARY));
        assert!(!runs_binary(b"sh\0nvidia-cuda-mps-server\0", SERVER_BINARY));
        assert!(!runs_binary(b"", SERVER_BINARY));
    }

    /// A copy of `sleep` named like the server, started with `pipe_dir` in its environment.
    fn fake_server(bin_dir: &Path, pipe_dir: &Path) -> Child {
        let exe = bin_dir.join(SERVER_BINARY);
        if !exe.exists() {
            let sleep = ["/bin/sleep", "/usr/bin/sleep"]
                .into_iter()
                .find(|p| Path::new(p).exists())
                .unwrap();
            std::fs::copy(sleep, &exe).unwrap();
        }
        Command::new(&exe)
            .arg("600")
            .env("CUDA_MPS_PIPE_DIRECTORY", pipe_dir)
            .spawn()
            .unwrap()
    }

    #[test]
    fn orphaned_servers_of_one_pipe_dir_are_found_and_killed_and_no_other() {
        let tmp = tempfile::tempdir().unwrap();
        let ours = tmp.path().join("GPU-0/pipe");
        let theirs = tmp.path().join("GPU-1/pipe");
        let mut mine = fake_server(tmp.path(), &ours);
        let mut other = fake_server(tmp.path(), &theirs);
        let found = servers_of(&ours);
        // Its parent is this test, not an MPS control daemon: the daemon is "gone".
        assert_eq!(
            found,
            vec![ServerProcess {
                pid: mine.id(),
                has_daemon: false
            }]
        );
        assert_eq!(kill_orphaned_servers(&ours), vec![mine.id()]);
        assert!(!mine.wait().unwrap().success(), "killed");
        assert_eq!(servers_of(&theirs).len(), 1, "another dir's server is left alone");
        other.kill().unwrap();
        other.wait().unwrap();
    }
}
