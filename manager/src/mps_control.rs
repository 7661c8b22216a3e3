//! Talking to `nvidia-cuda-mps-control`: starting a daemon, sending it commands, and reading
//! its answers.
//!
//! The control CLI exits 0 even when it rejects a command (measured on the H200, driver 580:
//! `set_default_active_thread_percentage 250` exits 0 and echoes the old value), so every
//! setting is verified by parsing the answer and reading the value back. The formats are listed
//! in docs/internals.md.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use async_trait::async_trait;
use gpu_mps_api::message::one_line;
use gpu_mps_api::{DaemonKey, Limits};
use thiserror::Error;
use tokio::io::AsyncWriteExt;
use tokio::process::Command;

pub use gpu_mps_api::mps_pipe_dir::{PID_FILE, read_pid_file};
/// The socket clients connect to, inside the pipe dir.
pub const CONTROL_SOCKET: &str = gpu_mps_api::node_config::GATE_SOCKET;

#[derive(Debug, Error)]
pub enum ControlError {
    #[error("cannot run {binary}: {source}")]
    Spawn { binary: String, source: std::io::Error },
    #[error("{binary} {command:?} did not answer within {seconds} s")]
    Timeout {
        binary: String,
        command: String,
        seconds: u64,
    },
    #[error("no MPS control daemon answers in {pipe_dir}: {output}")]
    NoDaemon { pipe_dir: String, output: String },
    #[error("starting the MPS control daemon for {key} failed: {reason}")]
    StartFailed { key: String, reason: String },
    #[error("MPS control daemon in {pipe_dir} rejected {command:?}: {answer:?}")]
    Rejected {
        pipe_dir: String,
        command: String,
        answer: String,
    },
    #[error("MPS control daemon in {pipe_dir}: {command:?} reads back {got:?}, expected {want}")]
    ReadBackMismatch {
        pipe_dir: String,
        command: String,
        got: String,
        want: String,
    },
}

/// The side effects of driving MPS, behind a trait so the manager's logic is tested without a
/// GPU and without processes.
#[async_trait]
pub trait MpsControl: Send + Sync {
    /// Starts `<binary> -d -M` for `key` and returns the control daemon's pid.
    async fn start_daemon(
        &self,
        key: &DaemonKey,
        pipe_dir: &Path,
        log_dir: &Path,
    ) -> Result<u32, ControlError>;
    /// Sends one command and returns the trimmed answer.
    async fn command(&self, pipe_dir: &Path, command: &str) -> Result<String, ControlError>;
}

/// Runs the real `nvidia-cuda-mps-control` (or the configured binary).
#[derive(Debug, Clone)]
pub struct CliControl {
    pub binary: PathBuf,
    pub timeout: Duration,
}

impl CliControl {
    fn binary_name(&self) -> String {
        self.binary.display().to_string()
    }

    fn base_command(&self, pipe_dir: &Path) -> Command {
        let mut cmd = Command::new(&self.binary);
        // The manager's own environment must not leak MPS settings into the daemon or the CLI.
        cmd.env_clear()
            .env(
                "PATH",
                std::env::var_os("PATH").unwrap_or_else(|| "/usr/sbin:/usr/bin:/sbin:/bin".into()),
            )
            .env("CUDA_MPS_PIPE_DIRECTORY", pipe_dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        if let Some(ld) = std::env::var_os("LD_LIBRARY_PATH") {
            cmd.env("LD_LIBRARY_PATH", ld);
        }
        cmd
    }
}

#[async_trait]
impl MpsControl for CliControl {
    async fn start_daemon(
        &self,
        key: &DaemonKey,
        pipe_dir: &Path,
        log_dir: &Path,
    ) -> Result<u32, ControlError> {
        let mut cmd = self.base_command(pipe_dir);
        cmd.arg("-d")
            .arg("-M")
            .env("CUDA_MPS_LOG_DIRECTORY", log_dir)
            .env("CUDA_VISIBLE_DEVICES", key.cuda_visible_devices())
            .stdin(Stdio::null());
        let start_failed = |reason: String| ControlError::StartFailed {
            key: key.to_string(),
            reason,
        };
        // `-d` forks the daemon and the parent exits once it is set up.
        let output = tokio::time::timeout(self.timeout, cmd.output())
            .await
            .map_err(|_| {
                start_failed(format!(
                    "{} -d did not return within {:?}",
                    self.binary_name(),
                    self.timeout
                ))
            })?
            .map_err(|source| ControlError::Spawn {
                binary: self.binary_name(),
                source,
            })?;
        if !output.status.success() {
            return Err(start_failed(format!(
                "{} -d exited with {}: {}",
                self.binary_name(),
                output.status,
                cli_output(
                    &String::from_utf8_lossy(&output.stderr),
                    &String::from_utf8_lossy(&output.stdout)
                )
            )));
        }
        let deadline = tokio::time::Instant::now() + self.timeout;
        loop {
            if let Some(pid) = read_pid_file(pipe_dir) {
                if pipe_dir.join(CONTROL_SOCKET).exists() && crate::process_identity::is_running(pid) {
                    return Ok(pid);
                }
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(start_failed(format!(
                    "no live daemon pid in {} after {:?}",
                    pipe_dir.join(PID_FILE).display(),
                    self.timeout
                )));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn command(&self, pipe_dir: &Path, command: &str) -> Result<String, ControlError> {
        let mut child = self
            .base_command(pipe_dir)
            .spawn()
            .map_err(|source| ControlError::Spawn {
                binary: self.binary_name(),
                source,
            })?;
        let timeout = || ControlError::Timeout {
            binary: self.binary_name(),
            command: command.to_string(),
            seconds: self.timeout.as_secs(),
        };
        let io = async {
            if let Some(mut stdin) = child.stdin.take() {
                // Without a daemon the CLI exits before reading stdin: a broken pipe here is
                // not the error, its exit status and output are.
                match stdin.write_all(format!("{command}\n").as_bytes()).await {
                    Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => return Err(e),
                    _ => {}
                }
            }
            child.wait_with_output().await
        };
        let output = tokio::time::timeout(self.timeout, io)
            .await
            .map_err(|_| timeout())?
            .map_err(|source| ControlError::Spawn {
                binary: self.binary_name(),
                source,
            })?;
        let stdout = String::from_utf8_lossy(&output.stdout).trim().to_string();
        if !output.status.success() {
            return Err(ControlError::NoDaemon {
                pipe_dir: pipe_dir.display().to_string(),
                output: cli_output(&String::from_utf8_lossy(&output.stderr), &stdout),
            });
        }
        Ok(stdout)
    }
}

/// The CLI's stderr, or its stdout when stderr is empty (it prints "Cannot find MPS control
/// daemon process" on stdout), as one line.
fn cli_output(stderr: &str, stdout: &str) -> String {
    one_line(if stderr.trim().is_empty() { stdout } else { stderr })
}

/// `get_server_list` / `get_client_list`: one pid per line.
pub fn parse_pid_list(answer: &str) -> Vec<u32> {
    answer.lines().filter_map(|l| l.trim().parse().ok()).collect()
}

/// A thread percentage answer: `25.0`.
pub fn parse_percentage(answer: &str) -> Option<f64> {
    answer.trim().parse().ok()
}

/// A pinned memory answer: `4G` (GiB), `3000M` (MiB), `512K`, or plain bytes. Returns bytes.
pub fn parse_memory(answer: &str) -> Option<u64> {
    let a = answer.trim();
    let (number, shift) = match a.char_indices().last()? {
        (i, 'G') => (&a[..i], 30),
        (i, 'M') => (&a[..i], 20),
        (i, 'K') => (&a[..i], 10),
        _ => (a, 0),
    };
    number.parse::<u64>().ok()?.checked_mul(1 << shift)
}

/// What `get_*_pinned_mem_limit` answers for a limit of `bytes` (whole MiB): from 1 GiB up it
/// prints whole GiB, rounded down (measured on the H200: `1040M` and `1960M` both read back as
/// `1G`, `1020M` as `1020M`, `4096M` as `4G`). So a read-back confirms the setting only to that
/// precision; the value sent is exact.
pub fn displayed_memory_bytes(bytes: u64) -> u64 {
    const GIB: u64 = 1 << 30;
    if bytes >= GIB { (bytes / GIB) * GIB } else { bytes }
}

/// An answer that says the command was not understood or the server does not exist.
fn is_refusal(answer: &str) -> bool {
    answer.starts_with("Unknown command") || (answer.starts_with("Server ") && answer.ends_with("not found"))
}

/// Where limits are set: as defaults for servers started later, or on a running server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    Defaults,
    Server(u32),
}

impl Target {
    fn threads_commands(self, pct: u8) -> (String, String) {
        match self {
            Target::Defaults => (
                format!("set_default_active_thread_percentage {pct}"),
                "get_default_active_thread_percentage".to_string(),
            ),
            Target::Server(pid) => (
                format!("set_active_thread_percentage {pid} {pct}"),
                format!("get_active_thread_percentage {pid}"),
            ),
        }
    }

    fn memory_commands(self, device: usize, value: &str) -> (String, String) {
        match self {
            Target::Defaults => (
                format!("set_default_device_pinned_mem_limit {device} {value}"),
                format!("get_default_device_pinned_mem_limit {device}"),
            ),
            Target::Server(pid) => (
                format!("set_device_pinned_mem_limit {pid} {device} {value}"),
                format!("get_device_pinned_mem_limit {pid} {device}"),
            ),
        }
    }
}

/// Sets `limits` on `target` for every device ordinal of the daemon (limits are set by
/// ORDINAL: a UUID is not validated by MPS and silently ignored when wrong), then reads each
/// value back and fails unless it matches.
pub async fn apply_limits(
    control: &dyn MpsControl,
    pipe_dir: &Path,
    target: Target,
    limits: Limits,
    device_count: usize,
) -> Result<(), ControlError> {
    let pipe = || pipe_dir.display().to_string();
    let (set, get) = target.threads_commands(limits.thread_percentage);
    let answer = control.command(pipe_dir, &set).await?;
    if is_refusal(&answer) {
        return Err(ControlError::Rejected {
            pipe_dir: pipe(),
            command: set,
            answer,
        });
    }
    let got = control.command(pipe_dir, &get).await?;
    if parse_percentage(&got) != Some(f64::from(limits.thread_percentage)) {
        return Err(ControlError::ReadBackMismatch {
            pipe_dir: pipe(),
            command: get,
            got,
            want: format!("{}.0", limits.thread_percentage),
        });
    }
    let value = limits.mps_memory_value();
    for device in 0..device_count.max(1) {
        let (set, get) = target.memory_commands(device, &value);
        let answer = control.command(pipe_dir, &set).await?;
        if is_refusal(&answer) || !answer.is_empty() {
            return Err(ControlError::Rejected {
                pipe_dir: pipe(),
                command: set,
                answer,
            });
        }
        let got = control.command(pipe_dir, &get).await?;
        if parse_memory(&got) != Some(displayed_memory_bytes(limits.effective_memory_bytes())) {
            return Err(ControlError::ReadBackMismatch {
                pipe_dir: pipe(),
                command: get,
                got,
                want: value.clone(),
            });
        }
    }
    Ok(())
}

/// The pids of the daemon's MPS servers.
pub async fn server_pids(control: &dyn MpsControl, pipe_dir: &Path) -> Result<Vec<u32>, ControlError> {
    Ok(parse_pid_list(
        &control.command(pipe_dir, "get_server_list").await?,
    ))
}

/// The pids of the clients of one server (host PID namespace).
pub async fn client_pids(
    control: &dyn MpsControl,
    pipe_dir: &Path,
    server: u32,
) -> Result<Vec<u32>, ControlError> {
    let answer = control
        .command(pipe_dir, &format!("get_client_list {server}"))
        .await?;
    if is_refusal(&answer) {
        return Ok(Vec::new());
    }
    Ok(parse_pid_list(&answer))
}

/// Sets limits as the defaults for new servers AND on every running server: a running server
/// keeps its own values, and new clients of it get the server's values, not the defaults.
pub async fn apply_limits_everywhere(
    control: &dyn MpsControl,
    pipe_dir: &Path,
    limits: Limits,
    device_count: usize,
) -> Result<Vec<u32>, ControlError> {
    apply_limits(control, pipe_dir, Target::Defaults, limits, device_count).await?;
    let listed = server_pids(control, pipe_dir).await?;
    let mut servers = Vec::with_capacity(listed.len());
    for server in listed {
        if let Err(e) = apply_limits(control, pipe_dir, Target::Server(server), limits, device_count).await {
            // A server that exited between the list and the setting (killed, or its last
            // client left) holds nothing any more: the next one starts from the defaults set
            // above.
            let gone = server_pids(control, pipe_dir)
                .await
                .is_ok_and(|now| !now.contains(&server));
            if gone {
                continue;
            }
            return Err(e);
        }
        servers.push(server);
    }
    Ok(servers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_measured_answers() {
        assert_eq!(parse_pid_list("607\n612\n"), vec![607, 612]);
        assert_eq!(parse_pid_list(""), Vec::<u32>::new());
        assert_eq!(parse_percentage("25.0"), Some(25.0));
        assert_eq!(parse_memory("4G"), Some(4 << 30));
        assert_eq!(parse_memory("8G"), Some(8 << 30));
        assert_eq!(parse_memory("3000M"), Some(3000 << 20));
        assert_eq!(parse_memory("0"), Some(0));
        assert_eq!(parse_memory("Server 1 not found"), None);
        // What MPS prints back for a limit (measured on the H200).
        for (set_mib, printed) in [
            (1020u64, "1020M"),
            (1040, "1G"),
            (1960, "1G"),
            (4096, "4G"),
            (5000, "4G"),
        ] {
            assert_eq!(
                parse_memory(printed),
                Some(displayed_memory_bytes(set_mib << 20)),
                "{set_mib}M reads back as {printed}"
            );
        }
        assert!(is_refusal("Unknown command \"bogus_command\""));
        assert!(is_refusal("Server 99999 not found"));
        assert!(!is_refusal("25.0"));
    }
}
