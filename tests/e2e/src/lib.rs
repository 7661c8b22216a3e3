//! Test harness: private containerd instances, a CRI client playing kubelet, test images.
