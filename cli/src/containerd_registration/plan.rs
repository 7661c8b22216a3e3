//! What install and uninstall change, as a plan of whole-file writes and removals: pure, from the
//! files' current text and the options, so every case is tested without touching a disk.

use std::path::{Path, PathBuf};

use gpu_mps_api::message::one_line;
use toml_edit::{Array, DocumentMut, Item, Table, Value, value};

use super::imports::{add_import, imports_cover, remove_import};
use super::layout::{
    Style, keep_line_endings, lookup, lookup_mut, plain_table, prune_empty_implicit, same_item, table_at,
};
use super::toolkit::is_toolkit_binary;
use super::{ConfigVersion, InstallOptions, Placement, RUNC_SHIM, RegistrationError, annotation_patterns};

/// Put in front of the tables gpu-mps writes, so a reader of config.toml knows who owns them.
const ENTRY_MARKER: &str = "gpu-mps runtime handler, managed by `gpu-mps install-containerd`; \
                            `gpu-mps uninstall-containerd` removes it.";
/// Put in front of the `runc` entry written for containerd 1.x; uninstall removes that entry only
/// when it carries this marker and is still exactly what was written.
const RUNC_MARKER: &str = "Spelled out by `gpu-mps install-containerd`: containerd 1.x drops its \
                           built-in runc entry once any runtime is configured.";

/// The current text of the files registration touches; `None` when a file does not exist.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExistingFiles {
    pub main: Option<String>,
    pub drop_in: Option<String>,
    /// The gpu-mps node config, whose runc_path chaining to the NVIDIA toolkit sets.
    pub node_config: Option<String>,
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

    /// The files as they are once this plan is applied to `existing`, in memory (what the
    /// property tests and the fuzz target compare). `None` if a change is to a file that is
    /// none of the three registration owns, which a plan never makes.
    pub fn applied_to(&self, existing: &ExistingFiles, opts: &InstallOptions) -> Option<ExistingFiles> {
        let mut out = existing.clone();
        for change in &self.changes {
            let path = change.path();
            let slot = if path == opts.on_host(&opts.main_config) {
                &mut out.main
            } else if path == opts.on_host(&opts.drop_in) {
                &mut out.drop_in
            } else if path == opts.on_host(&opts.node_config) {
                &mut out.node_config
            } else {
                return None;
            };
            *slot = match change {
                FileChange::Write { contents, .. } => Some(contents.clone()),
                FileChange::Remove { .. } => None,
            };
        }
        Some(out)
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
        if existing.main.is_none() {
            if let Some(mut key) = doc.key_mut("version") {
                key.leaf_decor_mut().set_prefix(CREATED_MARKER);
            }
        } else if let Some(item) = doc.get_mut("version").and_then(|i| i.as_value_mut()) {
            // A file without `version` is a version 1 config to containerd 1.x: the line is
            // ours, and uninstall takes it out again (found by fuzzing: it stayed).
            item.decor_mut().set_suffix(ADDED_MARKER);
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
        remove_added_version(&mut doc);
        match (&existing.main, only_what_install_created(&doc)) {
            (Some(previous), true) => changes.push(FileChange::Remove {
                path: opts.on_host(main_path),
                previous: previous.clone(),
            }),
            _ => push_main_write(&mut changes, opts, existing, &doc, true),
        }
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

/// The comment on the `version` of a main config install created.
const CREATED_MARKER: &str = "# containerd config created by `gpu-mps install-containerd`.\n";

/// The comment after a `version` install added to a config that had none.
const ADDED_MARKER: &str = " # added by `gpu-mps install-containerd`";

/// Takes out a `version` line install added (it carries [`ADDED_MARKER`]), once nothing else is
/// left: tables an administrator added since are written in that version's layout, and without
/// the line containerd 1.x would read them as version 1.
fn remove_added_version(doc: &mut DocumentMut) {
    if doc.as_table().iter().any(|(key, _)| key != "version") {
        return;
    }
    let added = doc
        .get("version")
        .and_then(|i| i.as_value())
        .and_then(|v| v.decor().suffix())
        .and_then(|s| s.as_str())
        .is_some_and(|s| s == ADDED_MARKER);
    if added {
        doc.remove("version");
    }
}

/// A main config install created and that now holds nothing else: uninstall removes it rather
/// than leave a stub (containerd without a config file runs on its defaults, as before).
fn only_what_install_created(doc: &DocumentMut) -> bool {
    let root = doc.as_table();
    root.len() == 1
        && root.contains_key("version")
        && root
            .key("version")
            .and_then(|k| k.leaf_decor().prefix())
            .and_then(|p| p.as_str())
            .is_some_and(|p| p == CREATED_MARKER)
        && doc.trailing().as_str().is_none_or(|t| t.trim().is_empty())
}

fn push_main_write(
    changes: &mut Vec<FileChange>,
    opts: &InstallOptions,
    existing: &ExistingFiles,
    doc: &DocumentMut,
    main_existed: bool,
) {
    let mut contents = doc.to_string();
    if let Some(previous) = existing.main.as_deref() {
        contents = keep_line_endings(previous, contents);
    }
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
        // The toolkit's runtime is chained by install itself (toolkit::plan_chain).
        if !binary.is_empty() && !is_toolkit_binary(binary) {
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

#[cfg(test)]
mod tests {
    use std::path::Path;

    use toml_edit::{Item, Value};

    use super::*;
    use crate::containerd_registration::fixtures::*;
    use crate::containerd_registration::imports::IMPORTS_MARKER;
    use crate::containerd_registration::{
        CONTAINER_ANNOTATION_PATTERNS, DROP_IN, MAIN_CONFIG, POD_ANNOTATION_PATTERNS, SHIM_PATH,
    };

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
    fn uninstall_removes_a_config_install_created() {
        for major in [1, 2] {
            let existing = files(None);
            let installed = after(
                &existing,
                &plan_install(&existing, &opts(Some(major))).expect("plan"),
            );
            let plan = plan_uninstall(&installed, &opts(Some(major))).expect("uninstall");
            let gone = after(&installed, &plan);
            assert_eq!(gone.main, None, "containerd {major}.x: a stub is left: {plan:#?}");
            assert_eq!(gone.drop_in, None, "containerd {major}.x");
        }
        // A created config the administrator has since added to stays, without our entry.
        let existing = files(None);
        let installed = after(&existing, &plan_install(&existing, &opts(Some(2))).expect("plan"));
        let mut edited = installed.clone();
        edited.main = installed
            .main
            .map(|m| format!("{m}root = \"/data/containerd\"\n"));
        let plan = plan_uninstall(&edited, &opts(Some(2))).expect("uninstall");
        let kept = after(&edited, &plan).main.expect("kept");
        assert!(kept.contains("root = \"/data/containerd\""), "{kept}");
    }

    /// Found by fuzzing (fuzz/fuzz_targets/containerd_config.rs): a config file without a
    /// `version` line got one from install, and kept it after uninstall.
    #[test]
    fn uninstall_takes_out_the_version_install_added_to_a_config_without_one() {
        // Only a config with no keys may lack `version` (others are refused: tested apart).
        for text in ["", "\n", "# tuned by hand\n", "# one\r\n\r\n# two\r\n"] {
            // Without a version line and a containerd binary to ask, install refuses (tested apart).
            for major in [Some(1), Some(2)] {
                let existing = files(Some(text));
                let installed = after(&existing, &plan_install(&existing, &opts(major)).expect("plan"));
                let plan = plan_uninstall(&installed, &opts(major)).expect("uninstall");
                let back = after(&installed, &plan);
                assert_eq!(
                    back.main.as_deref(),
                    Some(text),
                    "containerd {major:?}: {installed:#?}"
                );
                assert_eq!(back.drop_in, None);
            }
        }
        // Tables the administrator wrote since install are in version 2's layout: the line stays.
        let existing = files(Some("# tuned by hand\n"));
        let installed = after(&existing, &plan_install(&existing, &opts(Some(1))).expect("plan"));
        let mut edited = installed.clone();
        edited.main = installed
            .main
            .map(|m| format!("{m}[plugins.\"io.containerd.grpc.v1.cri\".registry]\nconfig_path = \"/etc/containerd/certs.d\"\n"));
        let kept = after(
            &edited,
            &plan_uninstall(&edited, &opts(Some(1))).expect("uninstall"),
        )
        .main
        .expect("kept");
        assert!(kept.contains("version = 2"), "{kept}");
        assert!(kept.contains("config_path"), "{kept}");
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
            node_config: None,
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
    fn crlf_and_a_missing_final_newline_survive_install_and_uninstall() {
        let original = DEBIAN.trim_end().replace('\n', "\r\n");
        let existing = files(Some(&original));
        let installed = after(&existing, &plan_install(&existing, &opts(Some(1))).expect("plan"));
        let text = installed.main.as_deref().expect("main");
        assert!(
            !text.replace("\r\n", "").contains('\n') && !text.ends_with('\n'),
            "{text:?}"
        );
        assert!(
            plan_install(&installed, &opts(Some(1)))
                .expect("again")
                .is_empty()
        );
        let removal = plan_uninstall(&installed, &opts(None)).expect("uninstall");
        assert_eq!(after(&installed, &removal), existing);
    }
}
