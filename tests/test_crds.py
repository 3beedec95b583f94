"""The CRDs are the pydantic models': generated, structural, and as strict as `parse` where CEL
can say it. CEL rules run here with cel-python, with the API server's order: defaults first,
then each node's rules, transition rules (oldSelf) only on an update."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import celpy
import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version

from sparrowrl.spec.job import JobError, load, parse
from sparrowrl_operator.model import ClusterSpec, SparrowRLJobStatus

ROOT = Path(__file__).resolve().parent.parent
CRDS = {p.name: yaml.safe_load(p.read_text()) for p in sorted((ROOT / "crds").glob("*.yaml"))}
JOB_CRD = CRDS["sparrowrl.dev_sparrowrljobs.yaml"]
CLUSTER_CRD = CRDS["sparrowrl.dev_sparrowclusters.yaml"]


def root_schema(crd: dict) -> dict:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


@pytest.mark.e2e
def test_crds_chart_copy_and_generator_agree():
    r = subprocess.run([sys.executable, str(ROOT / "hack" / "gen-crds.py"), "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    chart = ROOT / "charts" / "sparrowrl-operator" / "crds"
    assert sorted(p.name for p in chart.glob("*.yaml")) == sorted(CRDS)
    for name in CRDS:
        assert (chart / name).read_bytes() == (ROOT / "crds" / name).read_bytes(), name


def nodes(schema: dict, path: str = ""):
    yield path, schema
    for k, v in schema.get("properties", {}).items():
        yield from nodes(v, f"{path}.{k}")
    if isinstance(schema.get("items"), dict):
        yield from nodes(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from nodes(schema["additionalProperties"], f"{path}{{}}")


@pytest.mark.parametrize("name", sorted(CRDS))
def test_schema_is_structural(name):
    """What the API server refuses in a v1 CRD, or prunes by surprise."""
    for path, node in nodes(root_schema(CRDS[name])):
        forbidden = {
            "anyOf",
            "oneOf",
            "allOf",
            "$ref",
            "$defs",
            "patternProperties",
            "propertyNames",
            "title",
            "const",
            "uniqueItems",
        } & set(node)
        assert not forbidden, f"{path}: {forbidden}"
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), f"{path}: no type"
        assert not ("properties" in node and "additionalProperties" in node), f"{path}: both"
        assert not isinstance(node.get("default"), (dict, list)), f"{path}: a stored object default"
        if node.get("type") == "array":
            assert "maxItems" in node, f"{path}: unbounded list (CEL cost, and our limits)"
        if node.get("type") == "string" and "enum" not in node and path not in (".apiVersion", ".kind"):
            assert "maxLength" in node or node.get("format") == "date-time", f"{path}: unbounded string"


def test_printer_columns_point_at_status_fields():
    """A column whose path the schema lacks shows <none> forever."""
    schema = root_schema(JOB_CRD)
    for c in JOB_CRD["spec"]["versions"][0]["additionalPrinterColumns"]:
        node = schema
        for part in c["jsonPath"].lstrip(".").split("."):
            node = node["properties"][part] if part != "metadata" else {"properties": {"creationTimestamp": {}}}
        assert node is not None, c


def with_defaults(schema: dict, obj):
    """The API server's defaulting: scalar defaults of absent fields."""
    if isinstance(obj, dict) and "properties" in schema:
        out = dict(obj)
        for k, sub in schema["properties"].items():
            if k not in out and "default" in sub:
                out[k] = sub["default"]
            elif k in out:
                out[k] = with_defaults(sub, out[k])
        return out
    if isinstance(obj, list) and "items" in schema:
        return [with_defaults(schema["items"], x) for x in obj]
    if isinstance(obj, dict) and isinstance(schema.get("additionalProperties"), dict):
        return {k: with_defaults(schema["additionalProperties"], v) for k, v in obj.items()}
    return obj


ENV = celpy.Environment()


def cel_failures(schema: dict, obj, old=None, path: str = "") -> list[str]:
    out = []
    for rule in schema.get("x-kubernetes-validations", []):
        if "oldSelf" in rule["rule"] and old is None:
            continue
        act = {"self": celpy.json_to_cel(obj)} | ({"oldSelf": celpy.json_to_cel(old)} if old is not None else {})
        if not ENV.program(ENV.compile(rule["rule"])).evaluate(act):
            out.append(f"{path}: {rule['message']}")
    if isinstance(obj, dict) and "properties" in schema:
        for k, sub in schema["properties"].items():
            if k in obj:
                out += cel_failures(sub, obj[k], old.get(k) if isinstance(old, dict) else None, f"{path}.{k}")
    elif isinstance(obj, list) and "items" in schema:
        out += [m for x in obj for m in cel_failures(schema["items"], x, None, f"{path}[]")]
    elif isinstance(obj, dict) and isinstance(schema.get("additionalProperties"), dict):
        out += [m for v in obj.values() for m in cel_failures(schema["additionalProperties"], v, None, f"{path}{{}}")]
    return out


def admitted(obj: dict, old: dict | None = None) -> list[str]:
    """Why an API server with this CRD would refuse `obj` (an empty list: it would store it)."""
    schema = root_schema(JOB_CRD)
    obj = with_defaults(schema, obj)
    try:
        jsonschema.Draft4Validator(schema).validate(obj)
    except jsonschema.ValidationError as e:
        return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"]
    return cel_failures(schema["properties"]["spec"], obj["spec"], old and with_defaults(schema, old)["spec"], "spec")


def example_job() -> dict:
    return yaml.safe_load((ROOT / "examples" / "k8s" / "job.yaml").read_text())


def test_examples_are_admitted_and_parse():
    for path in sorted((ROOT / "examples").rglob("*.yaml")):
        docs = list(yaml.safe_load_all(path.read_text()))
        for doc in docs:
            if doc["kind"] == "SparrowRLJob":
                assert admitted(doc) == [], path
                if len(docs) == 1:
                    load(path)
                else:  # beside the job, the objects it mounts
                    parse(doc, str(path))
            elif doc["kind"] == "SparrowCluster":
                jsonschema.Draft4Validator(root_schema(CLUSTER_CRD)).validate(
                    with_defaults(root_schema(CLUSTER_CRD), doc)
                )
                ClusterSpec.model_validate(doc["spec"])
            else:  # Kubernetes' own kinds: against Kubernetes' schemas
                kubernetes_validate.validate(doc, latest_version(), strict=True)


def test_an_example_that_asks_for_gpus_runs_the_gpu_image():
    """The CPU image has no CUDA torch and no vLLM: a job with GPUs on it would idle them, or fail
    its check on trainer.device: cuda."""
    gpu_jobs = 0
    for path in sorted((ROOT / "examples" / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc["kind"] != "SparrowRLJob":
                continue
            spec = doc["spec"]
            if "nvidia.com/gpu" in json.dumps(spec) or (spec.get("rollout") or {}).get("engine") == "vllm":
                gpu_jobs += 1
                assert (spec.get("image") or "").endswith("-gpu"), f"{path.name}: GPUs with the CPU image"
    assert gpu_jobs >= 4


def spec_with(change) -> dict:
    job = example_job()
    change(job["spec"])
    return job


BAD = {  # refused by CEL in the API server and by parse in the operator and `sparrowrl run`
    "both model sources": lambda s: s["model"].update(path="/models/qwen"),
    "neither model source": lambda s: s["model"].pop("tiny"),
    "heads do not divide hidden": lambda s: s["model"]["tiny"].update(hidden=130),
    "tokenizer beside tiny": lambda s: s["model"].update(tokenizer="/t"),
    "both task sources": lambda s: s["task"].update(jsonl="x.jsonl"),
    "a task file and a data set": lambda s: s.update(task={"jsonl": "x.jsonl", "dataset": {"path": "d.parquet"}}),
    "no task source": lambda s: s.update(task={"reward": "exact"}),
    "topology and placements": lambda s: s.update(topology={"regions": [{"name": "a"}]}),
    "member cluster, ClusterIP trainer": lambda s: s["trainer"]["service"].update(type="ClusterIP"),
    "member cluster, no trainer section": lambda s: s.pop("trainer"),
    "minReplicas above replicas": lambda s: s["placements"][0].update(minReplicas=5),
    "node selector key": lambda s: s["rollout"].update(nodeSelector={"bad key!": "x"}),
    "tensor parallelism with hf": lambda s: s["rollout"].update(engine="hf", tensorParallelSize=2),
    "resource name": lambda s: s["trainer"]["resources"]["requests"].update({"bad name!": "1"}),
    "a CA of one's own with TLS off": lambda s: s.update(tls={"mode": "Disabled", "caSecretName": "team-ca"}),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_cel_refuses_what_parse_refuses(case):
    job = spec_with(BAD[case])
    with pytest.raises(JobError):
        parse(job)
    assert admitted(job), f"{case}: the API server would store it"


def test_a_plain_trainer_url_with_tls_on_is_refused_at_the_door():
    """By CEL alone: a job stored before the rule runs on as it started (the operator's own check
    spares a job whose pods are plain, test_operator_tls.py)."""
    job = spec_with(lambda s: s["trainer"]["service"].update(url="http://t.example.com:8470"))
    assert admitted(job) == [
        "spec: trainer.service.url: the trainer serves HTTPS (tls.mode Enabled); give an https:// URL, or set "
        "tls.mode: Disabled"
    ]


def test_tls_is_immutable():
    old = example_job()
    assert admitted(spec_with(lambda s: s["tls"].update(mode="Disabled")), old) == [
        "spec: tls is immutable: the job's pods trust the CA they started with"
    ]
    assert admitted(old, old) == []


def test_a_plain_trainer_url_is_for_a_job_that_runs_unencrypted():
    def plain(s):
        s["trainer"]["service"].update(url="http://t.example.com:8470")
        s["tls"] = {"mode": "Disabled"}

    job = spec_with(plain)
    assert admitted(job) == []
    assert parse(job).spec.tls.mode == "Disabled"


def test_managed_by_is_immutable():
    old = spec_with(lambda s: s.update(managedBy="kueue.x-k8s.io/multikueue"))
    assert admitted(old) == []
    assert admitted(old, old) == []
    assert admitted(example_job(), old) == ["spec: managedBy is immutable"]
    assert admitted(spec_with(lambda s: s.update(managedBy="sparrowrl.dev/operator")), old) == [
        "spec: managedBy is immutable"
    ]


IMMUTABLE = (
    "spec: seed, model, task, grpo, sync and trainer.ranks, nodes and sharding are immutable: the trainer's state "
    "belongs to them"
)


def test_training_fields_are_immutable():
    old = example_job()
    assert admitted(spec_with(lambda s: s["placements"][0].update(replicas=4)), old) == []
    assert admitted(spec_with(lambda s: s.update(runPolicy={"suspend": True})), old) == []
    assert admitted(spec_with(lambda s: s.setdefault("trainer", {}).update(ranks=1)), old) == []  # the default
    assert admitted(spec_with(lambda s: s.setdefault("trainer", {}).update(nodes=1, sharding="full")), old) == []
    assert admitted(spec_with(lambda s: s.setdefault("trainer", {}).update(joinTimeoutSeconds=60)), old) == []
    for change in (
        lambda s: s.update(seed=1),
        lambda s: s["grpo"].update(learningRate=1e-6),
        lambda s: s.update(sync={"streams": 2}),
        lambda s: s["model"]["tiny"].update(layers=3),
        lambda s: s.setdefault("trainer", {}).update(ranks=2),
        lambda s: s.setdefault("trainer", {}).update(nodes=2),
        lambda s: s.setdefault("trainer", {}).update(sharding="hybrid"),
    ):
        assert admitted(spec_with(change), old) == [IMMUTABLE]


def test_steps_may_be_raised_not_lowered():
    """The trainer trains on from its state with more steps (state_mismatch); fewer it refuses,
    and so does the API server, naming the field."""
    old = example_job()
    assert old["spec"]["steps"] == 300
    assert admitted(spec_with(lambda s: s.update(steps=301)), old) == []
    assert admitted(spec_with(lambda s: s.update(steps=300)), old) == []
    lowered = "spec.steps: steps may be raised, not lowered: the trainer may have trained past the lower value"
    assert admitted(spec_with(lambda s: s.update(steps=299)), old) == [lowered]
    assert admitted(spec_with(lambda s: s.pop("steps")), old) == [lowered]  # the default, 50, is fewer
    both = admitted(spec_with(lambda s: s.update(steps=400, seed=1)), old)
    assert both == [IMMUTABLE]


def test_full_status_fits_the_schema():
    """Every field the operator can write survives a real API server (which drops unknown ones)."""
    status = SparrowRLJobStatus.model_validate(
        {
            "observedGeneration": 3,
            "phase": "Running",
            "conditions": [
                {
                    "type": "Created",
                    "status": "True",
                    "reason": "PodsCreated",
                    "message": "m",
                    "lastTransitionTime": "2026-12-01T00:00:00Z",
                    "observedGeneration": 3,
                }
            ],
            "placements": [
                {"region": "eu", "cluster": "eu-west", "desired": 2, "ready": 1, "failed": 1, "replaced": 1}
            ],
            "leases": {
                "active": 2,
                "healthy": 1,
                "expired": 3,
                "requeued": 4,
                "staleWorkers": ["w"],
                "oldestHeartbeatSeconds": 1.5,
            },
            "progress": {
                "step": 3,
                "steps": 9,
                "policyVersion": 3,
                "reward": 0.5,
                "recentReward": 0.4,
                "tokensPerSecond": 10.0,
                "payloadBytes": 99,
                "changedFraction": 0.01,
                "commitsVerified": 2,
                "commitsMismatched": 0,
                "costDollars": 0.25,
                "tokensPerDollar": 1234.5,
                "workers": [{"name": "w", "region": "eu", "committedVersion": 3, "verification": "ok"}],
            },
            "display": {
                "step": "3/9",
                "rollout": "1/2",
                "leases": "1/2",
                "clusters": "2/2",
                "payload": "99 B",
                "tokensPerDollar": "1.2k",
            },
            "trainerAddress": "http://1.2.3.4:8470",
            "restarts": 1,
            "startTime": "2026-12-01T00:00:00Z",
            "activeSince": "2026-12-01T00:00:00Z",
            "completionTime": "2026-12-01T01:00:00Z",
        }
    )
    dumped = status.model_dump(by_alias=True, exclude_none=True)
    schema = root_schema(JOB_CRD)["properties"]["status"]
    jsonschema.Draft4Validator(schema).validate(dumped)
    pruned = prune(schema, copy.deepcopy(dumped))
    assert pruned == dumped


def prune(schema: dict, obj):
    """Structural pruning, as the API server does it."""
    if isinstance(obj, dict) and "properties" in schema:
        return {k: prune(schema["properties"][k], v) for k, v in obj.items() if k in schema["properties"]}
    if isinstance(obj, list):
        return [prune(schema["items"], x) for x in obj]
    return obj
