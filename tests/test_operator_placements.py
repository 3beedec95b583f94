"""The rollout's decisions (placements.py): member clusters reached or waited for, how their
workers reach the trainer, failed workers and relays replaced after a backoff, and a slot that
keeps failing given up."""

from __future__ import annotations

import pytest
from test_operator_decisions import IMAGE, MEMBERS, World, at, body, condition

from sparrowrl_operator.reconcile import Backoff, Member, Observed, reconcile
from sparrowrl_operator.times import stamp


def test_workers_in_members_wait_for_the_trainers_outside_address():
    w, job = World(lb=None), body()
    w.step(job, 0)
    assert "eu-west" not in w.pods and w.names(None)
    assert "address" in condition(job, "RolloutReady")["message"]
    w.lb = "198.51.100.1"
    w.step(job, 5)
    assert w.names("eu-west") and job["status"]["trainerAddress"] == "https://198.51.100.1:8470"


def test_an_unreachable_member_degrades_the_job_and_the_others_go_on():
    w, job = World(members={**MEMBERS, "ap-south": Member("sparrowrl", False, "connection refused")}), body()
    actions = w.step(job, 0)
    actions.events += w.step(job, 0).events
    assert "ap-south" not in w.pods
    assert w.names("eu-west") and w.names(None)
    d = condition(job, "Degraded")
    assert d["status"] == "True" and "ap-south (connection refused)" in d["message"]
    assert ("Warning", "MemberUnreachable") in [(t, r) for t, r, _ in actions.events]
    w.members["ap-south"] = Member("sparrowrl", True)
    w.step(job, 10)
    assert condition(job, "Degraded")["status"] == "False" and w.names("ap-south")


def test_a_member_not_probed_yet_is_waited_for_not_degraded():
    w, job = World(members={**MEMBERS, "ap-south": Member("", None, "connecting")}), body()
    w.step(job, 0)
    w.step(job, 0)
    assert "ap-south" not in w.pods and w.names("eu-west")
    assert not any(c["type"] == "Degraded" for c in job["status"]["conditions"])
    assert "connecting to ap-south" in condition(job, "RolloutReady")["message"]


def test_a_failed_worker_is_replaced_after_its_backoff():
    w, job = World(), body()
    w.step(job, 0)
    w.step(job, 0)
    w.run_all()
    w.set_phase("add-grpo-u-1-worker-eu-1-0", "Failed", finished=50)
    assert w.step(job, 52).create == []
    assert job["status"]["placements"][1]["failed"] == 1
    actions = w.step(job, 61)
    assert [m["metadata"]["name"] for _, m in actions.create] == ["add-grpo-u-1-worker-eu-1-1"]
    assert any(r == "Replaced" for _, r, _ in actions.events)
    assert "add-grpo-u-1-worker-eu-1-0" not in w.names("eu-west")
    w.run_all()
    w.step(job, 62)
    eu = job["status"]["placements"][1]
    assert (eu["region"], eu["desired"], eu["ready"], eu["failed"], eu["replaced"]) == ("eu", 2, 2, 0, 1)


@pytest.mark.parametrize(
    "service, node, address",
    [
        ({"type": "NodePort"}, "198.51.100.9", "https://198.51.100.9:30123"),
        ({"type": "NodePort"}, None, None),  # no node address yet: members wait
        ({"url": "https://trainer.example.com:443/"}, None, "https://trainer.example.com:443"),
    ],
)
def test_how_members_reach_the_trainer(service, node, address):
    w, job = World(lb=None), body(trainer={"service": service})
    w.step(job, 0)
    obs = w.observe(at(1))
    svc = {"spec": {"type": "NodePort", "ports": [{"port": 8470, "nodePort": 30123}]}}
    actions = reconcile(job, Observed(**{**obs.__dict__, "trainer_service": svc, "node_address": node}), IMAGE)
    remote = [m for c, m in actions.create if c == "eu-west" and m["kind"] == "Pod"]
    if address is None:
        assert remote == [] and actions.status.trainer_address is None
    else:
        assert actions.status.trainer_address == address
        assert remote[0]["spec"]["containers"][0]["args"][1:3] == ["--upstream", address]  # the relay


def crash(w: World, name: str, at_s: float, started_s: float = 0.0) -> None:
    """The pod failed as a container exiting 3 does: its reason, exit code and message."""
    w.set_phase(name, "Failed", finished=at_s, exit_code=3)
    status = w.pods.get(None, {}).get(name) or next(ps[name] for ps in w.pods.values() if name in ps)
    status["status"]["startTime"] = stamp(at(0))  # when it was scheduled: the image pull comes after
    status["status"]["containerStatuses"][0]["state"]["terminated"] |= {
        "reason": "Error",
        "message": "CUDA OOM\n",
        "startedAt": stamp(at(started_s)),
    }


def single(**changes) -> tuple[World, dict]:
    job = body(placements=[{"region": "us", "replicas": 2}], **changes)
    w = World(members={})
    w.step(job, 0)
    w.run_all()
    return w, job


def test_a_worker_failing_in_a_row_backs_off_then_is_given_up():
    w, job = single(runPolicy={"workerBackoffLimit": 2})
    b = Backoff(base=10)
    crash(w, "add-grpo-worker-us-1-0", 50)
    first = w.pods[None]["add-grpo-worker-us-1-0"]["metadata"]["annotations"]["sparrowrl.dev/token-generation"]
    assert w.step(job, 59, backoff=b).create == []  # its first backoff: 10 s
    actions = w.step(job, 60, backoff=b)
    assert [m["metadata"]["name"] for _, m in actions.create] == ["add-grpo-worker-us-1-1"]
    replaced = [m for _, r, m in actions.events if r == "Replaced"]
    assert replaced == [
        "pod add-grpo-worker-us-1-0 failed (Error, exit code 3: CUDA OOM), 1 in a row; replaced it (replacement 1)"
    ]
    notes = w.pods[None]["add-grpo-worker-us-1-1"]["metadata"]["annotations"]
    assert notes["sparrowrl.dev/failures-in-a-row"] == "1"
    assert int(notes["sparrowrl.dev/token-generation"]) > int(first)  # a new token: the old one is revoked
    crash(w, "add-grpo-worker-us-1-1", 100, started_s=60)
    assert w.step(job, 119, backoff=b).create == []  # the second: 20 s
    w.step(job, 120, backoff=b)
    assert w.pods[None]["add-grpo-worker-us-1-2"]["metadata"]["annotations"]["sparrowrl.dev/failures-in-a-row"] == "2"
    assert not any(c["type"] == "Degraded" for c in job["status"]["conditions"])
    crash(w, "add-grpo-worker-us-1-2", 200, started_s=120)
    actions = w.step(job, 10_000, backoff=b)
    assert actions.create == [] and "add-grpo-worker-us-1-2" in w.names()  # kept, for its logs
    degraded = condition(job, "Degraded")
    why = (
        "worker worker-us-1 failed 3 times in a row (runPolicy.workerBackoffLimit: 2); "
        "pod add-grpo-worker-us-1-2: Error, exit code 3: CUDA OOM"
    )
    assert (degraded["status"], degraded["reason"], degraded["message"]) == ("True", "CrashLoop", why)
    assert [(t, r, m) for t, r, m in actions.events if r == "CrashLoop"] == [
        ("Warning", "CrashLoop", why + "; no longer replaced: delete the pod to try again")
    ]
    assert job["status"]["placements"][0]["givenUp"] == ["add-grpo-worker-us-1-2"]
    assert job["status"]["phase"] != "Failed"  # the other worker goes on
    again = w.step(job, 10_010, backoff=b)
    assert again.create == [] and again.events == []  # said once; nothing spins
    del w.pods[None]["add-grpo-worker-us-1-2"]  # deleted by hand: the slot tries again, its row from 0
    actions = w.step(job, 10_020, backoff=b)
    (made,) = [m for _, m in actions.create]
    assert made["metadata"]["name"] == "add-grpo-worker-us-1-0"
    assert "sparrowrl.dev/failures-in-a-row" not in made["metadata"]["annotations"]
    assert condition(job, "Degraded")["status"] == "False" and job["status"]["placements"][0]["givenUp"] == []


def test_a_pod_that_ran_ten_minutes_breaks_the_row():
    w, job = single(runPolicy={"workerBackoffLimit": 1})
    crash(w, "add-grpo-worker-us-0-0", 50)
    w.step(job, 100)
    assert "add-grpo-worker-us-0-1" in w.names()
    crash(w, "add-grpo-worker-us-0-1", 800, started_s=100)  # ran 700 s: a failure, not a crash loop
    actions = w.step(job, 900)
    assert [m["metadata"]["name"] for _, m in actions.create] == ["add-grpo-worker-us-0-2"]
    assert w.pods[None]["add-grpo-worker-us-0-2"]["metadata"]["annotations"]["sparrowrl.dev/failures-in-a-row"] == "1"


def test_a_failed_pod_without_a_finish_time_is_still_replaced():
    """Evicted before its container ran: no containerStatuses. Its backoff counts from its last
    condition's change, and the reason is the pod's own."""
    w, job = single()
    pod = w.pods[None]["add-grpo-worker-us-0-0"]
    pod["status"] = {
        "phase": "Failed",
        "reason": "Evicted",
        "message": "The node was low on resource: memory.",
        "conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": stamp(at(40))}],
    }
    assert w.step(job, 45).create == []
    actions = w.step(job, 50)
    assert [m["metadata"]["name"] for _, m in actions.create] == ["add-grpo-worker-us-0-1"]
    assert "(Evicted: The node was low on resource: memory.)" in next(
        m for _, r, m in actions.events if r == "Replaced"
    )


def test_a_job_whose_workers_are_all_given_up_fails():
    w, job = World(members={}), body(placements=[{"region": "us", "replicas": 1}], runPolicy={"workerBackoffLimit": 0})
    w.step(job, 0)
    w.run_all()
    crash(w, "add-grpo-worker-us-0-0", 50)
    actions = w.step(job, 51)
    failed = condition(job, "Failed")
    assert job["status"]["phase"] == "Failed" and failed["reason"] == "WorkersFailed"
    assert "pod add-grpo-worker-us-0-0: Error, exit code 3: CUDA OOM" in failed["message"]
    assert condition(job, "Degraded")["reason"] == "CrashLoop"
    assert actions.create == [] and sorted(n for _, _, _, n in actions.delete) == [
        "add-grpo-relay-us-0",
        "add-grpo-trainer-0",
    ]
    assert w.step(job, 5000).create == []


def test_a_relay_given_up_degrades_its_placement_and_its_workers_go_on():
    w, job = single(runPolicy={"workerBackoffLimit": 0})
    crash(w, "add-grpo-relay-us-0", 50)
    actions = w.step(job, 100)
    assert actions.create == [] and job["status"]["phase"] != "Failed"
    assert "the relay of us failed 1 times in a row" in condition(job, "Degraded")["message"]
    assert any("workers fetch from the trainer meanwhile" in m for _, r, m in actions.events if r == "CrashLoop")
    assert {"add-grpo-worker-us-0-0", "add-grpo-worker-us-1-0"} <= set(w.names())
