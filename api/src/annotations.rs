//! Annotation keys gpu-mps reads and writes.

/// Pod- or container-level: pinned device memory per CUDA process (a Kubernetes quantity).
pub const MEMORY_LIMIT: &str = "gpu-mps.io/memory-limit";
/// Pod- or container-level: share of the GPU's SMs, 1 to 100.
pub const ACTIVE_THREAD_PERCENTAGE: &str = "gpu-mps.io/active-thread-percentage";
/// Pod- or container-level: how many CUDA processes the container runs on the GPU (1 to 48).
/// Its memory limit is their total, split evenly; a process beyond the number is refused
/// (docs/adr/0006).
pub const CUDA_PROCESSES: &str = "gpu-mps.io/cuda-processes";
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

#[cfg(test)]
mod tests {
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
