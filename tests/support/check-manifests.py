#!/usr/bin/env python3
"""The checks of tests/manifests.sh on rendered Kubernetes manifests, run in its venv (PyPI's
kubernetes-validate for the schemas, helm-python-sdk for Helm's renderer).

  check-manifests.py listed DIR [EXCLUDED...]   every .yaml under DIR is in the resources of its
                                                directory's kustomization.yaml, or EXCLUDED
  check-manifests.py validate FILE...           every object, strictly (unknown fields refused),
                                                against each Kubernetes version from MIN_VERSION on
  check-manifests.py images FILE IMAGE          every container of every pod template is IMAGE
  check-manifests.py same FILE FILE             both files hold the same objects
  check-manifests.py helm-lint CHART KUBE_VERSION  helm lint --strict, against that Kubernetes:
                                                no warning, no error
  check-manifests.py helm-render CHART OUT [KEY=VALUE...]
                                                renders CHART offline with these values (as
                                                helm's --set) into OUT, one YAML stream

Each failure is one line on stderr naming the file, the object and what was wrong; exit 1.
"""
import json
import os
import sys

import kubernetes_validate
import yaml
from kubernetes_validate import utils as kv

# The oldest Kubernetes the manifests are for: require-runtime-class.yaml is a
# ValidatingAdmissionPolicy, admissionregistration.k8s.io/v1 since 1.30.
MIN_VERSION = (1, 30)


class CheckFailed(Exception):
    pass


def objects_of(path):
    with open(path) as f:
        return [o for o in yaml.safe_load_all(f) if o]


def name_of(obj):
    meta = obj.get("metadata") or {}
    ns = meta.get("namespace")
    return "%s/%s%s" % (obj.get("kind"), (ns + "/") if ns else "", meta.get("name"))


def versions_to_check():
    """Each minor version kubernetes-validate bundles, from MIN_VERSION on."""
    minors = sorted({tuple(int(p) for p in v.split(".")[:2]) for v in kv.all_versions()})
    chosen = [m for m in minors if m >= MIN_VERSION]
    if not chosen:
        raise CheckFailed("kubernetes-validate %s bundles no schema for Kubernetes %d.%d or newer"
                          % (kubernetes_validate.__version__, *MIN_VERSION))
    return ["%d.%d.0" % m for m in chosen]


def validate(paths):
    versions = versions_to_check()
    errors = []
    for path in paths:
        objects = objects_of(path)
        if not objects:
            errors.append("%s: no Kubernetes object in it" % path)
        for obj in objects:
            for version in versions:
                try:
                    kv.validate(obj, version, strict=True)
                except kv.ValidationError as e:
                    where = ".".join(str(p) for p in e.path) or "(top)"
                    errors.append("%s: %s against Kubernetes %s: at %s: %s"
                                  % (path, name_of(obj), version, where, e.message))
                    break
                except kv.SchemaNotFoundError as e:
                    errors.append("%s: %s: %s" % (path, name_of(obj), e.message))
                    break
        if not errors:
            print("manifests: %s: %d objects valid, unknown fields refused, against Kubernetes %s to %s"
                  % (path, len(objects), versions[0], versions[-1]))
    if errors:
        raise CheckFailed("\n".join(errors))


def pod_templates(obj):
    spec = obj.get("spec") or {}
    if obj.get("kind") == "Pod":
        yield spec
    elif obj.get("kind") == "CronJob":
        yield spec["jobTemplate"]["spec"]["template"]["spec"]
    elif "template" in spec:
        yield spec["template"]["spec"]


def images(path, want):
    seen = 0
    errors = []
    for obj in objects_of(path):
        for pod in pod_templates(obj):
            for key in ("initContainers", "containers"):
                for c in pod.get(key) or []:
                    seen += 1
                    if c.get("image") != want:
                        errors.append("%s: %s container %s has image %s, expected %s"
                                      % (path, name_of(obj), c.get("name"), c.get("image"), want))
    if seen == 0:
        errors.append("%s: no container at all, expected some with image %s" % (path, want))
    if errors:
        raise CheckFailed("\n".join(errors))
    print("manifests: %s: all %d containers have image %s" % (path, seen, want))


def same(a, b):
    by_name = {}
    for path in (a, b):
        objs = {}
        for obj in objects_of(path):
            if name_of(obj) in objs:
                raise CheckFailed("%s: %s twice" % (path, name_of(obj)))
            objs[name_of(obj)] = obj
        by_name[path] = objs
    only_a = sorted(set(by_name[a]) - set(by_name[b]))
    only_b = sorted(set(by_name[b]) - set(by_name[a]))
    differ = sorted(n for n in set(by_name[a]) & set(by_name[b]) if by_name[a][n] != by_name[b][n])
    if only_a or only_b or differ:
        raise CheckFailed("%s and %s differ: only in the first: %s; only in the second: %s; different: %s"
                          % (a, b, only_a or "none", only_b or "none", differ or "none"))
    print("manifests: %s and %s hold the same %d objects" % (a, b, len(by_name[a])))


def listed(directory, excluded):
    errors = []
    for root, _dirs, files in os.walk(directory):
        yamls = sorted(f for f in files if f.endswith((".yaml", ".yml")))
        kustomization = os.path.join(root, "kustomization.yaml")
        resources = []
        if os.path.exists(kustomization):
            with open(kustomization) as f:
                resources = yaml.safe_load(f).get("resources") or []
        for name in yamls:
            rel = os.path.relpath(os.path.join(root, name), directory)
            if name == "kustomization.yaml" or rel in excluded:
                continue
            if name not in resources:
                errors.append("%s is in no kustomization's resources: list it in %s, or exclude it "
                              "with a reason in tests/manifests.sh" % (os.path.join(directory, rel), kustomization))
    for rel in excluded:
        if not os.path.exists(os.path.join(directory, rel)):
            errors.append("%s is excluded in tests/manifests.sh but does not exist: drop it there"
                          % os.path.join(directory, rel))
    if errors:
        raise CheckFailed("\n".join(errors))
    print("manifests: every .yaml under %s is listed in its kustomization.yaml%s"
          % (directory, " or excluded (%s)" % ", ".join(excluded) if excluded else ""))


def helm_render(chart_dir, out, sets):
    import helm_python as helm

    values = {}
    try:
        for s in sets:
            values = _merge(values, helm.parse_set_string(s))
        chart = helm.Chart.load(chart_dir)
        rendered = chart.render(values, name="gpu-mps", namespace="default", is_install=True)
    except helm.HelmError as e:
        raise CheckFailed("%s with values %s: %s" % (chart_dir, json.dumps(values), e))
    with open(out, "w") as f:
        for template in sorted(rendered):
            f.write("---\n# %s\n%s\n" % (template, rendered[template]))
    print("manifests: helm-python-sdk %s (Helm SDK %s) rendered %s (values %s) into %s"
          % (helm.__version__, helm.helm_sdk_version(), chart_dir, json.dumps(values), out))


def helm_lint(chart_dir, kube_version):
    import helm_python as helm

    # Helm's severities: 1 info, 2 warning, 3 error.
    result = helm.lint(chart_dir, strict=True, kube_version=kube_version)
    bad = [m for m in result["messages"] if m["severity"] >= 2]
    if bad or result["errors"]:
        raise CheckFailed("helm lint %s (Kubernetes %s): %s" % (chart_dir, kube_version, "; ".join(
            "%s: %s" % (m["path"], m["error"].strip().replace("\n", " ")) for m in bad) or result["errors"]))
    print("manifests: helm lint --strict %s against Kubernetes %s: no warning, no error (%s)" % (
        chart_dir, kube_version, "; ".join(m["error"] for m in result["messages"]) or "nothing to say"))


def _merge(a, b):
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def main(argv):
    if len(argv) < 2:
        raise CheckFailed(__doc__)
    cmd, args = argv[1], argv[2:]
    if cmd == "listed" and args:
        listed(args[0], args[1:])
    elif cmd == "validate" and args:
        validate(args)
    elif cmd == "images" and len(args) == 2:
        images(*args)
    elif cmd == "same" and len(args) == 2:
        same(*args)
    elif cmd == "helm-lint" and len(args) == 2:
        helm_lint(*args)
    elif cmd == "helm-render" and len(args) >= 2:
        helm_render(args[0], args[1], args[2:])
    else:
        raise CheckFailed("check-manifests.py: unknown command or arguments: %s\n%s" % (" ".join(argv[1:]), __doc__))


if __name__ == "__main__":
    try:
        main(sys.argv)
    except CheckFailed as e:
        print(e, file=sys.stderr)
        sys.exit(1)
