//! The files on disk: reading them, and applying a plan so that a failure at any step leaves every
//! file as it was.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use gpu_mps_api::files::{self, Durability, FileMode};

use super::plan::{ExistingFiles, FileChange, InstallPlan};
use super::{InstallOptions, RegistrationError};

impl ExistingFiles {
    pub fn read(opts: &InstallOptions) -> Result<Self, RegistrationError> {
        Ok(ExistingFiles {
            main: read_optional(&opts.on_host(&opts.main_config))?,
            drop_in: read_optional(&opts.on_host(&opts.drop_in))?,
            node_config: read_optional(&opts.on_host(&opts.node_config))?,
        })
    }
}

fn read_optional(path: &Path) -> Result<Option<String>, RegistrationError> {
    match fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(RegistrationError::Io {
            path: path.into(),
            action: "read",
            source,
        }),
    }
}

/// Makes the changes in order: each write goes to a temporary file in the same directory, is
/// synced and renamed over the target (keeping the target's mode); a main config that existed is
/// first copied to `<name>.gpu-mps-backup.<unix seconds>`. Returns the backups made. A change
/// that fails puts the files changed before it back as they were.
pub fn apply(plan: &InstallPlan) -> Result<Applied, RegistrationError> {
    let mut applied = Applied::default();
    for (done, change) in plan.changes.iter().enumerate() {
        if let Err(e) = apply_one(change, &mut applied) {
            return Err(roll_back(&plan.changes[..done], &applied, e));
        }
    }
    Ok(applied)
}

/// What [`apply`] made besides the changes themselves, for a roll back.
#[derive(Debug, Clone, Default)]
pub struct Applied {
    /// Copies of the main config made before it was changed.
    pub backups: Vec<PathBuf>,
    /// Directories created for a new file (conf.d).
    created_dirs: Vec<PathBuf>,
}

fn apply_one(change: &FileChange, applied: &mut Applied) -> Result<(), RegistrationError> {
    match change {
        FileChange::Write {
            path,
            previous,
            contents,
            backup,
        } => {
            if *backup && previous.is_some() {
                applied.backups.push(back_up(path)?);
            }
            if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty() && !d.exists()) {
                applied.created_dirs.push(dir.to_path_buf());
            }
            write_atomic(path, contents)
        }
        FileChange::Remove { path, .. } => remove_if_present(path),
    }
}

fn remove_if_present(path: &Path) -> Result<(), RegistrationError> {
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(RegistrationError::Io {
            path: path.into(),
            action: "remove",
            source,
        }),
    }
}

/// Undoes `applied` (newest first): each file gets its previous text back, byte for byte, or is
/// removed if it did not exist; the backups go too, since nothing changed. Returns `cause`,
/// saying what was put back or, if that failed, where the backups are.
pub(super) fn roll_back(
    changes: &[FileChange],
    applied: &Applied,
    cause: RegistrationError,
) -> RegistrationError {
    let backups = &applied.backups;
    let undone = changes.iter().rev().try_for_each(|change| match change {
        FileChange::Write {
            path,
            previous: Some(previous),
            ..
        }
        | FileChange::Remove { path, previous } => write_atomic(path, previous),
        FileChange::Write {
            path, previous: None, ..
        } => remove_if_present(path),
    });
    match undone {
        Ok(()) => {
            for backup in backups {
                let _ = fs::remove_file(backup);
            }
            // Only while empty: a directory that held anything else stays.
            for dir in applied.created_dirs.iter().rev() {
                let _ = fs::remove_dir(dir);
            }
            let files: Vec<String> = changes.iter().map(|c| c.path().display().to_string()).collect();
            if files.is_empty() {
                return cause;
            }
            RegistrationError::RolledBack {
                cause: Box::new(cause),
                files: files.join(", "),
            }
        }
        Err(rollback) => RegistrationError::RollbackFailed {
            cause: Box::new(cause),
            rollback: Box::new(rollback),
            backups: if backups.is_empty() {
                "none".into()
            } else {
                backups
                    .iter()
                    .map(|b| b.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            },
        },
    }
}

fn back_up(path: &Path) -> Result<PathBuf, RegistrationError> {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut backup = path.with_file_name(format!("{name}.gpu-mps-backup.{secs}"));
    let mut n = 1;
    while backup.exists() {
        backup = path.with_file_name(format!("{name}.gpu-mps-backup.{secs}.{n}"));
        n += 1;
    }
    fs::copy(path, &backup).map_err(|source| RegistrationError::Io {
        path: backup.clone(),
        action: "back up",
        source,
    })?;
    Ok(backup)
}

fn write_atomic(path: &Path, contents: &str) -> Result<(), RegistrationError> {
    let io_err = |action: &'static str| {
        move |source: io::Error| RegistrationError::Io {
            path: path.into(),
            action,
            source,
        }
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        fs::create_dir_all(dir).map_err(io_err("create the directory of"))?;
    }
    // Durable: /etc survives a power loss; a root-only config stays root-only.
    files::replace_file(
        path,
        contents.as_bytes(),
        FileMode::KeepExisting { default: 0o644 },
        Durability::Durable,
    )
    .map_err(io_err("write"))
}
