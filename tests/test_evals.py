"""Held-out evaluation (task.eval): the rounds' bookkeeping, pass@k, and a run that evaluates
as it trains, on workers, without training on what it evaluates."""

from __future__ import annotations

import json

import pytest
from support import jobs
from test_run_tasks import job, results, run

from sparrowrl.rollout.evals import FIRST_LEASE, Evals, pass_at


@pytest.mark.unit
def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at(4, 1, 1) == 0.25 and pass_at(4, 0, 4) == 0.0 and pass_at(4, 1, 4) == 1.0
    assert pass_at(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 − C(3, 2) / C(5, 2)


@pytest.mark.unit
def test_rounds_open_on_time_and_go_to_workers_at_their_version():
    now = [0.0]
    e = Evals(prompts=5, every=3, steps=10, per_lease=2, lease_seconds=10, clock=lambda: now[0])
    for v in (1, 2):
        e.open(v)
    assert not e.rounds  # due at 0, 3, 6, 9 and the last
    e.open(0)
    assert e.work("w", 1) is None  # a worker at another version trains
    a = e.work("w", 0)
    assert a["id"] >= FIRST_LEASE and e.is_lease(a["id"]) and a["prompts"] == [0, 1] and a["version"] == 0
    b = e.work("x", 0)
    assert b["prompts"] == [2, 3]
    sample = {"samples": [{"tokens": [3], "logprobs": [-1.0]}]}
    assert e.submit(a["id"], "x", 0, {0: sample, 1: sample})["admitted"] == 0  # not x's lease
    assert "v0" in e.submit(a["id"], "w", 1, {0: sample, 1: sample})["refused"]  # another version: dropped
    a = e.work("w", 0)
    assert a["prompts"] == [0, 1]  # back in the queue
    assert e.submit(a["id"], "w", 0, {0: sample, 1: sample}) == {"admitted": 2}
    now[0] = 11.0  # x's lease expires: its prompts go back
    c = e.work("y", 0)
    assert c["prompts"] == [2, 3] and e.waiting(0) and e.ready() == []
    assert e.submit(c["id"], "y", 0, {2: sample, 3: sample}) == {"admitted": 2}
    d = e.work("y", 0)
    assert d["prompts"] == [4] and e.submit(d["id"], "y", 0, {4: sample}) == {"admitted": 1}
    (r,) = e.ready()
    assert r.version == 0 and sorted(r.results) == [0, 1, 2, 3, 4] and r.results[4]["worker"] == "y"
    assert not e.waiting(0) and e.ready() == []
    # a round every worker left behind closes when the next opens, scored on what it has
    e.open(3)
    f = e.work("w", 3)
    e.submit(f["id"], "w", 3, {0: sample, 1: sample})
    e.open(6)
    (partial,) = e.ready()
    assert partial.version == 3 and partial.closed and sorted(partial.results) == [0, 1]
    assert e.work("w", 3) is None and e.work("w", 6)["prompts"] == [0, 1]
    e.close()
    assert [x.version for x in e.ready()] == []  # closed with nothing: nothing to score


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_a_run_evaluates_held_out_prompts_on_its_workers_without_training_on_them(tmp_path):
    spec = job(
        steps=4,
        model=jobs.tiny(warmupSteps=60),
        task={"builtin": "add", "eval": {"every": 2, "prompts": 6, "samples": 3, "decoding": "sampled"}},
    )
    r = run(tmp_path, spec)
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "run"
    s, rows = results(out)
    evals = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
    assert [e["version"] for e in evals] == [0, 2, 4]
    for e in evals:
        assert e["prompts"] == 6 and e["samples"] == 3 and e["decoding"] == "sampled"
        assert 0 <= e["pass_at_1"] <= e["pass_at_k"] <= 1
    assert s["eval_last"] == evals[-1] and s["eval_first"] == evals[0]
    assert s["prompt_groups_admitted"] == 4 * 4  # the eval's prompts are not training groups
    log = (out / "logs" / "trainer.log").read_text()
    assert "trainer: eval v4: pass@1 " in log and "(6 prompts x 3, sampled)" in log
    assert (out / "eval.png").stat().st_size > 0 and (out / "objective.png").stat().st_size > 0
