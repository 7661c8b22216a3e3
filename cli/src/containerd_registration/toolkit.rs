//! The NVIDIA Container Toolkit on the node, and whether gpu-mps-shim chains to it.
//!
//! Where the toolkit's runtime (nvidia-container-runtime) is what gives containers their GPU
//! (the GPU Operator, `nvidia-ctk runtime configure`), a pod of the gpu-mps handler goes through
//! containerd's runc shim straight to gpu-mps-shim, and from there to `runc_path`: with plain
//! runc there, the toolkit never sees the container and the pod gets no GPU. Chaining sets
//! `runc_path` in the node config to the toolkit's runtime, which then does its work on the spec
//! gpu-mps-shim rewrote and execs runc itself. docs/adr/0009-chaining-the-nvidia-toolkit.md says
//! when that happens by default.
//!
//! Detection and the decision are pure (`toolkit_runtimes`, `decide_chain`, `chain_node_config`,
//! `unchain_node_config`); `find_toolkit_binary` looks at the disk.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use gpu_mps_api::message::one_line;
use toml_edit::{DocumentMut, Item, value};

use gpu_mps_shim::node_files::runc_path_from_toml;

use super::plan::FileChange;
use super::{InstallOptions, RegistrationError};

/// The toolkit's runtime binary. Its `.cdi` and `.legacy` variants start with the same name.
pub const TOOLKIT_BINARY: &str = "nvidia-container-runtime";
/// The names the toolkit and the GPU Operator give its containerd runtime entries.
pub const TOOLKIT_RUNTIME_NAMES: [&str; 3] = ["nvidia", "nvidia-cdi", "nvidia-legacy"];
/// Where the toolkit's packages (/usr/bin) and the GPU Operator (/usr/local/nvidia/toolkit) put
/// the binary, as host paths.
pub const TOOLKIT_DIRS: [&str; 4] = [
    "/usr/bin",
    "/usr/local/bin",
    "/usr/local/nvidia/toolkit",
    "/usr/sbin",
];
/// The first line of the comment gpu-mps writes above the `runc_path` it set; uninstall removes
/// only a `runc_path` that carries it.
const CHAIN_MARKER: &str = "# runc_path set by `gpu-mps install-containerd` to chain the NVIDIA Container Toolkit; \
                            `gpu-mps uninstall-containerd` puts it back.";
/// The line under the marker that keeps the value runc_path had before, if it had one.
const PREVIOUS_PREFIX: &str = "# runc_path before: ";

/// `--chain-toolkit`: whether install sets runc_path to the toolkit's runtime.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ChainToolkit {
    /// Only when the toolkit is containerd's default runtime, i.e. every pod of the node already
    /// goes through it.
    #[default]
    Auto,
    /// Whenever the toolkit's runtime is found.
    Yes,
    /// Never; say what the pods miss when the toolkit is the default runtime.
    No,
}

impl FromStr for ChainToolkit {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(ChainToolkit::Auto),
            "yes" => Ok(ChainToolkit::Yes),
            "no" => Ok(ChainToolkit::No),
            other => Err(format!("{other:?}: expected auto, yes or no")),
        }
    }
}

/// A containerd runtime entry of the toolkit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolkitRuntime {
    pub name: String,
    /// Its `options.BinaryName`, if it has one.
    pub binary: Option<String>,
    /// It is `default_runtime_name`: every pod without a runtime class goes through it.
    pub default: bool,
}

impl fmt::Display for ToolkitRuntime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "runtime {:?}", self.name)?;
        if let Some(binary) = &self.binary {
            write!(f, " (BinaryName {binary})")?;
        }
        if self.default {
            write!(f, ", the default runtime")?;
        }
        Ok(())
    }
}

/// What is known of the toolkit on the node.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ToolkitFacts {
    /// Its runtime entries in containerd's config.
    pub runtimes: Vec<ToolkitRuntime>,
    /// nvidia-container-runtime on the node, as a host path.
    pub binary: Option<PathBuf>,
}

/// Whether a runtime binary is the toolkit's (nvidia-container-runtime or its `.cdi` / `.legacy`
/// variants), by its file name.
pub fn is_toolkit_binary(binary: &str) -> bool {
    Path::new(binary)
        .file_name()
        .is_some_and(|n| n.to_string_lossy().starts_with(TOOLKIT_BINARY))
}

/// The toolkit's runtime entries in a containerd config (a main config, a drop-in or the output
/// of `config dump`), in the version 2 or version 3 layout: those named nvidia, nvidia-cdi or
/// nvidia-legacy and those whose BinaryName is nvidia-container-runtime (a `runc` entry
/// pointed at it too). A config that does not parse has none: install reports it elsewhere.
pub fn toolkit_runtimes(config: &str) -> Vec<ToolkitRuntime> {
    let Ok(doc) = config.parse::<DocumentMut>() else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for plugin in ["io.containerd.grpc.v1.cri", "io.containerd.cri.v1.runtime"] {
        let Some(containerd) = doc
            .get("plugins")
            .and_then(|p| p.get(plugin))
            .and_then(|p| p.get("containerd"))
        else {
            continue;
        };
        let default_name = containerd.get("default_runtime_name").and_then(Item::as_str);
        let Some(runtimes) = containerd.get("runtimes").and_then(Item::as_table_like) else {
            continue;
        };
        for (name, entry) in runtimes.iter() {
            let binary = entry
                .get("options")
                .and_then(|o| o.get("BinaryName"))
                .and_then(Item::as_str)
                .filter(|b| !b.is_empty());
            if TOOLKIT_RUNTIME_NAMES.contains(&name) || binary.is_some_and(is_toolkit_binary) {
                found.push(ToolkitRuntime {
                    name: name.to_owned(),
                    binary: binary.map(str::to_owned),
                    default: default_name == Some(name),
                });
            }
        }
    }
    found
}

/// nvidia-container-runtime in the usual directories of the host, as a host path.
pub fn find_toolkit_binary(opts: &InstallOptions) -> Option<PathBuf> {
    TOOLKIT_DIRS
        .iter()
        .map(|dir| Path::new(dir).join(TOOLKIT_BINARY))
        .find(|candidate| opts.on_host(candidate).is_file())
}

/// What install does about the toolkit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChainDecision {
    /// Set runc_path to `runtime`, because `why`.
    Chain { runtime: PathBuf, why: String },
    /// Leave runc_path as it is; `note` tells the administrator what that means, if anything.
    Leave { note: Option<String> },
}

/// Decides whether runc_path becomes the toolkit's runtime. `runc_path`: the value in the node
/// config file, `None` when the file does not set it (runc's default path).
pub fn decide_chain(
    facts: &ToolkitFacts,
    mode: ChainToolkit,
    runc_path: Option<&Path>,
    node_config: &Path,
) -> Result<ChainDecision, RegistrationError> {
    let config = node_config.display();
    if runc_path.is_some_and(|p| is_toolkit_binary(&p.to_string_lossy())) {
        return Ok(ChainDecision::Leave { note: None });
    }
    let target = chain_target(facts);
    let default = facts.runtimes.iter().find(|r| r.default);
    let found = found_list(facts);
    let current = runc_path
        .map(|p| format!("runc_path = {:?}", p.display().to_string()))
        .unwrap_or_else(|| "runc_path (default /usr/sbin/runc)".into());
    match mode {
        ChainToolkit::Yes => match target {
            Some(runtime) => Ok(ChainDecision::Chain {
                why: format!("--chain-toolkit=yes ({found})"),
                runtime,
            }),
            None => Err(RegistrationError::NoToolkit {
                found: if found.is_empty() { "nothing".into() } else { found },
            }),
        },
        ChainToolkit::No => Ok(ChainDecision::Leave {
            note: default.map(|d| {
                format!(
                    "containerd's default runtime is the NVIDIA Container Toolkit's ({d}) but --chain-toolkit=no keeps {current} in {config}: a gpu-mps pod gets its GPU only as a CDI device or device nodes (docs/gpu-paths.md)"
                )
            }),
        }),
        ChainToolkit::Auto => match (default, target, runc_path) {
            (Some(d), Some(runtime), None) => Ok(ChainDecision::Chain {
                why: format!("containerd's default runtime is the NVIDIA Container Toolkit's ({d})"),
                runtime,
            }),
            (Some(d), Some(runtime), Some(_)) => Ok(ChainDecision::Leave {
                note: Some(format!(
                    "containerd's default runtime is the NVIDIA Container Toolkit's ({d}), but {config} sets {current}, which is left as it is: rerun with --chain-toolkit=yes to set runc_path = {:?}, or gpu-mps pods get their GPU only as CDI devices or device nodes (docs/gpu-paths.md)",
                    runtime.display().to_string()
                )),
            }),
            (Some(d), None, _) => Ok(ChainDecision::Leave {
                note: Some(format!(
                    "containerd's default runtime is {d}, but no nvidia-container-runtime binary was found in {}: install the NVIDIA Container Toolkit and rerun, or gpu-mps pods get their GPU only as CDI devices or device nodes (docs/gpu-paths.md)",
                    TOOLKIT_DIRS.join(", ")
                )),
            }),
            (None, Some(runtime), _) => Ok(ChainDecision::Leave {
                note: Some(format!(
                    "the NVIDIA Container Toolkit is on this node ({found}) but is not containerd's default runtime, so {current} in {config} stays: gpu-mps pods get their GPU as CDI devices or device nodes; rerun with --chain-toolkit=yes to have {:?} add it instead (docs/gpu-paths.md)",
                    runtime.display().to_string()
                )),
            }),
            (None, None, _) => Ok(ChainDecision::Leave { note: None }),
        },
    }
}

/// The runtime to chain: the default toolkit entry's binary, else another entry's, else the
/// binary found on the node. A bare BinaryName is resolved to the found binary of that name.
fn chain_target(facts: &ToolkitFacts) -> Option<PathBuf> {
    let mut entries: Vec<&ToolkitRuntime> = facts.runtimes.iter().collect();
    entries.sort_by_key(|r| !r.default);
    let named = entries.iter().find_map(|r| r.binary.as_deref());
    match named {
        Some(binary) if Path::new(binary).is_absolute() => Some(binary.into()),
        Some(binary) => Some(
            facts
                .binary
                .clone()
                .filter(|found| found.file_name().is_some_and(|n| n == binary))
                .unwrap_or_else(|| binary.into()),
        ),
        None => facts.binary.clone(),
    }
}

fn found_list(facts: &ToolkitFacts) -> String {
    let mut found: Vec<String> = facts
        .runtimes
        .iter()
        .map(|r| format!("containerd has {r}"))
        .collect();
    if let Some(binary) = &facts.binary {
        found.push(format!("{} is installed", binary.display()));
    }
    found.join("; ")
}

/// The node config with `runc_path = runtime`, marked as set by gpu-mps with the value it had,
/// so that uninstall can put it back. Everything else is kept as it was.
pub fn chain_node_config(
    previous: Option<&str>,
    runtime: &Path,
    path: &Path,
) -> Result<String, RegistrationError> {
    let mut doc = parse_node_config(previous.unwrap_or(""), path)?;
    let before = doc.get("runc_path").and_then(Item::as_str).map(str::to_owned);
    let mut comment = format!("{CHAIN_MARKER}\n");
    if let Some(before) = &before {
        comment.push_str(&format!(
            "{PREVIOUS_PREFIX}{}\n",
            value(before.as_str()).to_string().trim()
        ));
    }
    doc.insert("runc_path", value(runtime.display().to_string()));
    if let Some(mut key) = doc.key_mut("runc_path") {
        key.leaf_decor_mut().set_prefix(comment);
    }
    Ok(doc.to_string())
}

/// What uninstall does with the node config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unchain {
    /// gpu-mps set no runc_path there: nothing.
    NotOurs,
    /// The config with runc_path as it was before install.
    Write(String),
    /// Nothing is left but what install wrote into a file it created: the file goes.
    Remove,
}

/// The node config with the `runc_path` that install set put back as it was (removed when there
/// was none).
pub fn unchain_node_config(text: &str, path: &Path) -> Result<Unchain, RegistrationError> {
    let mut doc = parse_node_config(text, path)?;
    let prefix = doc.key_mut("runc_path").and_then(|k| {
        k.leaf_decor()
            .prefix()
            .and_then(|p| p.as_str())
            .map(str::to_owned)
    });
    let Some(prefix) = prefix.filter(|p| p.contains(CHAIN_MARKER)) else {
        return Ok(Unchain::NotOurs);
    };
    let previous = prefix
        .lines()
        .find_map(|l| l.strip_prefix(PREVIOUS_PREFIX))
        .and_then(|v| v.parse::<toml_edit::Value>().ok())
        .and_then(|v| v.as_str().map(str::to_owned));
    let mut kept = prefix.replace(&format!("{CHAIN_MARKER}\n"), "");
    kept = kept
        .lines()
        .filter(|l| !l.starts_with(PREVIOUS_PREFIX))
        .map(|l| format!("{l}\n"))
        .collect();
    match previous {
        Some(previous) => {
            doc.insert("runc_path", value(previous));
            if let Some(mut key) = doc.key_mut("runc_path") {
                key.leaf_decor_mut().set_prefix(kept);
            }
        }
        None => {
            doc.remove("runc_path");
        }
    }
    let text = doc.to_string();
    Ok(if text.trim().is_empty() {
        Unchain::Remove
    } else {
        Unchain::Write(text)
    })
}

/// What install does about the toolkit, for its plan and its output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChainPlan {
    /// The node config change, if any.
    pub change: Option<FileChange>,
    /// Chained: what and why, one line.
    pub chained: Option<String>,
    /// Not chained though it may matter: what that means and how to chain, one line.
    pub warning: Option<String>,
}

/// The node config change chaining makes, if any, and what to tell the administrator.
/// `node_config`: its current text (`None`: no file).
pub fn plan_chain(
    node_config: Option<&str>,
    facts: &ToolkitFacts,
    opts: &InstallOptions,
) -> Result<ChainPlan, RegistrationError> {
    let path = &opts.node_config;
    let runc_path = match node_config {
        Some(text) => runc_path_from_toml(text).map_err(|message| RegistrationError::Parse {
            path: path.clone(),
            message,
        })?,
        None => None,
    };
    match decide_chain(facts, opts.chain_toolkit, runc_path.as_deref(), path)? {
        ChainDecision::Leave { note } => Ok(ChainPlan {
            change: None,
            chained: None,
            warning: note,
        }),
        ChainDecision::Chain { runtime, why } => {
            let contents = chain_node_config(node_config, &runtime, path)?;
            let chained = format!(
                "chained to the NVIDIA Container Toolkit: runc_path = {:?} in {}, so that it gives each gpu-mps container its GPU after gpu-mps-shim ({why})",
                runtime.display().to_string(),
                path.display()
            );
            Ok(ChainPlan {
                change: Some(FileChange::Write {
                    path: opts.on_host(path),
                    previous: node_config.map(str::to_owned),
                    contents,
                    backup: node_config.is_some(),
                }),
                chained: Some(chained),
                warning: None,
            })
        }
    }
}

/// The node config change uninstall makes: the runc_path install set goes back as it was.
pub fn plan_unchain(
    node_config: Option<&str>,
    opts: &InstallOptions,
) -> Result<Option<FileChange>, RegistrationError> {
    let Some(text) = node_config else {
        return Ok(None);
    };
    let path = opts.on_host(&opts.node_config);
    Ok(match unchain_node_config(text, &opts.node_config)? {
        Unchain::NotOurs => None,
        Unchain::Write(contents) => Some(FileChange::Write {
            path,
            previous: Some(text.to_owned()),
            contents,
            backup: true,
        }),
        Unchain::Remove => Some(FileChange::Remove {
            path,
            previous: text.to_owned(),
        }),
    })
}

fn parse_node_config(text: &str, path: &Path) -> Result<DocumentMut, RegistrationError> {
    text.parse::<DocumentMut>().map_err(|e| RegistrationError::Parse {
        path: path.into(),
        message: one_line(&e.to_string()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const NODE_CONFIG: &str = "/etc/gpu-mps/config.toml";

    /// What the GPU Operator writes on containerd 1.x: an `nvidia` entry made the default.
    const V2_OPERATOR: &str = r#"version = 2
[plugins."io.containerd.grpc.v1.cri".containerd]
  default_runtime_name = "nvidia"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]
    runtime_type = "io.containerd.runc.v2"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia.options]
      BinaryName = "/usr/local/nvidia/toolkit/nvidia-container-runtime"
"#;

    /// `nvidia-ctk runtime configure` on containerd 2.x without --set-as-default: nvidia and
    /// nvidia-cdi next to runc, runc stays the default.
    const V3_CTK: &str = r#"version = 3
[plugins.'io.containerd.cri.v1.runtime'.containerd]
  default_runtime_name = 'runc'
  [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
    runtime_type = 'io.containerd.runc.v2'
  [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.nvidia]
    runtime_type = 'io.containerd.runc.v2'
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.nvidia.options]
      BinaryName = '/usr/bin/nvidia-container-runtime'
  [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.nvidia-cdi]
    runtime_type = 'io.containerd.runc.v2'
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.nvidia-cdi.options]
      BinaryName = '/usr/bin/nvidia-container-runtime.cdi'
"#;

    /// The same as V3_CTK with --set-as-default.
    fn v3_ctk_default() -> String {
        V3_CTK.replace("default_runtime_name = 'runc'", "default_runtime_name = 'nvidia'")
    }

    /// runc itself pointed at the toolkit (toolkit runtime mode without a separate entry).
    const V2_RUNC_IS_TOOLKIT: &str = r#"version = 2
[plugins."io.containerd.grpc.v1.cri".containerd]
  default_runtime_name = "runc"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
      BinaryName = "nvidia-container-runtime"
      SystemdCgroup = true
"#;

    const V2_PLAIN: &str = r#"version = 2
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
    BinaryName = ""
"#;

    fn facts(config: &str, binary: Option<&str>) -> ToolkitFacts {
        ToolkitFacts {
            runtimes: toolkit_runtimes(config),
            binary: binary.map(PathBuf::from),
        }
    }

    fn decide(config: &str, binary: Option<&str>, mode: ChainToolkit, runc: Option<&str>) -> ChainDecision {
        decide_chain(
            &facts(config, binary),
            mode,
            runc.map(Path::new),
            Path::new(NODE_CONFIG),
        )
        .expect("decision")
    }

    fn chained_to(d: &ChainDecision) -> Option<&Path> {
        match d {
            ChainDecision::Chain { runtime, .. } => Some(runtime),
            ChainDecision::Leave { .. } => None,
        }
    }

    fn note(d: &ChainDecision) -> &str {
        match d {
            ChainDecision::Leave { note: Some(n) } => n,
            other => panic!("expected a note, got {other:?}"),
        }
    }

    #[test]
    fn finds_the_toolkit_runtimes_of_each_layout() {
        assert_eq!(
            toolkit_runtimes(V2_OPERATOR),
            vec![ToolkitRuntime {
                name: "nvidia".into(),
                binary: Some("/usr/local/nvidia/toolkit/nvidia-container-runtime".into()),
                default: true,
            }]
        );
        let v3: Vec<(String, bool)> = toolkit_runtimes(V3_CTK)
            .into_iter()
            .map(|r| (r.name, r.default))
            .collect();
        assert_eq!(v3, vec![("nvidia".into(), false), ("nvidia-cdi".into(), false)]);
        assert_eq!(
            toolkit_runtimes(V2_RUNC_IS_TOOLKIT),
            vec![ToolkitRuntime {
                name: "runc".into(),
                binary: Some("nvidia-container-runtime".into()),
                default: true,
            }]
        );
        assert!(toolkit_runtimes(V2_PLAIN).is_empty());
        assert!(toolkit_runtimes("version = 2\n").is_empty());
        assert!(toolkit_runtimes("not toml [").is_empty());
    }

    #[test]
    fn an_entry_named_nvidia_counts_even_without_a_binary_name() {
        let config = "version = 3\n[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.nvidia-legacy]\nruntime_type = 'io.containerd.runc.v2'\n";
        assert_eq!(
            toolkit_runtimes(config),
            vec![ToolkitRuntime {
                name: "nvidia-legacy".into(),
                binary: None,
                default: false,
            }]
        );
    }

    #[test]
    fn auto_chains_when_the_toolkit_is_the_default_runtime() {
        let d = decide(V2_OPERATOR, None, ChainToolkit::Auto, None);
        assert_eq!(
            chained_to(&d),
            Some(Path::new("/usr/local/nvidia/toolkit/nvidia-container-runtime"))
        );
        let d = decide(&v3_ctk_default(), None, ChainToolkit::Auto, None);
        assert_eq!(
            chained_to(&d),
            Some(Path::new("/usr/bin/nvidia-container-runtime"))
        );
        // A bare BinaryName becomes the binary of that name found on the node.
        let d = decide(
            V2_RUNC_IS_TOOLKIT,
            Some("/usr/bin/nvidia-container-runtime"),
            ChainToolkit::Auto,
            None,
        );
        assert_eq!(
            chained_to(&d),
            Some(Path::new("/usr/bin/nvidia-container-runtime"))
        );
    }

    #[test]
    fn auto_explains_a_toolkit_that_is_not_the_default() {
        let d = decide(
            V3_CTK,
            Some("/usr/bin/nvidia-container-runtime"),
            ChainToolkit::Auto,
            None,
        );
        let n = note(&d);
        assert!(
            n.contains("not containerd's default runtime") && n.contains("--chain-toolkit=yes"),
            "{n}"
        );
        assert!(!n.contains('\n'), "{n}");
        // The same in the version 2 layout: the GPU Operator's entry, runc left the default.
        let v2_opt_in = V2_OPERATOR.replace(
            "default_runtime_name = \"nvidia\"",
            "default_runtime_name = \"runc\"",
        );
        assert_eq!(
            toolkit_runtimes(&v2_opt_in).iter().filter(|r| r.default).count(),
            0
        );
        let d = decide(&v2_opt_in, None, ChainToolkit::Auto, None);
        assert!(note(&d).contains("not containerd's default runtime"), "{d:?}");
        // The binary alone, no containerd entry, is the same case.
        let d = decide(
            V2_PLAIN,
            Some("/usr/bin/nvidia-container-runtime"),
            ChainToolkit::Auto,
            None,
        );
        assert!(note(&d).contains("/usr/bin/nvidia-container-runtime is installed"));
    }

    #[test]
    fn auto_keeps_a_runc_path_the_administrator_set() {
        let d = decide(V2_OPERATOR, None, ChainToolkit::Auto, Some("/opt/runc"));
        let n = note(&d);
        assert!(
            n.contains("runc_path = \"/opt/runc\"") && n.contains("--chain-toolkit=yes"),
            "{n}"
        );
    }

    #[test]
    fn nothing_to_say_without_the_toolkit() {
        for mode in [ChainToolkit::Auto, ChainToolkit::No] {
            assert_eq!(
                decide(V2_PLAIN, None, mode, None),
                ChainDecision::Leave { note: None }
            );
        }
    }

    #[test]
    fn a_runc_path_already_at_the_toolkit_is_left_alone() {
        for mode in [ChainToolkit::Auto, ChainToolkit::Yes, ChainToolkit::No] {
            assert_eq!(
                decide(
                    V2_OPERATOR,
                    None,
                    mode,
                    Some("/usr/local/nvidia/toolkit/nvidia-container-runtime")
                ),
                ChainDecision::Leave { note: None }
            );
        }
    }

    #[test]
    fn yes_chains_any_toolkit_and_fails_without_one() {
        let d = decide(V3_CTK, None, ChainToolkit::Yes, Some("/opt/runc"));
        assert_eq!(
            chained_to(&d),
            Some(Path::new("/usr/bin/nvidia-container-runtime"))
        );
        let d = decide(
            V2_PLAIN,
            Some("/usr/bin/nvidia-container-runtime"),
            ChainToolkit::Yes,
            None,
        );
        assert_eq!(
            chained_to(&d),
            Some(Path::new("/usr/bin/nvidia-container-runtime"))
        );
        let e = decide_chain(
            &facts(V2_PLAIN, None),
            ChainToolkit::Yes,
            None,
            Path::new(NODE_CONFIG),
        )
        .expect_err("no toolkit");
        assert!(e.to_string().contains("--chain-toolkit=yes"), "{e}");
    }

    #[test]
    fn no_says_what_the_pods_miss_when_the_toolkit_is_the_default() {
        let d = decide(V2_OPERATOR, None, ChainToolkit::No, None);
        assert!(note(&d).contains("--chain-toolkit=no"));
    }

    #[test]
    fn chain_modes_parse() {
        assert_eq!("auto".parse(), Ok(ChainToolkit::Auto));
        assert_eq!("yes".parse(), Ok(ChainToolkit::Yes));
        assert_eq!("no".parse(), Ok(ChainToolkit::No));
        assert!("true".parse::<ChainToolkit>().is_err());
    }

    #[test]
    fn chaining_the_shipped_node_config_keeps_it_valid_and_round_trips() {
        let shipped = include_str!("../../../packaging/config.toml");
        let path = Path::new(NODE_CONFIG);
        let runtime = Path::new("/usr/local/nvidia/toolkit/nvidia-container-runtime");
        let chained = chain_node_config(Some(shipped), runtime, path).expect("chain");
        let config = gpu_mps_api::NodeConfig::from_toml(&chained, path).expect("valid node config");
        assert_eq!(config.runc_path, runtime);
        let plain = gpu_mps_api::NodeConfig::from_toml(shipped, path).expect("shipped config");
        assert_eq!(config.limits.policy, plain.limits.policy);
        assert_eq!(
            unchain_node_config(&chained, path).expect("unchain"),
            Unchain::Write(shipped.to_owned())
        );
    }

    #[test]
    fn chaining_the_node_config_round_trips() {
        let path = Path::new(NODE_CONFIG);
        let runtime = Path::new("/usr/bin/nvidia-container-runtime");
        // No file: created with the line alone; uninstall removes the file.
        let created = chain_node_config(None, runtime, path).expect("chain");
        assert!(
            created.contains("runc_path = \"/usr/bin/nvidia-container-runtime\""),
            "{created}"
        );
        let parsed: toml_edit::DocumentMut = created.parse().expect("toml");
        assert_eq!(
            parsed.get("runc_path").and_then(Item::as_str),
            Some("/usr/bin/nvidia-container-runtime")
        );
        assert_eq!(
            unchain_node_config(&created, path).expect("unchain"),
            Unchain::Remove
        );

        // A config with other settings and its own runc_path: kept, and put back.
        let own = "# my node\nroot = \"/run/gpu-mps\"\nrunc_path = \"/opt/runc\"  # pinned\n\n[limits]\npolicy = \"ceiling\"\n";
        let chained = chain_node_config(Some(own), runtime, path).expect("chain");
        assert!(chained.contains("# runc_path before: \"/opt/runc\""), "{chained}");
        assert!(chained.contains("[limits]\npolicy = \"ceiling\""), "{chained}");
        let Unchain::Write(back) = unchain_node_config(&chained, path).expect("unchain") else {
            panic!("not put back: {chained}");
        };
        let back_doc: toml_edit::DocumentMut = back.parse().expect("toml");
        assert_eq!(
            back_doc.get("runc_path").and_then(Item::as_str),
            Some("/opt/runc")
        );
        assert!(back.starts_with("# my node\nroot = \"/run/gpu-mps\"\n"), "{back}");
        assert!(!back.contains("gpu-mps install-containerd"), "{back}");

        // Without runc_path: the key goes again, the rest is byte for byte.
        let plain = "root = \"/run/gpu-mps\"\n\n[limits]\npolicy = \"exact\"\n";
        let chained = chain_node_config(Some(plain), runtime, path).expect("chain");
        assert_eq!(
            unchain_node_config(&chained, path).expect("unchain"),
            Unchain::Write(plain.to_owned())
        );
        // A runc_path gpu-mps did not set is not touched.
        assert_eq!(unchain_node_config(own, path).expect("unchain"), Unchain::NotOurs);
    }
}
