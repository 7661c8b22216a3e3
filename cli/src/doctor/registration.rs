//! Check: containerd has the `gpu-mps` runtime, with gpu-mps-shim as its BinaryName, in the
//! config it reads (`containerd --config <main config> config dump`, imports merged), and the
//! running containerd started after that config last changed (it reads its config only at start).

use std::path::{Path, PathBuf};

use super::{Check, DoctorError, FileState};
use crate::containerd_registration::{self as reg, InstallOptions, RUNTIME_NAME};

const NAME: &str = "containerd";

#[derive(Debug)]
pub struct RegistrationFacts {
    pub main_config: PathBuf,
    /// The BinaryName the entry must have.
    pub shim: PathBuf,
    /// What `install-containerd` registers without `--shim`: the gpu-mps-shim next to this
    /// gpu-mps (crate::installed), so the suggested command names `--shim` only when it differs.
    pub default_shim: PathBuf,
    pub shim_state: FileState,
    /// None: no containerd binary was found.
    pub containerd: Option<ContainerdFacts>,
}

#[derive(Debug)]
pub struct ContainerdFacts {
    pub binary: PathBuf,
    pub binary_state: FileState,
    pub version: Option<(u32, u32)>,
    pub dump: Result<String, DoctorError>,
    /// The containerd process that reads `main_config`, if one runs.
    pub running: Option<RunningContainerd>,
    /// The main config and the drop-in, with their modification times (unix seconds).
    pub config_files: Vec<(PathBuf, i64)>,
}

/// The node's containerd: the process serving containerd's socket (kubelet's endpoint).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunningContainerd {
    pub pid: u32,
    /// The socket it was found serving.
    pub socket: PathBuf,
    /// The config its command line names (`--config`/`-c`, else containerd's default).
    pub config: PathBuf,
    /// `config` is the main config doctor checks (the same file, links resolved).
    pub reads_main_config: bool,
    /// Boot time plus the start in clock ticks after boot: both whole seconds in /proc, so up to
    /// [`START_TIME_SLACK`] early.
    pub started_unix: i64,
}

/// A config changed this close to containerd's start may be older than it: install-containerd
/// followed at once by a restart must not be told to restart again.
pub const START_TIME_SLACK: i64 = 2;

/// Where kubelet reaches containerd unless its --container-runtime-endpoint says otherwise.
pub const CONTAINERD_SOCKET: &str = "/run/containerd/containerd.sock";

/// What doctor and the DaemonSet's readiness say while the handler is in the config file but not
/// in the running containerd: pods with `runtimeClassName: gpu-mps` fail until then.
pub const NOT_LOADED_YET: &str = "containerd has not loaded the gpu-mps handler yet";

fn install_command(f: &RegistrationFacts) -> String {
    let mut command = "gpu-mps install-containerd".to_string();
    if f.main_config != Path::new(reg::MAIN_CONFIG) {
        command.push_str(&format!(" --containerd-config {}", f.main_config.display()));
    }
    if f.shim != f.default_shim {
        command.push_str(&format!(" --shim {}", f.shim.display()));
    }
    command
}

pub fn check(f: &RegistrationFacts) -> Check {
    let Some(c) = &f.containerd else {
        return Check::fail(
            NAME,
            "no containerd binary on PATH or in /usr/local/bin, /usr/bin, /bin",
            "install containerd (1.6, 1.7 or 2.x), or name its binary with --containerd <path>",
        );
    };
    if !c.binary_state.is_executable() {
        return Check::fail(
            NAME,
            format!("the containerd binary {}", c.binary_state.describe(&c.binary)),
            "name containerd's binary with --containerd <path>, or leave the flag out to find it on PATH",
        );
    }
    let main = f.main_config.display();
    let dump = match &c.dump {
        Ok(dump) => dump,
        Err(e) => {
            return Check::fail(
                NAME,
                format!("containerd cannot read its config: {e}"),
                format!("correct {main} (containerd does not start with it either), then run doctor again"),
            );
        }
    };
    let opts = InstallOptions {
        main_config: f.main_config.clone(),
        shim_path: f.shim.clone(),
        ..InstallOptions::default()
    };
    let notes = match reg::check_effective(dump, &opts) {
        Ok(notes) => notes,
        Err(e) => {
            return Check::fail(
                NAME,
                e.to_string(),
                format!(
                    "register the runtime: {}, then systemctl restart containerd",
                    install_command(f)
                ),
            );
        }
    };
    let shim = f.shim.display();
    if !f.shim_state.is_executable() {
        return Check::fail(
            NAME,
            format!(
                "runtime {RUNTIME_NAME:?} is registered, but its BinaryName {}",
                f.shim_state.describe(&f.shim)
            ),
            format!(
                "install gpu-mps-shim at {shim} (the gpu-mps package does), or register the path it has: gpu-mps install-containerd --shim <path>"
            ),
        );
    }
    let version = c
        .version
        .map(|(major, minor)| format!(" {major}.{minor}"))
        .unwrap_or_default();
    let found =
        format!("containerd{version} reads runtime {RUNTIME_NAME:?} from {main} with BinaryName {shim}");
    if let Some(running) = c.running.as_ref().filter(|r| !r.reads_main_config) {
        return Check::warn(
            NAME,
            format!(
                "{found}, but the containerd serving {} (pid {}) runs with --config {}, not {main}",
                running.socket.display(),
                running.pid,
                running.config.display()
            ),
            format!(
                "check the config that containerd runs with: gpu-mps doctor --containerd-config {} (or name the node's containerd socket with --containerd-socket)",
                running.config.display()
            ),
        );
    }
    if let Some(running) = &c.running {
        let changed: Vec<String> = c
            .config_files
            .iter()
            .filter(|(_, modified)| *modified > running.started_unix + START_TIME_SLACK)
            .map(|(path, _)| path.display().to_string())
            .collect();
        if !changed.is_empty() {
            return Check::warn(
                NAME,
                format!(
                    "{NOT_LOADED_YET}: {found}, but the running containerd (pid {}, serving {}) started before {} last changed: it runs without this until it restarts, and pods with runtimeClassName gpu-mps fail with no runtime for \"gpu-mps\" is configured",
                    running.pid,
                    running.socket.display(),
                    changed.join(" and ")
                ),
                "restart containerd: systemctl restart containerd (running containers keep running)",
            );
        }
    }
    if !notes.is_empty() {
        return Check::warn(
            NAME,
            format!("{found}, but {}", notes.join("; ")),
            "change the runc entry as the note says, then rerun gpu-mps install-containerd and restart containerd",
        );
    }
    let running = match &c.running {
        Some(r) => format!(
            " (running as pid {}, started after its config last changed; it serves {} with --config {})",
            r.pid,
            r.socket.display(),
            r.config.display()
        ),
        None => " (containerd is not running: it reads this when it starts)".into(),
    };
    Check::pass(NAME, found + &running)
}

/// The config a containerd command line reads: `--config X`, `--config=X`, `-c X`, or the
/// default.
pub fn containerd_config_arg(args: &[String]) -> PathBuf {
    let mut args = args.iter().skip(1);
    while let Some(arg) = args.next() {
        if let Some(value) = arg.strip_prefix("--config=").or_else(|| arg.strip_prefix("-c=")) {
            return value.into();
        }
        if arg == "--config" || arg == "-c" {
            if let Some(value) = args.next() {
                return value.into();
            }
        }
    }
    reg::MAIN_CONFIG.into()
}

/// Boot time (unix seconds): the `btime` line of `/proc/stat`.
pub fn parse_boot_time(proc_stat: &str) -> Option<i64> {
    proc_stat
        .lines()
        .find_map(|l| l.strip_prefix("btime "))
        .and_then(|v| v.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::Status;

    const DUMP: &str = r#"version = 2
[plugins."io.containerd.grpc.v1.cri".containerd]
  default_runtime_name = "runc"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.gpu-mps]
    runtime_type = "io.containerd.runc.v2"
    pod_annotations = ["gpu-mps.io/*", "*.gpu-mps.io/*"]
    container_annotations = ["gpu-mps.io/*", "*.gpu-mps.io/*", "cdi.k8s.io/*", "gpu-mps-device-plugin/*"]
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.gpu-mps.options]
      BinaryName = "/usr/local/bin/gpu-mps-shim"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
"#;

    fn facts(dump: Result<String, DoctorError>) -> RegistrationFacts {
        RegistrationFacts {
            main_config: reg::MAIN_CONFIG.into(),
            shim: reg::SHIM_PATH.into(),
            default_shim: reg::SHIM_PATH.into(),
            shim_state: FileState::Executable {
                at: reg::SHIM_PATH.into(),
            },
            containerd: Some(ContainerdFacts {
                binary: "/usr/bin/containerd".into(),
                binary_state: FileState::Executable {
                    at: "/usr/bin/containerd".into(),
                },
                version: Some((1, 7)),
                dump,
                running: None,
                config_files: vec![(reg::MAIN_CONFIG.into(), 1000)],
            }),
        }
    }

    #[test]
    fn a_registered_runtime_passes() {
        let c = check(&facts(Ok(DUMP.into())));
        assert_eq!(c.status, Status::Pass, "{c:?}");
        assert!(
            c.found.starts_with("containerd 1.7 reads runtime \"gpu-mps\" from /etc/containerd/config.toml with BinaryName /usr/local/bin/gpu-mps-shim"),
            "{}",
            c.found
        );
        assert!(c.found.contains("not running"), "{}", c.found);
        let mut f = facts(Ok(DUMP.into()));
        if let Some(c) = f.containerd.as_mut() {
            c.running = Some(RunningContainerd {
                pid: 42,
                socket: CONTAINERD_SOCKET.into(),
                config: reg::MAIN_CONFIG.into(),
                reads_main_config: true,
                started_unix: 1000 - START_TIME_SLACK,
            });
        }
        let c = check(&f);
        assert_eq!(c.status, Status::Pass, "{c:?}");
        assert!(c.found.contains("pid 42"), "{}", c.found);
    }

    #[test]
    fn an_unregistered_runtime_fails_with_the_install_command() {
        let c = check(&facts(Ok(DUMP.replace("runtimes.gpu-mps", "runtimes.other"))));
        assert_eq!(c.status, Status::Fail);
        assert!(c.found.contains("runtime \"gpu-mps\" is missing"), "{}", c.found);
        assert_eq!(
            c.fix.as_deref(),
            Some("register the runtime: gpu-mps install-containerd, then systemctl restart containerd")
        );
        let mut f = facts(Ok(DUMP.into()));
        f.main_config = "/tmp/c.toml".into();
        f.shim = "/opt/gpu-mps-shim".into();
        let c = check(&f);
        assert_eq!(c.status, Status::Fail);
        assert!(
            c.found.contains("BinaryName = \"/usr/local/bin/gpu-mps-shim\""),
            "{}",
            c.found
        );
        assert!(
            c.fix.unwrap().contains(
                "gpu-mps install-containerd --containerd-config /tmp/c.toml --shim /opt/gpu-mps-shim"
            )
        );
    }

    #[test]
    fn the_install_command_names_the_shim_only_when_it_is_not_the_default() {
        // A Debian package node (gpu-mps and its shim in /usr/bin) where the runtime is missing.
        let mut f = facts(Ok(DUMP.replace("runtimes.gpu-mps", "runtimes.other")));
        f.shim = "/usr/bin/gpu-mps-shim".into();
        f.default_shim = "/usr/bin/gpu-mps-shim".into();
        let c = check(&f);
        assert_eq!(c.status, Status::Fail, "{c:?}");
        assert_eq!(
            c.fix.as_deref(),
            Some("register the runtime: gpu-mps install-containerd, then systemctl restart containerd")
        );
        f.shim = "/usr/local/bin/gpu-mps-shim".into();
        let c = check(&f);
        assert_eq!(c.status, Status::Fail, "{c:?}");
        assert!(
            c.fix.as_deref().is_some_and(
                |fix| fix.contains("gpu-mps install-containerd --shim /usr/local/bin/gpu-mps-shim")
            ),
            "{c:?}"
        );
    }

    #[test]
    fn no_containerd_or_an_unreadable_config_fails() {
        let mut f = facts(Ok(DUMP.into()));
        f.containerd = None;
        let c = check(&f);
        assert_eq!(c.status, Status::Fail);
        assert!(c.fix.unwrap().contains("--containerd"));
        let mut f = facts(Ok(DUMP.into()));
        if let Some(c) = f.containerd.as_mut() {
            c.binary = "/opt/containerd".into();
            c.binary_state = FileState::Missing {
                searched: String::new(),
            };
        }
        let c = check(&f);
        assert_eq!(c.status, Status::Fail);
        assert_eq!(c.found, "the containerd binary /opt/containerd does not exist");
        let c = check(&facts(Err(DoctorError::Command {
            program: "/usr/bin/containerd".into(),
            message: "exit status: 1: failed to load TOML".into(),
        })));
        assert_eq!(c.status, Status::Fail);
        assert!(c.found.contains("cannot read its config") && c.found.contains("failed to load TOML"));
    }

    #[test]
    fn a_missing_shim_fails() {
        let mut f = facts(Ok(DUMP.into()));
        f.shim_state = FileState::Missing {
            searched: "looked at that path".into(),
        };
        let c = check(&f);
        assert_eq!(c.status, Status::Fail);
        assert!(
            c.found
                .contains("BinaryName /usr/local/bin/gpu-mps-shim does not exist"),
            "{}",
            c.found
        );
    }

    #[test]
    fn a_containerd_started_before_the_change_warns() {
        let mut f = facts(Ok(DUMP.into()));
        if let Some(c) = f.containerd.as_mut() {
            c.running = Some(RunningContainerd {
                pid: 42,
                socket: CONTAINERD_SOCKET.into(),
                config: reg::MAIN_CONFIG.into(),
                reads_main_config: true,
                started_unix: 1000 - START_TIME_SLACK - 1,
            });
        }
        let c = check(&f);
        assert_eq!(c.status, Status::Warn);
        assert!(c.found.starts_with(NOT_LOADED_YET), "{}", c.found);
        assert!(
            c.found.contains(
                "(pid 42, serving /run/containerd/containerd.sock) started before /etc/containerd/config.toml last changed"
            ),
            "{}",
            c.found
        );
        assert!(c.fix.unwrap().contains("systemctl restart containerd"));
    }

    #[test]
    fn a_containerd_on_another_config_is_named_with_its_config() {
        let mut f = facts(Ok(DUMP.into()));
        if let Some(c) = f.containerd.as_mut() {
            c.running = Some(RunningContainerd {
                pid: 7,
                socket: CONTAINERD_SOCKET.into(),
                config: "/etc/k3s/containerd.toml".into(),
                reads_main_config: false,
                started_unix: 2000,
            });
        }
        let c = check(&f);
        assert_eq!(c.status, Status::Warn, "{c:?}");
        assert!(
            c.found.contains(
                "the containerd serving /run/containerd/containerd.sock (pid 7) runs with --config /etc/k3s/containerd.toml, not /etc/containerd/config.toml"
            ),
            "{}",
            c.found
        );
        assert!(
            c.fix
                .unwrap()
                .contains("gpu-mps doctor --containerd-config /etc/k3s/containerd.toml")
        );
    }

    #[test]
    fn options_that_differ_from_runc_warn() {
        let dump = format!(
            "{DUMP}    [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc.options]\n      SystemdCgroup = true\n"
        );
        let c = check(&facts(Ok(dump)));
        assert_eq!(c.status, Status::Warn, "{c:?}");
        assert!(c.found.contains("SystemdCgroup"), "{}", c.found);
    }

    #[test]
    fn proc_fields() {
        let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            containerd_config_arg(&args(&["containerd"])),
            PathBuf::from("/etc/containerd/config.toml")
        );
        assert_eq!(
            containerd_config_arg(&args(&[
                "containerd",
                "--log-level",
                "debug",
                "--config",
                "/x.toml"
            ])),
            PathBuf::from("/x.toml")
        );
        assert_eq!(
            containerd_config_arg(&args(&["/usr/bin/containerd", "-c", "/y.toml"])),
            PathBuf::from("/y.toml")
        );
        assert_eq!(
            containerd_config_arg(&args(&["containerd", "--config=/z.toml"])),
            PathBuf::from("/z.toml")
        );
        assert_eq!(
            parse_boot_time("cpu  1 2 3\nbtime 1700000000\nprocesses 5\n"),
            Some(1_700_000_000)
        );
        assert_eq!(parse_boot_time("cpu 1\n"), None);
    }
}
