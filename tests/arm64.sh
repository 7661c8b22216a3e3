#!/usr/bin/env bash
# arm64 (GH200, Grace; issue 9): cross-builds gpu-mps-shim and gpu-mps-api for
# aarch64-unknown-linux-gnu and runs their tests under qemu-user, the arm64 shim binary's included.
#   bash tests/arm64.sh
#   bash tests/arm64.sh --build-only    (the cross build alone: tests/run.sh runs it in the background)
# Installs what it needs from Debian 12 (gcc-aarch64-linux-gnu, libc6-dev-arm64-cross,
# qemu-user-static) and rustup's aarch64 target. It names the linker and makes qemu-aarch64-static
# the runner through CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_* (not .cargo/config.toml, which would
# also apply on a native arm64 host, where no qemu is wanted), so `cargo test --target aarch64-unknown-linux-gnu` runs each test
# binary under it.
# Run: the shim's unit tests, golden cases (tests/golden.rs), bad inputs (tests/bad_input.rs) and
# CLI tests (tests/cli.rs), and gpu-mps-api's unit tests. The CLI tests exec the built gpu-mps-shim;
# under qemu-user such an exec goes to the host kernel, which runs an arm64 binary only with a
# binfmt_misc entry for qemu (a setting of the whole host, which CI does not make). So for them the
# shim's path holds, for the run, a script that execs qemu on the arm64 shim, with its argv[0].
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=/dev/null # rustup's file, outside the repository
[ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"
export CARGO_INCREMENTAL=0
target=aarch64-unknown-linux-gnu
sysroot=/usr/aarch64-linux-gnu
start=$SECONDS
die() { echo "arm64: $*" >&2; exit 1; }
build_only=no
case "${1:-}" in
    "") ;;
    --build-only) build_only=yes ;;
    *) die "unknown argument '$1' (allowed: --build-only)" ;;
esac

missing=()
command -v aarch64-linux-gnu-gcc >/dev/null || missing+=(gcc-aarch64-linux-gnu)
[ -f "$sysroot/lib/libc.so.6" ] || missing+=(libc6-dev-arm64-cross)
command -v qemu-aarch64-static >/dev/null || missing+=(qemu-user-static)
if [ ${#missing[@]} -gt 0 ]; then
    echo "arm64: installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
rustup target list --installed | grep -qx "$target" || rustup target add "$target"
echo "arm64: $(aarch64-linux-gnu-gcc --version | head -n1), $(qemu-aarch64-static --version | head -n1), $(rustc --version); ready after $((SECONDS - start)) s"

export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
# -L: the arm64 glibc and loader of libc6-arm64-cross, for the dynamically linked test binaries.
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64-static -L /usr/aarch64-linux-gnu"
shim=${CARGO_TARGET_DIR:-target}/$target/debug/gpu-mps-shim
# A run killed before its trap left the stand-in script in the shim's place: put the shim back.
[ -f "$shim.arm64" ] && mv -f "$shim.arm64" "$shim"

phase=$SECONDS
built=$(cargo test --locked --target "$target" -p gpu-mps-shim -p gpu-mps-api --no-run 2>&1) ||
    { echo "$built" >&2; die "the cross build failed"; }
echo "$built"
cli=$(sed -n 's|^ *Executable tests/cli.rs (\(.*\))$|\1|p' <<<"$built")
[ -x "$cli" ] || die "cargo built no shim/tests/cli.rs binary (its 'Executable tests/cli.rs' line is missing)"
case $cli in /*) ;; *) cli=$PWD/$cli ;; esac
echo "arm64: cross build took $((SECONDS - phase)) s"
[ "$build_only" = yes ] && exit 0

phase=$SECONDS
cargo test --locked --target "$target" -p gpu-mps-shim -p gpu-mps-api --lib --test golden --test bad_input -- --nocapture

# ELF e_machine (2 bytes at offset 18, little-endian): 0xb7 is EM_AARCH64.
[ "$(od -An -tx1 -j18 -N2 "$shim" | tr -d ' \n')" = b700 ] || die "$shim is not an arm64 ELF binary"
mv "$shim" "$shim.arm64"
trap 'mv -f "$shim.arm64" "$shim"' EXIT
printf '#!/bin/sh\nexec qemu-aarch64-static -L %s -0 "$0" "$0.arm64" "$@"\n' "$sysroot" >"$shim"
chmod 755 "$shim"
(cd shim && qemu-aarch64-static -L "$sysroot" "$cli" --nocapture)
echo "arm64: tests under qemu took $((SECONDS - phase)) s"
echo "arm64: all passed in $((SECONDS - start)) s"
