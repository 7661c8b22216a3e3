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
//! The planning functions are pure (`plan_install`, `plan_uninstall`, `check_effective`); the I/O
//! is in `ExistingFiles::read`, `apply`, `containerd_version`, `dump_config`, `install` and
//! `uninstall`. Comments and formatting of the main config outside the lines gpu-mps owns are kept
//! byte for byte (toml_edit).

use std::fmt;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

use thiserror::Error;
use toml_edit::{Array, DocumentMut, Item, Table, TableLike, Value, value};

/// The runtime handler name: RuntimeClass `handler: gpu-mps`.
pub const RUNTIME_NAME: &str = "gpu-mps";
pub const MAIN_CONFIG: &str = "/etc/containerd/config.toml";
pub const DROP_IN: &str = "/etc/containerd/conf.d/gpu-mps.toml";
pub const SHIM_PATH: &str = "/usr/local/bin/gpu-mps-shim";
/// Pod-level (`gpu-mps.io/memory-limit`) and container-level
/// (`<container-name>.gpu-mps.io/memory-limit`) annotations. containerd matches them with Go's
/// `filepath.Match`, where `*` stops at `/`.
pub use gpu_mps_api::annotations::{CONTAINER_ANNOTATION_PATTERNS, POD_ANNOTATION_PATTERNS};
use gpu_mps_api::files::{self, Durability, FileMode};
use gpu_mps_api::message::one_line;

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

/// Put in front of the tables gpu-mps writes, so a reader of config.toml knows who owns them.
const ENTRY_MARKER: &str = "gpu-mps runtime handler, managed by `gpu-mps install-containerd`; \
                            `gpu-mps uninstall-containerd` removes it.";
/// Trails an `imports` line gpu-mps added, so uninstall removes the line rather than leaving
/// `imports = []` behind (and keeps an `imports = []` the admin wrote).
const IMPORTS_MARKER: &str = "# added by `gpu-mps install-containerd`";
/// Put in front of the `runc` entry written for containerd 1.x; uninstall removes that entry only
/// when it carries this marker and is still exactly what was written.
const RUNC_MARKER: &str = "Spelled out by `gpu-mps install-containerd`: containerd 1.x drops its \
                           built-in runc entry once any runtime is configured.";

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
        }
    }
}

impl InstallOptions {
    /// Where a host path is seen from this process.
    pub fn on_host(&self, path: &Path) -> PathBuf {
        if self.host_root == Path::new("/") {
            return path.to_path_buf();
        }
        self.host_root.join(path.strip_prefix("/").unwrap_or(path))
    }
}

/// The current text of the files registration touches; `None` when a file does not exist.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExistingFiles {
    pub main: Option<String>,
    pub drop_in: Option<String>,
}

/// One change to one file. Paths are as seen from this process (under `host_root`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FileChange {
    Write {
        path: PathBuf,
        previous: Option<String>,
        contents: String,
        backup: bool,
    },
    Remove {
        path: PathBuf,
        previous: String,
    },
}

impl FileChange {
    pub fn path(&self) -> &Path {
        match self {
            FileChange::Write { path, .. } | FileChange::Remove { path, .. } => path,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstallPlan {
    /// The layout of the runtime entry; `None` when there is no containerd config at all.
    pub version: Option<ConfigVersion>,
    /// Where install puts the entry; `None` for uninstall.
    pub placement: Option<Placement>,
    /// The changes, in the order `apply` must make them. Empty: nothing to do.
    pub changes: Vec<FileChange>,
    /// Things the administrator should know, one line each.
    pub notes: Vec<String>,
}

impl InstallPlan {
    pub fn is_empty(&self) -> bool {
        self.changes.is_empty()
    }

    /// A unified diff of every change, for `--dry-run` and for the log.
    pub fn diff(&self) -> String {
        let mut out = String::new();
        for change in &self.changes {
            let (old, new) = match change {
                FileChange::Write {
                    previous, contents, ..
                } => (previous.as_deref().unwrap_or(""), contents.as_str()),
                FileChange::Remove { previous, .. } => (previous.as_str(), ""),
            };
            let path = change.path().display().to_string();
            let diff = similar::TextDiff::from_lines(old, new);
            out.push_str(
                &diff
                    .unified_diff()
                    .context_radius(3)
                    .header(&path, &path)
                    .to_string(),
            );
        }
        out
    }
}

/// A parsed main config: `version` is `None` when the file is empty or only comments.
struct MainConfig {
    doc: DocumentMut,
    version: Option<ConfigVersion>,
}

/// Reads the `version` of a containerd config. `Ok(None)`: the file holds nothing but comments.
pub fn detect_version(text: &str, path: &Path) -> Result<Option<ConfigVersion>, RegistrationError> {
    parse_main(Some(text), path).map(|m| m.and_then(|m| m.version))
}

fn parse_main(text: Option<&str>, path: &Path) -> Result<Option<MainConfig>, RegistrationError> {
    let Some(text) = text else { return Ok(None) };
    let doc = text
        .parse::<DocumentMut>()
        .map_err(|e| RegistrationError::Parse {
            path: path.into(),
            message: one_line(&e.to_string()),
        })?;
    let version = match doc.get("version") {
        None if doc.as_table().is_empty() => None,
        None => return Err(RegistrationError::NoVersion { path: path.into() }),
        Some(item) => match item.as_integer() {
            Some(2) => Some(ConfigVersion::V2),
            Some(3) => Some(ConfigVersion::V3),
            _ => {
                let found = item
                    .as_value()
                    .map(|v| v.to_string())
                    .unwrap_or_else(|| "a table".into());
                return Err(RegistrationError::UnsupportedVersion {
                    path: path.into(),
                    found: found.trim().into(),
                });
            }
        },
    };
    Ok(Some(MainConfig { doc, version }))
}

/// Plans registering the runtime. An empty plan means the node is already registered as asked.
pub fn plan_install(
    existing: &ExistingFiles,
    opts: &InstallOptions,
) -> Result<InstallPlan, RegistrationError> {
    let main_path = &opts.main_config;
    let parsed = parse_main(existing.main.as_deref(), main_path)?;
    let file_version = parsed.as_ref().and_then(|m| m.version);
    let (version, placement) = match (file_version, opts.containerd_major) {
        (Some(ConfigVersion::V3), Some(major)) if major < 2 => {
            return Err(RegistrationError::VersionMismatch {
                path: main_path.clone(),
                major,
            });
        }
        (Some(ConfigVersion::V3), _) => (ConfigVersion::V3, Placement::DropIn),
        (Some(ConfigVersion::V2), Some(major)) if major >= 2 => (ConfigVersion::V2, Placement::DropIn),
        // Safe on every containerd: 2.x migrates the version 2 main config in memory.
        (Some(ConfigVersion::V2), _) => (ConfigVersion::V2, Placement::MainConfig),
        (None, Some(major)) if major >= 2 => (ConfigVersion::V3, Placement::DropIn),
        (None, Some(_)) => (ConfigVersion::V2, Placement::MainConfig),
        (None, None) => {
            return Err(RegistrationError::UnknownContainerd {
                path: main_path.clone(),
            });
        }
    };
    let main_existed = parsed.is_some();
    let mut doc = match parsed {
        Some(m) => m.doc,
        None => DocumentMut::new(),
    };
    if file_version.is_none() {
        doc.insert("version", value(version.number()));
        if let (None, Some(mut key)) = (&existing.main, doc.key_mut("version")) {
            key.leaf_decor_mut()
                .set_prefix("# containerd config created by `gpu-mps install-containerd`.\n");
        }
    }

    let mut notes = Vec::new();
    let base = choose_base(doc.as_table(), version, opts, &mut notes);
    let entry = desired_entry(base.as_ref(), opts);

    let mut changes = Vec::new();
    match placement {
        Placement::MainConfig => {
            remove_import(&mut doc, opts, main_path)?;
            // Only ours counts as none: containerd 1.x would still forget its built-in runc.
            let no_other_runtime = lookup(doc.as_table(), &version.runtimes_path())
                .and_then(Item::as_table_like)
                .is_none_or(|t| t.iter().all(|(name, _)| name == opts.runtime_name));
            let style = Style::for_entry(doc.as_table(), version, base.as_ref().map(|b| b.name.as_str()));
            let runtimes = table_at(doc.as_table_mut(), &version.runtimes_path(), main_path)?;
            if no_other_runtime && version == ConfigVersion::V2 {
                let mut runc = builtin_runc();
                style.format(&mut runc, RUNC_MARKER);
                runtimes.insert("runc", Item::Table(runc));
            }
            put_entry(runtimes, &opts.runtime_name, entry, &style);
            push_main_write(&mut changes, opts, existing, &doc, main_existed);
            if let Some(previous) = &existing.drop_in {
                changes.push(FileChange::Remove {
                    path: opts.on_host(&opts.drop_in),
                    previous: previous.clone(),
                });
            }
        }
        Placement::DropIn => {
            let drop_in = drop_in_text(version, entry, opts);
            if existing.drop_in.as_deref() != Some(drop_in.as_str()) {
                changes.push(FileChange::Write {
                    path: opts.on_host(&opts.drop_in),
                    previous: existing.drop_in.clone(),
                    contents: drop_in,
                    backup: false,
                });
            }
            // An entry left in the main config by an install under containerd 1.x.
            remove_entry(&mut doc, version, opts);
            if !imports_cover(&doc, opts, main_path)? {
                add_import(&mut doc, &opts.drop_in.display().to_string(), main_path)?;
            }
            push_main_write(&mut changes, opts, existing, &doc, main_existed);
        }
    }
    Ok(InstallPlan {
        version: Some(version),
        placement: Some(placement),
        changes,
        notes,
    })
}

/// Plans removing the runtime: its entry and `imports` entry from the main config, then the
/// drop-in. An empty plan means there is nothing of gpu-mps left.
pub fn plan_uninstall(
    existing: &ExistingFiles,
    opts: &InstallOptions,
) -> Result<InstallPlan, RegistrationError> {
    let main_path = &opts.main_config;
    let parsed = parse_main(existing.main.as_deref(), main_path)?;
    let version = parsed.as_ref().and_then(|m| m.version);
    let mut changes = Vec::new();
    if let Some(MainConfig {
        mut doc,
        version: Some(v),
    }) = parsed
    {
        remove_entry(&mut doc, v, opts);
        remove_import(&mut doc, opts, main_path)?;
        push_main_write(&mut changes, opts, existing, &doc, true);
    }
    if let Some(previous) = &existing.drop_in {
        changes.push(FileChange::Remove {
            path: opts.on_host(&opts.drop_in),
            previous: previous.clone(),
        });
    }
    Ok(InstallPlan {
        version,
        placement: None,
        changes,
        notes: Vec::new(),
    })
}

fn push_main_write(
    changes: &mut Vec<FileChange>,
    opts: &InstallOptions,
    existing: &ExistingFiles,
    doc: &DocumentMut,
    main_existed: bool,
) {
    let contents = doc.to_string();
    if existing.main.as_deref() == Some(contents.as_str()) {
        return;
    }
    changes.push(FileChange::Write {
        path: opts.on_host(&opts.main_config),
        previous: existing.main.clone(),
        contents,
        backup: main_existed,
    });
}

/// The runtime entry whose settings are copied.
struct BaseRuntime {
    name: String,
    entry: Table,
}

fn choose_base(
    root: &Table,
    version: ConfigVersion,
    opts: &InstallOptions,
    notes: &mut Vec<String>,
) -> Option<BaseRuntime> {
    let runtimes = lookup(root, &version.runtimes_path()).and_then(Item::as_table_like);
    let default_name = lookup(root, &version.containerd_path())
        .and_then(Item::as_table_like)
        .and_then(|c| c.get("default_runtime_name"))
        .and_then(Item::as_str)
        .map(str::to_owned);
    let candidates: Vec<String> = match &opts.base_runtime {
        Some(name) => vec![name.clone()],
        None => ["runc".to_owned()].into_iter().chain(default_name).collect(),
    };
    let runtimes = runtimes?;
    for name in candidates {
        if name == opts.runtime_name {
            continue;
        }
        let Some(entry) = runtimes.get(&name).and_then(Item::as_table_like) else {
            continue;
        };
        let runtime_type = entry.get("runtime_type").and_then(Item::as_str);
        if runtime_type.is_some_and(|t| t != RUNC_SHIM) {
            continue;
        }
        let entry = plain_table(entry);
        let binary = entry
            .get("options")
            .and_then(Item::as_table_like)
            .and_then(|o| o.get("BinaryName"))
            .and_then(Item::as_str)
            .unwrap_or("");
        if !binary.is_empty() {
            notes.push(format!(
                "{}: runtime {name:?} runs BinaryName = {binary:?}: set runc_path = {binary:?} in /etc/gpu-mps/config.toml so gpu-mps-shim runs the same binary",
                opts.main_config.display()
            ));
        }
        return Some(BaseRuntime { name, entry });
    }
    if let Some(name) = &opts.base_runtime {
        notes.push(format!(
            "{}: no runtime {name:?} of type {RUNC_SHIM} to copy settings from; the {} entry has only its own",
            opts.main_config.display(),
            opts.runtime_name
        ));
    }
    None
}

/// The entry: the base runtime's settings, then ours on top.
fn desired_entry(base: Option<&BaseRuntime>, opts: &InstallOptions) -> Table {
    let empty = Table::new();
    let base = base.map(|b| &b.entry).unwrap_or(&empty);
    let mut entry = Table::new();
    entry.insert("runtime_type", value(RUNC_SHIM));
    for (key, item) in base.iter() {
        if !matches!(
            key,
            "runtime_type" | "pod_annotations" | "container_annotations" | "options"
        ) {
            entry.insert(key, item.clone());
        }
    }
    for key in ["pod_annotations", "container_annotations"] {
        let mut patterns: Vec<String> = annotation_patterns(key).iter().map(|p| (*p).to_owned()).collect();
        // Whatever the base runtime already lets through keeps reaching the spec.
        if let Some(extra) = base.get(key).and_then(Item::as_array) {
            for p in extra.iter().filter_map(Value::as_str) {
                if !patterns.iter().any(|q| q == p) {
                    patterns.push(p.to_owned());
                }
            }
        }
        entry.insert(key, value(patterns.into_iter().collect::<Array>()));
    }
    let mut options = Table::new();
    options.insert("BinaryName", value(opts.shim_path.display().to_string()));
    if let Some(base_options) = base.get("options").and_then(Item::as_table_like) {
        for (key, item) in base_options.iter() {
            if key != "BinaryName" {
                options.insert(key, item.clone());
            }
        }
    }
    entry.insert("options", Item::Table(options));
    entry
}

/// What containerd 1.x has built in when the config names no runtime.
fn builtin_runc() -> Table {
    let mut runc = Table::new();
    runc.insert("runtime_type", value(RUNC_SHIM));
    runc
}

/// Inserts or updates the entry in `runtimes`. An entry that already says the same is left as it
/// is, formatting included, which is what makes a second install a no-op.
fn put_entry(runtimes: &mut Table, name: &str, mut entry: Table, style: &Style) {
    let desired = Item::Table(entry.clone());
    if runtimes.get(name).is_some_and(|old| same_item(old, &desired)) {
        return;
    }
    style.format(&mut entry, ENTRY_MARKER);
    if let Some(Item::Table(old)) = runtimes.get(name) {
        // Rewritten where it was, with the comments above it.
        *entry.decor_mut() = old.decor().clone();
        if let Some(position) = old.position() {
            entry.set_position(position);
        }
    }
    runtimes.insert(name, Item::Table(entry));
}

/// Removes the runtime entry from the main config, the `runc` entry gpu-mps wrote next to it
/// when it is still as written and alone, and the tables that only held them.
fn remove_entry(doc: &mut DocumentMut, version: ConfigVersion, opts: &InstallOptions) {
    let path = version.runtimes_path();
    let Some(runtimes) = lookup_mut(doc.as_table_mut(), &path).and_then(Item::as_table_mut) else {
        return;
    };
    if runtimes.remove(&opts.runtime_name).is_none() {
        return;
    }
    let only_our_runc = runtimes.len() == 1
        && runtimes.get("runc").and_then(Item::as_table).is_some_and(|runc| {
            decor_mentions(runc, RUNC_MARKER)
                && same_item(&Item::Table(runc.clone()), &Item::Table(builtin_runc()))
        });
    if only_our_runc {
        runtimes.remove("runc");
    }
    prune_empty_implicit(doc.as_table_mut(), &path);
}

fn decor_mentions(table: &Table, marker: &str) -> bool {
    table
        .decor()
        .prefix()
        .and_then(|p| p.as_str())
        .is_some_and(|p| p.contains(marker))
}

/// Drops tables along `path`, deepest first, that are empty and have no header of their own.
fn prune_empty_implicit(root: &mut Table, path: &[&str]) {
    for depth in (1..=path.len()).rev() {
        let (parents, last) = (&path[..depth - 1], path[depth - 1]);
        let parent = if parents.is_empty() {
            Some(&mut *root)
        } else {
            lookup_mut(root, parents).and_then(Item::as_table_mut)
        };
        let Some(parent) = parent else { return };
        let empty = parent
            .get(last)
            .and_then(Item::as_table)
            .is_some_and(|t| t.is_empty() && t.is_implicit());
        if !empty {
            return;
        }
        parent.remove(last);
    }
}

fn drop_in_text(version: ConfigVersion, mut entry: Table, opts: &InstallOptions) -> String {
    let mut doc = DocumentMut::new();
    doc.insert("version", value(version.number()));
    if let Some(mut key) = doc.key_mut("version") {
        key.leaf_decor_mut().set_prefix(format!(
            "# The {name} runtime handler for containerd, written by `gpu-mps install-containerd`, which\n\
             # rewrites this file; `gpu-mps uninstall-containerd` removes it and its `imports` entry in\n\
             # {main}. Settings other than BinaryName and the annotations are copied\n\
             # from the runc entry of that file: change them there and rerun install-containerd.\n",
            name = opts.runtime_name,
            main = opts.main_config.display(),
        ));
    }
    Style::flat().format(&mut entry, "");
    let mut runtimes = Table::new();
    runtimes.set_implicit(true);
    runtimes.insert(&opts.runtime_name, Item::Table(entry));
    let mut containerd = Table::new();
    containerd.set_implicit(true);
    containerd.insert("runtimes", Item::Table(runtimes));
    let mut plugin = Table::new();
    plugin.set_implicit(true);
    plugin.insert("containerd", Item::Table(containerd));
    let mut plugins = Table::new();
    plugins.set_implicit(true);
    plugins.insert(version.cri_runtime_plugin(), Item::Table(plugin));
    doc.insert("plugins", Item::Table(plugins));
    doc.to_string()
}

/// Indentation of the tables and keys gpu-mps writes, taken from the file around them so the
/// entry reads like its neighbours (containerd's own `config default` indents by nesting).
struct Style {
    header: String,
    keys: String,
    options_header: String,
    options_keys: String,
}

impl Style {
    fn flat() -> Style {
        Style {
            header: String::new(),
            keys: String::new(),
            options_header: String::new(),
            options_keys: String::new(),
        }
    }

    fn for_entry(root: &Table, version: ConfigVersion, base: Option<&str>) -> Style {
        let runtimes_path = version.runtimes_path();
        let base_table = base.and_then(|name| {
            lookup(root, &runtimes_path)
                .and_then(Item::as_table)
                .and_then(|r| r.get(name))
                .and_then(Item::as_table)
                .filter(|t| !t.is_dotted())
        });
        let deeper = |indent: &str| {
            if indent.is_empty() {
                String::new()
            } else {
                format!("{indent}  ")
            }
        };
        let (header, keys, options) = match base_table {
            Some(t) => {
                let header = header_indent(t);
                let keys = first_key_indent(t).unwrap_or_else(|| deeper(&header));
                (header, keys, t.get("options").and_then(Item::as_table))
            }
            None => {
                // The closest table with a header of its own along the path.
                let ancestor = (1..=runtimes_path.len()).rev().find_map(|depth| {
                    lookup(root, &runtimes_path[..depth])
                        .and_then(Item::as_table)
                        .filter(|t| !t.is_implicit() && t.position().is_some())
                });
                let header = ancestor
                    .map(|t| deeper(&first_key_indent(t).unwrap_or_else(|| header_indent(t))))
                    .unwrap_or_default();
                let keys = deeper(&header);
                (header, keys, None)
            }
        };
        let options_header = options.map(header_indent).unwrap_or_else(|| keys.clone());
        let options_keys = options
            .and_then(first_key_indent)
            .unwrap_or_else(|| deeper(&options_header));
        Style {
            header,
            keys,
            options_header,
            options_keys,
        }
    }

    /// Sets indentation on a freshly built entry (and its `options`), with `marker` as a comment
    /// above its header.
    fn format(&self, entry: &mut Table, marker: &str) {
        let prefix = if marker.is_empty() {
            format!("\n{}", self.header)
        } else {
            format!("\n{h}# {marker}\n{h}", h = self.header)
        };
        entry.decor_mut().set_prefix(prefix);
        indent_keys(entry, &self.keys);
        if let Some(options) = entry.get_mut("options").and_then(Item::as_table_mut) {
            options
                .decor_mut()
                .set_prefix(format!("\n{}", self.options_header));
            indent_keys(options, &self.options_keys);
        }
    }
}

fn indent_keys(table: &mut Table, indent: &str) {
    let keys: Vec<String> = table
        .iter()
        .filter(|(_, i)| i.is_value())
        .map(|(k, _)| k.to_owned())
        .collect();
    for key in keys {
        if let Some(mut k) = table.key_mut(&key) {
            k.leaf_decor_mut().set_prefix(indent);
            k.leaf_decor_mut().set_suffix(" ");
        }
        if let Some(v) = table.get_mut(&key).and_then(Item::as_value_mut) {
            v.decor_mut().set_prefix(" ");
            v.decor_mut().set_suffix("");
        }
    }
}

/// The spaces before a table's header (after the last newline of its prefix).
fn header_indent(t: &Table) -> String {
    trailing_blank(t.decor().prefix().and_then(|p| p.as_str()).unwrap_or(""))
}

fn first_key_indent(t: &Table) -> Option<String> {
    let (key, _) = t.iter().find(|(_, i)| i.is_value())?;
    let prefix = t.key(key)?.leaf_decor().prefix()?.as_str()?;
    Some(trailing_blank(prefix))
}

fn trailing_blank(s: &str) -> String {
    let tail = s.rsplit('\n').next().unwrap_or("");
    if tail.chars().all(|c| c == ' ' || c == '\t') {
        tail.to_owned()
    } else {
        String::new()
    }
}

/// Whether an `imports` entry of the main config already loads the drop-in.
fn imports_cover(doc: &DocumentMut, opts: &InstallOptions, path: &Path) -> Result<bool, RegistrationError> {
    let Some(imports) = imports_array(doc, path)? else {
        return Ok(false);
    };
    let target = opts.drop_in.display().to_string();
    for entry in imports.iter() {
        let pattern = resolve_import(entry, opts, path)?;
        if glob_match(&pattern, &target) {
            return Ok(true);
        }
    }
    Ok(false)
}

fn add_import(doc: &mut DocumentMut, import: &str, path: &Path) -> Result<(), RegistrationError> {
    if imports_array(doc, path)?.is_none() {
        let mut array = Array::new();
        array.push(import);
        let mut imports = Value::Array(array);
        imports.decor_mut().set_prefix(" ");
        imports.decor_mut().set_suffix(format!("  {IMPORTS_MARKER}"));
        doc.insert("imports", Item::Value(imports));
        return Ok(());
    }
    if let Some(array) = doc.get_mut("imports").and_then(Item::as_array_mut) {
        // One path per line stays one per line.
        let own_line = array
            .iter()
            .last()
            .and_then(|v| v.decor().prefix())
            .and_then(|p| p.as_str())
            .filter(|p| p.contains('\n'))
            .map(str::to_owned);
        match own_line {
            Some(prefix) => array.push_formatted(Value::from(import).decorated(prefix, "")),
            None => array.push(import),
        }
    }
    Ok(())
}

/// Removes the `imports` entries that name the drop-in itself (globs that cover it stay), and
/// the whole line when gpu-mps added it and nothing else is left in it.
fn remove_import(doc: &mut DocumentMut, opts: &InstallOptions, path: &Path) -> Result<(), RegistrationError> {
    let Some(imports) = imports_array(doc, path)? else {
        return Ok(());
    };
    let mut ours = Vec::new();
    for (i, entry) in imports.iter().enumerate() {
        if Path::new(&resolve_import(entry, opts, path)?) == opts.drop_in {
            ours.push(i);
        }
    }
    if ours.is_empty() {
        return Ok(());
    }
    let added_by_us = doc
        .get("imports")
        .and_then(Item::as_value)
        .and_then(|v| v.decor().suffix())
        .and_then(|s| s.as_str())
        .is_some_and(|s| s.contains(IMPORTS_MARKER));
    if let Some(array) = doc.get_mut("imports").and_then(Item::as_array_mut) {
        for i in ours.into_iter().rev() {
            array.remove(i);
        }
        if array.is_empty() && added_by_us {
            doc.remove("imports");
        }
    }
    Ok(())
}

fn imports_array<'a>(doc: &'a DocumentMut, path: &Path) -> Result<Option<&'a Array>, RegistrationError> {
    match doc.get("imports") {
        None => Ok(None),
        Some(item) => item
            .as_array()
            .map(Some)
            .ok_or_else(|| RegistrationError::Layout {
                path: path.into(),
                key: "imports".into(),
                message: "expected an array of file paths".into(),
            }),
    }
}

/// An import as containerd resolves it: relative to the main config's directory.
fn resolve_import(entry: &Value, opts: &InstallOptions, path: &Path) -> Result<String, RegistrationError> {
    let import = entry.as_str().ok_or_else(|| RegistrationError::Layout {
        path: path.into(),
        key: "imports".into(),
        message: format!("{} is not a string", entry.to_string().trim()),
    })?;
    if Path::new(import).is_absolute() {
        return Ok(import.to_owned());
    }
    let dir = opts.main_config.parent().unwrap_or(Path::new("/"));
    Ok(dir.join(import).display().to_string())
}

/// Go's `filepath.Match`, which containerd applies to imports: `*` and `?` stop at `/`,
/// `[a-z]` and `[^a-z]` are classes, `\` escapes.
pub fn glob_match(pattern: &str, name: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let n: Vec<char> = name.chars().collect();
    glob_at(&p, &n)
}

fn glob_at(p: &[char], n: &[char]) -> bool {
    match p.first() {
        None => n.is_empty(),
        Some('*') => (0..=n.len())
            .take_while(|&i| i == 0 || n[i - 1] != '/')
            .any(|i| glob_at(&p[1..], &n[i..])),
        Some('?') => n.first().is_some_and(|&c| c != '/') && glob_at(&p[1..], &n[1..]),
        Some('[') => {
            let Some((&c, rest)) = n.split_first() else {
                return false;
            };
            match class_match(&p[1..], c) {
                Some((true, after)) => glob_at(after, rest),
                _ => false,
            }
        }
        Some('\\') if p.len() > 1 => n.first() == Some(&p[1]) && glob_at(&p[2..], &n[1..]),
        Some(&c) => n.first() == Some(&c) && glob_at(&p[1..], &n[1..]),
    }
}

/// Matches `c` against a class body (after `[`); returns the match and the pattern after `]`.
fn class_match(p: &[char], c: char) -> Option<(bool, &[char])> {
    let (negate, mut i) = if p.first() == Some(&'^') {
        (true, 1)
    } else {
        (false, 0)
    };
    let mut matched = false;
    let mut first = true;
    while i < p.len() {
        if p[i] == ']' && !first {
            return Some((matched != negate, &p[i + 1..]));
        }
        first = false;
        let lo = if p[i] == '\\' {
            i += 1;
            *p.get(i)?
        } else {
            p[i]
        };
        i += 1;
        let hi = if p.get(i) == Some(&'-') && p.get(i + 1).is_some_and(|&h| h != ']') {
            i += 2;
            p[i - 1]
        } else {
            lo
        };
        if lo <= c && c <= hi && c != '/' {
            matched = true;
        }
    }
    None
}

fn lookup<'a>(root: &'a Table, path: &[&str]) -> Option<&'a Item> {
    let (first, rest) = path.split_first()?;
    let mut item = root.get(first)?;
    for key in rest {
        item = item.as_table_like()?.get(key)?;
    }
    Some(item)
}

fn lookup_mut<'a>(root: &'a mut Table, path: &[&str]) -> Option<&'a mut Item> {
    let (first, rest) = path.split_first()?;
    let mut item = root.get_mut(first)?;
    for key in rest {
        item = item.as_table_like_mut()?.get_mut(key)?;
    }
    Some(item)
}

/// The table at `path`, created (without headers of its own) where missing. Tables written as
/// dotted keys or inline are refused: gpu-mps only adds `[table]` sections.
fn table_at<'a>(root: &'a mut Table, path: &[&str], file: &Path) -> Result<&'a mut Table, RegistrationError> {
    let mut table = root;
    for (depth, key) in path.iter().enumerate() {
        let item = table.entry(key).or_insert_with(|| {
            let mut t = Table::new();
            t.set_implicit(true);
            Item::Table(t)
        });
        table = match item {
            Item::Table(t) if !t.is_dotted() => t,
            _ => {
                return Err(RegistrationError::Layout {
                    path: file.into(),
                    key: dotted(&path[..=depth]),
                    message: "written inline or as dotted keys; gpu-mps only edits [table] sections: rewrite it as one and rerun".into(),
                });
            }
        };
    }
    Ok(table)
}

fn dotted(path: &[&str]) -> String {
    path.iter()
        .map(|k| {
            if k.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
            {
                (*k).to_owned()
            } else {
                format!("{k:?}")
            }
        })
        .collect::<Vec<_>>()
        .join(".")
}

/// A table-like item (table, inline table, dotted keys) as a plain table of values, without the
/// formatting of the file it came from.
fn plain_table(t: &dyn TableLike) -> Table {
    let mut out = Table::new();
    for (key, item) in t.iter() {
        let item = match item {
            Item::Table(sub) => Item::Table(plain_table(sub)),
            Item::Value(Value::InlineTable(sub)) => Item::Table(plain_table(sub)),
            Item::Value(v) => Item::Value(plain_value(v)),
            other => other.clone(),
        };
        out.insert(key, item);
    }
    out
}

/// A value in toml_edit's default formatting, so a copied entry quotes like the rest of the
/// entry whatever quoting the file used.
fn plain_value(v: &Value) -> Value {
    match v {
        Value::String(s) => Value::from(s.value().as_str()),
        Value::Array(a) => Value::Array(a.iter().map(plain_value).collect()),
        other => {
            let mut other = other.clone();
            other.decor_mut().clear();
            other
        }
    }
}

/// Equal as TOML data, whatever the formatting, quoting or key order.
fn same_item(a: &Item, b: &Item) -> bool {
    match (a.as_table_like(), b.as_table_like()) {
        (Some(x), Some(y)) => {
            x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| same_item(v, w)))
        }
        (None, None) => match (a.as_value(), b.as_value()) {
            (Some(x), Some(y)) => same_value(x, y),
            _ => false,
        },
        _ => false,
    }
}

fn same_value(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::String(x), Value::String(y)) => x.value() == y.value(),
        (Value::Integer(x), Value::Integer(y)) => x.value() == y.value(),
        (Value::Float(x), Value::Float(y)) => x.value() == y.value(),
        (Value::Boolean(x), Value::Boolean(y)) => x.value() == y.value(),
        (Value::Datetime(x), Value::Datetime(y)) => x.value() == y.value(),
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y.iter()).all(|(p, q)| same_value(p, q))
        }
        (Value::InlineTable(x), Value::InlineTable(y)) => {
            x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| same_value(v, w)))
        }
        _ => false,
    }
}

/// Checks `containerd config dump` output: the runtime is in effect as registered, and the CRI
/// plugin will load (its default runtime has an entry). Returns warnings about settings that
/// differ from the runtime the entry copied (e.g. SystemdCgroup set in another drop-in).
pub fn check_effective(dump: &str, opts: &InstallOptions) -> Result<Vec<String>, RegistrationError> {
    let fail = |message: String| RegistrationError::NotInEffect {
        config: opts.main_config.clone(),
        message,
    };
    let doc = dump
        .parse::<DocumentMut>()
        .map_err(|e| fail(format!("not TOML: {}", one_line(&e.to_string()))))?;
    let (version, runtimes) =
        effective_runtimes(&doc).ok_or_else(|| fail("it has no CRI runtimes at all".into()))?;
    let name = &opts.runtime_name;
    let entry = runtimes.get(name).and_then(Item::as_table_like).ok_or_else(|| {
        fail(format!(
            "runtime {name:?} is missing: an import that redefines the {} plugin may hide it (containerd 1.x replaces whole plugin tables)",
            version.cri_runtime_plugin()
        ))
    })?;
    let runtime_type = entry.get("runtime_type").and_then(Item::as_str).unwrap_or("");
    if runtime_type != RUNC_SHIM {
        return Err(fail(format!(
            "runtime {name:?} has runtime_type = {runtime_type:?}, expected {RUNC_SHIM:?}"
        )));
    }
    let options = entry.get("options").and_then(Item::as_table_like);
    let binary = options
        .and_then(|o| o.get("BinaryName"))
        .and_then(Item::as_str)
        .unwrap_or("");
    let shim = opts.shim_path.display().to_string();
    if binary != shim {
        return Err(fail(format!(
            "runtime {name:?} has options.BinaryName = {binary:?}, expected {shim:?}"
        )));
    }
    for key in ["pod_annotations", "container_annotations"] {
        let listed: Vec<&str> = entry
            .get(key)
            .and_then(Item::as_array)
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        if let Some(missing) = annotation_patterns(key).iter().find(|p| !listed.contains(*p)) {
            return Err(fail(format!(
                "runtime {name:?} has {key} = {listed:?}, without {missing:?}"
            )));
        }
    }
    check_default_runtime(&doc, version, runtimes).map_err(fail)?;
    let mut warnings = Vec::new();
    let base_name = opts.base_runtime.as_deref().unwrap_or("runc");
    let base_options = runtimes
        .get(base_name)
        .and_then(Item::as_table_like)
        .and_then(|b| b.get("options"))
        .and_then(Item::as_table_like);
    if let (Some(ours), Some(theirs)) = (options, base_options) {
        let mut keys: Vec<&str> = ours
            .iter()
            .map(|(k, _)| k)
            .chain(theirs.iter().map(|(k, _)| k))
            .collect();
        keys.sort_unstable();
        keys.dedup();
        for key in keys.into_iter().filter(|k| *k != "BinaryName") {
            let (a, b) = (ours.get(key), theirs.get(key));
            let same = match (a, b) {
                (Some(a), Some(b)) => same_item(a, b),
                // containerd decodes runc options as protobuf: unset is the zero value.
                (Some(x), None) | (None, Some(x)) => is_zero(x),
                (None, None) => true,
            };
            if !same {
                warnings.push(format!(
                    "runtime {name:?} has options.{key} = {}, but {base_name:?} has {}: set it in the {base_name:?} entry of {} and rerun install-containerd",
                    show(a),
                    show(b),
                    opts.main_config.display()
                ));
            }
        }
    }
    Ok(warnings)
}

/// Checks `containerd config dump` output after uninstall: the runtime is gone and the CRI plugin
/// will still load.
pub fn check_removed(dump: &str, opts: &InstallOptions) -> Result<(), RegistrationError> {
    let fail = |message: String| RegistrationError::NotInEffect {
        config: opts.main_config.clone(),
        message,
    };
    let doc = dump
        .parse::<DocumentMut>()
        .map_err(|e| fail(format!("not TOML: {}", one_line(&e.to_string()))))?;
    let Some((version, runtimes)) = effective_runtimes(&doc) else {
        return Ok(());
    };
    if runtimes.contains_key(&opts.runtime_name) {
        return Err(fail(format!(
            "runtime {:?} is still configured after uninstall: another file defines it",
            opts.runtime_name
        )));
    }
    check_default_runtime(&doc, version, runtimes).map_err(fail)
}

/// The CRI runtimes of a `config dump`, in whichever layout containerd printed it.
fn effective_runtimes(doc: &DocumentMut) -> Option<(ConfigVersion, &dyn TableLike)> {
    [ConfigVersion::V3, ConfigVersion::V2].into_iter().find_map(|v| {
        lookup(doc.as_table(), &v.runtimes_path())
            .and_then(Item::as_table_like)
            .map(|r| (v, r))
    })
}

/// The CRI plugin refuses to load when its default runtime has no entry (containerd 1.x checks
/// this at start; `config dump` does not).
fn check_default_runtime(
    doc: &DocumentMut,
    version: ConfigVersion,
    runtimes: &dyn TableLike,
) -> Result<(), String> {
    let containerd = lookup(doc.as_table(), &version.containerd_path()).and_then(Item::as_table_like);
    let default = containerd
        .and_then(|c| c.get("default_runtime_name"))
        .and_then(Item::as_str)
        .unwrap_or("runc");
    if !default.is_empty() && !runtimes.contains_key(default) {
        return Err(format!(
            "default_runtime_name = {default:?} has no entry, so the CRI plugin will not load: add a [...runtimes.{default}] entry"
        ));
    }
    Ok(())
}

fn is_zero(item: &Item) -> bool {
    match item.as_value() {
        Some(Value::String(s)) => s.value().is_empty(),
        Some(Value::Integer(i)) => *i.value() == 0,
        Some(Value::Float(f)) => *f.value() == 0.0,
        Some(Value::Boolean(b)) => !*b.value(),
        Some(Value::Array(a)) => a.is_empty(),
        Some(Value::InlineTable(t)) => t.is_empty(),
        Some(Value::Datetime(_)) => false,
        None => item.as_table_like().is_some_and(|t| t.is_empty()),
    }
}

fn show(item: Option<&Item>) -> String {
    item.and_then(Item::as_value)
        .map(|v| v.to_string().trim().to_owned())
        .unwrap_or_else(|| "(unset)".into())
}

// ---- I/O ----------------------------------------------------------------------------------------

impl ExistingFiles {
    pub fn read(opts: &InstallOptions) -> Result<Self, RegistrationError> {
        Ok(ExistingFiles {
            main: read_optional(&opts.on_host(&opts.main_config))?,
            drop_in: read_optional(&opts.on_host(&opts.drop_in))?,
        })
    }
}

fn read_optional(path: &Path) -> Result<Option<String>, RegistrationError> {
    match fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(RegistrationError::Io {
            path: path.into(),
            action: "read",
            source,
        }),
    }
}

/// Makes the changes in order: each write goes to a temporary file in the same directory, is
/// synced and renamed over the target (keeping the target's mode); a main config that existed is
/// first copied to `<name>.gpu-mps-backup.<unix seconds>`. Returns the backups made. A change
/// that fails puts the files changed before it back as they were.
pub fn apply(plan: &InstallPlan) -> Result<Applied, RegistrationError> {
    let mut applied = Applied::default();
    for (done, change) in plan.changes.iter().enumerate() {
        if let Err(e) = apply_one(change, &mut applied) {
            return Err(roll_back(&plan.changes[..done], &applied, e));
        }
    }
    Ok(applied)
}

/// What [`apply`] made besides the changes themselves, for a roll back.
#[derive(Debug, Clone, Default)]
pub struct Applied {
    /// Copies of the main config made before it was changed.
    pub backups: Vec<PathBuf>,
    /// Directories created for a new file (conf.d).
    created_dirs: Vec<PathBuf>,
}

fn apply_one(change: &FileChange, applied: &mut Applied) -> Result<(), RegistrationError> {
    match change {
        FileChange::Write {
            path,
            previous,
            contents,
            backup,
        } => {
            if *backup && previous.is_some() {
                applied.backups.push(back_up(path)?);
            }
            if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty() && !d.exists()) {
                applied.created_dirs.push(dir.to_path_buf());
            }
            write_atomic(path, contents)
        }
        FileChange::Remove { path, .. } => remove_if_present(path),
    }
}

fn remove_if_present(path: &Path) -> Result<(), RegistrationError> {
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(RegistrationError::Io {
            path: path.into(),
            action: "remove",
            source,
        }),
    }
}

/// Undoes `applied` (newest first): each file gets its previous text back, byte for byte, or is
/// removed if it did not exist; the backups go too, since nothing changed. Returns `cause`,
/// saying what was put back or, if that failed, where the backups are.
fn roll_back(changes: &[FileChange], applied: &Applied, cause: RegistrationError) -> RegistrationError {
    let backups = &applied.backups;
    let undone = changes.iter().rev().try_for_each(|change| match change {
        FileChange::Write {
            path,
            previous: Some(previous),
            ..
        }
        | FileChange::Remove { path, previous } => write_atomic(path, previous),
        FileChange::Write {
            path, previous: None, ..
        } => remove_if_present(path),
    });
    match undone {
        Ok(()) => {
            for backup in backups {
                let _ = fs::remove_file(backup);
            }
            // Only while empty: a directory that held anything else stays.
            for dir in applied.created_dirs.iter().rev() {
                let _ = fs::remove_dir(dir);
            }
            let files: Vec<String> = changes.iter().map(|c| c.path().display().to_string()).collect();
            if files.is_empty() {
                return cause;
            }
            RegistrationError::RolledBack {
                cause: Box::new(cause),
                files: files.join(", "),
            }
        }
        Err(rollback) => RegistrationError::RollbackFailed {
            cause: Box::new(cause),
            rollback: Box::new(rollback),
            backups: if backups.is_empty() {
                "none".into()
            } else {
                backups
                    .iter()
                    .map(|b| b.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            },
        },
    }
}

fn back_up(path: &Path) -> Result<PathBuf, RegistrationError> {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut backup = path.with_file_name(format!("{name}.gpu-mps-backup.{secs}"));
    let mut n = 1;
    while backup.exists() {
        backup = path.with_file_name(format!("{name}.gpu-mps-backup.{secs}.{n}"));
        n += 1;
    }
    fs::copy(path, &backup).map_err(|source| RegistrationError::Io {
        path: backup.clone(),
        action: "back up",
        source,
    })?;
    Ok(backup)
}

fn write_atomic(path: &Path, contents: &str) -> Result<(), RegistrationError> {
    let io_err = |action: &'static str| {
        move |source: io::Error| RegistrationError::Io {
            path: path.into(),
            action,
            source,
        }
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        fs::create_dir_all(dir).map_err(io_err("create the directory of"))?;
    }
    // Durable: /etc survives a power loss; a root-only config stays root-only.
    files::replace_file(
        path,
        contents.as_bytes(),
        FileMode::KeepExisting { default: 0o644 },
        Durability::Durable,
    )
    .map_err(io_err("write"))
}

/// `containerd --version` output to (major, minor), for Debian
/// (`containerd github.com/containerd/containerd 1.6.20~ds1 1.6.20~ds1-1+deb12u3`) and upstream
/// (`containerd containerd.io v1.7.27 05044ec...`) builds.
pub fn parse_containerd_version(output: &str) -> Option<(u32, u32)> {
    output.split_whitespace().skip(1).find_map(|field| {
        let v = field.strip_prefix('v').unwrap_or(field);
        let mut parts = v.split('.');
        let major = parts.next()?.parse().ok()?;
        let minor: String = parts.next()?.chars().take_while(char::is_ascii_digit).collect();
        Some((major, minor.parse().ok()?))
    })
}

/// Runs the host's containerd: directly, or through chroot when the host root is elsewhere.
fn containerd_command(opts: &InstallOptions, binary: &Path) -> Command {
    if opts.host_root == Path::new("/") {
        Command::new(binary)
    } else {
        let mut c = Command::new("chroot");
        c.arg(&opts.host_root).arg(binary);
        c
    }
}

fn run_containerd(
    opts: &InstallOptions,
    binary: &Path,
    args: &[&std::ffi::OsStr],
) -> Result<String, RegistrationError> {
    let out = containerd_command(opts, binary)
        .args(args)
        .output()
        .map_err(|e| RegistrationError::Containerd {
            binary: binary.into(),
            message: format!("cannot run it: {e}"),
        })?;
    let stderr = one_line(&String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    // containerd 1.x prints "failed to load TOML" and exits 0 with nothing on stdout.
    if !out.status.success() || stdout.trim().is_empty() {
        return Err(RegistrationError::Containerd {
            binary: binary.into(),
            message: format!("{}: {stderr}", out.status),
        });
    }
    Ok(stdout)
}

/// The (major, minor) version of the host's containerd.
pub fn containerd_version(opts: &InstallOptions, binary: &Path) -> Result<(u32, u32), RegistrationError> {
    let out = run_containerd(opts, binary, &["--version".as_ref()])?;
    parse_containerd_version(&out).ok_or_else(|| RegistrationError::Containerd {
        binary: binary.into(),
        message: format!("cannot read a version from {:?}", out.trim()),
    })
}

/// containerd's effective config: the main config with its imports merged, as containerd reads it.
pub fn dump_config(opts: &InstallOptions, binary: &Path) -> Result<String, RegistrationError> {
    run_containerd(
        opts,
        binary,
        &[
            "--config".as_ref(),
            opts.main_config.as_os_str(),
            "config".as_ref(),
            "dump".as_ref(),
        ],
    )
}

/// The containerd binary on the host, as a host path: the first of `$PATH` and the usual
/// directories that holds one.
pub fn find_containerd(opts: &InstallOptions) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/local/bin", "/usr/bin", "/bin"].map(PathBuf::from))
        .map(|dir| dir.join("containerd"))
        .find(|candidate| candidate.is_absolute() && opts.on_host(candidate).is_file())
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
}

impl Outcome {
    /// containerd reads its config only at start: a changed config needs a restart.
    pub fn needs_containerd_restart(&self) -> bool {
        !self.plan.is_empty()
    }
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
    let plan = plan_install(&ExistingFiles::read(&opts)?, &opts)?;
    let mut warnings = plan.notes.clone();
    if dry_run {
        return Ok(Outcome {
            plan,
            backups: Vec::new(),
            verified: false,
            warnings,
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
    })
}

/// Removes the runtime: plan, apply unless `dry_run`, then check that containerd still reads its
/// config and no longer has the runtime.
pub fn uninstall(
    opts: &InstallOptions,
    containerd: Option<&Path>,
    dry_run: bool,
) -> Result<Outcome, RegistrationError> {
    let plan = plan_uninstall(&ExistingFiles::read(opts)?, opts)?;
    if dry_run {
        return Ok(Outcome {
            plan,
            backups: Vec::new(),
            verified: false,
            warnings: Vec::new(),
        });
    }
    let applied = apply(&plan)?;
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
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Debian's /etc/containerd/config.toml (bookworm, trixie and sid ship the same file).
    const DEBIAN: &str = r#"version = 2

[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
    [plugins."io.containerd.grpc.v1.cri".cni]
      bin_dir = "/usr/lib/cni"
      conf_dir = "/etc/cni/net.d"
  [plugins."io.containerd.internal.v1.opt"]
    path = "/var/lib/containerd/opt"
"#;

    /// The shape of `containerd config default` on 1.x, with a kubeadm-style runc entry.
    const V2_KUBEADM: &str = r#"# tuned for kubeadm
disabled_plugins = []
imports = []
version = 2

[plugins]

  [plugins."io.containerd.grpc.v1.cri"]
    sandbox_image = "registry.k8s.io/pause:3.9"  # pinned

    [plugins."io.containerd.grpc.v1.cri".containerd]
      default_runtime_name = "runc"

      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes]

        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
          runtime_type = "io.containerd.runc.v2"
          pod_annotations = ["example.com/*"]

          [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
            BinaryName = ""
            SystemdCgroup = true
"#;

    const V3: &str = r#"version = 3
root = '/var/lib/containerd'

# kept
[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
  runtime_type = 'io.containerd.runc.v2'
  [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
    SystemdCgroup = true
"#;

    fn opts(major: Option<u32>) -> InstallOptions {
        InstallOptions {
            containerd_major: major,
            ..InstallOptions::default()
        }
    }

    fn files(main: Option<&str>) -> ExistingFiles {
        ExistingFiles {
            main: main.map(str::to_owned),
            drop_in: None,
        }
    }

    /// The files after the plan, as `ExistingFiles`.
    fn after(existing: &ExistingFiles, plan: &InstallPlan) -> ExistingFiles {
        let mut out = existing.clone();
        for change in &plan.changes {
            let slot = if change.path() == Path::new(MAIN_CONFIG) {
                &mut out.main
            } else {
                &mut out.drop_in
            };
            *slot = match change {
                FileChange::Write { contents, .. } => Some(contents.clone()),
                FileChange::Remove { .. } => None,
            };
        }
        out
    }

    fn written<'a>(plan: &'a InstallPlan, path: &str) -> &'a str {
        plan.changes
            .iter()
            .find_map(|c| match c {
                FileChange::Write {
                    path: p, contents, ..
                } if p == Path::new(path) => Some(contents.as_str()),
                _ => None,
            })
            .unwrap_or_else(|| panic!("{path} not written by {plan:#?}"))
    }

    fn get<'a>(text: &str, path: &[&str], doc: &'a mut Option<DocumentMut>) -> Option<&'a Item> {
        *doc = Some(text.parse().expect("valid TOML"));
        lookup(doc.as_ref().expect("set").as_table(), path)
    }

    fn entry_path(version: ConfigVersion, rest: &[&'static str]) -> Vec<&'static str> {
        let mut p = version.runtimes_path().to_vec();
        p.push(RUNTIME_NAME);
        p.extend_from_slice(rest);
        p
    }

    /// Every line of `before` is still there, in order: only lines were added.
    fn only_added(before: &str, after: &str) {
        let diff = similar::TextDiff::from_lines(before, after);
        let removed: Vec<_> = diff
            .iter_all_changes()
            .filter(|c| c.tag() == similar::ChangeTag::Delete)
            .map(|c| c.to_string())
            .collect();
        assert!(removed.is_empty(), "lines removed: {removed:?}\n{after}");
    }

    #[test]
    fn version_detection() {
        let p = Path::new("/c.toml");
        assert_eq!(detect_version("", p).expect("empty"), None);
        assert_eq!(detect_version("# only a comment\n", p).expect("comment"), None);
        assert_eq!(
            detect_version("version = 2", p).expect("2"),
            Some(ConfigVersion::V2)
        );
        assert_eq!(detect_version(V3, p).expect("3"), Some(ConfigVersion::V3));
        let e = detect_version("[plugins.cri]\nx = 1", p)
            .expect_err("v1")
            .to_string();
        assert!(e.starts_with("/c.toml: has no `version` key"), "{e}");
        let e = detect_version("version = 1", p).expect_err("1").to_string();
        assert!(e.contains("/c.toml: version = 1"), "{e}");
        let e = detect_version("version = \"2\"", p)
            .expect_err("string")
            .to_string();
        assert!(e.contains("version = \"2\""), "{e}");
        let e = detect_version("version = [", p)
            .expect_err("bad TOML")
            .to_string();
        assert!(
            e.starts_with("/c.toml: not valid TOML") && !e.contains('\n'),
            "{e}"
        );
    }

    #[test]
    fn debian_config_under_containerd_1x_gets_runc_and_the_entry_in_place() {
        let existing = files(Some(DEBIAN));
        let plan = plan_install(&existing, &opts(Some(1))).expect("plan");
        assert_eq!(
            (plan.version, plan.placement),
            (Some(ConfigVersion::V2), Some(Placement::MainConfig))
        );
        assert_eq!(plan.changes.len(), 1);
        let text = written(&plan, MAIN_CONFIG);
        only_added(DEBIAN, text);
        let v = ConfigVersion::V2;
        let mut d = None;
        assert_eq!(
            get(text, &entry_path(v, &["options", "BinaryName"]), &mut d).and_then(Item::as_str),
            Some(SHIM_PATH)
        );
        assert_eq!(
            get(text, &entry_path(v, &["runtime_type"]), &mut d).and_then(Item::as_str),
            Some(RUNC_SHIM)
        );
        let pods = get(text, &entry_path(v, &["pod_annotations"]), &mut d)
            .and_then(Item::as_array)
            .expect("array");
        assert_eq!(
            pods.iter().filter_map(Value::as_str).collect::<Vec<_>>(),
            POD_ANNOTATION_PATTERNS
        );
        let containers = get(text, &entry_path(v, &["container_annotations"]), &mut d)
            .and_then(Item::as_array)
            .expect("array");
        assert_eq!(
            containers.iter().filter_map(Value::as_str).collect::<Vec<_>>(),
            CONTAINER_ANNOTATION_PATTERNS,
            "CDI device annotations must reach the spec"
        );
        let mut runc = v.runtimes_path().to_vec();
        runc.extend(["runc", "runtime_type"]);
        assert_eq!(get(text, &runc, &mut d).and_then(Item::as_str), Some(RUNC_SHIM));
        assert!(
            text.contains(ENTRY_MARKER) && text.contains(RUNC_MARKER),
            "{text}"
        );
        // The new tables sit inside the CRI plugin, before the next plugin, indented like it.
        let entry_at = text.find("runtimes.gpu-mps]").expect("entry");
        assert!(
            entry_at < text.find("io.containerd.internal.v1.opt").expect("opt"),
            "{text}"
        );
        assert!(text.contains("\n    [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.gpu-mps]\n      runtime_type"), "{text}");

        let plan2 = plan_install(&after(&existing, &plan), &opts(Some(1))).expect("plan again");
        assert!(plan2.is_empty(), "second install changed: {}", plan2.diff());
    }

    #[test]
    fn runc_settings_are_copied_and_formatting_kept() {
        let existing = files(Some(V2_KUBEADM));
        let plan = plan_install(&existing, &opts(Some(1))).expect("plan");
        let text = written(&plan, MAIN_CONFIG);
        only_added(V2_KUBEADM, text);
        let v = ConfigVersion::V2;
        let mut d = None;
        assert_eq!(
            get(text, &entry_path(v, &["options", "SystemdCgroup"]), &mut d).and_then(Item::as_bool),
            Some(true)
        );
        let pods = get(text, &entry_path(v, &["pod_annotations"]), &mut d)
            .and_then(Item::as_array)
            .expect("array");
        let pods: Vec<_> = pods.iter().filter_map(Value::as_str).collect();
        assert_eq!(pods, ["gpu-mps.io/*", "*.gpu-mps.io/*", "example.com/*"]);
        assert!(!text.contains(RUNC_MARKER), "runc existed already: {text}");
        // Right after runc's options, at runc's indentation.
        assert!(
            text.contains("SystemdCgroup = true\n\n        # gpu-mps runtime handler"),
            "{text}"
        );
        assert!(text.contains("\n          [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.gpu-mps.options]\n            BinaryName = \"/usr/local/bin/gpu-mps-shim\"\n            SystemdCgroup = true\n"), "{text}");
        assert!(
            plan_install(&after(&existing, &plan), &opts(Some(1)))
                .expect("again")
                .is_empty()
        );
    }

    #[test]
    fn runc_binary_name_is_reported() {
        let main = V2_KUBEADM.replace("BinaryName = \"\"", "BinaryName = \"/opt/runc\"");
        let plan = plan_install(&files(Some(&main)), &opts(Some(1))).expect("plan");
        assert!(
            plan.notes.iter().any(|n| n.contains("runc_path = \"/opt/runc\"")),
            "{:?}",
            plan.notes
        );
        let mut d = None;
        let text = written(&plan, MAIN_CONFIG);
        let binary = get(
            text,
            &entry_path(ConfigVersion::V2, &["options", "BinaryName"]),
            &mut d,
        );
        assert_eq!(binary.and_then(Item::as_str), Some(SHIM_PATH));
    }

    #[test]
    fn version_3_goes_to_a_drop_in_and_an_import() {
        let existing = files(Some(V3));
        let plan = plan_install(&existing, &opts(Some(2))).expect("plan");
        assert_eq!(
            (plan.version, plan.placement),
            (Some(ConfigVersion::V3), Some(Placement::DropIn))
        );
        // The drop-in first: containerd 1.x refuses a config whose plain import is missing.
        assert_eq!(
            plan.changes.iter().map(FileChange::path).collect::<Vec<_>>(),
            [Path::new(DROP_IN), Path::new(MAIN_CONFIG)]
        );
        let main = written(&plan, MAIN_CONFIG);
        only_added(V3, main);
        assert!(
            main.starts_with(&format!(
                "version = 3\nroot = '/var/lib/containerd'\nimports = [\"/etc/containerd/conf.d/gpu-mps.toml\"]  {IMPORTS_MARKER}\n"
            )),
            "{main}"
        );
        let drop_in = written(&plan, DROP_IN);
        let mut d = None;
        assert_eq!(
            get(drop_in, &["version"], &mut d).and_then(Item::as_integer),
            Some(3)
        );
        let v = ConfigVersion::V3;
        assert_eq!(
            get(drop_in, &entry_path(v, &["options", "BinaryName"]), &mut d).and_then(Item::as_str),
            Some(SHIM_PATH)
        );
        assert_eq!(
            get(drop_in, &entry_path(v, &["options", "SystemdCgroup"]), &mut d).and_then(Item::as_bool),
            Some(true)
        );
        assert!(
            drop_in.contains("\n[plugins.\"io.containerd.cri.v1.runtime\".containerd.runtimes.gpu-mps]\n"),
            "{drop_in}"
        );

        let installed = after(&existing, &plan);
        assert!(
            plan_install(&installed, &opts(Some(2)))
                .expect("again")
                .is_empty()
        );
        // Without knowing containerd's version the layout of the file decides.
        assert!(
            plan_install(&installed, &opts(None))
                .expect("unknown containerd")
                .is_empty()
        );

        let removal = plan_uninstall(&installed, &opts(None)).expect("uninstall");
        // The main config first, for the same reason.
        assert_eq!(
            removal.changes.iter().map(FileChange::path).collect::<Vec<_>>(),
            [Path::new(MAIN_CONFIG), Path::new(DROP_IN)]
        );
        let restored = after(&installed, &removal);
        assert_eq!(restored, files(Some(V3)));
        assert!(plan_uninstall(&restored, &opts(None)).expect("again").is_empty());
    }

    #[test]
    fn imports_that_already_cover_the_drop_in_are_left_alone() {
        for import in [
            "/etc/containerd/conf.d/*.toml",
            "conf.d/*.toml",
            "/etc/containerd/conf.d/gpu-mps.toml",
        ] {
            let main = V3.replace("root =", &format!("imports = [{import:?}]\nroot ="));
            let plan = plan_install(&files(Some(&main)), &opts(Some(2))).expect("plan");
            assert_eq!(
                plan.changes.iter().map(FileChange::path).collect::<Vec<_>>(),
                [Path::new(DROP_IN)],
                "{import}"
            );
        }
        let main = V3.replace("root =", "imports = ['/etc/other/*.toml']\nroot =");
        let plan = plan_install(&files(Some(&main)), &opts(Some(2))).expect("plan");
        assert!(
            written(&plan, MAIN_CONFIG)
                .contains("imports = ['/etc/other/*.toml', \"/etc/containerd/conf.d/gpu-mps.toml\"]")
        );
        // Uninstall removes only the entry it added.
        let removal = plan_uninstall(&after(&files(Some(&main)), &plan), &opts(None)).expect("uninstall");
        assert_eq!(written(&removal, MAIN_CONFIG), main);
    }

    #[test]
    fn version_2_under_containerd_2_uses_a_version_2_drop_in() {
        let existing = files(Some(DEBIAN));
        let plan = plan_install(&existing, &opts(Some(2))).expect("plan");
        assert_eq!(
            (plan.version, plan.placement),
            (Some(ConfigVersion::V2), Some(Placement::DropIn))
        );
        let drop_in = written(&plan, DROP_IN);
        assert!(
            drop_in.contains("version = 2\n") && drop_in.contains("io.containerd.grpc.v1.cri"),
            "{drop_in}"
        );
        let main = written(&plan, MAIN_CONFIG);
        let import =
            format!("version = 2\nimports = [\"/etc/containerd/conf.d/gpu-mps.toml\"]  {IMPORTS_MARKER}\n");
        assert_eq!(main, DEBIAN.replace("version = 2\n", &import));
        let installed = after(&existing, &plan);
        assert_eq!(
            after(
                &installed,
                &plan_uninstall(&installed, &opts(None)).expect("uninstall")
            ),
            existing
        );
    }

    #[test]
    fn install_then_uninstall_under_containerd_1x_restores_the_file() {
        for original in [DEBIAN, V2_KUBEADM] {
            let existing = files(Some(original));
            let installed = after(&existing, &plan_install(&existing, &opts(Some(1))).expect("plan"));
            let removal = plan_uninstall(&installed, &opts(None)).expect("uninstall");
            assert_eq!(after(&installed, &removal).main.as_deref(), Some(original));
        }
    }

    #[test]
    fn a_runc_entry_changed_by_the_admin_survives_uninstall() {
        let existing = files(Some(DEBIAN));
        let mut installed = after(&existing, &plan_install(&existing, &opts(Some(1))).expect("plan"));
        let edited = installed.main.as_deref().expect("main").replace(
            "runtime_type = \"io.containerd.runc.v2\"\n",
            "runtime_type = \"io.containerd.runc.v2\"\n      privileged_without_host_devices = true\n",
        );
        installed.main = Some(edited);
        let removal = plan_uninstall(&installed, &opts(None)).expect("uninstall");
        let text = written(&removal, MAIN_CONFIG);
        assert!(
            text.contains("runtimes.runc]") && !text.contains("gpu-mps]"),
            "{text}"
        );
    }

    #[test]
    fn a_lone_gpu_mps_entry_gets_runc_back_under_containerd_1x() {
        let main = format!(
            "{DEBIAN}[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.gpu-mps]\nruntime_type = \"x\"\n"
        );
        let plan = plan_install(&files(Some(&main)), &opts(Some(1))).expect("plan");
        let mut d = None;
        let mut runc = ConfigVersion::V2.runtimes_path().to_vec();
        runc.extend(["runc", "runtime_type"]);
        let text = written(&plan, MAIN_CONFIG);
        assert_eq!(
            get(text, &runc, &mut d).and_then(Item::as_str),
            Some(RUNC_SHIM),
            "{text}"
        );
    }

    #[test]
    fn multi_line_imports_stay_one_per_line() {
        let main = "version = 3\nimports = [\n  \"/etc/other/*.toml\",\n]\n";
        let existing = files(Some(main));
        let plan = plan_install(&existing, &opts(Some(2))).expect("plan");
        let text = written(&plan, MAIN_CONFIG);
        assert_eq!(
            text,
            "version = 3\nimports = [\n  \"/etc/other/*.toml\",\n  \"/etc/containerd/conf.d/gpu-mps.toml\",\n]\n"
        );
        let installed = after(&existing, &plan);
        let removal = plan_uninstall(&installed, &opts(None)).expect("uninstall");
        assert_eq!(after(&installed, &removal), existing);
    }

    #[test]
    fn no_config_needs_containerd_version() {
        let e = plan_install(&files(None), &opts(None))
            .expect_err("unknown")
            .to_string();
        assert!(
            e.starts_with("/etc/containerd/config.toml: does not exist"),
            "{e}"
        );

        let plan = plan_install(&files(None), &opts(Some(1))).expect("1.x");
        let main = written(&plan, MAIN_CONFIG);
        assert!(
            main.starts_with("# containerd config created by `gpu-mps install-containerd`.\nversion = 2\n"),
            "{main}"
        );
        assert!(
            main.contains("runtimes.runc]") && main.contains("runtimes.gpu-mps]"),
            "{main}"
        );
        assert!(matches!(
            &plan.changes[0],
            FileChange::Write { backup: false, .. }
        ));

        let plan = plan_install(&files(None), &opts(Some(2))).expect("2.x");
        let main = written(&plan, MAIN_CONFIG);
        assert!(
            main.ends_with(&format!(
                "imports = [\"/etc/containerd/conf.d/gpu-mps.toml\"]  {IMPORTS_MARKER}\n"
            )),
            "{main}"
        );
        assert!(
            main.starts_with("# containerd config created by `gpu-mps install-containerd`.\nversion = 3\n"),
            "{main}"
        );
        assert!(written(&plan, DROP_IN).contains("version = 3"));
    }

    #[test]
    fn version_3_under_containerd_1x_is_refused() {
        let e = plan_install(&files(Some(V3)), &opts(Some(1)))
            .expect_err("mismatch")
            .to_string();
        assert_eq!(
            e,
            "/etc/containerd/config.toml: version = 3 is the containerd 2.x layout, but this node runs containerd 1.x"
        );
    }

    #[test]
    fn moving_from_1x_to_2x_moves_the_entry_into_the_drop_in() {
        let existing = files(Some(V2_KUBEADM));
        let in_place = after(&existing, &plan_install(&existing, &opts(Some(1))).expect("1.x"));
        let plan = plan_install(&in_place, &opts(Some(2))).expect("2.x");
        assert_eq!(plan.placement, Some(Placement::DropIn));
        let main = written(&plan, MAIN_CONFIG);
        assert!(
            !main.contains("gpu-mps]")
                && main.contains("imports = [\"/etc/containerd/conf.d/gpu-mps.toml\"]"),
            "{main}"
        );
        // And back: the drop-in goes, after the main config stops importing it.
        let moved = after(&in_place, &plan);
        let back = plan_install(&moved, &opts(Some(1))).expect("back to 1.x");
        assert_eq!(
            back.changes.iter().map(FileChange::path).collect::<Vec<_>>(),
            [Path::new(MAIN_CONFIG), Path::new(DROP_IN)]
        );
        assert_eq!(after(&moved, &back), in_place);
    }

    #[test]
    fn an_edited_entry_is_rewritten_where_it_stands() {
        let existing = files(Some(V2_KUBEADM));
        let installed = after(&existing, &plan_install(&existing, &opts(Some(1))).expect("plan"));
        let main = installed.main.clone().expect("main");
        let tampered = ExistingFiles {
            main: Some(main.replace(SHIM_PATH, "/usr/sbin/runc")),
            drop_in: None,
        };
        let plan = plan_install(&tampered, &opts(Some(1))).expect("plan");
        assert_eq!(written(&plan, MAIN_CONFIG), main);
    }

    #[test]
    fn inline_tables_are_refused_with_the_key() {
        let main = "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\"]\ncontainerd = { snapshotter = \"overlayfs\" }\n";
        let e = plan_install(&files(Some(main)), &opts(Some(1)))
            .expect_err("inline")
            .to_string();
        assert!(e.starts_with("/etc/containerd/config.toml: plugins.\"io.containerd.grpc.v1.cri\".containerd: written inline"), "{e}");
    }

    #[test]
    fn host_root_prefixes_files_not_contents() {
        let o = InstallOptions {
            host_root: "/host".into(),
            ..opts(Some(2))
        };
        let plan = plan_install(&files(Some(V3)), &o).expect("plan");
        assert_eq!(
            plan.changes[0].path(),
            Path::new("/host/etc/containerd/conf.d/gpu-mps.toml")
        );
        assert_eq!(
            plan.changes[1].path(),
            Path::new("/host/etc/containerd/config.toml")
        );
        let FileChange::Write { contents, .. } = &plan.changes[1] else {
            panic!("write")
        };
        assert!(contents.contains("\"/etc/containerd/conf.d/gpu-mps.toml\""));
    }

    #[test]
    fn glob_matching_follows_go() {
        let cases = [
            (
                "/etc/containerd/conf.d/*.toml",
                "/etc/containerd/conf.d/gpu-mps.toml",
                true,
            ),
            (
                "/etc/containerd/*.toml",
                "/etc/containerd/conf.d/gpu-mps.toml",
                false,
            ),
            (
                "/etc/containerd/conf.d/*",
                "/etc/containerd/conf.d/gpu-mps.toml",
                true,
            ),
            (
                "/etc/containerd/conf.?/gpu-mps.toml",
                "/etc/containerd/conf.d/gpu-mps.toml",
                true,
            ),
            (
                "/etc/containerd/conf.d/[a-h]*.toml",
                "/etc/containerd/conf.d/gpu-mps.toml",
                true,
            ),
            (
                "/etc/containerd/conf.d/[^g]*.toml",
                "/etc/containerd/conf.d/gpu-mps.toml",
                false,
            ),
            (
                "/etc/containerd/conf.d/\\*.toml",
                "/etc/containerd/conf.d/gpu-mps.toml",
                false,
            ),
            (
                "/etc/containerd/conf.d/gpu-mps.toml",
                "/etc/containerd/conf.d/gpu-mps.toml",
                true,
            ),
            ("/etc/containerd/conf.d/[a-", "/etc/containerd/conf.d/a", false),
        ];
        for (pattern, name, want) in cases {
            assert_eq!(glob_match(pattern, name), want, "{pattern} vs {name}");
        }
    }

    #[test]
    fn containerd_versions() {
        let cases = [
            (
                "containerd github.com/containerd/containerd 1.6.20~ds1 1.6.20~ds1-1+deb12u3",
                (1, 6),
            ),
            (
                "containerd github.com/containerd/containerd 1.7.24~ds1 1.7.24~ds1-6+deb13u1",
                (1, 7),
            ),
            (
                "containerd github.com/containerd/containerd/v2 2.1.9+unknown ",
                (2, 1),
            ),
            (
                "containerd containerd.io v1.7.27 05044ec0a9a75232cad458027ca83437aae3f4da",
                (1, 7),
            ),
        ];
        for (text, want) in cases {
            assert_eq!(parse_containerd_version(text), Some(want), "{text}");
        }
        assert_eq!(parse_containerd_version("containerd garbage"), None);
    }

    const DUMP_V3: &str = r#"version = 3
[plugins.'io.containerd.cri.v1.runtime'.containerd]
  default_runtime_name = 'runc'
  [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.gpu-mps]
    runtime_type = 'io.containerd.runc.v2'
    pod_annotations = ['gpu-mps.io/*', '*.gpu-mps.io/*']
    container_annotations = ['gpu-mps.io/*', '*.gpu-mps.io/*', 'cdi.k8s.io/*', 'gpu-mps-device-plugin/*']
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.gpu-mps.options]
      BinaryName = '/usr/local/bin/gpu-mps-shim'
      SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
    runtime_type = 'io.containerd.runc.v2'
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
      BinaryName = ''
      SystemdCgroup = true
"#;

    #[test]
    fn effective_config_checks() {
        let o = opts(None);
        let warnings = check_effective(DUMP_V3, &o).expect("in effect");
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(
            warnings[0].contains("options.SystemdCgroup = false, but \"runc\" has true"),
            "{}",
            warnings[0]
        );
        // Unset and zero are the same to containerd.
        let unset = DUMP_V3
            .replace("      SystemdCgroup = false\n", "")
            .replace("BinaryName = ''", "BinaryName = ''\n      IoUid = 0");
        let warnings = check_effective(&unset, &o).expect("in effect");
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(
            warnings[0].contains("options.SystemdCgroup = (unset), but \"runc\" has true"),
            "{}",
            warnings[0]
        );
        let missing = DUMP_V3.replace("runtimes.gpu-mps", "runtimes.other");
        let e = check_effective(&missing, &o).expect_err("missing").to_string();
        assert!(e.contains("runtime \"gpu-mps\" is missing"), "{e}");
        let no_runc = DUMP_V3.replace("runtimes.runc", "runtimes.crun");
        let e = check_effective(&no_runc, &o).expect_err("no default").to_string();
        assert!(e.contains("default_runtime_name = \"runc\" has no entry"), "{e}");
        let wrong = DUMP_V3.replace("'/usr/local/bin/gpu-mps-shim'", "''");
        assert!(
            check_effective(&wrong, &o)
                .expect_err("binary")
                .to_string()
                .contains("options.BinaryName = \"\"")
        );
        let annotations = DUMP_V3.replacen("'*.gpu-mps.io/*'", "'x'", 1);
        assert!(
            check_effective(&annotations, &o)
                .expect_err("annotations")
                .to_string()
                .contains("*.gpu-mps.io/*")
        );
    }

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
