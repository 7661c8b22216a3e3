//! The I/O of `gpu-mps doctor`: reads the node's files, runs containerd and nvidia-smi, loads
//! NVML, asks the manager, looks at /proc. Whatever fails is recorded in the facts; nothing here
//! decides PASS or FAIL.

use std::collections::HashMap;
use std::fs;
use std::io::{self, Read};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, UNIX_EPOCH};

use gpu_mps_api::NodeConfig;
use gpu_mps_api::client::ManagerConnection;
use gpu_mps_api::node_config::PublishedConfig;
use gpu_mps_api::node_files::load_inventory;
use gpu_mps_api::process_identity::ProcessIdentity;
use gpu_mps_api::proto;

use super::{
    CdiFacts, CdiSpec, ConfigFacts, ConfigState, ContainerdFacts, DescriptorFacts, DoctorError, Facts,
    FileState, GpuFacts, GpuSeen, GpuSource, HostMpsDirFacts, ManagerAnswer, ManagerFacts, MpsFacts,
    NvmlProbe, ProcessDescriptors, RegistrationFacts, RuncFacts, RunningContainerd, containerd_config_arg,
    parse_boot_time, parse_cdi_spec, parse_nvidia_smi, parse_open_files_limit,
};
use crate::containerd_registration::{self as reg, InstallOptions};

/// Where the checks look; the defaults are a node's paths, tests point them elsewhere.
#[derive(Debug, Clone)]
pub struct DoctorOptions {
    pub config: PathBuf,
    /// The manager's socket; default: `<root>/manager.sock`.
    pub socket: Option<PathBuf>,
    pub containerd_config: PathBuf,
    pub drop_in: PathBuf,
    pub shim: PathBuf,
    /// The containerd binary; default: found on PATH.
    pub containerd: Option<PathBuf>,
    pub cdi_dirs: Vec<PathBuf>,
    /// The host dir the chained toolkit's legacy hook binds into containers.
    pub host_mps_dir: PathBuf,
    /// The socket kubelet talks to containerd on: the containerd serving it is the node's.
    pub containerd_socket: PathBuf,
}

/// The directories a node's binaries live in besides PATH (systemd gives services these).
const SYSTEM_DIRS: [&str; 6] = [
    "/usr/local/sbin",
    "/usr/local/bin",
    "/usr/sbin",
    "/usr/bin",
    "/sbin",
    "/bin",
];
/// How long the manager and nvidia-smi may take to answer.
const ANSWER_TIME: Duration = Duration::from_secs(5);
/// Clock ticks per second in /proc/<pid>/stat: USER_HZ, 100 on every architecture Linux
/// runs containerd on (the kernel's own HZ may differ; /proc reports in USER_HZ).
const USER_HZ: u64 = 100;

pub fn gather(o: &DoctorOptions) -> Facts {
    let config = gather_config(&o.config);
    let node = &config.config;
    let registration = gather_registration(o);
    let dump = registration
        .containerd
        .as_ref()
        .and_then(|c| c.dump.as_ref().ok())
        .map(String::as_str);
    let runc = gather_runc(node, dump);
    let (manager, status) = gather_manager(o, node);
    let gpus = gather_gpus(status.as_ref(), node);
    let descriptors = if manager.answer.is_ok() {
        gather_descriptors(node)
    } else {
        DescriptorFacts::ManagerDown
    };
    Facts {
        registration,
        runc,
        host_mps_dir: gather_host_mps_dir(&o.host_mps_dir),
        cdi: gather_cdi(&o.cdi_dirs),
        gpus,
        nvml: probe_nvml(),
        manager,
        descriptors,
        mps: gather_mps(node),
        config,
    }
}

fn gather_config(path: &Path) -> ConfigFacts {
    let (state, config) = match NodeConfig::load(path) {
        Ok(config) if path.exists() => (ConfigState::Loaded, config),
        Ok(config) => (ConfigState::Missing, config),
        Err(e) => (ConfigState::Invalid(e.into()), NodeConfig::default()),
    };
    ConfigFacts {
        path: path.to_path_buf(),
        state,
        config,
    }
}

fn gather_registration(o: &DoctorOptions) -> RegistrationFacts {
    let opts = InstallOptions {
        main_config: o.containerd_config.clone(),
        drop_in: o.drop_in.clone(),
        shim_path: o.shim.clone(),
        ..InstallOptions::default()
    };
    let binary = o.containerd.clone().or_else(|| reg::find_containerd(&opts));
    let containerd = binary.map(|binary| ContainerdFacts {
        binary_state: file_state(&binary),
        version: reg::containerd_version(&opts, &binary).ok(),
        dump: reg::dump_config(&opts, &binary).map_err(DoctorError::from),
        running: running_containerd(&o.containerd_socket, &o.containerd_config),
        config_files: [&o.containerd_config, &o.drop_in]
            .into_iter()
            .filter_map(|p| Some((p.clone(), modified_unix(p)?)))
            .collect(),
        binary,
    });
    RegistrationFacts {
        main_config: o.containerd_config.clone(),
        shim: o.shim.clone(),
        default_shim: crate::installed::default_shim_path(),
        shim_state: file_state(&o.shim),
        containerd,
    }
}

fn modified_unix(path: &Path) -> Option<i64> {
    let modified = fs::metadata(path).ok()?.modified().ok()?;
    i64::try_from(modified.duration_since(UNIX_EPOCH).ok()?.as_secs()).ok()
}

fn cmdline(pid: u32) -> Vec<String> {
    fs::read(format!("/proc/{pid}/cmdline"))
        .map(|raw| {
            raw.split(|b| *b == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// The containerd serving `socket` (the node's, the one kubelet uses), found by the socket's
/// peer credentials, so a test's private containerd or one in another mount namespace is never
/// taken for it; with the config its command line names and when it started.
fn running_containerd(socket: &Path, main_config: &Path) -> Option<RunningContainerd> {
    use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
    let stream = std::os::unix::net::UnixStream::connect(socket).ok()?;
    let pid = u32::try_from(getsockopt(&stream, PeerCredentials).ok()?.pid()).ok()?;
    let config = containerd_config_arg(&cmdline(pid));
    let same = |a: &Path, b: &Path| {
        a == b || (a.canonicalize().ok()).is_some_and(|a| Some(a) == b.canonicalize().ok())
    };
    let ticks = ProcessIdentity::of(pid)?.start_ticks;
    let boot = parse_boot_time(&fs::read_to_string("/proc/stat").ok()?)?;
    Some(RunningContainerd {
        pid,
        started_unix: boot + i64::try_from(ticks / USER_HZ).ok()?,
        socket: socket.to_path_buf(),
        reads_main_config: same(&config, main_config),
        config,
    })
}

/// What the file at `path` is like.
pub fn file_state(path: &Path) -> FileState {
    match fs::metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => FileState::Missing {
            searched: String::new(),
        },
        Err(source) => FileState::Unreadable(DoctorError::Io {
            path: path.to_path_buf(),
            action: "looking at",
            source,
        }),
        Ok(m) if !m.is_file() => FileState::NotAFile { at: path.into() },
        Ok(m) if m.permissions().mode() & 0o111 == 0 => FileState::NotExecutable { at: path.into() },
        Ok(_) => FileState::Executable { at: path.into() },
    }
}

/// PATH, then the system directories, each once.
fn search_dirs(extra: &[&str]) -> Vec<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut dirs: Vec<PathBuf> = std::env::split_paths(&path)
        .chain(SYSTEM_DIRS.iter().chain(extra).map(PathBuf::from))
        .filter(|d| d.is_absolute())
        .collect();
    let mut seen = std::collections::HashSet::new();
    dirs.retain(|d| seen.insert(d.clone()));
    dirs
}

/// A binary as a config names it: a path is looked at as it is, a bare name as Command would
/// find it (PATH), then in the system directories and `extra`.
fn locate(name: &Path, extra: &[&str]) -> FileState {
    if name.components().count() > 1 {
        return file_state(name);
    }
    for dir in &search_dirs(extra) {
        let candidate = dir.join(name);
        if candidate.exists() {
            return file_state(&candidate);
        }
    }
    FileState::Missing {
        searched: format!(
            "not on PATH, nor in {}",
            SYSTEM_DIRS
                .iter()
                .chain(extra)
                .copied()
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

fn gather_runc(node: &NodeConfig, dump: Option<&str>) -> RuncFacts {
    let runc = locate(&node.runc_path, &[]);
    let mut runc_elsewhere: Vec<PathBuf> = search_dirs(&[])
        .into_iter()
        .map(|d| d.join("runc"))
        .filter(|p| *p != node.runc_path && file_state(p).is_executable())
        .collect();
    runc_elsewhere.dedup();
    let toolkit_binary = match locate(Path::new(reg::TOOLKIT_BINARY), &reg::TOOLKIT_DIRS) {
        FileState::Executable { at } => Some(at),
        _ => None,
    };
    RuncFacts {
        runc_path: node.runc_path.clone(),
        runc,
        runc_elsewhere,
        nvidia_runtimes: dump.map(reg::toolkit_runtimes).unwrap_or_default(),
        toolkit_binary,
    }
}

/// What is at `path`, without following a symlink (the toolkit's mount would follow it).
fn gather_host_mps_dir(path: &Path) -> HostMpsDirFacts {
    let found = match fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => Ok(Some("a directory")),
        Ok(m) if m.file_type().is_symlink() => Ok(Some("a symlink")),
        Ok(_) => Ok(Some("not a directory")),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(DoctorError::Io {
            path: path.to_path_buf(),
            action: "looking at it",
            source,
        }),
    };
    HostMpsDirFacts {
        path: path.to_path_buf(),
        found,
    }
}

fn gather_manager(o: &DoctorOptions, node: &NodeConfig) -> (ManagerFacts, Option<proto::StatusResponse>) {
    let socket = o.socket.clone().unwrap_or_else(|| node.manager_socket());
    match ManagerConnection::connect_once(&socket, ANSWER_TIME).and_then(|c| c.status()) {
        Ok(s) => {
            let answer = ManagerAnswer {
                version: s.manager_version.clone(),
                policy: s.policy.clone(),
                config_digest: s.config_digest.clone(),
                config_source: s.config_source.clone(),
                config_note: s.config_note.clone(),
            };
            let facts = ManagerFacts {
                socket,
                answer: Ok(answer),
            };
            (facts, Some(s))
        }
        Err(e) => {
            let facts = ManagerFacts {
                socket,
                answer: Err(e.into()),
            };
            (facts, None)
        }
    }
}

/// The GPU list with the most current compute modes: the manager's, else nvidia-smi's, else the
/// inventory the manager wrote at its last start.
fn gather_gpus(status: Option<&proto::StatusResponse>, node: &NodeConfig) -> GpuFacts {
    let inventory_path = node.inventory_path();
    let inventory = load_inventory(&inventory_path);
    let mig: HashMap<String, bool> = inventory
        .as_ref()
        .map(|i| i.gpus.iter().map(|g| (g.uuid.clone(), g.mig_enabled)).collect())
        .unwrap_or_default();
    let mut why = Vec::new();
    match status {
        Some(s) if !s.gpus.is_empty() => {
            return GpuFacts {
                source: GpuSource::Manager,
                gpus: s
                    .gpus
                    .iter()
                    .map(|g| GpuSeen {
                        index: g.index,
                        uuid: g.uuid.clone(),
                        compute_mode: g.compute_mode.clone(),
                        mig_enabled: mig.get(&g.uuid).copied().unwrap_or(false),
                    })
                    .collect(),
            };
        }
        Some(_) => why.push("the manager reports no GPU".to_string()),
        None => why.push("the manager does not answer".to_string()),
    }
    match nvidia_smi() {
        Ok(gpus) if !gpus.is_empty() => {
            return GpuFacts {
                source: GpuSource::NvidiaSmi,
                gpus,
            };
        }
        Ok(_) => why.push("nvidia-smi lists no GPU".into()),
        Err(e) => why.push(e.to_string()),
    }
    match inventory {
        Ok(i) if !i.gpus.is_empty() => GpuFacts {
            source: GpuSource::Inventory(inventory_path),
            gpus: i
                .gpus
                .iter()
                .map(|g| GpuSeen {
                    index: g.index,
                    uuid: g.uuid.clone(),
                    compute_mode: g.compute_mode.clone(),
                    mig_enabled: g.mig_enabled,
                })
                .collect(),
        },
        Ok(_) => {
            why.push(format!("{} lists no GPU", inventory_path.display()));
            GpuFacts {
                source: GpuSource::Nowhere(why.join("; ")),
                gpus: Vec::new(),
            }
        }
        Err(e) => {
            why.push(format!("no inventory: {e}"));
            GpuFacts {
                source: GpuSource::Nowhere(why.join("; ")),
                gpus: Vec::new(),
            }
        }
    }
}

/// The GPUs as nvidia-smi lists them, bounded in time (a GPU in a bad state can hang it).
fn nvidia_smi() -> Result<Vec<GpuSeen>, DoctorError> {
    let binary = match locate(Path::new("nvidia-smi"), &[]) {
        FileState::Executable { at } => at,
        _ => {
            return Err(DoctorError::Command {
                program: "nvidia-smi".into(),
                message: "not installed".into(),
            });
        }
    };
    let fail = |message: String| DoctorError::Command {
        program: binary.clone(),
        message,
    };
    let mut child = Command::new(&binary)
        .args([
            "--query-gpu=index,uuid,compute_mode,mig.mode.current",
            "--format=csv,noheader",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| fail(format!("cannot run it: {}", super::plain_io(&e))))?;
    let started = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if started.elapsed() < 2 * ANSWER_TIME => std::thread::sleep(Duration::from_millis(50)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(fail(format!(
                    "did not answer within {} s",
                    (2 * ANSWER_TIME).as_secs()
                )));
            }
            Err(e) => return Err(fail(super::plain_io(&e))),
        }
    };
    let mut out = String::new();
    let mut err = String::new();
    if let Some(mut s) = child.stdout.take() {
        let _ = s.read_to_string(&mut out);
    }
    if let Some(mut s) = child.stderr.take() {
        let _ = s.read_to_string(&mut err);
    }
    if !status.success() {
        let said = if err.trim().is_empty() { &out } else { &err };
        return Err(fail(format!("{status}: {}", said.trim())));
    }
    parse_nvidia_smi(&out).map_err(fail)
}

fn gather_cdi(dirs: &[PathBuf]) -> CdiFacts {
    let mut specs = Vec::new();
    let mut unreadable = Vec::new();
    for dir in dirs {
        let entries = match fs::read_dir(dir) {
            Ok(entries) => entries,
            // Both directories are optional.
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(source) => {
                unreadable.push(DoctorError::Io {
                    path: dir.clone(),
                    action: "listing",
                    source,
                });
                continue;
            }
        };
        let mut paths: Vec<PathBuf> = entries
            .filter_map(|e| Some(e.ok()?.path()))
            .filter(|p| {
                p.extension()
                    .is_some_and(|x| x == "json" || x == "yaml" || x == "yml")
            })
            .collect();
        paths.sort();
        for path in paths {
            match fs::read_to_string(&path) {
                Ok(text) => match parse_cdi_spec(&text) {
                    Ok((kind, devices)) => specs.push(CdiSpec { path, kind, devices }),
                    Err(message) => unreadable.push(DoctorError::Invalid { path, message }),
                },
                Err(source) => unreadable.push(DoctorError::Io {
                    path,
                    action: "reading",
                    source,
                }),
            }
        }
    }
    CdiFacts {
        dirs: dirs.to_vec(),
        specs,
        unreadable,
    }
}

fn probe_nvml() -> NvmlProbe {
    use nvml_wrapper::Nvml;
    use nvml_wrapper::error::NvmlError;
    match Nvml::init() {
        Ok(nvml) => NvmlProbe::Ready {
            driver_version: nvml.sys_driver_version().unwrap_or_else(|_| "unknown".into()),
            gpus: nvml.device_count().unwrap_or(0),
        },
        Err(NvmlError::LibloadingError(e)) => NvmlProbe::LibraryMissing {
            message: e.to_string(),
        },
        Err(e) => NvmlProbe::InitFailed {
            message: e.to_string(),
        },
    }
}

/// Whether `pid` is a gpu-mps-manager (and not a pid reused by another process).
fn is_manager(pid: u32) -> bool {
    cmdline(pid).first().is_some_and(|argv0| {
        Path::new(argv0)
            .file_name()
            .is_some_and(|n| n == "gpu-mps-manager")
    })
}

/// The manager's pid: from the lock it holds under its root, else from the config it published.
fn manager_pid(node: &NodeConfig) -> Result<u32, String> {
    let lock = node.manager_lock_path();
    let published = node.published_path();
    let from_lock = fs::read_to_string(&lock).ok().and_then(|t| t.trim().parse().ok());
    let from_published = fs::read_to_string(&published)
        .ok()
        .and_then(|t| PublishedConfig::from_json(&t).ok())
        .map(|p| p.manager_pid);
    [from_lock, from_published]
        .into_iter()
        .flatten()
        .find(|pid| is_manager(*pid))
        .ok_or_else(|| {
            format!(
                "neither {} nor {} names a running gpu-mps-manager",
                lock.display(),
                published.display()
            )
        })
}

fn gather_descriptors(node: &NodeConfig) -> DescriptorFacts {
    let pid = match manager_pid(node) {
        Ok(pid) => pid,
        Err(looked) => return DescriptorFacts::NoPid(looked),
    };
    let fd_dir = PathBuf::from(format!("/proc/{pid}/fd"));
    let limits = PathBuf::from(format!("/proc/{pid}/limits"));
    let open = fs::read_dir(&fd_dir)
        .map(|entries| entries.count() as u64)
        .map_err(|source| DoctorError::Io {
            path: fd_dir,
            action: "listing",
            source,
        });
    let limit = fs::read_to_string(&limits)
        .map_err(|source| DoctorError::Io {
            path: limits.clone(),
            action: "reading",
            source,
        })
        .and_then(|text| {
            parse_open_files_limit(&text).ok_or(DoctorError::Invalid {
                path: limits,
                message: "it has no \"Max open files\" line".into(),
            })
        });
    DescriptorFacts::Process(Box::new(ProcessDescriptors {
        pid,
        open,
        limit,
        wanted: 2 * u64::from(node.gate.max_connections) + 1024,
    }))
}

fn gather_mps(node: &NodeConfig) -> MpsFacts {
    let control = locate(&node.daemon.control_binary, &[]);
    let server_name = Path::new("nvidia-cuda-mps-server");
    let beside = match &control {
        FileState::Executable { at } => at.parent().map(|dir| dir.join(server_name)),
        _ => None,
    };
    let server = match beside.map(|p| file_state(&p)) {
        Some(found @ FileState::Executable { .. }) => found,
        _ => locate(server_name, &[]),
    };
    MpsFacts {
        control_binary: node.daemon.control_binary.clone(),
        control,
        server,
    }
}
