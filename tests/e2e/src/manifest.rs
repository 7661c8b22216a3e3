//! The pod template of a Kubernetes manifest (packaging/kubernetes: the DaemonSet, the uninstall
//! Job), read from the file itself, and what kubelet makes of one of its containers for CRI:
//! the command with `$(VAR)` expanded from the container's env, the env, privileged, hostPID,
//! and the hostPath volume mounts with their propagation. A test runs the manifest as written,
//! with only the env values it overrides, so the manifest and the test cannot drift apart.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, Result, bail};
use k8s_cri::v1 as cri;
use serde::Deserialize;

use crate::cri::{ContainerSpec, PodSpec};

/// A workload object (DaemonSet, Job, ...) as far as its pod template goes.
#[derive(Debug, Clone, Deserialize)]
pub struct Workload {
    pub kind: String,
    pub metadata: Metadata,
    pub spec: WorkloadSpec,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Metadata {
    pub name: String,
    #[serde(default)]
    pub namespace: String,
}

#[derive(Debug, Clone, Deserialize)]
pub struct WorkloadSpec {
    pub template: PodTemplate,
}

#[derive(Debug, Clone, Deserialize)]
pub struct PodTemplate {
    pub spec: PodTemplateSpec,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodTemplateSpec {
    #[serde(default, rename = "hostPID")]
    pub host_pid: bool,
    #[serde(default)]
    pub init_containers: Vec<ManifestContainer>,
    #[serde(default)]
    pub containers: Vec<ManifestContainer>,
    #[serde(default)]
    pub volumes: Vec<Volume>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ManifestContainer {
    pub name: String,
    pub image: String,
    #[serde(default)]
    pub command: Vec<String>,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub env: Vec<EnvVar>,
    #[serde(default)]
    pub security_context: SecurityContext,
    #[serde(default)]
    pub volume_mounts: Vec<VolumeMount>,
    pub readiness_probe: Option<Probe>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct EnvVar {
    pub name: String,
    /// Only literal values: the manifests use no `valueFrom`.
    pub value: String,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct SecurityContext {
    #[serde(default)]
    pub privileged: bool,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeMount {
    pub name: String,
    pub mount_path: String,
    #[serde(default)]
    pub read_only: bool,
    /// None, HostToContainer or Bidirectional; absent is None.
    pub mount_propagation: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Volume {
    pub name: String,
    pub host_path: Option<HostPath>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct HostPath {
    pub path: String,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Probe {
    pub exec: Option<ExecAction>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ExecAction {
    pub command: Vec<String>,
}

/// The first object of `kind` in a (multi-document) manifest file.
pub fn load_workload(path: &Path, kind: &str) -> Result<Workload> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    for document in serde_yaml::Deserializer::from_str(&text) {
        let value = serde_yaml::Value::deserialize(document)
            .with_context(|| format!("{}: not YAML", path.display()))?;
        if value.get("kind").and_then(serde_yaml::Value::as_str) == Some(kind) {
            return serde_yaml::from_value(value)
                .with_context(|| format!("{}: the {kind} does not have the expected shape", path.display()));
        }
    }
    bail!("{}: no {kind} in it", path.display())
}

impl PodTemplateSpec {
    /// A container of the template (init containers included), by name.
    pub fn container(&self, name: &str) -> Result<&ManifestContainer> {
        self.init_containers
            .iter()
            .chain(&self.containers)
            .find(|c| c.name == name)
            .with_context(|| format!("the pod template has no container {name:?}"))
    }

    /// RunPodSandbox's settings: hostPID, and a privileged sandbox when a container is.
    pub fn pod_spec(&self, name: &str, namespace: &str, runtime_handler: &str) -> PodSpec {
        let mut pod = PodSpec::new(name, namespace, runtime_handler);
        pod.host_pid = self.host_pid;
        pod.privileged = self
            .init_containers
            .iter()
            .chain(&self.containers)
            .any(|c| c.security_context.privileged);
        pod
    }

    /// CreateContainer's config for `container` as kubelet builds it: command and args with
    /// `$(VAR)` expanded from the env, the env, privileged, and every volume mount resolved to
    /// its hostPath. Only hostPath volumes are supported.
    pub fn container_spec(&self, container: &ManifestContainer) -> Result<ContainerSpec> {
        let env: BTreeMap<&str, &str> = container
            .env
            .iter()
            .map(|v| (v.name.as_str(), v.value.as_str()))
            .collect();
        let expand_all = |words: &[String]| words.iter().map(|w| expand(w, &env)).collect::<Vec<_>>();
        let mut mounts = Vec::new();
        for mount in &container.volume_mounts {
            let volume = self
                .volumes
                .iter()
                .find(|v| v.name == mount.name)
                .with_context(|| format!("container {}: no volume {:?}", container.name, mount.name))?;
            let host = volume.host_path.as_ref().with_context(|| {
                format!(
                    "volume {:?}: only hostPath volumes are supported here",
                    volume.name
                )
            })?;
            mounts.push(cri::Mount {
                container_path: mount.mount_path.clone(),
                host_path: host.path.clone(),
                readonly: mount.read_only,
                propagation: propagation(mount.mount_propagation.as_deref())? as i32,
                ..Default::default()
            });
        }
        Ok(ContainerSpec {
            name: container.name.clone(),
            image: container.image.clone(),
            command: expand_all(&container.command),
            args: expand_all(&container.args),
            env: container
                .env
                .iter()
                .map(|v| (v.name.clone(), v.value.clone()))
                .collect(),
            mounts,
            privileged: container.security_context.privileged,
            ..ContainerSpec::default()
        })
    }
}

impl ManifestContainer {
    /// Sets the value of env variables the manifest defines (as a kustomize patch would); a name
    /// the manifest does not define is an error, so that a renamed variable fails the test.
    pub fn override_env(&mut self, values: &[(&str, &str)]) -> Result<()> {
        for (name, value) in values {
            let var = self
                .env
                .iter_mut()
                .find(|v| v.name == *name)
                .with_context(|| format!("container {}: the manifest sets no env {name}", self.name))?;
            var.value = value.to_string();
        }
        Ok(())
    }

    /// Adds env variables the manifest leaves at the script's default.
    pub fn add_env(&mut self, values: &[(&str, &str)]) -> Result<()> {
        for (name, value) in values {
            if self.env.iter().any(|v| v.name == *name) {
                bail!("container {}: the manifest already sets {name}", self.name);
            }
            self.env.push(EnvVar {
                name: name.to_string(),
                value: value.to_string(),
            });
        }
        Ok(())
    }

    /// The value of an env variable the manifest sets.
    pub fn env_value(&self, name: &str) -> Option<&str> {
        self.env.iter().find(|v| v.name == name).map(|v| v.value.as_str())
    }
}

/// kubelet's expansion of `command` and `args`: `$(NAME)` becomes NAME's value when the env
/// defines it and stays as written otherwise; `$$` is a literal `$`.
pub fn expand(word: &str, env: &BTreeMap<&str, &str>) -> String {
    let mut out = String::new();
    let mut rest = word;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let tail = &rest[at + 1..];
        if let Some(after) = tail.strip_prefix('$') {
            out.push('$');
            rest = after;
        } else if let Some(reference) = tail
            .strip_prefix('(')
            .and_then(|t| t.find(')').map(|end| &t[..end]))
        {
            match env.get(reference) {
                Some(value) => out.push_str(value),
                None => {
                    out.push_str("$(");
                    out.push_str(reference);
                    out.push(')');
                }
            }
            rest = &tail[reference.len() + 2..];
        } else {
            out.push('$');
            rest = tail;
        }
    }
    out.push_str(rest);
    out
}

fn propagation(value: Option<&str>) -> Result<cri::MountPropagation> {
    Ok(match value {
        None | Some("None") => cri::MountPropagation::PropagationPrivate,
        Some("HostToContainer") => cri::MountPropagation::PropagationHostToContainer,
        Some("Bidirectional") => cri::MountPropagation::PropagationBidirectional,
        Some(other) => {
            bail!("mountPropagation {other:?}: Kubernetes allows None, HostToContainer, Bidirectional")
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expansion_follows_kubelet() {
        let env = BTreeMap::from([("P", "/usr/local"), ("EMPTY", "")]);
        assert_eq!(expand("$(P)/bin/x", &env), "/usr/local/bin/x");
        assert_eq!(expand("a$(EMPTY)b", &env), "ab");
        assert_eq!(expand("$(MISSING)/x", &env), "$(MISSING)/x");
        assert_eq!(expand("$$(P)", &env), "$(P)");
        assert_eq!(expand("cost $5 $(P", &env), "cost $5 $(P");
        assert_eq!(expand("plain", &env), "plain");
    }

    const MANIFEST: &str = r#"
apiVersion: v1
kind: Namespace
metadata: { name: ns }
---
apiVersion: apps/v1
kind: DaemonSet
metadata: { name: ds, namespace: ns }
spec:
  template:
    spec:
      hostPID: true
      initContainers:
        - name: init
          image: img
          command: ["run", "$(PREFIX)/bin/x"]
          env: [{ name: PREFIX, value: /p }]
          securityContext: { privileged: true }
          volumeMounts: [{ name: root, mountPath: /host, mountPropagation: HostToContainer }]
      containers:
        - name: main
          image: img
      volumes:
        - name: root
          hostPath: { path: /, type: Directory }
"#;

    #[test]
    fn a_daemonset_container_becomes_a_cri_config() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.yaml");
        std::fs::write(&path, MANIFEST).unwrap();
        let workload = load_workload(&path, "DaemonSet").unwrap();
        assert_eq!(workload.metadata.namespace, "ns");
        let template = &workload.spec.template.spec;
        let mut init = template.container("init").unwrap().clone();
        init.override_env(&[("PREFIX", "/q")]).unwrap();
        assert!(init.override_env(&[("NOPE", "x")]).is_err());
        let spec = template.container_spec(&init).unwrap();
        assert_eq!(spec.command, ["run", "/q/bin/x"]);
        assert!(spec.privileged);
        assert_eq!(spec.mounts[0].host_path, "/");
        assert_eq!(
            spec.mounts[0].propagation,
            cri::MountPropagation::PropagationHostToContainer as i32
        );
        let pod = template.pod_spec("p", "ns", "runc");
        assert!(pod.host_pid && pod.privileged);
        assert!(load_workload(&path, "Job").is_err());
    }
}
