//! Check: gpu-mps-manager answers on its socket and runs with the config in the file (its policy
//! and the digest of every setting); an edit of the file takes effect only when it restarts.

use std::path::PathBuf;

use gpu_mps_api::client::ClientError;

use super::{Check, ConfigFacts, ConfigState, DoctorError};

const NAME: &str = "manager";
const START: &str = "start it: systemctl start gpu-mps-manager (journalctl -u gpu-mps-manager says why it stopped); on Kubernetes, the manager container of the gpu-mps DaemonSet";

#[derive(Debug)]
pub struct ManagerFacts {
    pub socket: PathBuf,
    pub answer: Result<ManagerAnswer, DoctorError>,
}

/// What the manager's Status says about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManagerAnswer {
    pub version: String,
    pub policy: String,
    pub config_digest: String,
    pub config_source: String,
    /// The manager's own note when its file changed since it started.
    pub config_note: String,
}

pub fn check(f: &ManagerFacts, config: &ConfigFacts) -> Check {
    let socket = f.socket.display();
    let a = match &f.answer {
        Ok(a) => a,
        Err(DoctorError::Manager(ClientError::NotRunning { reason, .. })) => {
            return Check::fail(
                NAME,
                format!("gpu-mps-manager is not running: nothing answers at {socket} ({reason})"),
                START,
            );
        }
        Err(DoctorError::Manager(ClientError::Timeout { seconds })) => {
            return Check::fail(
                NAME,
                format!("gpu-mps-manager at {socket} did not answer within {seconds} s"),
                "see what it is doing (journalctl -u gpu-mps-manager), then restart it: systemctl restart gpu-mps-manager",
            );
        }
        Err(e) => {
            return Check::fail(
                NAME,
                format!("gpu-mps-manager at {socket} did not answer: {e}"),
                format!("check it runs (systemctl status gpu-mps-manager); if not, {START}"),
            );
        }
    };
    let path = config.path.display();
    let running = format!(
        "gpu-mps-manager {} answers at {socket} with policy {} (config digest {}, read from {})",
        a.version, a.policy, a.config_digest, a.config_source
    );
    let restart = "restart it to apply the file: systemctl restart gpu-mps-manager (MPS daemons, leases and gates survive a restart)";
    if let ConfigState::Invalid(_) = config.state {
        return Check::warn(
            NAME,
            format!("{running}, but {path} does not parse: the manager would not start again with it"),
            format!("correct {path} before the manager's next restart"),
        );
    }
    let file_digest = config.config.digest();
    let mut found = running;
    if a.config_source != config.path.display().to_string() {
        found.push_str(&format!("; this check read {path}"));
    }
    if a.config_digest != file_digest {
        let note = if a.config_note.is_empty() {
            String::new()
        } else {
            format!("; the manager says: {}", a.config_note)
        };
        return Check::warn(
            NAME,
            format!(
                "{found}, but {path} now holds policy {} (digest {file_digest}): the config changed since the manager started{note}",
                config.config.limits.policy
            ),
            restart,
        );
    }
    Check::pass(NAME, format!("{found}: the same config as {path}"))
}

#[cfg(test)]
mod tests {
    use gpu_mps_api::NodeConfig;
    use gpu_mps_api::node_config::LimitPolicy;

    use super::*;
    use crate::doctor::Status;

    const SOCKET: &str = "/run/gpu-mps/manager.sock";

    fn config(state: ConfigState) -> ConfigFacts {
        ConfigFacts {
            path: "/etc/gpu-mps/config.toml".into(),
            state,
            config: NodeConfig::default(),
        }
    }

    fn answer(digest: String) -> ManagerFacts {
        ManagerFacts {
            socket: SOCKET.into(),
            answer: Ok(ManagerAnswer {
                version: "0.1.0".into(),
                policy: "exact".into(),
                config_digest: digest,
                config_source: "/etc/gpu-mps/config.toml".into(),
                config_note: String::new(),
            }),
        }
    }

    #[test]
    fn a_manager_with_the_files_config_passes() {
        let c = check(
            &answer(NodeConfig::default().digest()),
            &config(ConfigState::Loaded),
        );
        assert_eq!(c.status, Status::Pass, "{c:?}");
        assert!(
            c.found
                .starts_with("gpu-mps-manager 0.1.0 answers at /run/gpu-mps/manager.sock with policy exact")
                && c.found.ends_with("the same config as /etc/gpu-mps/config.toml"),
            "{}",
            c.found
        );
    }

    #[test]
    fn a_manager_that_is_not_running_fails_in_plain_words() {
        let f = ManagerFacts {
            socket: SOCKET.into(),
            answer: Err(DoctorError::Manager(ClientError::NotRunning {
                socket: SOCKET.into(),
                reason: "its socket does not exist".into(),
            })),
        };
        let c = check(&f, &config(ConfigState::Loaded));
        assert_eq!(c.status, Status::Fail);
        assert_eq!(
            c.found,
            "gpu-mps-manager is not running: nothing answers at /run/gpu-mps/manager.sock (its socket does not exist)"
        );
        assert!(
            c.fix
                .unwrap_or_default()
                .starts_with("start it: systemctl start gpu-mps-manager")
        );
    }

    #[test]
    fn a_hung_or_failing_manager_fails() {
        let mut f = answer(String::new());
        f.answer = Err(DoctorError::Manager(ClientError::Timeout { seconds: 5 }));
        let c = check(&f, &config(ConfigState::Loaded));
        assert_eq!(c.status, Status::Fail);
        assert!(c.found.contains("did not answer within 5 s"), "{}", c.found);
        f.answer = Err(DoctorError::Manager(ClientError::Other("broken pipe".into())));
        let c = check(&f, &config(ConfigState::Loaded));
        assert_eq!(c.status, Status::Fail);
        assert!(c.found.contains("broken pipe"), "{}", c.found);
    }

    #[test]
    fn a_config_changed_since_the_start_warns() {
        let mut edited = config(ConfigState::Loaded);
        edited.config.limits.policy = LimitPolicy::Uniform;
        let mut f = answer(NodeConfig::default().digest());
        if let Ok(a) = f.answer.as_mut() {
            a.config_note = "config.toml changed since start".into();
        }
        let c = check(&f, &edited);
        assert_eq!(c.status, Status::Warn);
        assert!(
            c.found.contains("now holds policy uniform")
                && c.found.contains("changed since the manager started")
                && c.found
                    .contains("the manager says: config.toml changed since start"),
            "{}",
            c.found
        );
        assert!(
            c.fix
                .unwrap_or_default()
                .contains("systemctl restart gpu-mps-manager")
        );
    }

    #[test]
    fn a_config_that_no_longer_parses_warns() {
        let e = NodeConfig::from_toml("x = 1", std::path::Path::new("/etc/gpu-mps/config.toml")).unwrap_err();
        let c = check(
            &answer(NodeConfig::default().digest()),
            &config(ConfigState::Invalid(e.into())),
        );
        assert_eq!(c.status, Status::Warn);
        assert!(c.found.contains("would not start again"), "{}", c.found);
    }
}
