//! What stops a simulation. Each is one line: what was wrong, the value, what is allowed.

use gpu_mps_api::memory_units::UnitError;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum SimError {
    #[error("{0}")]
    Invalid(String),
    #[error("the GPUs cannot be laid out as gpu-mps.io/memory units: {0}")]
    Layout(#[from] UnitError),
    #[error(
        "the simulator's best fit chose {fast:?} but UnitLayout::preferred chose {real:?} for {size} units on node {node}: the fast path no longer models the device plugin"
    )]
    PreferredDisagrees {
        node: u32,
        size: u32,
        fast: Option<Vec<String>>,
        real: Option<Vec<String>>,
    },
}
