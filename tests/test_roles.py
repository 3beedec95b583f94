"""Which processes a job runs (layout.processes), called directly as the runner and the operator do;
and the role commands, started by hand."""

import json
import os
import subprocess
import urllib.error
import urllib.request

import pytest
import yaml
from support import jobs
from support.bounded import EXE, free_port
from support.servers import get
from support.wait import until

from sparrowrl.spec.job import parse
from sparrowrl.spec.layout import Process, processes

pytestmark = pytest.mark.e2e


def spec(*regions) -> object:
    return parse(jobs.job(topology={"regions": list(regions)})).spec


def url(name: str, region: str) -> str:
    return f"http://{name}.svc" if name != "trainer" or region == "us" else f"http://lb-for-{region}"


def test_a_relay_per_region_with_workers_and_workers_that_prefer_it():
    got = processes(
        spec(
            {"name": "us", "workers": 2, "bandwidthMbit": 100},
            {"name": "eu", "workers": 0},
            {"name": "ap", "workers": 1, "relay": False, "bandwidthMbit": 50},
        ),
        url,
    )
    t, r = "http://trainer.svc", "http://relay-us.svc"
    assert got == [
        Process("trainer", "trainer"),
        Process("relay", "relay-us", "us", t, rate_mbit=100),  # the cap is on the region's WAN link
        Process("worker", "worker-us-0", "us", t, r),  # versions from the relay first; work from the trainer
        Process("worker", "worker-us-1", "us", t, r),
        Process("worker", "worker-ap-0", "ap", "http://lb-for-ap", None, 50),  # no relay: each worker's link is capped
    ]  # ap reaches the trainer by another address (in a cluster: a member cluster's, through a load balancer)


def test_placements_are_the_regions_in_a_cluster():
    j = parse(
        jobs.job(
            trainer={"service": {"type": "LoadBalancer"}},
            placements=[
                {"region": "us", "replicas": 2},
                {"region": "eu", "cluster": "eu-west", "replicas": 1, "relay": False},
            ],
        )
    )
    assert [(r.kind, r.name, r.trainer, r.relay) for r in processes(j.spec, url)] == [
        ("trainer", "trainer", None, None),
        ("relay", "relay-us", "http://trainer.svc", None),
        ("worker", "worker-us-0", "http://trainer.svc", "http://relay-us.svc"),
        ("worker", "worker-us-1", "http://trainer.svc", "http://relay-us.svc"),
        ("worker", "worker-eu-0", "http://lb-for-eu", None),
    ]
    assert j.spec.quorum == 2  # each placement's minReplicas (1) must call in before rollouts start


def test_names_are_unique_dns_labels():
    many = processes(spec(*({"name": f"r{i}", "workers": 64} for i in range(64))), url)
    names = [r.name for r in many]
    assert len(names) == len(set(names)) == 1 + 64 + 64 * 64
    assert all(len(n) <= 63 and n.replace("-", "").isalnum() and n == n.lower() for n in names)


@pytest.mark.timeout(400)
def test_role_commands_started_by_hand_form_a_job(tmp_path):
    """The README's commands, one process each, sharing nothing but the network: a worker gets
    the job, the model's config and tokenizer, and its weights over HTTP."""
    job = jobs.job("by-hand", steps=3, grpo=jobs.GRPO, rollout={"groupsPerLease": 1}, topology=jobs.TWO_REGIONS)
    for d in ("trainer", "relay", "w0", "w1"):
        (tmp_path / d).mkdir()
    (tmp_path / "trainer" / "job.yaml").write_text(yaml.safe_dump(job))
    env = dict(os.environ, SPARROWRL_TOKEN="s3cret")  # the job's secret: the trainer's alone

    def given(*what: str) -> str:  # as the README has them made
        r = subprocess.run([EXE, "credentials", *what], env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    key = given("key")
    envs = {
        "trainer": env,
        **{
            name: dict(env, SPARROWRL_TOKEN=given(*role), SPARROWRL_TRAINER_KEY=key)
            for name, role in (
                ("relay", ("relay", "a")),
                ("w0", ("worker", "worker-a-0")),
                ("w1", ("worker", "worker-b-0")),
            )
        },
    }
    t, r, w0, w1, tm, rm, wm = (free_port() for _ in range(7))  # tm, rm, wm: open /metrics ports
    trainer, relay = f"http://127.0.0.1:{t}", f"http://127.0.0.1:{r}"
    commands = {  # each in a folder of its own, as on separate machines
        "trainer": ["trainer", "job.yaml", "--state-dir", "state", "--port", t, "--metrics-port", tm],
        "relay": ["relay", "--upstream", trainer, "--port", r, "--cache", "cache", "--metrics-port", rm],
        "w0": [
            "worker",
            "--trainer",
            trainer,
            "--relay",
            relay,
            "--name",
            "worker-a-0",
            "--region",
            "a",
            "--port",
            w0,
            "--metrics-port",
            wm,
        ],
        "w1": ["worker", "--trainer", trainer, "--name", "worker-b-0", "--port", w1],
    }
    # the trainer waits for both workers before it hands out work: until w1 calls in, nothing runs
    probes = {
        "trainer": f"{trainer}/readyz",
        "relay": f"{relay}/readyz",  # listed upstream
        "w0": f"http://127.0.0.1:{w0}/readyz",  # committed a verified version
        "w1": f"http://127.0.0.1:{w1}/healthz",
    }  # alive: it may be done before its readiness is seen
    procs = {}
    try:
        for name, args in commands.items():
            if name == "w1":  # before it starts: the job waits for it
                r = subprocess.run(
                    [EXE, "status", trainer, "--json"], env=env, capture_output=True, text=True, timeout=60
                )
                assert r.returncode == 0, r.stderr
                s = json.loads(r.stdout)
                assert s["phase"] == "Pending" and [
                    (w["name"], w["region"], w["committed_version"]) for w in s["workers"]
                ] == [("worker-a-0", "a", 0)]
                r = subprocess.run(
                    [EXE, "status", trainer],
                    env=dict(env, SPARROWRL_TOKEN="wrong"),
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
                assert r.returncode == 1 and "401 unauthorized" in r.stderr
                assert get(f"{trainer}/healthz") == 200 and get(f"{trainer}/v1/status") == 401  # probes need no token
                admin = given(
                    "admin"
                )  # what a scraper of every role's /metrics holds (the trainer takes the secret too)
                m = {
                    url: scrape(url, f"http://127.0.0.1:{o}", admin)
                    for url, o in ((trainer, tm), (relay, rm), (f"http://127.0.0.1:{w0}", wm))
                }
                assert m[trainer]["sparrowrl_versions_published_total"] == 0
                assert (
                    m[trainer]["sparrowrl_store_pruned_versions_total"] == 0
                    and m[trainer]["sparrowrl_store_versions"] == 1
                )
                assert m[trainer]["sparrowrl_store_bytes"] == sum(
                    f.stat().st_size for f in (tmp_path / "trainer" / "state" / "store" / "bases").iterdir()
                )  # v0's base
                assert m[trainer]["sparrowrl_prompt_groups_total", "state", "admitted"] == 0
                assert m[trainer]["sparrowrl_commit_verifications_total", "result", "ok"] == 1  # w0's v0
                assert m[relay]["sparrowrl_received_bytes_total", "kind", "base"] > 0  # v0, once, for w0
                assert (
                    m[relay]["sparrowrl_sent_bytes_total", "kind", "base"]
                    == m[f"http://127.0.0.1:{w0}"]["sparrowrl_received_bytes_total", "kind", "base"]
                    > 0
                )
                assert m[f"http://127.0.0.1:{w0}"]["sparrowrl_commit_verifications_total", "result", "ok"] == 1
                by_stream = {
                    k[3:]: x
                    for k, x in m[f"http://127.0.0.1:{w0}"].items()
                    if k[:3] == ("sparrowrl_received_stream_bytes_total", "kind", "base")
                }
                assert {k[:2] for k in by_stream} == {("server", relay)}  # its relay, not the origin
                assert (
                    sum(by_stream.values())
                    == m[f"http://127.0.0.1:{w0}"]["sparrowrl_received_bytes_total", "kind", "base"]
                )
            procs[name] = subprocess.Popen(
                [EXE, *map(str, args)],
                cwd=tmp_path / name,
                env=envs[name],
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            until(lambda: get(probes[name]) == 200, 240, f"{probes[name]} answering", every=0.2, alive=procs)
        summary = tmp_path / "trainer" / "state" / "summary.json"
        until(summary.exists, 300, "the run's summary", every=0.5, alive={"trainer": procs["trainer"]})
        s = json.loads(summary.read_text())
        assert s["steps"] == 3 and s["weights_mismatch"] == 0 and s["weights_verified"] == 2 * 4  # v0..v3, 2 workers
        assert s["prompt_groups_lost"] == 0 and s["prompt_groups_discarded_late"] == 0 and s["trainer_restarts"] == 0
        assert sorted(p.name for p in (tmp_path / "w0").iterdir()) == []  # a worker writes nothing to disk
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            p.wait(30)


def scrape(url: str, open_url: str, token: str) -> dict:
    """/metrics (401 without a token), parsed by prometheus-client's own parser: name (and
    label, value) → sample value. `open_url` (--metrics-port) serves the same
    without the token, and nothing else."""
    from prometheus_client.parser import text_string_to_metric_families

    assert get(f"{url}/metrics") == 401
    assert get(f"{open_url}/v1/versions") == get(f"{open_url}/healthz") == 404
    out = []
    for req in (
        urllib.request.Request(f"{url}/metrics", headers={"Authorization": f"Bearer {token}"}),
        urllib.request.Request(f"{open_url}/metrics"),
    ):
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.headers["Content-Type"].startswith("text/plain; version=")
            text = r.read().decode()
        out.append(
            {
                (s.name, *(x for kv in s.labels.items() for x in kv)) if s.labels else s.name: s.value
                for family in text_string_to_metric_families(text)
                for s in family.samples
            }
        )
    assert out[0].keys() == out[1].keys()
    return out[0]


@pytest.mark.timeout(300)
def test_the_trainer_answers_its_liveness_probe_while_it_loads(tmp_path):
    """A large model takes minutes to load and write v0: meanwhile the trainer's port says it
    lives (a kubelet's liveness probe), not that it is ready, and asks callers to come back."""
    # the supervised warm-up stands in for a long load: it runs before v0 is written
    job = jobs.job("slow", model=jobs.tiny(warmupSteps=100_000))
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = dict(os.environ, SPARROWRL_TOKEN="s3cret")
    args = [EXE, "trainer", "job.yaml", "--state-dir", "state", "--port", str(port)]
    p = subprocess.Popen(args, cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        until(
            lambda: get(f"{base}/healthz") == 200, 120, "the trainer's liveness probe", every=0.2, alive={"trainer": p}
        )
        assert get(f"{base}/readyz") == 503
        try:
            urllib.request.urlopen(f"{base}/v1/work", timeout=5)
        except urllib.error.HTTPError as e:
            assert e.code == 503 and e.headers["Retry-After"], e.headers  # workers wait on it
            assert "starting" in e.read().decode()
        else:
            raise AssertionError("/v1/work answered while the trainer was loading")
        assert not (tmp_path / "state" / "store" / "store.json").exists(), "v0 was written already"
    finally:
        p.terminate()
        p.wait(30)
