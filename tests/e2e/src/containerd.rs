//! A private containerd per test: its own root, state, socket, config and runc root, so tests
//! run in parallel and leave nothing behind.

use std::fmt::Write as _;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::cri::CriClient;
use crate::ctr::Ctr;
use crate::diagnostics::{self, LogTail, TAIL_LINES};
use crate::image;
use crate::processes;
use crate::suites::Suite;
use crate::workdir::WorkDir;

/// The CRI runtime handler that runs containers through gpu-mps-shim.
pub const GPU_MPS_HANDLER: &str = "gpu-mps";
/// The default CRI runtime handler: plain runc.
pub const RUNC_HANDLER: &str = "runc";
/// The containerd namespace of the CRI plugin.
pub const CRI_NAMESPACE: &str = "k8s.io";
/// Annotations the gpu-mps handler passes from the pod and the container to the OCI spec.
pub use gpu_mps_api::annotations::{CONTAINER_ANNOTATION_PATTERNS, POD_ANNOTATION_PATTERNS};
const START_TIMEOUT: Duration = Duration::from_secs(30);
const CRI_READY_TIMEOUT: Duration = Duration::from_secs(20);

/// What a test needs from its containerd beyond the defaults.
#[derive(Debug, Clone, Default)]
pub struct ContainerdOptions {
    /// Passed to containerd as GPU_MPS_CONFIG; the runc shims it starts, and so gpu-mps-shim
    /// and gpu-mps-hook, inherit it.
    pub gpu_mps_config: Option<PathBuf>,
    /// Registers the `gpu-mps` CRI runtime handler with this binary as the runc binary.
    pub gpu_mps_shim: Option<PathBuf>,
    pub cdi: CdiOptions,
    /// Runs containerd (and so its shims and containers) in a mount namespace of its own whose
    /// `/` is shared, as on a systemd host. A CRI mount of a host path with HostToContainer
    /// propagation needs that (containerd refuses a private source), and the test host's `/`
    /// may be private; the host's own mounts are never changed.
    pub shared_root_namespace: bool,
}

/// What the CRI plugin does with CDI devices (`cdi.k8s.io/*` annotations): containerd 1.7 and
/// 2.x resolve them against the CDI specs in their spec dirs when CDI is on, and fail
/// CreateContainer for a device no spec names; 1.6 has no CDI. The spec dir is always the
/// test's own: a test containerd never reads the host's /etc/cdi or /var/run/cdi.
#[derive(Debug, Clone, Default)]
pub struct CdiOptions {
    /// `enable_cdi`; None keeps containerd's default (1.7: off, 2.x: on).
    pub enabled: Option<bool>,
    /// CDI spec files for the spec dir: (file name, content).
    pub specs: Vec<(String, String)>,
}

/// How containerd stores image layers here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Snapshotter {
    Overlayfs,
    /// Only where overlayfs does not work (e.g. a temp dir that is itself on overlayfs).
    Native,
}

impl Snapshotter {
    pub fn name(self) -> &'static str {
        match self {
            Snapshotter::Overlayfs => "overlayfs",
            Snapshotter::Native => "native",
        }
    }
}

/// A running containerd; killed, with its containers, on drop.
#[derive(Debug)]
pub struct Containerd {
    suite: Suite,
    child: Option<Child>,
    /// containerd's command line and environment, to start it again ([`Containerd::restart`]).
    launch: Launch,
    socket: PathBuf,
    state: PathBuf,
    runc_root: PathBuf,
    log: PathBuf,
    snapshotter: Snapshotter,
    /// Gone after containerd and its shims.
    mount_namespace: Option<MountNamespace>,
    // Last: removed once containerd and its containers are gone.
    dir: WorkDir,
}

impl Containerd {
    /// Starts containerd of `suite` and waits for its socket.
    pub async fn start(suite: &Suite, options: ContainerdOptions) -> Result<Containerd> {
        let dir = WorkDir::new("gme2e-ctd.")?;
        let snapshotter = snapshotter();
        let layout = Layout::new(&dir);
        for d in [
            &layout.root,
            &layout.state,
            &layout.runc_root,
            &layout.cni_conf,
            &layout.cni_bin,
            &layout.path_dir,
            &layout.cdi_dir,
        ] {
            std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
        }
        // containerd-shim-runc-v2 runs the first `runc` on its PATH: the chosen one, never the
        // suite's own when that does not run here.
        symlink(&suite.runc, layout.path_dir.join("runc")).context("linking the chosen runc")?;
        for (name, content) in &options.cdi.specs {
            let path = layout.cdi_dir.join(name);
            std::fs::write(&path, content).with_context(|| format!("writing {}", path.display()))?;
        }
        let config = match suite.config_version() {
            3 => config_v3(&layout, snapshotter, &options),
            _ => config_v2(&layout, snapshotter, &options, suite.has_cdi()),
        };
        std::fs::write(&layout.config, config).context("writing containerd's config")?;

        let path = format!(
            "{}:{}:{}",
            layout.path_dir.display(),
            suite.bin_dir.display(),
            std::env::var("PATH").unwrap_or_else(|_| "/usr/sbin:/usr/bin:/sbin:/bin".into())
        );
        std::fs::File::create(&layout.log).context("creating containerd's log")?;
        let mount_namespace = match options.shared_root_namespace {
            true => Some(MountNamespace::new().await?),
            false => None,
        };
        let launch = Launch {
            mount_namespace: mount_namespace.as_ref().map(MountNamespace::path),
            containerd: suite.containerd.clone(),
            config: layout.config.clone(),
            path,
            gpu_mps_config: options.gpu_mps_config.clone(),
            log: layout.log.clone(),
        };
        let child = launch.spawn()?;
        println!(
            "started {} at {} (snapshotter {}, runc {})",
            suite.containerd_version,
            layout.socket.display(),
            snapshotter.name(),
            suite.runc.display()
        );
        let mut containerd = Containerd {
            suite: suite.clone(),
            child: Some(child),
            launch,
            socket: layout.socket,
            state: layout.state,
            runc_root: layout.runc_root,
            log: layout.log,
            snapshotter,
            mount_namespace,
            dir,
        };
        containerd.wait_for_socket().await?;
        Ok(containerd)
    }

    /// Stops containerd (SIGTERM, as systemd does) and starts it again on the same config, root
    /// and state: its containers run on in their shims meanwhile. A CRI client must reconnect.
    pub async fn restart(&mut self) -> Result<()> {
        if let Some(mut child) = self.child.take() {
            crate::processes::stop_child(&mut child, Duration::from_secs(10));
        }
        self.child = Some(self.launch.spawn()?);
        self.wait_for_socket().await
    }

    async fn wait_for_socket(&mut self) -> Result<()> {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if std::os::unix::net::UnixStream::connect(&self.socket).is_ok() {
                return Ok(());
            }
            if let Some(child) = self.child.as_mut() {
                if let Some(status) = child.try_wait()? {
                    bail!(
                        "containerd exited ({status}) before serving {}; its log:\n{}",
                        self.socket.display(),
                        diagnostics::tail_of(&self.log, TAIL_LINES)
                    );
                }
            }
            if Instant::now() > deadline {
                bail!(
                    "containerd did not serve {} within {START_TIMEOUT:?}",
                    self.socket.display()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn suite(&self) -> &Suite {
        &self.suite
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    pub fn snapshotter(&self) -> Snapshotter {
        self.snapshotter
    }

    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// containerd's main config file (`--config`).
    pub fn config_path(&self) -> &Path {
        &self.launch.config
    }

    /// The pid of the containerd process now serving.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The runc root of every container of this containerd (CRI and ctr alike).
    pub fn runc_root(&self) -> &Path {
        &self.runc_root
    }

    /// This test's private directory (containerd's own files live in it too).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The one CDI spec dir this containerd reads (1.7, 2.x), as Layout names it.
    pub fn cdi_dir(&self) -> PathBuf {
        Layout::new(&self.dir).cdi_dir
    }

    pub fn log_tail(&self, lines: usize) -> String {
        diagnostics::tail_of(&self.log, lines)
    }

    /// A `ctr` bound to this containerd.
    pub fn ctr(&self) -> Ctr {
        Ctr::new(&self.suite.ctr, &self.socket, &self.runc_root)
    }

    /// A CRI client, once the CRI plugin answers (it starts after the socket is up).
    pub async fn cri(&self) -> Result<CriClient> {
        let deadline = Instant::now() + CRI_READY_TIMEOUT;
        loop {
            let attempt = async {
                let mut client = CriClient::connect(&self.socket, self.dir.join("pods")).await?;
                client.version().await?;
                anyhow::Ok(client)
            };
            match attempt.await {
                Ok(client) => return Ok(client),
                Err(e) if Instant::now() > deadline => {
                    return Err(e.context(format!(
                        "the CRI plugin did not answer within {CRI_READY_TIMEOUT:?}"
                    )));
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }

    /// Imports the test image (built around `checker`) into the CRI namespace, unpacked for
    /// this containerd's snapshotter. Returns its name.
    pub async fn import_test_image(&self, checker: &Path) -> Result<&'static str> {
        let archive = self.dir.join("test-image.oci.tar");
        std::fs::write(&archive, test_image_archive(checker)?).context("writing the test image")?;
        self.import_image_archive(&archive).await?;
        Ok(image::TEST_IMAGE)
    }

    /// `ctr -n k8s.io images import` of an OCI archive, unpacked for this containerd's
    /// snapshotter, as `ctr` names it (from the archive's index annotations).
    pub async fn import_image_archive(&self, archive: &Path) -> Result<()> {
        let mut args: Vec<String> = vec!["images".into(), "import".into()];
        if self.suite.containerd_major >= 2 {
            // 2.x imports through the transfer service by default, which unpacks with its own
            // config; --local unpacks with the snapshotter named here, as 1.x does.
            args.push("--local".into());
        }
        args.extend([
            "--snapshotter".into(),
            self.snapshotter.name().into(),
            archive.display().to_string(),
        ]);
        let out = self.ctr().namespace(CRI_NAMESPACE).command(&args).await?;
        if !out.status.success() {
            bail!(
                "ctr images import failed ({}): {}{}",
                out.status,
                out.stdout,
                out.stderr
            );
        }
        Ok(())
    }

    /// A plain rootfs directory holding the test image's files, for `ctr run --rootfs`.
    pub fn test_rootfs(&self, checker: &Path) -> Result<PathBuf> {
        let rootfs = self.dir.join("rootfs");
        if !rootfs.join("checker").exists() {
            image::write_rootfs(checker, &rootfs)?;
        }
        Ok(rootfs)
    }

    /// Host pids of the init processes of this containerd's containers, from runc's state.
    pub fn container_pids(&self) -> Vec<u32> {
        runc_containers(&self.runc_root).iter().map(|c| c.pid).collect()
    }

    /// The host pid of a container's init process, from runc's state; None before runc
    /// created it or after it was deleted. `namespace`: [`CRI_NAMESPACE`] for CRI containers,
    /// "default" for ctr's.
    pub fn container_pid(&self, namespace: &str, id: &str) -> Option<u32> {
        runc_state(&self.runc_root.join(namespace).join(id)).map(|c| c.pid)
    }

    /// The OCI spec of a container as runc got it: its bundle's config.json, after
    /// gpu-mps-shim rewrote it. `namespace` as for [`Containerd::container_pid`].
    pub fn bundle_spec(&self, namespace: &str, id: &str) -> Result<serde_json::Value> {
        let path = self
            .state
            .join("io.containerd.runtime.v2.task")
            .join(namespace)
            .join(id)
            .join("config.json");
        let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
    }

    /// The containerd-shim processes serving this containerd.
    pub fn shim_pids(&self) -> Vec<u32> {
        shims_of(&self.socket)
    }

    /// The sockets its shims listen on (under a host-wide directory).
    pub fn shim_sockets(&self) -> Vec<PathBuf> {
        shim_sockets(&self.state)
    }

    /// Kills every container of this containerd (through runc's state, so it works whether or
    /// not containerd still answers), containerd, and its shims; removes the cgroups runc made.
    fn shut_down(&mut self) {
        let containers = runc_containers(&self.runc_root);
        let pids: Vec<u32> = containers.iter().map(|c| c.pid).collect();
        pids.iter().for_each(|pid| processes::kill_hard(*pid));
        processes::wait_gone(&pids, Duration::from_secs(3));
        if let Some(mut child) = self.child.take() {
            processes::stop_child(&mut child, Duration::from_secs(5));
        }
        let shims = shims_of(&self.socket);
        let shim_sockets = shim_sockets(&self.state);
        shims.iter().for_each(|pid| processes::kill_hard(*pid));
        processes::wait_gone(&shims, Duration::from_secs(3));
        // Its mounts go with the last process in it.
        self.mount_namespace.take();
        // A killed shim leaves its socket (in a host-wide directory) behind.
        for socket in shim_sockets {
            let _ = std::fs::remove_file(socket);
        }
        // A killed task leaves its cgroup a moment after it is gone from /proc: retry EBUSY
        // briefly. A cgroup still in use after that (or already gone) is left alone.
        let deadline = Instant::now() + Duration::from_secs(2);
        for cgroup in containers.iter().flat_map(|c| &c.cgroups) {
            while let Err(e) = std::fs::remove_dir(cgroup) {
                if e.raw_os_error() != Some(nix::errno::Errno::EBUSY as i32) || Instant::now() > deadline {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        self.shut_down();
        diagnostics::record(LogTail {
            title: format!("containerd log ({}, {})", self.suite.name, self.log.display()),
            text: self.log_tail(TAIL_LINES),
        });
        self.dir.unmount_all();
    }
}

/// How a test's containerd is started.
#[derive(Debug, Clone)]
struct Launch {
    containerd: PathBuf,
    config: PathBuf,
    /// PATH: the chosen runc first, then the suite's binaries.
    path: String,
    gpu_mps_config: Option<PathBuf>,
    /// Appended to: a restarted containerd logs after the first.
    log: PathBuf,
    /// `/proc/<pid>/ns/mnt` to enter first (a restarted containerd enters the same one).
    mount_namespace: Option<PathBuf>,
}

impl Launch {
    fn spawn(&self) -> Result<Child> {
        let log = std::fs::OpenOptions::new()
            .append(true)
            .open(&self.log)
            .context("opening containerd's log")?;
        // nsenter execs containerd in place: the child is containerd itself.
        let mut command = match &self.mount_namespace {
            Some(namespace) => {
                let mut nsenter = Command::new("nsenter");
                nsenter
                    .arg(format!("--mount={}", namespace.display()))
                    .arg("--")
                    .arg(&self.containerd);
                nsenter
            }
            None => Command::new(&self.containerd),
        };
        command
            .arg("--config")
            .arg(&self.config)
            .env("PATH", &self.path)
            .env_remove("CONTAINERD_ADDRESS")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        match &self.gpu_mps_config {
            Some(config) => command.env(gpu_mps_api::node_config::CONFIG_ENV, config),
            None => command.env_remove(gpu_mps_api::node_config::CONFIG_ENV),
        };
        command
            .spawn()
            .with_context(|| format!("starting {}", self.containerd.display()))
    }
}

/// A mount namespace whose `/` is shared (a fresh peer group, so nothing propagates to or from
/// the host's), held open by a sleeping process until dropped.
#[derive(Debug)]
struct MountNamespace {
    holder: Child,
}

impl MountNamespace {
    async fn new() -> Result<MountNamespace> {
        let holder = Command::new("unshare")
            .args(["--mount", "--propagation", "private", "--", "sh", "-c"])
            .arg("mount --make-rshared / && exec sleep infinity")
            .stdin(Stdio::null())
            .spawn()
            .context("starting unshare (util-linux) for containerd's mount namespace")?;
        let mut namespace = MountNamespace { holder };
        let mountinfo = format!("/proc/{}/mountinfo", namespace.holder.id());
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let text = std::fs::read_to_string(&mountinfo).unwrap_or_default();
            let root_shared = text
                .lines()
                .any(|l| l.split(' ').nth(4) == Some("/") && l.contains(" shared:"));
            if root_shared {
                return Ok(namespace);
            }
            if let Some(status) = namespace.holder.try_wait()? {
                bail!("unshare --mount exited ({status}) before / was shared in its namespace");
            }
            if Instant::now() > deadline {
                bail!("/ was not shared in containerd's mount namespace within {START_TIMEOUT:?}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn path(&self) -> PathBuf {
        PathBuf::from(format!("/proc/{}/ns/mnt", self.holder.id()))
    }
}

impl Drop for MountNamespace {
    fn drop(&mut self) {
        let _ = self.holder.kill();
        let _ = self.holder.wait();
    }
}

/// Paths inside a containerd's private directory.
struct Layout {
    root: PathBuf,
    state: PathBuf,
    socket: PathBuf,
    config: PathBuf,
    runc_root: PathBuf,
    cni_conf: PathBuf,
    cni_bin: PathBuf,
    /// Put first on containerd's PATH; holds only `runc`.
    path_dir: PathBuf,
    /// The only CDI spec dir (1.7, 2.x).
    cdi_dir: PathBuf,
    log: PathBuf,
}

impl Layout {
    fn new(dir: &WorkDir) -> Layout {
        Layout {
            root: dir.join("root"),
            state: dir.join("state"),
            socket: dir.join("containerd.sock"),
            config: dir.join("containerd.toml"),
            runc_root: dir.join("runc"),
            cni_conf: dir.join("cni/net.d"),
            cni_bin: dir.join("cni/bin"),
            path_dir: dir.join("bin"),
            cdi_dir: dir.join("cdi"),
            log: dir.join("containerd.log"),
        }
    }
}

/// A TOML string literal.
fn quote(value: impl AsRef<str>) -> String {
    toml::Value::String(value.as_ref().to_string()).to_string()
}

fn quote_path(path: &Path) -> String {
    quote(path.to_string_lossy())
}

fn quote_list(values: &[&str]) -> String {
    format!("[{}]", values.iter().map(quote).collect::<Vec<_>>().join(", "))
}

/// Plugins that cannot work here (or are not needed) and would only add noise or fail.
fn disabled_plugins(version: u32) -> String {
    let mut plugins = vec![
        "io.containerd.snapshotter.v1.aufs",
        "io.containerd.snapshotter.v1.btrfs",
        "io.containerd.snapshotter.v1.devmapper",
        "io.containerd.snapshotter.v1.zfs",
        "io.containerd.tracing.processor.v1.otlp",
    ];
    if version >= 3 {
        plugins.extend([
            "io.containerd.snapshotter.v1.blockfile",
            "io.containerd.snapshotter.v1.erofs",
        ]);
    }
    quote_list(&plugins)
}

/// The runtime handlers under `prefix` (the CRI runtime plugin's `containerd` table).
fn runtimes(prefix: &str, layout: &Layout, options: &ContainerdOptions) -> String {
    let mut text = String::new();
    let runc_root = quote_path(&layout.runc_root);
    let _ = write!(
        text,
        r#"
[{prefix}.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
[{prefix}.runtimes.runc.options]
  Root = {runc_root}
"#
    );
    if let Some(shim) = &options.gpu_mps_shim {
        let pod_annotations = quote_list(&POD_ANNOTATION_PATTERNS);
        let container_annotations = quote_list(&CONTAINER_ANNOTATION_PATTERNS);
        let _ = write!(
            text,
            r#"
[{prefix}.runtimes.{GPU_MPS_HANDLER}]
  runtime_type = "io.containerd.runc.v2"
  pod_annotations = {pod_annotations}
  container_annotations = {container_annotations}
[{prefix}.runtimes.{GPU_MPS_HANDLER}.options]
  BinaryName = {shim}
  Root = {runc_root}
"#,
            shim = quote_path(shim)
        );
    }
    text
}

/// The CDI settings of the CRI table that has them (1.7: the CRI plugin's, 2.x: its runtime
/// plugin's).
fn cdi_settings(layout: &Layout, cdi: &CdiOptions) -> String {
    let mut text = format!("  cdi_spec_dirs = [{}]\n", quote_path(&layout.cdi_dir));
    if let Some(enabled) = cdi.enabled {
        let _ = writeln!(text, "  enable_cdi = {enabled}");
    }
    text
}

// Both schemas: `restrict_oom_score_adj` because CRI gives the pause container -998 and a
// test host (a container, a VM sandbox) may not lower scores below its own; AppArmor off
// because the CRI default profile needs apparmor_parser, which is no part of these tests.

/// containerd 1.6 and 1.7: config version 2, CRI settings in one `io.containerd.grpc.v1.cri`
/// plugin. `has_cdi`: 1.7, whose CRI plugin has the CDI settings (1.6's has none).
fn config_v2(
    layout: &Layout,
    snapshotter: Snapshotter,
    options: &ContainerdOptions,
    has_cdi: bool,
) -> String {
    let cri = r#"plugins."io.containerd.grpc.v1.cri""#;
    format!(
        r#"# Generated by gpu-mps-e2e for one test.
version = 2
root = {root}
state = {state}
disabled_plugins = {disabled}

[grpc]
  address = {socket}

[debug]
  level = "info"

[{cri}]
  sandbox_image = {image}
  disable_apparmor = true
  restrict_oom_score_adj = true
  disable_tcp_service = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
{cdi}
[{cri}.cni]
  bin_dir = {cni_bin}
  conf_dir = {cni_conf}

[{cri}.containerd]
  snapshotter = {snapshotter}
  default_runtime_name = "runc"
{runtimes}"#,
        root = quote_path(&layout.root),
        state = quote_path(&layout.state),
        disabled = disabled_plugins(2),
        socket = quote_path(&layout.socket),
        image = quote(image::TEST_IMAGE),
        cni_bin = quote_path(&layout.cni_bin),
        cni_conf = quote_path(&layout.cni_conf),
        snapshotter = quote(snapshotter.name()),
        cdi = if has_cdi {
            cdi_settings(layout, &options.cdi)
        } else {
            String::new()
        },
        runtimes = runtimes(&format!("{cri}.containerd"), layout, options),
    )
}

/// containerd 2.x: config version 3, CRI split into `io.containerd.cri.v1.images` (snapshotter,
/// pinned sandbox image) and `io.containerd.cri.v1.runtime` (runtimes, CNI); NRI is on by
/// default there and would listen on a host-wide socket, so it is switched off.
fn config_v3(layout: &Layout, snapshotter: Snapshotter, options: &ContainerdOptions) -> String {
    let images = "plugins.'io.containerd.cri.v1.images'";
    let runtime = "plugins.'io.containerd.cri.v1.runtime'";
    format!(
        r#"# Generated by gpu-mps-e2e for one test.
version = 3
root = {root}
state = {state}
disabled_plugins = {disabled}

[grpc]
  address = {socket}

[debug]
  level = "info"

[{images}]
  snapshotter = {snapshotter}

[{images}.pinned_images]
  sandbox = {image}

[{runtime}]
  disable_apparmor = true
  restrict_oom_score_adj = true
{cdi}
[{runtime}.cni]
  bin_dirs = [{cni_bin}]
  conf_dir = {cni_conf}

[{runtime}.containerd]
  default_runtime_name = "runc"
{runtimes}
[plugins.'io.containerd.grpc.v1.cri']
  disable_tcp_service = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"

[plugins.'io.containerd.nri.v1.nri']
  disable = true
"#,
        root = quote_path(&layout.root),
        state = quote_path(&layout.state),
        disabled = disabled_plugins(3),
        socket = quote_path(&layout.socket),
        image = quote(image::TEST_IMAGE),
        cni_bin = quote_path(&layout.cni_bin),
        cni_conf = quote_path(&layout.cni_conf),
        snapshotter = quote(snapshotter.name()),
        cdi = cdi_settings(layout, &options.cdi),
        runtimes = runtimes(&format!("{runtime}.containerd"), layout, options),
    )
}

/// Forces a snapshotter ("overlayfs" or "native"), e.g. to test the fallback.
pub const SNAPSHOTTER_ENV: &str = "GPU_MPS_E2E_SNAPSHOTTER";

/// overlayfs when the temp dir can hold an overlay mount, else native. Probed once.
pub fn snapshotter() -> Snapshotter {
    static PROBED: OnceLock<Snapshotter> = OnceLock::new();
    *PROBED.get_or_init(
        || match (std::env::var(SNAPSHOTTER_ENV).as_deref(), probe_overlay()) {
            (Ok("native"), _) => Snapshotter::Native,
            (Ok("overlayfs"), _) | (_, Ok(())) => Snapshotter::Overlayfs,
            (_, Err(e)) => {
                eprintln!(
                    "overlayfs does not work in {}: {e:#}; containerd uses the native snapshotter",
                    std::env::temp_dir().display()
                );
                Snapshotter::Native
            }
        },
    )
}

fn probe_overlay() -> Result<()> {
    use nix::mount::{MntFlags, MsFlags, mount, umount2};
    let dir = WorkDir::new("gme2e-ovl.")?;
    for sub in ["lower", "upper", "work", "merged"] {
        std::fs::create_dir(dir.join(sub))?;
    }
    let data = format!(
        "lowerdir={},upperdir={},workdir={}",
        dir.join("lower").display(),
        dir.join("upper").display(),
        dir.join("work").display()
    );
    mount(
        Some("overlay"),
        &dir.join("merged"),
        Some("overlay"),
        MsFlags::empty(),
        Some(data.as_str()),
    )
    .context("mount -t overlay")?;
    std::fs::write(dir.join("merged/probe"), b"x").context("writing through the overlay")?;
    umount2(&dir.join("merged"), MntFlags::MNT_DETACH).context("umount")?;
    Ok(())
}

/// The test image archive, built once per test process.
fn test_image_archive(checker: &Path) -> Result<&'static [u8]> {
    static ARCHIVE: OnceLock<Result<Vec<u8>, String>> = OnceLock::new();
    ARCHIVE
        .get_or_init(|| image::oci_archive(checker).map_err(|e| format!("{e:#}")))
        .as_deref()
        .map_err(|e| anyhow::anyhow!("building the test image: {e}"))
}

/// A container as runc records it under its root.
#[derive(Debug)]
struct RuncContainer {
    pid: u32,
    cgroups: Vec<PathBuf>,
}

/// `<runc root>/<namespace>/<id>/state.json` of every container, created or running.
fn runc_containers(runc_root: &Path) -> Vec<RuncContainer> {
    let mut found = Vec::new();
    let dirs = |p: &Path| {
        std::fs::read_dir(p)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .collect::<Vec<_>>()
    };
    for namespace in dirs(runc_root) {
        found.extend(
            dirs(&namespace)
                .iter()
                .filter_map(|container| runc_state(container)),
        );
    }
    found
}

/// `<dir>/state.json` of one container.
fn runc_state(dir: &Path) -> Option<RuncContainer> {
    let text = std::fs::read_to_string(dir.join("state.json")).ok()?;
    let state = serde_json::from_str::<serde_json::Value>(&text).ok()?;
    let pid = state["init_process_pid"]
        .as_u64()
        .and_then(|p| u32::try_from(p).ok())?;
    let cgroups = state["cgroup_paths"]
        .as_object()
        .map(|paths| {
            paths
                .values()
                .filter_map(|v| v.as_str())
                .map(PathBuf::from)
                .collect()
        })
        .unwrap_or_default();
    Some(RuncContainer { pid, cgroups })
}

/// The sockets of this containerd's shims, from each task's `address` (1.x) or
/// `bootstrap.json` (2.x) file.
fn shim_sockets(state: &Path) -> Vec<PathBuf> {
    let tasks = state.join("io.containerd.runtime.v2.task");
    let dirs = |p: &Path| {
        std::fs::read_dir(p)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .collect::<Vec<_>>()
    };
    let mut sockets = Vec::new();
    for task in dirs(&tasks).iter().flat_map(|namespace| dirs(namespace)) {
        let address = std::fs::read_to_string(task.join("address")).ok().or_else(|| {
            let bootstrap = std::fs::read_to_string(task.join("bootstrap.json")).ok()?;
            let bootstrap: serde_json::Value = serde_json::from_str(&bootstrap).ok()?;
            bootstrap["address"].as_str().map(str::to_string)
        });
        if let Some(path) = address.as_deref().and_then(|a| a.trim().strip_prefix("unix://")) {
            sockets.push(PathBuf::from(path));
        }
    }
    sockets.sort();
    sockets.dedup();
    sockets
}

/// The containerd-shim processes serving the containerd at `socket`.
fn shims_of(socket: &Path) -> Vec<u32> {
    processes::with_argument(b"containerd-shim", socket.as_os_str().as_encoded_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> Layout {
        let p = |s: &str| PathBuf::from(format!("/t/{s}"));
        Layout {
            root: p("root"),
            state: p("state"),
            socket: p("containerd.sock"),
            config: p("containerd.toml"),
            runc_root: p("runc"),
            cni_conf: p("cni/net.d"),
            cni_bin: p("cni/bin"),
            path_dir: p("bin"),
            cdi_dir: p("cdi"),
            log: p("containerd.log"),
        }
    }

    fn options() -> ContainerdOptions {
        ContainerdOptions {
            gpu_mps_config: None,
            gpu_mps_shim: Some(PathBuf::from("/x/gpu-mps-shim")),
            cdi: CdiOptions {
                enabled: Some(true),
                specs: Vec::new(),
            },
            shared_root_namespace: false,
        }
    }

    #[test]
    fn configs_parse_and_register_both_handlers() {
        for (version, text) in [
            (2, config_v2(&layout(), Snapshotter::Overlayfs, &options(), true)),
            (3, config_v3(&layout(), Snapshotter::Native, &options())),
        ] {
            let parsed: toml::Table = toml::from_str(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
            assert_eq!(parsed["version"].as_integer(), Some(version));
            let plugins = parsed["plugins"].as_table().unwrap();
            let containerd = if version == 2 {
                &plugins["io.containerd.grpc.v1.cri"]["containerd"]
            } else {
                &plugins["io.containerd.cri.v1.runtime"]["containerd"]
            };
            let gpu = &containerd["runtimes"]["gpu-mps"];
            assert_eq!(gpu["runtime_type"].as_str(), Some("io.containerd.runc.v2"));
            assert_eq!(gpu["options"]["BinaryName"].as_str(), Some("/x/gpu-mps-shim"));
            assert_eq!(gpu["pod_annotations"].as_array().unwrap().len(), 2);
            assert_eq!(containerd["default_runtime_name"].as_str(), Some("runc"));
            let cdi = if version == 2 {
                &plugins["io.containerd.grpc.v1.cri"]
            } else {
                &plugins["io.containerd.cri.v1.runtime"]
            };
            assert_eq!(cdi["enable_cdi"].as_bool(), Some(true), "{text}");
            assert_eq!(
                cdi["cdi_spec_dirs"].as_array().unwrap()[0].as_str(),
                Some("/t/cdi")
            );
        }
    }

    #[test]
    fn cdi_settings_only_where_containerd_has_them() {
        let v16 = config_v2(&layout(), Snapshotter::Overlayfs, &options(), false);
        assert!(
            !v16.contains("cdi_spec_dirs") && !v16.contains("enable_cdi"),
            "{v16}"
        );
        let default = config_v3(&layout(), Snapshotter::Native, &ContainerdOptions::default());
        assert!(
            default.contains("cdi_spec_dirs") && !default.contains("enable_cdi"),
            "{default}"
        );
    }

    #[test]
    fn no_gpu_mps_handler_without_a_shim() {
        let text = config_v2(
            &layout(),
            Snapshotter::Overlayfs,
            &ContainerdOptions::default(),
            true,
        );
        assert!(!text.contains("gpu-mps]"), "{text}");
    }
}
