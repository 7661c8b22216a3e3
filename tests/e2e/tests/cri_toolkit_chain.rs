//! gpu-mps chained to the NVIDIA Container Toolkit's runtime (docs/adr/0009, docs/gpu-paths.md),
//! with a stand-in for nvidia-container-runtime: a script of that name that records each call
//! (its arguments, and on `create` the config.json it was handed) and then execs runc, as the
//! toolkit's runtime does once it has edited the spec.
//!
//! `gpu-mps install-containerd` is run on a containerd config where the toolkit is the default
//! runtime, as the GPU Operator leaves it; it must set runc_path in the node config to the
//! stand-in. The manager is restarted on that config, and pods of the gpu-mps handler then run
//! through CRI: the stand-in must see `create` for the GPU container on the spec gpu-mps-shim
//! rewrote (the MPS gate mount and env are in what it was given), and for the other containers
//! (a container without a GPU, the pause container) too. Uninstall puts runc_path back.
//!
//! The toolkit in legacy mode adds a prestart hook that binds the host's /tmp/nvidia-mps, where
//! it exists, at the same path in the container, over the gate. The stand-in can do the same
//! (its `cover`): it adds a prestart hook that binds a host dir over the container's
//! /tmp/nvidia-mps from the container's mount namespace, as nvidia-container-cli does. runc
//! runs every prestart hook before the createRuntime hooks, after its own mounts (checked on
//! runc 1.1.5, docs/adr/0011), so gpu-mps-hook sees the cover and must refuse the create with
//! one line, before any lease.
//!
//! Run: `cargo test -p gpu-mps-e2e --test cri_toolkit_chain -- --nocapture` (needs the
//! workspace and the static checker built, see gpu_mps_e2e::binaries).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use gpu_mps_api::NodeConfig;
use gpu_mps_e2e::checker::{CONTAINER_PIPE_DIR, CheckerLine, MpsClient};
use gpu_mps_e2e::containerd::GPU_MPS_HANDLER;
use gpu_mps_e2e::image::TEST_IMAGE;
use gpu_mps_e2e::workdir::WorkDir;
use gpu_mps_e2e::{ContainerSpec, GpuNode, LimitsConfig, PodSpec, Suite, per_suite};

per_suite!(
    install_chains_the_default_toolkit_runtime_and_every_container_goes_through_it,
    a_prestart_hook_that_mounts_over_the_gate_fails_the_create
);

const WAIT: Duration = Duration::from_secs(20);
const TOOLKIT_BINARY: &str = "nvidia-container-runtime";

/// The stand-in runtime and what it recorded.
struct StandIn {
    dir: PathBuf,
    binary: PathBuf,
}

impl StandIn {
    /// `cover`: a host dir the stand-in binds over /tmp/nvidia-mps of every container whose
    /// spec mounts something there, from a prestart hook it adds to the spec.
    fn install(dir: &Path, runc: &Path, cover: Option<&Path>) -> Result<StandIn> {
        let binary = dir.join(TOOLKIT_BINARY);
        let add_cover = match cover {
            Some(cover) => {
                let hook = dir.join("cover-hook");
                std::fs::write(&hook, cover_hook(cover))?;
                std::fs::set_permissions(&hook, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
                // gpu-mps-shim writes the spec pretty-printed, its `"hooks": {` on a line of its
                // own; the stand-in fails the create if the hook did not go in.
                format!(
                    "if [ \"$sub\" = create ] && grep -q '\"{pipe}\"' \"$bundle/config.json\"; then\n\
                       sed -i 's|\"hooks\": {{|\"hooks\": {{ \"prestart\": [{{ \"path\": \"{hook}\" }}],|' \"$bundle/config.json\"\n\
                       grep -q '{hook}' \"$bundle/config.json\" || {{ echo 'stand-in: no prestart hook added' >&2; exit 1; }}\n\
                     fi\n",
                    pipe = CONTAINER_PIPE_DIR,
                    hook = hook.display()
                )
            }
            None => String::new(),
        };
        // The bundle from every form runc takes (`--bundle X`, `--bundle=X`, `-b X`, none: the
        // working directory); the container id is the last argument.
        let text = format!(
            "#!/bin/sh\n\
             rec='{d}'\n\
             printf '%s\\n' \"$*\" >> \"$rec/calls\"\n\
             bundle=.; prev=; sub=; last=\n\
             for a in \"$@\"; do\n\
               case \"$prev\" in --bundle|-b) bundle=$a ;; esac\n\
               case \"$a\" in --bundle=*) bundle=${{a#--bundle=}} ;; create) [ -z \"$sub\" ] && sub=create ;; esac\n\
               prev=$a; last=$a\n\
             done\n\
             if [ \"$sub\" = create ]; then cp \"$bundle/config.json\" \"$rec/spec-$last.json\"; fi\n\
             {add_cover}\
             exec '{runc}' \"$@\"\n",
            d = dir.display(),
            runc = runc.display()
        );
        std::fs::write(&binary, text)?;
        std::fs::set_permissions(&binary, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
        Ok(StandIn {
            dir: dir.to_path_buf(),
            binary,
        })
    }

    fn calls(&self) -> Vec<String> {
        std::fs::read_to_string(self.dir.join("calls"))
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }

    /// The `create` call of container `id`, and the spec it was handed.
    fn create_of(&self, id: &str) -> Result<(String, serde_json::Value)> {
        let call = self
            .calls()
            .into_iter()
            .find(|c| c.split(' ').any(|a| a == "create") && c.ends_with(id))
            .with_context(|| {
                format!(
                    "the stand-in saw no create of {id}; its calls: {:#?}",
                    self.calls()
                )
            })?;
        let spec_path = self.dir.join(format!("spec-{id}.json"));
        let spec = std::fs::read_to_string(&spec_path)
            .with_context(|| format!("reading {}", spec_path.display()))?;
        Ok((call, serde_json::from_str(&spec)?))
    }
}

/// A containerd config of `version` whose default runtime is the toolkit's, as the GPU Operator
/// (or `nvidia-ctk runtime configure --set-as-default`) writes it.
fn toolkit_default_config(version: u32, toolkit: &Path) -> String {
    let plugin = if version >= 3 {
        "io.containerd.cri.v1.runtime"
    } else {
        "io.containerd.grpc.v1.cri"
    };
    format!(
        "version = {version}\n\
         [plugins.\"{plugin}\".containerd]\n\
         \x20 default_runtime_name = \"nvidia\"\n\
         \x20 [plugins.\"{plugin}\".containerd.runtimes.runc]\n\
         \x20   runtime_type = \"io.containerd.runc.v2\"\n\
         \x20 [plugins.\"{plugin}\".containerd.runtimes.nvidia]\n\
         \x20   runtime_type = \"io.containerd.runc.v2\"\n\
         \x20   [plugins.\"{plugin}\".containerd.runtimes.nvidia.options]\n\
         \x20     BinaryName = \"{}\"\n",
        toolkit.display()
    )
}

fn gpu_mps(cli: &Path, node_config: &Path, subcommand: &str, args: &[String]) -> Result<String> {
    let out = Command::new(cli)
        .arg("--config")
        .arg(node_config)
        .arg(subcommand)
        .args(args)
        .output()
        .with_context(|| format!("running {}", cli.display()))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(
        out.status.success(),
        "gpu-mps {subcommand} {args:?}: {}: {text}",
        out.status
    );
    println!("gpu-mps {subcommand}:\n{text}");
    Ok(text)
}

fn env_of(spec: &serde_json::Value) -> Vec<String> {
    spec["process"]["env"]
        .as_array()
        .map(|e| e.iter().filter_map(|v| v.as_str().map(str::to_owned)).collect())
        .unwrap_or_default()
}

fn has_gate_mount(spec: &serde_json::Value) -> bool {
    spec["mounts"]
        .as_array()
        .is_some_and(|m| m.iter().any(|m| m["destination"] == CONTAINER_PIPE_DIR))
}

/// The prestart hook of the stand-in's cover: binds `cover` over the container's /tmp/nvidia-mps
/// from the container's mount namespace, at the path under the rootfs (runc has not pivoted yet),
/// as nvidia-container-cli mounts. The pid and bundle come from the OCI state on stdin.
fn cover_hook(cover: &Path) -> String {
    format!(
        "#!/bin/sh\n\
         state=$(cat)\n\
         pid=$(printf '%s' \"$state\" | sed -n 's/.*\"pid\": *\\([0-9][0-9]*\\).*/\\1/p')\n\
         bundle=$(printf '%s' \"$state\" | sed -n 's/.*\"bundle\": *\"\\([^\"]*\\)\".*/\\1/p')\n\
         exec nsenter --mount=/proc/$pid/ns/mnt mount --bind '{}' \"$bundle/rootfs{CONTAINER_PIPE_DIR}\"\n",
        cover.display()
    )
}

/// A node whose node config was chained to the stand-in by `gpu-mps install-containerd`, its
/// manager restarted on it.
struct Chained {
    node: GpuNode,
    _scratch: WorkDir,
    stand_in: StandIn,
    node_config: PathBuf,
    /// The node config before install.
    original: String,
    /// install-containerd's and uninstall-containerd's arguments after the subcommand.
    registration: Vec<String>,
}

impl Chained {
    async fn install(suite: &Suite, cover: Option<&Path>) -> Result<Chained> {
        let mut node = GpuNode::start(suite, LimitsConfig::uniform()).await?;
        let scratch = WorkDir::new("gme2e-toolkit.")?;
        let stand_in = StandIn::install(scratch.path(), &suite.runc, cover)?;

        // The node config as a package installs it: runc_path not set.
        let node_config = node.manager.config_path().to_path_buf();
        let original: String = std::fs::read_to_string(&node_config)?
            .lines()
            .filter(|l| !l.starts_with("runc_path"))
            .map(|l| format!("{l}\n"))
            .collect();
        std::fs::write(&node_config, &original)?;

        let containerd_config = scratch.join("containerd.toml");
        std::fs::write(
            &containerd_config,
            toolkit_default_config(suite.config_version(), &stand_in.binary),
        )?;
        let utf8 = |p: &Path| p.to_str().map(str::to_owned).context("utf-8 path");
        let registration = vec![
            "--containerd-config".to_string(),
            utf8(&containerd_config)?,
            "--containerd".to_string(),
            utf8(&suite.containerd)?,
            "--shim".to_string(),
            utf8(&node.bins.shim)?,
        ];
        let out = gpu_mps(&node.bins.cli, &node_config, "install-containerd", &registration)?;
        ensure!(
            out.contains("chained to the NVIDIA Container Toolkit")
                && out.contains("restart gpu-mps-manager"),
            "install did not say it chained and that the manager needs a restart: {out}"
        );
        ensure!(!out.contains("warning"), "install warned: {out}");
        let chained = NodeConfig::load(&node_config)?;
        ensure!(
            chained.runc_path == stand_in.binary,
            "runc_path = {} after install, expected the toolkit's runtime {}",
            chained.runc_path.display(),
            stand_in.binary.display()
        );
        node.manager.set_config(chained);
        node.manager.restart().await?;
        Ok(Chained {
            node,
            _scratch: scratch,
            stand_in,
            node_config,
            original,
            registration,
        })
    }

    fn uninstall(&self) -> Result<()> {
        gpu_mps(
            &self.node.bins.cli,
            &self.node_config,
            "uninstall-containerd",
            &self.registration,
        )?;
        let back = std::fs::read_to_string(&self.node_config)?;
        ensure!(
            back == self.original,
            "uninstall did not put the node config back:\n{back}\nexpected:\n{}",
            self.original
        );
        Ok(())
    }
}

async fn install_chains_the_default_toolkit_runtime_and_every_container_goes_through_it(
    suite: Suite,
) -> Result<()> {
    let chained = Chained::install(&suite, None).await?;
    let (node, stand_in) = (&chained.node, &chained.stand_in);

    let mut cri = node.cri().await?;
    let gpu = node.gpu_uuid(0).to_string();
    let pod = cri
        .run_pod_sandbox(&PodSpec::new("chained", "default", GPU_MPS_HANDLER).gpu_limits("2Gi", 25))
        .await?;
    let with_gpu = cri
        .create_container(
            &pod,
            &ContainerSpec::new("with-gpu", TEST_IMAGE)
                .command(&["/checker"])
                .args(&["mps-client", "--hold-seconds=300"])
                .gpu(&gpu),
        )
        .await?;
    cri.start_container(&with_gpu).await?;
    let client = MpsClient::parse(&cri.first_stdout_line(&with_gpu, WAIT).await?)?;
    ensure!(
        client.admitted,
        "the GPU container did not reach its MPS daemon through the chained runtime: {client}"
    );
    let without_gpu = cri
        .create_container(
            &pod,
            &ContainerSpec::new("without-gpu", TEST_IMAGE)
                .command(&["/checker"])
                .args(&["report"]),
        )
        .await?;
    cri.start_container(&without_gpu).await?;
    cri.wait_exit(&without_gpu, WAIT).await?;

    let (call, spec) = stand_in.create_of(&with_gpu.id)?;
    println!("the stand-in ran: {call}");
    let env = env_of(&spec);
    ensure!(
        has_gate_mount(&spec)
            && env
                .iter()
                .any(|e| *e == format!("CUDA_MPS_PIPE_DIRECTORY={CONTAINER_PIPE_DIR}")),
        "the stand-in got a spec without gpu-mps' rewrite (no {CONTAINER_PIPE_DIR} mount or CUDA_MPS_PIPE_DIRECTORY): env {env:?}"
    );
    ensure!(
        env.iter().any(|e| *e == format!("NVIDIA_VISIBLE_DEVICES={gpu}")),
        "the toolkit would not know the GPU: NVIDIA_VISIBLE_DEVICES is not in {env:?}"
    );
    let (_, plain) = stand_in.create_of(&without_gpu.id)?;
    ensure!(
        !has_gate_mount(&plain) && !env_of(&plain).iter().any(|e| e.starts_with("CUDA_MPS_")),
        "the container without a GPU was rewritten: {plain}"
    );
    stand_in
        .create_of(&pod.id)
        .context("the pause container did not go through the chained runtime")?;
    cri.remove_container(&with_gpu).await?;
    cri.remove_container(&without_gpu).await?;
    cri.delete_pod(&pod).await?;
    // Every other subcommand goes through it as well.
    let calls = stand_in.calls();
    for sub in ["start", "delete"] {
        if !calls.iter().any(|c| c.split(' ').any(|a| a == sub)) {
            bail!("the stand-in never saw `{sub}`: {calls:#?}");
        }
    }

    chained.uninstall()
}

async fn a_prestart_hook_that_mounts_over_the_gate_fails_the_create(suite: Suite) -> Result<()> {
    let host = WorkDir::new("gme2e-host-mps.")?;
    let chained = Chained::install(&suite, Some(host.path())).await?;
    let node = &chained.node;
    let mut cri = node.cri().await?;
    let gpu = node.gpu_uuid(0).to_string();
    let pod = cri
        .run_pod_sandbox(&PodSpec::new("covered", "default", GPU_MPS_HANDLER).gpu_limits("2Gi", 25))
        .await?;
    let covered = cri
        .create_container(
            &pod,
            &ContainerSpec::new("covered", TEST_IMAGE)
                .command(&["/checker"])
                .args(&["mps-client", "--hold-seconds=300"])
                .gpu(&gpu),
        )
        .await?;
    let refused = match cri.start_container(&covered).await {
        Ok(()) => {
            let seen = cri.first_stdout_line(&covered, WAIT).await.unwrap_or_default();
            bail!(
                "a GPU container whose {CONTAINER_PIPE_DIR} a prestart hook covered with {} started; it saw: {seen}",
                host.path().display()
            )
        }
        Err(status) => status.message().to_string(),
    };
    let (call, spec) = chained.stand_in.create_of(&covered.id)?;
    ensure!(
        has_gate_mount(&spec),
        "the stand-in's create was not of the rewritten spec: {call}"
    );
    let line = refused
        .lines()
        .find(|l| l.contains("is not its MPS gate"))
        .with_context(|| format!("no line of the refusal says the gate is covered: {refused}"))?;
    // The cover named by its dir inside its filesystem (a tail of the host path).
    let cover_name = host
        .path()
        .file_name()
        .context("scratch dir name")?
        .to_string_lossy();
    ensure!(
        line.contains("a mount made after runc's covers it")
            && line.contains(&format!("/{cover_name} on "))
            && line.contains(&format!("rootfs{CONTAINER_PIPE_DIR})"))
            && line.contains("remove that dir from the host or run the toolkit in CDI mode"),
        "the refusal does not say what covers the gate and what to do: {line}"
    );
    println!("{}: refused: {line}", suite.containerd_version);
    let status = node.manager.status().await?;
    ensure!(
        status.leases.is_empty(),
        "the refused container holds a lease: {:?}",
        status.leases
    );
    cri.delete_container(&covered).await?;
    cri.delete_pod(&pod).await?;
    chained.uninstall()
}
