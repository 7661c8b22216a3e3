//! The crate's error: one variant per module, each message one line that names what was
//! wrong, the value, what is allowed and where to change it.

use std::io;
use std::path::PathBuf;

use thiserror::Error;

use crate::allocation::AllocationError;
use crate::bundle::BundleError;
use crate::gpu_devices::DeviceError;
use crate::node_files::NodeFileError;
use crate::request::RequestError;
use crate::rewrite::RewriteError;
use crate::runc_args::ArgsError;
use crate::spec_fields::SpecError;

#[derive(Debug, Error)]
pub enum ShimError {
    #[error(transparent)]
    Args(#[from] ArgsError),
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error(transparent)]
    Devices(#[from] DeviceError),
    #[error(transparent)]
    Request(#[from] RequestError),
    #[error(transparent)]
    Allocation(#[from] AllocationError),
    #[error(transparent)]
    Rewrite(#[from] RewriteError),
    #[error(transparent)]
    Bundle(#[from] BundleError),
    #[error(transparent)]
    NodeFile(#[from] NodeFileError),
    #[error(transparent)]
    ContainerId(#[from] gpu_mps_api::container_id::ContainerIdError),
    #[error("cannot find the bundle: the current directory is unreadable: {0}")]
    CurrentDir(io::Error),
    #[error("cannot run runc at {path}: {source} (runc_path in {config}{note})")]
    Exec {
        path: PathBuf,
        source: io::Error,
        config: PathBuf,
        note: String,
    },
}
