#!/usr/bin/env bash
# Every shell script here through ShellCheck (Debian's shellcheck package, which
# scripts/setup-debian.sh installs); any finding fails the run:
#   bash tests/shellcheck.sh
# The scripts: each *.sh file and each file whose first line is a sh/bash/dash shebang
# (.ci/run, the Debian maintainer scripts), tracked or new but not ignored (git ls-files), or
# every file outside target/ and .git where there is no git checkout (tests/fresh-root.sh copies
# the tree with git archive). Settings and the one check left off, with why: .shellcheckrc.
# A finding that is meant is disabled on its own line with a reason:
#   # shellcheck disable=SC2086 # $pulled is a space-separated list of package names
set -euo pipefail
cd "$(dirname "$0")/.."   # .shellcheckrc: sources are followed from the repository root
die() { echo "shellcheck: $*" >&2; exit 1; }
command -v shellcheck >/dev/null || die "shellcheck not found (bash scripts/setup-debian.sh installs it)"

if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    list_files() { git ls-files -z --cached --others --exclude-standard; }
else
    list_files() { find . \( -name .git -o -name target \) -prune -o -type f -print0 | sed -z 's|^\./||'; }
fi
scripts=()
while IFS= read -r -d '' f; do
    if [ ! -f "$f" ] || [ -L "$f" ]; then continue; fi
    first=""
    case "$f" in *.sh) ;; *) IFS= read -r -n 200 first <"$f" 2>/dev/null || true ;; esac
    if [[ $f == *.sh || $first =~ ^#!.*[/[:space:]](ba|da)?sh([[:space:]]|$) ]]; then scripts+=("$f"); fi
done < <(list_files | LC_ALL=C sort -zu)
[ ${#scripts[@]} -gt 0 ] || die "no shell scripts found"
echo "shellcheck: $(shellcheck --version | sed -n 's/^version: //p'), ${#scripts[@]} scripts"
shellcheck "${scripts[@]}" || die "findings above (fix them, or disable one on its line with the reason)"
echo "shellcheck: no findings"
