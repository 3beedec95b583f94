"""Monitoring from the chart: its PodMonitor scrapes every pod the operator makes, and its Grafana
dashboard asks only for series that our code exports, with the labels they carry.

The exported metrics are read from the code: every `family(...)` call of the modules that serve
/metrics (the trainer's ledger, the relay, the worker), checked against what the trainer's ledger
really yields. The PodMonitor is checked against a hand-written schema of the fields it uses
(prometheus-operator's monitoring.coreos.com/v1 PodMonitor; its CRD is not shipped here), with
unknown fields refused, so a misspelt field fails here and not in a cluster."""

from __future__ import annotations

import ast
import datetime
import json
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from test_chart import CHART, KUBE_VERSIONS, NS, WATCHED, render

from sparrowrl.auth import pki
from sparrowrl.rollout.coordinator import Coordinator
from sparrowrl.trainer import reports
from sparrowrl.trainer.retention import Held
from sparrowrl_operator.builders import stored
from sparrowrl_operator.constants import METRICS_PORT
from sparrowrl_operator.reconcile import Member, Observed, reconcile

ROOT = Path(__file__).resolve().parents[1]
ON = ["--set", "monitoring.podMonitor.enabled=true", "--set", "monitoring.dashboard.enabled=true"]
kube = pytest.mark.kube

# ---------------------------------------------------------------- what the code exports

SOURCES = {  # role → the module whose `family(...)` calls make its /metrics
    "trainer": ROOT / "runtime" / "sparrowrl" / "trainer" / "reports.py",
    "relay": ROOT / "runtime" / "sparrowrl" / "transport" / "relay.py",
    "worker": ROOT / "runtime" / "sparrowrl" / "worker" / "worker.py",
}


def family_calls(path: Path) -> list[ast.Call]:
    return [
        n
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "family"
    ]


def exported() -> dict[str, dict[str, set[str]]]:
    """Series name (as Prometheus stores it) → role → the labels the code gives it."""
    out: dict[str, dict[str, set[str]]] = {}
    for role, path in SOURCES.items():
        for call in family_calls(path):
            kind, name = (ast.literal_eval(a) for a in call.args[:2])  # a name made at run time fails here
            by = next((k.value for k in call.keywords if k.arg == "by"), None)
            labels = ast.literal_eval(by.elts[0]) if by is not None else ()
            series = f"sparrowrl_{name}" + ("_total" if kind == "counter" else "")
            out.setdefault(series, {})[role] = {labels} if isinstance(labels, str) else set(labels)
    return out


EXPORTED = exported()


def test_only_those_modules_make_metrics():
    """A new module that serves metrics must be added to SOURCES, or its series go unchecked."""
    makers = {p for p in (ROOT / "runtime").rglob("*.py") if family_calls(p)}
    assert makers == set(SOURCES.values())


def full_snapshot() -> reports.Snapshot:
    """A snapshot in which every series the trainer can show has a value."""
    c = Coordinator(4, 1, 10, staleness=1, steps=10, split="pull")
    c.publish(0, "h0")
    c.work("w1", 0, region="eu")
    c.commit("w1", 0, "h0", refused=1)
    c.publish(1, "h1")
    row = {
        "version": 1,
        "reward_mean": 0.5,
        "loss": -0.5,
        "kl": 0.01,
        "lr": 1e-5,
        "tokens": 96,
        "completion_tokens_mean": 3.0,
        "reward_failed": {"raised": 1},
        "payload_bytes": 10,
        "dense_bytes": 100,
        "changed_fraction": 0.01,
        **{f"{p}_s": 1.0 for p in reports.PHASES},
        "skipped": "nonfinite",
        "entropy": 1.2,
        **{f"clip_{b}": 0.01 for b in reports.CLIPS},
        **{f"is_{k}": 0.5 for k in ("weight_mean", "weight_min", "weight_max", "masked", "truncated", "ess")},
        **{f"mismatch_{k}": 0.1 for k in ("mean", "max", "kl")},
        "zero_variance_groups": 0.25,
        "truncated": 0.125,
        "completion_len_min": 1,
        "completion_len_max": 8,
        "episode_ends": {"done": 3, "error": 1},
        "episode_tool_calls": 2,
        "episode_tool_errors": 1,
        "episode_turns_mean": 1.5,
        "by_age": {"0": {"samples": 3, "tokens": 9, "mismatch_max": 0.2, "refused": 0, "mismatch_mean": 0.1}},
        "by_worker": {"w": {"samples": 3, "tokens": 9, "mismatch_max": 0.2, "refused": 1, "mismatch_mean": 0.1}},
        "refused_samples": {"w": {"logprob_gap": 1}},
    }
    return reports.Snapshot(
        c.view(),
        10,
        [row],
        5.0,
        {"delta": 1, "base": 2},
        0,
        0,
        False,
        Held(pruned=1, versions=2, bytes=3),
        0.5,
        evals=({"version": 1, "prompts": 8, "samples": 4, "decoding": "sampled", "pass_at_1": 0.5, "pass_at_k": 0.75},),
    )


def test_the_trainers_series_read_from_the_code_are_the_ones_it_serves():
    served: dict[str, set[str]] = {}
    for fam in reports.metrics(full_snapshot()):
        for s in fam.samples:
            served.setdefault(s.name, set()).update(s.labels)
    assert served == {n: roles["trainer"] for n, roles in EXPORTED.items() if "trainer" in roles}


def test_the_docs_list_every_series():
    docs = (ROOT / "docs" / "rl.md").read_text()
    assert [n for n in EXPORTED if f"`{n}" not in docs] == []


# ---------------------------------------------------------------- the chart's objects


@kube
def test_lint_with_monitoring_on_and_off(helm):
    helm("lint", "--strict", str(CHART))
    helm("lint", "--strict", str(CHART), *ON)
    helm("lint", "--strict", str(CHART), *ON, *WATCHED, "--set", "monitoring.podMonitor.labels.release=kps")


@kube
def test_both_are_off_by_default(helm):
    values = yaml.safe_load((CHART / "values.yaml").read_text())["monitoring"]
    assert values["podMonitor"]["enabled"] is False and values["dashboard"]["enabled"] is False
    kinds = [(o["kind"], o["metadata"]["name"]) for o in render(helm)]
    assert not [k for k in kinds if k[0] in ("PodMonitor", "ConfigMap")], kinds
    one = render(helm, "--set", "monitoring.dashboard.enabled=true")
    assert [o["kind"] for o in one if o["kind"] in ("PodMonitor", "ConfigMap")] == ["ConfigMap"]


DURATION = {"type": "string", "pattern": "^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
        "matchExpressions": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["key", "operator"],
                "properties": {
                    "key": {"type": "string"},
                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
    },
}
# The fields of monitoring.coreos.com/v1 PodMonitor that the chart sets, typed as its CRD types them.
POD_MONITOR = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PodMonitor"},
        "metadata": {
            "type": "object",
            "required": ["name", "namespace"],
            "properties": {"labels": {"type": "object", "additionalProperties": {"type": "string"}}},
        },
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "podMetricsEndpoints"],
            "properties": {
                "selector": SELECTOR,
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "any": {"type": "boolean"},
                        "matchNames": {"type": "array", "items": {"type": "string"}, "minItems": 1},
                    },
                },
                "podMetricsEndpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string", "pattern": "^/"},
                            "interval": DURATION,
                            "tlsConfig": {
                                "type": "object",
                                "additionalProperties": False,
                                "properties": {"insecureSkipVerify": {"type": "boolean"}},
                            },
                            "relabelings": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "properties": {
                                        "sourceLabels": {
                                            "type": "array",
                                            "items": {"type": "string", "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$"},
                                        },
                                        "targetLabel": {"type": "string", "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$"},
                                        "action": {"enum": ["replace", "keep", "drop", "labelmap"]},
                                        "regex": {"type": "string"},
                                        "replacement": {"type": "string"},
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}


def monitoring(objs: list[dict]) -> tuple[dict, dict]:
    (pm,) = [o for o in objs if o["kind"] == "PodMonitor"]
    (cm,) = [o for o in objs if o["kind"] == "ConfigMap"]
    return pm, cm


@kube
@pytest.mark.parametrize("args", [[], WATCHED], ids=["all-namespaces", "watchNamespaces"])
def test_the_objects_are_valid(helm, args):
    pm, cm = monitoring(render(helm, *ON, *args))
    jsonschema.Draft7Validator(POD_MONITOR).validate(pm)
    for version in KUBE_VERSIONS:
        kubernetes_validate.validate(cm, version, strict=True)
    for o in (pm, cm):
        assert o["metadata"]["namespace"] == NS and o["metadata"]["labels"]["app.kubernetes.io/part-of"] == "sparrowrl"
    assert pm["spec"]["namespaceSelector"] == ({"matchNames": ["team-a", "team-b"]} if args else {"any": True})
    assert len(json.dumps(cm["data"])) < 1 << 20  # a ConfigMap's limit
    with pytest.raises(jsonschema.ValidationError):  # the schema does refuse what a CRD would prune
        jsonschema.Draft7Validator(POD_MONITOR).validate(
            {**pm, "spec": {**pm["spec"], "podMetricsEndpoint": pm["spec"]["podMetricsEndpoints"]}}
        )


@kube
def test_the_users_labels_reach_the_objects(helm):
    pm, cm = monitoring(
        render(
            helm,
            *ON,
            "--set",
            "monitoring.podMonitor.labels.release=kps",
            "--set-string",
            "monitoring.dashboard.labels.grafana_dashboard=yes",
        )
    )
    assert pm["metadata"]["labels"]["release"] == "kps"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "yes"
    _, cm = monitoring(render(helm, *ON))
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"  # kube-prometheus-stack's sidecar's default


@kube
@pytest.mark.parametrize(
    "setting, field",
    [
        ("monitoring.podMonitor.interval=soon", "interval"),
        ("monitoring.dashboard.enable=true", "enable"),
        ("monitoring.podMonitor.enabled=yes", "enabled"),
    ],
)
def test_schema_rejects(helm, setting, field):
    err = helm("template", "x", str(CHART), "--set", setting, ok=False).stderr
    assert field in err and ("schema" in err or "at '/" in err), err


def operator_pods() -> list[dict]:
    """The pods the operator makes for examples/k8s/job.yaml, in its own cluster and two members."""
    job = yaml.safe_load((ROOT / "examples" / "k8s" / "job.yaml").read_text())
    job["metadata"] |= {"uid": "u-1", "generation": 1}
    members = {"eu-west": Member("sparrowrl", True), "ap-south": Member("sparrowrl", True)}
    pods: dict = {}
    objects: dict = {}
    now = datetime.datetime(2026, 12, 1, tzinfo=datetime.timezone.utc)
    ca = pki.authority("test", now=now)  # the job's CA, made the first cycle
    for _ in range(2):  # member clusters' pods come in the second cycle, after the token's Secret
        plan = reconcile(
            job,
            Observed(
                now=now,
                token="tok",
                authority=ca,
                members=members,
                trainer_service={"status": {"loadBalancer": {"ingress": [{"ip": "203.0.113.7"}]}}},
                pods={c: list(ps.values()) for c, ps in pods.items()},
                objects=objects,
            ),
            "sparrowrl-runtime:test",
        )
        for cluster, m in plan.create + plan.apply:
            if m["kind"] == "Pod":
                pods.setdefault(cluster, {})[m["metadata"]["name"]] = m
            else:
                objects.setdefault(cluster, {})[m["kind"], m["metadata"]["name"]] = stored(m)
    return [p for ps in pods.values() for p in ps.values()]


def selects(selector: dict, labels: dict) -> bool:
    ok = all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())
    for e in selector.get("matchExpressions", []):
        has, value = e["key"] in labels, labels.get(e["key"])
        ok &= {
            "In": has and value in e.get("values", []),
            "NotIn": not has or value not in e.get("values", []),
            "Exists": has,
            "DoesNotExist": not has,
        }[e["operator"]]
    return ok


def meta_label(key: str) -> str:
    """How Prometheus' Kubernetes discovery names a pod label."""
    return "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)


@kube
def test_the_pod_monitor_scrapes_every_pod_the_operator_makes_on_its_open_metrics_port(helm):
    pm, _ = monitoring(render(helm, *ON))
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    pods = operator_pods()
    roles = {p["metadata"]["labels"]["sparrowrl.dev/role"] for p in pods}
    assert roles == {"trainer", "relay", "worker"} and len(pods) == 1 + 3 + 5
    for pod in pods:
        labels = pod["metadata"]["labels"]
        assert selects(pm["spec"]["selector"], labels), pod["metadata"]["name"]
        (c,) = pod["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        # the port serves /metrics without the token: the role was started with --metrics-port on it
        assert ports[endpoint["port"]] == METRICS_PORT and c["args"][c["args"].index("--metrics-port") + 1] == str(
            METRICS_PORT
        )
        for r in endpoint["relabelings"]:  # the job, role and region labels come from the pod's labels
            (source,) = r["sourceLabels"]
            found = [k for k in labels if meta_label(k) == source]
            # every pod has its job and role; the trainer has no region; a worker's metrics are plain HTTP
            role = labels["sparrowrl.dev/role"]
            assert found or (r["targetLabel"], role) in (("region", "trainer"), ("__scheme__", "worker")), source
            if r["targetLabel"] == "__scheme__" and found:  # the trainer's and relays': HTTPS, as their own port
                assert re.fullmatch(r["regex"], labels[found[0]]) and labels[found[0]] == "https"
    targets = {r["targetLabel"]: r["sourceLabels"][0] for r in endpoint["relabelings"]}
    assert targets == {
        "__scheme__": meta_label("sparrowrl.dev/metrics-scheme"),
        "sparrowrl_job": meta_label("sparrowrl.dev/job"),
        "role": meta_label("sparrowrl.dev/role"),
        "region": meta_label("sparrowrl.dev/region"),
    }
    assert endpoint["tlsConfig"] == {"insecureSkipVerify": True}
    assert not selects(pm["spec"]["selector"], {"app.kubernetes.io/managed-by": "Helm", "sparrowrl.dev/role": "x"})


# ---------------------------------------------------------------- the dashboard's queries

FUNCTIONS = {"rate", "increase", "sum", "max", "min", "avg", "count", "by", "without", "label_values"}
TARGET_LABELS = {"namespace", "pod", "container", "endpoint", "job", "instance"}  # prometheus-operator's own
VECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{([^}]*)\}")
MATCHER = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"([^"]*)"\s*(,|$)')


def matchers(body: str) -> dict[str, str]:
    found = MATCHER.findall(body)
    assert "".join(f'{k}{op}"{v}"{sep}' for k, op, v, sep in found) == re.sub(r"\s", "", body), body
    return {k: v for k, _, v, _ in found}


def series_of(expr: str) -> tuple[list[tuple[str, dict]], set[str]]:
    """The series an expression (or a variable's label_values(series, label)) reads, with their
    matchers, and the labels it groups by (or lists)."""
    listed = set()
    if m := re.fullmatch(r"label_values\((.*),\s*(\w+)\)", expr):
        expr, listed = m.group(1), {m.group(2)}
    vectors = [(name, matchers(body)) for name, body in VECTOR.findall(expr)]
    rest = re.sub(r"\[[^\]]*\]", " ", VECTOR.sub(" ", expr))
    grouped = {x.strip() for g in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", rest) for x in g.split(",")}
    rest = re.sub(r"\b(?:by|without)\s*\([^)]*\)", " ", rest)
    bare = [(n, {}) for n in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", rest) if n not in FUNCTIONS]
    return vectors + bare, (grouped | listed) - {""}


def dashboard(helm) -> dict:
    _, cm = monitoring(render(helm, *ON))
    (text,) = cm["data"].values()
    assert text == (CHART / "dashboards" / "sparrowrl.json").read_text().rstrip("\n")  # verbatim
    return json.loads(text)


@kube
def test_the_dashboard_reads_only_series_our_code_exports_with_their_labels(helm):
    pm, _ = monitoring(render(helm, *ON))
    relabelled = {r["targetLabel"] for r in pm["spec"]["podMetricsEndpoints"][0]["relabelings"]}
    d = dashboard(helm)
    variables = [v["name"] for v in d["templating"]["list"]]
    assert d["uid"] and d["title"] and variables == ["datasource", "namespace", "job"]
    queries = [v["definition"] for v in d["templating"]["list"] if v["type"] == "query"]
    queries += [t["expr"] for p in d["panels"] for t in p["targets"]]
    assert all(p["targets"] for p in d["panels"])
    for expr in queries:
        used, grouped = series_of(expr)
        assert used, expr
        labels_here: set[str] = set()
        for name, match in used:
            assert name in EXPORTED, f"{name} (in {expr}) is not a series our code exports"
            roles = EXPORTED[name]
            if "role" in match:
                assert match["role"] in roles, f"{expr}: no {match['role']} exports {name}"
                roles = {match["role"]: roles[match["role"]]}
            else:  # a name two roles export means two things: the query must say which
                assert len(roles) == 1, f'{expr}: {name} is exported by {sorted(roles)}; add role="..."'
            own = set().union(*roles.values())
            allowed = own | TARGET_LABELS | relabelled
            assert set(match) <= allowed, f"{expr}: {set(match) - allowed} on {name}"
            labels_here |= allowed
        assert grouped <= labels_here, f"{expr}: groups by {grouped - labels_here}"
    for p in d["panels"]:
        for t in p["targets"]:
            legend = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", t["legendFormat"]))
            have = set().union(*(set().union(*EXPORTED[n].values()) for n, _ in series_of(t["expr"])[0]))
            assert legend <= have | TARGET_LABELS | relabelled, (p["title"], legend)


@kube
def test_the_dashboard_shows_what_the_issue_asks_for(helm):
    """Reward, tokens/s, payload per step, staleness per worker, leases, refused answers and
    bytes per relay; and tokens per dollar."""
    d = dashboard(helm)
    read = {p["title"]: {n for t in p["targets"] for n, _ in series_of(t["expr"])[0]} for p in d["panels"]}
    assert read["Reward"] == {"sparrowrl_reward"}
    assert read["Tokens per second"] == {"sparrowrl_tokens_total"}
    assert read["Payload per step"] == {"sparrowrl_payload_bytes"}
    assert read["Staleness per worker"] == {"sparrowrl_worker_staleness"}
    assert {"sparrowrl_leases_active", "sparrowrl_worker_leases"} <= read["Leases"]
    assert {"sparrowrl_worker_refused_answers_total", "sparrowrl_refused_answers_total"} <= read["Refused answers"]
    assert {"sparrowrl_sent_bytes_total", "sparrowrl_received_bytes_total"} <= read["Bytes per relay"]
    assert read["Tokens per dollar"] == {"sparrowrl_tokens_per_dollar"}
    # what the objective shows of each step (issue 45): every series of it is on a panel
    learning = {
        "sparrowrl_entropy",
        "sparrowrl_clip_fraction",
        "sparrowrl_is_weight_mean",
        "sparrowrl_is_weight_min",
        "sparrowrl_is_weight_max",
        "sparrowrl_is_masked",
        "sparrowrl_is_truncated",
        "sparrowrl_is_ess",
        "sparrowrl_mismatch",
        "sparrowrl_mismatch_kl",
        "sparrowrl_mismatch_by_age",
        "sparrowrl_worker_mismatch",
        "sparrowrl_zero_variance_groups",
        "sparrowrl_completion_length",
        "sparrowrl_truncated",
        "sparrowrl_eval_pass_at_1",
        "sparrowrl_eval_pass_at_k",
        "sparrowrl_worker_refused_samples_total",
        "sparrowrl_steps_skipped_total",
    }
    assert learning <= set().union(*read.values()) and learning <= set(EXPORTED)
    ids = [p["id"] for p in d["panels"]]
    assert len(set(ids)) == len(ids)
    for p in d["panels"]:  # on the 24-column grid, and every query through the chosen data source
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0
        assert p["datasource"]["uid"] == "${datasource}"
        assert all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"])
