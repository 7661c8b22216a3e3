//! Registers the `gpu-mps` runtime handler with containerd (`gpu-mps install-containerd`) and
//! removes it again (`gpu-mps uninstall-containerd`).
//!
//! The entry is containerd's own runc shim (`io.containerd.runc.v2`) with `options.BinaryName`
//! pointing at gpu-mps-shim, the settings of the node's existing runc entry (SystemdCgroup, Root,
//! ...) copied over, and the gpu-mps annotations let through to the OCI spec.
//!
//! Where the entry goes follows what the real binaries do with their config (measured on
//! containerd 1.6.20, 1.7.24 and 2.1.9, see docs/adr/0002-containerd-registration.md):
//! - containerd 1.x merges an imported file by replacing each top-level plugin table whole. A
//!   drop-in naming `plugins."io.containerd.grpc.v1.cri"` would drop the main config's CRI settings
//!   (CNI dirs, registry mirrors, the runc entry). So on 1.x the entry goes into the main config.
//! - containerd 1.x also forgets its built-in `runc` entry once the config names any runtime, and
//!   the CRI plugin then refuses to load (`default_runtime_name = "runc"` has no entry). When the
//!   main config names no runtime, a plain `runc` entry is written next to ours.
//! - containerd 2.x merges imports key by key: there the entry goes into a drop-in of the same
//!   config version as the main file, and the main file gets an `imports` entry for it.
//! - containerd 1.x refuses to start when a plain (non-glob) import is missing, so the main config
//!   never names a drop-in that is not on disk: install writes the drop-in before the main config,
//!   uninstall edits the main config before it removes the drop-in.
//!
//! The planning functions are pure (`plan`: `plan_install`, `plan_uninstall`; `effective`:
//! `check_effective`, `check_removed`); the I/O is in `apply` (reading the files, writing them
//! atomically, rolling back), `containerd` (its version and `config dump`) and the `install` and
//! `uninstall` below. Comments and formatting of the main config outside the lines gpu-mps owns
//! are kept byte for byte (toml_edit; `layout` decides how the new lines are indented).

mod apply;
mod containerd;
mod effective;
#[cfg(test)]
mod fixtures;
mod imports;
mod layout;
mod plan;
mod toolkit;

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

use thiserror::Error;

use apply::roll_back;
pub use apply::{Applied, apply};
pub use containerd::{containerd_version, dump_config, find_containerd, parse_containerd_version};
pub use effective::{check_effective, check_removed};
pub use imports::glob_match;
pub use plan::{ExistingFiles, FileChange, InstallPlan, detect_version, plan_install, plan_uninstall};
pub use toolkit::{
    ChainDecision, ChainPlan, ChainToolkit, TOOLKIT_BINARY, TOOLKIT_DIRS, ToolkitFacts, ToolkitRuntime,
    decide_chain, find_toolkit_binary, is_toolkit_binary, plan_chain, plan_unchain, toolkit_runtimes,
};

/// The runtime handler name: RuntimeClass `handler: gpu-mps`.
pub const RUNTIME_NAME: &str = "gpu-mps";
pub const MAIN_CONFIG: &str = "/etc/containerd/config.toml";
pub const DROP_IN: &str = "/etc/containerd/conf.d/gpu-mps.toml";
pub const SHIM_PATH: &str = "/usr/local/bin/gpu-mps-shim";
/// Pod-level (`gpu-mps.io/memory-limit`) and container-level
/// (`<container-name>.gpu-mps.io/memory-limit`) annotations. containerd matches them with Go's
/// `filepath.Match`, where `*` stops at `/`.
pub use gpu_mps_api::annotations::{CONTAINER_ANNOTATION_PATTERNS, POD_ANNOTATION_PATTERNS};

/// The patterns the entry must list under `key` (pod_annotations or container_annotations).
pub fn annotation_patterns(key: &str) -> &'static [&'static str] {
    if key == "pod_annotations" {
        &POD_ANNOTATION_PATTERNS
    } else {
        &CONTAINER_ANNOTATION_PATTERNS
    }
}
/// containerd's runc shim, which does the task API, IO, events and OOM handling for us.
pub const RUNC_SHIM: &str = "io.containerd.runc.v2";

#[derive(Debug, Error)]
pub enum RegistrationError {
    #[error("{path}: not valid TOML: {message}")]
    Parse { path: PathBuf, message: String },
    #[error(
        "{path}: version = {found}: gpu-mps edits version 2 (containerd 1.6/1.7) and version 3 (containerd 2.x) configs"
    )]
    UnsupportedVersion { path: PathBuf, found: String },
    #[error(
        "{path}: has no `version` key, so containerd reads it in the old version 1 layout: port it to version 2 (containerd 1.6/1.7) or 3 (containerd 2.x) and rerun"
    )]
    NoVersion { path: PathBuf },
    #[error("{path}: version = 3 is the containerd 2.x layout, but this node runs containerd {major}.x")]
    VersionMismatch { path: PathBuf, major: u32 },
    #[error(
        "{path}: does not exist and containerd's version is unknown, so gpu-mps cannot tell whether to write a version 2 or version 3 config: make the containerd binary findable or create the file"
    )]
    UnknownContainerd { path: PathBuf },
    #[error("{path}: {key}: {message}")]
    Layout {
        path: PathBuf,
        key: String,
        message: String,
    },
    #[error("{path}: {action}: {source}")]
    Io {
        path: PathBuf,
        action: &'static str,
        #[source]
        source: io::Error,
    },
    #[error(
        "--chain-toolkit=yes: found {found}, but no nvidia-container-runtime to chain (no containerd runtime entry names one, none is in /usr/bin, /usr/local/bin, /usr/local/nvidia/toolkit or /usr/sbin): install the NVIDIA Container Toolkit, or rerun with --chain-toolkit=auto"
    )]
    NoToolkit { found: String },
    #[error(
        "{path}: no such containerd config: an explicit --containerd-config must exist (only containerd's default {MAIN_CONFIG} is created when absent, since containerd then runs on its built-in defaults); check the path, or create the file first"
    )]
    NoSuchConfig { path: PathBuf },
    #[error(
        "{path}: no such containerd config, so there is nothing to remove from it: check the path (containerd runs with the file its --config names, default {MAIN_CONFIG})"
    )]
    NoSuchConfigToClean { path: PathBuf },
    #[error("{binary}: {message}")]
    Containerd { binary: PathBuf, message: String },
    #[error("containerd's effective config (from {config}): {message}")]
    NotInEffect { config: PathBuf, message: String },
    #[error("{cause}; every file was put back as it was ({files})")]
    RolledBack {
        cause: Box<RegistrationError>,
        files: String,
    },
    #[error("{cause}; putting the files back failed too: {rollback}; the main config's backups: {backups}")]
    RollbackFailed {
        cause: Box<RegistrationError>,
        rollback: Box<RegistrationError>,
        backups: String,
    },
}

/// The `version` of a containerd config file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConfigVersion {
    /// containerd 1.6 and 1.7 (2.x reads it too and migrates it in memory).
    V2,
    /// containerd 2.x.
    V3,
}

impl ConfigVersion {
    fn number(self) -> i64 {
        match self {
            ConfigVersion::V2 => 2,
            ConfigVersion::V3 => 3,
        }
    }

    /// The plugin that holds the CRI runtimes in this layout.
    pub fn cri_runtime_plugin(self) -> &'static str {
        match self {
            ConfigVersion::V2 => "io.containerd.grpc.v1.cri",
            ConfigVersion::V3 => "io.containerd.cri.v1.runtime",
        }
    }

    fn containerd_path(self) -> [&'static str; 3] {
        ["plugins", self.cri_runtime_plugin(), "containerd"]
    }

    fn runtimes_path(self) -> [&'static str; 4] {
        ["plugins", self.cri_runtime_plugin(), "containerd", "runtimes"]
    }
}

impl fmt::Display for ConfigVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "version {}", self.number())
    }
}

/// Which file holds the runtime entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// In the main config (containerd 1.x, or a version 2 file whose containerd is unknown).
    MainConfig,
    /// In the drop-in, imported by the main config (containerd 2.x).
    DropIn,
}

#[derive(Debug, Clone)]
pub struct InstallOptions {
    /// The runtime handler name.
    pub runtime_name: String,
    /// BinaryName of the entry: the runc wrapper.
    pub shim_path: PathBuf,
    /// The main containerd config, as a path on the host.
    pub main_config: PathBuf,
    /// The drop-in file, as a path on the host.
    pub drop_in: PathBuf,
    /// The entry whose settings the new entry copies. `None`: `runc`, else the default runtime.
    pub base_runtime: Option<String>,
    /// containerd's major version (`containerd --version`). Decides the placement; needed when
    /// there is no main config to read the layout from.
    pub containerd_major: Option<u32>,
    /// Where the host's `/` is mounted, e.g. `/host` in an installer container. Files are read and
    /// written under it; the paths written into configs stay host paths.
    pub host_root: PathBuf,
    /// The gpu-mps node config, whose runc_path chaining sets (a host path).
    pub node_config: PathBuf,
    /// Whether install chains gpu-mps-shim to the NVIDIA Container Toolkit's runtime.
    pub chain_toolkit: ChainToolkit,
}

impl Default for InstallOptions {
    fn default() -> Self {
        InstallOptions {
            runtime_name: RUNTIME_NAME.into(),
            shim_path: SHIM_PATH.into(),
            main_config: MAIN_CONFIG.into(),
            drop_in: DROP_IN.into(),
            base_runtime: None,
            containerd_major: None,
            host_root: "/".into(),
            node_config: gpu_mps_api::node_config::DEFAULT_CONFIG_PATH.into(),
            chain_toolkit: ChainToolkit::Auto,
        }
    }
}

impl InstallOptions {
    /// Where a host path is seen from this process.
    pub fn on_host(&self, path: &Path) -> PathBuf {
        crate::host_paths::on_host(&self.host_root, path)
    }
}

/// What `install` and `uninstall` did.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub plan: InstallPlan,
    /// Copies of the main config made before it was changed.
    pub backups: Vec<PathBuf>,
    /// Checked with `containerd config dump` (false: no containerd binary, or a dry run).
    pub verified: bool,
    pub warnings: Vec<String>,
    /// The node config changed (runc_path chained or put back): gpu-mps-manager publishes it
    /// only at its start.
    pub node_config_changed: bool,
    /// Install chained gpu-mps-shim to the NVIDIA Container Toolkit: what and why, one line.
    pub chained: Option<String>,
}

impl Outcome {
    /// containerd reads its config only at start: a changed config needs a restart.
    pub fn needs_containerd_restart(&self) -> bool {
        self.plan.changes.len() > usize::from(self.node_config_changed)
    }
}

/// What is known of the NVIDIA Container Toolkit: containerd's effective config when its binary
/// is there (the toolkit may sit in a drop-in), else the main config's text.
fn gather_toolkit(opts: &InstallOptions, containerd: Option<&Path>, main: Option<&str>) -> ToolkitFacts {
    let dumped = containerd.and_then(|binary| dump_config(opts, binary).ok());
    ToolkitFacts {
        runtimes: dumped
            .as_deref()
            .or(main)
            .map(toolkit_runtimes)
            .unwrap_or_default(),
        binary: find_toolkit_binary(opts),
    }
}

/// Adds the node config change to `plan`, last: containerd's files are checked first.
fn push_node_config(plan: &mut InstallPlan, change: Option<FileChange>) -> bool {
    match change {
        Some(change) => {
            plan.changes.push(change);
            true
        }
        None => false,
    }
}

/// A main config that does not exist is containerd's "run on built-in defaults" only at its
/// default path: any other path that does not exist is a typo (config.tml) or a directory that is
/// not there, and writing it would register gpu-mps where no containerd looks.
fn refuse_a_missing_explicit_config(
    existing: &ExistingFiles,
    opts: &InstallOptions,
    error: impl FnOnce(PathBuf) -> RegistrationError,
) -> Result<(), RegistrationError> {
    if existing.main.is_none() && opts.main_config != Path::new(MAIN_CONFIG) {
        return Err(error(opts.main_config.clone()));
    }
    Ok(())
}

/// Registers the runtime: plan, apply unless `dry_run`, then check containerd's effective config.
/// `containerd`: the host's containerd binary (a host path); without it the placement rests on
/// the main config's version, and nothing is verified.
pub fn install(
    opts: &InstallOptions,
    containerd: Option<&Path>,
    dry_run: bool,
) -> Result<Outcome, RegistrationError> {
    let mut opts = opts.clone();
    if let (None, Some(binary)) = (opts.containerd_major, containerd) {
        opts.containerd_major = Some(containerd_version(&opts, binary)?.0);
    }
    let existing = ExistingFiles::read(&opts)?;
    refuse_a_missing_explicit_config(&existing, &opts, |path| RegistrationError::NoSuchConfig { path })?;
    let mut plan = plan_install(&existing, &opts)?;
    let facts = gather_toolkit(&opts, containerd, existing.main.as_deref());
    let chain = plan_chain(existing.node_config.as_deref(), &facts, &opts)?;
    let node_config_changed = push_node_config(&mut plan, chain.change);
    plan.notes.extend(chain.warning);
    let chained = chain.chained;
    let mut warnings = plan.notes.clone();
    if dry_run {
        return Ok(Outcome {
            plan,
            backups: Vec::new(),
            verified: false,
            warnings,
            node_config_changed,
            chained,
        });
    }
    let applied = apply(&plan)?;
    let verified = match containerd {
        Some(binary) => {
            // containerd must read the new files and have the runtime in effect; otherwise they
            // are put back, so that a failed install never leaves containerd a config it cannot
            // start with.
            match dump_config(&opts, binary).and_then(|dump| check_effective(&dump, &opts)) {
                Ok(notes) => warnings.extend(notes),
                Err(e) => return Err(roll_back(&plan.changes, &applied, e)),
            }
            true
        }
        None => {
            warnings.push(
                "no containerd binary found: the result was not checked with `containerd config dump`".into(),
            );
            false
        }
    };
    Ok(Outcome {
        plan,
        backups: applied.backups,
        verified,
        warnings,
        node_config_changed,
        chained,
    })
}

/// Removes the runtime: plan, apply unless `dry_run`, then check that containerd still reads its
/// config and no longer has the runtime.
pub fn uninstall(
    opts: &InstallOptions,
    containerd: Option<&Path>,
    dry_run: bool,
) -> Result<Outcome, RegistrationError> {
    let existing = ExistingFiles::read(opts)?;
    refuse_a_missing_explicit_config(&existing, opts, |path| RegistrationError::NoSuchConfigToClean {
        path,
    })?;
    let mut plan = plan_uninstall(&existing, opts)?;
    let node_config_changed =
        push_node_config(&mut plan, plan_unchain(existing.node_config.as_deref(), opts)?);
    if dry_run {
        return Ok(Outcome {
            plan,
            backups: Vec::new(),
            verified: false,
            warnings: Vec::new(),
            node_config_changed,
            chained: None,
        });
    }
    let applied = apply(&plan)?;
    let drop_in_removed = plan
        .changes
        .iter()
        .any(|c| matches!(c, FileChange::Remove { path, .. } if *path == opts.on_host(&opts.drop_in)));
    if drop_in_removed {
        // The conf.d install made for the drop-in; kept if anything else is in it.
        if let Some(dir) = opts.on_host(&opts.drop_in).parent() {
            let _ = std::fs::remove_dir(dir);
        }
    }
    let mut warnings = Vec::new();
    let mut verified = false;
    if let Some(binary) = containerd {
        if opts.on_host(&opts.main_config).exists() {
            if let Err(e) = dump_config(opts, binary).and_then(|dump| check_removed(&dump, opts)) {
                return Err(roll_back(&plan.changes, &applied, e));
            }
            verified = true;
        }
    } else {
        warnings.push(
            "no containerd binary found: the result was not checked with `containerd config dump`".into(),
        );
    }
    Ok(Outcome {
        plan,
        backups: applied.backups,
        verified,
        warnings,
        node_config_changed,
        chained: None,
    })
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::fixtures::{V3, opts};
    use super::*;

    #[test]
    fn apply_writes_atomically_with_a_backup_and_removes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().to_path_buf();
        let o = InstallOptions {
            host_root: root.clone(),
            ..opts(Some(2))
        };
        fs::create_dir_all(root.join("etc/containerd")).expect("mkdir");
        let main = root.join("etc/containerd/config.toml");
        fs::write(&main, V3).expect("write");
        let outcome = install(&o, None, false).expect("install");
        assert!(outcome.needs_containerd_restart() && !outcome.verified);
        assert_eq!(outcome.backups.len(), 1);
        assert_eq!(fs::read_to_string(&outcome.backups[0]).expect("backup"), V3);
        assert!(root.join("etc/containerd/conf.d/gpu-mps.toml").is_file());
        assert!(install(&o, None, false).expect("again").plan.is_empty());
        let removed = uninstall(&o, None, false).expect("uninstall");
        assert_eq!(removed.backups.len(), 1);
        assert_eq!(fs::read_to_string(&main).expect("main"), V3);
        assert!(!root.join("etc/containerd/conf.d/gpu-mps.toml").exists());
        let leftovers: Vec<_> = fs::read_dir(root.join("etc/containerd"))
            .expect("ls")
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains("tmp"))
            .collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
    }

    #[test]
    fn install_chains_the_default_toolkit_runtime_and_uninstall_puts_runc_path_back() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().to_path_buf();
        let o = InstallOptions {
            host_root: root.clone(),
            ..opts(Some(2))
        };
        fs::create_dir_all(root.join("etc/containerd")).expect("mkdir");
        fs::create_dir_all(root.join("etc/gpu-mps")).expect("mkdir");
        let operator = V3.replace(
            "# kept\n",
            "[plugins.'io.containerd.cri.v1.runtime'.containerd]\n  default_runtime_name = 'nvidia'\n\
             [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.nvidia.options]\n  \
             BinaryName = '/usr/local/nvidia/toolkit/nvidia-container-runtime'\n# kept\n",
        );
        fs::write(root.join("etc/containerd/config.toml"), &operator).expect("write");
        let node = root.join("etc/gpu-mps/config.toml");
        let node_text = "# node\n[limits]\npolicy = \"exact\"\n";
        fs::write(&node, node_text).expect("write");

        let outcome = install(&o, None, false).expect("install");
        assert!(outcome.node_config_changed && outcome.needs_containerd_restart());
        let chained = fs::read_to_string(&node).expect("node config");
        let config = gpu_mps_api::NodeConfig::from_toml(&chained, &node).expect("valid node config");
        assert_eq!(
            config.runc_path,
            Path::new("/usr/local/nvidia/toolkit/nvidia-container-runtime")
        );
        assert!(
            outcome
                .chained
                .as_deref()
                .is_some_and(|c| c.contains("containerd's default runtime is the NVIDIA Container Toolkit's")),
            "{:?}",
            outcome.chained
        );
        assert!(
            !outcome.warnings.iter().any(|w| w.contains("Toolkit")),
            "{:?}",
            outcome.warnings
        );
        assert!(!install(&o, None, false).expect("again").node_config_changed);

        let removed = uninstall(&o, None, false).expect("uninstall");
        assert!(removed.node_config_changed);
        assert_eq!(fs::read_to_string(&node).expect("node config"), node_text);
        assert_eq!(
            fs::read_to_string(root.join("etc/containerd/config.toml")).expect("main"),
            operator
        );
    }

    #[test]
    fn uninstall_of_a_config_install_created_leaves_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().to_path_buf();
        let o = InstallOptions {
            host_root: root.clone(),
            ..opts(Some(2))
        };
        install(&o, None, false).expect("install");
        assert!(root.join("etc/containerd/config.toml").is_file());
        uninstall(&o, None, false).expect("uninstall");
        assert!(!root.join("etc/containerd/config.toml").exists());
        assert!(!root.join("etc/containerd/conf.d").exists());
        assert!(!root.join("etc/gpu-mps").exists());
    }

    #[test]
    fn a_missing_config_is_created_only_at_the_default_path() {
        let dir = tempfile::tempdir().expect("tempdir");
        let o = InstallOptions {
            host_root: dir.path().into(),
            main_config: "/etc/containerd/config.tml".into(),
            ..opts(Some(2))
        };
        let e = install(&o, None, false).expect_err("a typo in the path");
        assert!(matches!(e, RegistrationError::NoSuchConfig { .. }), "{e}");
        assert!(
            e.to_string()
                .starts_with("/etc/containerd/config.tml: no such containerd config"),
            "{e}"
        );
        let e = uninstall(&o, None, false).expect_err("nothing to clean");
        assert!(matches!(e, RegistrationError::NoSuchConfigToClean { .. }), "{e}");
        assert!(!dir.path().join("etc").exists());
        // containerd's own default path runs on built-in defaults when absent: created.
        let o = InstallOptions {
            host_root: dir.path().into(),
            ..opts(Some(2))
        };
        install(&o, None, false).expect("install at the default path");
        assert!(dir.path().join("etc/containerd/config.toml").is_file());
    }

    #[test]
    fn dry_run_writes_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let o = InstallOptions {
            host_root: dir.path().into(),
            ..opts(Some(1))
        };
        let outcome = install(&o, None, true).expect("dry run");
        assert!(
            outcome
                .plan
                .diff()
                .contains("+[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.gpu-mps]"),
            "{}",
            outcome.plan.diff()
        );
        assert!(!dir.path().join("etc").exists());
    }
}
