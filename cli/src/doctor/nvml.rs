//! Check: NVML (libnvidia-ml.so.1) loads and starts. gpu-mps-manager finds the GPUs, their device
//! minors and compute modes through it and does not start without it.

use super::Check;

const NAME: &str = "nvml";

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NvmlProbe {
    Ready {
        driver_version: String,
        gpus: u32,
    },
    /// The library could not be loaded.
    LibraryMissing {
        message: String,
    },
    /// The library loaded, but NVML did not start (no kernel driver, a version mismatch).
    InitFailed {
        message: String,
    },
}

pub fn check(probe: &NvmlProbe) -> Check {
    match probe {
        NvmlProbe::Ready { driver_version, gpus } => Check::pass(
            NAME,
            format!("libnvidia-ml.so.1 loaded: driver {driver_version}, {gpus} GPU(s)"),
        ),
        NvmlProbe::LibraryMissing { message } => Check::fail(
            NAME,
            format!("cannot load libnvidia-ml.so.1: {message}; gpu-mps-manager does not start without it"),
            "install the NVIDIA driver's user-space libraries (libnvidia-ml.so.1: Debian's libnvidia-ml1 package, or the driver's .run installer), then run ldconfig",
        ),
        NvmlProbe::InitFailed { message } => Check::fail(
            NAME,
            format!("libnvidia-ml.so.1 loaded but NVML did not start: {message}"),
            "load the NVIDIA kernel driver (modprobe nvidia; nvidia-smi must list the GPUs), and keep the kernel module and the libraries of one driver version (reboot after a driver upgrade)",
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::Status;

    #[test]
    fn a_started_nvml_passes() {
        let c = check(&NvmlProbe::Ready {
            driver_version: "580.65.06".into(),
            gpus: 8,
        });
        assert_eq!(c.status, Status::Pass);
        assert_eq!(c.found, "libnvidia-ml.so.1 loaded: driver 580.65.06, 8 GPU(s)");
    }

    #[test]
    fn a_missing_library_fails_with_the_package() {
        let c = check(&NvmlProbe::LibraryMissing {
            message: "libnvidia-ml.so.1: cannot open shared object file: No such file or directory".into(),
        });
        assert_eq!(c.status, Status::Fail);
        assert!(c.found.contains("cannot open shared object file"), "{}", c.found);
        assert!(c.fix.unwrap_or_default().contains("libnvidia-ml1"));
    }

    #[test]
    fn a_library_without_its_driver_fails_with_modprobe() {
        let c = check(&NvmlProbe::InitFailed {
            message: "the NVIDIA driver is not loaded".into(),
        });
        assert_eq!(c.status, Status::Fail);
        assert!(c.fix.unwrap_or_default().contains("modprobe nvidia"));
    }
}
