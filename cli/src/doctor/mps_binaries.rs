//! Check: the driver's MPS binaries are there. The manager runs `[daemon] control_binary`
//! (nvidia-cuda-mps-control) for every GPU's daemon, and the control daemon starts
//! nvidia-cuda-mps-server, which it looks for beside itself and on PATH.

use std::path::{Path, PathBuf};

use super::{Check, FileState};

const NAME: &str = "mps-binaries";

#[derive(Debug)]
pub struct MpsFacts {
    /// `control_binary` as the config names it.
    pub control_binary: PathBuf,
    pub control: FileState,
    pub server: FileState,
}

pub fn check(f: &MpsFacts, config_path: &Path) -> Check {
    let package = "install the NVIDIA driver's MPS tools (nvidia-cuda-mps-control and nvidia-cuda-mps-server: Debian's nvidia-cuda-mps package, or the driver's .run installer)";
    if !f.control.is_executable() {
        return Check::fail(
            NAME,
            format!(
                "control_binary {}: gpu-mps-manager cannot start an MPS daemon",
                f.control.describe(&f.control_binary)
            ),
            format!(
                "{package}, or set control_binary under [daemon] in {} to where it is",
                config_path.display()
            ),
        );
    }
    let server = Path::new("nvidia-cuda-mps-server");
    if !f.server.is_executable() {
        return Check::fail(
            NAME,
            format!(
                "{} is there but {}: the MPS control daemon cannot start a server, so no CUDA client gets one",
                f.control.describe(&f.control_binary),
                f.server.describe(server)
            ),
            format!("{package}; the server goes beside the control binary or on PATH"),
        );
    }
    Check::pass(
        NAME,
        format!(
            "{} and {}",
            f.control.describe(&f.control_binary),
            f.server.describe(server)
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::Status;

    const CONFIG: &str = "/etc/gpu-mps/config.toml";

    fn found(path: &str) -> FileState {
        FileState::Executable { at: path.into() }
    }

    fn facts() -> MpsFacts {
        MpsFacts {
            control_binary: "nvidia-cuda-mps-control".into(),
            control: found("/usr/bin/nvidia-cuda-mps-control"),
            server: found("/usr/bin/nvidia-cuda-mps-server"),
        }
    }

    #[test]
    fn both_binaries_pass() {
        let c = check(&facts(), Path::new(CONFIG));
        assert_eq!(c.status, Status::Pass);
        assert_eq!(
            c.found,
            "/usr/bin/nvidia-cuda-mps-control and /usr/bin/nvidia-cuda-mps-server"
        );
    }

    #[test]
    fn a_missing_control_binary_fails() {
        let mut f = facts();
        f.control = FileState::Missing {
            searched: "not on PATH, /usr/bin, /usr/local/bin".into(),
        };
        let c = check(&f, Path::new(CONFIG));
        assert_eq!(c.status, Status::Fail);
        assert_eq!(
            c.found,
            "control_binary nvidia-cuda-mps-control does not exist (not on PATH, /usr/bin, /usr/local/bin): gpu-mps-manager cannot start an MPS daemon"
        );
        let fix = c.fix.unwrap_or_default();
        assert!(
            fix.contains("nvidia-cuda-mps package") && fix.contains(CONFIG),
            "{fix}"
        );
        f.control = FileState::NotExecutable {
            at: "/opt/mps-control".into(),
        };
        assert!(
            check(&f, Path::new(CONFIG))
                .found
                .contains("/opt/mps-control is not executable")
        );
    }

    #[test]
    fn a_missing_server_fails() {
        let mut f = facts();
        f.server = FileState::Missing {
            searched: "not beside it, not on PATH".into(),
        };
        let c = check(&f, Path::new(CONFIG));
        assert_eq!(c.status, Status::Fail);
        assert!(
            c.found.contains("nvidia-cuda-mps-server does not exist"),
            "{}",
            c.found
        );
    }
}
