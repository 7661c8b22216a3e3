#!/usr/bin/env bash
# The manifests people apply (issue 9): renders packaging/kubernetes with a real kubectl, the
# example overlay, a `kustomize edit set image` of it and the Helm chart, then checks every
# rendered object against the Kubernetes JSON schemas with unknown fields refused, offline.
#   bash tests/manifests.sh
# Tools, cached under $GPU_MPS_CACHE/manifests (nothing is installed system-wide):
#   - kubectl and kustomize: Debian sid's packages, extracted (private apt state; the mirror is the
#     machine's own, tests/support/debian-mirror.sh). sid moves: the versions used are printed.
#   - kubernetes-validate (the schemas of each Kubernetes minor, a strict variant that refuses
#     unknown fields) and helm-python-sdk (Helm's own Go SDK as a library: renders a chart offline,
#     no helm binary, no download at run time), from PyPI, pinned below, in a venv.
# Each check also has a case that must fail (a misspelled field, an unknown kind, an unlisted file,
# a misspelled chart value), so a check that passes everything would fail here.
set -euo pipefail
cd "$(dirname "$0")/.."

kubernetes_validate_version=1.37.0
helm_python_sdk_version=0.2.2
# Files under packaging/kubernetes that its kustomization.yaml leaves out on purpose, each with why.
# They are still schema-checked. (A file neither listed nor here fails the run.)
excluded=(
    # A Job run by hand, one per node, after the DaemonSet is deleted: applying it with the rest
    # would uninstall every node it names at once (packaging/README.md "Uninstall").
    uninstall/gpu-mps-uninstall.yaml
)
# The image name gpu-mps.yaml uses and the kustomization's `images` entry matches.
placeholder=registry.example/gpu-mps

cache=${GPU_MPS_CACHE:-$HOME/.cache/gpu-mps}/manifests
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
start=$SECONDS
die() { echo "manifests: $*" >&2; exit 1; }

# --- kubectl and kustomize from Debian sid ---
. tests/support/private-apt.sh
tools=$cache/sid-root
# In this shell, not in sid_versions' subshell: fetch_tools needs what it sets.
apt_ready=false
private_apt_init sid "${GPU_MPS_CACHE:-$HOME/.cache/gpu-mps}" && apt_ready=true
# Prints "kubectl <version> kustomize <version> " as sid has them today; fails if it has not both.
sid_versions() {
    $apt_ready || return 1
    local pkg ver
    for pkg in kubectl kustomize; do
        ver=$(private_apt_candidate "$pkg") || { echo "Debian sid has no $pkg package today" >&2; return 1; }
        printf '%s %s ' "$pkg" "$ver"
    done
}
fetch_tools() { # WANT: download and extract into $tools, replacing it only once all went well
    private_apt_download "$private_apt_dir/debs-manifests" kubectl kustomize || return 1
    rm -rf "$tools.new" && mkdir -p "$tools.new"
    for deb in "$private_apt_dir"/debs-manifests/*.deb; do dpkg-deb -x "$deb" "$tools.new" || return 1; done
    echo "$1" >"$tools.new/VERSIONS"
    rm -rf "$tools" && mv "$tools.new" "$tools"
}
# sid moves, and now and then a package is missing from it for a while: then the copy fetched
# on an earlier day is used, and said so.
if want=$(sid_versions); then
    if [ "$(cat "$tools/VERSIONS" 2>/dev/null)" != "$want" ] || [ ! -x "$tools/usr/bin/kubectl" ]; then
        fetch_tools "$want" || [ -x "$tools/usr/bin/kubectl" ] || die "apt-get download kubectl kustomize from Debian sid failed"
    fi
elif [ -x "$tools/usr/bin/kubectl" ]; then
    echo "manifests: Debian sid's kubectl/kustomize cannot be had now; using the cached $(cat "$tools/VERSIONS")"
else
    die "cannot get kubectl and kustomize from Debian sid (above), and none is cached in $tools"
fi
want=$(cat "$tools/VERSIONS")
kubectl=$tools/usr/bin/kubectl
kustomize=$tools/usr/bin/kustomize

# --- the Python side, pinned ---
venv=$cache/venv
pins="kubernetes-validate==$kubernetes_validate_version helm-python-sdk==$helm_python_sdk_version"
if [ "$(cat "$venv/PINS" 2>/dev/null)" != "$pins" ]; then
    if ! python3 -c 'import ensurepip' 2>/dev/null; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv
    fi
    rm -rf "$venv"
    python3 -m venv "$venv"
    # shellcheck disable=SC2086 # pins is a list of requirement specifiers
    "$venv/bin/pip" install -q --disable-pip-version-check $pins || die "pip install $pins failed"
    # The wheel carries Helm's library three times (a wheel holds no links): 85 MB each. Keep one.
    for lib in "$venv"/lib/python3*/site-packages/helm_python/lib/libhelm_c.so{,.0}; do
        # shellcheck disable=SC2012 # the wheel's own file names (no odd characters): the first of them
        real=$(ls "$venv"/lib/python3*/site-packages/helm_python/lib/libhelm_c.so.*.*.* | head -n1)
        [ -f "$lib" ] && [ -f "$real" ] && cmp -s "$lib" "$real" && ln -f "$real" "$lib"
    done
    echo "$pins" >"$venv/PINS"
fi
check() { "$venv/bin/python" tests/support/check-manifests.py "$@"; }
echo "manifests: kubectl $("$kubectl" version --client | tr '\n' ' ')(Debian sid: $want)"
echo "manifests: $pins; tools ready after $((SECONDS - start)) s"

# must_fail WHAT PATTERN COMMAND...: COMMAND must fail and say PATTERN.
must_fail() {
    local what=$1 pattern=$2 out
    shift 2
    if out=$("$@" 2>&1); then die "$what: passed, but must fail"; fi
    grep -q -- "$pattern" <<<"$out" || die "$what: failed without saying '$pattern': $out"
    echo "manifests: refused as it must: $what: $(grep -m1 -- "$pattern" <<<"$out")"
}

version=$(awk -F'"' '/^\[workspace.package\]/ { p = 1 } p && /^version *=/ { print $2; exit }' Cargo.toml)
[ -n "$version" ] || die "no [workspace.package] version in Cargo.toml"

# --- every file is listed ---
check listed packaging/kubernetes "${excluded[@]}"
cp -r packaging/kubernetes "$work/unlisted"
cp packaging/kubernetes/runtimeclass.yaml "$work/unlisted/forgotten.yaml"
must_fail "a yaml the kustomization does not list" "forgotten.yaml is in no kustomization" \
    check listed "$work/unlisted" "${excluded[@]}"

# --- kubectl apply -k packaging/kubernetes, as shipped ---
"$kubectl" kustomize packaging/kubernetes >"$work/kustomize.yaml"
check validate "$work/kustomize.yaml"
check images "$work/kustomize.yaml" "$placeholder:$version"
for f in "${excluded[@]}"; do check validate "packaging/kubernetes/$f"; done

# --- the image overridden: by the example overlay, and by `kustomize edit set image` ---
"$kubectl" kustomize packaging/overlays/example >"$work/overlay.yaml"
check validate "$work/overlay.yaml"
check images "$work/overlay.yaml" "registry.internal.example/gpu/gpu-mps:$version"
cp -r packaging/kubernetes "$work/edited"
(cd "$work/edited" && "$kustomize" edit set image "$placeholder=edit.example/gpu-mps:edited-1")
"$kubectl" kustomize "$work/edited" >"$work/edited.yaml"
check images "$work/edited.yaml" "edit.example/gpu-mps:edited-1"

# --- the schema check refuses what a cluster would ---
cp -r packaging/kubernetes "$work/misspelled"
sed -i 's/^\( *\)hostPID:/\1hostPid:/' "$work/misspelled/gpu-mps.yaml"
grep -q 'hostPid:' "$work/misspelled/gpu-mps.yaml" || die "gpu-mps.yaml has no hostPID line to misspell"
"$kubectl" kustomize "$work/misspelled" >"$work/misspelled.yaml"
must_fail "a misspelled field (hostPid)" "'hostPid' was unexpected" check validate "$work/misspelled.yaml"
sed 's/^kind: RuntimeClass$/kind: RuntimeKlass/' "$work/kustomize.yaml" >"$work/unknown-kind.yaml"
must_fail "an unknown kind (RuntimeKlass)" "Couldn't find schema for kind RuntimeKlass" \
    check validate "$work/unknown-kind.yaml"

# --- Helm: the chart lints clean, renders the same objects, and takes the image from its values ---
check helm-lint packaging/helm/gpu-mps 1.30.0
cp -rL packaging/helm/gpu-mps "$work/bad-chart"
sed -i 's/^version: .*/version: not-a-version/' "$work/bad-chart/Chart.yaml"
must_fail "a chart whose version is not SemVer" "not-a-version" check helm-lint "$work/bad-chart" 1.30.0
check helm-render packaging/helm/gpu-mps "$work/helm.yaml"
check validate "$work/helm.yaml"
check same "$work/kustomize.yaml" "$work/helm.yaml"
chart_version=$(awk -F'"' '/^appVersion:/ { print $2 }' packaging/helm/gpu-mps/Chart.yaml)
[ "$chart_version" = "$version" ] || die "packaging/helm/gpu-mps/Chart.yaml: appVersion $chart_version, but Cargo.toml says $version"
check helm-render packaging/helm/gpu-mps "$work/helm-image.yaml" image.repository=helm.example/gpu-mps,image.tag=helm-1
check images "$work/helm-image.yaml" "helm.example/gpu-mps:helm-1"
must_fail "the chart with another image against the kustomization" "different: \['DaemonSet/" \
    check same "$work/kustomize.yaml" "$work/helm-image.yaml"
must_fail "a misspelled chart value (image.tagg)" "tagg" \
    check helm-render packaging/helm/gpu-mps "$work/typo.yaml" image.tagg=1

# --- the switches (issue 22): RESTART_CONTAINERD and the device plugin, the same in kustomize
# (components/) and Helm (values), each checked by what it renders and against the other ---
cp -r packaging/kubernetes "$work/base"
mkdir -p "$work/switched"
cat >"$work/switched/kustomization.yaml" <<'YAML'
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
- ../base
components:
- ../base/components/restart-containerd
- ../base/components/no-device-plugin
YAML
"$kubectl" kustomize "$work/switched" >"$work/switched.yaml"
check validate "$work/switched.yaml"
grep -A1 -- '- name: RESTART_CONTAINERD' "$work/kustomize.yaml" | grep -q 'value: "false"' \
    || die "packaging/kubernetes: RESTART_CONTAINERD is not \"false\" by default"
grep -A1 -- '- name: RESTART_CONTAINERD' "$work/switched.yaml" | grep -q 'value: "true"' \
    || die "components/restart-containerd does not set RESTART_CONTAINERD to \"true\""
grep -q -- ' name: device-plugin$' "$work/kustomize.yaml" || die "packaging/kubernetes has no device-plugin container"
if grep -q -- ' name: device-plugin$' "$work/switched.yaml"; then die "components/no-device-plugin left the device-plugin container"; fi
check helm-render packaging/helm/gpu-mps "$work/helm-switched.yaml" restartContainerd=true,devicePlugin=false
check same "$work/switched.yaml" "$work/helm-switched.yaml"
must_fail "the switched chart against the default kustomization" "different: \['DaemonSet/" \
    check same "$work/kustomize.yaml" "$work/helm-switched.yaml"
must_fail "a misspelled switch (restartContainerD)" "restartContainerD" \
    check helm-render packaging/helm/gpu-mps "$work/typo-switch.yaml" restartContainerD=true

echo "manifests: all checks passed in $((SECONDS - start)) s"
