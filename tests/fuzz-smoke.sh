#!/usr/bin/env bash
# Fuzz smoke test (issue 8): builds every cargo-fuzz target in fuzz/ and runs each for a bounded
# time from its seed corpus (fuzz/corpus/<target>); fails on any crash, panic or hang.
#   bash tests/fuzz-smoke.sh                      # 10 s per target, no sanitizer
#   FUZZ_SECONDS=300 bash tests/fuzz-smoke.sh     # a longer run
#   FUZZ_SANITIZER=address bash tests/fuzz-smoke.sh
#   bash tests/fuzz-smoke.sh --build-only         # install and build, run nothing (tests/run.sh)
# Needs only the stable toolchain: cargo-fuzz comes from crates.io (installed into ~/.cargo/bin
# when missing). Without a sanitizer it passes rustc no nightly-only flag; with one it passes
# -Zsanitizer, which stable rustc refuses unless RUSTC_BOOTSTRAP=1 (measured on 1.95.0).
# New inputs the run finds go to a temporary directory, never into the committed corpus; a crash
# is written to fuzz/artifacts/<target>/ and the command to reproduce it is printed.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=/dev/null # rustup's file, outside the repository
[ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"
export PATH="$HOME/.cargo/bin:$PATH"

build_only=no
case "${1:-}" in
    "") ;;
    --build-only) build_only=yes ;;
    *) echo "fuzz-smoke: unknown argument '$1' (allowed: --build-only)" >&2; exit 2 ;;
esac
seconds=${FUZZ_SECONDS:-10}
sanitizer=${FUZZ_SANITIZER:-none}
cargo_fuzz_version=0.13.2
[ "$sanitizer" = none ] || export RUSTC_BOOTSTRAP=1
# The toolchain of rust-toolchain.toml (a stable one: a nightly that happens to be installed is
# not what makes this pass), unless FUZZ_TOOLCHAIN names another.
if [ -n "${FUZZ_TOOLCHAIN:-}" ]; then export RUSTUP_TOOLCHAIN=$FUZZ_TOOLCHAIN; fi

phase_start=$SECONDS
phase() { # name: prints the seconds since the previous phase ended
    echo "fuzz-smoke: $1 took $((SECONDS - phase_start)) s"
    phase_start=$SECONDS
}

# libfuzzer-sys compiles libFuzzer itself, which is C++.
if ! command -v c++ >/dev/null; then
    as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends g++
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "fuzz-smoke: installing cargo-fuzz $cargo_fuzz_version into ~/.cargo/bin"
    cargo install cargo-fuzz --locked --version "$cargo_fuzz_version"
fi
phase "install ($(cargo fuzz --version), $(rustc --version))"

cargo fuzz build --sanitizer "$sanitizer"
phase "build (sanitizer $sanitizer)"
[ "$build_only" = yes ] && exit 0

bin_dir=fuzz/target/$(rustc -vV | sed -n 's/^host: //p')/release
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failed=()
printf '%-26s %12s %8s %8s  %s\n' target executions seconds corpus result
for target in $(cargo fuzz list); do
    mkdir -p "$work/$target" "fuzz/artifacts/$target" "fuzz/corpus/$target"
    log=$work/$target.log
    # A 10 s limit per input: anything slower is a hang to report, not a run to wait out.
    if "$bin_dir/$target" "$work/$target" "fuzz/corpus/$target" -max_total_time="$seconds" \
        -timeout=10 -artifact_prefix="fuzz/artifacts/$target/" >"$log" 2>&1; then
        result=ok
    else
        result="FAILED (exit $?)"
        failed+=("$target")
    fi
    runs=$(sed -n 's/^Done \([0-9]*\) runs in \([0-9]*\) second.*/\1/p' "$log")
    took=$(sed -n 's/^Done \([0-9]*\) runs in \([0-9]*\) second.*/\2/p' "$log")
    corpus=$(find "fuzz/corpus/$target" -type f | wc -l)
    printf '%-26s %12s %8s %8s  %s\n' "$target" "${runs:--}" "${took:--}" "$corpus" "$result"
    if [ "$result" != ok ]; then
        grep -E -A12 'panicked at|ERROR: libFuzzer|SUMMARY' "$log" | head -40 || tail -40 "$log"
        artifact=$(sed -n 's/.*Test unit written to \(.*\)$/\1/p' "$log" | tail -1)
        [ -n "$artifact" ] && echo "reproduce: RUSTC_BOOTSTRAP=1 cargo fuzz run --sanitizer $sanitizer $target $artifact"
    fi
done
phase "run ($seconds s per target)"

if [ ${#failed[@]} -gt 0 ]; then
    echo "fuzz-smoke: FAILED: ${failed[*]}"
    exit 1
fi
echo "fuzz-smoke: every target ran without a crash"
