#!/usr/bin/env bash
# Adds a baseline commit's release binaries to .carry/ for tests/gpu/defence-cost.sh:
#   BASE=a8a6adc tests/gpu/pack-base.sh
# Builds BASE in a throwaway git worktree (its own target dir, seeded with this checkout's
# target/release), so this checkout is untouched.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
BASE=${BASE:?set BASE to the commit to compare against, e.g. BASE=a8a6adc}
tree=$(mktemp -d)/base
git worktree add -q --detach "$tree" "$BASE"
trap 'git worktree remove --force "$tree"' EXIT
# The dependencies this checkout built already are reused (their builds do not depend on the
# workspace's path); only the workspace's crates compile again.
[ -d target/release ] && mkdir -p "$tree/target" && cp -a target/release "$tree/target/"
(cd "$tree" && bash scripts/build-release.sh)
stage=$(mktemp -d)
cp "$tree"/target/dist/{gpu-mps-shim,gpu-mps-hook,gpu-mps-manager,gpu-mps} "$stage/"
mkdir -p .carry
tar -C "$stage" -cJf .carry/gpu-mps-bin-base.tar.xz .
git rev-parse --short "$BASE" >.carry/BASE-COMMIT
rm -rf "$stage"
du -sh .carry/gpu-mps-bin-base.tar.xz
