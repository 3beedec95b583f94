"""The operator's pods really train: kopf runs the operator against emulated clusters, and
tests/support/kubelet.py runs every Pod it creates as a local process. A job spanning the operator's
cluster and two members trains to completion, through faults, with every commit verified."""

from __future__ import annotations

import base64
import copy
import http.client
import socket
import ssl
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from support.kube import clusters, until
from support.kubelet import kubelets
from support.operator_run import add_member, columns, operator

from sparrowrl.auth import pki

# The two tests run one after the other (make test: --dist loadgroup): each runs dozens of processes,
# and together on this workplace's 2 cores their jobs starved (a 40-step job needed over 300 s).
pytestmark = [pytest.mark.kube, pytest.mark.e2e, pytest.mark.xdist_group("clusters")]


CRD = yaml.safe_load((Path(__file__).parent.parent / "crds" / "sparrowrl.dev_sparrowrljobs.yaml").read_text())

JOBS = "sparrowrl.dev/v1alpha1/sparrowrljobs"
NS = "default"
JOB = {
    "apiVersion": "sparrowrl.dev/v1alpha1",
    "kind": "SparrowRLJob",
    "metadata": {"name": "grpo", "namespace": NS},
    "spec": {
        "steps": 60,
        "seed": 1,
        "model": {"tiny": {"hidden": 32, "layers": 1, "heads": 2}},
        "task": {"builtin": "add"},
        "grpo": {"groupSize": 4, "promptsPerStep": 4, "maxNewTokens": 3, "learningRate": 1e-3},
        "rollout": {"groupsPerLease": 1, "leaseSeconds": 10},
        "trainer": {"service": {"type": "LoadBalancer"}},
        "placements": [
            {"region": "us", "replicas": 1},
            {"region": "eu", "cluster": "east", "replicas": 1},
            {"region": "ap", "cluster": "west", "replicas": 1},
        ],
        "health": {"staleAfterSeconds": 20},
    },  # over a worker's longest retry backoff (about 10 s)
}


def job_of(home) -> dict:
    job = home.get(JOBS, NS, "grpo") or {}
    assert (job.get("status") or {}).get("phase") != "Failed", job["status"]  # fail now, not at a deadline
    return job


def condition(job: dict, type_: str) -> dict:
    return next((c for c in (job.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


def reasons(home) -> list[str]:
    return [e.get("reason") for e in home.list("v1/events", NS)]


def pods(cluster, namespace: str) -> set[str]:
    return {p["metadata"]["name"] for p in cluster.list("v1/pods", namespace)}


def kubectl(tools: Path, home, tmp_path: Path, *args: str) -> str:
    config = tmp_path / "kubeconfig"
    config.write_text(yaml.safe_dump(home.kubeconfig()))
    p = subprocess.run(
        [str(tools / "kubectl"), "--kubeconfig", str(config), *args], capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 0, p.stderr
    return p.stdout


def settled(home, **want) -> dict | None:
    """The job once its status has these display columns' values, e.g. rollout="3/3"."""
    j = job_of(home)
    return j if all(((j.get("status") or {}).get("display") or {}).get(k) == v for k, v in want.items()) else None


STEPS = 150


@pytest.mark.timeout(600)
def test_a_job_across_three_clusters_trains_to_completion_through_faults(tmp_path, kube_tools):
    with (
        clusters("home", "east", "west") as (home, east, west),
        kubelets(home, east, west, root=tmp_path) as (k_home, k_east, _),
        operator(home),
    ):
        add_member(home, east, "east")
        add_member(home, west, "west")
        job = copy.deepcopy(JOB)
        job["spec"]["steps"] = STEPS  # enough to outlast the checks and the faults below
        m = "grpo-" + home.create(job)["metadata"]["uid"][:5]  # names in a member carry the uid's start
        until(
            lambda: (job_of(home).get("status") or {}).get("progress", {}).get("step", 0) >= 2,
            240,
            "training under way",
        )
        running = until(
            lambda: settled(home, rollout="3/3", leases="1/1") or settled(home, rollout="3/3"), 60, "every worker ready"
        )
        (tmp_path / "running.yaml").write_text(yaml.safe_dump(running))
        encrypted_every_hop(home, k_home, running)
        described = kubectl(kube_tools, home, tmp_path, "describe", "srl", "grpo")
        assert "Phase:" in described and "Type:" in described and "TrainerReady" in described, described
        (tmp_path / "describe.txt").write_text(described)
        shown = columns(CRD, running, wide=True)
        assert shown["Phase"] == "Running" and shown["Rollout"] == "3/3" and shown["Clusters"] == "3/3", shown
        print(shown, described, sep="\n")

        old = slot_token(east, f"{m}-worker-eu-0-token")
        k_east.kill("sparrowrl", f"{m}-worker-eu-0-0")  # a node loses the container
        until(lambda: f"{m}-worker-eu-0-1" in pods(east, "sparrowrl"), 60, "the killed worker replaced")
        new = slot_token(east, f"{m}-worker-eu-0-token")
        asks = lambda token: asked(home, running["status"]["trainerAddress"], token)  # noqa: E731
        why = until(lambda: (r := asks(old))[0] == 401 and r[1], 120, "the replaced pod's token refused")
        assert "was replaced by generation" in why and asks(new)[0] == 200
        k_home.kill(NS, "grpo-trainer-0")
        until(lambda: "grpo-trainer-1" in pods(home, NS), 60, "the trainer restarted")
        job = until(
            lambda: (j := job_of(home)).get("status", {}).get("phase") in ("Succeeded", "Failed") and j,
            400,
            "the job finished",
        )
        s = job["status"]
        assert s["phase"] == "Succeeded", condition(job, "Failed")
        assert s["progress"]["step"] == s["progress"]["steps"] == STEPS
        assert s["progress"]["commitsVerified"] > 0 and s["progress"]["commitsMismatched"] == 0
        assert s["restarts"] == 1
        assert "resumed at v" in k_home.log(NS, "grpo-trainer-1")  # from its volume, not from scratch
        replaced = {p["region"]: p["replaced"] for p in s["placements"]}
        assert replaced == {"us": 0, "eu": 1, "ap": 0}, s["placements"]
        assert {"Created", "Replaced", "TrainerRestarted", "Succeeded"} <= set(reasons(home))
        assert s["display"]["step"] == f"{STEPS}/{STEPS}"
        assert s["trainerAddress"].startswith("https://127.")
        until(
            lambda: (
                not [
                    p
                    for p in east.list("v1/pods", "sparrowrl")
                    if p["status"].get("phase") not in ("Succeeded", "Failed")
                ]
            ),
            30,
            "nothing left running in the member",
        )  # a finished job frees its machines


def encrypted_every_hop(home, k_home, running: dict) -> None:
    """TLS by default: the trainer's load balancer answers HTTPS with a certificate the job's CA
    signed for its address (issued anew when the address appeared, after the trainer had started,
    and read by it where it runs), refuses plain HTTP, and is refused by a client of another CA."""
    assert condition(running, "Encrypted")["status"] == "True"
    ca = base64.b64decode(home.get("v1/secrets", NS, "grpo-ca")["data"]["tls.crt"]).decode()
    lb = running["status"]["trainerAddress"]
    with urllib.request.urlopen(f"{lb}/healthz", timeout=10, context=ssl.create_default_context(cadata=ca)) as r:
        assert r.status == 200
    with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
        urllib.request.urlopen(lb.replace("https://", "http://") + "/healthz", timeout=10)
    other = ssl.create_default_context(cadata=pki.authority("another job").cert.decode())
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        urllib.request.urlopen(f"{lb}/healthz", timeout=10, context=other)
    host = lb.split("://")[1].split(":")[0]
    assert events(home, "CertificateIssued", f"does not name {host}"), "issued anew for the load balancer"

    def served() -> bytes:
        with (
            socket.create_connection((host, 8470), timeout=10) as s,
            ssl.create_default_context(cadata=ca).wrap_socket(s, server_hostname=host) as t,
        ):
            return t.getpeercert(binary_form=True) or b""

    def issued() -> bytes | None:
        s = home.get("v1/secrets", NS, "grpo-trainer-tls")
        pem = base64.b64decode(s["data"]["tls.crt"]) if s else None
        return x509.load_pem_x509_certificate(pem).public_bytes(serialization.Encoding.DER) if pem else None

    before = served()
    assert before == issued()
    home.delete("v1/secrets", NS, "grpo-trainer-tls")  # a certificate issued anew, while the trainer runs
    after = until(lambda: (c := issued()) and c != before and c, 60, "a new certificate")
    until(lambda: served() == after, 60, "the trainer serving it")
    assert "serving the certificate in tls/tls.crt from now on" in k_home.log(NS, "grpo-trainer-0")  # no restart


def slot_token(cluster, name: str) -> str:
    return base64.b64decode(cluster.get("v1/secrets", "sparrowrl", name)["data"]["token"]).decode()


def asked(home, trainer: str, token: str) -> tuple[int, str]:
    """GET /v1/job from the trainer's load balancer with `token`, as a worker does: status, text."""
    ca = base64.b64decode(home.get("v1/secrets", NS, "grpo-ca")["data"]["tls.crt"]).decode()
    request = urllib.request.Request(f"{trainer}/v1/job", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=10, context=ssl.create_default_context(cadata=ca)) as r:
            return r.status, ""
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def small(name: str, **spec) -> dict:
    job = copy.deepcopy(JOB)
    job["metadata"]["name"] = name
    job["spec"].update(placements=[{"region": "us", "replicas": 1}], trainer={}, **spec)
    return job


def events(home, reason: str, about: str) -> list[dict]:
    return [e for e in home.list("v1/events", NS) if e.get("reason") == reason and about in e.get("message", "")]


@pytest.mark.timeout(900)
def test_a_hung_worker_suspend_and_resume_and_a_trainer_past_its_backoff_limit(tmp_path):
    """Three jobs in one cluster: one whose only worker hangs, which is found stale and replaced
    (with no other worker, the job cannot end first); one suspended mid-run and resumed, which
    goes on from its state; one whose trainer dies with backoffLimit 0, which fails and frees
    its pods."""
    with clusters("home") as (home,), kubelets(home, root=tmp_path) as (k_home,), operator(home):
        step = lambda name: ((home.get(JOBS, NS, name) or {}).get("status") or {}).get("progress", {}).get("step", 0)  # noqa: E731
        home.create(small("hung", steps=40))
        until(lambda: step("hung") >= 1, 240, "the hung job training")
        k_home.pause(NS, "hung-worker-us-0-0")  # at once, long before its end: its pod runs; it says nothing
        home.create(small("fragile", steps=200, runPolicy={"backoffLimit": 0}))
        until(lambda: step("fragile") >= 1, 240, "the fragile job training")
        k_home.kill(NS, "fragile-trainer-0")

        home.create(small("pause", steps=40))
        until(lambda: step("pause") >= 2, 240, "the paused job training")
        home.patch(JOBS, NS, "pause", {"spec": {"runPolicy": {"suspend": True}}})
        suspended = until(
            lambda: (
                (j := home.get(JOBS, NS, "pause"))["status"]["phase"] == "Suspended"
                and not [p for p in pods(home, NS) if p.startswith("pause-")]
                and j
            ),
            60,
            "suspended, pods gone",
        )
        at = suspended["status"]["progress"]["step"]
        assert at < 40, "the suspend came after the job's end: nothing left to resume"

        fragile = until(
            lambda: (j := home.get(JOBS, NS, "fragile"))["status"]["phase"] == "Failed" and j,
            120,
            "the fragile job failed",
        )
        assert condition(fragile, "Failed")["reason"] == "BackoffLimitExceeded"
        until(
            lambda: (
                not [
                    p
                    for p in home.list("v1/pods", NS)
                    if p["metadata"]["name"].startswith("fragile-")
                    and p["status"].get("phase") not in ("Succeeded", "Failed")
                ]
            ),
            60,
            "the failed job's pods freed",
        )

        home.patch(JOBS, NS, "pause", {"spec": {"runPolicy": {"suspend": False}}})
        # LeasesHealthy is False only until the replacement's cycle ends (tests/test_operator_decisions.py
        # checks the condition itself); its Events stay
        until(
            lambda: events(home, "StaleWorkers", "hung-worker-us-0-0"), 120, "LeasesHealthy False for the hung worker"
        )
        assert events(home, "StaleWorker", "hung-worker-us-0-0")
        until(lambda: "hung-worker-us-0-1" in pods(home, NS), 30, "the hung worker replaced")

        until(lambda: step("pause") > at, 240, "training again after the resume")
        for name in ("pause", "hung"):
            done = until(
                lambda: (j := home.get(JOBS, NS, name))["status"]["phase"] in ("Succeeded", "Failed") and j,
                600,
                f"{name} finished",
            )
            assert done["status"]["phase"] == "Succeeded", condition(done, "Failed")
        done = home.get(JOBS, NS, "pause")
        assert done["status"]["restarts"] == 0  # a resume is not a failure
        assert condition(done, "Suspended")["status"] == "False"
        assert {"Suspended", "Resumed"} <= set(reasons(home))
        log = k_home.log(NS, "pause-trainer-0")
        assert "resumed at v" in log, log[-2000:]  # from its volume, not from scratch
        assert home.get(JOBS, NS, "hung")["status"]["placements"][0]["replaced"] == 1


REWARD = """\
def score(prompt, completion, answer, **fields):
    return sum(a == b for a, b in zip(completion, answer)) / max(len(answer), len(completion), 1)
"""


def inputs_job(name: str, model: dict, task: dict, template: dict) -> dict:
    """A tiny job with a worker in each of two clusters, its trainer's pod patched by `template`."""
    job = copy.deepcopy(JOB)
    job["metadata"]["name"] = name
    job["spec"] |= {"steps": 3, "model": model, "task": task}
    job["spec"]["trainer"] = {"service": {"type": "LoadBalancer"}, "template": {"spec": template}}
    job["spec"]["placements"] = [
        {"region": "us", "replicas": 1, "relay": False},
        {"region": "eu", "cluster": "east", "replicas": 1, "relay": False},
    ]
    return job


@pytest.mark.timeout(600)
def test_jobs_whose_inputs_come_from_volumes_and_the_hub_and_one_that_cannot_run(tmp_path):
    """examples/k8s/job-volumes.yaml and job-hub.yaml in small: one job's model and chat-format
    data on a claim of the user's and its reward in a ConfigMap, mounted through trainer.template;
    another's model from the (stand-in) hub, private, with the token from a Secret. Both succeed
    across the operator's cluster and a member, and the trained model on the state volume loads
    with transformers. A third names a reward file that is not there: its trainer's check fails
    it with InvalidSpec naming the path, and it is not restarted."""
    import json
    import shutil

    from support.hub import Hub
    from support.models import save_tiny
    from transformers import AutoModelForCausalLM

    model = save_tiny(tmp_path / "model")
    with (
        Hub() as hub,
        clusters("home", "east") as (home, east),
        kubelets(home, east, root=tmp_path),
        operator(home),
    ):
        hub.add("model", "me/tiny", model, private=True)
        add_member(home, east, "east")
        claim = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "inputs", "namespace": NS}}
        home.create(claim | {"spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}})
        filled = (
            tmp_path / "home" / "volumes" / NS / "inputs"
        )  # the emulated claim's disk, filled as a user's pod would
        shutil.copytree(model, filled / "model")
        rows = [
            {"messages": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)}
            for a in range(5)
            for b in range(5)
        ]
        (filled / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        meta = {"name": "reward", "namespace": NS}
        home.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {"reward.py": REWARD}})
        secret = {"name": "hf-token", "namespace": NS}
        home.create({"apiVersion": "v1", "kind": "Secret", "metadata": secret, "stringData": {"token": hub.token}})

        mounts = {
            "containers": [
                {
                    "name": "trainer",
                    "volumeMounts": [
                        {"name": "inputs", "mountPath": "/var/lib/sparrowrl/inputs", "readOnly": True},
                        {"name": "reward", "mountPath": "/var/lib/sparrowrl/reward", "readOnly": True},
                    ],
                }
            ],
            "volumes": [
                {"name": "inputs", "persistentVolumeClaim": {"claimName": "inputs"}},
                {"name": "reward", "configMap": {"name": "reward"}},
            ],
        }
        chat = {"jsonl": "inputs/data.jsonl", "reward": "reward/reward.py:score"}
        home.create(inputs_job("volumes", {"path": "inputs/model"}, chat, mounts))
        token = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}}
        env = [token, {"name": "HF_ENDPOINT", "value": hub.url}, {"name": "HF_HUB_OFFLINE", "value": "0"}]
        env.append({"name": "HF_HOME", "value": "hf-home"})  # in the pod's working folder, not the user's cache
        hub_job = inputs_job(
            "hub", {"hub": {"repo": "me/tiny"}}, {"builtin": "add"}, {"containers": [{"name": "trainer", "env": env}]}
        )
        home.create(hub_job)
        missing = {"jsonl": "inputs/data.jsonl", "reward": "reward/missing.py:score"}
        home.create(inputs_job("broken", {"path": "inputs/model"}, missing, mounts))

        def finished(name: str) -> dict | None:
            j = home.get(JOBS, NS, name) or {}
            return j if (j.get("status") or {}).get("phase") in ("Succeeded", "Failed") else None

        broken = until(lambda: finished("broken"), 240, "the broken job refused")
        failed = condition(broken, "Failed")
        assert failed["reason"] == "InvalidSpec", failed
        assert "no file " in failed["message"] and "/reward/missing.py" in failed["message"], failed  # the path
        assert broken["status"]["restarts"] == 0
        for name in ("volumes", "hub"):
            done = until(lambda: finished(name), 400, f"the {name} job finished")
            assert done["status"]["phase"] == "Succeeded", (condition(done, "Failed"), done["status"])
            assert done["status"]["progress"]["commitsMismatched"] == 0
            assert {p["region"]: p["desired"] for p in done["status"]["placements"]} == {"us": 1, "eu": 1}
        assert any("/me/tiny/resolve/" in path for _, path in hub.requests)  # a private repo: HF_TOKEN reached it
        until(
            lambda: (
                not [
                    p
                    for p in home.list("v1/pods", NS)
                    if p["metadata"]["name"].startswith("broken-")
                    and p["status"].get("phase") not in ("Succeeded", "Failed")
                ]
            ),
            30,
            "the broken job's relays and workers freed",
        )
        trained = tmp_path / "home" / "volumes" / NS / "volumes-state" / "final"
        loaded = AutoModelForCausalLM.from_pretrained(trained, local_files_only=True)
        assert loaded.config.hidden_size == 32


@pytest.mark.timeout(600)
def test_an_environment_job_runs_its_episodes_in_two_clusters(tmp_path):
    """examples/k8s/job-environment.yaml in small: the environment's code in a ConfigMap in each
    cluster, mounted under the working folder of the trainer's pod and of each worker's. The
    trainer's check runs one episode against a stub model before it starts; the workers run the
    episodes (one in a member cluster) and the job succeeds with every commit verified."""
    example = Path(__file__).parent.parent / "examples" / "k8s" / "job-environment.yaml"
    config_map, job_doc = yaml.safe_load_all(example.read_text())
    with clusters("home", "east") as (home, east), kubelets(home, east, root=tmp_path), operator(home):
        add_member(home, east, "east")
        for c in (home, east):
            c.create(config_map | {"metadata": config_map["metadata"] | {"namespace": NS}})
        mount = {"name": "env", "mountPath": "/var/lib/sparrowrl/envs", "readOnly": True}
        volume = {"name": "env", "configMap": {"name": "two-turn-sum"}}
        job = inputs_job(
            "env",
            job_doc["spec"]["model"] | {"tiny": {"hidden": 32, "layers": 1, "heads": 2, "warmupSteps": 60}},
            job_doc["spec"]["task"],
            {"containers": [{"name": "trainer", "volumeMounts": [mount]}], "volumes": [volume]},
        )
        for p in job["spec"]["placements"]:
            p["template"] = {"spec": {"containers": [{"name": "worker", "volumeMounts": [mount]}], "volumes": [volume]}}
        home.create(job)

        def finished() -> dict | None:
            j = home.get(JOBS, NS, "env") or {}
            return j if (j.get("status") or {}).get("phase") in ("Succeeded", "Failed") else None

        done = until(finished, 400, "the environment's job finished")
        assert done["status"]["phase"] == "Succeeded", (condition(done, "Failed"), done["status"])
        assert done["status"]["progress"]["commitsMismatched"] == 0
        assert {p["region"]: p["desired"] for p in done["status"]["placements"]} == {"us": 1, "eu": 1}
