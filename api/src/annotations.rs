//! Annotation keys gpu-mps reads and writes.

/// Pod- or container-level: pinned device memory per CUDA process (a Kubernetes quantity).
pub const MEMORY_LIMIT: &str = "gpu-mps.io/memory-limit";
/// Pod- or container-level: share of the GPU's SMs, 1 to 100.
pub const ACTIVE_THREAD_PERCENTAGE: &str = "gpu-mps.io/active-thread-percentage";
/// Pod- or container-level: how many CUDA processes the container runs on the GPU (1 to 48).
/// Its memory limit is their total, split evenly; a process beyond the number is refused
/// (docs/adr/0006).
pub const CUDA_PROCESSES: &str = "gpu-mps.io/cuda-processes";
/// Pod- or container-level: MPS client priority of the container's CUDA processes, `normal` (the
/// default) or `below-normal` (`CUDA_MPS_CLIENT_PRIORITY`). A courtesy, not a limit: a process
/// can set its own back to normal.
pub const CLIENT_PRIORITY: &str = "gpu-mps.io/priority";
/// Written by the shim: which daemon serves the container (for debugging).
pub const DAEMON: &str = "gpu-mps.io/daemon";
/// Written by the shim: the limits it resolved, as `<memory>/<threads>%`.
pub const LIMITS: &str = "gpu-mps.io/limits";

/// Set by gpu-mps-device-plugin's Allocate as a CONTAINER annotation: the `gpu-mps.io/memory`
/// device IDs kubelet gave the container, comma-separated. The shim takes the container's memory
/// from them, over any `memory-limit` annotation. Its domain is outside
/// [`POD_ANNOTATION_PATTERNS`] on purpose: containerd never copies a pod's annotation of that
/// name into a spec, so a pod cannot claim units it was not scheduled for.
pub const ALLOCATED_UNITS: &str = "gpu-mps-device-plugin/units";

/// The suffix of both keys: a container-level annotation is `<container-name>.gpu-mps.io/...`
/// (a valid Kubernetes annotation key for every container name), so that one pod annotation can
/// give one container of a pod its own limits.
pub const DOMAIN: &str = "gpu-mps.io";

/// Set by containerd's CRI plugin on every container spec.
pub const CRI_CONTAINER_TYPE: &str = "io.kubernetes.cri.container-type";
pub const CRI_CONTAINER_NAME: &str = "io.kubernetes.cri.container-name";
pub const CRI_SANDBOX_NAME: &str = "io.kubernetes.cri.sandbox-name";
pub const CRI_SANDBOX_NAMESPACE: &str = "io.kubernetes.cri.sandbox-namespace";
/// Prefix of CDI device annotations (`cdi.k8s.io/<plugin>: nvidia.com/gpu=0`).
pub const CDI_PREFIX: &str = "cdi.k8s.io/";

/// Pod annotations containerd must pass into container specs for the `gpu-mps` handler
/// (`pod_annotations`): the limits, pod-level and container-level.
pub const POD_ANNOTATION_PATTERNS: [&str; 2] = ["gpu-mps.io/*", "*.gpu-mps.io/*"];
/// Container annotations containerd must pass (`container_annotations`): the limits, and the CDI
/// device annotations a device plugin sets, without which a GPU handed over through CDI would
/// reach runc unseen by the shim (and run without MPS).
/// And the device plugin's allocation ([`ALLOCATED_UNITS`]).
pub const CONTAINER_ANNOTATION_PATTERNS: [&str; 4] = [
    "gpu-mps.io/*",
    "*.gpu-mps.io/*",
    "cdi.k8s.io/*",
    "gpu-mps-device-plugin/*",
];

/// The container-level key for `base` (one of MEMORY_LIMIT, ACTIVE_THREAD_PERCENTAGE,
/// CUDA_PROCESSES).
pub fn container_key(container_name: &str, base: &str) -> String {
    format!("{container_name}.{base}")
}

/// The keys a pod or container sets: what gpu-mps reads under [`DOMAIN`], at pod level as
/// they are and at container level after `<container-name>.`.
pub const SETTABLE: [&str; 4] = [
    MEMORY_LIMIT,
    ACTIVE_THREAD_PERCENTAGE,
    CUDA_PROCESSES,
    CLIENT_PRIORITY,
];

/// A key under gpu-mps.io/ or `<container>.gpu-mps.io/` that gpu-mps does not read: a typo
/// would otherwise leave the container on the node default with no word anywhere.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownKey {
    pub key: String,
    /// The settable key nearest to it, in the same form (pod or container level).
    pub nearest: String,
}

impl std::fmt::Display for UnknownKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let key = crate::message::printable(&self.key);
        let nearest = crate::message::printable(&self.nearest);
        write!(
            f,
            "unknown annotation {key} (did you mean {nearest}?): gpu-mps reads {}, each also as <container-name>.{DOMAIN}/...; fix or remove it on the pod",
            SETTABLE.join(", ")
        )
    }
}

/// Every key of `keys` in gpu-mps's domain that gpu-mps does not read, sorted. Container-level
/// keys count whatever container they name: another container's key must be a known one too.
pub fn unknown_keys<'a>(keys: impl IntoIterator<Item = &'a String>) -> Vec<UnknownKey> {
    let mut unknown: Vec<UnknownKey> = keys.into_iter().filter_map(|key| unknown_key(key)).collect();
    unknown.sort_by(|a, b| a.key.cmp(&b.key));
    unknown
}

/// `Some` when `key` is in gpu-mps's domain (`gpu-mps.io/x`, `<c>.gpu-mps.io/x`) and `x` is
/// not a settable name. The keys gpu-mps-shim writes ([`DAEMON`], [`LIMITS`]) pass: a spec
/// the shim rewrote is rewritten again unchanged (shim/tests/golden.rs), and they are
/// overwritten, never read.
fn unknown_key(key: &str) -> Option<UnknownKey> {
    if key == DAEMON || key == LIMITS {
        return None;
    }
    let (domain, name) = key.split_once('/')?;
    let container_prefix = match domain.strip_suffix(DOMAIN) {
        Some("") => "",
        Some(prefix) if prefix.ends_with('.') => prefix,
        _ => return None,
    };
    let settable_names = SETTABLE.map(|k| &k[DOMAIN.len() + 1..]);
    if settable_names.contains(&name) {
        return None;
    }
    let nearest = settable_names
        .iter()
        .min_by_key(|known| edit_distance(name, known))
        .copied()
        .unwrap_or_default();
    Some(UnknownKey {
        key: key.to_string(),
        nearest: format!("{container_prefix}{DOMAIN}/{nearest}"),
    })
}

/// Levenshtein distance in characters: one per insertion, deletion or substitution.
pub(crate) fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut previous: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut current = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            let substitution = previous[j] + usize::from(ca != *cb);
            current[j + 1] = substitution.min(previous[j + 1] + 1).min(current[j] + 1);
        }
        previous = current;
    }
    previous[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(list: &[&str]) -> Vec<String> {
        list.iter().map(ToString::to_string).collect()
    }

    #[test]
    fn a_misspelled_key_names_the_nearest_known_one_in_its_form() {
        let cases = [
            ("gpu-mps.io/memory-limt", "gpu-mps.io/memory-limit"),
            ("gpu-mps.io/memry-limit", "gpu-mps.io/memory-limit"),
            ("gpu-mps.io/Memory-Limit", "gpu-mps.io/memory-limit"),
            (
                "gpu-mps.io/active-threads-percentage",
                "gpu-mps.io/active-thread-percentage",
            ),
            (
                "gpu-mps.io/thread-percentage",
                "gpu-mps.io/active-thread-percentage",
            ),
            ("gpu-mps.io/cuda-process", "gpu-mps.io/cuda-processes"),
            ("infer.gpu-mps.io/memory_limit", "infer.gpu-mps.io/memory-limit"),
            // Another container's key: still gpu-mps's, so still checked.
            (
                "sidecar.gpu-mps.io/cuda-procs",
                "sidecar.gpu-mps.io/cuda-processes",
            ),
            // No name at all: the shortest settable key is the fewest edits away.
            ("gpu-mps.io/", "gpu-mps.io/priority"),
            ("gpu-mps.io/priorty", "gpu-mps.io/priority"),
        ];
        for (key, nearest) in cases {
            let unknown = unknown_keys(&keys(&[key]));
            assert_eq!(unknown.len(), 1, "{key}");
            assert_eq!(unknown[0].nearest, nearest, "{key}");
            let line = unknown[0].to_string();
            assert!(
                line.starts_with(&format!("unknown annotation {key} (did you mean {nearest}?): ")),
                "{line}"
            );
            assert!(!line.contains('\n'), "{line}");
        }
        assert_eq!(
            unknown_keys(&keys(&["gpu-mps.io/memory-limt"]))[0].to_string(),
            "unknown annotation gpu-mps.io/memory-limt (did you mean gpu-mps.io/memory-limit?): \
             gpu-mps reads gpu-mps.io/memory-limit, gpu-mps.io/active-thread-percentage, \
             gpu-mps.io/cuda-processes, gpu-mps.io/priority, each also as \
             <container-name>.gpu-mps.io/...; fix or remove it on the pod"
        );
    }

    #[test]
    fn known_keys_and_other_domains_pass() {
        let fine = keys(&[
            MEMORY_LIMIT,
            ACTIVE_THREAD_PERCENTAGE,
            CUDA_PROCESSES,
            "infer.gpu-mps.io/memory-limit",
            "other.gpu-mps.io/cuda-processes",
            ".gpu-mps.io/memory-limit",
            ALLOCATED_UNITS,
            "gpu-mps.io.example.com/memory-limt",
            "not-gpu-mps.io/memory-limt",
            "example.com/gpu-mps.io",
            CRI_CONTAINER_NAME,
            "cdi.k8s.io/nvidia",
            "no-slash",
        ]);
        assert_eq!(unknown_keys(&fine), vec![]);
    }

    #[test]
    fn keys_the_shim_writes_pass_at_pod_level_only() {
        assert_eq!(unknown_keys(&keys(&[LIMITS, DAEMON])), vec![]);
        let unknown = unknown_keys(&keys(&["infer.gpu-mps.io/limits"]));
        assert_eq!(unknown.len(), 1, "{unknown:?}");
        assert!(
            unknown[0]
                .to_string()
                .starts_with("unknown annotation infer.gpu-mps.io/limits (did you mean infer.gpu-mps.io/"),
            "{unknown:?}"
        );
    }

    #[test]
    fn a_container_name_with_control_characters_stays_on_one_line() {
        let line = unknown_keys(&keys(&["in\nfer.gpu-mps.io/memory-limt"]))[0].to_string();
        assert!(
            line.starts_with("unknown annotation in\\nfer.gpu-mps.io/memory-limt (did you mean in\\nfer.gpu-mps.io/memory-limit?)"),
            "{line}"
        );
    }

    #[test]
    fn edit_distance_counts_single_character_edits() {
        assert_eq!(edit_distance("memory-limit", "memory-limit"), 0);
        assert_eq!(edit_distance("memory-limt", "memory-limit"), 1);
        assert_eq!(edit_distance("memry-limit", "memory-limit"), 1);
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
    }

    #[test]
    fn no_pod_annotation_pattern_passes_the_allocation() {
        // containerd matches with Go's filepath.Match, where `*` stops at `/`.
        for pattern in super::POD_ANNOTATION_PATTERNS {
            let (domain, _) = pattern.split_once('/').unwrap();
            let (key_domain, _) = super::ALLOCATED_UNITS.split_once('/').unwrap();
            let matches = match domain.strip_prefix('*') {
                Some(suffix) => key_domain.ends_with(suffix),
                None => key_domain == domain,
            };
            assert!(
                !matches,
                "{pattern} would let a pod set {}",
                super::ALLOCATED_UNITS
            );
        }
        assert!(super::CONTAINER_ANNOTATION_PATTERNS.contains(&"gpu-mps-device-plugin/*"));
    }

    #[test]
    fn container_key_prefixes_the_domain() {
        assert_eq!(
            super::container_key("infer", super::MEMORY_LIMIT),
            "infer.gpu-mps.io/memory-limit"
        );
    }
}
