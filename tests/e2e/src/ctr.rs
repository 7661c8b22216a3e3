//! `ctr` against a test's containerd: the path a person debugging a node takes
//! (`ctr run --runc-binary gpu-mps-shim ...`).

use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use anyhow::{Context, Result};

use crate::image::CHECKER_PATH;

/// The containerd namespace ctr uses here (ctr's own default).
pub const CTR_NAMESPACE: &str = "default";
/// How long one ctr command may take before the test fails.
pub const CTR_TIMEOUT: Duration = Duration::from_secs(60);

/// `ctr --address <socket> --namespace <ns>`.
#[derive(Debug, Clone)]
pub struct Ctr {
    binary: PathBuf,
    address: PathBuf,
    namespace: String,
    runc_root: PathBuf,
}

/// What a ctr command printed.
#[derive(Debug, Clone)]
pub struct CtrOutput {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl CtrOutput {
    /// stdout's last non-empty line: the checker prints one JSON line, after whatever else
    /// the container may print.
    pub fn last_line(&self) -> &str {
        self.stdout
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("")
    }
}

/// One `ctr run --rm --rootfs <rootfs> <id> /checker <args>`.
#[derive(Debug, Clone)]
pub struct CtrRun {
    pub id: String,
    pub rootfs: PathBuf,
    /// `--runc-binary`: gpu-mps-shim for the gpu-mps path, None for plain runc.
    pub runc_binary: Option<PathBuf>,
    pub env: Vec<(String, String)>,
    pub annotations: Vec<(String, String)>,
    /// `--mount` values, e.g. `type=bind,src=/x,dst=/y,options=rbind:ro`.
    pub mounts: Vec<String>,
    /// The checker's arguments, e.g. `["report"]`.
    pub args: Vec<String>,
}

impl CtrRun {
    /// `/checker <args>` in `rootfs`, through plain runc, with a unique container id.
    pub fn checker(id_prefix: &str, rootfs: &Path, args: &[&str]) -> CtrRun {
        CtrRun {
            id: unique_id(id_prefix),
            rootfs: rootfs.to_path_buf(),
            runc_binary: None,
            env: Vec::new(),
            annotations: Vec::new(),
            mounts: Vec::new(),
            args: args.iter().map(|a| a.to_string()).collect(),
        }
    }

    pub fn runc_binary(mut self, binary: &Path) -> CtrRun {
        self.runc_binary = Some(binary.to_path_buf());
        self
    }

    pub fn env(mut self, key: &str, value: &str) -> CtrRun {
        self.env.push((key.into(), value.into()));
        self
    }

    pub fn annotation(mut self, key: &str, value: &str) -> CtrRun {
        self.annotations.push((key.into(), value.into()));
        self
    }

    /// `gpu-mps.io/memory-limit` and `gpu-mps.io/active-thread-percentage` annotations.
    pub fn gpu_limits(self, memory: &str, thread_percentage: u8) -> CtrRun {
        use gpu_mps_api::annotations::{ACTIVE_THREAD_PERCENTAGE, MEMORY_LIMIT};
        self.annotation(MEMORY_LIMIT, memory)
            .annotation(ACTIVE_THREAD_PERCENTAGE, &thread_percentage.to_string())
    }

    /// `NVIDIA_VISIBLE_DEVICES=<gpu>`.
    pub fn gpu(self, gpu: &str) -> CtrRun {
        self.env(crate::cri::NVIDIA_VISIBLE_DEVICES, gpu)
    }

    pub fn mount(mut self, mount: &str) -> CtrRun {
        self.mounts.push(mount.into());
        self
    }
}

impl Ctr {
    pub fn new(binary: &Path, address: &Path, runc_root: &Path) -> Ctr {
        Ctr {
            binary: binary.to_path_buf(),
            address: address.to_path_buf(),
            namespace: CTR_NAMESPACE.into(),
            runc_root: runc_root.to_path_buf(),
        }
    }

    pub fn namespace(mut self, namespace: &str) -> Ctr {
        self.namespace = namespace.into();
        self
    }

    /// Any ctr command, e.g. `["images", "ls"]`.
    pub async fn command<S: AsRef<std::ffi::OsStr>>(&self, args: &[S]) -> Result<CtrOutput> {
        let mut command = tokio::process::Command::new(&self.binary);
        command
            .arg("--address")
            .arg(&self.address)
            .arg("--namespace")
            .arg(&self.namespace)
            .args(args)
            .env_remove("CONTAINERD_ADDRESS")
            .env_remove("CONTAINERD_NAMESPACE")
            .stdin(Stdio::null())
            .kill_on_drop(true);
        let rendered = format!(
            "ctr {}",
            args.iter()
                .map(|a| a.as_ref().to_string_lossy().into_owned())
                .collect::<Vec<_>>()
                .join(" ")
        );
        let out = tokio::time::timeout(CTR_TIMEOUT, command.output())
            .await
            .with_context(|| format!("{rendered} did not finish within {CTR_TIMEOUT:?}"))?
            .with_context(|| format!("running {rendered}"))?;
        Ok(CtrOutput {
            status: out.status,
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        })
    }

    /// `ctr run --rm --rootfs ...`: waits for the container to exit; its exit status is ctr's.
    pub async fn run(&self, run: &CtrRun) -> Result<CtrOutput> {
        let mut args: Vec<String> = vec!["run".into(), "--rm".into(), "--rootfs".into()];
        args.push("--runc-root".into());
        args.push(self.runc_root.display().to_string());
        if let Some(binary) = &run.runc_binary {
            args.push("--runc-binary".into());
            args.push(binary.display().to_string());
        }
        for (key, value) in &run.env {
            args.push("--env".into());
            args.push(format!("{key}={value}"));
        }
        for (key, value) in &run.annotations {
            args.push("--annotation".into());
            args.push(format!("{key}={value}"));
        }
        for mount in &run.mounts {
            args.push("--mount".into());
            args.push(mount.clone());
        }
        args.push(run.rootfs.display().to_string());
        args.push(run.id.clone());
        args.push(CHECKER_PATH.into());
        args.extend(run.args.iter().cloned());
        self.command(&args).await
    }
}

/// `<prefix>-<pid>-<n>`: unique within this host while the test runs (runc's root is private
/// to the test's containerd, containerd-shim sockets are not).
pub fn unique_id(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}
