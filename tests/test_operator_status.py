"""The status's figures (status.py): the worst workers listed and every one counted, cost and
tokens per dollar in their column, and the phase derived from the conditions alone."""

from __future__ import annotations

import json

import pytest
import yaml
from test_operator_decisions import ROOT, World, body, condition, trainer_status

from sparrowrl.spec.status import WorkerStatus
from sparrowrl_operator.conditions import set_condition
from sparrowrl_operator.status import derive_phase, human_count


def test_a_status_of_hundreds_of_workers_counts_them_all_and_lists_the_worst_64():
    """The trainer lists every worker; the custom resource gets counts of them all and the worst
    64, however many there are: mismatches, then those with most refused samples, then stale ones,
    then the furthest behind, then those refusing answers (not the first 64 by name), in a status
    far under a CR's size limit."""
    w = World(members={})
    job = body(placements=[{"region": f"r{i}", "replicas": 64} for i in range(8)], health={"onStale": "Ignore"})
    w.step(job, 0)
    w.step(job, 0)
    w.run_all()
    names = [n for n in w.names() if "-worker-" in n]
    assert len(names) == 512
    last = names[-64:]  # the worst all sort last by name
    mismatched, stale, behind, refusing = last[-3:], last[-9:-3], last[-20:-9], last[-24:-20]
    untrusted = {last[-26]: 2, last[-25]: 9}  # refused samples: the more, the worse
    workers = [
        WorkerStatus(
            name=n,
            committed_version=2 if n in behind else 5,
            staleness=3 if n in behind else 0,
            last_verification="mismatch" if n in mismatched else "ok",
            seconds_since_seen=400.0 if n in stale else 1.0,
            refused_answers=7 if n in refusing else 0,
            refused_samples=untrusted.get(n, 0),
        )
        for n in names + ["add-grpo-worker-gone-0-0"]  # a pod gone, that the trainer still lists
    ]
    w.trainer = trainer_status([]).model_copy(update={"workers": workers})
    w.step(job, 310)  # the trainer has been up past staleAfterSeconds (300)
    progress = job["status"]["progress"]
    listed = [x["name"] for x in progress["workers"]]
    assert len(listed) == 64
    assert listed[:3] == sorted(mismatched) and listed[3:5] == [last[-25], last[-26]]
    assert set(listed[5:11]) == set(stale) and set(listed[11:22]) == set(behind)
    assert listed[22:26] == sorted(refusing) and listed[26] == names[0]  # then the rest, by name
    assert progress["workers"][3] == {
        "name": last[-25],
        "committedVersion": 5,
        "verification": "ok",
        "behind": 0,
        "refusedSamples": 9,
    }
    assert progress["workers"][0] == {
        "name": mismatched[0],
        "committedVersion": 5,
        "verification": "mismatch",
        "behind": 0,
    }
    assert progress["workerCounts"] == {
        "total": 513,
        "live": 512,
        "stale": 6,
        "mismatched": 3,
        "behind": 11,
        "refusing": 4,
        "untrusted": 2,
        "byStaleness": {"current": 501, "one": 0, "two": 0, "threeOrMore": 11, "unknown": 0},
    }
    assert job["status"]["leases"]["staleWorkers"] == sorted(stale)
    assert condition(job, "WeightsInSync")["reason"] == "HashMismatch"
    w.trainer = trainer_status([]).model_copy(
        update={
            "workers": [
                x.model_copy(update={"last_verification": "ok", "staleness": 0, "seconds_since_seen": 1.0})
                for x in workers
            ]
        }
    )
    w.step(job, 320)
    assert "512 workers within" in condition(job, "WeightsInSync")["message"]  # all of them, not the 64 listed
    assert len(json.dumps(job["status"]).encode()) < 64 << 10


def test_a_priced_jobs_cost_and_tokens_per_dollar_reach_the_status_and_its_column():
    """`kubectl get` shows tokens per dollar as a string: a number column would print 1.44e+07."""
    from support.operator_run import columns

    crd = yaml.safe_load((ROOT / "crds" / "sparrowrl.dev_sparrowrljobs.yaml").read_text())
    w, job = World(), body()
    w.step(job, 0)
    w.step(job, 0)
    w.run_all()
    w.trainer = trainer_status([("add-grpo-worker-us-0-0", 1.0, "ok")])
    w.step(job, 5)
    assert "tokensPerDollar" not in job["status"]["display"] and columns(crd, job)["Tokens/$"] == "<none>"
    w.trainer = w.trainer.model_copy(update={"cost_dollars": 1.234567, "tokens_per_dollar": 14_412_345.67})
    w.step(job, 6)
    p = job["status"]["progress"]
    assert p["costDollars"] == 1.2346 and p["tokensPerDollar"] == 14_412_345.7
    assert job["status"]["display"]["tokensPerDollar"] == "14.4M" and columns(crd, job)["Tokens/$"] == "14.4M"


@pytest.mark.parametrize(
    ("conditions", "serving", "want"),
    [
        ([], False, "Pending"),
        ([("TrainerReady", False, "Creating")], False, "Pending"),
        ([("TrainerReady", True, "Ready")], False, "Starting"),
        ([("TrainerReady", True, "Ready")], True, "Running"),
        ([("TrainerReady", False, "Restarting")], True, "Restarting"),
        ([("TrainerReady", False, "Suspended"), ("Suspended", True, "Suspended")], False, "Suspended"),
        ([("Suspended", False, "Resumed"), ("TrainerReady", True, "Ready")], True, "Running"),
        ([("Succeeded", True, "Succeeded"), ("TrainerReady", False, "Finished")], False, "Succeeded"),
        ([("Succeeded", False, "StepsRaised"), ("TrainerReady", False, "Restarting")], False, "Restarting"),
        ([("Failed", True, "BackoffLimitExceeded"), ("Suspended", True, "Suspended")], False, "Failed"),
    ],
)
def test_the_phase_is_derived_from_the_conditions_alone(conditions, serving, want):
    conds = []
    for type_, status, reason in conditions:
        conds = set_condition(conds, type_, status, reason, "", "2026-12-02T00:00:00Z")
    assert derive_phase(conds, serving) == want


@pytest.mark.parametrize(
    "x, shown", [(999, "999"), (14_400_000, "14.4M"), (2.5e12, "2.5T"), (1e300, "1e+300"), (float("inf"), "inf")]
)
def test_the_tokens_per_dollar_column_is_short_at_any_size(x, shown):
    assert human_count(x) == shown and len(human_count(x)) <= 64  # the CRD's bound on the field
