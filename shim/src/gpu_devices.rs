//! Which GPUs a container got, read from what the kubelet, the device plugin and the runtime put
//! in its spec, and their UUIDs from the manager's inventory. Pure: the spec's fields in, names
//! (then UUIDs) out.
//!
//! Sources, and who writes them:
//! - `linux.devices` entries that are GPU device nodes: character devices 195:<minor>, minor
//!   neither 255 (`nvidiactl`) nor 254 (`nvidia-modeset`); `nvidia-uvm` has a major of its own.
//!   They come from the CRI `devices` of a device plugin's Allocate, or from CDI devices that
//!   containerd resolved before runc (CRI `CDIDevices` or annotations). The node's minor names
//!   the GPU (through the inventory), whatever path the container sees it at; an entry without
//!   numbers at `/dev/nvidia<N>` is minor N.
//! - CDI annotations `cdi.k8s.io/<name>: <vendor>/<class>=<name>[,...]`: kubelet sets them for a
//!   device plugin's CDI devices; containerd passes only container annotations of that prefix,
//!   which a pod cannot set (api::annotations::CONTAINER_ANNOTATION_PATTERNS). GPU kinds:
//!   `nvidia.com/gpu` (what `nvidia-ctk cdi generate` names) and
//!   `k8s.device-plugin.nvidia.com/gpu` (NVIDIA's device plugin, strategy `cdi-annotations`:
//!   key `cdi.k8s.io/nvidia-device-plugin_<response uuid>`, value
//!   `k8s.device-plugin.nvidia.com/gpu=<uuid or index>`), named by index, UUID or `all`.
//!   NVIDIA's DRA driver (`k8s.gpu.nvidia.com/device=gpu-<n>`, `.../claim=<claim uid>-gpu-<n>`)
//!   names no GPU gpu-mps can look up: it counts only as the device nodes containerd resolved it
//!   into. Every other kind of an NVIDIA vendor (`nvidia.com` or `*.nvidia.com`, any case) is
//!   refused, save the device plugin's companions that carry no GPU (gds, mofed, gdrcopy,
//!   imex-channel): a kind gpu-mps does not know may carry a GPU that a runtime after the shim
//!   (the chained toolkit in CDI mode) would hand the container outside MPS. Other vendors'
//!   kinds are other devices.
//! - nvidia-container-toolkit's volume-mounts device list (device plugin strategy
//!   `volume-mounts`): mounts at `/var/run/nvidia-container-devices/<index|uuid|all>` (or
//!   `.../cdi/nvidia.com/gpu/<name>`). As in the toolkit, only a mount whose source is
//!   `/dev/null` counts: a pod's own volume at that path (emptyDir, configMap) names nothing.
//!   A pod allowed hostPath volumes could mount /dev/null there; Pod Security `baseline`
//!   forbids hostPath, and such a pod can escape far more than MPS anyway.
//! - `NVIDIA_VISIBLE_DEVICES` in `process.env` (index, UUID, UUID prefix, `all`;
//!   `none`/`void`/empty name nothing): the pod's own env.
//!
//! The first three are written for the pod, never by it: trusted. The env is not. When a
//! trusted source names a GPU, the container's GPUs are the union of the trusted sources and the
//! env never widens them: a pod's `NVIDIA_VISIBLE_DEVICES=all` must not make it a daemon over
//! every GPU (which would overlap, and block, every single-GPU daemon of the node). When no
//! trusted source names one, the node's `[gpus] trust_visible_devices_env` decides
//! ([`judge_env`]): off (the default), the env names no GPU: a container that names some there is
//! refused, and one whose env says `all` (every CUDA image's default) runs without a GPU, its env
//! set to `void`; on (the device plugin's envvar strategy, where nvidia-container-runtime after
//! the shim injects the device nodes the env names, so the env is all there is), the env's GPUs,
//! but never `all`.

use std::collections::HashMap;
use std::fmt;
use std::path::{Component, Path};

use gpu_mps_api::DaemonKey;
use gpu_mps_api::annotations::CDI_PREFIX;
use gpu_mps_api::inventory::{GpuInfo, Inventory, LookupError};
use gpu_mps_api::message::printable;
use oci_spec::runtime::Mount;
use thiserror::Error;

use crate::spec_fields::DeviceNode;

pub const VISIBLE_DEVICES_ENV: &str = "NVIDIA_VISIBLE_DEVICES";
/// The CDI kind (`vendor/class`) of NVIDIA GPUs that `nvidia-ctk cdi generate` writes.
pub const CDI_GPU_KIND: &str = "nvidia.com/gpu";
/// The CDI kind of GPUs that NVIDIA's k8s-device-plugin writes in its own spec and names in its
/// `cdi.k8s.io/nvidia-device-plugin_<id>` annotations (its vendor is fixed in its source).
pub const DEVICE_PLUGIN_CDI_GPU_KIND: &str = "k8s.device-plugin.nvidia.com/gpu";
/// Every CDI kind whose device names (index, UUID, `all`) are GPUs of the inventory.
pub const CDI_GPU_KINDS: [&str; 2] = [CDI_GPU_KIND, DEVICE_PLUGIN_CDI_GPU_KIND];
/// NVIDIA's DRA driver (driver gpu.nvidia.com): its devices carry GPUs, but their names
/// (`gpu-<n>`, `<claim uid>-gpu-<n>`) are the driver's own.
const DRA_CDI_VENDOR: &str = "k8s.gpu.nvidia.com";
const DRA_CDI_CLASSES: [&str; 2] = ["device", "claim"];
/// Vendors whose listed classes carry no GPU: NVIDIA's device plugin adds `gds=all` and
/// `mofed=all` (GPUDirect Storage, Mellanox OFED) beside a GPU; gdrcopy and IMEX channels are
/// device nodes of their own.
const NON_GPU_CDI_VENDORS: [&str; 2] = ["nvidia.com", "k8s.device-plugin.nvidia.com"];
const NON_GPU_CDI_CLASSES: [&str; 4] = ["gds", "mofed", "gdrcopy", "imex-channel"];
/// The node-config key that makes the env a GPU source.
pub const TRUST_ENV_KEY: &str = "[gpus] trust_visible_devices_env";
/// The major number of the NVIDIA driver's device nodes (`/dev/nvidia<N>`, nvidiactl, modeset).
pub const NVIDIA_MAJOR: i64 = 195;
/// Minors of major 195 that are not GPUs: nvidia-modeset and nvidiactl.
const NON_GPU_MINORS: [i64; 2] = [254, 255];
const DEVICE_NODE_PREFIX: &str = "/dev/nvidia";
/// Where the volume-mounts strategy lists a container's devices, one mount per device; also
/// the value of NVIDIA_VISIBLE_DEVICES under that strategy (a pointer, not a device).
pub const VOLUME_MOUNTS_ROOT: &str = "/var/run/nvidia-container-devices";
/// The only source of a mount that lists a device: what the device plugin mounts.
const VOLUME_MOUNT_SOURCE: &str = "/dev/null";

/// Where a device name was written, so an error or the plan's reason can point at it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceSource {
    /// `ignored_beyond`: the trusted sources the env was ignored next to (it names no GPU of
    /// its own then); `None` when the env decides.
    Env {
        value: String,
        ignored_beyond: Option<String>,
    },
    Cdi {
        key: String,
        value: String,
    },
    LinuxDevice {
        path: String,
        major: i64,
        minor: i64,
    },
    VolumeMount {
        destination: String,
    },
}

impl DeviceSource {
    /// Written for the pod by kubelet, the device plugin or the runtime, not by the pod.
    pub fn trusted(&self) -> bool {
        !matches!(self, DeviceSource::Env { .. })
    }

    fn ignored(&self) -> bool {
        matches!(
            self,
            DeviceSource::Env {
                ignored_beyond: Some(_),
                ..
            }
        )
    }

    /// The kind of source, as the plan's reason names it.
    fn kind(&self) -> &'static str {
        match self {
            DeviceSource::Env { .. } => VISIBLE_DEVICES_ENV,
            DeviceSource::Cdi { .. } => "CDI annotations",
            DeviceSource::LinuxDevice { .. } => "linux.devices",
            DeviceSource::VolumeMount { .. } => "the volume-mount device list",
        }
    }
}

impl fmt::Display for DeviceSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSource::Env {
                value,
                ignored_beyond: None,
            } => write!(f, "{VISIBLE_DEVICES_ENV}={value:?}"),
            DeviceSource::Env {
                value,
                ignored_beyond: Some(trusted),
            } => write!(
                f,
                "{VISIBLE_DEVICES_ENV}={value:?} ignored beyond the GPUs of {trusted}"
            ),
            DeviceSource::Cdi { key, value } => write!(f, "annotation {}={value:?}", printable(key)),
            DeviceSource::LinuxDevice { path, major, minor } => {
                write!(f, "linux.devices {} ({major}:{minor})", printable(path))
            }
            DeviceSource::VolumeMount { destination } => {
                write!(f, "volume mount {}", printable(destination))
            }
        }
    }
}

/// One GPU as the spec names it: an index, a UUID (or a unique prefix of one) or `all`; for a
/// device node, its path (the GPU is the one with the node's minor, in `origin`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceName {
    pub name: String,
    pub origin: DeviceSource,
}

/// The GPUs a container asks for, not yet resolved. Names at least one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceRequest {
    /// Trusted sources first; then the env's names, which count only when no trusted source
    /// names a GPU (otherwise their origin says they are ignored), and then only as
    /// [`judge_env`] lets them.
    pub devices: Vec<DeviceName>,
}

impl DeviceRequest {
    /// Whether the GPUs come from trusted sources (the env is then ignored).
    pub fn trusted(&self) -> bool {
        self.devices.iter().any(|d| d.origin.trusted())
    }
}

/// The fields of a spec that can name GPUs, as spec_fields reads them.
#[derive(Debug, Clone, Copy)]
pub struct SpecDevices<'a> {
    pub env: &'a [String],
    pub annotations: &'a HashMap<String, String>,
    pub linux_devices: &'a [DeviceNode],
    pub mounts: &'a [Mount],
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum DeviceError {
    #[error(
        "{origin}: device {entry:?} names no GPU: expected {CDI_GPU_KIND}=<index|uuid|all> or {DEVICE_PLUGIN_CDI_GPU_KIND}=<index|uuid|all>"
    )]
    EmptyCdiName { origin: DeviceSource, entry: String },
    #[error(
        "{origin}: {entry:?} is an NVIDIA CDI kind gpu-mps does not know, which may carry a GPU outside MPS: refused (GPUs are {CDI_GPU_KIND}, {DEVICE_PLUGIN_CDI_GPU_KIND} and {DRA_CDI_VENDOR}/device|claim; known to carry none: gds, mofed, gdrcopy, imex-channel)"
    )]
    UnknownNvidiaKind { origin: DeviceSource, entry: String },
    #[error(
        "{origin}: {entry:?} is a device of NVIDIA's DRA driver, whose name is no GPU gpu-mps can look up, and linux.devices holds no GPU device node it was resolved into: let containerd resolve CDI devices (enable_cdi = true on 1.7, the default on 2.x)"
    )]
    UnresolvedDra { origin: DeviceSource, entry: String },
    #[error(
        "{VISIBLE_DEVICES_ENV}={value:?} names GPUs, but none was scheduled to this container (no GPU device node, CDI device or volume-mount device): the env is the pod's own and names GPUs only with {TRUST_ENV_KEY} = true in the gpu-mps node config (the NVIDIA device plugin's envvar strategy); ask for the GPU through the device plugin or DRA"
    )]
    EnvNotTrusted { value: String },
    #[error(
        "{VISIBLE_DEVICES_ENV}={value:?} with no GPU scheduled to this container: under {TRUST_ENV_KEY} the env names the GPUs the device plugin gave, one by one, never all of the node's (a CUDA image's default): ask for the GPU through the device plugin, or set {VISIBLE_DEVICES_ENV}=void on a container that needs none"
    )]
    EnvAll { value: String },
    #[error(
        "{origin}: {lookup} (gpu-mps-manager writes the inventory at start: restart it if the node's GPUs changed)"
    )]
    Unknown {
        origin: DeviceSource,
        lookup: LookupError,
    },
    #[error(
        "{origin}: {name:?} is a MIG device: gpu-mps does not support MPS on MIG (request whole GPUs without MIG)"
    )]
    MigDevice { origin: DeviceSource, name: String },
    #[error(
        "{origin}: GPU {index} ({uuid}) has MIG enabled: gpu-mps does not support MPS on MIG-enabled GPUs (disable MIG on it or give the node's gpu-mps pods other GPUs)"
    )]
    MigEnabled {
        origin: DeviceSource,
        index: u32,
        uuid: String,
    },
    #[error("{origin}: asks for all GPUs, but the node's GPU inventory lists none")]
    NoGpus { origin: DeviceSource },
}

/// What the spec asks for; `None` for a container without an NVIDIA GPU.
pub fn requested(spec: SpecDevices<'_>) -> Result<Option<DeviceRequest>, DeviceError> {
    let mut devices: Vec<DeviceName> = spec.linux_devices.iter().filter_map(device_node).collect();
    let cdi = cdi_annotations(spec.annotations)?;
    // A DRA device counts as the GPU device nodes containerd resolved it into; without any, a
    // runtime after the shim could still resolve it, to a GPU gpu-mps cannot name.
    if let (true, Some((origin, entry))) = (devices.is_empty(), cdi.dra.into_iter().next()) {
        return Err(DeviceError::UnresolvedDra { origin, entry });
    }
    devices.extend(cdi.gpus);
    devices.extend(spec.mounts.iter().filter_map(volume_mount));

    let trusted_kinds = {
        let mut kinds: Vec<&str> = Vec::new();
        for d in &devices {
            if !kinds.contains(&d.origin.kind()) {
                kinds.push(d.origin.kind());
            }
        }
        kinds
    };
    if let Some(value) = env_value(spec.env) {
        let origin = DeviceSource::Env {
            value: value.to_string(),
            ignored_beyond: (!trusted_kinds.is_empty()).then(|| trusted_kinds.join(" and ")),
        };
        devices.extend(list(value).map(|name| DeviceName {
            name: name.to_string(),
            origin: origin.clone(),
        }));
    }
    Ok((!devices.is_empty()).then_some(DeviceRequest { devices }))
}

/// What the node's `[gpus] trust_visible_devices_env` makes of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EnvVerdict {
    /// The request stands: trusted sources name its GPUs, or the node trusts the env.
    Gpus,
    /// Only the env names GPUs, it says `all` (every CUDA image's default) and the node does
    /// not trust it: the container got no GPU, runs without MPS, and its env is set to `void`
    /// so that no runtime after the shim hands it one.
    NoGpu { value: String },
}

/// Judges a request that only the container's env may make: refused where the env names GPUs
/// the node does not take from it, or names all of them.
pub fn judge_env(request: &DeviceRequest, trust_env: bool) -> Result<EnvVerdict, DeviceError> {
    if request.trusted() {
        return Ok(EnvVerdict::Gpus);
    }
    let Some(DeviceSource::Env { value, .. }) = request.devices.first().map(|d| &d.origin) else {
        return Ok(EnvVerdict::Gpus);
    };
    let all = request.devices.iter().any(|d| d.name == "all");
    match (trust_env, all) {
        (true, false) => Ok(EnvVerdict::Gpus),
        (true, true) => Err(DeviceError::EnvAll { value: value.clone() }),
        (false, true) => Ok(EnvVerdict::NoGpu { value: value.clone() }),
        (false, false) => Err(DeviceError::EnvNotTrusted { value: value.clone() }),
    }
}

/// Why a spec for which [`requested`] found no GPU passes through: what each source held.
pub fn no_gpu_reason(spec: SpecDevices<'_>) -> String {
    let visible = match visible_devices(spec.env) {
        Some(value) => format!("{VISIBLE_DEVICES_ENV}={value:?}"),
        None => format!("no {VISIBLE_DEVICES_ENV}"),
    };
    let mut reason = format!("passthrough: no GPU ({visible}, no CDI {CDI_GPU_KIND} device");
    let nvidia_nodes: Vec<String> = spec
        .linux_devices
        .iter()
        .filter(|n| n.major == Some(NVIDIA_MAJOR) || n.path.starts_with(DEVICE_NODE_PREFIX))
        .map(|n| {
            let number = |v: Option<i64>| v.map_or_else(|| "?".to_string(), |v| v.to_string());
            format!("{} ({}:{})", printable(&n.path), number(n.major), number(n.minor))
        })
        .collect();
    if !nvidia_nodes.is_empty() {
        reason += &format!(
            ", no GPU device node in linux.devices: {} (GPUs are char {NVIDIA_MAJOR}:<minor> but not nvidiactl or nvidia-modeset)",
            nvidia_nodes.join(", ")
        );
    }
    for mount in spec.mounts {
        let destination = clean(mount.destination());
        let listed = destination
            .as_deref()
            .and_then(|d| d.strip_prefix(VOLUME_MOUNTS_ROOT))
            .is_some_and(|rest| rest.starts_with('/'));
        let source = mount.source().as_deref();
        if listed && source.and_then(clean).as_deref() != Some(VOLUME_MOUNT_SOURCE) {
            let source = source.map_or_else(
                || "none".to_string(),
                |s| printable(&s.to_string_lossy()).into_owned(),
            );
            reason += &format!(
                ", mount {} ignored (source {source}: only a {VOLUME_MOUNT_SOURCE} mount lists a device)",
                printable(&mount.destination().to_string_lossy())
            );
        }
    }
    reason.push(')');
    reason
}

/// The value of `NVIDIA_VISIBLE_DEVICES` in `env`. Later entries override earlier ones, as when
/// the env is turned into a map.
pub fn visible_devices(env: &[String]) -> Option<&str> {
    env.iter()
        .rev()
        .find_map(|e| e.strip_prefix(VISIBLE_DEVICES_ENV)?.strip_prefix('='))
}

/// Whether the env's `NVIDIA_VISIBLE_DEVICES` names devices (it is not unset, empty, `none`,
/// `void`, or the volume-mounts strategy's pointer to the mounts).
pub fn env_names_devices(env: &[String]) -> bool {
    env_value(env).is_some()
}

/// The env's value when it names devices: not unset, empty, `none`, `void`, or the
/// volume-mounts strategy's pointer to the mounts.
fn env_value(env: &[String]) -> Option<&str> {
    let value = visible_devices(env)?.trim();
    let names_nothing =
        matches!(value, "" | "none" | "void") || Path::new(value) == Path::new(VOLUME_MOUNTS_ROOT);
    (!names_nothing).then_some(value)
}

/// A GPU device node of `linux.devices`: char 195:<minor>, minor not a control node.
fn device_node(node: &DeviceNode) -> Option<DeviceName> {
    if !node.kind.is_char() {
        return None;
    }
    let from_path = node
        .path
        .strip_prefix(DEVICE_NODE_PREFIX)
        .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|n| n.parse::<i64>().ok());
    let major = node.major.or(from_path.map(|_| NVIDIA_MAJOR))?;
    let minor = node.minor.or(from_path)?;
    (major == NVIDIA_MAJOR && !NON_GPU_MINORS.contains(&minor)).then(|| DeviceName {
        name: node.path.clone(),
        origin: DeviceSource::LinuxDevice {
            path: node.path.clone(),
            major,
            minor,
        },
    })
}

/// What a CDI kind (`vendor/class`) is to gpu-mps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CdiKind {
    /// Its names are GPUs of the inventory (index, UUID, `all`).
    Gpu,
    /// NVIDIA's DRA driver: carries a GPU, named in the driver's own terms.
    Dra,
    /// An NVIDIA kind known to carry no GPU.
    NvidiaNonGpu,
    /// An NVIDIA vendor's kind gpu-mps does not know.
    UnknownNvidia,
    /// Another vendor's device.
    Other,
}

/// NVIDIA's vendors are `nvidia.com` and its subdomains, compared without case: a kind that
/// only differs in case from a known one is not that one, and is still NVIDIA's.
fn cdi_kind(kind: &str) -> CdiKind {
    let (vendor, class) = kind.split_once('/').unwrap_or((kind, ""));
    let lower = vendor.to_ascii_lowercase();
    let nvidia = lower == "nvidia.com" || lower.ends_with(".nvidia.com");
    if CDI_GPU_KINDS.contains(&kind) {
        CdiKind::Gpu
    } else if vendor == DRA_CDI_VENDOR && DRA_CDI_CLASSES.contains(&class) {
        CdiKind::Dra
    } else if NON_GPU_CDI_VENDORS.contains(&vendor) && NON_GPU_CDI_CLASSES.contains(&class) {
        CdiKind::NvidiaNonGpu
    } else if nvidia {
        CdiKind::UnknownNvidia
    } else {
        CdiKind::Other
    }
}

/// What the CDI annotations hold: GPUs by name, and entries of NVIDIA's DRA driver (which only
/// device nodes resolve).
struct CdiAnnotations {
    gpus: Vec<DeviceName>,
    dra: Vec<(DeviceSource, String)>,
}

/// GPUs of CDI annotations, sorted by key; an NVIDIA kind gpu-mps does not know is an error.
fn cdi_annotations(annotations: &HashMap<String, String>) -> Result<CdiAnnotations, DeviceError> {
    let mut cdi: Vec<_> = annotations
        .iter()
        .filter(|(k, _)| k.starts_with(CDI_PREFIX))
        .collect();
    cdi.sort();
    let mut found = CdiAnnotations {
        gpus: Vec::new(),
        dra: Vec::new(),
    };
    for (key, value) in cdi {
        let origin = DeviceSource::Cdi {
            key: key.clone(),
            value: value.clone(),
        };
        for entry in list(value) {
            let (kind, name) = entry.split_once('=').unwrap_or((entry, ""));
            let (kind, name) = (kind.trim(), name.trim());
            match cdi_kind(kind) {
                CdiKind::Other | CdiKind::NvidiaNonGpu => continue,
                CdiKind::UnknownNvidia => {
                    return Err(DeviceError::UnknownNvidiaKind {
                        origin,
                        entry: entry.to_string(),
                    });
                }
                CdiKind::Dra => found.dra.push((origin.clone(), entry.to_string())),
                CdiKind::Gpu if name.is_empty() => {
                    return Err(DeviceError::EmptyCdiName {
                        origin,
                        entry: entry.to_string(),
                    });
                }
                CdiKind::Gpu => found.gpus.push(DeviceName {
                    name: name.to_string(),
                    origin: origin.clone(),
                }),
            }
        }
    }
    Ok(found)
}

/// The GPU a mount of the volume-mounts device list names: `/dev/null` mounted at
/// `<root>/<name>`, `<root>/cdi/<kind>/<name>` or `<root>/cdi/<kind>=<name>` for a GPU kind
/// ([`CDI_GPU_KINDS`]).
/// IMEX channels (`<root>/imex/...`) and other CDI kinds are no GPUs.
fn volume_mount(mount: &Mount) -> Option<DeviceName> {
    let source = clean(mount.source().as_deref()?)?;
    if source != VOLUME_MOUNT_SOURCE {
        return None;
    }
    let destination = clean(mount.destination())?;
    let listed = destination.strip_prefix(VOLUME_MOUNTS_ROOT)?.strip_prefix('/')?;
    let name = if let Some(cdi) = listed.strip_prefix("cdi/") {
        let (_, name) = cdi
            .split_once('=')
            .or_else(|| cdi.rsplit_once('/'))
            .filter(|(kind, _)| CDI_GPU_KINDS.contains(kind))?;
        name
    } else if listed.starts_with("imex/") {
        return None;
    } else {
        listed
    };
    if name.is_empty() {
        return None;
    }
    let name = name.to_string();
    Some(DeviceName {
        name,
        origin: DeviceSource::VolumeMount { destination },
    })
}

/// An absolute path with `.`, `..` and repeated slashes resolved lexically, as the toolkit
/// compares them; `None` for a relative path.
fn clean(path: &Path) -> Option<String> {
    if !path.is_absolute() {
        return None;
    }
    let mut parts = Vec::new();
    for component in path.components() {
        match component {
            Component::Normal(part) => parts.push(part.to_str()?),
            Component::ParentDir => {
                parts.pop();
            }
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    Some(format!("/{}", parts.join("/")))
}

/// The daemon serving these GPUs: their UUIDs, looked up in the node's inventory. The env's
/// names are skipped when trusted sources name the GPUs.
pub fn resolve(request: &DeviceRequest, inventory: &Inventory) -> Result<DaemonKey, DeviceError> {
    let mut uuids = Vec::new();
    for DeviceName { name, origin } in &request.devices {
        if origin.ignored() {
            continue;
        }
        let usable = |gpu: &GpuInfo| {
            if gpu.mig_enabled {
                Err(DeviceError::MigEnabled {
                    origin: origin.clone(),
                    index: gpu.index,
                    uuid: gpu.uuid.clone(),
                })
            } else {
                Ok(gpu.uuid.clone())
            }
        };
        let unknown = |lookup| DeviceError::Unknown {
            origin: origin.clone(),
            lookup,
        };
        if let DeviceSource::LinuxDevice { minor, .. } = origin {
            uuids.push(usable(inventory.lookup_minor(*minor).map_err(unknown)?)?);
        } else if name == "all" {
            if inventory.gpus.is_empty() {
                return Err(DeviceError::NoGpus {
                    origin: origin.clone(),
                });
            }
            for gpu in &inventory.gpus {
                uuids.push(usable(gpu)?);
            }
        } else if name.starts_with("MIG-") || name.contains(':') {
            // `MIG-<uuid>` or `<gpu>:<gi>` (a MIG device by index pair).
            return Err(DeviceError::MigDevice {
                origin: origin.clone(),
                name: name.clone(),
            });
        } else {
            uuids.push(usable(inventory.lookup(name).map_err(unknown)?)?);
        }
    }
    Ok(DaemonKey::new(uuids))
}

fn list(value: &str) -> impl Iterator<Item = &str> {
    value.split(',').map(str::trim).filter(|s| !s.is_empty())
}

#[cfg(test)]
mod tests {
    use gpu_mps_api::inventory::GpuInfo;
    use serde_json::json;

    use super::*;
    use crate::spec_fields::DeviceKind;

    const A: &str = "GPU-aaaaaaaa-1111-2222-3333-444444444444";
    const B: &str = "GPU-bbbbbbbb-1111-2222-3333-444444444444";
    const C: &str = "GPU-cccccccc-1111-2222-3333-444444444444";

    /// GPUs 0 and 1 with their own minors (GPU 1 has minor 0: NVML's order is not the driver's).
    fn inventory(mig_on_1: bool) -> Inventory {
        let gpu = |index: u32, minor: u32, uuid: &str, mig_enabled: bool| GpuInfo {
            index,
            minor,
            uuid: uuid.into(),
            name: "NVIDIA H200".into(),
            memory_bytes: 141 << 30,
            compute_mode: "Default".into(),
            mig_enabled,
        };
        Inventory {
            source: "nvml".into(),
            gpus: vec![gpu(0, 1, A, false), gpu(1, 0, B, mig_on_1), gpu(2, 2, C, false)],
        }
    }

    /// A spec's GPU fields, owned, for `requested` to borrow.
    #[derive(Default)]
    struct Spec {
        env: Vec<String>,
        annotations: HashMap<String, String>,
        linux_devices: Vec<DeviceNode>,
        mounts: Vec<Mount>,
    }

    impl Spec {
        fn env(value: &str) -> Spec {
            Spec::default().with_env(value)
        }

        fn with_env(mut self, value: &str) -> Spec {
            self.env = vec!["PATH=/usr/bin".into(), format!("{VISIBLE_DEVICES_ENV}={value}")];
            self
        }

        fn cdi(mut self, key: &str, value: &str) -> Spec {
            self.annotations.insert(key.into(), value.into());
            self
        }

        /// A char device at `path`, with numbers when given.
        fn node(mut self, path: &str, numbers: Option<(i64, i64)>) -> Spec {
            self.linux_devices.push(DeviceNode {
                path: path.into(),
                kind: DeviceKind::Char,
                major: numbers.map(|n| n.0),
                minor: numbers.map(|n| n.1),
            });
            self
        }

        fn mount(mut self, destination: &str, source: &str) -> Spec {
            let m = json!({ "destination": destination, "type": "bind", "source": source, "options": ["ro", "rbind"] });
            self.mounts.push(serde_json::from_value(m).unwrap());
            self
        }

        fn fields(&self) -> SpecDevices<'_> {
            SpecDevices {
                env: &self.env,
                annotations: &self.annotations,
                linux_devices: &self.linux_devices,
                mounts: &self.mounts,
            }
        }

        fn request(&self) -> Option<DeviceRequest> {
            requested(self.fields()).unwrap()
        }

        /// The GPUs' UUIDs; `None` for no GPU.
        fn gpus(&self) -> Result<Option<Vec<String>>, DeviceError> {
            match requested(self.fields())? {
                None => Ok(None),
                Some(r) => Ok(Some(resolve(&r, &inventory(false))?.gpu_uuids().to_vec())),
            }
        }
    }

    fn uuids(list: &[&str]) -> Option<Vec<String>> {
        let mut v: Vec<String> = list.iter().map(|s| s.to_string()).collect();
        v.sort();
        Some(v)
    }

    #[test]
    fn no_gpu_means_passthrough() {
        for value in [
            "",
            "none",
            "void",
            " void ",
            VOLUME_MOUNTS_ROOT,
            "/var/run/nvidia-container-devices/",
        ] {
            assert_eq!(Spec::env(value).gpus(), Ok(None), "{value:?}");
        }
        assert_eq!(Spec::default().gpus(), Ok(None));
        let other_cdi = Spec::default()
            .cdi("cdi.k8s.io/fpga", "vendor.com/fpga=0")
            .cdi("other/x", "nvidia.com/gpu=0");
        assert_eq!(other_cdi.gpus(), Ok(None));
        let prefixed = Spec {
            env: vec!["NVIDIA_VISIBLE_DEVICES_X=0".into()],
            ..Spec::default()
        };
        assert_eq!(prefixed.gpus(), Ok(None));
    }

    #[test]
    fn env_names_indices_uuids_prefixes_and_all() {
        let cases: &[(&str, &[&str])] = &[
            ("0", &[A]),
            ("1,0", &[A, B]),
            (" 1 , 1 ", &[B]),
            (B, &[B]),
            ("GPU-aaaaaaaa", &[A]),
            ("all", &[A, B, C]),
        ];
        for (value, want) in cases {
            assert_eq!(Spec::env(value).gpus(), Ok(uuids(want)), "{value}");
        }
    }

    #[test]
    fn the_last_env_entry_wins() {
        let spec = Spec {
            env: vec![
                format!("{VISIBLE_DEVICES_ENV}=0"),
                format!("{VISIBLE_DEVICES_ENV}=void"),
            ],
            ..Spec::default()
        };
        assert_eq!(spec.gpus(), Ok(None));
    }

    /// What NVIDIA's k8s-device-plugin writes under its `cdi-annotations` strategy: the key
    /// `cdi.k8s.io/` + `nvidia-device-plugin_` + a fresh UUID of the response, the value its
    /// vendor's GPU kind with the GPU's UUID (index under `--device-id-strategy=index`), the
    /// companions `gds=all` / `mofed=all` when those are on.
    const PLUGIN_KEY: &str = "cdi.k8s.io/nvidia-device-plugin_7d0f3c52-9b1e-4a57-8c2d-5e6f7a8b9c0d";

    #[test]
    fn cdi_annotations_name_gpus_and_other_vendors_kinds_are_ignored() {
        type Annotations<'a> = &'a [(&'a str, &'a str)];
        let a_uuid = format!("nvidia.com/gpu={A}");
        let plugin_b = format!("k8s.device-plugin.nvidia.com/gpu={B}");
        let plugin_b_gds = format!(
            "k8s.device-plugin.nvidia.com/gpu={B},k8s.device-plugin.nvidia.com/gds=all,k8s.device-plugin.nvidia.com/mofed=all"
        );
        let plugin_two = format!("k8s.device-plugin.nvidia.com/gpu={A},k8s.device-plugin.nvidia.com/gpu={C}");
        let cases: &[(Annotations, &[&str])] = &[
            (&[(PLUGIN_KEY, &plugin_b)], &[B]),
            (&[(PLUGIN_KEY, "k8s.device-plugin.nvidia.com/gpu=1")], &[B]),
            (&[(PLUGIN_KEY, &plugin_b_gds)], &[B]),
            (&[(PLUGIN_KEY, &plugin_two)], &[A, C]),
            (&[("cdi.k8s.io/p", &a_uuid)], &[A]),
            (&[("cdi.k8s.io/p", "nvidia.com/gpu=all")], &[A, B, C]),
            (
                &[(
                    "cdi.k8s.io/p",
                    "vendor.com/fpga=0, nvidia.com/gpu=0,vendor.com/nic=1,nvidia.com/imex-channel=0",
                )],
                &[A],
            ),
            (
                &[
                    ("cdi.k8s.io/p", "nvidia.com/gpu=0"),
                    ("cdi.k8s.io/q", "nvidia.com/gpu=1"),
                ],
                &[A, B],
            ),
        ];
        for (annotations, want) in cases {
            let mut spec = Spec::env("void");
            for (k, v) in *annotations {
                spec = spec.cdi(k, v);
            }
            assert_eq!(spec.gpus(), Ok(uuids(want)), "{annotations:?}");
            assert!(spec.request().unwrap().trusted(), "{annotations:?}");
        }
    }

    #[test]
    fn the_device_plugins_cdi_gpu_narrows_a_cuda_images_env() {
        // A CUDA image says NVIDIA_VISIBLE_DEVICES=all; the plugin's annotation names GPU 1.
        let spec = Spec::env("all").cdi(PLUGIN_KEY, &format!("k8s.device-plugin.nvidia.com/gpu={B}"));
        assert_eq!(spec.gpus(), Ok(uuids(&[B])));
        let request = spec.request().unwrap();
        assert_eq!(judge_env(&request, false), Ok(EnvVerdict::Gpus));
        assert!(request.devices.iter().any(|d| d.origin.ignored()));
    }

    #[test]
    fn unknown_nvidia_kinds_fail_closed() {
        for entry in [
            "nvidia.com/foo=0",
            "nvidia.com/nic=1",
            "nvidia.com/pgpu=0",
            "management.nvidia.com/gpu=all",
            "k8s.device-plugin.nvidia.com/mig-1g.10gb=0",
            "NVIDIA.com/gpu=0",
            "nvidia.COM/gpu=0",
            "k8s.gpu.nvidia.com/other=gpu-0",
            "k8s.compute-domain.nvidia.com/channel=0",
            "nvidia.com",
            "k8s.device-plugin.nvidia.com/gpu",
        ] {
            let spec = Spec::env("void")
                .cdi("cdi.k8s.io/x", &format!("vendor.com/fpga=0,{entry}"))
                .node("/dev/nvidia0", Some((195, 0)));
            let e = requested(spec.fields()).unwrap_err();
            let text = e.to_string();
            assert!(
                matches!(
                    e,
                    DeviceError::UnknownNvidiaKind { .. } | DeviceError::EmptyCdiName { .. }
                ),
                "{entry}: {text}"
            );
            assert!(
                text.contains(&format!("{entry:?}")) && text.contains("cdi.k8s.io/x") && !text.contains('\n'),
                "{entry}: {text}"
            );
        }
        let e = requested(Spec::default().cdi("cdi.k8s.io/x", "nvidia.com/foo=0").fields())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("an NVIDIA CDI kind gpu-mps does not know")
                && e.contains("k8s.device-plugin.nvidia.com/gpu"),
            "{e}"
        );
        // Look-alikes of another vendor are not NVIDIA's.
        let other = Spec::default().cdi("cdi.k8s.io/x", "notnvidia.com/gpu=0,nvidia.com.evil/gpu=0");
        assert_eq!(other.gpus(), Ok(None));
    }

    #[test]
    fn dra_devices_count_only_as_the_device_nodes_they_were_resolved_into() {
        let claim = "k8s.gpu.nvidia.com/claim=0b4c5d6e-1f2a-4b3c-9d8e-7f6a5b4c3d2e-gpu-0";
        let resolved = Spec::env("all")
            .cdi("cdi.k8s.io/gpu.nvidia.com", claim)
            .node("/dev/nvidia0", Some((195, 0)));
        assert_eq!(resolved.gpus(), Ok(uuids(&[B])));
        let device = Spec::default()
            .cdi("cdi.k8s.io/gpu.nvidia.com", "k8s.gpu.nvidia.com/device=gpu-1")
            .node("/dev/nvidia1", Some((195, 1)));
        assert_eq!(device.gpus(), Ok(uuids(&[A])));
        for spec in [
            Spec::default().cdi("cdi.k8s.io/gpu.nvidia.com", claim),
            Spec::env("0").cdi("cdi.k8s.io/gpu.nvidia.com", claim),
            Spec::default()
                .cdi("cdi.k8s.io/gpu.nvidia.com", claim)
                .cdi("cdi.k8s.io/p", "nvidia.com/gpu=0")
                .node("/dev/nvidiactl", Some((195, 255))),
        ] {
            let e = requested(spec.fields()).unwrap_err();
            assert!(matches!(e, DeviceError::UnresolvedDra { .. }), "{e}");
            let text = e.to_string();
            assert!(
                text.contains(claim) && text.contains("enable_cdi") && !text.contains('\n'),
                "{text}"
            );
        }
    }

    #[test]
    fn an_env_only_request_follows_the_nodes_setting() {
        let judge = |spec: Spec, trust: bool| judge_env(&spec.request().unwrap(), trust);
        // Off (the default): names refused, `all` (a CUDA image's default) is no GPU.
        for value in ["0", B, "GPU-aaaaaaaa", "1,0", "7"] {
            let e = judge(Spec::env(value), false).unwrap_err();
            assert_eq!(
                e,
                DeviceError::EnvNotTrusted {
                    value: value.to_string()
                }
            );
            let text = e.to_string();
            assert!(
                text.starts_with(&format!(
                    "NVIDIA_VISIBLE_DEVICES={value:?} names GPUs, but none was scheduled"
                )) && text.contains("[gpus] trust_visible_devices_env = true")
                    && !text.contains('\n'),
                "{text}"
            );
        }
        for value in ["all", " all ", "0,all"] {
            assert_eq!(
                judge(Spec::env(value), false),
                Ok(EnvVerdict::NoGpu {
                    value: value.trim().to_string()
                }),
                "{value:?}"
            );
        }
        // On (the envvar strategy): the env's GPUs, never `all`.
        for value in ["0", B, "1,0"] {
            assert_eq!(judge(Spec::env(value), true), Ok(EnvVerdict::Gpus), "{value}");
        }
        for value in ["all", "0,all"] {
            let e = judge(Spec::env(value), true).unwrap_err();
            assert!(matches!(e, DeviceError::EnvAll { .. }), "{e}");
            let text = e.to_string();
            assert!(
                text.contains("never all")
                    && text.contains("NVIDIA_VISIBLE_DEVICES=void")
                    && !text.contains('\n'),
                "{text}"
            );
        }
        // Trusted sources decide whatever the setting and the env say.
        for trust in [false, true] {
            for spec in [
                Spec::env("all").node("/dev/nvidia0", Some((195, 0))),
                Spec::env("0").cdi(PLUGIN_KEY, "k8s.device-plugin.nvidia.com/gpu=1"),
                Spec::env("all").mount(&format!("{VOLUME_MOUNTS_ROOT}/2"), "/dev/null"),
            ] {
                assert_eq!(judge(spec, trust), Ok(EnvVerdict::Gpus));
            }
        }
    }

    #[test]
    fn gpu_device_nodes_are_found_by_their_minor_not_their_path() {
        // Inventory: minor 1 = GPU 0 (A), minor 0 = GPU 1 (B), minor 2 = GPU 2 (C).
        let cases: &[(Spec, &[&str])] = &[
            (Spec::default().node("/dev/nvidia0", Some((195, 0))), &[B]),
            (Spec::default().node("/dev/nvidia1", Some((195, 1))), &[A]),
            // The container path is the CRI's choice; the node's numbers say which GPU it is.
            (Spec::default().node("/dev/nvidia0", Some((195, 2))), &[C]),
            (Spec::default().node("/dev/gpu", Some((195, 2))), &[C]),
            // No numbers: `/dev/nvidia<N>` is minor N.
            (Spec::default().node("/dev/nvidia2", None), &[C]),
            (
                Spec::default()
                    .node("/dev/nvidia0", Some((195, 0)))
                    .node("/dev/nvidia1", Some((195, 1))),
                &[A, B],
            ),
        ];
        for (spec, want) in cases {
            assert_eq!(spec.gpus(), Ok(uuids(want)), "{:?}", spec.linux_devices);
            let request = spec.request().unwrap();
            assert!(request.trusted());
            assert!(matches!(
                request.devices[0].origin,
                DeviceSource::LinuxDevice { major: 195, .. }
            ));
        }
    }

    #[test]
    fn control_nodes_and_other_devices_are_no_gpus() {
        let mut spec = Spec::default()
            .node("/dev/nvidiactl", Some((195, 255)))
            .node("/dev/nvidia-modeset", Some((195, 254)))
            .node("/dev/nvidia-uvm", Some((508, 0)))
            .node("/dev/nvidia-uvm-tools", Some((508, 1)))
            .node("/dev/nvidiactl", None)
            .node("/dev/nvidia-caps/nvidia-cap1", Some((237, 1)))
            .node("/dev/dri/renderD128", Some((226, 128)))
            .node("/dev/nvidia3", Some((10, 3)));
        spec.linux_devices.push(DeviceNode {
            path: "/dev/nvidia0".into(),
            kind: DeviceKind::Block,
            major: Some(195),
            minor: Some(0),
        });
        assert_eq!(spec.gpus(), Ok(None));
        let reason = no_gpu_reason(spec.fields());
        assert!(
            reason.starts_with(
                "passthrough: no GPU (no NVIDIA_VISIBLE_DEVICES, no CDI nvidia.com/gpu device, no GPU device node in linux.devices: /dev/nvidiactl (195:255), /dev/nvidia-modeset (195:254), /dev/nvidia-uvm (508:0)"
            ) && reason.contains("/dev/nvidiactl (?:?)")
                && !reason.contains("renderD128"),
            "{reason}"
        );
    }

    #[test]
    fn the_reason_of_a_plain_cpu_container_is_unchanged() {
        assert_eq!(
            no_gpu_reason(Spec::env("void").fields()),
            "passthrough: no GPU (NVIDIA_VISIBLE_DEVICES=\"void\", no CDI nvidia.com/gpu device)"
        );
        assert_eq!(
            no_gpu_reason(Spec::default().fields()),
            "passthrough: no GPU (no NVIDIA_VISIBLE_DEVICES, no CDI nvidia.com/gpu device)"
        );
    }

    #[test]
    fn the_volume_mount_list_counts_only_dev_null_mounts() {
        let root = VOLUME_MOUNTS_ROOT;
        let listed = |name: &str| format!("{root}/{name}");
        let cases: &[(Spec, Option<Vec<String>>)] = &[
            (Spec::env(root).mount(&listed("0"), "/dev/null"), uuids(&[A])),
            (Spec::env(root).mount(&listed(B), "/dev/null"), uuids(&[B])),
            (
                Spec::env(root).mount(&listed("all"), "/dev/null"),
                uuids(&[A, B, C]),
            ),
            // Lexically clean paths, as the toolkit compares them.
            (
                Spec::env(root).mount("/var/run//nvidia-container-devices/./1", "/dev/../dev/null"),
                uuids(&[B]),
            ),
            (
                Spec::env(root).mount(&listed("cdi/nvidia.com/gpu/1"), "/dev/null"),
                uuids(&[B]),
            ),
            (
                Spec::env(root).mount(&listed("cdi/nvidia.com/gpu=0"), "/dev/null"),
                uuids(&[A]),
            ),
            (
                Spec::env(root).mount(&listed("cdi/k8s.device-plugin.nvidia.com/gpu/2"), "/dev/null"),
                uuids(&[C]),
            ),
            // A pod's own volume (any other source) lists nothing.
            (
                Spec::env(root).mount(
                    &listed("all"),
                    "/var/lib/kubelet/pods/u/volumes/kubernetes.io~empty-dir/x",
                ),
                None,
            ),
            (Spec::env(root).mount(&listed("0"), "null"), None),
            (Spec::env(root).mount(&listed("0"), "/dev/zero"), None),
            (
                Spec::env(root)
                    .mount(&listed("0"), "/dev/null")
                    .mount(&listed("1"), "/tmp/pod-volume"),
                uuids(&[A]),
            ),
            // Not devices: the root itself, IMEX channels, other CDI kinds, another root.
            (Spec::env(root).mount(root, "/dev/null"), None),
            (Spec::env(root).mount(&listed("imex/channel0"), "/dev/null"), None),
            (
                Spec::env(root).mount(&listed("cdi/vendor.com/nic/0"), "/dev/null"),
                None,
            ),
            (
                Spec::env(root).mount("/var/run/nvidia-container-devicesX/0", "/dev/null"),
                None,
            ),
            (
                Spec::env(root).mount("/run/nvidia-container-devices/0", "/dev/null"),
                None,
            ),
        ];
        for (spec, want) in cases {
            assert_eq!(&spec.gpus(), &Ok(want.clone()), "{:?}", spec.mounts);
        }
        let pod_volume = Spec::env(root).mount(&listed("all"), "/tmp/pod-volume");
        let reason = no_gpu_reason(pod_volume.fields());
        assert!(
            reason.contains(
                "mount /var/run/nvidia-container-devices/all ignored (source /tmp/pod-volume: only a /dev/null mount lists a device)"
            ),
            "{reason}"
        );
    }

    #[test]
    fn trusted_sources_are_combined() {
        let spec = Spec::env("void")
            .node("/dev/nvidia0", Some((195, 0)))
            .cdi("cdi.k8s.io/p", "nvidia.com/gpu=2")
            .mount(&format!("{VOLUME_MOUNTS_ROOT}/0"), "/dev/null");
        assert_eq!(spec.gpus(), Ok(uuids(&[A, B, C])));
    }

    #[test]
    fn the_env_never_widens_a_trusted_set() {
        let root = VOLUME_MOUNTS_ROOT;
        let cases: &[(Spec, &[&str], &str)] = &[
            (
                Spec::env("all").node("/dev/nvidia0", Some((195, 0))),
                &[B],
                "linux.devices",
            ),
            (
                Spec::env("0,1").cdi("cdi.k8s.io/p", "nvidia.com/gpu=1"),
                &[B],
                "CDI annotations",
            ),
            (
                Spec::env("all").mount(&format!("{root}/2"), "/dev/null"),
                &[C],
                "the volume-mount device list",
            ),
            // The env's names need not even exist: they are not looked up.
            (
                Spec::env("7,MIG-x").node("/dev/nvidia1", Some((195, 1))),
                &[A],
                "linux.devices",
            ),
            (
                Spec::env(A)
                    .node("/dev/nvidia0", Some((195, 0)))
                    .cdi("cdi.k8s.io/p", "nvidia.com/gpu=2"),
                &[B, C],
                "linux.devices and CDI annotations",
            ),
        ];
        for (spec, want, trusted) in cases {
            assert_eq!(spec.gpus(), Ok(uuids(want)), "{:?}", spec.env);
            let request = spec.request().unwrap();
            let env = request
                .devices
                .iter()
                .find(|d| !d.origin.trusted())
                .expect("the env stays in the request, marked ignored");
            let text = env.origin.to_string();
            assert!(
                text.ends_with(&format!("ignored beyond the GPUs of {trusted}")),
                "{text}"
            );
        }
        // A trusted source that names no GPU leaves the decision to the env.
        let only_control = Spec::env("1").node("/dev/nvidiactl", Some((195, 255)));
        assert_eq!(only_control.gpus(), Ok(uuids(&[B])));
        assert!(!only_control.request().unwrap().trusted());
    }

    #[test]
    fn errors_name_the_source_and_value() {
        let e = Spec::env("7").gpus().unwrap_err().to_string();
        assert!(
            e.starts_with("NVIDIA_VISIBLE_DEVICES=\"7\": GPU \"7\" is not on this node (known: 0=GPU-aaaa"),
            "{e}"
        );
        let e = Spec::default()
            .cdi("cdi.k8s.io/p", "nvidia.com/gpu=GPU-ffff")
            .gpus()
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("annotation cdi.k8s.io/p=\"nvidia.com/gpu=GPU-ffff\": GPU \"GPU-ffff\""),
            "{e}"
        );
        let e = requested(Spec::default().cdi("cdi.k8s.io/p", "nvidia.com/gpu=").fields())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("cdi.k8s.io/p") && e.contains("nvidia.com/gpu=<index|uuid|all>"),
            "{e}"
        );
        for mig in ["MIG-0c7a1f8e-5d4b-5f0e-9a3c-1b2c3d4e5f60", "0:1"] {
            let e = Spec::env(mig).gpus().unwrap_err().to_string();
            assert!(e.contains(mig) && e.contains("MIG"), "{e}");
        }
        let e = Spec::default()
            .mount(&format!("{VOLUME_MOUNTS_ROOT}/9"), "/dev/null")
            .gpus()
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("volume mount /var/run/nvidia-container-devices/9: GPU \"9\" is not on this node"),
            "{e}"
        );
    }

    #[test]
    fn keys_and_paths_with_line_breaks_stay_on_one_line() {
        // A spec from ctr, or a device plugin's CDI spec, can hold any string in these.
        let e = Spec::default()
            .cdi("cdi.k8s.io/a\r\nb", "nvidia.com/gpu=")
            .gpus()
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("annotation cdi.k8s.io/a\\r\\nb=\"nvidia.com/gpu=\": "),
            "{e}"
        );
        let e = Spec::default()
            .node("/dev/gpu\n0", Some((NVIDIA_MAJOR, 7)))
            .gpus()
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("linux.devices /dev/gpu\\n0 (195:7): "), "{e}");
        let e = Spec::default()
            .mount("/var/run/nvidia-container-devices/x\ny", "/dev/null")
            .gpus()
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("volume mount /var/run/nvidia-container-devices/x\\ny: "),
            "{e}"
        );
        let cpu = Spec::default()
            .node("/dev/nvidia\u{1b}", Some((NVIDIA_MAJOR, 255)))
            .mount("/var/run/nvidia-container-devices/0\n", "/srv/x\n");
        let reason = no_gpu_reason(cpu.fields());
        assert!(!reason.contains('\n') && !reason.contains('\u{1b}'), "{reason}");
    }

    #[test]
    fn an_unknown_minor_fails_closed_naming_the_node() {
        for spec in [
            Spec::default().node("/dev/nvidia0", Some((195, 7))),
            Spec::env("0").node("/dev/nvidia0", Some((195, 7))),
            Spec::default().node("/dev/nvidia7", None),
        ] {
            let e = spec.gpus().unwrap_err().to_string();
            assert!(
                e.contains("(195:7): no GPU of this node has device minor 7 (known minors: 1=GPU 0 GPU-aaaa")
                    && e.contains("restart it"),
                "{e}"
            );
            assert!(!e.contains('\n'));
        }
        let e = Spec::default()
            .node("/dev/nvidia0", Some((195, -1)))
            .gpus()
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("linux.devices /dev/nvidia0 (195:-1): no GPU"),
            "{e}"
        );
    }

    #[test]
    fn mig_enabled_gpus_are_refused() {
        let inv = inventory(true);
        let r = |spec: Spec| resolve(&spec.request().unwrap(), &inv);
        assert!(r(Spec::env("0")).is_ok());
        for spec in [
            Spec::env("1"),
            Spec::env("all"),
            Spec::env(B),
            Spec::default().node("/dev/nvidia0", Some((195, 0))),
        ] {
            let e = r(spec).unwrap_err();
            assert!(matches!(e, DeviceError::MigEnabled { index: 1, .. }), "{e}");
            assert!(e.to_string().contains("has MIG enabled"), "{e}");
        }
        let empty = Inventory {
            source: "nvml".into(),
            gpus: vec![],
        };
        let e = resolve(&Spec::env("all").request().unwrap(), &empty).unwrap_err();
        assert!(matches!(e, DeviceError::NoGpus { .. }), "{e}");
    }
}
