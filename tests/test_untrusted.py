"""A worker whose log-probs are false, end to end: a real trainer and two real workers, one of
them behind a proxy that rewrites every other lease's log-probs to −1e4 (what the trainer's door
takes). Before the trainer checked them, one such lease made the loss infinite and every weight
NaN (issue 45)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
import yaml
from safetensors.torch import load_file
from support import jobs
from support.liar import LyingProxy
from support.servers import EXE, free_port, get
from support.wait import until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

STEPS = 40


@pytest.mark.parametrize("correction", ["truncate", "off"])
def test_a_workers_false_log_probs_are_refused_and_the_run_learns_on(tmp_path, correction):
    job = jobs.job(
        "untrusted",
        steps=STEPS,
        seed=0,
        model=jobs.tiny(hidden=64, warmupSteps=200),
        grpo={
            "learningRate": 1e-4,
            "groupSize": 8,
            "promptsPerStep": 8,
            "maxNewTokens": 4,
            "behaviour": {"correction": correction},
        },
        rollout={"groupsPerLease": 2},
        sync={"staleness": 1},
        topology={
            "regions": [{"name": "a", "workers": 1, "relay": False}, {"name": "b", "workers": 1, "relay": False}]
        },
    )
    for d in ("trainer", "honest", "liar"):
        (tmp_path / d).mkdir()
    (tmp_path / "trainer" / "job.yaml").write_text(yaml.safe_dump(job))
    env = dict(os.environ, SPARROWRL_TOKEN="s3cret")

    def given(*what: str) -> str:
        r = subprocess.run([EXE, "credentials", *what], env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    key = given("key")
    port = free_port()
    trainer = f"http://127.0.0.1:{port}"
    procs: dict[str, subprocess.Popen] = {}

    def start(name: str, args: list, env: dict) -> None:
        procs[name] = subprocess.Popen(
            [EXE, *map(str, args)],
            cwd=tmp_path / name,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )

    with LyingProxy(trainer) as proxy:
        try:
            start("trainer", ["trainer", "job.yaml", "--state-dir", "state", "--port", port], env)
            until(lambda: get(f"{trainer}/readyz") == 200, 240, "the trainer ready", every=0.2, alive=procs)
            for name, worker, url in (("honest", "worker-a-0", trainer), ("liar", "worker-b-0", proxy.url)):
                token = given("worker", worker)
                start(
                    name,
                    ["worker", "--trainer", url, "--name", worker, "--port", free_port()],
                    dict(env, SPARROWRL_TOKEN=token, SPARROWRL_TRAINER_KEY=key),
                )
            summary = tmp_path / "trainer" / "state" / "summary.json"
            until(summary.exists, 480, "the run's summary", every=0.5, alive={"trainer": procs["trainer"]})
            assert procs["trainer"].wait(60) == 0
        finally:
            for p in procs.values():
                p.terminate()
            for p in procs.values():
                p.wait(30)
    log = procs["trainer"].stdout.read()

    s = json.loads(summary.read_text())
    assert s["steps"] == STEPS and s["final_version"] == STEPS and s["prompt_groups_lost"] == 0
    assert s["weights_mismatch"] == 0
    # every sample of every falsified group the trainer admitted was refused, under the liar's name
    assert proxy.falsified >= 3, proxy.falsified
    assert s["samples_refused"] == {"worker-b-0/logprob_gap": 8 * proxy.falsified}, (s, proxy.falsified)
    assert "refused 16 samples of worker worker-b-0" in log or "refused 8 samples of worker worker-b-0" in log
    assert sum(s["steps_skipped"].values()) <= STEPS // 4, s["steps_skipped"]
    rows = [json.loads(x) for x in (tmp_path / "trainer" / "state" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["loss"] is not None and r["skipped"] != "nonfinite" for r in rows)
    honest = [r["by_worker"]["worker-a-0"] for r in rows if "worker-a-0" in r["by_worker"]]
    # the honest worker's gap is staleness's and its engine's: up to 0.10 nats per token here
    # (one version old at this learning rate), against the liar's 20 (its log clamped)
    assert honest and all(h["refused"] == 0 and h["mismatch_mean"] < 0.5 for h in honest)
    # the weights stay finite, and the reward rises: by 0.054 to 0.062 in four runs (2026-12-05)
    final = load_file(tmp_path / "trainer" / "state" / "final" / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in final.values())
    first, last = (sum(r["reward_mean"] for r in part) / len(part) for part in (rows[:10], rows[-10:]))
    assert last > first + 0.02, (first, last)
