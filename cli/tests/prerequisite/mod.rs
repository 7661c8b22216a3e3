//! What a CLI integration test needs from the machine it runs on (root, the containerd cache of
//! tests/support/fetch-containerd.sh). Where that is missing the test FAILS and says what to do:
//! a test that passes without running reads as coverage that is not there. A developer may set
//! `GPU_MPS_CLI_TESTS_ALLOW_SKIP=1` to skip such a test with a line instead; CI never sets it.

use std::os::unix::fs::MetadataExt;

pub const ALLOW_SKIP_ENV: &str = "GPU_MPS_CLI_TESTS_ALLOW_SKIP";

/// Whether this process runs as root.
pub fn is_root() -> bool {
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// The test named `test` cannot run: `missing` says why and what to do. Panics, unless
/// [`ALLOW_SKIP_ENV`] is `1`: then it prints a line and the caller returns.
pub fn unmet(test: &str, missing: &str) {
    if std::env::var_os(ALLOW_SKIP_ENV).is_some_and(|v| v == "1") {
        eprintln!("SKIPPED {test}: {missing} ({ALLOW_SKIP_ENV}=1)");
        return;
    }
    panic!("{test} cannot run: {missing} (set {ALLOW_SKIP_ENV}=1 to skip it instead; CI never does)");
}
