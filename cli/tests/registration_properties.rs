//! Properties of the containerd registration over generated configs (version 2 and 3 layouts,
//! nested or flat headers, odd indentation, comments, inline tables and dotted keys, other
//! runtimes, `imports` arrays): uninstall after install gives back the original text byte for
//! byte, and a second install changes nothing; in memory for many configs, and through the real
//! files (atomic writes, backups, removal of the drop-in) for a few.
//!
//! The configs are written out as text by `render`, not by a TOML library, so that they carry the
//! formatting an administrator's file has and toml_edit must keep.

use std::fmt::Write as _;

use gpu_mps_cli::containerd_registration::{
    ExistingFiles, InstallOptions, InstallPlan, Placement, install, plan_install, plan_uninstall, uninstall,
};
use proptest::prelude::*;
use proptest::sample::{select, subsequence};
use proptest::strategy::ValueTree;

/// Configs per property. Each is tried under every containerd version its layout allows (up to
/// three installs and uninstalls, all in memory): 256 take about 2 s for both properties in a debug
/// build on two cores. 20,000 passed once in a release build (3 minutes) when this was written.
const CASES: u32 = 256;
/// Configs for the property that installs into real files.
const ON_DISK_CASES: u32 = 32;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Layout {
    V2,
    V3,
}

#[derive(Debug, Clone, Copy)]
enum OptionsStyle {
    Table,
    Inline,
    Dotted,
    Missing,
}

#[derive(Debug, Clone)]
struct Runtime {
    name: &'static str,
    options: OptionsStyle,
    systemd_cgroup: bool,
    pod_annotations: bool,
}

#[derive(Debug, Clone, Copy)]
enum ImportsStyle {
    /// `["a", "b"]`
    OneLine,
    /// `[ "a", "b" ]`
    Spaced,
    /// One path per line, each followed by a comma.
    OnePerLine,
    /// One path per line, no comma after the last.
    OnePerLineNoTrailingComma,
}

#[derive(Debug, Clone)]
struct Imports {
    entries: Vec<&'static str>,
    style: ImportsStyle,
    comment: bool,
}

/// One containerd config as an administrator might have written it.
#[derive(Debug, Clone)]
struct Config {
    layout: Layout,
    single_quotes: bool,
    indent: &'static str,
    /// `[plugins]` and `[plugins."<cri>"]` written out, containerd's `config default` style.
    parent_headers: bool,
    header_comment: Option<&'static str>,
    version_last: bool,
    version_comment: bool,
    root: bool,
    imports: Option<Imports>,
    other_plugin_first: bool,
    other_plugin: bool,
    registry_inline: bool,
    default_runtime: Option<&'static str>,
    runtimes_header: bool,
    runtimes: Vec<Runtime>,
    /// `[plugins."..".containerd]` after its runtimes, which TOML allows.
    containerd_table_last: bool,
    section_comments: bool,
    header_comments: bool,
    trailing_spaces: bool,
    blank_lines: usize,
    trailing_comment: bool,
    final_newline: bool,
    crlf: bool,
}

fn runtime() -> impl Strategy<Value = (OptionsStyle, bool, bool)> {
    (
        select(vec![
            OptionsStyle::Table,
            OptionsStyle::Inline,
            OptionsStyle::Dotted,
            OptionsStyle::Missing,
        ]),
        any::<bool>(),
        any::<bool>(),
    )
}

fn imports() -> impl Strategy<Value = Option<Imports>> {
    // Never the drop-in's own path: that entry is gpu-mps' to remove.
    let entries = subsequence(
        vec![
            "/etc/containerd/conf.d/*.toml",
            "conf.d/*.toml",
            "/etc/other/*.toml",
            "/etc/containerd/extra.toml",
        ],
        0..=3,
    );
    let style = select(vec![
        ImportsStyle::OneLine,
        ImportsStyle::Spaced,
        ImportsStyle::OnePerLine,
        ImportsStyle::OnePerLineNoTrailingComma,
    ]);
    proptest::option::of(
        (entries, style, any::<bool>()).prop_map(|(entries, style, comment)| Imports {
            entries,
            style,
            comment,
        }),
    )
}

fn config() -> impl Strategy<Value = Config> {
    let layout = (
        select(vec![Layout::V2, Layout::V3]),
        any::<bool>(),
        select(vec!["", "  ", "    ", "\t", " "]),
        any::<bool>(),
        proptest::option::of(select(vec!["tuned for kubeadm", "", "managed by hand"])),
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
    );
    let plugins = (
        imports(),
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        proptest::option::of(select(vec!["runc", "crun", "kata"])),
        any::<bool>(),
        subsequence(vec!["runc", "crun", "nvidia", "kata"], 0..=4),
        proptest::collection::vec(runtime(), 4),
    );
    let text = (
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        0..3usize,
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
    );
    (layout, plugins, text).prop_map(|(l, p, t)| Config {
        layout: l.0,
        single_quotes: l.1,
        indent: l.2,
        parent_headers: l.3,
        header_comment: l.4,
        version_last: l.5,
        version_comment: l.6,
        root: l.7,
        imports: p.0,
        other_plugin_first: p.1,
        other_plugin: p.2,
        registry_inline: p.3,
        default_runtime: p.4,
        runtimes_header: p.5,
        runtimes: p
            .6
            .into_iter()
            .zip(p.7)
            .map(|(name, (options, systemd_cgroup, pod_annotations))| Runtime {
                name,
                options,
                systemd_cgroup,
                pod_annotations,
            })
            .collect(),
        containerd_table_last: t.0,
        section_comments: t.1,
        header_comments: t.2,
        trailing_spaces: t.3,
        blank_lines: t.4,
        trailing_comment: t.5,
        final_newline: t.6,
        crlf: t.7,
    })
}

/// The config as text.
fn render(c: &Config) -> String {
    let q = |s: &str| {
        if c.single_quotes {
            format!("'{s}'")
        } else {
            format!("\"{s}\"")
        }
    };
    let (version, cri) = match c.layout {
        Layout::V2 => (2, "io.containerd.grpc.v1.cri"),
        Layout::V3 => (3, "io.containerd.cri.v1.runtime"),
    };
    let cri = format!("plugins.{}", q(cri));
    let ind = |depth: usize| {
        if c.parent_headers {
            c.indent.repeat(depth)
        } else {
            c.indent.to_owned()
        }
    };
    let header = |out: &mut String, depth: usize, name: &str| {
        let note = if c.header_comments { "  # note" } else { "" };
        let _ = writeln!(out, "{}[{name}]{note}", ind(depth));
    };
    let blank = "\n".repeat(c.blank_lines);
    let mut out = String::new();
    if let Some(comment) = c.header_comment {
        let _ = writeln!(out, "# {comment}");
    }
    let version_line = if c.version_comment {
        format!("version={version}   # containerd {}.x\n", version - 1)
    } else {
        format!("version = {version}\n")
    };
    if !c.version_last {
        out.push_str(&version_line);
    }
    if c.root {
        let _ = writeln!(out, "root = {}", q("/var/lib/containerd"));
    }
    if let Some(imports) = &c.imports {
        let entries: Vec<String> = imports.entries.iter().map(|e| q(e)).collect();
        match imports.style {
            ImportsStyle::OneLine => {
                let _ = write!(out, "imports = [{}]", entries.join(", "));
            }
            ImportsStyle::Spaced => {
                let _ = write!(out, "imports = [ {} ]", entries.join(", "));
            }
            ImportsStyle::OnePerLine => {
                out.push_str("imports = [\n");
                for e in &entries {
                    let _ = writeln!(out, "{}{e},", c.indent);
                }
                out.push(']');
            }
            ImportsStyle::OnePerLineNoTrailingComma => {
                out.push_str("imports = [");
                let lines: Vec<String> = entries.iter().map(|e| format!("\n{}{e}", c.indent)).collect();
                out.push_str(&lines.join(","));
                out.push_str("\n]");
            }
        }
        out.push_str(if imports.comment { "  # drop-ins\n" } else { "\n" });
    }
    if c.version_last {
        out.push_str(&version_line);
    }
    let other = |out: &mut String| {
        if c.other_plugin {
            out.push_str(&blank);
            header(out, 1, &format!("plugins.{}", q("io.containerd.internal.v1.opt")));
            let _ = writeln!(out, "{}path = {}", ind(2), q("/var/lib/containerd/opt"));
        }
    };
    let containerd_table = |out: &mut String| {
        if let Some(default) = c.default_runtime {
            out.push_str(&blank);
            header(out, 2, &format!("{cri}.containerd"));
            let _ = writeln!(out, "{}default_runtime_name = {}", ind(3), q(default));
        }
    };
    out.push_str(&blank);
    if c.parent_headers {
        header(&mut out, 0, "plugins");
    }
    if c.other_plugin_first {
        other(&mut out);
    }
    out.push_str(&blank);
    if c.section_comments {
        let _ = writeln!(out, "{}# the CRI plugin", ind(1));
    }
    if c.parent_headers {
        header(&mut out, 1, &cri);
        if c.layout == Layout::V2 {
            let _ = writeln!(
                out,
                "{}sandbox_image = {}  # pinned",
                ind(2),
                q("registry.k8s.io/pause:3.9")
            );
        } else {
            let _ = writeln!(out, "{}enable_cdi = true", ind(2));
        }
    }
    if c.layout == Layout::V2 {
        out.push_str(&blank);
        header(&mut out, 2, &format!("{cri}.registry"));
        if c.registry_inline {
            let _ = writeln!(
                out,
                "{}mirrors = {{ {} = {{ endpoint = [{}] }} }}",
                ind(3),
                q("docker.io"),
                q("https://mirror.example")
            );
        } else {
            let _ = writeln!(out, "{}config_path = {}", ind(3), q("/etc/containerd/certs.d"));
        }
    }
    if !c.containerd_table_last {
        containerd_table(&mut out);
    }
    if c.runtimes_header {
        out.push_str(&blank);
        header(&mut out, 3, &format!("{cri}.containerd.runtimes"));
    }
    for r in &c.runtimes {
        out.push_str(&blank);
        if c.section_comments {
            let _ = writeln!(out, "{}# {}", ind(4), r.name);
        }
        let table = format!("{cri}.containerd.runtimes.{}", r.name);
        header(&mut out, 4, &table);
        let runtime_type = if r.name == "kata" {
            "io.containerd.kata.v2"
        } else {
            "io.containerd.runc.v2"
        };
        let _ = writeln!(out, "{}runtime_type = {}", ind(5), q(runtime_type));
        if r.pod_annotations {
            let _ = writeln!(out, "{}pod_annotations = [{}]", ind(5), q("example.com/*"));
        }
        let binary =
            (r.name == "nvidia").then(|| format!("BinaryName = {}", q("/usr/bin/nvidia-container-runtime")));
        let cgroup = r.systemd_cgroup;
        match r.options {
            OptionsStyle::Table => {
                header(&mut out, 5, &format!("{table}.options"));
                if let Some(binary) = &binary {
                    let _ = writeln!(out, "{}{binary}", ind(6));
                }
                let _ = writeln!(out, "{}SystemdCgroup = {cgroup}", ind(6));
            }
            OptionsStyle::Inline => {
                let binary = binary.map(|b| format!("{b}, ")).unwrap_or_default();
                let _ = writeln!(out, "{}options = {{ {binary}SystemdCgroup = {cgroup} }}", ind(5));
            }
            OptionsStyle::Dotted => {
                let _ = writeln!(out, "{}options.SystemdCgroup = {cgroup}", ind(5));
            }
            OptionsStyle::Missing => {}
        }
    }
    if c.containerd_table_last {
        containerd_table(&mut out);
    }
    if !c.other_plugin_first {
        other(&mut out);
    }
    if c.trailing_comment {
        out.push_str("\n# end\n");
    }
    if c.trailing_spaces {
        out = out.replace(" = true\n", " = true  \n");
    }
    if !c.final_newline {
        while out.ends_with('\n') {
            out.pop();
        }
    }
    if c.crlf {
        out = out.replace('\n', "\r\n");
    }
    out
}

/// containerd's major version and where the entry then goes; version 3 needs containerd 2.x.
fn majors(layout: Layout) -> &'static [(Option<u32>, Placement)] {
    match layout {
        Layout::V2 => &[
            (Some(1), Placement::MainConfig),
            (None, Placement::MainConfig),
            (Some(2), Placement::DropIn),
        ],
        Layout::V3 => &[(Some(2), Placement::DropIn), (None, Placement::DropIn)],
    }
}

fn options(major: Option<u32>) -> InstallOptions {
    InstallOptions {
        containerd_major: major,
        ..InstallOptions::default()
    }
}

/// The files once `plan` is applied.
fn after(existing: &ExistingFiles, plan: &InstallPlan, opts: &InstallOptions) -> ExistingFiles {
    plan.applied_to(existing, opts)
        .expect("a change to a file registration does not own")
}

fn installed(text: &str, major: Option<u32>, placement: Placement) -> (ExistingFiles, InstallOptions) {
    let opts = options(major);
    let original = ExistingFiles {
        main: Some(text.to_owned()),
        drop_in: None,
        node_config: None,
    };
    let plan = plan_install(&original, &opts).unwrap_or_else(|e| panic!("install: {e}\n{text}"));
    assert_eq!(plan.placement, Some(placement), "{text}");
    assert!(!plan.is_empty(), "nothing to install into:\n{text}");
    (after(&original, &plan, &opts), opts)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: CASES, ..ProptestConfig::default() })]

    #[test]
    fn uninstall_after_install_gives_back_the_original_byte_for_byte(config in config()) {
        let text = render(&config);
        for &(major, placement) in majors(config.layout) {
            let (files, opts) = installed(&text, major, placement);
            let removal = plan_uninstall(&files, &opts)
                .unwrap_or_else(|e| panic!("uninstall: {e}\n{}", files.main.as_deref().unwrap_or("")));
            let restored = after(&files, &removal, &opts);
            prop_assert_eq!(
                restored.main.as_deref(),
                Some(text.as_str()),
                "containerd {:?}, installed:\n{}",
                major,
                files.main.as_deref().unwrap_or("")
            );
            prop_assert_eq!(restored.drop_in, None);
        }
    }

    #[test]
    fn a_second_install_changes_nothing(config in config()) {
        let text = render(&config);
        for &(major, placement) in majors(config.layout) {
            let (files, opts) = installed(&text, major, placement);
            let again = plan_install(&files, &opts).expect("second install");
            prop_assert!(
                again.is_empty(),
                "containerd {:?}: the second install changes:\n{}",
                major,
                again.diff()
            );
        }
    }
}

proptest! {
    // Each case writes and fsyncs real files: fewer of them.
    #![proptest_config(ProptestConfig { cases: ON_DISK_CASES, ..ProptestConfig::default() })]

    #[test]
    fn on_disk_uninstall_after_install_gives_back_the_file(config in config()) {
        let text = render(&config);
        for &(major, _) in majors(config.layout) {
            let dir = tempfile::tempdir().expect("tempdir");
            let opts = InstallOptions {
                host_root: dir.path().to_path_buf(),
                ..options(major)
            };
            let main = opts.on_host(&opts.main_config);
            std::fs::create_dir_all(main.parent().expect("/etc/containerd")).expect("mkdir");
            std::fs::write(&main, &text).expect("write");
            install(&opts, None, false).unwrap_or_else(|e| panic!("install: {e}\n{text}"));
            prop_assert!(install(&opts, None, false).expect("again").plan.is_empty());
            uninstall(&opts, None, false).unwrap_or_else(|e| panic!("uninstall: {e}\n{text}"));
            prop_assert_eq!(std::fs::read_to_string(&main).expect("main"), text.as_str());
            prop_assert!(!opts.on_host(&opts.drop_in).exists());
        }
    }
}

/// The generator reaches the shapes the properties are about; a change that narrowed it would
/// otherwise go unnoticed.
#[test]
fn the_generated_configs_cover_the_layouts() {
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let strategy = config();
    let mut seen = [false; 9];
    for _ in 0..CASES {
        let c = strategy.new_tree(&mut runner).expect("a config").current();
        let text = render(&c);
        seen[0] |= c.layout == Layout::V3;
        seen[1] |= text.contains("options = {");
        seen[2] |= text.contains("options.SystemdCgroup");
        seen[3] |= text.contains("imports = [\n");
        seen[4] |= text.contains("\n]") && !text.contains(",\n]");
        seen[5] |= c.parent_headers && c.indent == "\t";
        seen[6] |= !text.ends_with('\n');
        seen[7] |= text.contains("\r\n");
        seen[8] |= text.contains("mirrors = {");
        let parsed: Result<toml_edit::DocumentMut, _> = text.parse();
        assert!(parsed.is_ok(), "not TOML: {parsed:?}\n{text}");
    }
    assert_eq!(
        seen, [true; 9],
        "v3, inline options, dotted options, one import per line, no trailing comma, tabs, no final newline, CRLF, inline registry"
    );
}
