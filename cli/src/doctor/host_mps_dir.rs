//! Check: where runc_path chains the NVIDIA Container Toolkit, the host has no /tmp/nvidia-mps.
//!
//! In legacy mode the toolkit's prestart hook binds the host's /tmp/nvidia-mps, when it exists,
//! at the same path in every GPU container: over the gate gpu-mps-shim mounted there.
//! gpu-mps-hook then refuses the create (docs/adr/0011), so on such a node every chained GPU pod
//! fails to start until the dir goes. /tmp is world-writable: any host account, or an MPS set up
//! by hand with the default pipe dir, makes it.

use std::path::{Path, PathBuf};

use super::{Check, DoctorError};
use crate::containerd_registration::is_toolkit_binary;

const NAME: &str = "host-mps-dir";
/// Where a host MPS daemon keeps its pipes by default, and the path the toolkit binds.
pub const HOST_MPS_DIR: &str = gpu_mps_api::CONTAINER_PIPE_DIR;

#[derive(Debug)]
pub struct HostMpsDirFacts {
    pub path: PathBuf,
    /// What is at `path` (`a directory`, `a symlink`...), `None` when nothing.
    pub found: Result<Option<&'static str>, DoctorError>,
}

pub fn check(f: &HostMpsDirFacts, runc_path: &Path) -> Check {
    let dir = f.path.display();
    if !is_toolkit_binary(&runc_path.to_string_lossy()) {
        return Check::pass(
            NAME,
            format!(
                "runc_path = {} does not chain the NVIDIA Container Toolkit, so no toolkit hook binds the host's {dir} into gpu-mps containers",
                runc_path.display()
            ),
        );
    }
    match &f.found {
        Ok(None) => Check::pass(
            NAME,
            format!(
                "the host has no {dir}, which the chained toolkit's legacy hook would bind over each GPU container's gate"
            ),
        ),
        Ok(Some(kind)) => Check::fail(
            NAME,
            format!(
                "runc_path = {} chains the NVIDIA Container Toolkit and the host has {dir} ({kind}): in legacy mode the toolkit's prestart hook binds it over each GPU container's gate, and gpu-mps-hook refuses every such create",
                runc_path.display()
            ),
            format!(
                "remove {dir} from the host (stop the MPS daemon that uses it, if one runs outside gpu-mps: gpu-mps runs its own daemons under its root), and keep it from coming back; or run the toolkit in CDI mode (mode = \"cdi\" under [nvidia-container-runtime] in /etc/nvidia-container-runtime/config.toml) and remove the dir all the same"
            ),
        ),
        Err(e) => Check::skip(NAME, format!("cannot tell whether the host has {dir}: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::Status;

    const CHAINED: &str = "/usr/bin/nvidia-container-runtime";

    fn facts(found: Option<&'static str>) -> HostMpsDirFacts {
        HostMpsDirFacts {
            path: HOST_MPS_DIR.into(),
            found: Ok(found),
        }
    }

    #[test]
    fn a_chained_toolkit_and_a_host_dir_fail_with_why_and_what_to_do() {
        let c = check(&facts(Some("a directory")), Path::new(CHAINED));
        assert_eq!(c.status, Status::Fail);
        assert!(
            c.found.contains("/tmp/nvidia-mps (a directory)")
                && c.found.contains("over each GPU container's gate")
                && c.found.contains("gpu-mps-hook refuses"),
            "{}",
            c.found
        );
        let fix = c.fix.unwrap_or_default();
        assert!(
            fix.starts_with("remove /tmp/nvidia-mps from the host") && fix.contains("CDI mode"),
            "{fix}"
        );
    }

    #[test]
    fn no_host_dir_or_no_chain_passes() {
        assert_eq!(check(&facts(None), Path::new(CHAINED)).status, Status::Pass);
        let plain = check(&facts(Some("a directory")), Path::new("/usr/sbin/runc"));
        assert_eq!(plain.status, Status::Pass, "{}", plain.found);
        assert!(plain.found.contains("does not chain"), "{}", plain.found);
    }

    #[test]
    fn an_unreadable_tmp_skips() {
        let f = HostMpsDirFacts {
            path: HOST_MPS_DIR.into(),
            found: Err(DoctorError::Io {
                path: HOST_MPS_DIR.into(),
                action: "looking at it",
                source: std::io::Error::from_raw_os_error(13),
            }),
        };
        let c = check(&f, Path::new(CHAINED));
        assert_eq!(c.status, Status::Skip);
        assert!(c.found.contains("Permission denied"), "{}", c.found);
    }
}
