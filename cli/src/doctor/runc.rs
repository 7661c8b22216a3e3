//! Check: the runc gpu-mps-shim execs (`runc_path`) is there, and GPU containers get their devices.
//!
//! The shim hands the rewritten spec to `runc_path`. Where the NVIDIA Container Toolkit is what
//! gives GPU containers their device nodes and driver libraries (its `nvidia` runtime, or
//! nvidia-container-runtime chained as runc), plain runc at runc_path skips that step: a pod sent
//! to the gpu-mps runtime then starts without its GPU, unless the GPU comes as a CDI device, which
//! containerd resolves before the runtime runs.

use std::path::{Path, PathBuf};

use toml_edit::{DocumentMut, Item};

use super::{Check, FileState};

const NAME: &str = "runc";
pub const TOOLKIT_RUNTIME: &str = "nvidia-container-runtime";

#[derive(Debug)]
pub struct RuncFacts {
    pub runc_path: PathBuf,
    pub runc: FileState,
    /// runc binaries found elsewhere on the node, for the fix when runc_path is wrong.
    pub runc_elsewhere: Vec<PathBuf>,
    /// containerd runtime entries of the toolkit, as "name (BinaryName ...)".
    pub nvidia_runtimes: Vec<String>,
    /// nvidia-container-runtime, where it is installed.
    pub toolkit_binary: Option<PathBuf>,
}

pub fn check(f: &RuncFacts, config_path: &Path) -> Check {
    let config = config_path.display();
    let runc_path = f.runc_path.display();
    if !f.runc.is_executable() {
        let fix = match f.runc_elsewhere.first() {
            Some(found) => format!(
                "set runc_path = \"{}\" in {config} (runc is there), then restart gpu-mps-manager",
                found.display()
            ),
            None => format!(
                "install runc (Debian's runc package puts it at /usr/sbin/runc), or set runc_path in {config} to where it is"
            ),
        };
        return Check::fail(
            NAME,
            format!(
                "runc_path = {runc_path}: {}: gpu-mps-shim cannot start any container",
                f.runc.describe(&f.runc_path)
            ),
            fix,
        );
    }
    let chained = f
        .runc_path
        .file_name()
        .is_some_and(|n| n.to_string_lossy().contains(TOOLKIT_RUNTIME));
    if chained {
        return Check::pass(
            NAME,
            format!(
                "runc_path = {runc_path} is executable: the NVIDIA Container Toolkit adds each GPU container's devices and driver libraries after gpu-mps-shim"
            ),
        );
    }
    let mut toolkit = Vec::new();
    if !f.nvidia_runtimes.is_empty() {
        toolkit.push(format!("containerd has {}", f.nvidia_runtimes.join(", ")));
    }
    if let Some(binary) = &f.toolkit_binary {
        toolkit.push(format!("{} is installed", binary.display()));
    }
    if toolkit.is_empty() {
        return Check::pass(
            NAME,
            format!(
                "runc_path = {runc_path} is executable; no NVIDIA Container Toolkit runtime on this node, so GPUs reach containers only as CDI devices or device nodes"
            ),
        );
    }
    let toolkit_path = f
        .toolkit_binary
        .as_deref()
        .unwrap_or(Path::new("/usr/bin/nvidia-container-runtime"))
        .display();
    Check::warn(
        NAME,
        format!(
            "runc_path = {runc_path} is plain runc while this node has the NVIDIA Container Toolkit ({}): a GPU pod of the gpu-mps runtime gets no GPU devices or driver libraries unless its GPU comes as a CDI device",
            toolkit.join("; ")
        ),
        format!(
            "either run `gpu-mps install-containerd --chain-toolkit=yes` (it sets runc_path = \"{toolkit_path}\" in {config}) and restart gpu-mps-manager, so that the toolkit adds the GPU to each container after gpu-mps-shim (docs/gpu-paths.md); or hand GPUs over as CDI devices (a CDI spec from `nvidia-ctk cdi generate`, CDI enabled in containerd, a device plugin that allocates CDI devices), which needs no chained runtime"
        ),
    )
}

/// The containerd runtime entries of the NVIDIA Container Toolkit in a `config dump`: those named
/// nvidia (nvidia, nvidia-cdi, nvidia-legacy, as the toolkit and the GPU operator name them) or
/// whose BinaryName is nvidia-container-runtime.
pub fn nvidia_runtimes(dump: &str) -> Vec<String> {
    let Ok(doc) = dump.parse::<DocumentMut>() else {
        return Vec::new();
    };
    let runtimes = ["io.containerd.cri.v1.runtime", "io.containerd.grpc.v1.cri"]
        .iter()
        .find_map(|plugin| {
            doc.get("plugins")
                .and_then(|p| p.get(plugin))
                .and_then(|p| p.get("containerd"))
                .and_then(|c| c.get("runtimes"))
                .and_then(Item::as_table_like)
        });
    let Some(runtimes) = runtimes else {
        return Vec::new();
    };
    runtimes
        .iter()
        .filter_map(|(name, entry)| {
            let binary = entry
                .get("options")
                .and_then(|o| o.get("BinaryName"))
                .and_then(Item::as_str)
                .unwrap_or("");
            (name.contains("nvidia") || binary.contains(TOOLKIT_RUNTIME)).then(|| {
                if binary.is_empty() {
                    format!("runtime {name:?}")
                } else {
                    format!("runtime {name:?} (BinaryName {binary})")
                }
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::Status;

    fn facts() -> RuncFacts {
        RuncFacts {
            runc_path: "/usr/sbin/runc".into(),
            runc: FileState::Executable {
                at: "/usr/sbin/runc".into(),
            },
            runc_elsewhere: Vec::new(),
            nvidia_runtimes: Vec::new(),
            toolkit_binary: None,
        }
    }

    const CONFIG: &str = "/etc/gpu-mps/config.toml";

    #[test]
    fn plain_runc_without_the_toolkit_passes() {
        let c = check(&facts(), Path::new(CONFIG));
        assert_eq!(c.status, Status::Pass);
        assert!(c.found.contains("no NVIDIA Container Toolkit"), "{}", c.found);
    }

    #[test]
    fn a_missing_runc_fails_and_names_the_one_found() {
        let mut f = facts();
        f.runc = FileState::Missing {
            searched: "looked at that path".into(),
        };
        let c = check(&f, Path::new(CONFIG));
        assert_eq!(c.status, Status::Fail);
        assert!(c.found.contains("/usr/sbin/runc does not exist"), "{}", c.found);
        assert!(c.fix.as_deref().unwrap_or("").contains("install runc"));
        f.runc_elsewhere = vec!["/usr/bin/runc".into()];
        let c = check(&f, Path::new(CONFIG));
        assert_eq!(
            c.fix.as_deref(),
            Some(
                "set runc_path = \"/usr/bin/runc\" in /etc/gpu-mps/config.toml (runc is there), then restart gpu-mps-manager"
            )
        );
        f.runc = FileState::NotExecutable {
            at: "/usr/sbin/runc".into(),
        };
        let c = check(&f, Path::new(CONFIG));
        assert_eq!(c.status, Status::Fail);
        assert!(c.found.contains("is not executable"), "{}", c.found);
    }

    #[test]
    fn plain_runc_beside_the_toolkit_warns_and_explains_both_ways() {
        let mut f = facts();
        f.toolkit_binary = Some("/usr/bin/nvidia-container-runtime".into());
        let c = check(&f, Path::new(CONFIG));
        assert_eq!(c.status, Status::Warn);
        assert!(
            c.found.contains("/usr/bin/nvidia-container-runtime is installed"),
            "{}",
            c.found
        );
        assert!(c.found.contains("gets no GPU devices"), "{}", c.found);
        let fix = c.fix.unwrap_or_default();
        assert!(
            fix.contains("runc_path = \"/usr/bin/nvidia-container-runtime\"") && fix.contains("CDI devices"),
            "{fix}"
        );
        let mut f = facts();
        f.nvidia_runtimes = vec!["runtime \"nvidia\"".into()];
        let c = check(&f, Path::new(CONFIG));
        assert_eq!(c.status, Status::Warn);
        assert!(
            c.found.contains("containerd has runtime \"nvidia\""),
            "{}",
            c.found
        );
    }

    #[test]
    fn runc_path_at_the_toolkit_passes() {
        let mut f = facts();
        f.runc_path = "/usr/bin/nvidia-container-runtime".into();
        f.runc = FileState::Executable {
            at: f.runc_path.clone(),
        };
        f.toolkit_binary = Some(f.runc_path.clone());
        let c = check(&f, Path::new(CONFIG));
        assert_eq!(c.status, Status::Pass);
        assert!(c.found.contains("NVIDIA Container Toolkit adds"), "{}", c.found);
    }

    #[test]
    fn toolkit_entries_of_a_dump() {
        let v2 = r#"version = 2
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]
  runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia.options]
    BinaryName = "/usr/bin/nvidia-container-runtime"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.gpu]
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.gpu.options]
    BinaryName = "/usr/local/nvidia/toolkit/nvidia-container-runtime.cdi"
"#;
        assert_eq!(
            nvidia_runtimes(v2),
            vec![
                "runtime \"nvidia\" (BinaryName /usr/bin/nvidia-container-runtime)".to_string(),
                "runtime \"gpu\" (BinaryName /usr/local/nvidia/toolkit/nvidia-container-runtime.cdi)".into(),
            ]
        );
        let v3 = "version = 3\n[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.nvidia-cdi]\nruntime_type = 'io.containerd.runc.v2'\n";
        assert_eq!(nvidia_runtimes(v3), vec!["runtime \"nvidia-cdi\"".to_string()]);
        assert!(nvidia_runtimes("not toml [").is_empty());
        assert!(nvidia_runtimes("version = 2\n").is_empty());
    }
}
