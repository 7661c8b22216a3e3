//! Test harness: private containerd instances of several versions, a CRI client playing
//! kubelet, test images built in Rust, a private gpu-mps-manager on fake GPUs.
//!
//! Every test runs once per containerd suite (`per_suite!`), against a containerd, runc and
//! manager of its own, and prints the exact versions it ran against.

pub mod binaries;
pub mod cdi;
pub mod checker;
pub mod concurrent;
pub mod containerd;
pub mod cri;
pub mod ctr;
pub mod device_nodes;
pub mod diagnostics;
pub mod host_user;
pub mod image;
pub mod kubelet;
pub mod manager;
pub mod manifest;
pub mod node;
pub mod processes;
pub mod suites;
pub mod workdir;

use std::future::Future;
use std::time::{Duration, Instant};

pub use binaries::Binaries;
pub use containerd::{CdiOptions, Containerd, ContainerdOptions};
pub use cri::{ContainerSpec, CriClient, PodSpec};
pub use ctr::{Ctr, CtrRun};
pub use manager::{LimitsConfig, Manager, StatusLookup};
pub use node::GpuNode;
pub use suites::Suite;

/// A test that has not finished by then fails instead of hanging CI.
pub const TEST_TIMEOUT: Duration = Duration::from_secs(240);

/// Runs one test body against the named suite: prints the versions, gives the body a
/// current-thread runtime, and on failure prints the logs of the daemons the body ran.
/// A suite left out by GPU_MPS_E2E_SUITES is skipped with a line saying so; a suite that is
/// wanted but not fetched fails.
pub fn run_suite_test<F, Fut>(suite_name: &str, test: F)
where
    F: FnOnce(Suite) -> Fut,
    Fut: Future<Output = anyhow::Result<()>>,
{
    let suite = match Suite::for_test(suite_name) {
        Ok(Some(suite)) => suite,
        Ok(None) => {
            println!("skipped: suite {suite_name} is not in {}", suites::SUITES_ENV);
            return;
        }
        Err(e) => panic!("{e:#}"),
    };
    println!("{suite}");
    diagnostics::reset();
    let started = Instant::now();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let result = runtime.block_on(async {
        tokio::time::timeout(TEST_TIMEOUT, test(suite.clone()))
            .await
            .unwrap_or_else(|_| Err(anyhow::anyhow!("the test did not finish within {TEST_TIMEOUT:?}")))
    });
    drop(runtime);
    match result {
        Ok(()) => println!("passed on {} in {:.1?}", suite.name, started.elapsed()),
        Err(e) => {
            diagnostics::print_recorded();
            panic!(
                "failed on suite {} ({}, {}) after {:.1?}: {e:?}",
                suite.name,
                suite.containerd_version,
                suite.runc_version,
                started.elapsed()
            );
        }
    }
}

/// Generates one `#[test]` per known suite for an `async fn(Suite) -> anyhow::Result<()>`:
/// `per_suite!(cri_report);` makes `cri_report::bookworm`, `cri_report::trixie` and
/// `cri_report::sid`, so `cargo test --test smoke sid` runs one suite.
#[macro_export]
macro_rules! per_suite {
    ($($(#[$attr:meta])* $test:ident),+ $(,)?) => {
        $(
            mod $test {
                #[test]
                $(#[$attr])*
                fn bookworm() {
                    $crate::run_suite_test("bookworm", super::$test)
                }

                #[test]
                $(#[$attr])*
                fn trixie() {
                    $crate::run_suite_test("trixie", super::$test)
                }

                #[test]
                $(#[$attr])*
                fn sid() {
                    $crate::run_suite_test("sid", super::$test)
                }
            }
        )+
    };
}
