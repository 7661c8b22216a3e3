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

per_suite!(install_chains_the_default_toolkit_runtime_and_every_container_goes_through_it);

const WAIT: Duration = Duration::from_secs(20);
const TOOLKIT_BINARY: &str = "nvidia-container-runtime";

/// The stand-in runtime and what it recorded.
struct StandIn {
    dir: PathBuf,
    binary: PathBuf,
}

impl StandIn {
    fn install(dir: &Path, runc: &Path) -> Result<StandIn> {
        let binary = dir.join(TOOLKIT_BINARY);
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

fn gpu_mps(cli: &Path, node_config: &Path, args: &[&str]) -> Result<String> {
    let out = Command::new(cli)
        .arg("--config")
        .arg(node_config)
        .args(args)
        .output()
        .with_context(|| format!("running {}", cli.display()))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(out.status.success(), "gpu-mps {args:?}: {}: {text}", out.status);
    println!("gpu-mps {}:\n{text}", args[0]);
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

async fn install_chains_the_default_toolkit_runtime_and_every_container_goes_through_it(
    suite: Suite,
) -> Result<()> {
    let mut node = GpuNode::start(&suite, LimitsConfig::uniform()).await?;
    let scratch = WorkDir::new("gme2e-toolkit.")?;
    let stand_in = StandIn::install(scratch.path(), &suite.runc)?;

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
    let registration = [
        "--containerd-config",
        containerd_config.to_str().context("utf-8 path")?,
        "--containerd",
        suite.containerd.to_str().context("utf-8 path")?,
        "--shim",
        node.bins.shim.to_str().context("utf-8 path")?,
    ];
    let out = gpu_mps(
        &node.bins.cli,
        &node_config,
        &[&["install-containerd"], &registration[..]].concat(),
    )?;
    ensure!(
        out.contains("chained to the NVIDIA Container Toolkit") && out.contains("restart gpu-mps-manager"),
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

    gpu_mps(
        &node.bins.cli,
        &node_config,
        &[&["uninstall-containerd"], &registration[..]].concat(),
    )?;
    let back = std::fs::read_to_string(&node_config)?;
    ensure!(
        back == original,
        "uninstall did not put the node config back:\n{back}\nexpected:\n{original}"
    );
    Ok(())
}
