#!/usr/bin/env bash
# Installs what building and testing gpu-mps needs on a Debian 12 machine, idempotently:
# apt packages (as root, or through sudo) and, through rustup, the Rust toolchain that
# rust-toolchain.toml pins (rustup itself when cargo is missing or older than the workspace
# needs). containerd is NOT installed system-wide: the tests and the demo fetch Debian's
# containerd + runc into a private cache (tests/support/fetch-containerd.sh).
set -euo pipefail

need_rust="1.85"
repo=$(cd "$(dirname "$0")/.." && pwd)   # where rust-toolchain.toml is
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

# The last one, shellcheck, is for tests/shellcheck.sh (a step of tests/run.sh); the demo needs the rest.
packages=(ca-certificates curl git gcc libc6-dev pkg-config protobuf-compiler xz-utils iproute2 python3 shellcheck)
missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "setup: installing ${missing[*]}"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# shellcheck source=/dev/null # rustup's file, outside the repository
[ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"
version_ok() { # rustc >= need_rust ?
    local have
    have=$(rustc --version 2>/dev/null | awk '{print $2}') || return 1
    [ -n "$have" ] && [ "$(printf '%s\n%s\n' "$need_rust" "$have" | sort -V | head -n1)" = "$need_rust" ]
}
if ! command -v cargo >/dev/null || ! version_ok; then
    if command -v rustup >/dev/null; then
        :   # the pinned toolchain is installed below
    else
        # rustup-init itself, from where the sh.rustup.rs script fetches it, checked against its
        # published sha256 (some networks reach static.rust-lang.org but not sh.rustup.rs).
        echo "setup: installing rustup, then the toolchain of rust-toolchain.toml"
        init_url=https://static.rust-lang.org/rustup/dist/$(uname -m)-unknown-linux-gnu/rustup-init
        init_dir=$(mktemp -d)
        curl --proto '=https' --tlsv1.2 -sSf -o "$init_dir/rustup-init" "$init_url"
        want=$(curl --proto '=https' --tlsv1.2 -sSf "$init_url.sha256" | awk '{ print $1 }')
        [ "$(sha256sum "$init_dir/rustup-init" | awk '{ print $1 }')" = "$want" ] ||
            { echo "setup: $init_url does not match its published sha256" >&2; exit 1; }
        chmod +x "$init_dir/rustup-init"
        "$init_dir/rustup-init" -y --profile minimal --default-toolchain none
        rm -rf "$init_dir"
        # shellcheck source=/dev/null # rustup's file, outside the repository
        . "$HOME/.cargo/env"
    fi
fi
# With no argument rustup installs what rust-toolchain.toml names, with its components; a no-op
# when it is there.
if command -v rustup >/dev/null; then (cd "$repo" && rustup toolchain install); fi
echo "setup: $(cd "$repo" && rustc --version), $(protoc --version)"
