//! A whole test node: gpu-mps-manager on fake GPUs, and containerd with the `gpu-mps` runtime
//! handler, both private to one test.

use std::path::PathBuf;

use anyhow::Result;
use gpu_mps_api::inventory::GpuInfo;

use crate::binaries::Binaries;
use crate::containerd::{CdiOptions, Containerd, ContainerdOptions};
use crate::cri::CriClient;
use crate::manager::{FAKE_GPU_MEMORY, LimitsConfig, Manager, fake_gpus};
use crate::suites::Suite;

/// Fields drop in order: containerd (and its containers, whose poststop hooks call the
/// manager) before the manager.
#[derive(Debug)]
pub struct GpuNode {
    pub containerd: Containerd,
    pub manager: Manager,
    pub bins: Binaries,
}

impl GpuNode {
    /// Two fake 16 GiB GPUs under `limits`.
    pub async fn start(suite: &Suite, limits: LimitsConfig) -> Result<GpuNode> {
        GpuNode::start_with_gpus(suite, limits, fake_gpus(2, FAKE_GPU_MEMORY)).await
    }

    pub async fn start_with_gpus(suite: &Suite, limits: LimitsConfig, gpus: Vec<GpuInfo>) -> Result<GpuNode> {
        GpuNode::start_with(suite, limits, gpus, CdiOptions::default()).await
    }

    /// `gpus` under `limits`, and containerd's CDI as `cdi` says.
    pub async fn start_with(
        suite: &Suite,
        limits: LimitsConfig,
        gpus: Vec<GpuInfo>,
        cdi: CdiOptions,
    ) -> Result<GpuNode> {
        let bins = Binaries::locate()?;
        let manager = Manager::start(&bins, &suite.runc, &limits, gpus).await?;
        let options = ContainerdOptions {
            gpu_mps_config: Some(manager.config_path().to_path_buf()),
            gpu_mps_shim: Some(bins.shim.clone()),
            cdi,
            shared_root_namespace: false,
        };
        let containerd = Containerd::start(suite, options).await?;
        Ok(GpuNode {
            containerd,
            manager,
            bins,
        })
    }

    /// A CRI client, with the test image imported.
    pub async fn cri(&self) -> Result<CriClient> {
        let client = self.containerd.cri().await?;
        self.containerd.import_test_image(&self.bins.checker).await?;
        Ok(client)
    }

    /// The rootfs directory for `ctr run --rootfs`.
    pub fn rootfs(&self) -> Result<PathBuf> {
        self.containerd.test_rootfs(&self.bins.checker)
    }

    pub fn gpu_uuid(&self, index: usize) -> &str {
        self.manager.gpu_uuid(index)
    }
}
