//! `gpu-mps doctor`, the real binary, on a node set up in a temporary directory: no manager
//! running, and (where tests/support/fetch-containerd.sh has fetched it) Debian bookworm's real
//! containerd reading a private config before and after `gpu-mps install-containerd`.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod prerequisite;

const CHECKS: [&str; 10] = [
    "node-config",
    "containerd",
    "runc",
    "host-mps-dir",
    "cdi",
    "compute-mode",
    "nvml",
    "manager",
    "descriptors",
    "mps-binaries",
];
const STATUSES: [&str; 4] = ["PASS", "WARN", "FAIL", "SKIP"];

/// A node in a temporary directory: a node config whose root is there, and paths for
/// containerd's config, the drop-in, the shim and the CDI specs.
struct Node {
    dir: tempfile::TempDir,
}

impl Node {
    fn new() -> Node {
        // The root must fit the socket paths under it (34 bytes): not under a long $TMPDIR.
        let dir = tempfile::Builder::new()
            .prefix("doctor")
            .tempdir_in("/tmp")
            .expect("tempdir");
        let node = Node { dir };
        fs::create_dir(node.root()).expect("root");
        fs::write(
            node.path("config.toml"),
            format!("root = \"{}\"\n", node.root().display()),
        )
        .expect("config");
        let shim = node.path("gpu-mps-shim");
        fs::write(&shim, "#!/bin/sh\nexit 0\n").expect("shim");
        fs::set_permissions(&shim, fs::Permissions::from_mode(0o755)).expect("chmod");
        node
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn root(&self) -> PathBuf {
        self.path("r")
    }

    /// The flags that point doctor and install-containerd at this node's containerd files.
    fn containerd_args(&self, containerd: &Path) -> Vec<String> {
        [
            "--containerd-config",
            &self.path("containerd.toml").display().to_string(),
            "--drop-in",
            &self.path("conf.d/gpu-mps.toml").display().to_string(),
            "--shim",
            &self.path("gpu-mps-shim").display().to_string(),
            "--containerd",
            &containerd.display().to_string(),
        ]
        .map(String::from)
        .to_vec()
    }

    fn gpu_mps(&self, args: &[String]) -> Output {
        Command::new(env!("CARGO_BIN_EXE_gpu-mps"))
            .arg("--config")
            .arg(self.path("config.toml"))
            .args(args)
            .env_remove("GPU_MPS_CONFIG")
            .output()
            .expect("run gpu-mps")
    }

    fn doctor(&self, containerd: &Path, extra: &[&str]) -> Output {
        let mut args = vec![
            "doctor".to_string(),
            "--cdi-dir".into(),
            self.path("cdi").display().to_string(),
        ];
        args.extend(self.containerd_args(containerd));
        // The node's containerd is the one serving this socket (a private one in these tests).
        if !extra.contains(&"--containerd-socket") {
            args.extend([
                "--containerd-socket".into(),
                self.path("containerd.sock").display().to_string(),
            ]);
        }
        args.extend(extra.iter().map(|a| a.to_string()));
        self.gpu_mps(&args)
    }
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The line of `check`, asserting the output is one line per check in order, then the count.
fn line_of(text: &str, check: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        lines.len(),
        CHECKS.len() + 1,
        "one line per check, then the count:\n{text}"
    );
    for (line, name) in lines.iter().zip(CHECKS) {
        let mut words = line.split_whitespace();
        let status = words.next().unwrap_or("");
        assert!(STATUSES.contains(&status), "{line}");
        assert_eq!(words.next(), Some(name), "{text}");
    }
    assert!(lines[CHECKS.len()].starts_with("10 checks: "), "{text}");
    let at = CHECKS.iter().position(|c| *c == check).expect("a check name");
    lines[at].to_string()
}

/// No errno names (ENOENT, ECONNREFUSED), no "os error 2", no "Nix error": words only.
fn assert_plain_words(text: &str) {
    for jargon in ["ENOENT", "ECONNREFUSED", "EACCES", "os error", "Nix error"] {
        assert!(!text.contains(jargon), "{jargon:?} in:\n{text}");
    }
}

#[test]
fn without_a_manager_doctor_fails_with_one_line_per_check() {
    let node = Node::new();
    let out = node.doctor(&node.path("no-containerd"), &[]);
    let text = stdout(&out);
    assert_eq!(
        out.status.code(),
        Some(1),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let manager = line_of(&text, "manager");
    let socket = node.root().join("manager.sock");
    assert_eq!(
        manager,
        format!(
            "FAIL manager        gpu-mps-manager is not running: nothing answers at {} (its socket does not exist). Fix: start it: systemctl start gpu-mps-manager (journalctl -u gpu-mps-manager says why it stopped); on Kubernetes, the manager container of the gpu-mps DaemonSet.",
            socket.display()
        )
    );
    assert!(
        line_of(&text, "descriptors").starts_with("SKIP descriptors    gpu-mps-manager is not running"),
        "{text}"
    );
    assert!(line_of(&text, "node-config").starts_with("PASS"), "{text}");
    assert!(
        line_of(&text, "containerd").starts_with("FAIL containerd"),
        "{text}"
    );
    assert_plain_words(&text);

    // A socket file nobody listens on: a manager that died without removing it.
    drop(std::os::unix::net::UnixListener::bind(&socket).expect("bind"));
    let out = node.doctor(&node.path("no-containerd"), &[]);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(1), "{text}");
    let manager = line_of(&text, "manager");
    assert!(
        manager.starts_with("FAIL manager        gpu-mps-manager is not running")
            && manager.contains("Connection refused"),
        "{manager}"
    );
    assert_plain_words(&text);
}

#[test]
fn doctor_json_lists_every_check() {
    let node = Node::new();
    let out = node.doctor(&node.path("no-containerd"), &["--json"]);
    assert_eq!(out.status.code(), Some(1));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(json["ok"], false);
    let checks = json["checks"].as_array().expect("checks");
    let names: Vec<&str> = checks.iter().filter_map(|c| c["check"].as_str()).collect();
    assert_eq!(names, CHECKS);
    let manager = &checks[CHECKS.iter().position(|c| *c == "manager").expect("manager")];
    assert_eq!(manager["status"], "FAIL");
    assert!(
        manager["fix"]
            .as_str()
            .is_some_and(|f| f.starts_with("start it: systemctl start gpu-mps-manager")),
        "{manager}"
    );
    for c in checks {
        if c["status"] == "FAIL" {
            assert!(
                c["fix"].as_str().is_some_and(|f| !f.is_empty()),
                "a FAIL without a fix: {c}"
            );
        }
    }
}

#[test]
fn an_invalid_node_config_is_a_finding_not_an_abort() {
    let node = Node::new();
    fs::write(node.path("config.toml"), "[limits]\npolcy = \"ceiling\"\n").expect("config");
    let out = node.doctor(&node.path("no-containerd"), &[]);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(1), "{text}");
    let line = line_of(&text, "node-config");
    assert!(
        line.starts_with("FAIL node-config") && line.contains("polcy") && line.contains("built-in defaults"),
        "{line}"
    );
}

fn cache_dir() -> PathBuf {
    match std::env::var_os("GPU_MPS_CACHE") {
        Some(dir) => PathBuf::from(dir),
        None => {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/root".into())).join(".cache/gpu-mps")
        }
    }
}

/// Debian bookworm's containerd (1.6) from tests/support/fetch-containerd.sh's cache; not fetched,
/// test `test` fails (or is skipped, see [`prerequisite::unmet`]).
fn bookworm(test: &str) -> Option<(PathBuf, PathBuf)> {
    let root = cache_dir().join("containerd/bookworm");
    let binary = root.join("usr/bin/containerd");
    if binary.is_file() {
        return Some((root, binary));
    }
    prerequisite::unmet(
        test,
        &format!(
            "{} is missing: run tests/support/fetch-containerd.sh (it fetches containerd into {})",
            binary.display(),
            cache_dir().display()
        ),
    );
    None
}

#[test]
fn the_registration_check_fails_before_install_containerd_and_passes_after() {
    let Some((suite, containerd)) =
        bookworm("the_registration_check_fails_before_install_containerd_and_passes_after")
    else {
        return;
    };
    let node = Node::new();
    let shipped = fs::read_to_string(suite.join("etc/containerd/config.toml")).expect("Debian's config.toml");
    fs::write(node.path("containerd.toml"), &shipped).expect("main config");

    let out = node.doctor(&containerd, &[]);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(1), "{text}");
    let line = line_of(&text, "containerd");
    let install = format!(
        "gpu-mps install-containerd --containerd-config {} --shim {}",
        node.path("containerd.toml").display(),
        node.path("gpu-mps-shim").display()
    );
    assert!(
        line.starts_with("FAIL containerd")
            && line.contains("runtime \"gpu-mps\" is missing")
            && line.contains(&install),
        "{line}"
    );

    let mut args = vec!["install-containerd".to_string()];
    args.extend(node.containerd_args(&containerd));
    let out = node.gpu_mps(&args);
    assert!(
        out.status.success(),
        "install-containerd: {}{}",
        stdout(&out),
        String::from_utf8_lossy(&out.stderr)
    );

    let out = node.doctor(&containerd, &[]);
    let text = stdout(&out);
    let line = line_of(&text, "containerd");
    assert_eq!(
        line,
        format!(
            "PASS containerd     containerd 1.6 reads runtime \"gpu-mps\" from {} with BinaryName {} (containerd is not running: it reads this when it starts).",
            node.path("containerd.toml").display(),
            node.path("gpu-mps-shim").display()
        )
    );
    // The shim the entry names must exist.
    fs::remove_file(node.path("gpu-mps-shim")).expect("rm shim");
    let line = line_of(&stdout(&node.doctor(&containerd, &[])), "containerd");
    assert!(
        line.starts_with("FAIL containerd") && line.contains("gpu-mps-shim does not exist"),
        "{line}"
    );
}

/// A containerd started on the node's private config, killed when dropped.
struct RunningContainerd(std::process::Child);

impl Drop for RunningContainerd {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_containerd_that_started_before_the_registration_needs_a_restart() {
    const TEST: &str = "a_containerd_that_started_before_the_registration_needs_a_restart";
    let Some((suite, containerd)) = bookworm(TEST) else {
        return;
    };
    if !prerequisite::is_root() {
        prerequisite::unmet(TEST, "starting containerd needs root: run the tests as root");
        return;
    }
    let node = Node::new();
    let shipped = fs::read_to_string(suite.join("etc/containerd/config.toml")).expect("Debian's config.toml");
    fs::write(node.path("containerd.toml"), &shipped).expect("main config");
    let mut args = vec!["install-containerd".to_string()];
    args.extend(node.containerd_args(&containerd));
    assert!(node.gpu_mps(&args).status.success());

    let socket = node.path("containerd.sock");
    let log = fs::File::create(node.path("containerd.log")).expect("log");
    let child = Command::new(&containerd)
        .arg("--config")
        .arg(node.path("containerd.toml"))
        .arg("--root")
        .arg(node.path("containerd-root"))
        .arg("--state")
        .arg(node.path("containerd-state"))
        .arg("--address")
        .arg(&socket)
        .stdout(log.try_clone().expect("log"))
        .stderr(log)
        .spawn()
        .expect("start containerd");
    let pid = child.id();
    let _running = RunningContainerd(child);
    let started = std::time::Instant::now();
    // Bound is not yet listening: wait until a connect is accepted, as doctor's is.
    while std::os::unix::net::UnixStream::connect(&socket).is_err() {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(20),
            "containerd did not serve: {}",
            fs::read_to_string(node.path("containerd.log")).unwrap_or_default()
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let line = line_of(&stdout(&node.doctor(&containerd, &[])), "containerd");
    assert!(
        line.starts_with("PASS containerd")
            && line.contains(&format!(
                "(running as pid {pid}, started after its config last changed; it serves {} with --config {})",
                socket.display(),
                node.path("containerd.toml").display()
            )),
        "{line}"
    );
    // A containerd that reads the same config but serves another socket is not the node's: with
    // the node's socket unserved, doctor says none runs and names no pid.
    let unserved = node.path("node-containerd.sock");
    let unserved_arg = unserved.to_str().expect("utf-8 path");
    let line = line_of(
        &stdout(&node.doctor(&containerd, &["--containerd-socket", unserved_arg])),
        "containerd",
    );
    assert!(
        line.starts_with("PASS containerd")
            && line.contains("(containerd is not running: it reads this when it starts)")
            && !line.contains(&pid.to_string()),
        "{line}"
    );

    // An edit after containerd started: it runs without it until it restarts.
    let later = std::time::SystemTime::now() + std::time::Duration::from_secs(10);
    fs::File::options()
        .append(true)
        .open(node.path("containerd.toml"))
        .and_then(|f| f.set_modified(later))
        .expect("touch");
    let line = line_of(&stdout(&node.doctor(&containerd, &[])), "containerd");
    assert!(
        line.starts_with("WARN containerd     containerd has not loaded the gpu-mps handler yet: ")
            && line.contains(&format!(
                "the running containerd (pid {pid}, serving {}) started before {} last changed",
                socket.display(),
                node.path("containerd.toml").display()
            ))
            && line.ends_with(
                "Fix: restart containerd: systemctl restart containerd (running containers keep running)."
            ),
        "{line}"
    );
}
