#!/usr/bin/env bash
# The licences, sources and duplicate crates of every dependency, by cargo deny (deny.toml).
#   bash tests/deny.sh                  install cargo-deny if missing, then check
#   bash tests/deny.sh --install-only   (tests/support/prefetch.sh, ahead of the check)
# Advisories are not checked here: the RustSec database comes from GitHub, which the CI machine
# cannot reach (docs/adr/0017); `cargo deny check advisories` on a machine with network does it.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=/dev/null # rustup's file, outside the repository
[ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"
cargo_deny_version=0.20.2
install_only=no
case "${1:-}" in
    "") ;;
    --install-only) install_only=yes ;;
    *) echo "deny: unknown argument '$1' (allowed: --install-only)" >&2; exit 2 ;;
esac
if [ "$(cargo deny --version 2>/dev/null)" != "cargo-deny $cargo_deny_version" ]; then
    echo "deny: installing cargo-deny $cargo_deny_version into ~/.cargo/bin"
    cargo install cargo-deny --locked --version "$cargo_deny_version"
fi
[ "$install_only" = yes ] && exit 0
echo "deny: $(cargo deny --version)"
cargo deny check --hide-inclusion-graph licenses bans sources
