#!/usr/bin/env bash
# The README's first command as a newcomer runs it: on a fresh Debian 12 root (bookworm minbase with
# ca-certificates, the smallest Debian 12 a machine has: no Rust, no compiler, no git, no sudo),
# the repository's HEAD copied in, `bash demo/run.sh` as root. Nothing of this machine's toolchain
# or caches is used inside: it installs its packages, Rust through rustup and Debian's containerd
# on its own, so it needs this machine's Debian mirror and the network (crates.io, rustup).
#
#   bash tests/fresh-root.sh            (as root; 15-25 minutes on 2 cores, most of it compiling)
#   bash tests/fresh-root.sh --tests    (then also `bash tests/run.sh` there: over an hour)
#
# Not a step of tests/run.sh: compiling everything from nothing does not fit CI's budget. The root
# is the / of a private mount namespace, so nothing is mounted or installed on this machine;
# the demo's output is kept in target/fresh-root/.
set -euo pipefail
cd "$(dirname "$0")/.."
die() { echo "fresh-root: FAIL: $*" >&2; exit 1; }
say() { echo "fresh-root: $*"; }

if [ "${1:-}" = "--in-namespace" ]; then
    R=$2 tests=$3
    . tests/support/root-namespace.sh
    mount_root "$R"
    # The root becomes this namespace's / (pivot_root, not chroot): `runc exec` does not work
    # from inside a chroot (opencontainers/runc#1499), and on a machine there is none.
    cd "$R"
    mkdir -p .old-root
    pivot_root . .old-root
    cd /
    umount -l /.old-root
    rmdir /.old-root
    # Everything else in this mount namespace, by namespace (paths of roots mean nothing here now).
    # shellcheck disable=SC2317 # not unreachable: it is the EXIT trap set just below
    stop_namespace_processes() {
        local p me
        me=$(readlink /proc/self/ns/mnt)
        for p in /proc/[0-9]*; do
            [ "${p#/proc/}" = "$$" ] && continue
            [ "$(readlink "$p/ns/mnt" 2>/dev/null)" = "$me" ] && kill -KILL "${p#/proc/}" 2>/dev/null
        done
        return 0
    }
    trap stop_namespace_processes EXIT
    # As a login shell of root would have it; commands exactly as the README writes them.
    run() {
        /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
            HOME=/root LC_ALL=C.UTF-8 TERM=dumb bash -c "cd /root/gpu-mps && $1"
    }
    say "inside: $(cat /etc/debian_version), $(sh -c 'command -v cargo gcc git sudo' | wc -l) of cargo/gcc/git/sudo present"
    start=$(date +%s)
    run "bash demo/run.sh" || die "bash demo/run.sh failed after $(( $(date +%s) - start )) s"
    say "bash demo/run.sh: ok in $(( $(date +%s) - start )) s"
    if [ "$tests" = yes ]; then
        start=$(date +%s)
        run "bash tests/run.sh" || die "bash tests/run.sh failed after $(( $(date +%s) - start )) s"
        say "bash tests/run.sh: ok in $(( $(date +%s) - start )) s"
    fi
    # What the README's commands left on the machine (README "What the tests need").
    sizes=""
    for d in /root/gpu-mps/target /root/gpu-mps/fuzz/target /root/.rustup /root/.cargo /root/.cache/gpu-mps /usr; do
        [ -d "$d" ] && sizes="$sizes, $d $(du -sxh "$d" 2>/dev/null | cut -f1)"
    done
    say "disk: the root holds $(du -sxh / 2>/dev/null | cut -f1)$sizes"
    exit 0
fi

tests=no
case "${1:-}" in
    "") ;;
    --tests) tests=yes ;;
    -h | --help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) die "unknown argument '$1' (allowed: --tests, --help)" ;;
esac
[ "$(id -u)" = 0 ] || die "run as root (mmdebstrap, chroot, mounts): bash tests/fresh-root.sh"
export GPU_MPS_CACHE=${GPU_MPS_CACHE:-$HOME/.cache/gpu-mps}
command -v unshare >/dev/null || die "unshare not found (apt-get install util-linux)"

root_tar=$(bash tests/support/debian-root.sh deb-root --variant=minbase --include=ca-certificates)
W=$(mktemp -d /tmp/gpu-mps-fresh.XXXXXX)
trap 'rm -rf "$W"' EXIT
R=$W/root
mkdir -p "$R"
tar -xf "$root_tar" -C "$R"
. tests/support/debian-mirror.sh
echo "deb $(debian_mirror) bookworm main" >"$R/etc/apt/sources.list"
cp /etc/resolv.conf "$R/etc/resolv.conf"
# How this machine's apt reaches its mirror (`Acquire::` settings: a mirror that serves a snapshot
# needs its Valid-Until checks off), as a machine of its network would have it.
for conf in /etc/apt/apt.conf.d/*; do
    # shellcheck disable=SC2015 # meant: skip the file when any of the three fails
    [ -f "$conf" ] && [ ! -e "$R$conf" ] && grep -q '^[[:space:]]*Acquire::' "$conf" || continue
    cp "$conf" "$R$conf"
    say "apt settings of this machine added: $conf"
done
# The local certificate authorities this machine trusts (a network that inspects TLS has its own):
# a machine of this network would have them too. Debian's own stay as the root has them.
if ls /usr/local/share/ca-certificates/*.crt >/dev/null 2>&1; then
    mkdir -p "$R/usr/local/share/ca-certificates"
    cp /usr/local/share/ca-certificates/*.crt "$R/usr/local/share/ca-certificates/"
    chroot "$R" update-ca-certificates >/dev/null
    say "local CAs of this machine added: $(cd /usr/local/share/ca-certificates && echo *.crt)"
fi
mkdir -p "$R/root/gpu-mps"
git archive HEAD | tar -x -C "$R/root/gpu-mps"
say "root from $root_tar, HEAD $(git rev-parse --short HEAD)$(git status --porcelain | grep -q . && echo ' (uncommitted changes are not in it)')"

rc=0
unshare --mount bash "$0" --in-namespace "$R" "$tests" 2>&1 | tee "$W/out.log" || rc=$?
mkdir -p target/fresh-root
cp "$W/out.log" target/fresh-root/out.log
# shellcheck disable=SC2015 # meant: fail when either the run or the grep fails
[ "$rc" = 0 ] && grep -q 'bash demo/run.sh: ok' "$W/out.log" || die "see target/fresh-root/out.log"
say "ok"
