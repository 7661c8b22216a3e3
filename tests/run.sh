#!/usr/bin/env bash
# The test command (README, .ci/run): everything that can run without a GPU.
#   bash tests/run.sh
# Installs its prerequisites, fetches containerd 1.6 / 1.7 / 2.x + runc from Debian into a private
# cache, checks format and lints, builds, then runs the unit tests, the shim/manager/hook
# integration tests and the end-to-end suites on real containerd through ctr and the CRI API,
# then the dependencies' licences (cargo deny) and a bounded run of every fuzz target.
# Needs root (containerd, runc and mounts). The GPU suite is tests/gpu/run.sh, on a GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "tests/run.sh: run as root (containerd and runc need it): sudo bash tests/run.sh" >&2; exit 1; }
bash scripts/setup-debian.sh
# shellcheck source=/dev/null # rustup's file, outside the repository
[ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"
export GPU_MPS_CACHE=${GPU_MPS_CACHE:-$HOME/.cache/gpu-mps}
bash tests/support/fetch-containerd.sh "$GPU_MPS_CACHE"
for s in "$GPU_MPS_CACHE"/containerd/*/; do echo "containerd suite $(basename "$s"): $(tr '\n' ' ' <"$s/VERSIONS")"; done

# CI builds once from a fresh clone: incremental state would only take disk (3 GB of 15 at 7df373a).
if [ -n "${CI:-}" ]; then export CARGO_INCREMENTAL=0; fi
echo "disk before the build: $(df -h --output=avail,size . | tail -n1 | awk '{print $1 " free of " $2}')"
step() { echo; echo "=== $* ($(date -u +%T), $((SECONDS / 60)) min $((SECONDS % 60)) s in)"; }
mkdir -p target
# Downloads for the packaging steps while the workspace compiles, then those steps' own builds at
# the lowest CPU priority (tests/support/prefetch.sh --prebuild), in a process group of its own
# that ends with this script.
setsid bash tests/support/prefetch.sh --prebuild >target/prefetch.log 2>&1 &
prefetch=$!
trap 'kill -- -"$prefetch" 2>/dev/null || true' EXIT
step "shellcheck"; bash tests/shellcheck.sh   # every shell script, *.sh or by shebang, with no finding (.shellcheckrc)
step "format";  cargo fmt --all -- --check
step "clippy";  cargo clippy --workspace --all-targets --locked -- -D warnings
step "build";   cargo build --workspace --bins --locked
RUSTFLAGS='-C target-feature=+crt-static' cargo build -p gpu-mps-checker --target x86_64-unknown-linux-gnu --locked
step "tests";   cargo test --workspace --locked -- --nocapture 2>&1 | tee target/test-output.log
step "prefetch and prebuild"
# shellcheck disable=SC2015 # meant: the message when the prefetch failed or logged nothing
wait "$prefetch" && grep '^prefetch: ' target/prefetch.log ||
    { echo "prefetch failed (each step fetches and builds for itself):"; tail -n5 target/prefetch.log; }
step "deny"; bash tests/deny.sh   # licences, sources, duplicate crates of every dependency (deny.toml, docs/adr/0017)
step "metrics"; bash tests/metrics.sh   # the manager's /metrics, checked with promtool (docs/metrics.md)
step "image"; bash tests/image.sh   # the DaemonSet image: built with buildah, run through CRI (packaging/README.md)
step "debian package"; bash tests/deb.sh   # install, run a container, purge in a fresh Debian 12 root (packaging/README.md)
step "manifests"; bash tests/manifests.sh   # kustomize + Helm renders, schema-checked (packaging/README.md)
step "arm64"; bash tests/arm64.sh   # shim + api tests cross-built, run under qemu-user (packaging/README.md "arm64")
step "fuzz smoke"; FUZZ_SECONDS=${FUZZ_SECONDS:-5} bash tests/fuzz-smoke.sh   # every cargo-fuzz target 5 s from its corpus (docs/fuzz-results.md)
step "disk"
echo "target/ takes $(du -sh target | cut -f1); $(df -h --output=avail . | tail -n1 | tr -d ' ') free"
step "versions tested"
grep -hoE 'suite [a-z]+: containerd [^,]+, runc [^ |]+' target/test-output.log | sort -u || true
