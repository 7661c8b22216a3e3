#!/usr/bin/env bash
# Builds the binaries of packaging/binaries.txt into target/dist/, the one place packaging takes
# them from: that file names each one, its cargo package and how it is linked (static: shim and
# hook, exec'd on every container start; dynamic: the rest), and why.
#
#   scripts/build-release.sh                 # this machine's architecture -> target/dist/
#   scripts/build-release.sh --arch arm64    # arm64 (GH200, Grace) from x86_64 -> target/dist-arm64/
# --arch arm64 cross-builds with Debian's cross toolchain (gcc-aarch64-linux-gnu, libc6-dev-arm64-cross,
# installed when missing) and rustup's aarch64-unknown-linux-gnu target (this script names the
# linker). There the shim and hook come out static but not PIE (rustc makes no static-pie for that
# target); the dynamic ones, linked against Debian 12's glibc, use symbols up to GLIBC_2.34.
set -euo pipefail
cd "$(dirname "$0")/.."

arch=native
while [ $# -gt 0 ]; do
    case $1 in
        --arch) arch=${2:-}; shift 2 || shift ;;
        --arch=*) arch=${1#--arch=}; shift ;;
        -h | --help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *) echo "build-release: unknown argument '$1' (allowed: --arch arm64; --help)" >&2; exit 2 ;;
    esac
done

# packaging/binaries.txt: `name package static|dynamic what it is`, # comments and blank lines.
list=packaging/binaries.txt
entries=$(awk '{ sub(/#.*/, "") } !NF { next }
    NF < 3 || ($3 != "static" && $3 != "dynamic") {
        printf "build-release: %s:%d: expected `name package static|dynamic what it is`, got: %s\n", FILENAME, FNR, $0 >"/dev/stderr"
        bad = 1; next
    }
    { print $1, $2, $3 } END { exit bad }' "$list")
static_packages=() dynamic_packages=()
while read -r _ package link; do
    if [ "$link" = static ]; then static_packages+=(-p "$package"); else dynamic_packages+=(-p "$package"); fi
done <<<"$entries"
# (cargo build with no -p would build the whole workspace)
if [ ${#static_packages[@]} -eq 0 ] || [ ${#dynamic_packages[@]} -eq 0 ]; then
    echo "build-release: $list names no static or no dynamic binary (this script builds both kinds)" >&2
    exit 1
fi

# On a fresh Debian 12 machine: the packages and the Rust toolchain a build needs (quick when all
# are there already).
bash scripts/setup-debian.sh >&2
# shellcheck source=/dev/null # rustup's file, outside the repository
[ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"
host=$(rustc -vV | awk '/^host:/ { print $2 }')
case $arch in amd64 | x86_64) [ "$host" = x86_64-unknown-linux-gnu ] && arch=native ;; esac
case $arch in
    native)
        target=$host
        dist=target/dist
        # The dynamic ones without --target: target/release, as `cargo build --release` gives.
        cargo build --release --locked "${dynamic_packages[@]}"
        dynamic_dir=target/release
        static_dir=target/$target/release
        static_args=()
        ;;
    arm64 | aarch64)
        target=aarch64-unknown-linux-gnu
        dist=target/dist-arm64
        # The cross linker, set here only: a native arm64 host links with its own cc.
        export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
        if [ "$host" != "$target" ] &&
            { ! command -v aarch64-linux-gnu-gcc >/dev/null || [ ! -f /usr/aarch64-linux-gnu/lib/libc.a ]; }; then
            as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
            as_root apt-get update -qq
            as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
                gcc-aarch64-linux-gnu libc6-dev-arm64-cross
        fi
        rustup target list --installed 2>/dev/null | grep -qx "$target" || rustup target add "$target"
        cargo build --release --locked --target "$target" "${dynamic_packages[@]}"
        dynamic_dir=target/$target/release
        # The static ones in a target dir of their own: same --target, other RUSTFLAGS, and sharing
        # one dir would rebuild every dependency at each switch.
        static_args=(--target-dir target/static)
        static_dir=target/static/$target/release
        ;;
    *)
        echo "build-release: --arch '$arch' is not supported on $host (allowed: arm64, or none for this machine's)" >&2
        exit 2
        ;;
esac
RUSTFLAGS='-C target-feature=+crt-static' cargo build --release --locked --target "$target" \
    "${static_args[@]}" "${static_packages[@]}"
# Made anew with the listed binaries only: the image copies the directory whole.
rm -rf "$dist"
mkdir -p "$dist"
while read -r name package link; do
    if [ "$link" = static ]; then from=$static_dir; else from=$dynamic_dir; fi
    cp "$from/$name" "$dist/" ||
        { echo "build-release: $list names $name, which cargo package $package did not build" >&2; exit 1; }
done <<<"$entries"
ls -la "$dist"
