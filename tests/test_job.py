"""The job spec: what `sparrowrl run` and the operator both read."""

import importlib.util
import subprocess
from pathlib import Path

import pytest
import yaml
from support.jobs import job
from support.servers import EXE

from sparrowrl.spec.job import JobError, load, parse

EXAMPLE = "examples/local-job.yaml"


def test_the_example_parses_with_its_defaults():
    j = load(EXAMPLE)
    assert j.kind == "SparrowRLJob" and j.spec.sync.mode == "sparse" and j.spec.rollout.engine == "hf"
    assert [r.name for r in j.spec.topology.regions] == ["us", "eu"]


@pytest.mark.parametrize(
    "spec, field, reason",
    [
        ({"grpo": {"learningRate": -1}}, "spec.grpo.learningRate", "greater than 0"),
        ({"grpo": {"learningrate": 1e-5}}, "spec.grpo.learningrate", "unknown field"),
        ({"sync": {"mode": "dense"}}, "spec.sync.mode", "'sparse' or 'full'"),
        ({"sync": {"staleness": 20}}, "spec.sync.staleness", "less than or equal to 8"),
        ({"rollout": {"engine": "tgi"}}, "spec.rollout.engine", "Input should be 'hf'"),
        ({"model": {"tiny": {"hidden": 100, "heads": 3}}}, "spec.model.tiny", "multiple of heads"),
        ({"model": {"path": "/m", "tiny": {}}}, "spec.model", "exactly one of model.path"),
        ({"task": {}}, "spec.task", "exactly one of task.builtin"),
        ({"topology": {"regions": [{"name": "a"}, {"name": "a"}]}}, "spec.topology", "unique"),
        ({"topology": {"regions": [{"name": "Bad_Name"}]}}, "spec.topology.regions.0.name", "pattern"),
        (
            {"topology": {"regions": [{"name": "a", "workers": 0}]}},
            "spec.topology",
            "at least one region needs a worker",
        ),
        ({"placements": [{"region": "a"}], "topology": {"regions": [{"name": "b"}]}}, "spec", "topology (regions for"),
        ({"placements": [{"region": "a", "cluster": "east"}]}, "spec", "cannot reach a ClusterIP trainer"),
        ({"placements": [{"region": "a", "replicas": 1, "minReplicas": 2}]}, "spec.placements.0", "must not exceed"),
        (
            {"placements": [{"region": "a", "template": {"status": {}}}]},
            "spec.placements.0.template",
            "metadata and spec",
        ),
        (
            {"placements": [{"region": "a", "template": {"spec": {"containers": [{"name": "relay", "env": []}]}}}]},
            "spec.placements.0.template",
            "spec.containers[0] ('relay'): the pod's one container is 'worker'",
        ),
        (
            {"relays": {"template": {"spec": {"containers": [{"name": "worker", "env": []}]}}}},
            "spec.relays.template",
            "the pod's one container is 'relay'; add a sidecar as an init container with restartPolicy: Always",
        ),
        (
            {"relays": {"template": {"spec": {"initContainers": [{"name": "relay"}]}}}},
            "spec.relays.template",
            "spec.initContainers[0] ('relay'): an init container needs its image",
        ),
        ({"relays": {"template": {"spec": {"containers": [{"image": "x"}]}}}}, "spec.relays.template", "needs a name"),
        ({"relays": {"template": {"spec": {"containers": None}}}}, "spec.relays.template", "a list of containers"),
        (
            {"relays": {"template": {"spec": {"containers": [{"name": "relay", "image": None}]}}}},
            "spec.relays.template",
            "image must be a string",
        ),
        ({"relays": {"resources": {"limits": {"cpu": "two"}}}}, "spec.relays.resources.limits.cpu", "pattern"),
        ({"runPolicy": {"workerBackoffLimit": -1}}, "spec.runPolicy.workerBackoffLimit", "greater than or equal to 0"),
        (
            {"trainer": {"state": {"retentionPolicy": {"whenDeleted": "Orphan"}}}},
            "spec.trainer.state.retentionPolicy.whenDeleted",
            "'Retain' or 'Delete'",
        ),
        ({"trainer": {"resources": {"limits": {"cpu": "two"}}}}, "spec.trainer.resources.limits.cpu", "pattern"),
        ({"trainer": {"ranks": 0}}, "spec.trainer.ranks", "greater than or equal to 1"),
        ({"trainer": {"ranks": 9}, "grpo": {"promptsPerStep": 8}}, "spec", "trainer.ranks (9) must not exceed"),
        ({"trainer": {"nodes": 33}}, "spec.trainer.nodes", "less than or equal to 32"),
        ({"trainer": {"nodes": 0}}, "spec.trainer.nodes", "greater than or equal to 1"),
        ({"trainer": {"sharding": "zero3"}}, "spec.trainer.sharding", "'full' or 'hybrid'"),
        ({"trainer": {"joinTimeoutSeconds": 5}}, "spec.trainer.joinTimeoutSeconds", "greater than or equal to 10"),
        (
            {"trainer": {"nodes": 3, "ranks": 3}, "grpo": {"promptsPerStep": 8}},
            "spec",
            "trainer.nodes × ranks (3 × 3) must not exceed grpo.promptsPerStep (8)",
        ),
        (
            {"trainer": {"nodes": 32, "ranks": 16}, "grpo": {"promptsPerStep": 1024}},
            "spec",
            "trainer.nodes × ranks (32 × 16) is more than 256 ranks",
        ),
        (
            {"trainer": {"ranks": 4, "resources": {"limits": {"nvidia.com/gpu": "2"}}}},
            "spec",
            "fewer than trainer.ranks",
        ),
        ({"runPolicy": {"backoffLimit": 101}}, "spec.runPolicy.backoffLimit", "less than or equal to 100"),
        # the objective's fields (issue 45): each bounded, finite, and named
        ({"grpo": {"clipHigh": 0}}, "spec.grpo.clipHigh", "greater than 0"),
        ({"grpo": {"dualClip": 1.0}}, "spec.grpo.dualClip", "greater than 1"),
        ({"grpo": {"dualClip": float("nan")}}, "spec.grpo.dualClip", "finite number"),
        ({"grpo": {"ratioLevel": "batch"}}, "spec.grpo.ratioLevel", "'token' or 'sequence'"),
        ({"grpo": {"lossAggregation": "dapo"}}, "spec.grpo.lossAggregation", "'token', 'sequence' or 'constant'"),
        ({"grpo": {"scaleRewards": True}}, "spec.grpo.scaleRewards", "'group', 'batch' or 'none'"),
        ({"grpo": {"zeroVarianceGroups": "filter"}}, "spec.grpo.zeroVarianceGroups", "'skip', 'train' or 'refill'"),
        ({"grpo": {"maxGenBatches": 0}}, "spec.grpo.maxGenBatches", "greater than or equal to 1"),
        ({"grpo": {"maxGenBatches": 65}}, "spec.grpo.maxGenBatches", "less than or equal to 64"),
        ({"grpo": {"updatesPerBatch": 65}}, "spec.grpo.updatesPerBatch", "less than or equal to 64"),
        ({"grpo": {"entropyCoef": -0.1}}, "spec.grpo.entropyCoef", "greater than or equal to 0"),
        ({"grpo": {"klEstimator": "k4"}}, "spec.grpo.klEstimator", "'k1', 'k2', 'k3' or 'low-var-kl'"),
        ({"grpo": {"overlongBuffer": 9, "maxNewTokens": 8}}, "spec.grpo", "overlongBuffer (9) must not exceed"),
        ({"grpo": {"overlongPenalty": float("inf")}}, "spec.grpo.overlongPenalty", "finite number"),
        ({"grpo": {"behaviour": {"correction": "clip"}}}, "spec.grpo.behaviour.correction", "'off', 'truncate'"),
        ({"grpo": {"behaviour": {"cap": 1.0}}}, "spec.grpo.behaviour.cap", "greater than 1"),
        ({"grpo": {"behaviour": {"floor": 1.5}}}, "spec.grpo.behaviour.floor", "less than 1"),
        ({"grpo": {"behaviour": {"refuseGap": 0}}}, "spec.grpo.behaviour.refuseGap", "greater than 0"),
        ({"grpo": {"behaviour": {"level": "group"}}}, "spec.grpo.behaviour.level", "'token' or 'sequence'"),
        ({"health": {"onStale": "Panic"}}, "spec.health.onStale", "'Replace', 'Ignore' or 'FailJob'"),
        ({"trainer": {"costPerHour": -1}}, "spec.trainer.costPerHour", "greater than or equal to 0"),
        ({"trainer": {"costPerHour": float("inf")}}, "spec.trainer.costPerHour", "finite number"),
        (
            {"placements": [{"region": "a", "costPerHour": 1e9}]},
            "spec.placements.0.costPerHour",
            "less than or equal to 100000",
        ),
    ],
)
def test_bad_fields_are_named_with_the_reason(spec, field, reason):
    with pytest.raises(JobError) as e:
        parse(job(**spec))
    assert f"{field}: " in str(e.value) and reason in str(e.value)


def test_a_job_with_placements_survives_a_round_trip():
    """`sparrowrl run --steps` dumps the spec and reads it back: every field is then set."""
    j = load("examples/k8s/job.yaml")
    again = parse(
        {
            "apiVersion": j.api_version,
            "kind": j.kind,
            "metadata": {"name": "x"},
            "spec": j.spec.model_dump(by_alias=True, exclude_none=True),
        }
    )
    assert again.spec == j.spec and [r.name for r in again.spec.regions] == ["us", "eu", "ap"]
    assert again.spec.quorum == 1 + 1 + 1  # each placement's minReplicas


def test_wrong_kind_and_missing_metadata():
    with pytest.raises(JobError, match="kind: Input should be 'SparrowRLJob'"):
        parse({**job(), "kind": "Job"})
    with pytest.raises(JobError, match="metadata: Field required"):
        parse({k: v for k, v in job().items() if k != "metadata"})


@pytest.mark.e2e
def test_run_refuses_a_bad_spec_before_starting_anything(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(job(grpo={"groupSize": 1})))
    r = subprocess.run([EXE, "run", str(bad), "--run-dir", str(tmp_path / "run")], capture_output=True, text=True)
    assert r.returncode == 1 and "spec.grpo.groupSize: Input should be greater than or equal to 2" in r.stderr
    assert not (tmp_path / "run").exists()
    (tmp_path / "broken.yaml").write_text("spec: [")
    r = subprocess.run([EXE, "run", str(tmp_path / "broken.yaml")], capture_output=True, text=True)
    assert r.returncode == 1 and "not valid YAML" in r.stderr


@pytest.mark.e2e
@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_run_names_a_missing_vllm_before_starting_anything(tmp_path):
    f = tmp_path / "vllm.yaml"
    f.write_text(yaml.safe_dump(job(rollout={"engine": "vllm"})))
    r = subprocess.run([EXE, "run", str(f), "--run-dir", str(tmp_path / "run")], capture_output=True, text=True)
    assert r.returncode == 1 and "spec.rollout.engine: vllm is not installed here" in r.stderr
    assert not (tmp_path / "run").exists()


def test_relative_paths_are_relative_to_the_job_file(tmp_path):
    (tmp_path / "data.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    f = tmp_path / "j.yaml"
    f.write_text(yaml.safe_dump(job(task={"jsonl": "data.jsonl"})))
    assert load(f).spec.task.jsonl == str(tmp_path / "data.jsonl")
    (tmp_path / "data").mkdir()
    f.write_text(yaml.safe_dump(job(task={"dataset": {"path": "data"}})))
    assert load(f).spec.task.dataset.path == str(tmp_path / "data")
    f.write_text(yaml.safe_dump(job(task={"dataset": {"path": "openai/gsm8k", "name": "main"}})))
    assert load(f).spec.task.dataset.path == "openai/gsm8k"  # nothing of that name here: a name on the hub


@pytest.mark.parametrize(
    "task, reason",
    [
        (
            {"builtin": "add", "jsonl": "x.jsonl"},
            "give exactly one of task.builtin, task.jsonl, task.dataset and task.environment",
        ),
        ({"reward": "exact"}, "give exactly one of task.builtin, task.jsonl, task.dataset and task.environment"),
        ({"builtin": "add", "chatTemplate": "maybe"}, "spec.task.chatTemplate: Input should be a valid boolean"),
        (
            {"builtin": "add", "maxPromptTokens": 0},
            "spec.task.maxPromptTokens: Input should be greater than or equal to 1",
        ),
        ({"builtin": "add", "onBadRow": "ignore"}, "spec.task.onBadRow: Input should be 'refuse' or 'skip'"),
        ({"builtin": "add", "rewardWorkers": 65}, "spec.task.rewardWorkers: Input should be less than or equal to 64"),
        (
            {"builtin": "add", "rewardTimeoutSeconds": 0},
            "spec.task.rewardTimeoutSeconds: Input should be greater than 0",
        ),
        ({"dataset": {"path": "d", "promptField": ""}}, "spec.task.dataset.promptField: String should have at least 1"),
        ({"dataset": {"split": "train"}}, "spec.task.dataset.path: Field required"),
    ],
)
def test_task_fields_are_checked(task, reason):
    with pytest.raises(JobError) as e:
        parse(job(task=task))
    assert reason in str(e.value), str(e.value)


def cli(*args):
    """The command in this process (typer's runner): exit code and stderr."""
    from typer.testing import CliRunner

    from sparrowrl.cli.main import app

    r = CliRunner().invoke(app, list(map(str, args)), catch_exceptions=False)
    return r.exit_code, r.stderr


def test_a_job_file_of_several_documents_is_read_for_its_one_sparrowrljob(tmp_path):
    """examples/k8s/job-volumes.yaml: a claim, a ConfigMap and the job, as `kubectl apply -f`
    takes them. `sparrowrl run` and `check` read the job and ignore the others (docs/operator.md:
    the same YAML runs under both); none or two jobs is one line naming the file and the count."""
    volumes = Path(__file__).resolve().parents[1] / "examples/k8s/job-volumes.yaml"
    j = load(volumes)
    assert j.metadata.name == "chat-grpo" and j.spec.model.path == str(volumes.resolve().parent / "inputs/model")
    code, err = cli("check", volumes)  # past loading: the model is on the claim, not here
    assert code == 3 and err.strip() == f"error: {volumes}: spec.model.path: {j.spec.model.path} is not a folder"

    claim, config, spec = yaml.safe_load_all(volumes.read_text())
    f = tmp_path / "j.yaml"
    for docs, count in (
        ([claim, config], "0 of its 2 YAML documents (PersistentVolumeClaim, ConfigMap)"),
        ([spec, claim, spec], "2 of its 3 YAML documents (SparrowRLJob, PersistentVolumeClaim, SparrowRLJob)"),
    ):
        f.write_text(yaml.safe_dump_all(docs))
        code, err = cli("run", f, "--run-dir", tmp_path / "run")
        assert code == 1 and err.strip() == f"error: {f}: {count} are a SparrowRLJob; a job file holds exactly one"
    assert not (tmp_path / "run").exists()


def test_the_alias_bound_covers_every_document_of_a_job_file(tmp_path):
    """Documents not read are still expanded by whoever reads them (kubectl): the bound on YAML
    values once aliases are expanded holds for the file, not for its job alone."""
    many = "kind: ConfigMap\ndata:\n  l0: &l0 [0, 0, 0, 0, 0, 0, 0, 0, 0, 0]\n"
    many += "".join(f"  l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]\n" for i in (1, 2, 3))
    many += f"  l4: [{', '.join(['*l3'] * 5)}]\n"  # about 68,000 values
    one = yaml.safe_dump(job(), sort_keys=False)
    f = tmp_path / "j.yaml"
    f.write_text(f"{many}---\n{one}")
    assert load(f).metadata.name == "t"  # one such document is within the bound
    f.write_text(f"{many}---\n{many}---\n{one}")
    with pytest.raises(JobError, match=r"more than 100,000 YAML values once its aliases are expanded"):
        load(f)


@pytest.mark.parametrize(
    "text, at, why",
    [
        (
            "spec:\n  steps: 1\n model: x\n",  # indented less than its siblings
            "line 3, column 2",
            "expected <block end>, but found '<block mapping start>' (while parsing a block mapping at line 1, "
            "column 1)",
        ),
        (
            "spec: [1, 2\n",  # a bracket never closed
            "line 2, column 1",
            "expected ',' or ']', but got '<stream end>' (while parsing a flow sequence at line 1, column 7)",
        ),
        ("spec:\n\tsteps: 1\n", "line 2, column 1", "found character '\\t' that cannot start any token"),
        ("kind: SparrowRLJob\nmetadata: name: x\n", "line 2, column 15", "mapping values are not allowed here"),
    ],
)
def test_a_yaml_syntax_error_is_one_line_with_its_line_and_column(tmp_path, text, at, why):
    f = tmp_path / "job.yaml"
    f.write_text(text)
    code, err = cli("run", f, "--run-dir", tmp_path / "run")
    assert code == 1 and err.strip() == f"error: {f}: not valid YAML at {at}: {why}", err
    assert not (tmp_path / "run").exists()
