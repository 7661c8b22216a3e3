//! `gpu-mps install-containerd --containerd-config <a private file>`, as a test or a second
//! containerd uses it: the drop-in goes next to that file (never to /etc/containerd/conf.d), the
//! restart it suggests is not the system containerd's, and uninstall leaves nothing of a config
//! it created. Runs the binary against containerd 2.x of Debian sid from
//! tests/support/fetch-containerd.sh (`$GPU_MPS_CACHE`, default ~/.cache/gpu-mps).

use std::path::{Path, PathBuf};
use std::process::Command;

fn sid_containerd() -> PathBuf {
    let cache = std::env::var_os("GPU_MPS_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/root".into())).join(".cache/gpu-mps")
        });
    let binary = cache.join("containerd/sid/usr/bin/containerd");
    assert!(
        binary.is_file(),
        "{} is missing: run tests/support/fetch-containerd.sh",
        binary.display()
    );
    binary
}

/// `gpu-mps --config <dir>/node.toml <args>`: stdout, and stderr on failure.
fn gpu_mps(dir: &Path, args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_gpu-mps"))
        .arg("--config")
        .arg(dir.join("node.toml"))
        .args(args)
        .output()
        .expect("run gpu-mps");
    assert!(
        out.status.success(),
        "gpu-mps {args:?}: {}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn a_private_config_gets_its_drop_in_next_to_it_and_uninstall_leaves_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let main = dir.path().join("config.toml");
    let main_arg = main.to_str().expect("utf-8 path");
    // A private config must exist (a path that does not is refused: missing_paths below).
    std::fs::write(&main, "version = 3\n").expect("write the private config");
    let containerd = sid_containerd();
    let containerd_arg = containerd.to_str().expect("utf-8 path");
    let drop_in = dir.path().join("conf.d/gpu-mps.toml");
    let args = [
        "install-containerd",
        "--containerd-config",
        main_arg,
        "--containerd",
        containerd_arg,
    ];

    let dry = gpu_mps(dir.path(), &[&args[..], &["--dry-run"]].concat());
    assert!(dry.contains(&format!("+++ {}", drop_in.display())), "{dry}");
    assert!(!dry.contains("/etc/containerd/conf.d"), "{dry}");

    let out = gpu_mps(dir.path(), &args);
    assert!(drop_in.is_file(), "{out}");
    let text = std::fs::read_to_string(&main).expect("main config");
    assert!(
        text.contains(&format!("imports = [\"{}\"]", drop_in.display())),
        "{text}"
    );
    assert!(!out.contains("systemctl restart containerd"), "{out}");
    assert!(
        out.contains(&format!("containerd reads {main_arg} only at its start")),
        "{out}"
    );

    let out = gpu_mps(
        dir.path(),
        &[
            "uninstall-containerd",
            "--containerd-config",
            main_arg,
            "--containerd",
            containerd_arg,
        ],
    );
    assert!(!out.contains("systemctl restart containerd"), "{out}");
    assert_eq!(
        std::fs::read_to_string(&main).expect("main config"),
        "version = 3\n",
        "uninstall puts the private config back as it was"
    );
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .expect("ls")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| name != "config.toml" && !name.starts_with("config.toml.gpu-mps-backup."))
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// `gpu-mps <args>`: its exit status, stdout and stderr.
fn gpu_mps_status(dir: &Path, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_gpu-mps"))
        .arg("--config")
        .arg(dir.join("node.toml"))
        .args(args)
        .output()
        .expect("run gpu-mps");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn missing_paths_are_refused_and_nothing_is_created() {
    let dir = tempfile::tempdir().expect("tempdir");
    let containerd = sid_containerd();
    let containerd_arg = containerd.to_str().expect("utf-8 path");
    // A typo of the file name, and a path whose directories do not exist.
    for main in [
        dir.path().join("config.tml"),
        dir.path().join("no/such/dir/config.toml"),
    ] {
        let main_arg = main.to_str().expect("utf-8 path");
        for command in ["install-containerd", "uninstall-containerd"] {
            let (ok, stdout, stderr) = gpu_mps_status(
                dir.path(),
                &[
                    command,
                    "--containerd-config",
                    main_arg,
                    "--containerd",
                    containerd_arg,
                ],
            );
            assert!(!ok, "{command} {main_arg} must fail: {stdout}{stderr}");
            assert!(
                stderr.contains(&format!("{main_arg}: no such containerd config")),
                "{command}: {stderr}"
            );
            assert!(!stdout.contains("already clean"), "{command}: {stdout}");
        }
    }
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .expect("ls")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert!(left.is_empty(), "created: {left:?}");
}
