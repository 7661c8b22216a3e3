//! `gpu-mps install-containerd` against the real containerd of Debian bookworm (1.6), trixie (1.7)
//! and sid (2.1): register into a temporary config, then ask that containerd what it makes of it
//! with `containerd --config <file> config dump`. The binaries come from
//! tests/support/fetch-containerd.sh (a private cache; nothing is installed system-wide).
//!
//! Also pins down the containerd behaviour the registration design rests on
//! (docs/adr/0002-containerd-registration.md): 1.x replaces whole plugin tables on import,
//! 2.x merges them key by key.

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use gpu_mps_cli::containerd_registration::{self as reg, InstallOptions, Placement, RUNC_SHIM, SHIM_PATH};
use toml_edit::{DocumentMut, Item, Value};

mod prerequisite;

/// Debian suite and the major version of its containerd: 1.6 in bookworm, 1.7 in trixie, 2.x in sid
/// (2.1.9 when this was written; sid moves).
const SUITES: [(&str, u32); 3] = [("bookworm", 1), ("trixie", 1), ("sid", 2)];

fn cache_dir() -> PathBuf {
    match std::env::var_os("GPU_MPS_CACHE") {
        Some(dir) => PathBuf::from(dir),
        None => {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/root".into())).join(".cache/gpu-mps")
        }
    }
}

/// The suite's extracted packages, or a failure that says how to get them.
fn suite_root(suite: &str) -> PathBuf {
    let root = cache_dir().join("containerd").join(suite);
    let binary = root.join("usr/bin/containerd");
    assert!(
        binary.is_file(),
        "{} is missing: run tests/support/fetch-containerd.sh to fetch containerd of Debian bookworm, trixie and sid into {} (nothing is installed system-wide)",
        binary.display(),
        cache_dir().display()
    );
    root
}

fn containerd(suite: &str) -> PathBuf {
    suite_root(suite).join("usr/bin/containerd")
}

fn run(binary: &Path, args: &[&str]) -> String {
    let out = Command::new(binary)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", binary.display()));
    assert!(
        out.status.success(),
        "{} {args:?}: {}: {}",
        binary.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn dump(binary: &Path, config: &Path) -> DocumentMut {
    let text = run(
        binary,
        &["--config", &config.display().to_string(), "config", "dump"],
    );
    text.parse()
        .unwrap_or_else(|e| panic!("config dump is not TOML: {e}\n{text}"))
}

/// The CRI runtimes table of a dump, in either layout.
fn cri_runtimes(doc: &DocumentMut) -> &dyn toml_edit::TableLike {
    for plugin in ["io.containerd.cri.v1.runtime", "io.containerd.grpc.v1.cri"] {
        if let Some(r) = doc
            .get("plugins")
            .and_then(|p| p.get(plugin))
            .and_then(|p| p.get("containerd"))
            .and_then(|c| c.get("runtimes"))
            .and_then(Item::as_table_like)
        {
            return r;
        }
    }
    panic!("no CRI runtimes in the dump:\n{doc}")
}

fn strings(item: Option<&Item>) -> Vec<String> {
    item.and_then(Item::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).map(str::to_owned).collect())
        .unwrap_or_default()
}

/// One starting point of a node: the main config before gpu-mps, if any.
struct Case {
    name: &'static str,
    main: Option<String>,
    /// SystemdCgroup of the runc entry, which the gpu-mps entry must carry too.
    systemd_cgroup: bool,
}

fn cases(suite: &str) -> Vec<Case> {
    let root = suite_root(suite);
    let shipped = fs::read_to_string(root.join("etc/containerd/config.toml")).expect("Debian's config.toml");
    // kubeadm's advice: start from `config default` and turn on the systemd cgroup driver.
    let default = run(&containerd(suite), &["config", "default"]);
    let systemd = default.replace("SystemdCgroup = false", "SystemdCgroup = true");
    assert_ne!(
        default, systemd,
        "{suite}: `config default` has no SystemdCgroup = false line"
    );
    vec![
        Case {
            name: "Debian's config.toml",
            main: Some(shipped),
            systemd_cgroup: false,
        },
        Case {
            name: "config default + SystemdCgroup",
            main: Some(systemd),
            systemd_cgroup: true,
        },
        Case {
            name: "no config.toml",
            main: None,
            systemd_cgroup: false,
        },
    ]
}

#[test]
fn install_and_uninstall_on_each_containerd() {
    for (suite, major) in SUITES {
        let binary = containerd(suite);
        let version =
            reg::containerd_version(&InstallOptions::default(), &binary).expect("containerd --version");
        assert_eq!(version.0, major, "{suite}: containerd {version:?}");
        let (major, minor) = version;
        for case in cases(suite) {
            let what = format!("{suite} (containerd {major}.{minor}), {}", case.name);
            let dir = tempfile::tempdir().expect("tempdir");
            let main = dir.path().join("config.toml");
            let drop_in = dir.path().join("conf.d/gpu-mps.toml");
            if let Some(text) = &case.main {
                fs::write(&main, text).expect("write config");
            }
            let opts = InstallOptions {
                main_config: main.clone(),
                drop_in: drop_in.clone(),
                ..InstallOptions::default()
            };

            if case.main.is_none() {
                // An explicit --containerd-config that does not exist is a typo until shown
                // otherwise: refused, nothing created (only containerd's default path is
                // created when absent; unit-tested in containerd_registration).
                let refused = reg::install(&opts, Some(&binary), false)
                    .expect_err(&format!("{what}: a missing explicit config was accepted"));
                assert!(
                    refused.to_string().contains("no such containerd config"),
                    "{what}: {refused}"
                );
                assert!(
                    !main.exists() && !drop_in.exists(),
                    "{what}: something was created"
                );
                continue;
            }
            let outcome = reg::install(&opts, Some(&binary), false).unwrap_or_else(|e| panic!("{what}: {e}"));
            assert!(outcome.verified, "{what}: not verified");
            assert!(outcome.warnings.is_empty(), "{what}: {:?}", outcome.warnings);
            let placement = if major >= 2 {
                Placement::DropIn
            } else {
                Placement::MainConfig
            };
            assert_eq!(outcome.plan.placement, Some(placement), "{what}");
            assert_eq!(drop_in.exists(), placement == Placement::DropIn, "{what}");

            let doc = dump(&binary, &main);
            let runtimes = cri_runtimes(&doc);
            let entry = runtimes
                .get("gpu-mps")
                .and_then(Item::as_table_like)
                .unwrap_or_else(|| panic!("{what}: no gpu-mps runtime:\n{doc}"));
            assert_eq!(
                entry.get("runtime_type").and_then(Item::as_str),
                Some(RUNC_SHIM),
                "{what}"
            );
            let options = entry
                .get("options")
                .and_then(Item::as_table_like)
                .expect("options");
            assert_eq!(
                options.get("BinaryName").and_then(Item::as_str),
                Some(SHIM_PATH),
                "{what}"
            );
            // containerd 1.x prints runc options as written; an absent SystemdCgroup is false.
            let systemd_cgroup = options
                .get("SystemdCgroup")
                .and_then(Item::as_bool)
                .unwrap_or(false);
            assert_eq!(systemd_cgroup, case.systemd_cgroup, "{what}");
            for key in ["pod_annotations", "container_annotations"] {
                assert_eq!(
                    strings(entry.get(key)),
                    reg::annotation_patterns(key),
                    "{what}: {key}"
                );
            }
            // The CRI plugin only loads when its default runtime has an entry.
            assert!(runtimes.contains_key("runc"), "{what}: runc is gone:\n{doc}");
            if case.name.starts_with("Debian") {
                // The shipped CNI dir survives: the CRI plugin table was not replaced.
                assert!(
                    doc.to_string().contains("/usr/lib/cni"),
                    "{what}: CNI bin dir lost:\n{doc}"
                );
            }
            eprintln!(
                "{what}: {:?} in {}; dump: gpu-mps runtime_type = {RUNC_SHIM:?}, BinaryName = {SHIM_PATH:?}, SystemdCgroup = {}, annotations = {:?} / {:?}",
                placement,
                if placement == Placement::DropIn {
                    "the drop-in"
                } else {
                    "config.toml"
                },
                case.systemd_cgroup,
                reg::POD_ANNOTATION_PATTERNS,
                reg::CONTAINER_ANNOTATION_PATTERNS
            );

            let again =
                reg::install(&opts, Some(&binary), false).unwrap_or_else(|e| panic!("{what}: again: {e}"));
            assert!(
                again.plan.is_empty(),
                "{what}: second install changed:\n{}",
                again.plan.diff()
            );
            assert!(again.backups.is_empty(), "{what}: second install made a backup");

            let removed = reg::uninstall(&opts, Some(&binary), false)
                .unwrap_or_else(|e| panic!("{what}: uninstall: {e}"));
            if case.main.is_none() {
                // A config install created goes whole: no stub is left, and containerd runs on
                // its defaults as before (1.x's `config dump` cannot read a missing file).
                assert!(
                    !main.exists(),
                    "{what}: the config install created is left behind"
                );
                assert!(
                    !drop_in.parent().expect("conf.d").exists(),
                    "{what}: the conf.d install created is left behind"
                );
            } else {
                assert!(removed.verified, "{what}: uninstall not verified");
                let doc = dump(&binary, &main);
                assert!(
                    !cri_runtimes(&doc).contains_key("gpu-mps"),
                    "{what}: gpu-mps still there after uninstall"
                );
            }
            assert!(!drop_in.exists(), "{what}: drop-in left behind");
            if let Some(original) = &case.main {
                assert_eq!(
                    &fs::read_to_string(&main).expect("config"),
                    original,
                    "{what}: uninstall did not restore the file"
                );
            }
            let again = reg::uninstall(&opts, Some(&binary), false)
                .unwrap_or_else(|e| panic!("{what}: uninstall again: {e}"));
            assert!(
                again.plan.is_empty(),
                "{what}: second uninstall changed:\n{}",
                again.plan.diff()
            );
        }
    }
}

/// A config containerd cannot read once gpu-mps' entry is in (here: an import it cannot parse,
/// which gpu-mps does not read) makes install and uninstall fail with containerd's reason and
/// leaves every file as it was, byte for byte, with no backup or drop-in left behind.
#[test]
fn a_config_containerd_cannot_read_is_left_as_it_was() {
    for (suite, _) in SUITES {
        let binary = containerd(suite);
        let dir = tempfile::tempdir().expect("tempdir");
        let main = dir.path().join("config.toml");
        let drop_in = dir.path().join("conf.d/gpu-mps.toml");
        let broken = dir.path().join("broken.toml");
        fs::write(&broken, "this is = = not toml\n").expect("broken");
        let main_text = format!(
            "version = 2\nimports = [{:?}]\n\n# kept byte for byte\n[plugins.\"io.containerd.grpc.v1.cri\"]\n  sandbox_image = \"example.invalid/pause:1\"\n",
            broken.display().to_string()
        );
        fs::write(&main, &main_text).expect("main");
        let listing = || {
            let mut names: Vec<String> = walk(dir.path());
            names.sort();
            names
        };
        let before = listing();
        let opts = InstallOptions {
            main_config: main.clone(),
            drop_in: drop_in.clone(),
            ..InstallOptions::default()
        };
        let err = reg::install(&opts, Some(&binary), false).expect_err("containerd cannot read it");
        let message = err.to_string();
        assert!(message.contains("put back as it was"), "{suite}: {message}");
        assert_eq!(fs::read_to_string(&main).expect("main"), main_text, "{suite}");
        assert_eq!(listing(), before, "{suite}: {message}");
        println!("{suite}: install refused: {message}");
    }
}

/// Every file and directory under `dir`, as a path relative to it (directories end in `/`).
fn walk(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    for entry in fs::read_dir(dir).expect("read_dir").flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.push(format!("{}/", entry.file_name().to_string_lossy()));
            out.extend(
                walk(&path)
                    .into_iter()
                    .map(|p| format!("{}/{p}", entry.file_name().to_string_lossy())),
            );
        } else {
            out.push(entry.file_name().to_string_lossy().into_owned());
        }
    }
    out
}

/// What the design rests on: containerd 1.x replaces a whole plugin table with the one of an
/// imported file; containerd 2.x merges key by key. If this changes, revisit the ADR.
#[test]
fn how_each_containerd_merges_an_imported_drop_in() {
    for (suite, major) in SUITES {
        let dir = tempfile::tempdir().expect("tempdir");
        let main = dir.path().join("config.toml");
        let drop_in = dir.path().join("extra.toml");
        fs::write(
            &main,
            format!(
                "version = 2\nimports = [{:?}]\n[plugins.\"io.containerd.grpc.v1.cri\"]\n  sandbox_image = \"example.invalid/pause:1\"\n",
                drop_in.display().to_string()
            ),
        )
        .expect("main");
        fs::write(
            &drop_in,
            "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.other]\n  runtime_type = \"io.containerd.runc.v2\"\n",
        )
        .expect("drop-in");
        let text = dump(&containerd(suite), &main).to_string();
        let kept = text.contains("example.invalid/pause:1");
        let runc = text.contains("runtimes.runc]");
        if major >= 2 {
            assert!(
                kept && runc,
                "{suite}: 2.x should merge the drop-in into the main config's CRI table:\n{text}"
            );
        } else {
            assert!(
                !kept && !runc,
                "{suite}: 1.x used to replace the CRI table on import; it no longer does:\n{text}"
            );
        }
        // containerd 1.x refuses a missing plain import; a glob that matches nothing is fine.
        fs::remove_file(&drop_in).expect("rm");
        let out = Command::new(containerd(suite))
            .args(["--config", &main.display().to_string(), "config", "dump"])
            .output()
            .expect("run");
        let failed = String::from_utf8_lossy(&out.stderr).contains("failed to load TOML");
        assert_eq!(
            failed,
            major < 2,
            "{suite}: missing import: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// Starts each containerd on the registered config (private root, state and socket) and checks
/// that its CRI plugin loads: `config dump` does not run the CRI plugin's own validation.
#[test]
fn cri_plugin_loads_with_the_runtime_registered() {
    if !prerequisite::is_root() {
        prerequisite::unmet(
            "cri_plugin_loads_with_the_runtime_registered",
            "starting containerd needs root: run the tests as root",
        );
        return;
    }
    for (suite, major) in SUITES {
        let root = suite_root(suite);
        let dir = tempfile::tempdir().expect("tempdir");
        let d = dir.path();
        let socket = d.join("c.sock");
        // Debian's file, moved off the host's paths (root, state, socket, opt and CNI conf dirs);
        // NRI off so no socket outside the temp dir.
        let shipped = fs::read_to_string(root.join("etc/containerd/config.toml")).expect("config");
        let private = format!(
            "root = {:?}\nstate = {:?}\ndisabled_plugins = [\"io.containerd.nri.v1.nri\"]\n[grpc]\n  address = {:?}\n",
            d.join("root").display().to_string(),
            d.join("state").display().to_string(),
            socket.display().to_string()
        );
        let main = d.join("config.toml");
        let text = shipped
            .replacen("version = 2\n", &format!("version = 2\n{private}"), 1)
            .replace("/var/lib/containerd/opt", &d.join("opt").display().to_string())
            // The CRI plugin creates its CNI conf dir.
            .replace("/etc/cni/net.d", &d.join("cni").display().to_string());
        fs::write(&main, &text).expect("write");
        let opts = InstallOptions {
            main_config: main.clone(),
            drop_in: d.join("conf.d/gpu-mps.toml"),
            ..InstallOptions::default()
        };
        reg::install(&opts, Some(&containerd(suite)), false).unwrap_or_else(|e| panic!("{suite}: {e}"));

        let log = fs::File::create(d.join("containerd.log")).expect("log");
        let mut child = Command::new(containerd(suite))
            .args(["--config", &main.display().to_string()])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start containerd");
        let ctr = root.join("usr/bin/ctr");
        let deadline = Instant::now() + Duration::from_secs(30);
        let plugins = loop {
            let out = Command::new(&ctr)
                .args(["--address", &socket.display().to_string(), "plugins", "ls"])
                .output()
                .expect("ctr");
            if out.status.success() {
                break String::from_utf8_lossy(&out.stdout).into_owned();
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "{suite}: containerd did not come up: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            sleep(Duration::from_millis(200));
        };
        let _ = child.kill();
        let _ = child.wait();
        let mut log = String::new();
        let _ = fs::File::open(d.join("containerd.log")).and_then(|mut f| f.read_to_string(&mut log));
        let wanted: &[(&str, &str)] = if major >= 2 {
            &[
                ("io.containerd.grpc.v1", "cri"),
                ("io.containerd.cri.v1", "runtime"),
            ]
        } else {
            &[("io.containerd.grpc.v1", "cri")]
        };
        for (kind, id) in wanted {
            let line = plugins
                .lines()
                .find(|l| {
                    let f: Vec<_> = l.split_whitespace().collect();
                    f.first() == Some(kind) && f.get(1) == Some(id)
                })
                .unwrap_or_else(|| panic!("{suite}: no plugin {kind} {id}:\n{plugins}"));
            let cri_errors: Vec<_> = log
                .lines()
                .filter(|l| l.contains("level=error") || l.contains("failed to load plugin"))
                .collect();
            assert_eq!(
                line.split_whitespace().last(),
                Some("ok"),
                "{suite}: {line}\n{}",
                cri_errors.join("\n")
            );
        }
        eprintln!("{suite}: containerd started on the registered config; CRI plugin status ok");
    }
}

/// install adds no `imports` entry where one already loads the drop-in: that judgement must be
/// containerd's own. Each import is asked of containerd 2.x (the one whose drop-in is imported)
/// through `config dump`, and of the planner, with the drop-in at `<dir>/a/conf.d/gpu-mps.toml`.
#[test]
fn an_import_covers_the_drop_in_exactly_when_containerd_loads_it_through_it() {
    let (suite, _) = SUITES[2];
    let binary = containerd(suite);
    let imports = [
        "{a}/conf.d/*.toml",
        "conf.d/*.toml",
        "./conf.d/*.toml",
        "x/../conf.d/*.toml",
        "conf.d//*.toml",
        "{a}/*.toml",
        "{a}/conf.d/*",
        "{a}/conf.?/*.toml",
        // No `*`: a file of that very name, not a glob.
        "{a}/conf.?/gpu-mps.toml",
        "{a}/conf.d/gpu-mps.t?ml",
        "{a}/conf.d/gpu-mps.toml",
        "./conf.d/gpu-mps.toml",
        "{a}/conf.d/[a-h]*.toml",
        "{a}/conf.d/[^g]*.toml",
        "{a}/conf.d/[!g]*.toml",
        "{a}/conf.d/[!x]*.toml",
        "{a}/conf.d/\\\\*.toml",
        "{a}/**/gpu-mps.toml",
        "{dir}/**/gpu-mps.toml",
        "{a}/conf.d/{gpu-mps,x}*",
        "{a}/conf.d/*.TOML",
    ];
    for import in imports {
        let dir = tempfile::tempdir().expect("tempdir");
        let a = dir.path().join("a");
        let import = import
            .replace("{a}", &a.display().to_string())
            .replace("{dir}", &dir.path().display().to_string());
        let main = a.join("config.toml");
        let drop_in = a.join("conf.d/gpu-mps.toml");
        fs::create_dir_all(drop_in.parent().expect("conf.d")).expect("mkdir");
        fs::write(
            &drop_in,
            "version = 3\n[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.gpu-mps]\n  runtime_type = 'io.containerd.runc.v2'\n",
        )
        .expect("drop-in");
        fs::write(&main, format!("version = 3\nimports = [\"{import}\"]\n")).expect("main");
        let loaded = cri_runtimes(&dump(&binary, &main)).contains_key("gpu-mps");
        let opts = InstallOptions {
            main_config: main.clone(),
            drop_in: drop_in.clone(),
            containerd_major: Some(2),
            ..InstallOptions::default()
        };
        let plan = reg::plan_install(&reg::ExistingFiles::read(&opts).expect("read"), &opts).expect("plan");
        let covered = !plan.changes.iter().any(|c| c.path() == main);
        assert_eq!(
            covered, loaded,
            "{suite}: imports = [\"{import}\"]: containerd loads the drop-in: {loaded}; gpu-mps thinks it does: {covered}"
        );
    }
}
