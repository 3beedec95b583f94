"""What the operator's pods are made of (builders.py, through the cycle): templates merged as
each role's, relays' own resources, the trainer's check, and every example's pods valid for
Kubernetes' own schema."""

from __future__ import annotations

import re

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version
from test_operator_decisions import IMAGE, ROOT, T0, World, body

from sparrowrl_operator.reconcile import reconcile


def test_a_sharded_trainer_gets_shared_memory_for_its_ranks():
    w, job = World(), body()
    job["spec"]["trainer"]["ranks"] = 2
    w.step(job, 0), w.step(job, 0)
    trainer = w.pods[None]["add-grpo-trainer-0"]["spec"]
    assert {"name": "shm", "emptyDir": {"medium": "Memory"}} in trainer["volumes"]
    assert {"name": "shm", "mountPath": "/dev/shm"} in trainer["containers"][0]["volumeMounts"]
    w, job = World(), body()
    w.step(job, 0), w.step(job, 0)
    assert "shm" not in str(w.pods[None]["add-grpo-trainer-0"]["spec"]["volumes"])


def documented_example() -> str:
    """The job docs/operator.md shows for GPU workers, checked to be examples/k8s/gpu-workers.yaml."""
    doc = (ROOT / "docs" / "operator.md").read_text()
    blocks = [b for b in re.findall(r"```yaml\n(.*?)```", doc, re.S) if "\n  relays:\n" in b]
    assert len(blocks) == 1, "docs/operator.md shows one job with relays"
    assert blocks[0] == (ROOT / "examples" / "k8s" / "gpu-workers.yaml").read_text()
    return blocks[0]


def test_relay_pods_take_neither_gpus_nor_a_workers_template():
    """The documented example: workers with a GPU each and a template that adds a variable and a
    volume; the relay gets its own resources, no GPU, no toleration of GPU nodes, and one container
    with an image. Every pod is valid for Kubernetes' own schema."""
    job = yaml.safe_load(documented_example())
    job["metadata"] |= {"uid": "u-1", "generation": 1}
    w = World(members={})
    w.step(job, 0)
    pods = w.pods[None]
    assert sorted(pods) == [
        "gpu-grpo-relay-us-0",
        "gpu-grpo-trainer-0",
        "gpu-grpo-worker-us-0-0",
        "gpu-grpo-worker-us-1-0",
    ]
    for pod in pods.values():
        kubernetes_validate.validate(pod, latest_version(), strict=True)
        assert all(c.get("image") for c in pod["spec"]["containers"])
    relay = pods["gpu-grpo-relay-us-0"]["spec"]
    assert [c["name"] for c in relay["containers"]] == ["relay"]
    assert relay["containers"][0]["resources"] == {"requests": {"cpu": "2", "memory": "4Gi"}}
    assert "nvidia.com/gpu" not in str(relay) and "tolerations" not in relay
    assert "HF_HOME" not in str(relay) and "hf-cache" not in str(relay)
    worker = pods["gpu-grpo-worker-us-0-0"]["spec"]
    (c,) = worker["containers"]
    assert c["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    assert {"name": "HF_HOME", "value": "/cache"} in c["env"]
    assert {"name": "hf-cache", "mountPath": "/cache"} in c["volumeMounts"]
    assert {"name": "hf-cache", "emptyDir": {"sizeLimit": "20Gi"}} in worker["volumes"]
    log = {"name": "SPARROWRL_LOG_FORMAT", "value": "json"}  # every role logs JSON lines in a cluster
    assert all(log in p["spec"]["containers"][0]["env"] for p in pods.values())


def test_a_native_sidecar_is_added_to_workers_and_relays_get_their_template():
    proxy = {"name": "proxy", "image": "envoyproxy/envoy:v1.33", "restartPolicy": "Always"}
    job = body(
        placements=[{"region": "us", "template": {"spec": {"initContainers": [proxy]}}}],
        relays={"template": {"metadata": {"labels": {"team": "net"}}, "spec": {"priorityClassName": "relay"}}},
    )
    w = World(members={})
    w.step(job, 0)
    worker, relay = w.pods[None]["add-grpo-worker-us-0-0"], w.pods[None]["add-grpo-relay-us-0"]
    assert [c["name"] for c in worker["spec"]["containers"]] == ["worker"]
    assert worker["spec"]["initContainers"] == [proxy]
    assert [c["name"] for c in relay["spec"]["containers"]] == ["relay"] and "initContainers" not in relay["spec"]
    assert relay["metadata"]["labels"]["team"] == "net" and relay["spec"]["priorityClassName"] == "relay"
    assert "team" not in worker["metadata"]["labels"] and "priorityClassName" not in worker["spec"]


@pytest.mark.parametrize(
    "template, why",
    [
        ({"spec": {"containers": [{"name": "sidecar", "env": []}]}}, "spec.containers[0] ('sidecar'): the pod's one"),
        (
            {"spec": {"containers": [{"name": "proxy", "image": "envoy"}]}},
            "spec.containers[0] ('proxy'): the pod's one container is 'worker'; add a sidecar",
        ),
        ({"spec": {"initContainers": [{"name": "fetch"}]}}, "spec.initContainers[0] ('fetch'): an init container"),
        ({"spec": None}, "spec: an object"),
        ({"metadata": None}, "metadata: an object"),
        ({"metadata": {"labels": {"sparrowrl.dev/job-uid": "x"}}}, "metadata.labels['sparrowrl.dev/job-uid']"),
        ({"metadata": {"labels": {"app.kubernetes.io/managed-by": "me"}}}, "metadata.labels['app.kubernetes.io"),
        ({"metadata": {"annotations": {"sparrowrl.dev/steps": "9"}}}, "metadata.annotations['sparrowrl.dev/steps']"),
        ({"metadata": {"name": "mine"}}, "metadata.name: the operator sets it"),
        ({"spec": {"restartPolicy": "OnFailure"}}, "spec.restartPolicy: the operator sets it"),
        (
            {"spec": {"containers": [{"name": "worker", "volumeMounts": [{"name": "tmp", "mountPath": "/scratch"}]}]}},
            "spec.containers[0] ('worker'): volume 'tmp' is the pod's /tmp",
        ),
    ],
)
def test_a_template_that_would_break_the_pods_fails_the_job(template, why):
    """An image-less container would be refused by the API server; an added container would keep a
    finished pod running; the operator's labels, a name or a restart policy would hide its pods
    from it or its check's refusal from the job."""
    job = body(placements=[{"region": "us", "template": template}])
    actions = reconcile(job, World(members={}).observe(T0), IMAGE)
    failed = next(c for c in actions.status.conditions if c.type == "Failed")
    assert failed.reason == "InvalidSpec" and actions.create == []
    assert "spec.placements.0.template: " + why in failed.message, failed.message


def trainer_pod(example: str) -> tuple[dict, World]:
    w, job = World(), yaml.safe_load_all((ROOT / "examples" / "k8s" / example).read_text())
    job = next(d for d in job if d["kind"] == "SparrowRLJob")
    job["metadata"] |= {"uid": "u-1", "generation": 1}
    w.step(job, 0), w.step(job, 0)
    return w.pods[None][f"{job['metadata']['name']}-trainer-0"], w


@pytest.mark.parametrize(
    "example", ["job.yaml", "job-volumes.yaml", "job-hub.yaml", "job-image.yaml", "job-environment.yaml"]
)
def test_every_pod_of_the_examples_is_a_valid_pod(example):
    """What a real API server would refuse (an init container with a probe, a mount of no volume)."""
    import kubernetes_validate
    from kubernetes_validate.utils import latest_version

    _, w = trainer_pod(example)
    for pods in w.pods.values():
        for pod in pods.values():
            kubernetes_validate.validate(pod, latest_version(), strict=True)
            spec = pod["spec"]
            volumes = {v["name"] for v in spec["volumes"]}
            for c in spec["containers"] + spec.get("initContainers", []):
                assert {m["name"] for m in c.get("volumeMounts", [])} <= volumes, (pod["metadata"]["name"], c["name"])


def test_the_trainer_pod_takes_its_template_and_checks_the_job_before_it_starts():
    pod, w = trainer_pod("job-volumes.yaml")
    spec = pod["spec"]
    assert {"name": "inputs", "persistentVolumeClaim": {"claimName": "grpo-inputs", "readOnly": True}} in spec[
        "volumes"
    ]
    trainer, (check,) = spec["containers"][0], spec["initContainers"]
    assert trainer["args"][:2] == ["trainer", "job.yaml"]  # in the working folder: relative paths are below it
    mounts = {m["mountPath"]: m for m in trainer["volumeMounts"]}
    assert mounts["/var/lib/sparrowrl/job.yaml"]["subPath"] == "job.yaml"
    assert mounts["/var/lib/sparrowrl/inputs"]["name"] == "inputs"  # the template's, merged by name
    assert check["name"] == "sparrowrl-check" and check["args"] == ["check", "job.yaml", "--state-dir", "state"]
    assert check["volumeMounts"] == trainer["volumeMounts"] and check["resources"] == trainer["resources"]
    assert check["image"] == trainer["image"] and check["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert "SPARROWRL_TOKEN" not in {e["name"] for e in check["env"]}  # it signs nothing
    assert trainer["startupProbe"]["httpGet"]["path"] == "/healthz"
    for name, worker in w.pods[None].items():  # the trainer's template is the trainer's alone
        if name != pod["metadata"]["name"]:
            assert "inputs" not in str(worker["spec"]) and "initContainers" not in worker["spec"]

    pod, _ = trainer_pod("job-hub.yaml")
    trainer, (check,) = pod["spec"]["containers"][0], pod["spec"]["initContainers"]
    token = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}}
    assert token in trainer["env"] and token in check["env"]

    pod, _ = trainer_pod("job-image.yaml")
    spec = pod["spec"]
    assert spec["imagePullSecrets"] == [{"name": "registry-example-com"}]
    assert spec["serviceAccountName"] == "sparrowrl-trainer" and spec["priorityClassName"] == "training-high"
    assert "nodeAffinity" in spec["affinity"]
    assert spec["initContainers"][0]["image"] == "registry.example.com/team/sparrowrl-rewards:1.2.0-gpu"


def test_an_environment_is_mounted_at_one_place_in_the_trainer_s_pod_and_every_worker_s():
    """examples/k8s/job-environment.yaml: the ConfigMap of its code, at /var/lib/sparrowrl/envs in
    the trainer's pod (and its check's) and in each worker's, where the job's envs/FILE.py names it."""
    pod, w = trainer_pod("job-environment.yaml")
    workers = [p for name, p in w.pods[None].items() if "-worker-" in name]
    assert len(workers) == 2
    for p in [pod, *workers]:
        spec = p["spec"]
        assert {"name": "env", "configMap": {"name": "two-turn-sum"}} in spec["volumes"]
        for c in spec["containers"] + spec.get("initContainers", []):
            assert c["workingDir"] == "/var/lib/sparrowrl"
            assert {"name": "env", "mountPath": "/var/lib/sparrowrl/envs", "readOnly": True} in c["volumeMounts"]


def test_every_container_of_ours_writes_only_to_its_volumes_and_a_template_may_say_otherwise():
    """Each role's container, a trainer node's and the check run on a read-only root with a /tmp
    of their own, in pods that get no service account token; a template's own volume at /tmp
    replaces that one (two mounts at one path would be refused), a template may give a container
    a writable root back, and one that names a service account gets its token as it says."""
    job = body()
    job["spec"]["trainer"] |= {"nodes": 2, "ranks": 1}
    w = World(members={})
    w.step(job, 0), w.step(job, 1)
    pods = w.pods[None]
    assert {"add-grpo-trainer-0", "add-grpo-trainer-node1-0", "add-grpo-relay-us-0"} <= set(pods)
    for name, pod in pods.items():
        kubernetes_validate.validate(pod, latest_version(), strict=True)
        spec = pod["spec"]
        assert {"name": "tmp", "emptyDir": {}} in spec["volumes"], name
        assert spec["automountServiceAccountToken"] is False, name  # no role calls the Kubernetes API
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False, (name, c["name"])
            assert [m["name"] for m in c["volumeMounts"] if m["mountPath"] == "/tmp"] == ["tmp"], (name, c["name"])

    scratch = {"name": "scratch", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}}
    template = {
        "spec": {
            "volumes": [scratch],
            "containers": [
                {
                    "name": "worker",
                    "volumeMounts": [{"name": "scratch", "mountPath": "/tmp"}],
                    "securityContext": {"readOnlyRootFilesystem": False},
                }
            ],
        }
    }
    w = World(members={})
    w.step(body(placements=[{"region": "us", "template": template}]), 0)
    worker = w.pods[None]["add-grpo-worker-us-0-0"]
    kubernetes_validate.validate(worker, latest_version(), strict=True)
    (c,) = worker["spec"]["containers"]
    assert [m["name"] for m in c["volumeMounts"] if m["mountPath"] == "/tmp"] == ["scratch"]
    assert scratch in worker["spec"]["volumes"] and "tmp" not in {v["name"] for v in worker["spec"]["volumes"]}
    assert c["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": False,
    }
    in_memory = {"name": "tmp", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}}
    w = World(members={})
    w.step(body(placements=[{"region": "us", "template": {"spec": {"volumes": [in_memory]}}}]), 0)
    worker = w.pods[None]["add-grpo-worker-us-0-0"]
    kubernetes_validate.validate(worker, latest_version(), strict=True)
    assert [v for v in worker["spec"]["volumes"] if v["name"] == "tmp"] == [in_memory]
    assert {"name": "tmp", "mountPath": "/tmp"} in worker["spec"]["containers"][0]["volumeMounts"]
    env = {e["name"]: e.get("value") for e in worker["spec"]["containers"][0]["env"]}
    assert env["HOME"] == "/tmp" and env["NUMBA_CACHE_DIR"] == "/tmp/numba"  # caches where it can write
    home = {"name": "HOME", "valueFrom": {"configMapKeyRef": {"name": "paths", "key": "home"}}}
    w = World(members={})
    w.step(
        body(placements=[{"region": "us", "template": {"spec": {"containers": [{"name": "worker", "env": [home]}]}}}]),
        0,
    )
    env = w.pods[None]["add-grpo-worker-us-0-0"]["spec"]["containers"][0]["env"]
    assert [e for e in env if e["name"] == "HOME"] == [home]  # whole: a value beside it would be refused
    relay = w.pods[None]["add-grpo-relay-us-0"]["spec"]  # the workers' template is theirs alone
    assert relay["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True

    pod, _ = trainer_pod("job-image.yaml")  # a service account named: its own setting decides
    assert (
        pod["spec"]["serviceAccountName"] == "sparrowrl-trainer" and "automountServiceAccountToken" not in pod["spec"]
    )
    job = body()
    job["spec"]["trainer"]["template"] = {"spec": {"serviceAccountName": "sa", "automountServiceAccountToken": True}}
    w = World(members={})
    w.step(job, 0)
    assert w.pods[None]["add-grpo-trainer-0"]["spec"]["automountServiceAccountToken"] is True
