//! Where runc's command line keeps the subcommand, the bundle and the log settings.
//!
//! runc parses its global flags with Go's `flag` package (urfave/cli v1): they come before the
//! subcommand, as `--name value`, `--name=value`, `-name value` or `-name=value`, and the first
//! argument that is not a flag is the subcommand. A subcommand's own flags may come before or
//! after its positional arguments (urfave/cli v1 moves them to the front), so `create`'s
//! arguments are scanned to the end. The shim only reads the arguments; runc gets them unchanged.

use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

use thiserror::Error;

/// `--log-format`: how runc (and so the shim) writes lines to the `--log` file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// logrus text, runc's default: `time="..." level=error msg="..."`.
    #[default]
    Text,
    /// One JSON object per line; what containerd's runc shim asks for and reads back.
    Json,
}

/// The global flags the shim acts on; the others are only skipped.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GlobalOptions {
    pub log: Option<PathBuf>,
    pub log_format: LogFormat,
    pub debug: bool,
}

/// The arguments of `runc create` the shim needs.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CreateArgs {
    /// `None`: no `--bundle` (or an empty one), so the bundle is the current directory.
    pub bundle: Option<PathBuf>,
    /// The container id, for debug logs only.
    pub container_id: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Subcommand {
    Create(CreateArgs),
    /// Any other subcommand (`None`: there is none); runc gets it untouched.
    Other(Option<String>),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuncArgs {
    pub global: GlobalOptions,
    pub subcommand: Subcommand,
}

/// What the shim was asked to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Invocation {
    /// `--help` or `-h` as the first argument: explain the shim instead of running runc.
    Help,
    /// `--version` or `-v` as the first argument: the shim's version, then runc's.
    Version,
    Runc(RuncArgs),
}

/// A flag that needs a value came last. runc would refuse the command too; the global flags
/// read before it still say where to log the error.
#[derive(Debug, Error, PartialEq, Eq)]
#[error("flag needs an argument: {flag}")]
pub struct ArgsError {
    pub flag: String,
    pub global: GlobalOptions,
}

/// runc's global flags that take a value.
const GLOBAL_VALUE_FLAGS: &[&str] = &["root", "log", "log-format", "criu", "rootless"];
/// runc's global boolean flags.
const GLOBAL_BOOL_FLAGS: &[&str] = &["debug", "systemd-cgroup", "help", "h", "version", "v"];
/// `runc create` flags that take a value.
const CREATE_VALUE_FLAGS: &[&str] = &[
    "bundle",
    "b",
    "console-socket",
    "pid-file",
    "preserve-fds",
    "pidfd-socket",
];
/// runc's subcommands, used to tell an unknown boolean global flag from one with a value.
const SUBCOMMANDS: &[&str] = &[
    "checkpoint",
    "create",
    "delete",
    "events",
    "exec",
    "features",
    "help",
    "init",
    "kill",
    "list",
    "pause",
    "ps",
    "restore",
    "resume",
    "run",
    "spec",
    "start",
    "state",
    "update",
];

/// Parses the arguments after argv[0].
pub fn parse(args: &[OsString]) -> Result<Invocation, ArgsError> {
    match args.first().and_then(|a| a.to_str()) {
        Some("--help" | "-h") => return Ok(Invocation::Help),
        Some("--version" | "-v") => return Ok(Invocation::Version),
        _ => {}
    }
    let mut global = GlobalOptions::default();
    let mut i = 0;
    let mut subcommand = None;
    while i < args.len() {
        let arg = &args[i];
        if arg.as_bytes() == b"--" {
            subcommand = args.get(i + 1).map(|s| (i + 1, s));
            break;
        }
        let Some(flag) = Flag::parse(arg) else {
            subcommand = Some((i, arg));
            break;
        };
        if GLOBAL_VALUE_FLAGS.contains(&flag.name) {
            let (value, used) = flag.value(args, i, &global)?;
            match flag.name {
                "log" => global.log = Some(PathBuf::from(value)),
                "log-format" => {
                    global.log_format = if value.as_bytes() == b"json" {
                        LogFormat::Json
                    } else {
                        LogFormat::Text
                    }
                }
                _ => {}
            }
            i += used;
        } else if GLOBAL_BOOL_FLAGS.contains(&flag.name) {
            if flag.name == "debug" {
                global.debug = flag.bool_value();
            }
            i += 1;
        } else if flag.inline.is_some() {
            i += 1;
        } else {
            // A flag this runc version does not have, or a newer runc's: boolean when a
            // subcommand or another flag follows it, else it takes the next argument as its
            // value. Guessing "value" wrongly could hide a `create` (and pass a GPU container
            // through without limits), so a following flag is never taken as a value.
            let next_is_boolean_context = args
                .get(i + 1)
                .and_then(|a| a.to_str())
                .is_some_and(|a| SUBCOMMANDS.contains(&a) || a.starts_with('-'));
            i += if next_is_boolean_context { 1 } else { 2 };
        }
    }
    let subcommand = match subcommand {
        Some((at, name)) if name.as_bytes() == b"create" => {
            Subcommand::Create(parse_create(&args[at + 1..], &global)?)
        }
        Some((_, name)) => Subcommand::Other(Some(name.to_string_lossy().into_owned())),
        None => Subcommand::Other(None),
    };
    Ok(Invocation::Runc(RuncArgs { global, subcommand }))
}

fn parse_create(args: &[OsString], global: &GlobalOptions) -> Result<CreateArgs, ArgsError> {
    let mut create = CreateArgs::default();
    let mut i = 0;
    while i < args.len() {
        let arg = &args[i];
        if arg.as_bytes() == b"--" {
            if let Some(last) = args[i + 1..].last() {
                create.container_id = Some(last.to_string_lossy().into_owned());
            }
            break;
        }
        match Flag::parse(arg) {
            Some(flag) if CREATE_VALUE_FLAGS.contains(&flag.name) => {
                let (value, used) = flag.value(args, i, global)?;
                if matches!(flag.name, "bundle" | "b") {
                    create.bundle = (!value.is_empty()).then(|| PathBuf::from(value));
                }
                i += used;
            }
            // Boolean flags (`--no-pivot`, `--no-new-keyring`) and unknown ones.
            Some(_) => i += 1,
            None => {
                // runc takes exactly one positional argument; the last one is the id even when
                // an unknown flag's value came before it.
                create.container_id = Some(arg.to_string_lossy().into_owned());
                i += 1;
            }
        }
    }
    Ok(create)
}

/// One command-line flag in Go's syntax: one or two dashes, a name, maybe `=value`.
struct Flag<'a> {
    name: &'a str,
    inline: Option<&'a OsStr>,
}

impl<'a> Flag<'a> {
    fn parse(arg: &'a OsStr) -> Option<Flag<'a>> {
        let bytes = arg.as_bytes();
        let body = bytes.strip_prefix(b"--").or_else(|| bytes.strip_prefix(b"-"))?;
        if body.is_empty() || body[0] == b'-' || body[0] == b'=' {
            return None;
        }
        let (name, inline) = match body.iter().position(|b| *b == b'=') {
            Some(eq) => (&body[..eq], Some(OsStr::from_bytes(&body[eq + 1..]))),
            None => (body, None),
        };
        Some(Flag {
            name: std::str::from_utf8(name).ok()?,
            inline,
        })
    }

    /// The flag's value and how many arguments it used.
    fn value(
        &self,
        args: &'a [OsString],
        at: usize,
        global: &GlobalOptions,
    ) -> Result<(&'a OsStr, usize), ArgsError> {
        match self.inline {
            Some(v) => Ok((v, 1)),
            None => match args.get(at + 1) {
                Some(v) => Ok((v.as_os_str(), 2)),
                None => Err(ArgsError {
                    flag: format!("-{}", self.name),
                    global: global.clone(),
                }),
            },
        }
    }

    /// Go's `strconv.ParseBool` for `--flag=value`; a bare flag is true.
    fn bool_value(&self) -> bool {
        match self.inline.and_then(|v| v.to_str()) {
            None => self.inline.is_none(),
            Some(v) => matches!(v, "1" | "t" | "T" | "true" | "TRUE" | "True"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(line: &str) -> Vec<OsString> {
        line.split_whitespace().map(OsString::from).collect()
    }

    fn runc(line: &str) -> RuncArgs {
        match parse(&args(line)) {
            Ok(Invocation::Runc(r)) => r,
            other => panic!("{line}: {other:?}"),
        }
    }

    fn create(line: &str) -> CreateArgs {
        match runc(line).subcommand {
            Subcommand::Create(c) => c,
            other => panic!("{line}: not create: {other:?}"),
        }
    }

    #[test]
    fn finds_the_bundle_in_every_form() {
        let b = |s: &str| Some(PathBuf::from(s));
        let cases: &[(&str, Option<PathBuf>, &str)] = &[
            ("create --bundle /b id", b("/b"), "id"),
            ("create --bundle=/b id", b("/b"), "id"),
            ("create -b /b id", b("/b"), "id"),
            ("create -b=/b id", b("/b"), "id"),
            ("create -bundle /b id", b("/b"), "id"),
            ("create id", None, "id"),
            ("create --bundle= id", None, "id"),
            ("create id --bundle /b", b("/b"), "id"),
            (
                "--root /run/containerd/runc/k8s.io --log /x/log.json --log-format json --systemd-cgroup \
                 create --bundle /b --pid-file /b/init.pid id",
                b("/b"),
                "id",
            ),
            (
                "--root=/r --debug create --console-socket /s.sock --no-pivot -b /b id",
                b("/b"),
                "id",
            ),
            (
                "-root /r -log /l create --preserve-fds 2 --no-new-keyring --bundle /b id",
                b("/b"),
                "id",
            ),
            (
                "--criu /c --rootless auto create --pidfd-socket /p --bundle /b id",
                b("/b"),
                "id",
            ),
            ("create --pid-file /b/pid -- id", None, "id"),
            ("--newer-bool create --bundle /b id", b("/b"), "id"),
            ("--newer-valued x create --bundle /b id", b("/b"), "id"),
            ("create --newer-valued=x --bundle /b id", b("/b"), "id"),
        ];
        for (line, bundle, id) in cases {
            let c = create(line);
            assert_eq!(&c.bundle, bundle, "{line}");
            assert_eq!(c.container_id.as_deref(), Some(*id), "{line}");
        }
    }

    #[test]
    fn reads_log_settings_before_the_subcommand() {
        let r = runc("--log /x/log.json --log-format json create id");
        assert_eq!(r.global.log, Some(PathBuf::from("/x/log.json")));
        assert_eq!(r.global.log_format, LogFormat::Json);
        assert!(!r.global.debug);
        let r = runc("--log=/l --log-format=text --debug delete id");
        assert_eq!(r.global.log, Some(PathBuf::from("/l")));
        assert_eq!(r.global.log_format, LogFormat::Text);
        assert!(r.global.debug);
        assert!(!runc("--debug=false kill id").global.debug);
        assert_eq!(
            runc("-log-format json state id").global.log_format,
            LogFormat::Json
        );
    }

    #[test]
    fn an_unknown_flag_before_another_flag_is_boolean() {
        // A newer runc's boolean global flag must not swallow `--root` and hide the create.
        assert!(matches!(
            runc("--newer-bool --root /r create id").subcommand,
            Subcommand::Create(_)
        ));
        assert!(matches!(
            runc("--newer-value v --root /r create id").subcommand,
            Subcommand::Create(_)
        ));
    }

    #[test]
    fn other_subcommands_are_not_create() {
        for (line, sub) in [
            ("delete id", Some("delete")),
            ("--root /r --log create kill id 9", Some("kill")),
            ("--log-format json start id", Some("start")),
            ("state create", Some("state")),
            ("", None),
            ("--debug", None),
        ] {
            assert_eq!(
                runc(line).subcommand,
                Subcommand::Other(sub.map(String::from)),
                "{line}"
            );
        }
        // `--log create` is the log file named "create", so the subcommand is `kill`.
        assert_eq!(
            runc("--log create kill id").global.log,
            Some(PathBuf::from("create"))
        );
    }

    #[test]
    fn help_and_version_only_as_first_argument() {
        assert_eq!(parse(&args("--help")), Ok(Invocation::Help));
        assert_eq!(parse(&args("-h")), Ok(Invocation::Help));
        assert_eq!(parse(&args("--version")), Ok(Invocation::Version));
        assert_eq!(parse(&args("-v")), Ok(Invocation::Version));
        assert_eq!(runc("--debug --version").subcommand, Subcommand::Other(None));
        assert_eq!(
            runc("create --help id").subcommand,
            Subcommand::Create(create("create id"))
        );
    }

    #[test]
    fn a_missing_value_keeps_the_log_settings() {
        let e = parse(&args("--log /l --log-format json create --bundle")).unwrap_err();
        assert_eq!(e.flag, "-bundle");
        assert_eq!(e.global.log, Some(PathBuf::from("/l")));
        assert_eq!(e.global.log_format, LogFormat::Json);
        assert!(parse(&args("--root")).is_err());
    }

    #[test]
    fn bundle_paths_need_not_be_utf8() {
        let raw = OsStr::from_bytes(b"/b\xff").to_os_string();
        let argv = vec![
            OsString::from("create"),
            OsString::from("-b"),
            raw.clone(),
            OsString::from("id"),
        ];
        match parse(&argv) {
            Ok(Invocation::Runc(RuncArgs {
                subcommand: Subcommand::Create(c),
                ..
            })) => {
                assert_eq!(c.bundle, Some(PathBuf::from(raw)));
            }
            other => panic!("{other:?}"),
        }
    }
}
