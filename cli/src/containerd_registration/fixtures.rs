//! The containerd configs and plan helpers the unit tests of this module share.

use std::path::Path;

use toml_edit::{DocumentMut, Item};

use super::layout::lookup;
use super::{ConfigVersion, ExistingFiles, FileChange, InstallOptions, InstallPlan, RUNTIME_NAME};

/// Debian's /etc/containerd/config.toml (bookworm, trixie and sid ship the same file).
pub(super) const DEBIAN: &str = r#"version = 2

[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
    [plugins."io.containerd.grpc.v1.cri".cni]
      bin_dir = "/usr/lib/cni"
      conf_dir = "/etc/cni/net.d"
  [plugins."io.containerd.internal.v1.opt"]
    path = "/var/lib/containerd/opt"
"#;

/// The shape of `containerd config default` on 1.x, with a kubeadm-style runc entry.
pub(super) const V2_KUBEADM: &str = r#"# tuned for kubeadm
disabled_plugins = []
imports = []
version = 2

[plugins]

  [plugins."io.containerd.grpc.v1.cri"]
    sandbox_image = "registry.k8s.io/pause:3.9"  # pinned

    [plugins."io.containerd.grpc.v1.cri".containerd]
      default_runtime_name = "runc"

      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes]

        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
          runtime_type = "io.containerd.runc.v2"
          pod_annotations = ["example.com/*"]

          [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
            BinaryName = ""
            SystemdCgroup = true
"#;

pub(super) const V3: &str = r#"version = 3
root = '/var/lib/containerd'

# kept
[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
  runtime_type = 'io.containerd.runc.v2'
  [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
    SystemdCgroup = true
"#;

pub(super) fn opts(major: Option<u32>) -> InstallOptions {
    InstallOptions {
        containerd_major: major,
        ..InstallOptions::default()
    }
}

pub(super) fn files(main: Option<&str>) -> ExistingFiles {
    ExistingFiles {
        main: main.map(str::to_owned),
        drop_in: None,
        node_config: None,
    }
}

/// The files after the plan, as `ExistingFiles` (the default options' paths).
pub(super) fn after(existing: &ExistingFiles, plan: &InstallPlan) -> ExistingFiles {
    plan.applied_to(existing, &InstallOptions::default())
        .unwrap_or_else(|| panic!("a change to a file registration does not own: {plan:#?}"))
}

pub(super) fn written<'a>(plan: &'a InstallPlan, path: &str) -> &'a str {
    plan.changes
        .iter()
        .find_map(|c| match c {
            FileChange::Write {
                path: p, contents, ..
            } if p == Path::new(path) => Some(contents.as_str()),
            _ => None,
        })
        .unwrap_or_else(|| panic!("{path} not written by {plan:#?}"))
}

pub(super) fn get<'a>(text: &str, path: &[&str], doc: &'a mut Option<DocumentMut>) -> Option<&'a Item> {
    *doc = Some(text.parse().expect("valid TOML"));
    lookup(doc.as_ref().expect("set").as_table(), path)
}

pub(super) fn entry_path(version: ConfigVersion, rest: &[&'static str]) -> Vec<&'static str> {
    let mut p = version.runtimes_path().to_vec();
    p.push(RUNTIME_NAME);
    p.extend_from_slice(rest);
    p
}

/// Every line of `before` is still there, in order: only lines were added.
pub(super) fn only_added(before: &str, after: &str) {
    let diff = similar::TextDiff::from_lines(before, after);
    let removed: Vec<_> = diff
        .iter_all_changes()
        .filter(|c| c.tag() == similar::ChangeTag::Delete)
        .map(|c| c.to_string())
        .collect();
    assert!(removed.is_empty(), "lines removed: {removed:?}\n{after}");
}
