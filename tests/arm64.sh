#!/usr/bin/env bash
# arm64 (GH200, Grace; issue 9): cross-builds gpu-mps-shim and gpu-mps-api for
# aarch64-unknown-linux-gnu and runs their tests under qemu-user, then the arm64 shim binary itself.
#   bash tests/arm64.sh
# Installs what it needs from Debian 12 (gcc-aarch64-linux-gnu, libc6-dev-arm64-cross,
# qemu-user-static) and rustup's aarch64 target. .cargo/config.toml names the linker and makes
# qemu-aarch64-static the runner, so `cargo test --target aarch64-unknown-linux-gnu` runs each test
# binary under it.
# Run: the shim's unit tests, its golden cases (tests/golden.rs) and bad inputs (tests/bad_input.rs),
# and gpu-mps-api's unit tests. Not run: shim/tests/cli.rs, which spawns the built gpu-mps-shim as
# a child; under qemu-user that exec goes to the host kernel, which cannot run an arm64 binary
# without a binfmt_misc entry for qemu (a setting of the whole host, which CI does not make). The
# smoke test at the end runs that binary through qemu instead: --version, which reads the node
# config and execs runc.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"
export CARGO_INCREMENTAL=0
target=aarch64-unknown-linux-gnu
sysroot=/usr/aarch64-linux-gnu
start=$SECONDS
die() { echo "arm64: $*" >&2; exit 1; }

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

phase=$SECONDS
cargo test --locked --target "$target" -p gpu-mps-shim -p gpu-mps-api --no-run
echo "arm64: cross build took $((SECONDS - phase)) s"
phase=$SECONDS
cargo test --locked --target "$target" -p gpu-mps-shim -p gpu-mps-api --lib --test golden --test bad_input -- --nocapture
echo "arm64: tests under qemu took $((SECONDS - phase)) s"

# The shim binary itself on arm64: it reads the node config and execs runc (here a fake one).
shim=${CARGO_TARGET_DIR:-target}/$target/debug/gpu-mps-shim
# ELF e_machine (2 bytes at offset 18, little-endian): 0xb7 is EM_AARCH64.
[ "$(od -An -tx1 -j18 -N2 "$shim" | tr -d ' \n')" = b700 ] || die "$shim is not an arm64 ELF binary"
smoke=$(mktemp -d)
trap 'rm -rf "$smoke"' EXIT
printf '#!/bin/sh\n[ "$1" = --version ] && echo "runc version 0.0.0-arm64-smoke"\n' >"$smoke/runc"
chmod 755 "$smoke/runc"
printf 'root = "%s"\nrunc_path = "%s"\n' "$smoke/root" "$smoke/runc" >"$smoke/config.toml"
version=$(awk -F'"' '/^\[workspace.package\]/ { p = 1 } p && /^version *=/ { print $2; exit }' Cargo.toml)
want=$(printf 'gpu-mps-shim version %s\nrunc version 0.0.0-arm64-smoke' "$version")
got=$(GPU_MPS_CONFIG=$smoke/config.toml qemu-aarch64-static -L "$sysroot" "$shim" --version) ||
    die "the arm64 gpu-mps-shim --version failed under qemu"
[ "$got" = "$want" ] || die "the arm64 gpu-mps-shim --version printed '$got', expected '$want'"
echo "arm64: $shim --version under qemu: $(tr '\n' ',' <<<"$got")"
echo "arm64: all passed in $((SECONDS - start)) s"
