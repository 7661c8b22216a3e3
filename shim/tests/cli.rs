//! The built binary against a fake runc: a shell script that records its argv. Each test gets
//! a temp dir with the node config ($GPU_MPS_CONFIG), the manager's root (inventory), a bundle
//! and the fake runc.

// Test helpers may unwrap: a panic that shows the value is the clearest failure here.
#![allow(clippy::unwrap_used)]

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Mutex;

use gpu_mps_api::NodeConfig;
use gpu_mps_api::inventory::Inventory;
use gpu_mps_shim::plan_rewrite;
use serde_json::Value;
use tempfile::TempDir;

const SHIM: &str = env!("CARGO_BIN_EXE_gpu-mps-shim");
/// The container id every `create` in these tests uses.
const CREATED_ID: &str = "id";
const GPU0: &str = "GPU-5bc4d1a1-4a1e-9d7b-3c2f-8e1f0a6b7c01";

/// Held while a script is written and while a child is spawned: a child forked while another
/// thread still has the script open for writing would make exec fail with ETXTBSY.
static SPAWN: Mutex<()> = Mutex::new(());

fn golden_input(case: &str) -> String {
    fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/golden")
            .join(case)
            .join("input.json"),
    )
    .unwrap()
}

struct Fixture {
    dir: TempDir,
}

impl Fixture {
    /// A node with the golden inventory and a bundle holding golden case `case`'s input.
    /// Under policy uniform (the container sees its gate dir under every policy); the exact
    /// tests pass their own `[limits]`.
    fn new(case: &str) -> Self {
        Self::with_config(case, "[limits]\npolicy = \"uniform\"\n")
    }

    fn with_config(case: &str, extra_config: &str) -> Self {
        let f = Fixture {
            dir: tempfile::tempdir().unwrap(),
        };
        fs::create_dir_all(f.root()).unwrap();
        fs::copy(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/inventory.json"),
            f.inventory(),
        )
        .unwrap();
        fs::create_dir_all(f.bundle()).unwrap();
        fs::write(f.config_json(), golden_input(case)).unwrap();
        fs::set_permissions(f.config_json(), fs::Permissions::from_mode(0o644)).unwrap();
        // The env-* cases name their GPU by NVIDIA_VISIBLE_DEVICES, as the NVIDIA device
        // plugin's envvar strategy hands it over: a node that takes GPUs from the env.
        let trust_env = if extra_config.contains("[gpus]") {
            ""
        } else {
            "[gpus]\ntrust_visible_devices_env = true\n"
        };
        let config = format!(
            "root = {:?}\nrunc_path = {:?}\nhook_path = \"/usr/local/bin/gpu-mps-hook\"\n{trust_env}{extra_config}",
            f.root(),
            f.runc()
        );
        fs::write(f.node_config(), config).unwrap();
        let script = format!(
            "#!/bin/sh\nfor a in \"$@\"; do printf '%s\\n' \"$a\"; done > {:?}\n\
             if [ \"$1\" = --version ]; then echo 'runc version 1.2.3-fake'; fi\n\
             exit \"${{FAKE_RUNC_EXIT:-0}}\"\n",
            f.argv_file()
        );
        let _guard = SPAWN.lock().unwrap_or_else(|e| e.into_inner());
        fs::write(f.runc(), script).unwrap();
        fs::set_permissions(f.runc(), fs::Permissions::from_mode(0o755)).unwrap();
        f
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
    fn root(&self) -> PathBuf {
        self.path("root")
    }
    fn inventory(&self) -> PathBuf {
        self.root().join("inventory.json")
    }
    fn bundle(&self) -> PathBuf {
        self.path("bundle")
    }
    fn config_json(&self) -> PathBuf {
        self.bundle().join("config.json")
    }
    fn node_config(&self) -> PathBuf {
        self.path("config.toml")
    }
    fn runc(&self) -> PathBuf {
        self.path("fake-runc")
    }
    fn argv_file(&self) -> PathBuf {
        self.path("runc-argv")
    }
    fn log(&self) -> PathBuf {
        self.path("log.json")
    }
    /// The dir the container sees at /tmp/nvidia-mps: its gate dir, under every policy.
    fn gate_dir(&self, id: &str) -> PathBuf {
        let id = gpu_mps_api::ContainerId::parse(id).unwrap();
        self.root().join("gates").join(id.gate_name())
    }
    fn pipe_dir(&self, uuid: &str) -> PathBuf {
        self.root().join("daemons").join(uuid).join("pipe")
    }
    fn bundle_arg(&self) -> String {
        self.bundle().to_str().unwrap().to_string()
    }

    /// What runc got, one argument per line; `None` when runc did not run.
    fn runc_argv(&self) -> Option<Vec<String>> {
        let text = fs::read_to_string(self.argv_file()).ok()?;
        Some(text.lines().map(String::from).collect())
    }

    /// The config.json the library plans for this node, which the binary must have written.
    fn planned(&self, input: &str, id: &str) -> String {
        let config = NodeConfig::from_toml(
            &fs::read_to_string(self.node_config()).unwrap(),
            &self.node_config(),
        )
        .unwrap();
        let inventory = Inventory::from_json(&fs::read_to_string(self.inventory()).unwrap()).unwrap();
        plan_rewrite(input, &config, &inventory, id)
            .unwrap()
            .rewritten
            .unwrap()
    }

    fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new(program);
        cmd.env("GPU_MPS_CONFIG", self.node_config())
            .env_remove("GPU_MPS_SHIM_DEBUG")
            .env_remove("FAKE_RUNC_EXIT")
            .current_dir(self.dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        cmd
    }

    fn run(&self, args: &[&str]) -> Output {
        let mut cmd = self.command(SHIM);
        cmd.args(args);
        spawn(cmd)
    }

    /// `create` the way containerd's runc shim calls it: with a JSON runc log.
    fn create_with_json_log(&self) -> Output {
        let log = self.log().to_str().unwrap().to_string();
        self.run(&[
            "--log",
            &log,
            "--log-format",
            "json",
            "create",
            "--bundle",
            &self.bundle_arg(),
            "id",
        ])
    }
}

fn spawn(mut cmd: Command) -> Output {
    let child = {
        let _guard = SPAWN.lock().unwrap_or_else(|e| e.into_inner());
        cmd.spawn().unwrap()
    };
    child.wait_with_output().unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn mode(path: &Path) -> u32 {
    fs::metadata(path).unwrap().permissions().mode() & 0o7777
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

#[test]
fn create_rewrites_the_spec_makes_the_gate_dir_and_passes_the_arguments_unchanged() {
    let f = Fixture::new("env-uuid");
    let (bundle, log) = (f.bundle_arg(), f.log().to_str().unwrap().to_string());
    let pid_file = format!("{bundle}/init.pid");
    let args = [
        "--root",
        "/run/containerd/runc/k8s.io",
        "--log",
        &log,
        "--log-format",
        "json",
        "--systemd-cgroup",
        "create",
        "--bundle",
        &bundle,
        "--pid-file",
        &pid_file,
        "b7e1d3f5a9c2",
    ];
    let out = f.run(&args);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(f.runc_argv(), Some(strings(&args)));
    assert_eq!(
        fs::read_to_string(f.config_json()).unwrap(),
        f.planned(&golden_input("env-uuid"), "b7e1d3f5a9c2")
    );
    assert_eq!(mode(&f.config_json()), 0o644);
    assert!(f.gate_dir("b7e1d3f5a9c2").is_dir());
    assert_eq!(mode(&f.gate_dir("b7e1d3f5a9c2")), 0o755);
    assert!(
        !f.pipe_dir(GPU0).exists(),
        "the daemon's pipe dir is never the container's: it holds control_privileged"
    );
    assert!(!f.log().exists(), "nothing is logged on success");
    assert_eq!(
        fs::read_dir(f.bundle()).unwrap().count(),
        1,
        "no temp file is left in the bundle"
    );
    assert!(
        out.stdout.is_empty() && out.stderr.is_empty(),
        "create must stay silent: {}",
        stderr(&out)
    );
}

#[test]
fn every_form_of_the_bundle_argument() {
    type Args = fn(&str) -> Vec<String>;
    let forms: &[(&str, Args)] = &[
        ("--bundle X", |b| strings(&["create", "--bundle", b, "id"])),
        ("--bundle=X", |b| {
            vec!["create".into(), format!("--bundle={b}"), "id".into()]
        }),
        ("-b X", |b| strings(&["create", "-b", b, "id"])),
        ("-b=X", |b| vec!["create".into(), format!("-b={b}"), "id".into()]),
        ("-bundle X", |b| strings(&["create", "-bundle", b, "id"])),
        ("global flags first", |b| {
            strings(&[
                "--root",
                "/r",
                "--log-format=json",
                "--debug",
                "create",
                "--no-pivot",
                "-b",
                b,
                "id",
            ])
        }),
        ("flags after the id", |b| {
            strings(&["-root=/r", "create", "id", "--bundle", b])
        }),
        ("none: the current directory", |_| {
            strings(&["--root", "/r", "create", "--pid-file", "p", "id"])
        }),
    ];
    for (form, args) in forms {
        let f = Fixture::new("cdi-index");
        let args = args(&f.bundle_arg());
        let mut cmd = f.command(SHIM);
        cmd.args(&args).current_dir(f.bundle());
        let out = spawn(cmd);
        assert!(out.status.success(), "{form}: {}", stderr(&out));
        assert_eq!(f.runc_argv(), Some(args.clone()), "{form}");
        let spec: Value = serde_json::from_str(&fs::read_to_string(f.config_json()).unwrap()).unwrap();
        assert_eq!(spec["annotations"]["gpu-mps.io/limits"], "4Gi/25%", "{form}");
        assert!(f.gate_dir(CREATED_ID).is_dir(), "{form}");
    }
}

#[test]
fn a_container_without_gpu_is_not_touched_nor_is_the_node_config_validated() {
    for case in ["pause", "cpu-void", "cpu-no-gpu-other-cdi-vendor"] {
        // A typo in [limits] and no inventory: neither matters when no GPU is asked for.
        let f = Fixture::with_config(case, "[limits]\npolcy = \"ceiling\"\n");
        fs::remove_file(f.inventory()).unwrap();
        let before = fs::read(f.config_json()).unwrap();
        let inode = fs::metadata(f.config_json()).unwrap().ino();
        let args = ["--log", "/dev/null", "create", "--bundle", &f.bundle_arg(), "id"];
        let out = f.run(&args);
        assert!(out.status.success(), "{case}: {}", stderr(&out));
        assert_eq!(f.runc_argv(), Some(strings(&args)), "{case}");
        assert_eq!(
            fs::read(f.config_json()).unwrap(),
            before,
            "{case}: byte for byte"
        );
        assert_eq!(
            fs::metadata(f.config_json()).unwrap().ino(),
            inode,
            "{case}: not even rewritten"
        );
        assert!(!f.root().join("daemons").exists(), "{case}");
    }
}

#[test]
fn on_a_node_that_does_not_trust_the_env_an_env_only_gpu_gets_nothing() {
    let untrusted = "[gpus]\ntrust_visible_devices_env = false\n[limits]\npolicy = \"uniform\"\n";
    // A CUDA image's NVIDIA_VISIBLE_DEVICES=all and no GPU scheduled: runc runs a container
    // without a GPU, its env voided so that the chained toolkit adds none; no daemon, no gate,
    // and no inventory needed.
    let f = Fixture::with_config("env-all", untrusted);
    fs::remove_file(f.inventory()).unwrap();
    let args = [
        "--log",
        "/dev/null",
        "create",
        "--bundle",
        &f.bundle_arg(),
        CREATED_ID,
    ];
    let out = f.run(&args);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(f.runc_argv(), Some(strings(&args)));
    let spec: Value = serde_json::from_str(&fs::read_to_string(f.config_json()).unwrap()).unwrap();
    let env: Vec<&str> = spec["process"]["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e.as_str().unwrap())
        .collect();
    assert!(env.contains(&"NVIDIA_VISIBLE_DEVICES=void"), "{env:?}");
    assert!(
        !env.iter()
            .any(|e| e.starts_with("CUDA_MPS_") || *e == "NVIDIA_VISIBLE_DEVICES=all"),
        "{env:?}"
    );
    assert!(spec.get("hooks").is_none(), "{spec}");
    assert!(!f.gate_dir(CREATED_ID).exists() && !f.root().join("daemons").exists());

    // The env names a GPU: refused with one line naming the key, and runc never runs.
    let f = Fixture::with_config("env-index", untrusted);
    let before = fs::read(f.config_json()).unwrap();
    let out = f.run(&["create", "--bundle", &f.bundle_arg(), CREATED_ID]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("NVIDIA_VISIBLE_DEVICES=\"1\" names GPUs, but none was scheduled")
            && err.contains("[gpus] trust_visible_devices_env = true")
            && err.trim_end().lines().count() == 1,
        "{err}"
    );
    assert_eq!(f.runc_argv(), None);
    assert_eq!(fs::read(f.config_json()).unwrap(), before);
    assert!(!f.gate_dir(CREATED_ID).exists());
}

#[test]
fn other_subcommands_go_to_runc_untouched_with_its_exit_code() {
    let f = Fixture::with_config("env-uuid", "[limits]\npolcy = \"ceiling\"\n");
    let before = fs::read(f.config_json()).unwrap();
    for args in [
        &["--root", "/run/containerd/runc/k8s.io", "kill", "id", "9"][..],
        &[
            "--log",
            "/x/log.json",
            "--log-format",
            "json",
            "delete",
            "--force",
            "id",
        ],
        &["state", "id"],
        &["--root", "/r", "--", "start", "id"],
        &[],
    ] {
        let mut cmd = f.command(SHIM);
        cmd.args(args).env("FAKE_RUNC_EXIT", "3");
        let out = spawn(cmd);
        assert_eq!(out.status.code(), Some(3), "{args:?}: {}", stderr(&out));
        assert_eq!(f.runc_argv(), Some(strings(args)), "{args:?}");
    }
    assert_eq!(fs::read(f.config_json()).unwrap(), before);
}

#[test]
fn bad_input_fails_with_one_json_line_in_the_runc_log() {
    let f = Fixture::new("error-memory-unknown-suffix");
    let before = fs::read(f.config_json()).unwrap();
    let out = f.create_with_json_log();
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(f.runc_argv(), None, "runc must not run");
    assert_eq!(fs::read(f.config_json()).unwrap(), before);
    let text = fs::read_to_string(f.log()).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 1, "{text}");
    let line: Value = serde_json::from_str(lines[0]).unwrap();
    let keys: Vec<&String> = line.as_object().unwrap().keys().collect();
    assert_eq!(keys, ["level", "msg", "time"]);
    assert_eq!(line["level"], "error");
    let msg = line["msg"].as_str().unwrap();
    assert!(
        msg.starts_with("gpu-mps: annotation gpu-mps.io/memory-limit=\"4GB\": "),
        "{msg}"
    );
    assert!(msg.contains("allowed are Ki, Mi, Gi"), "{msg}");
    assert_rfc3339(line["time"].as_str().unwrap());
    assert_eq!(stderr(&out), format!("{msg}\n"), "stderr gets the same message");
}

#[test]
fn bad_input_fails_with_one_text_line_in_the_runc_log() {
    let f = Fixture::new("error-threads-out-of-range");
    let log = f.log().to_str().unwrap().to_string();
    let out = f.run(&["--log", &log, "create", "-b", &f.bundle_arg(), "id"]);
    assert_eq!(out.status.code(), Some(1));
    let text = fs::read_to_string(f.log()).unwrap();
    assert_eq!(text.lines().count(), 1, "{text}");
    let rest = text.strip_prefix("time=\"").unwrap();
    let (time, rest) = rest.split_once('"').unwrap();
    assert_rfc3339(time);
    assert_eq!(
        rest,
        " level=error msg=\"gpu-mps: annotation gpu-mps.io/active-thread-percentage=\\\"250\\\": \\\"250\\\" is not \
         an active thread percentage: expected a whole number from 1 to 100 (set it on the pod)\"\n"
    );
}

#[test]
fn without_log_flag_the_error_goes_to_stderr() {
    let f = Fixture::new("error-missing-limits");
    let out = f.run(&["create", "--bundle", &f.bundle_arg(), "id"]);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(
        err.starts_with("gpu-mps: no memory limit for container \"infer\""),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");
}

#[test]
fn a_missing_inventory_says_the_manager_is_not_running() {
    let f = Fixture::new("env-index");
    fs::remove_file(f.inventory()).unwrap();
    let out = f.create_with_json_log();
    assert_eq!(out.status.code(), Some(1));
    let line: Value = serde_json::from_str(fs::read_to_string(f.log()).unwrap().trim()).unwrap();
    let msg = line["msg"].as_str().unwrap();
    assert!(
        msg.contains("inventory.json") && msg.contains("gpu-mps-manager") && msg.contains("not running"),
        "{msg}"
    );
    assert_eq!(f.runc_argv(), None);
}

#[test]
fn an_invalid_node_config_fails_a_gpu_create() {
    let f = Fixture::with_config("env-index", "[limits]\npolcy = \"ceiling\"\n");
    let out = f.run(&["create", "--bundle", &f.bundle_arg(), "id"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("polcy"), "{}", stderr(&out));
}

#[test]
fn a_missing_runc_is_reported() {
    let f = Fixture::with_config("pause", "");
    fs::remove_file(f.runc()).unwrap();
    let out = f.run(&["delete", "id"]);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(
        err.starts_with("gpu-mps: cannot run runc at ") && err.contains("runc_path"),
        "{err}"
    );
}

#[test]
fn gate_dir_and_config_modes_do_not_depend_on_the_umask() {
    let f = Fixture::new("env-uuid");
    let mut cmd = f.command("/bin/sh");
    cmd.args([
        "-c",
        "umask 077; exec \"$0\" \"$@\"",
        SHIM,
        "create",
        "--bundle",
        &f.bundle_arg(),
        "id",
    ]);
    let out = spawn(cmd);
    assert!(out.status.success(), "{}", stderr(&out));
    // The gate dir 0755 (the container's /tmp/nvidia-mps), its parents 0700 (no host user
    // reaches a gate).
    let gate = f.gate_dir(CREATED_ID);
    assert_eq!(mode(&gate), 0o755, "{}", gate.display());
    let mut dir = gate.parent().unwrap().to_path_buf();
    while dir != f.root() {
        assert_eq!(mode(&dir), 0o700, "{}", dir.display());
        dir.pop();
    }
    assert_eq!(mode(&f.config_json()), 0o644);
}

#[test]
fn help_explains_the_shim_and_runs_no_runc() {
    for flag in ["--help", "-h"] {
        let f = Fixture::new("pause");
        let out = f.run(&[flag]);
        assert!(out.status.success());
        let text = String::from_utf8(out.stdout).unwrap();
        assert!(
            text.contains("BinaryName") && text.contains("io.containerd.runc.v2"),
            "{text}"
        );
        assert!(text.contains("--runc-binary"), "{text}");
        assert_eq!(f.runc_argv(), None);
    }
}

#[test]
fn version_prints_the_shims_then_runcs() {
    let f = Fixture::new("pause");
    let out = f.run(&["--version"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(
        text,
        format!(
            "gpu-mps-shim version {}\nrunc version 1.2.3-fake\n",
            env!("CARGO_PKG_VERSION")
        )
    );
    assert_eq!(f.runc_argv(), Some(strings(&["--version"])));
}

#[test]
fn version_without_runc_prints_the_shims_and_says_why_runcs_is_missing() {
    let f = Fixture::new("pause");
    fs::remove_file(f.runc()).unwrap();
    let out = f.run(&["--version"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let err = stderr(&out);
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        format!("gpu-mps-shim version {}\n", env!("CARGO_PKG_VERSION"))
    );
    assert!(
        err.contains(&f.runc().display().to_string()) && err.contains("runc's version is not shown"),
        "{err}"
    );
}

#[test]
fn debug_logs_what_the_shim_did_to_stderr() {
    let f = Fixture::new("env-index");
    let mut cmd = f.command(SHIM);
    cmd.args(["create", "--bundle", &f.bundle_arg(), "id"])
        .env("GPU_MPS_SHIM_DEBUG", "1");
    let out = spawn(cmd);
    assert!(out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("rewrite: GPUs GPU-9e2f7c3d") && err.contains("limits 4Gi/25%"),
        "{err}"
    );
    assert!(
        err.contains("exec ") && err.contains("fake-runc create --bundle"),
        "{err}"
    );

    let f = Fixture::new("pause");
    let out = f.run(&["--debug", "create", "--bundle", &f.bundle_arg(), "id"]);
    assert!(out.status.success());
    assert!(
        stderr(&out).contains("passthrough: sandbox container"),
        "{}",
        stderr(&out)
    );
}

/// With a runc `--log` (containerd always passes one), debug lines go there as runc's own debug
/// lines do, never to stderr: runc's stderr on `create` is the container's, so they would land,
/// host paths and all, in every container's log.
#[test]
fn debug_goes_to_the_runc_log_never_to_stderr() {
    for (case, expected) in [
        ("env-index", "rewrite: GPUs GPU-9e2f7c3d"),
        ("pause", "passthrough: sandbox container"),
    ] {
        let f = Fixture::new(case);
        let mut cmd = f.command(SHIM);
        let log = f.log().to_str().unwrap().to_string();
        cmd.args([
            "--log",
            &log,
            "--log-format",
            "json",
            "create",
            "--bundle",
            &f.bundle_arg(),
            "id",
        ])
        .env("GPU_MPS_SHIM_DEBUG", "1");
        let out = spawn(cmd);
        assert!(out.status.success(), "{case}: {}", stderr(&out));
        assert!(
            !stderr(&out).contains("gpu-mps-shim"),
            "{case}: debug on stderr: {}",
            stderr(&out)
        );
        let text = fs::read_to_string(f.log()).unwrap_or_default();
        let lines: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert!(
            lines
                .iter()
                .any(|l| l["level"] == "debug" && l["msg"].as_str().is_some_and(|m| m.contains(expected))),
            "{case}: no debug line with {expected:?} in the runc log: {text}"
        );
        for l in &lines {
            assert_rfc3339(l["time"].as_str().unwrap());
        }
    }
    // The text format too, as logrus writes it.
    let f = Fixture::new("pause");
    let log = f.log().to_str().unwrap().to_string();
    let out = f.run(&[
        "--debug",
        "--log",
        &log,
        "create",
        "--bundle",
        &f.bundle_arg(),
        "id",
    ]);
    assert!(out.status.success());
    assert!(!stderr(&out).contains("gpu-mps-shim"), "{}", stderr(&out));
    let text = fs::read_to_string(f.log()).unwrap();
    assert!(
        text.lines()
            .any(|l| l.contains("level=debug") && l.contains("passthrough: sandbox container")),
        "{text}"
    );
}

/// A bad annotation is the pod's to fix whatever state the node is in: it is reported before the
/// node's files are read, so a node whose manager never ran (no inventory) still tells the pod
/// what is wrong with it, and every bad field at once.
#[test]
fn bad_annotations_are_reported_even_when_the_manager_is_down_and_all_at_once() {
    let f = Fixture::new("error-memory-unknown-suffix");
    fs::remove_file(f.inventory()).unwrap();
    let spec = fs::read_to_string(f.config_json()).unwrap().replace(
        "\"gpu-mps.io/active-thread-percentage\": \"25\"",
        "\"gpu-mps.io/active-thread-percentage\": \"250\"",
    );
    fs::write(f.config_json(), spec).unwrap();
    let out = f.create_with_json_log();
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        !err.contains("inventory"),
        "the missing inventory hid the annotation: {err}"
    );
    assert!(
        err.contains("gpu-mps.io/memory-limit=\"4GB\"")
            && err.contains("gpu-mps.io/active-thread-percentage=\"250\""),
        "not every bad annotation is named: {err}"
    );
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert_eq!(f.runc_argv(), None, "runc ran");
}

/// On a node whose manager found no NVIDIA driver (its `nvml-error` next to the inventory), a GPU
/// container is told that, in the runc log containerd hands to kubelet.
#[test]
fn a_node_without_the_driver_tells_the_pod_so() {
    let f = Fixture::new("env-index");
    fs::remove_file(f.inventory()).unwrap();
    fs::write(
        f.root().join("nvml-error"),
        "NVML: loading libnvidia-ml.so.1 (is the NVIDIA driver installed?): a libloading error occurred\n",
    )
    .unwrap();
    let out = f.create_with_json_log();
    assert!(!out.status.success());
    let log = fs::read_to_string(f.log()).unwrap();
    let last: Value = serde_json::from_str(log.lines().last().unwrap()).unwrap();
    let msg = last["msg"].as_str().unwrap();
    assert!(
        msg.contains("no usable NVIDIA driver") && !msg.contains("not running"),
        "{msg}"
    );
    assert_eq!(f.runc_argv(), None, "runc ran");
    // A container without a GPU still runs there.
    let f = Fixture::new("cpu-none");
    fs::write(f.root().join("nvml-error"), "NVML: no driver\n").unwrap();
    assert!(f.create_with_json_log().status.success());
}

/// `2026-12-03T08:20:00Z`: what Go's time.Time accepts when containerd decodes the log line.
fn assert_rfc3339(time: &str) {
    let b = time.as_bytes();
    let digits = |r: std::ops::Range<usize>| r.into_iter().all(|i| b[i].is_ascii_digit());
    assert!(
        b.len() == 20
            && digits(0..4)
            && b[4] == b'-'
            && digits(5..7)
            && b[7] == b'-'
            && digits(8..10)
            && b[10] == b'T'
            && digits(11..13)
            && b[13] == b':'
            && digits(14..16)
            && b[16] == b':'
            && digits(17..19)
            && b[19] == b'Z',
        "{time} is not RFC 3339"
    );
}

#[test]
fn under_policy_exact_create_makes_the_containers_gate_dir_and_mounts_it() {
    let f = Fixture::with_config("env-uuid", "[limits]\npolicy = \"exact\"\n");
    let out = f.create_with_json_log();
    assert!(out.status.success(), "{}", stderr(&out));
    let id = gpu_mps_api::ContainerId::parse(CREATED_ID).unwrap();
    let gate = f.root().join("gates").join(id.gate_name());
    assert!(gate.is_dir(), "no gate dir {}", gate.display());
    assert_eq!(mode(&gate), 0o755);
    assert!(
        !f.pipe_dir(GPU0).exists(),
        "the daemon's pipe dir is the manager's business under every policy"
    );
    let spec: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(f.config_json()).unwrap()).unwrap();
    let mount = spec["mounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["destination"] == "/tmp/nvidia-mps")
        .unwrap();
    assert_eq!(mount["source"], gate.to_str().unwrap());
}

#[test]
fn under_policy_exact_an_id_that_cannot_name_a_dir_fails_the_create() {
    let f = Fixture::with_config("env-uuid", "[limits]\npolicy = \"exact\"\n");
    let out = f.run(&["create", "--bundle", &f.bundle_arg(), "../escape"]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("container id \"../escape\" cannot name a gate dir"),
        "{err}"
    );
    assert_eq!(f.runc_argv(), None, "runc must not run");
    assert!(!f.root().join("escape").exists() && !f.root().join("gates").exists());
}

#[test]
fn the_config_the_running_manager_published_wins_over_an_edited_file() {
    let f = Fixture::with_config("env-uuid", "[limits]\npolicy = \"uniform\"\n");
    let file =
        NodeConfig::from_toml(&fs::read_to_string(f.node_config()).unwrap(), &f.node_config()).unwrap();
    // The manager started with policy exact; config.toml was edited to uniform since.
    let mut running = file.clone();
    running.limits.policy = gpu_mps_api::node_config::LimitPolicy::Exact;
    let published = gpu_mps_api::node_config::PublishedConfig::new(running.clone(), &f.node_config(), 4242);
    fs::create_dir_all(f.root()).unwrap();
    fs::write(file.published_path(), serde_json::to_string(&published).unwrap()).unwrap();
    let out = f.create_with_json_log();
    assert!(out.status.success(), "{}", stderr(&out));
    let spec: Value = serde_json::from_str(&fs::read_to_string(f.config_json()).unwrap()).unwrap();
    let args = spec["hooks"]["createRuntime"]
        .as_array()
        .unwrap()
        .iter()
        .find(|h| h["path"] == "/usr/local/bin/gpu-mps-hook" || h["args"][0] == "gpu-mps-hook")
        .unwrap()["args"]
        .clone();
    let args: Vec<&str> = args
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert!(args.contains(&"--policy=exact"), "{args:?}");
    assert!(
        args.contains(&format!("--config-digest={}", running.digest()).as_str()),
        "{args:?}"
    );
    // A published config that does not parse fails the create with one line.
    fs::write(file.published_path(), "{}").unwrap();
    let f2 = f;
    fs::write(f2.config_json(), golden_input("env-uuid")).unwrap();
    let out = f2.create_with_json_log();
    assert!(!out.status.success());
    let e = stderr(&out);
    assert!(e.contains("node-config.json") && e.contains("restart it"), "{e}");
}
