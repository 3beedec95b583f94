"""What a pod says of itself (pods.py), as a kubelet writes it: why it failed, when, its slot's
failures in a row, a refusal by the trainer's check; and the pods indexed by slot."""

from __future__ import annotations

import pytest

from sparrowrl_operator.pods import Pods, failed_at, in_a_row, refused, termination


def pod(name="p", role="worker", labels=None, annotations=None, **status) -> dict:
    meta = {"name": name, "labels": {"sparrowrl.dev/role": role, **(labels or {})}}
    if annotations is not None:
        meta["annotations"] = annotations
    return {"metadata": meta, "status": status}


def ran(start: str, end: str, **terminated) -> dict:
    """The worker's container, terminated after running from `start` to `end`."""
    return {"name": "worker", "state": {"terminated": {"startedAt": start, "finishedAt": end, **terminated}}}


@pytest.mark.parametrize(
    "status, why",
    [
        (
            {"containerStatuses": [ran("", "", reason="Error", exitCode=3, message="CUDA OOM\n")]},
            "Error, exit code 3: CUDA OOM",
        ),
        ({"containerStatuses": [ran("", "", exitCode=137)]}, "exit code 137"),
        (  # the role's container first, whatever the order
            {
                "containerStatuses": [
                    {"name": "proxy", "state": {"terminated": {"reason": "Completed", "exitCode": 0}}},
                    ran("", "", reason="OOMKilled", exitCode=137),
                ]
            },
            "OOMKilled, exit code 137",
        ),
        (
            {
                "containerStatuses": [
                    {"name": "worker", "lastState": {"terminated": {"reason": "Error", "exitCode": 1}}}
                ]
            },
            "Error, exit code 1",
        ),
        (
            {"reason": "Evicted", "message": "The node was low on resource: memory."},
            "Evicted: The node was low on resource: memory.",
        ),
        ({}, "no reason given"),
    ],
)
def test_why_a_pod_failed(status, why):
    assert termination(pod(**status)) == why


@pytest.mark.parametrize(
    "status, created, when",
    [
        ({"containerStatuses": [ran("2026-12-01T12:00:00Z", "2026-12-01T12:01:00Z")]}, None, "2026-12-01T12:01:00Z"),
        (  # evicted before its container ran: its newest condition's change
            {
                "conditions": [
                    {"type": "Ready", "lastTransitionTime": "2026-12-01T12:00:40Z"},
                    {"type": "Initialized", "lastTransitionTime": "2026-12-01T12:00:10Z"},
                ],
                "startTime": "2026-12-01T12:00:00Z",
            },
            None,
            "2026-12-01T12:00:40Z",
        ),
        ({"startTime": "2026-12-01T12:00:05Z"}, "2026-12-01T12:00:00Z", "2026-12-01T12:00:05Z"),
        ({}, "2026-12-01T12:00:00Z", "2026-12-01T12:00:00Z"),
    ],
)
def test_when_a_pod_failed(status, created, when):
    p = pod(**status)
    if created:
        p["metadata"]["creationTimestamp"] = created
    assert failed_at(p) == when


@pytest.mark.parametrize(
    "before, ran_until, row",
    [
        (None, "2026-12-01T12:01:00Z", 1),
        ({"sparrowrl.dev/failures-in-a-row": "2"}, "2026-12-01T12:01:00Z", 3),
        ({"sparrowrl.dev/failures-in-a-row": "x"}, "2026-12-01T12:01:00Z", 1),
        ({"sparrowrl.dev/failures-in-a-row": "4"}, "2026-12-01T12:09:59Z", 5),
        ({"sparrowrl.dev/failures-in-a-row": "4"}, "2026-12-01T12:10:00Z", 1),  # ran 600 s: a new row
    ],
)
def test_failures_in_a_row(before, ran_until, row):
    assert in_a_row(pod(annotations=before, containerStatuses=[ran("2026-12-01T12:00:00Z", ran_until)])) == row


@pytest.mark.parametrize(
    "name, exit_code, message, why",
    [
        ("sparrowrl-check", 3, "loading\nerror: spec.task: no file\n\n", "spec.task: no file"),
        ("sparrowrl-check", 3, "", "no reason given"),
        ("sparrowrl-check", 137, "error: killed", None),  # not a refusal: a failure, restarted
        ("fetch", 3, "error: spec.task: no file", None),
    ],
)
def test_a_refusal_by_the_trainers_check(name, exit_code, message, why):
    p = pod("t-0", role="trainer")
    p["status"]["initContainerStatuses"] = [
        {"name": name, "state": {"terminated": {"exitCode": exit_code, "message": message}}}
    ]
    assert refused(p) == (why and f"the trainer's check in pod t-0: {why}")


def test_pods_are_indexed_by_slot_the_newest_attempt_current():
    def attempt(n: int, slot: str = "0", going: bool = False) -> dict:
        labels = {"sparrowrl.dev/region": "us", "sparrowrl.dev/slot": slot, "sparrowrl.dev/attempt": str(n)}
        p = pod(f"w-{slot}-{n}", labels=labels)
        if going:
            p["metadata"]["deletionTimestamp"] = "2026-12-01T12:00:00Z"
        return p

    pods = Pods({None: [attempt(2), attempt(0, going=True), attempt(1)], "eu": [attempt(0, slot="1")]})
    current, older = pods.current(None, ("worker", "us", "0"))
    assert current["metadata"]["name"] == "w-0-2" and [p["metadata"]["name"] for p in older] == ["w-0-0", "w-0-1"]
    assert pods.current(None, ("worker", "us", "1")) == (None, [])
    assert pods.current("eu", ("worker", "us", "1"))[0]["metadata"]["name"] == "w-1-0"
    assert pods.alive == {"w-0-2", "w-0-1", "w-1-0"} and pods.trainer() is None
