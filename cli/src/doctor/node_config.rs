//! Check: the node config file parses. The other checks use its settings, or the built-in
//! defaults when it does not parse (as the shim does for runc_path).

use std::path::PathBuf;

use gpu_mps_api::NodeConfig;

use super::{Check, DoctorError};

const NAME: &str = "node-config";

#[derive(Debug)]
pub struct ConfigFacts {
    pub path: PathBuf,
    pub state: ConfigState,
    /// The settings the other checks use: the file's, else the defaults.
    pub config: NodeConfig,
}

#[derive(Debug)]
pub enum ConfigState {
    Loaded,
    /// No file: every setting is a default.
    Missing,
    Invalid(DoctorError),
}

pub fn check(f: &ConfigFacts) -> Check {
    let c = &f.config;
    let path = f.path.display();
    match &f.state {
        ConfigState::Loaded => Check::pass(
            NAME,
            format!(
                "{path}: policy {}, tenancy {}, root {}",
                c.limits.policy,
                c.limits.tenancy,
                c.root.display()
            ),
        ),
        ConfigState::Missing => Check::warn(
            NAME,
            format!(
                "{path} does not exist: every setting is a default (policy {}, root {}), and a container that sets no limits of its own is refused",
                c.limits.policy,
                c.root.display()
            ),
            format!(
                "install the shipped config as {path} (packaging/config.toml; the gpu-mps package does) and restart gpu-mps-manager"
            ),
        ),
        ConfigState::Invalid(e) => Check::fail(
            NAME,
            format!("{e}; the checks below use the built-in defaults"),
            format!(
                "correct the key it names in {path}, then restart gpu-mps-manager (it does not start with this file)"
            ),
        ),
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::doctor::Status;

    fn facts(state: ConfigState) -> ConfigFacts {
        ConfigFacts {
            path: "/etc/gpu-mps/config.toml".into(),
            state,
            config: NodeConfig::default(),
        }
    }

    #[test]
    fn a_loaded_config_passes() {
        let c = check(&facts(ConfigState::Loaded));
        assert_eq!(c.status, Status::Pass);
        assert_eq!(
            c.found,
            "/etc/gpu-mps/config.toml: policy exact, tenancy shared, root /run/gpu-mps"
        );
    }

    #[test]
    fn a_missing_config_warns() {
        let c = check(&facts(ConfigState::Missing));
        assert_eq!(c.status, Status::Warn);
        assert!(
            c.found.contains("does not exist") && c.found.contains("refused"),
            "{}",
            c.found
        );
        assert!(c.fix.unwrap().contains("packaging/config.toml"));
    }

    #[test]
    fn an_invalid_config_fails_with_its_error() {
        let e = NodeConfig::from_toml("polcy = 1", Path::new("/etc/gpu-mps/config.toml")).unwrap_err();
        let c = check(&facts(ConfigState::Invalid(e.into())));
        assert_eq!(c.status, Status::Fail);
        assert!(
            c.found.contains("/etc/gpu-mps/config.toml") && c.found.contains("polcy"),
            "{}",
            c.found
        );
        assert!(c.found.contains("built-in defaults"), "{}", c.found);
        assert!(c.fix.unwrap().contains("restart gpu-mps-manager"));
    }
}
