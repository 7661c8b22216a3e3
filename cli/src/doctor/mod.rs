//! `gpu-mps doctor`: checks what a gpu-mps node needs and prints one line per check, with the fix
//! for each failure.
//!
//! Split as the shim is: `gather` does every read, run and connect and records what it found in
//! [`Facts`], each a plain value (an error is recorded, never returned); [`diagnose`] turns the facts
//! into [`Check`]s without touching the node. So each check's PASS, WARN and FAIL is a unit test
//! that needs neither root, a GPU, containerd nor a running manager.
//!
//! One module per check, holding the facts it reads and the function that judges them.

mod cdi;
mod compute_mode;
mod descriptors;
mod gather;
mod host_mps_dir;
mod manager;
mod mps_binaries;
mod node_config;
mod nvml;
mod registration;
mod runc;

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

use gpu_mps_api::client::ClientError;
use gpu_mps_api::message::{one_line, without_os_error_numbers};
use gpu_mps_api::node_config::ConfigError;
use gpu_mps_api::node_files::NodeFileError;
use serde::Serialize;
use thiserror::Error;

use crate::containerd_registration::RegistrationError;

pub use cdi::{CdiFacts, CdiSpec, GPU_CDI_KIND, parse_cdi_spec};
pub use compute_mode::{GpuFacts, GpuSeen, GpuSource, parse_nvidia_smi};
pub use descriptors::{DescriptorFacts, ProcessDescriptors, parse_open_files_limit};
pub use gather::{DoctorOptions, file_state, gather};
pub use host_mps_dir::{HOST_MPS_DIR, HostMpsDirFacts};
pub use manager::{ManagerAnswer, ManagerFacts};
pub use mps_binaries::MpsFacts;
pub use node_config::{ConfigFacts, ConfigState};
pub use nvml::NvmlProbe;
pub use registration::{
    CONTAINERD_SOCKET, ContainerdFacts, NOT_LOADED_YET, RegistrationFacts, RunningContainerd,
    containerd_config_arg, parse_boot_time,
};
pub use runc::RuncFacts;

/// Why a fact could not be gathered. Recorded in the facts and shown in the check's line.
#[derive(Debug, Error)]
pub enum DoctorError {
    #[error("{}: {action}: {}", .path.display(), plain_io(.source))]
    Io {
        path: PathBuf,
        action: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("{}: {message}", .program.display())]
    Command { program: PathBuf, message: String },
    #[error("{}: {message}", .path.display())]
    Invalid { path: PathBuf, message: String },
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    NodeFile(#[from] NodeFileError),
    #[error(transparent)]
    Registration(#[from] RegistrationError),
    #[error(transparent)]
    Manager(#[from] ClientError),
}

/// An OS error in words: "No such file or directory", without " (os error 2)".
pub fn plain_io(e: &io::Error) -> String {
    let text = e.to_string();
    match text.rfind(" (os error ") {
        Some(at) if text.ends_with(')') => text[..at].to_string(),
        _ => text,
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Status {
    Pass,
    Warn,
    Fail,
    /// Could not be judged because something it needs is missing; the line says what. Another
    /// check's FAIL names the cause, so a SKIP never fails the run by itself.
    Skip,
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Status::Pass => "PASS",
            Status::Warn => "WARN",
            Status::Fail => "FAIL",
            Status::Skip => "SKIP",
        })
    }
}

/// The verdict of one check.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Check {
    #[serde(rename = "check")]
    pub name: &'static str,
    pub status: Status,
    /// What was found, in words.
    pub found: String,
    /// What to do about it; always set for FAIL.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
}

impl Check {
    fn new(name: &'static str, status: Status, found: String, fix: Option<String>) -> Self {
        Check {
            name,
            status,
            found: without_os_error_numbers(&one_line(&found)),
            fix: fix.map(|f| one_line(&f)),
        }
    }

    pub fn pass(name: &'static str, found: impl Into<String>) -> Self {
        Check::new(name, Status::Pass, found.into(), None)
    }

    pub fn warn(name: &'static str, found: impl Into<String>, fix: impl Into<String>) -> Self {
        Check::new(name, Status::Warn, found.into(), Some(fix.into()))
    }

    pub fn fail(name: &'static str, found: impl Into<String>, fix: impl Into<String>) -> Self {
        Check::new(name, Status::Fail, found.into(), Some(fix.into()))
    }

    pub fn skip(name: &'static str, found: impl Into<String>) -> Self {
        Check::new(name, Status::Skip, found.into(), None)
    }

    /// The check as one line: `FAIL manager       what was found. Fix: what to do.`
    pub fn line(&self) -> String {
        let mut line = format!("{} {:<14} {}", self.status, self.name, sentence(&self.found));
        if let Some(fix) = &self.fix {
            line.push_str(" Fix: ");
            line.push_str(&sentence(fix));
        }
        line
    }
}

/// `text` ending in a full stop, unless it ends in punctuation already.
fn sentence(text: &str) -> String {
    if text.ends_with(['.', '!', '?']) {
        text.to_string()
    } else {
        format!("{text}.")
    }
}

/// Everything [`gather`] found on the node; the input of [`diagnose`].
#[derive(Debug)]
pub struct Facts {
    pub config: ConfigFacts,
    pub registration: RegistrationFacts,
    pub runc: RuncFacts,
    pub host_mps_dir: HostMpsDirFacts,
    pub cdi: CdiFacts,
    pub gpus: GpuFacts,
    pub nvml: NvmlProbe,
    pub manager: ManagerFacts,
    pub descriptors: DescriptorFacts,
    pub mps: MpsFacts,
}

/// The checks, in the order they are printed.
pub fn diagnose(facts: &Facts) -> Report {
    let config = &facts.config;
    Report {
        checks: vec![
            node_config::check(config),
            registration::check(&facts.registration),
            runc::check(&facts.runc, &config.path),
            host_mps_dir::check(&facts.host_mps_dir, &facts.runc.runc_path),
            cdi::check(&facts.cdi, &facts.gpus),
            compute_mode::check(&facts.gpus, config.config.daemon.exclusive_process, &config.path),
            nvml::check(&facts.nvml),
            manager::check(&facts.manager, config),
            descriptors::check(&facts.descriptors),
            mps_binaries::check(&facts.mps, &config.path),
        ],
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Report {
    pub checks: Vec<Check>,
}

impl Report {
    pub fn failed(&self) -> bool {
        self.checks.iter().any(|c| c.status == Status::Fail)
    }

    fn count(&self, status: Status) -> usize {
        self.checks.iter().filter(|c| c.status == status).count()
    }

    /// One line per check, then a count.
    pub fn text(&self) -> String {
        let mut out: String = self.checks.iter().map(|c| c.line() + "\n").collect();
        out.push_str(&format!(
            "{} checks: {} passed, {} warned, {} failed, {} skipped\n",
            self.checks.len(),
            self.count(Status::Pass),
            self.count(Status::Warn),
            self.count(Status::Fail),
            self.count(Status::Skip)
        ));
        out
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({ "ok": !self.failed(), "checks": self.checks })
    }
}

/// What a file the node needs is like: found and executable, or why not.
#[derive(Debug)]
pub enum FileState {
    Executable {
        at: PathBuf,
    },
    NotExecutable {
        at: PathBuf,
    },
    NotAFile {
        at: PathBuf,
    },
    /// Not there; `searched` says where it was looked for (empty: at the path named).
    Missing {
        searched: String,
    },
    Unreadable(DoctorError),
}

impl FileState {
    pub fn is_executable(&self) -> bool {
        matches!(self, FileState::Executable { .. })
    }

    /// The file as found, for a line: "/usr/sbin/runc", or what is wrong with it.
    pub fn describe(&self, name: &Path) -> String {
        match self {
            FileState::Executable { at } => at.display().to_string(),
            FileState::NotExecutable { at } => format!("{} is not executable", at.display()),
            FileState::NotAFile { at } => format!("{} is not a file", at.display()),
            FileState::Missing { searched } if searched.is_empty() => {
                format!("{} does not exist", name.display())
            }
            FileState::Missing { searched } => format!("{} does not exist ({searched})", name.display()),
            FileState::Unreadable(e) => e.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_holds_status_name_found_and_fix() {
        let c = Check::fail("manager", "not\nrunning", "start it");
        assert_eq!(c.line(), "FAIL manager        not running. Fix: start it.");
        assert_eq!(Check::pass("nvml", "ok.").line(), "PASS nvml           ok.");
    }

    #[test]
    fn a_failure_fails_the_report_and_a_skip_does_not() {
        let mut r = Report {
            checks: vec![
                Check::pass("a", "x"),
                Check::skip("b", "y"),
                Check::warn("c", "z", "w"),
            ],
        };
        assert!(!r.failed());
        assert_eq!(r.json()["ok"], true);
        r.checks.push(Check::fail("d", "broken", "fix it"));
        assert!(r.failed());
        let json = r.json();
        assert_eq!(json["ok"], false);
        assert_eq!(json["checks"][3]["status"], "FAIL");
        assert_eq!(json["checks"][3]["check"], "d");
        assert_eq!(json["checks"][3]["fix"], "fix it");
        assert!(json["checks"][0].get("fix").is_none());
        let text = r.text();
        assert_eq!(text.lines().count(), 5, "{text}");
        assert!(
            text.ends_with("4 checks: 1 passed, 1 warned, 1 failed, 1 skipped\n"),
            "{text}"
        );
    }

    #[test]
    fn os_error_numbers_are_left_out_of_findings() {
        let c = Check::fail(
            "containerd",
            "/x: cannot run it: No such file or directory (os error 2); (os error x) stays",
            "f",
        );
        assert_eq!(
            c.found,
            "/x: cannot run it: No such file or directory; (os error x) stays"
        );
    }

    #[test]
    fn os_errors_read_as_words() {
        let e = io::Error::from_raw_os_error(2);
        assert_eq!(plain_io(&e), "No such file or directory");
        let e = DoctorError::Io {
            path: "/x".into(),
            action: "reading",
            source: io::Error::from_raw_os_error(13),
        };
        assert_eq!(e.to_string(), "/x: reading: Permission denied");
    }
}
