//! Where the daemon's files live: the same names as the real `nvidia-cuda-mps-control`
//! (listing of a real pipe dir in docs/gpu-runs/2026-12-03-probe.log).

use std::path::{Path, PathBuf};

pub const PIPE_DIR_ENV: &str = "CUDA_MPS_PIPE_DIRECTORY";
pub const LOG_DIR_ENV: &str = "CUDA_MPS_LOG_DIRECTORY";
pub const DEFAULT_PIPE_DIR: &str = "/tmp/nvidia-mps";
pub const DEFAULT_LOG_DIR: &str = "/var/log/nvidia-mps";

#[derive(Debug, Clone)]
pub struct Paths {
    pub pipe_dir: PathBuf,
    pub log_dir: PathBuf,
}

impl Paths {
    /// From CUDA_MPS_PIPE_DIRECTORY / CUDA_MPS_LOG_DIRECTORY (unset or empty: the defaults),
    /// made absolute because the daemon changes its directory to `/`.
    pub fn from_env() -> Paths {
        Paths {
            pipe_dir: dir_from_env(PIPE_DIR_ENV, DEFAULT_PIPE_DIR),
            log_dir: dir_from_env(LOG_DIR_ENV, DEFAULT_LOG_DIR),
        }
    }

    /// The socket clients and the control CLI connect to.
    pub fn control(&self) -> PathBuf {
        self.pipe_dir.join("control")
    }

    pub fn control_privileged(&self) -> PathBuf {
        self.pipe_dir.join("control_privileged")
    }

    /// Empty file; the daemon holds a `flock` on it while it runs, so a second daemon for the
    /// same pipe dir can tell a live owner from stale files.
    pub fn control_lock(&self) -> PathBuf {
        self.pipe_dir.join("control_lock")
    }

    pub fn pid_file(&self) -> PathBuf {
        self.pipe_dir.join("nvidia-cuda-mps-control.pid")
    }

    /// The real daemon keeps a FIFO named `log` in the pipe dir; the fake creates it and never
    /// reads it.
    pub fn log_fifo(&self) -> PathBuf {
        self.pipe_dir.join("log")
    }

    pub fn control_log(&self) -> PathBuf {
        self.log_dir.join("control.log")
    }

    pub fn server_log(&self) -> PathBuf {
        self.log_dir.join("server.log")
    }
}

fn dir_from_env(var: &str, default: &str) -> PathBuf {
    let dir = match std::env::var_os(var) {
        Some(v) if !v.is_empty() => PathBuf::from(v),
        _ => PathBuf::from(default),
    };
    absolute(&dir)
}

fn absolute(dir: &Path) -> PathBuf {
    if dir.is_absolute() {
        return dir.to_path_buf();
    }
    std::env::current_dir()
        .map(|cwd| cwd.join(dir))
        .unwrap_or_else(|_| dir.to_path_buf())
}
