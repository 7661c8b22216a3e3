//! A misspelled gpu-mps annotation through the CRI runtime handler `gpu-mps`: the pod is not
//! run on the node default with no word anywhere; its CreateContainer fails with one line that
//! names the nearest known key, which is what the CRI client (kubelet) shows. containerd runs the
//! shim's `create` at StartContainer, so that is the call refused.
//!
//! Needs the workspace built (`cargo build --workspace`) and the static checker; see
//! gpu_mps_e2e::binaries. Run: `cargo test -p gpu-mps-e2e --test cri_annotations -- --nocapture`.

use anyhow::{Result, bail, ensure};
use gpu_mps_e2e::containerd::GPU_MPS_HANDLER;
use gpu_mps_e2e::image::TEST_IMAGE;
use gpu_mps_e2e::{ContainerSpec, GpuNode, LimitsConfig, PodSpec, Suite, per_suite};

per_suite!(a_misspelled_annotation_is_refused_naming_the_nearest_key);

/// One pod with a typo at pod level, one with a typo in another container's key: each GPU
/// container is refused at the shim's create, and the manager holds no lease for either.
async fn a_misspelled_annotation_is_refused_naming_the_nearest_key(suite: Suite) -> Result<()> {
    let node = GpuNode::start(&suite, LimitsConfig::uniform()).await?;
    let mut cri = node.cri().await?;
    let gpu = node.gpu_uuid(0).to_string();
    let container = ContainerSpec::new("infer", TEST_IMAGE)
        .command(&["/checker"])
        .args(&["sleep", "300"])
        .gpu(&gpu);
    let cases = [
        (
            "typo",
            "gpu-mps.io/memry-limit",
            "unknown annotation gpu-mps.io/memry-limit (did you mean gpu-mps.io/memory-limit?)",
        ),
        (
            "sidecar-typo",
            "sidecar.gpu-mps.io/cuda-procs",
            "unknown annotation sidecar.gpu-mps.io/cuda-procs (did you mean sidecar.gpu-mps.io/cuda-processes?)",
        ),
    ];
    for (pod_name, key, expected) in cases {
        let pod = cri
            .run_pod_sandbox(&PodSpec::new(pod_name, "default", GPU_MPS_HANDLER).annotation(key, "16Gi"))
            .await?;
        // containerd runs `runc create` (the shim) at StartContainer.
        let created = cri.create_container(&pod, &container).await?;
        let message = match cri.start_container(&created).await {
            Ok(()) => bail!("pod {pod_name} with {key} started, expected a refusal"),
            Err(status) => status.message().to_string(),
        };
        println!("refused as expected: {message}");
        ensure!(
            message.contains(expected),
            "the CRI error does not say {expected:?}: {message}"
        );
        let line = message.lines().find(|l| l.contains(expected)).unwrap_or_default();
        ensure!(
            line.contains("fix or remove it on the pod"),
            "the refusal is not one line: {message}"
        );
        cri.delete_pod(&pod).await?;
    }
    let status = node.manager.status().await?;
    ensure!(
        status.leases.is_empty(),
        "a refused container holds a lease: {status:#?}"
    );
    Ok(())
}
