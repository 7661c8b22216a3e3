//! Check: every GPU is in EXCLUSIVE_PROCESS compute mode, or the manager puts it there.
//!
//! A CUDA process that misses MPS (its CUDA_MPS_PIPE_DIRECTORY pointed at a directory without a
//! daemon) opens a direct context with the whole GPU, past every limit; only EXCLUSIVE_PROCESS,
//! where the MPS server is the one process allowed a context, refuses it. The manager sets the mode
//! at start and again whenever it drifts, unless `[daemon] exclusive_process = false`.

use std::path::{Path, PathBuf};

use super::Check;

const NAME: &str = "compute-mode";

/// The node's GPUs and where the list came from.
#[derive(Debug)]
pub struct GpuFacts {
    pub source: GpuSource,
    pub gpus: Vec<GpuSeen>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuSeen {
    pub index: u32,
    pub uuid: String,
    /// As NVML ("ExclusiveProcess") or nvidia-smi ("Exclusive_Process") spells it.
    pub compute_mode: String,
    pub mig_enabled: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GpuSource {
    /// The running manager's status: compute modes read now.
    Manager,
    /// nvidia-smi: compute modes read now.
    NvidiaSmi,
    /// The inventory the manager wrote at its last start, before it set EXCLUSIVE_PROCESS.
    Inventory(PathBuf),
    /// No list: why.
    Nowhere(String),
}

impl GpuSource {
    pub fn describe(&self) -> String {
        match self {
            GpuSource::Manager => "the running manager".into(),
            GpuSource::NvidiaSmi => "nvidia-smi".into(),
            GpuSource::Inventory(path) => {
                format!("{}, written when the manager last started", path.display())
            }
            GpuSource::Nowhere(why) => why.clone(),
        }
    }

    /// Whether its compute modes are the GPUs' modes now.
    fn is_live(&self) -> bool {
        matches!(self, GpuSource::Manager | GpuSource::NvidiaSmi)
    }
}

fn is_exclusive_process(mode: &str) -> bool {
    mode.replace('_', "").eq_ignore_ascii_case("exclusiveprocess")
}

pub fn check(f: &GpuFacts, exclusive_process: bool, config_path: &Path) -> Check {
    if f.gpus.is_empty() {
        return Check::skip(NAME, format!("no GPU list: {}", f.source.describe()));
    }
    let source = f.source.describe();
    let mig: Vec<String> = f
        .gpus
        .iter()
        .filter(|g| g.mig_enabled)
        .map(|g| format!("GPU {} ({})", g.index, g.uuid))
        .collect();
    if !mig.is_empty() {
        return Check::warn(
            NAME,
            format!(
                "{} has MIG enabled (from {source}): gpu-mps does not run MPS on MIG GPUs",
                mig.join(", ")
            ),
            "turn MIG off on that GPU (nvidia-smi -i <index> -mig 0, then reset the GPU), or keep it off gpu-mps nodes",
        );
    }
    let others: Vec<&GpuSeen> = f
        .gpus
        .iter()
        .filter(|g| !is_exclusive_process(&g.compute_mode))
        .collect();
    if others.is_empty() {
        return Check::pass(NAME, format!("every GPU is in EXCLUSIVE_PROCESS (from {source})"));
    }
    let listed = others
        .iter()
        .map(|g| format!("GPU {} ({}) is in {}", g.index, g.uuid, g.compute_mode))
        .collect::<Vec<_>>()
        .join(", ");
    let escape =
        "a CUDA process that misses MPS can open a direct context with the whole GPU, past every limit";
    let by_hand = others
        .iter()
        .map(|g| format!("nvidia-smi -i {} -c EXCLUSIVE_PROCESS", g.index))
        .collect::<Vec<_>>()
        .join("; ");
    if !exclusive_process {
        return Check::warn(
            NAME,
            format!("{listed} (from {source}) and daemon.exclusive_process = false: {escape}"),
            format!(
                "set exclusive_process = true under [daemon] in {} and restart gpu-mps-manager (it sets the mode and puts the old one back when it stops), or as root: {by_hand}",
                config_path.display()
            ),
        );
    }
    if f.source.is_live() {
        return Check::warn(
            NAME,
            format!(
                "{listed} (from {source}) although daemon.exclusive_process = true: the manager could not set it, or it was changed since; meanwhile {escape}"
            ),
            format!(
                "journalctl -u gpu-mps-manager says why it could not set the mode; to set it by hand, as root: {by_hand}"
            ),
        );
    }
    Check::pass(
        NAME,
        format!(
            "{listed} (from {source}); the manager sets EXCLUSIVE_PROCESS when it starts (daemon.exclusive_process = true)"
        ),
    )
}

/// `nvidia-smi --query-gpu=index,uuid,compute_mode,mig.mode.current --format=csv,noheader`.
pub fn parse_nvidia_smi(output: &str) -> Result<Vec<GpuSeen>, String> {
    output
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|line| {
            let fields: Vec<&str> = line.split(',').map(str::trim).collect();
            match fields.as_slice() {
                [index, uuid, mode, mig] => Ok(GpuSeen {
                    index: index
                        .parse()
                        .map_err(|_| format!("{index:?} is not a GPU index in {line:?}"))?,
                    uuid: uuid.to_string(),
                    compute_mode: mode.to_string(),
                    mig_enabled: mig.eq_ignore_ascii_case("enabled"),
                }),
                _ => Err(format!("{line:?} does not have the 4 fields asked for")),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::Status;

    const CONFIG: &str = "/etc/gpu-mps/config.toml";

    fn facts(source: GpuSource, modes: &[&str]) -> GpuFacts {
        GpuFacts {
            source,
            gpus: modes
                .iter()
                .enumerate()
                .map(|(i, m)| GpuSeen {
                    index: i as u32,
                    uuid: format!("GPU-{i}"),
                    compute_mode: m.to_string(),
                    mig_enabled: false,
                })
                .collect(),
        }
    }

    #[test]
    fn exclusive_gpus_pass() {
        let c = check(
            &facts(GpuSource::NvidiaSmi, &["Exclusive_Process", "ExclusiveProcess"]),
            true,
            Path::new(CONFIG),
        );
        assert_eq!(c.status, Status::Pass);
        assert_eq!(c.found, "every GPU is in EXCLUSIVE_PROCESS (from nvidia-smi)");
        let c = check(
            &facts(GpuSource::Manager, &["ExclusiveProcess"]),
            false,
            Path::new(CONFIG),
        );
        assert_eq!(c.status, Status::Pass);
    }

    #[test]
    fn default_mode_with_exclusive_process_off_warns() {
        let c = check(
            &facts(GpuSource::Manager, &["ExclusiveProcess", "Default"]),
            false,
            Path::new(CONFIG),
        );
        assert_eq!(c.status, Status::Warn);
        assert!(
            c.found
                .starts_with("GPU 1 (GPU-1) is in Default (from the running manager)")
                && c.found.contains("whole GPU"),
            "{}",
            c.found
        );
        let fix = c.fix.unwrap_or_default();
        assert!(
            fix.contains("exclusive_process = true under [daemon] in /etc/gpu-mps/config.toml")
                && fix.contains("nvidia-smi -i 1 -c EXCLUSIVE_PROCESS"),
            "{fix}"
        );
    }

    #[test]
    fn a_live_default_mode_the_manager_should_have_set_warns() {
        let c = check(
            &facts(GpuSource::NvidiaSmi, &["Default"]),
            true,
            Path::new(CONFIG),
        );
        assert_eq!(c.status, Status::Warn);
        assert!(c.found.contains("could not set it"), "{}", c.found);
        assert!(
            c.fix
                .unwrap_or_default()
                .contains("journalctl -u gpu-mps-manager")
        );
    }

    #[test]
    fn an_inventory_from_before_the_manager_set_the_mode_passes() {
        let c = check(
            &facts(
                GpuSource::Inventory("/run/gpu-mps/inventory.json".into()),
                &["Default"],
            ),
            true,
            Path::new(CONFIG),
        );
        assert_eq!(c.status, Status::Pass, "{c:?}");
        assert!(
            c.found
                .contains("the manager sets EXCLUSIVE_PROCESS when it starts"),
            "{}",
            c.found
        );
        let c = check(
            &facts(
                GpuSource::Inventory("/run/gpu-mps/inventory.json".into()),
                &["Default"],
            ),
            false,
            Path::new(CONFIG),
        );
        assert_eq!(c.status, Status::Warn);
    }

    #[test]
    fn mig_warns_and_no_list_skips() {
        let mut f = facts(GpuSource::NvidiaSmi, &["ExclusiveProcess"]);
        f.gpus[0].mig_enabled = true;
        let c = check(&f, true, Path::new(CONFIG));
        assert_eq!(c.status, Status::Warn);
        assert!(c.found.contains("MIG"), "{}", c.found);
        let c = check(
            &GpuFacts {
                source: GpuSource::Nowhere("no manager, no nvidia-smi".into()),
                gpus: Vec::new(),
            },
            true,
            Path::new(CONFIG),
        );
        assert_eq!(c.status, Status::Skip);
        assert_eq!(c.found, "no GPU list: no manager, no nvidia-smi");
    }

    #[test]
    fn nvidia_smi_output_parses() {
        let out = "0, GPU-1b2c, Exclusive_Process, [N/A]\n1, GPU-3d4e, Default, Enabled\n\n";
        let gpus = parse_nvidia_smi(out).unwrap();
        assert_eq!(gpus.len(), 2);
        assert_eq!(gpus[0].compute_mode, "Exclusive_Process");
        assert!(!gpus[0].mig_enabled && gpus[1].mig_enabled);
        assert_eq!(gpus[1].uuid, "GPU-3d4e");
        assert!(parse_nvidia_smi("x, y, z, w\n").is_err());
        assert!(parse_nvidia_smi("0, GPU-1\n").is_err());
    }
}
