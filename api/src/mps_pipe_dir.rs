//! Which MPS control daemon runs from a pipe dir: the pid its pid file names, and whether that
//! process is still the pipe dir's daemon. The manager asks it to adopt or stop its daemons,
//! `gpu-mps node remove-state` to refuse removing a root a daemon still runs from.

use std::ffi::OsStr;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// File the control daemon writes its pid to, inside its pipe dir.
pub const PID_FILE: &str = "nvidia-cuda-mps-control.pid";
const PIPE_DIR_VAR: &[u8] = b"CUDA_MPS_PIPE_DIRECTORY=";

/// Reads the control daemon's pid from its pipe dir; `None` when there is no file or no pid in
/// it.
pub fn read_pid_file(pipe_dir: &Path) -> Option<u32> {
    std::fs::read_to_string(pipe_dir.join(PID_FILE))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// True if `environ` (/proc/<pid>/environ, NUL-separated) names exactly `pipe_dir`.
pub fn names_pipe_dir(environ: &[u8], pipe_dir: &Path) -> bool {
    environ
        .split(|b| *b == 0)
        .filter_map(|var| var.strip_prefix(PIPE_DIR_VAR))
        .any(|value| Path::new(OsStr::from_bytes(value)) == pipe_dir)
}

/// Whether process `pid` runs with `CUDA_MPS_PIPE_DIRECTORY=<pipe_dir>`, as every MPS control
/// daemon the manager starts does: a pid file can name a pid the kernel has since given to an
/// unrelated process, which the manager must never signal. `pipe_dir` is the path as that
/// process sees it (the host's). An error when its environment cannot be read: gone meanwhile
/// (NotFound), or another user's without the privilege to read it.
pub fn process_names_pipe_dir(pid: u32, pipe_dir: &Path) -> io::Result<bool> {
    std::fs::read(format!("/proc/{pid}/environ")).map(|environ| names_pipe_dir(&environ, pipe_dir))
}

/// True if process `pid` is the MPS control daemon of `pipe_dir` (see
/// [`process_names_pipe_dir`]); a process whose environment cannot be read is not.
pub fn serves_pipe_dir(pid: u32, pipe_dir: &Path) -> bool {
    process_names_pipe_dir(pid, pipe_dir).unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pipe_dir_is_known_by_its_variable_exactly() {
        let dir = Path::new("/run/gpu-mps/daemons/GPU-1/pipe");
        assert!(names_pipe_dir(
            b"PATH=/bin\0CUDA_MPS_PIPE_DIRECTORY=/run/gpu-mps/daemons/GPU-1/pipe\0",
            dir
        ));
        // A trailing slash names the same dir; a longer path or another variable does not.
        assert!(names_pipe_dir(
            b"CUDA_MPS_PIPE_DIRECTORY=/run/gpu-mps/daemons/GPU-1/pipe/\0",
            dir
        ));
        assert!(!names_pipe_dir(
            b"CUDA_MPS_PIPE_DIRECTORY=/run/gpu-mps/daemons/GPU-10/pipe\0",
            dir
        ));
        assert!(!names_pipe_dir(
            b"CUDA_MPS_LOG_DIRECTORY=/run/gpu-mps/daemons/GPU-1/pipe\0",
            dir
        ));
        assert!(!names_pipe_dir(
            b"XCUDA_MPS_PIPE_DIRECTORY=/run/gpu-mps/daemons/GPU-1/pipe\0",
            dir
        ));
    }

    #[test]
    fn a_process_serves_the_pipe_dir_of_its_environment() {
        let dir = tempfile::tempdir().unwrap();
        let pipe_dir = dir.path().join("pipe");
        let mut child = std::process::Command::new("sleep")
            .arg("60")
            .env("CUDA_MPS_PIPE_DIRECTORY", &pipe_dir)
            .spawn()
            .unwrap();
        std::fs::create_dir(&pipe_dir).unwrap();
        assert_eq!(read_pid_file(&pipe_dir), None);
        std::fs::write(pipe_dir.join(PID_FILE), format!("{}\n", child.id())).unwrap();
        assert_eq!(read_pid_file(&pipe_dir), Some(child.id()));
        assert!(serves_pipe_dir(child.id(), &pipe_dir));
        assert!(!serves_pipe_dir(child.id(), &dir.path().join("other")));
        assert!(!serves_pipe_dir(std::process::id(), &pipe_dir));
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(
            process_names_pipe_dir(child.id(), &pipe_dir).unwrap_err().kind(),
            io::ErrorKind::NotFound
        );
    }
}
