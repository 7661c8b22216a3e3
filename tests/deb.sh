#!/usr/bin/env bash
# The Debian package's round trip in a fresh Debian 12 root (issue 9, item 6):
#   1. build it from the release binaries (scripts/build-release.sh) and check it with Debian 12's
#      lintian (no error or warning left but the commented overrides; info and pedantic tags are
#      shown, not fatal: an unused override is one, and the spelling noise in binaries comes and
#      goes with builds); build the arm64 layout with stubs;
#   2. in a fresh bookworm minbase root (tests/support/debian-root.sh, chroot in a private mount
#      namespace): `apt-get install ./gpu-mps_*.deb` pulls containerd and runc from the mirror,
#      registers the gpu-mps handler (/usr/bin/gpu-mps-shim) with containerd;
#   3. start containerd (Debian's, from that install) and the manager as the unit's ExecStart does,
#      on a fake GPU with the fake MPS daemon (no systemd runs in a chroot); run a container of an
#      image imported from a tarball through the registered shim; it must get a lease and be served;
#   4. `apt-get remove gpu-mps` (binaries, registration and the state root go: the node config names
#      root = "/run/gpu-mps-custom", which prerm's `gpu-mps node remove-state` removes, and postrm
#      the empty /run/gpu-mps; the config and the backups of containerd's config stay),
#      `apt-get purge gpu-mps`, then compare a listing (type,
#      mode, owner, link, sha256) of the whole root with the one taken before the install. What may
#      differ is listed in `allowed`:
#      apt and dpkg state and logs, the packages apt pulled in (checked with dpkg --verify, which
#      also proves containerd's config is back byte for byte), containerd's own state from its run.
#
#   bash tests/deb.sh          (as root; CI: tests/run.sh)
#
# Needs root, network access to this machine's Debian mirror; caches under $GPU_MPS_CACHE.
set -euo pipefail
cd "$(dirname "$0")/.."
die() { echo "deb.sh: FAIL: $*" >&2; exit 1; }
say() { echo "deb.sh: $*"; }
# The binaries the package must ship, sorted: packaging/binaries.txt's first column.
listed_binaries() { awk '{ sub(/#.*/, "") } NF { print $1 }' packaging/binaries.txt | LC_ALL=C sort; }

# Phase 2-4 run here, in a private mount namespace (re-executed by phase 1): every mount is gone
# when it ends, whatever happens.
if [ "${1:-}" = "--in-namespace" ]; then
    W=$2 deb=$3
    R=$W/root F=$W/files
    . tests/support/root-namespace.sh
    mount_root "$R"
    mount -t tmpfs -o mode=1777 tmpfs "$R/tmp"
    mount --bind "$F" "$R/mnt"
    in_root() {
        chroot "$R" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LC_ALL=C.UTF-8 \
            DEBIAN_FRONTEND=noninteractive "$@"
    }
    # For a daemon started with `&`: $! is then the daemon itself.
    exec_in_root() {
        exec chroot "$R" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LC_ALL=C.UTF-8 "$@"
    }
    trap 'stop_root_processes "$R"' EXIT

    # The listing of the root: /proc, /sys, /dev and /mnt (the test's own files) are mounts.
    listing() {
        (cd "$R" && find . \( -path ./proc -o -path ./sys -o -path ./dev -o -path ./mnt \) -prune -o \
            -printf '%p\t%y\t%m\t%u:%g\t%l\n' | LC_ALL=C sort) >"$W/$1.meta"
        (cd "$R" && find . \( -path ./proc -o -path ./sys -o -path ./dev -o -path ./mnt \) -prune -o \
            -type f -print0 | xargs -0 sha256sum | awk '{ print $2 "\t" $1 }' | LC_ALL=C sort) >"$W/$1.sums"
    }

    say "fresh root: $(in_root cat /etc/debian_version), $(in_root dpkg-query -W -f '.\n' | wc -l) packages"
    listing before
    in_root dpkg-query -W -f '${Package}\n' | sort >"$W/packages.before"
    for p in containerd runc; do
        ! grep -qx "$p" "$W/packages.before" || die "the fresh root already has $p"
    done

    say "apt-get install ./$(basename "$deb")"
    in_root apt-get update -qq >"$F/apt.log" 2>&1 || { cat "$F/apt.log"; die "apt-get update in the root"; }
    # Without the Recommends of containerd and runc (criu, python3, ...): they are not gpu-mps's,
    # and their maintainer scripts' files (certificates, caches) would make the comparison below
    # about them. The Depends are what is tested.
    (in_root sh -c "cd /mnt && apt-get install -y --no-install-recommends ./$(basename "$deb")") >"$F/install.log" 2>&1 ||
        { cat "$F/install.log"; die "apt-get install ./$(basename "$deb")"; }
    sed -n '/^gpu-mps: /p; /^containerd config/p; /BinaryName/p; /^Setting up gpu-mps /p' "$F/install.log"
    in_root dpkg-query -W -f '${Package}\n' | sort >"$W/packages.after"
    pulled=$(comm -13 "$W/packages.before" "$W/packages.after" | { grep -vx gpu-mps || true; } | tr '\n' ' ')
    say "apt pulled in: $pulled"
    for p in containerd runc; do
        case " $pulled " in *" $p "*) ;; *) die "apt-get install did not pull in $p (pulled: $pulled)" ;; esac
    done
    auto=$(in_root apt-mark showauto | tr '\n' ' ')
    case " $auto " in *" containerd "*) ;; *) die "containerd is not marked as installed automatically: $auto" ;; esac
    for b in $(listed_binaries); do
        [ -x "$R/usr/bin/$b" ] || die "/usr/bin/$b is not installed"
    done
    [ -z "$(ls -A "$R/usr/local/bin")" ] || die "the package wrote into /usr/local/bin: $(ls "$R/usr/local/bin")"
    # Enabled for the next boot (deb-systemd-helper works without a running systemd; on merged /usr
    # it names the unit by /lib/systemd/system, the same directory).
    wants=$(readlink "$R/etc/systemd/system/multi-user.target.wants/gpu-mps-manager.service" || true)
    case "$wants" in
    /lib/systemd/system/gpu-mps-manager.service | /usr/lib/systemd/system/gpu-mps-manager.service) ;;
    *) die "postinst did not enable gpu-mps-manager.service (multi-user.target.wants: '$wants')" ;;
    esac
    grep -q '^gpu-mps: the containerd config changed' "$F/install.log" ||
        die "postinst did not say that the containerd config changed"
    # postinst reads runc_path and hook_path with `gpu-mps config get`: both are there.
    ! grep -q 'which does not exist' "$F/install.log" ||
        die "postinst warned of a runc or hook that is installed: $(grep 'which does not exist' "$F/install.log")"
    [ "$(in_root gpu-mps config get hook_path)" = /usr/bin/gpu-mps-hook ] ||
        die "gpu-mps config get hook_path in the root: $(in_root gpu-mps config get hook_path 2>&1)"

    # What containerd itself makes of its config: the gpu-mps entry names the packaged shim.
    in_root containerd config dump >"$F/config-dump.toml" 2>"$F/config-dump.err" ||
        { cat "$F/config-dump.err"; die "containerd config dump"; }
    shim=$(awk '/^ *\[.*runtimes\.gpu-mps\.options\]/ { inside = 1; next } /^ *\[/ { inside = 0 }
        inside && $1 == "BinaryName" { gsub(/"/, "", $3); print $3 }' "$F/config-dump.toml")
    [ "$shim" = /usr/bin/gpu-mps-shim ] ||
        die "containerd's gpu-mps runtime has BinaryName '$shim', not /usr/bin/gpu-mps-shim (dump: $F/config-dump.toml)"
    say "containerd registers runtime gpu-mps with BinaryName = $shim"

    # The admin's part: a node without a GPU runs the fake MPS daemon and keeps the compute mode;
    # the state root is not the default one, which the package's removal must find in the config.
    root=/run/gpu-mps-custom
    sed -i -e 's|^control_binary = .*|control_binary = "/mnt/fake-mps-control"|' \
        -e "s|^# root = .*|root = \"$root\"|" \
        -e 's|^exclusive_process = .*|exclusive_process = false|' \
        -e 's|^idle_grace_seconds = .*|idle_grace_seconds = 1|' "$R/etc/gpu-mps/config.toml"
    grep -qx 'hook_path = "/usr/bin/gpu-mps-hook"' "$R/etc/gpu-mps/config.toml" ||
        die "the shipped /etc/gpu-mps/config.toml does not set hook_path = \"/usr/bin/gpu-mps-hook\""
    [ "$(in_root gpu-mps config get root)" = "$root" ] ||
        die "no line '# root = ...' in the shipped config to set root = \"$root\": gpu-mps config get root says $(in_root gpu-mps config get root 2>&1)"
    gpu=GPU-deb00000-0000-0000-0000-000000000000
    printf '{"source":"tests/deb.sh","gpus":[{"index":0,"minor":0,"uuid":"%s","name":"Fake GPU (test double)","memory_bytes":17179869184,"compute_mode":"Default","mig_enabled":false}]}\n' \
        "$gpu" >"$F/inventory.json"

    say "starting containerd and gpu-mps-manager (as the unit's ExecStart, on a fake GPU)"
    exec_in_root containerd >"$F/containerd.log" 2>&1 &
    containerd=$!
    exec_start=$(sed -n 's/^ExecStart=//p' "$R/usr/lib/systemd/system/gpu-mps-manager.service")
    [ "$exec_start" = /usr/bin/gpu-mps-manager ] || die "the unit's ExecStart is '$exec_start'"
    exec_in_root GPU_MPS_CONFIG=/etc/gpu-mps/config.toml "$exec_start" --fake-inventory /mnt/inventory.json \
        >"$F/manager.log" 2>&1 &
    manager=$!
    for _ in $(seq 100); do
        [ -S "$R/run/containerd/containerd.sock" ] && [ -S "$R$root/manager.sock" ] && break
        sleep 0.1
    done
    [ -S "$R/run/containerd/containerd.sock" ] || { tail -n 20 "$F/containerd.log"; die "containerd did not start"; }
    [ -S "$R$root/manager.sock" ] || { tail -n 20 "$F/manager.log"; die "gpu-mps-manager did not start on $root"; }

    # doctor, with no flag, checks the registration against the shim next to it: /usr/bin.
    in_root gpu-mps doctor >"$F/doctor.txt" 2>&1 || true
    doctor_line=$(grep -E '^[A-Z]+ +containerd ' "$F/doctor.txt" || true)
    case "$doctor_line" in
    PASS*"/usr/bin/gpu-mps-shim"*) say "gpu-mps doctor: $doctor_line" ;;
    *) cat "$F/doctor.txt"; die "gpu-mps doctor does not pass the containerd registration with /usr/bin/gpu-mps-shim" ;;
    esac

    image=$(in_root ctr images import /mnt/image.tar 2>&1 | awk '/^unpacking/ { print $2 }')
    [ -n "$image" ] || image=docker.io/gpu-mps/test:e2e
    # The shipped config takes no GPU from a container's env: the GPU is named as a CDI device.
    say "running a container of $image through $shim"
    in_root ctr run --rm --runtime io.containerd.runc.v2 --runc-binary "$shim" \
        --annotation "cdi.k8s.io/deb-test=nvidia.com/gpu=$gpu" --annotation gpu-mps.io/memory-limit=2Gi \
        --annotation gpu-mps.io/active-thread-percentage=30 "$image" deb-test \
        /checker mps-client --hold-seconds 4 >"$F/container.out" 2>&1 &
    run=$!
    lease=""
    for _ in $(seq 80); do
        lease=$(in_root gpu-mps leases --json 2>/dev/null | tr -d ' \n' || true)
        case "$lease" in *'"container_id":"deb-test"'*) break ;; esac
        sleep 0.1
    done
    wait "$run" || { cat "$F/container.out"; tail -n 20 "$F/manager.log"; die "the container failed"; }
    case "$lease" in
    *'"container_id":"deb-test"'*'"memory_limit_bytes":2147483648,"active_thread_percentage":30'*) ;;
    *) cat "$F/container.out"; die "no lease of 2Gi / 30 % for the container: gpu-mps leases said '$lease'" ;;
    esac
    served=$(grep -o 'SERVER [0-9]* THREADS [0-9.]* MEM [^"]*' "$F/container.out" | head -n1 || true)
    [ -n "$served" ] || { cat "$F/container.out"; die "the container's CUDA client was not served"; }
    say "the container got a lease (2Gi, 30 %) and was served: $served"

    # prerm would stop the unit (SIGTERM) on a systemd node; here nothing runs the unit. On
    # SIGTERM the manager stops the idle MPS daemon: nothing of gpu-mps may keep running.
    [ -z "$(in_root ctr tasks ls -q)" ] || die "a task is left in containerd: $(in_root ctr tasks ls -q)"
    kill -TERM "$manager"
    wait "$manager" || true
    kill -TERM "$containerd"
    wait "$containerd" || true
    left=""
    for p in /proc/[0-9]*; do
        [ "$(readlink "$p/root" 2>/dev/null)" = "$R" ] && left+=" ${p#/proc/}:$(tr '\0' ' ' <"$p/cmdline")"
    done
    [ -z "$left" ] || die "processes still run in the root after the manager and containerd stopped:$left"

    # A container that still holds a lease (its init process runs): the remove is refused and the
    # package stays, as the DaemonSet's uninstall refuses (`gpu-mps node live-leases`).
    sleep 120 &
    holder=$!
    ticks=$(sed 's/.*) //' "/proc/$holder/stat" | awk '{ print $20 }')
    mkdir -p "$R$root/leases"
    # Container id "abc": its lease file is named by the first 8 bytes of sha256("abc").
    printf '{"container_id":"abc","key":["%s"],"limits":{"memory_bytes":2147483648,"thread_percentage":30},"cuda_processes":1,"namespace":"","pod":"","container_name":"","bundle":"/b","process":{"pid":%s,"start_ticks":%s},"acquired_unix":1}' \
        "$gpu" "$holder" "$ticks" >"$R$root/leases/ba7816bf8f01cfea.json"
    say "apt-get remove gpu-mps while a container holds a lease (pid $holder)"
    if in_root apt-get remove -y gpu-mps >"$F/remove-refused.log" 2>&1; then
        cat "$F/remove-refused.log"
        die "apt-get remove went through under a running container's lease"
    fi
    grep -q "^gpu-mps: not removed: these containers still run with gpu-mps leases:" "$F/remove-refused.log" ||
        { cat "$F/remove-refused.log"; die "the refused remove did not say why"; }
    grep -q "^abc abc pid $holder on " "$F/remove-refused.log" ||
        { cat "$F/remove-refused.log"; die "the refused remove did not name the container"; }
    in_root dpkg-query -W -f '${Status}' gpu-mps | grep -qx "install ok installed" ||
        die "after the refused remove gpu-mps is not installed: $(in_root dpkg-query -W -f '${Status}' gpu-mps)"
    [ -x "$R/usr/bin/gpu-mps-shim" ] || die "the refused remove took gpu-mps-shim"
    say "refused: $(grep -c . "$F/remove-refused.log") lines, the package stays installed"
    kill "$holder"
    wait "$holder" 2>/dev/null || true
    rm -f "$R$root/leases/ba7816bf8f01cfea.json"

    [ -e "$R$root/state.json" ] || die "the manager left no state in $root: $(ls -A "$R$root")"
    # shellcheck disable=SC2012 # names the manager made (no odd characters), for the log only
    say "apt-get remove gpu-mps (the state root $root holds: $(ls -A "$R$root" | tr '\n' ' '))"
    in_root apt-get remove -y gpu-mps >"$F/remove.log" 2>&1 || { cat "$F/remove.log"; die "apt-get remove gpu-mps"; }
    sed -n '/^gpu-mps: /p; /^Removing /p' "$F/remove.log"
    # Removed: the binaries, the registration, the configured state root (no MPS daemon runs from
    # it) and the package's own /run/gpu-mps, empty.
    # Kept until the purge: the node config and the backups of containerd's config.
    for b in $(listed_binaries); do
        [ ! -e "$R/usr/bin/$b" ] || die "apt-get remove left /usr/bin/$b"
    done
    [ ! -e "$R$root" ] || die "apt-get remove left the state root $root: $(ls -A "$R$root")"
    # (apt ends the lines of the maintainer scripts with a carriage return: no -x)
    grep -q "^gpu-mps: removed the state root $root" "$F/remove.log" ||
        { cat "$F/remove.log"; die "prerm did not say that it removed the state root $root"; }
    [ ! -e "$R/run/gpu-mps" ] || die "apt-get remove left /run/gpu-mps: $(ls -A "$R/run/gpu-mps")"
    ! grep -qs gpu-mps-shim "$R/etc/containerd/config.toml" || die "apt-get remove left gpu-mps in containerd's config"
    [ -f "$R/etc/gpu-mps/config.toml" ] || die "apt-get remove did not keep /etc/gpu-mps/config.toml"
    # shellcheck disable=SC2012 # names the package made (no odd characters); ls prints nothing when none match
    backups=$(cd "$R" && ls etc/containerd/*.gpu-mps-backup.* 2>/dev/null | tr '\n' ' ')
    [ -n "$backups" ] || die "install-containerd made no backup of containerd's config, or remove deleted it"
    say "after the remove: binaries, registration, $root and /run/gpu-mps gone; kept /etc/gpu-mps/config.toml and $backups"

    say "apt-get purge gpu-mps"
    in_root apt-get purge -y gpu-mps >"$F/purge.log" 2>&1 || { cat "$F/purge.log"; die "apt-get purge gpu-mps"; }
    sed -n '/^gpu-mps: /p; /^Purging /p; /^Removing /p' "$F/purge.log"
    status=$(in_root dpkg-query -W -f '${db:Status-Abbrev}' gpu-mps 2>/dev/null || true)
    case "$status" in "" | "pn"*) ;; *) die "dpkg still knows gpu-mps after the purge: status '$status'" ;; esac
    # shellcheck disable=SC2086 # $pulled is a space-separated list of package names, one argument each
    in_root dpkg --verify $pulled >"$F/verify.txt" 2>&1 || true
    [ ! -s "$F/verify.txt" ] || { cat "$F/verify.txt"; die "files of the packages apt pulled in differ from the packages (dpkg --verify)"; }
    listing after

    # What may differ, and why (paths as find prints them, ./ first):
    allowed='^\./var/lib/apt/lists(/|$)'                # apt-get update
    allowed+='|^\./var/cache/(apt|debconf)(/|$)'        # apt's package cache, debconf's database
    allowed+='|^\./var/log/(apt(/|$)|dpkg\.log$|alternatives\.log$)'
    allowed+='|^\./var/lib/dpkg/(status|status-old|available|lock.*|triggers/.*|info/format)$'
    allowed+='|^\./var/lib/apt/extended_states$'
    allowed+='|^\./var/lib/(containerd|systemd)$'       # parents of the entries below
    allowed+='|^\./var/lib/containerd/'                 # containerd's own state from the test's run
    allowed+='|^\./run/containerd(/|$)'                 # and its runtime dir (a tmpfs on a node)
    allowed+='|^\./etc/cni(/net\.d)?$'                 # made by containerd's CRI plugin at its start
    allowed+='|^\./etc/systemd/system/multi-user\.target\.wants(/containerd\.service)?$'
    allowed+='|^\./var/lib/systemd/deb-systemd-helper-enabled(/.*containerd.*)?$'
    # The files of the packages apt pulled in (verified above), and dpkg's records of them.
    for p in $pulled; do
        # Merged /usr: a package's /lib/... is ./usr/lib/... in the listing.
        in_root dpkg-query -L "$p" | grep '^/' | sed -e 's|^|.|' -e 'p' -e 's#^\./\(lib\|lib64\|bin\|sbin\)/#./usr/\1/#'
        allowed+="|^\\./var/lib/dpkg/info/${p//./\\.}(:[a-z0-9]+)?\\."
    done >"$W/owned"
    unexpected() {
        ALLOWED=$allowed awk -F'\t' 'NR == FNR { owned[$1] = 1; next } !($1 in owned) && $1 !~ ENVIRON["ALLOWED"]' "$W/owned" "$1"
    }
    changed=$(diff <(unexpected "$W/before.meta") <(unexpected "$W/after.meta") || true)
    changed+=$(diff <(unexpected "$W/before.sums") <(unexpected "$W/after.sums") || true)
    [ -z "$changed" ] || { echo "$changed" | head -n 60; die "the purge left the root different from before the install (see above; < before, > after)"; }
    say "after the purge the root is as it was, but for apt/dpkg state and the $(echo "$pulled" | wc -w) packages apt pulled in ($(wc -l <"$W/after.meta") entries compared)"
    exit 0
fi

[ "$(id -u)" = 0 ] || die "run as root (chroot, mounts, containerd): bash tests/deb.sh"
start=$(date +%s)
export GPU_MPS_CACHE=${GPU_MPS_CACHE:-$HOME/.cache/gpu-mps}
export CARGO_INCREMENTAL=${CARGO_INCREMENTAL:-0}
# shellcheck source=/dev/null # rustup's file, outside the repository
[ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"

missing=()
command -v lintian >/dev/null || missing+=(lintian)
command -v dpkg-shlibdeps >/dev/null || missing+=(dpkg-dev)
command -v readelf >/dev/null || missing+=(binutils)
command -v unshare >/dev/null || missing+=(util-linux)
if [ ${#missing[@]} -gt 0 ]; then
    say "installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
say "$(lintian --version), $(dpkg-deb --version | head -n1)"

# Release binaries (a no-op when target/dist is current), the fake MPS daemon, the image.
bash scripts/build-release.sh >/dev/null
cargo build --locked -q -p fake-mps-control -p gpu-mps-e2e --bin fake-mps-control --bin test-image-archive
RUSTFLAGS='-C target-feature=+crt-static' cargo build --locked -q -p gpu-mps-checker --target x86_64-unknown-linux-gnu
say "binaries ready after $(( $(date +%s) - start )) s"

# The rule that gives an arm64 package its Depends (readelf, no arm64 libraries here) must agree
# with dpkg-shlibdeps where both can run.
from_readelf=$(dpkg-deb -f "$(GPU_MPS_DEB_DEPENDS_FROM=readelf bash packaging/deb/build.sh)" Depends)
deb=$(bash packaging/deb/build.sh)
[ "$(dpkg-deb -f "$deb" Depends)" = "$from_readelf" ] ||
    die "Depends from readelf ($from_readelf) differ from dpkg-shlibdeps' ($(dpkg-deb -f "$deb" Depends))"
say "built $deb: $(dpkg-deb -f "$deb" Version Architecture Depends | tr '\n' ' ')"
# A package's /usr/bin holds exactly the binaries of packaging/binaries.txt.
ships_listed_binaries() {
    local shipped
    shipped=$(dpkg-deb -c "$1" | awk '$6 ~ /^\.\/usr\/bin\/./ { sub(/^\.\/usr\/bin\//, "", $6); print $6 }' | LC_ALL=C sort)
    [ "$shipped" = "$(listed_binaries)" ] ||
        die "$1 ships /usr/bin: $(echo "$shipped" | paste -sd ' '); packaging/binaries.txt lists: $(listed_binaries | paste -sd ' ')"
}
ships_listed_binaries "$deb"
say "/usr/bin: $(listed_binaries | paste -sd ' ') (packaging/binaries.txt)"
lintian --allow-root --display-info --pedantic --fail-on error,warning "$deb" ||
    die "lintian flags $deb (justify a tag in packaging/deb/lintian-overrides, or fix it)"
say "lintian: clean (overrides: $(grep -c '^gpu-mps:' packaging/deb/lintian-overrides), each with its reason)"
arm=$(bash packaging/deb/build.sh --arch arm64 --stub-binaries 2>/dev/null)
[ "$(dpkg-deb -f "$arm" Architecture)" = arm64 ] || die "$arm is not Architecture: arm64"
ships_listed_binaries "$arm"
rm -f "$arm"
say "arm64 layout ($(basename "$arm"), stub binaries): ok"

root_tar=$(bash tests/support/debian-root.sh deb-root --variant=minbase --include=ca-certificates)
W=$(mktemp -d /tmp/gpu-mps-deb.XXXXXX)
trap 'rm -rf "$W"' EXIT
mkdir -p "$W/root" "$W/files"
tar -xf "$root_tar" -C "$W/root"
# apt in the root uses this machine's mirror and name service.
. tests/support/debian-mirror.sh
echo "deb $(debian_mirror) bookworm main" >"$W/root/etc/apt/sources.list"
cp /etc/resolv.conf "$W/root/etc/resolv.conf"
cp "$deb" target/debug/fake-mps-control "$W/files/"
target/debug/test-image-archive target/x86_64-unknown-linux-gnu/debug/gpu-mps-checker "$W/files/image.tar" >/dev/null

rc=0
unshare --mount bash "$0" --in-namespace "$W" "$W/files/$(basename "$deb")" || rc=$?
if [ $rc -ne 0 ]; then
    mkdir -p target/deb-test
    cp -r "$W/files"/*.log "$W/files"/*.out "$W/files"/*.toml target/deb-test/ 2>/dev/null || true
    die "the round trip failed (logs in target/deb-test/)"
fi
say "ok in $(( $(date +%s) - start )) s"
