//! `gpu-mps explain`: the rewrite gpu-mps-shim would make to a bundle, as a unified diff.

use gpu_mps_api::NodeConfig;
use gpu_mps_api::inventory::Inventory;
use gpu_mps_shim::ShimError;
use similar::TextDiff;

/// Describes the shim's decision for `spec` and, for a GPU container, the diff of config.json.
/// The original is pretty-printed with the same formatter the shim uses, so the diff shows
/// only what the shim changes (containerd writes config.json on one line).
pub fn explain_rewrite(
    spec_path: &str,
    spec: &str,
    config: &NodeConfig,
    inventory: &Inventory,
    container_id: &str,
) -> Result<String, ShimError> {
    let plan = gpu_mps_shim::plan_rewrite(spec, config, inventory, container_id)?;
    let mut out = format!("{spec_path}: {}\n", plan.reason);
    if let (Some(daemon), Some(limits)) = (&plan.daemon, &plan.limits) {
        out += &format!(
            "daemon: {} (pipe dir {})\nlimits: {limits}\n",
            daemon,
            config.pipe_dir(daemon).display()
        );
    }
    // Every policy mounts the container's gate dir, never the daemon's pipe dir (docs/adr/0006).
    if let Some(dir) = &plan.gate_dir {
        out += &format!(
            "gate: {} (policy {}: the container sees only the control socket the manager serves there)\n",
            dir.display(),
            config.limits.policy
        );
    }
    let Some(rewritten) = plan.rewritten else {
        out += "config.json is passed to runc unchanged\n";
        return Ok(out);
    };
    let original: serde_json::Value = serde_json::from_str(spec).expect("the shim parsed this spec already");
    let original = serde_json::to_string_pretty(&original).expect("a JSON value serializes") + "\n";
    let diff = TextDiff::from_lines(&original, &rewritten);
    out += &diff
        .unified_diff()
        .context_radius(2)
        .header("config.json", "config.json (gpu-mps-shim)")
        .to_string();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use gpu_mps_api::inventory::GpuInfo;
    use gpu_mps_api::limits::Limits;
    use gpu_mps_api::node_config::LimitPolicy;

    use super::*;

    fn inventory() -> Inventory {
        Inventory {
            source: "test".into(),
            gpus: vec![GpuInfo {
                index: 0,
                minor: 0,
                uuid: "GPU-aaaa".into(),
                name: "t".into(),
                memory_bytes: 16 << 30,
                compute_mode: "Default".into(),
                mig_enabled: false,
            }],
        }
    }

    #[test]
    fn shows_only_the_shims_changes() {
        let spec = r#"{"ociVersion":"1.0.2","process":{"args":["sh"],"env":["PATH=/bin","NVIDIA_VISIBLE_DEVICES=0"],"cwd":"/"},"root":{"path":"rootfs"},"annotations":{"gpu-mps.io/memory-limit":"4Gi","gpu-mps.io/active-thread-percentage":"25"}}"#;
        // The spec names its GPU by NVIDIA_VISIBLE_DEVICES: a node that takes GPUs from the env.
        let mut config = NodeConfig::default();
        config.gpus.trust_visible_devices_env = true;
        let out = explain_rewrite("b/config.json", spec, &config, &inventory(), "c1").unwrap();
        assert!(
            out.contains("+      \"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25\""),
            "{out}"
        );
        assert!(out.contains("limits: 4Gi/25%"), "{out}");
        // Nothing of the original is lost: a removed line only comes back with a comma added.
        let added: Vec<&str> = out
            .lines()
            .filter(|l| l.starts_with('+') && !l.starts_with("+++"))
            .collect();
        for removed in out
            .lines()
            .filter(|l| l.starts_with('-') && !l.starts_with("---"))
        {
            let content = removed[1..].trim_end_matches(',');
            assert!(
                added.iter().any(|a| a[1..].trim_end_matches(',') == content),
                "{removed} lost:\n{out}"
            );
        }
    }

    #[test]
    fn names_the_containers_gate_under_every_policy() {
        let spec = r#"{"ociVersion":"1.0.2","process":{"args":["sh"],"env":["PATH=/bin","NVIDIA_VISIBLE_DEVICES=0"],"cwd":"/"},"root":{"path":"rootfs"},"annotations":{"gpu-mps.io/memory-limit":"4Gi","gpu-mps.io/active-thread-percentage":"25"}}"#;
        for policy in [LimitPolicy::Uniform, LimitPolicy::Ceiling, LimitPolicy::Exact] {
            let mut config = NodeConfig::default();
            config.gpus.trust_visible_devices_env = true;
            config.limits.policy = policy;
            config.limits.ceiling = Some(Limits {
                memory_bytes: 8 << 30,
                thread_percentage: 50,
            });
            let out = explain_rewrite("b/config.json", spec, &config, &inventory(), "c1").unwrap();
            let gate = config.gate_dir(&gpu_mps_api::ContainerId::parse("c1").unwrap());
            assert!(
                out.contains(&format!(
                    "gate: {} (policy {policy}: the container sees only the control socket the manager serves there)\n",
                    gate.display()
                )),
                "{policy}: {out}"
            );
        }
    }

    #[test]
    fn a_cpu_container_is_unchanged() {
        let spec = r#"{"ociVersion":"1.0.2","process":{"args":["sh"],"env":["PATH=/bin"],"cwd":"/"},"root":{"path":"rootfs"}}"#;
        let out = explain_rewrite("b/config.json", spec, &NodeConfig::default(), &inventory(), "c1").unwrap();
        assert!(out.contains("unchanged"), "{out}");
        assert!(!out.contains("gate:"), "no GPU, no gate: {out}");
    }
}
