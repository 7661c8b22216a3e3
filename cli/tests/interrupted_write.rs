//! `gpu-mps install-containerd` stopped in the middle of writing containerd's main config: the
//! file size limit (RLIMIT_FSIZE, set by the shell's `ulimit -f`) lets the new text be written
//! only partly. With SIGXFSZ ignored the write fails with EFBIG and install must put every file
//! back; with SIGXFSZ at its default the kernel kills the process mid-write, like a crash or a
//! power cut would. Either way containerd's config must still be the old one, byte for byte.
//!
//! Root gets no exemption from the limit, so this holds where the tests run as root too (CI).

use std::fs;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use gpu_mps_cli::containerd_registration::{ExistingFiles, FileChange, InstallOptions, plan_install};

/// A version 3 config as containerd 2.x's packages ship it, with the runc entry to copy.
const MAIN: &str = "version = 3\nroot = '/var/lib/containerd'\n\n\
[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]\n  runtime_type = 'io.containerd.runc.v2'\n  \
[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]\n    SystemdCgroup = true\n";

/// The bytes one unit of `ulimit -f` stands for in this shell (512 in POSIX shells, 1024 in a
/// bash that is not in POSIX mode).
fn ulimit_unit() -> u64 {
    let out = Command::new("sh")
        .args(["-c", "ulimit -f 1 && exec cat /proc/self/limits"])
        .output()
        .expect("sh");
    let limits = String::from_utf8_lossy(&out.stdout);
    limits
        .lines()
        .find(|l| l.starts_with("Max file size"))
        .and_then(|l| l.split_whitespace().nth(3))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no file size limit in /proc/self/limits:\n{limits}"))
}

struct Node {
    dir: tempfile::TempDir,
    /// Outside `dir`, so that `dir` holds only what install writes.
    tools: tempfile::TempDir,
    original: String,
    /// The `ulimit -f` value: the drop-in and the backup fit under it, the new main config not.
    limit_units: u64,
}

impl Node {
    fn main(&self) -> PathBuf {
        self.dir.path().join("config.toml")
    }

    fn options(&self) -> InstallOptions {
        InstallOptions {
            main_config: self.main(),
            drop_in: self.dir.path().join("conf.d/gpu-mps.toml"),
            containerd_major: Some(2),
            ..InstallOptions::default()
        }
    }

    /// A main config padded so that the limit falls inside the new text of it.
    fn new() -> Node {
        let dir = tempfile::tempdir().expect("tempdir");
        let tools = tempfile::tempdir().expect("tempdir");
        let unit = ulimit_unit();
        let mut node = Node {
            dir,
            tools,
            original: MAIN.to_owned(),
            limit_units: 0,
        };
        fs::write(node.main(), MAIN).expect("main");
        let plan = plan_install(
            &ExistingFiles::read(&node.options()).expect("read"),
            &node.options(),
        )
        .expect("plan");
        let size = |path: &Path| {
            plan.changes
                .iter()
                .find_map(|c| match c {
                    FileChange::Write {
                        path: p, contents, ..
                    } if p == path => Some(contents.len() as u64),
                    _ => None,
                })
                .unwrap_or_else(|| panic!("{} not written by {plan:#?}", path.display()))
        };
        let drop_in = size(&node.options().drop_in);
        let added = size(&node.main()) - MAIN.len() as u64;
        assert!(added > 10, "install adds {added} bytes to the main config");
        let limit = (drop_in.max(MAIN.len() as u64) / unit + 1) * unit;
        // A comment brings the main config to 10 bytes under the limit: its backup fits, its new
        // text does not.
        let pad = (limit - 10 - MAIN.len() as u64 - 3) as usize;
        node.original = format!("{MAIN}# {}\n", "x".repeat(pad));
        assert_eq!(node.original.len() as u64, limit - 10);
        fs::write(node.main(), &node.original).expect("main");
        node.limit_units = limit / unit;

        // Says it is containerd 2.1.9; install stops before it would ask for `config dump`.
        let containerd = node.tools.path().join("containerd");
        fs::write(
            &containerd,
            "#!/bin/sh\necho 'containerd github.com/containerd/containerd/v2 2.1.9+fake'\n",
        )
        .expect("fake containerd");
        fs::set_permissions(&containerd, std::os::unix::fs::PermissionsExt::from_mode(0o755)).expect("chmod");
        node
    }

    /// `gpu-mps install-containerd` under the file size limit; `ignore_sigxfsz` chooses between
    /// a failed write and a killed process.
    fn install_under_limit(&self, ignore_sigxfsz: bool) -> Output {
        let trap = if ignore_sigxfsz { "trap '' XFSZ; " } else { "" };
        let script = format!("{trap}ulimit -f {} && exec \"$@\"", self.limit_units);
        let opts = self.options();
        Command::new("sh")
            .args([
                "-c",
                &script,
                "sh",
                env!("CARGO_BIN_EXE_gpu-mps"),
                "install-containerd",
            ])
            .arg("--containerd-config")
            .arg(&opts.main_config)
            .arg("--drop-in")
            .arg(&opts.drop_in)
            .arg("--containerd")
            .arg(self.tools.path().join("containerd"))
            .output()
            .expect("run gpu-mps")
    }

    /// Every entry of the config directory, hidden ones and those in subdirectories included.
    fn files(&self) -> Vec<String> {
        let mut out = Vec::new();
        let mut dirs = vec![self.dir.path().to_path_buf()];
        while let Some(dir) = dirs.pop() {
            for entry in fs::read_dir(&dir).expect("read_dir").flatten() {
                let path = entry.path();
                let name = path
                    .strip_prefix(self.dir.path())
                    .expect("under dir")
                    .display()
                    .to_string();
                if path.is_dir() {
                    dirs.push(path);
                    out.push(format!("{name}/"));
                } else {
                    out.push(name);
                }
            }
        }
        out.sort();
        out
    }
}

#[test]
fn a_write_that_fails_midway_leaves_every_file_as_it_was() {
    let node = Node::new();
    let out = node.install_under_limit(true);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "install succeeded under the limit: {stderr}"
    );
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("config.toml: write: File too large") && stderr.contains("every file was put back"),
        "{stderr}"
    );
    assert_eq!(
        fs::read_to_string(node.main()).expect("main"),
        node.original,
        "the main config changed"
    );
    // No temp file, no backup, and neither the drop-in written before nor its conf.d.
    assert_eq!(node.files(), ["config.toml"]);
}

#[test]
fn a_process_killed_midway_leaves_the_main_config_as_it_was() {
    let node = Node::new();
    let out = node.install_under_limit(false);
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGXFSZ),
        "{:?}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        fs::read_to_string(node.main()).expect("main"),
        node.original,
        "the main config changed"
    );
    // What a killed install leaves besides it: the drop-in (written first and named by no import
    // yet), the backup, and the cut-off temp file. None of them is the main config's name, so
    // containerd starts on the old config; the next install rewrites the drop-in and the main
    // config.
    let files = node.files();
    let temp = left_temp_file(&files);
    let backups: Vec<_> = files
        .iter()
        .filter(|f| f.starts_with("config.toml.gpu-mps-backup."))
        .collect();
    assert_eq!(backups.len(), 1, "{files:?}");
    let mut expected = vec![
        "conf.d/".to_owned(),
        "conf.d/gpu-mps.toml".to_owned(),
        "config.toml".to_owned(),
        backups[0].clone(),
        temp.clone(),
    ];
    expected.sort();
    assert_eq!(files, expected);
    let written = fs::metadata(node.dir.path().join(&temp))
        .expect("temp file")
        .len();
    assert_eq!(
        written,
        node.limit_units * ulimit_unit(),
        "the temp file holds what fit"
    );
}

/// The temp file a killed install left: `.config.toml.gpu-mps.<its pid>.tmp`.
fn left_temp_file(files: &[String]) -> String {
    let temps: Vec<&String> = files
        .iter()
        .filter(|f| f.starts_with(".config.toml.gpu-mps.") && f.ends_with(".tmp"))
        .collect();
    assert_eq!(temps.len(), 1, "{files:?}");
    temps[0].clone()
}
