//! Check: the runc gpu-mps-shim execs (`runc_path`) is there, and GPU containers get their devices.
//!
//! The shim hands the rewritten spec to `runc_path`. Where the NVIDIA Container Toolkit is what
//! gives GPU containers their device nodes and driver libraries (its `nvidia` runtime, or
//! nvidia-container-runtime chained as runc), plain runc at runc_path skips that step: a pod sent
//! to the gpu-mps runtime then starts without its GPU, unless the GPU comes as a CDI device, which
//! containerd resolves before the runtime runs.

use std::path::{Path, PathBuf};

use super::{Check, FileState};
use crate::containerd_registration::{ToolkitRuntime, is_toolkit_binary};

const NAME: &str = "runc";

#[derive(Debug)]
pub struct RuncFacts {
    pub runc_path: PathBuf,
    pub runc: FileState,
    /// runc binaries found elsewhere on the node, for the fix when runc_path is wrong.
    pub runc_elsewhere: Vec<PathBuf>,
    /// containerd runtime entries of the toolkit, from `config dump`.
    pub nvidia_runtimes: Vec<ToolkitRuntime>,
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
    if is_toolkit_binary(&f.runc_path.to_string_lossy()) {
        return Check::pass(
            NAME,
            format!(
                "runc_path = {runc_path} is executable: the NVIDIA Container Toolkit adds each GPU container's devices and driver libraries after gpu-mps-shim"
            ),
        );
    }
    let mut toolkit = Vec::new();
    if !f.nvidia_runtimes.is_empty() {
        let runtimes: Vec<String> = f.nvidia_runtimes.iter().map(ToString::to_string).collect();
        toolkit.push(format!("containerd has {}", runtimes.join(", ")));
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
        f.nvidia_runtimes = vec![ToolkitRuntime {
            name: "nvidia".into(),
            binary: None,
            default: false,
        }];
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
}
