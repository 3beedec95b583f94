"""The trainer's word on its workers (health.py): stale workers, weights out of sync, false
samples and skipped steps, as conditions with one Event as each changes."""

from __future__ import annotations

import pytest
import yaml
from test_operator_decisions import ROOT, World, at, body, condition, trainer_status

from sparrowrl.spec.status import TrainerStatus
from sparrowrl_operator.reconcile import Actions
from sparrowrl_operator.times import stamp


def test_a_stale_worker_is_reported_and_replaced():
    w, job = World(), body()
    w.step(job, 0)
    w.step(job, 0)
    w.run_all()
    w.trainer = trainer_status([("add-grpo-worker-us-0-0", 2.0, "ok"), ("add-grpo-u-1-worker-eu-0-0", 400.0, "ok")])
    actions = w.step(job, 310)
    lh = condition(job, "LeasesHealthy")
    assert lh["status"] == "False" and lh["reason"] == "StaleWorkers" and "add-grpo-u-1-worker-eu-0-0" in lh["message"]
    assert ("Warning", "StaleWorker") in [(t, r) for t, r, _ in actions.events]
    assert "add-grpo-u-1-worker-eu-0-1" in w.names("eu-west") and "add-grpo-u-1-worker-eu-0-0" not in w.names("eu-west")
    assert job["status"]["leases"] | {"oldestHeartbeatSeconds": 0} == {
        "active": 3,
        "healthy": 2,
        "expired": 0,
        "requeued": 0,
        "staleWorkers": ["add-grpo-u-1-worker-eu-0-0"],
        "oldestHeartbeatSeconds": 0,
    }
    w.run_all()
    w.step(job, 320)  # the trainer still lists the old name; its pod is gone, so it no longer counts
    assert condition(job, "LeasesHealthy")["status"] == "True"


def test_a_stale_worker_gets_one_event_and_many_get_one_between_them():
    """Not an Event per stale worker per cycle (4,000 stale workers made 4,000 every cycle):
    one as each goes stale while the status can name them all, then one when their count changes."""
    stale = lambda actions: [m for _, r, m in actions.events if r == "StaleWorker"]  # noqa: E731
    places = [{"region": "us", "replicas": 40}, {"region": "eu", "cluster": "eu-west", "replicas": 40}]
    w, job = World(), body(placements=places, health={"staleAfterSeconds": 60, "onStale": "Ignore"})
    w.step(job, 0)
    w.step(job, 0)
    w.run_all()
    workers = [n for c in (None, "eu-west") for n in w.names(c) if "-worker-" in n]
    assert len(workers) == 80
    w.trainer = trainer_status([(n, 61.0, "ok") for n in workers[:2]])
    assert len(stale(w.step(job, 70))) == 2
    assert stale(w.step(job, 80)) == []  # still the same two
    w.trainer = trainer_status([(n, 61.0, "ok") for n in workers[:3]])
    assert [m.split()[1] for m in stale(w.step(job, 90))] == [workers[2]]
    w.trainer = trainer_status([(n, 61.0, "ok") for n in workers[:64]])  # as many as the status names
    assert len(stale(w.step(job, 95))) == 61
    w.trainer = trainer_status([(n, 61.0, "ok") for n in workers[1:65]])  # one back, one more gone
    assert [m.split()[1] for m in stale(w.step(job, 97))] == [workers[64]]
    w.trainer = trainer_status([(n, 61.0, "ok") for n in workers])  # more than the status lists
    (many,) = stale(w.step(job, 100))
    assert many.startswith("80 workers not heard from")
    assert stale(w.step(job, 110)) == []
    assert job["status"]["progress"]["workerCounts"]["stale"] == 80


def test_no_worker_is_stale_while_the_trainer_has_just_started():
    """After a trainer restart every worker looks silent: they were backing off while it was down."""
    w, job = World(), body()
    w.step(job, 0)
    w.step(job, 0)
    w.run_all()
    w.set_phase("add-grpo-trainer-0", "Running")
    w.pods[None]["add-grpo-trainer-0"]["status"]["startTime"] = stamp(at(1000))
    w.trainer = trainer_status([("add-grpo-worker-us-0-0", 400.0, "ok")])
    w.step(job, 1200)  # up 200 s, under staleAfterSeconds (300)
    assert condition(job, "LeasesHealthy")["status"] == "True" and "add-grpo-worker-us-0-0" in w.names()
    w.step(job, 1301)
    assert condition(job, "LeasesHealthy")["status"] == "False" and "add-grpo-worker-us-0-1" in w.names()


@pytest.mark.parametrize("on_stale, phase", [("Ignore", "Running"), ("FailJob", "Failed")])
def test_on_stale(on_stale, phase):
    w, job = World(), body(health={"staleAfterSeconds": 60, "onStale": on_stale})
    w.step(job, 0)
    w.step(job, 0)
    w.run_all()
    w.trainer = trainer_status([("add-grpo-worker-us-0-0", 61.0, "ok")])
    w.step(job, 70)
    assert job["status"]["phase"] == phase
    assert ("add-grpo-worker-us-0-0" in w.names()) == (on_stale == "Ignore")
    if on_stale == "FailJob":
        assert condition(job, "Failed")["reason"] == "StaleWorkers"


def test_weights_in_sync_and_a_hash_mismatch():
    w, job = World(), body()
    w.step(job, 0)
    w.step(job, 0)
    w.run_all()
    w.trainer = trainer_status([("add-grpo-worker-us-0-0", 1.0, "ok"), ("add-grpo-worker-us-1-0", 1.0, "ok")])
    w.step(job, 5)
    assert condition(job, "WeightsInSync")["status"] == "True"
    assert job["status"]["phase"] == "Running"
    assert job["status"]["display"] == {
        "step": "5/300",
        "rollout": "5/5",
        "leases": "3/3",
        "clusters": "3/3",
        "payload": "12.3 kB (1.20%)",
    }
    w.trainer = trainer_status([("add-grpo-worker-us-0-0", 1.0, "ok"), ("add-grpo-worker-us-1-0", 1.0, "mismatch")])
    actions = w.step(job, 6)
    ws = condition(job, "WeightsInSync")
    assert (ws["status"], ws["reason"]) == ("False", "HashMismatch") and "add-grpo-worker-us-1-0" in ws["message"]
    assert any(r == "HashMismatch" for _, r, _ in actions.events)


def refused_status(refused: dict[str, int], names: list[str], **job) -> TrainerStatus:
    """The trainer's status with each of `names` reporting, `refused` its samples refused per worker."""
    t = trainer_status([(n, 1.0, "ok") for n in names])
    workers = [w.model_copy(update={"refused_samples": refused.get(w.name, 0)}) for w in t.workers]
    return t.model_copy(update={"workers": workers, "samples_refused": sum(refused.values()), **job})


def dropped_by_crd(status: dict) -> list[str]:
    """The fields of a written status that the CRD's schema lacks: a real API server drops them."""
    crd = yaml.safe_load((ROOT / "crds" / "sparrowrl.dev_sparrowrljobs.yaml").read_text())
    out: list[str] = []

    def walk(schema: dict, obj, at: str) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                if k not in schema.get("properties", {}):
                    out.append(f"{at}.{k}")
                else:
                    walk(schema["properties"][k], v, f"{at}.{k}")
        elif isinstance(obj, list):
            for x in obj:
                walk(schema["items"], x, f"{at}[]")

    walk(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"], status, "status")
    return out


def refused_events(actions: Actions) -> list[tuple[str, str]]:
    return [(t, m) for t, r, m in actions.events if r == "SamplesRefused"]


def test_a_worker_sending_false_samples_is_named_in_a_condition_an_event_and_the_listing():
    """The trainer refuses samples whose log-probs are false; the worker that sent them shows in
    WorkersTrusted, in one Warning as its count grows (not every cycle), and first in the listing
    after hash mismatches. The run goes on: the phase is not the condition's."""
    w, job = World(), body()
    w.step(job, 0)
    w.step(job, 0)
    w.run_all()
    liar, other = "add-grpo-worker-us-1-0", "add-grpo-worker-us-0-0"
    w.trainer = refused_status({}, [other, liar])
    actions = w.step(job, 5)
    wt = condition(job, "WorkersTrusted")
    assert (wt["status"], wt["reason"]) == ("True", "AllSamplesTrusted") and refused_events(actions) == []
    assert job["status"]["progress"]["workerCounts"]["untrusted"] == 0

    w.trainer = refused_status({liar: 3}, [other, liar])
    actions = w.step(job, 15)
    wt = condition(job, "WorkersTrusted")
    assert (wt["status"], wt["reason"]) == ("False", "FalseSamples") and f"{liar} (3)" in wt["message"]
    assert other not in wt["message"]
    ((kind, message),) = refused_events(actions)
    assert kind == "Warning" and message.startswith(f"worker {liar} has had 3 samples refused")
    assert "kubectl logs add-grpo-trainer-0" in message
    assert ("Warning", "FalseSamples") in [(t, r) for t, r, _ in actions.events]  # the condition going False
    progress = job["status"]["progress"]
    assert progress["workers"][0] == {
        "name": liar,
        "committedVersion": 5,
        "verification": "ok",
        "behind": 0,
        "refusedSamples": 3,
    }
    assert all("refusedSamples" not in x for x in progress["workers"][1:])
    assert progress["workerCounts"]["untrusted"] == 1 and progress["samplesRefused"] == 3
    assert job["status"]["phase"] == "Running"  # not a failure of the job
    assert dropped_by_crd(job["status"]) == []

    actions = w.step(job, 25)  # the same count: no Event again, the condition holds
    assert refused_events(actions) == [] and "FalseSamples" not in [r for _, r, _ in actions.events]
    assert condition(job, "WorkersTrusted")["reason"] == "FalseSamples"

    w.trainer = refused_status({liar: 5}, [other, liar])
    ((_, message),) = refused_events(w.step(job, 35))
    assert message.startswith(f"worker {liar} has had 5 samples refused (2 since the last count)")

    w.pods[None][liar]["metadata"]["deletionTimestamp"] = stamp(at(40))  # its pod going: the trainer still lists it
    actions = w.step(job, 45)
    assert condition(job, "WorkersTrusted")["status"] == "True" and refused_events(actions) == []
    assert job["status"]["progress"]["workerCounts"]["untrusted"] == 0


def test_false_samples_get_an_event_per_worker_and_many_workers_one_between_them():
    """As the stale workers: one Event per worker while the status lists them all, then one
    Event when the job's refused samples grow, however many workers send them."""
    places = [{"region": "us", "replicas": 40}, {"region": "eu", "cluster": "eu-west", "replicas": 40}]
    w, job = World(), body(placements=places)
    w.step(job, 0)
    w.step(job, 0)
    w.run_all()
    workers = [n for c in (None, "eu-west") for n in w.names(c) if "-worker-" in n]
    assert len(workers) == 80
    w.trainer = refused_status({n: 1 for n in workers[:3]}, workers)
    assert sorted(m.split()[1] for _, m in refused_events(w.step(job, 10))) == sorted(workers[:3])
    w.trainer = refused_status({n: 1 for n in workers}, workers)  # more than the status lists
    (many,) = refused_events(w.step(job, 20))
    assert many[1].startswith("80 workers had samples refused") and "77 more since the last count" in many[1]
    assert refused_events(w.step(job, 30)) == []
    w.trainer = refused_status({n: 1 + (n == workers[5]) for n in workers}, workers)
    (more,) = refused_events(w.step(job, 40))
    assert more[1].startswith("80 workers had samples refused, the most: " + workers[5] + " (2)")
    assert job["status"]["progress"]["workerCounts"]["untrusted"] == 80
    assert "and 72 more" in condition(job, "WorkersTrusted")["message"]


def test_skipped_steps_reach_the_status_with_an_event_as_they_grow():
    w, job = World(), body()
    w.step(job, 0)
    w.step(job, 0)
    w.run_all()
    names = ["add-grpo-worker-us-0-0"]
    skipped = lambda actions: [(t, m) for t, r, m in actions.events if r == "StepsSkipped"]  # noqa: E731
    w.trainer = refused_status({}, names)
    assert skipped(w.step(job, 5)) == [] and job["status"]["progress"]["stepsSkipped"] == 0
    w.trainer = refused_status({}, names, steps_skipped=2)
    ((kind, message),) = skipped(w.step(job, 15))
    assert kind == "Normal" and message.startswith("2 more steps changed no weight (2 of 5 so far)")
    assert job["status"]["progress"]["stepsSkipped"] == 2
    assert skipped(w.step(job, 25)) == []
    w.trainer = refused_status({}, names, steps_skipped=3)
    ((_, message),) = skipped(w.step(job, 35))
    assert message.startswith("1 more step changed no weight (3 of 5 so far)")
    assert job["status"]["phase"] == "Running"
