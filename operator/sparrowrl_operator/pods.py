"""What a pod says of itself, as the kubelet wrote it, and the observed pods indexed by slot:
one pod per role, region and slot, the newest attempt the current one."""

from __future__ import annotations

import datetime
import functools
from collections.abc import Iterator

from sparrowrl.spec.layout import INVALID_EXIT
from sparrowrl_operator import builders
from sparrowrl_operator.constants import (
    ATTEMPT_LABEL,
    FAILURES_ANNOTATION,
    NODE_LABEL,
    REGION_LABEL,
    ROLE_LABEL,
    SLOT_LABEL,
)
from sparrowrl_operator.times import since

Cluster = str | None  # a SparrowCluster's name; None: the operator's own
Slot = tuple[str, str | None, str | None]  # role, region, slot
RESET_AFTER = 600.0  # seconds a pod must run for its failure not to continue its slot's row (as the kubelet's)


def phase_of(pod: dict) -> str:
    return (pod.get("status") or {}).get("phase") or "Pending"


def ready(pod: dict) -> bool:
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


def other_node(pod: dict) -> bool:
    """A trainer's node other than 0: it runs ranks only, and serves nothing (no API, no TLS)."""
    return (pod["metadata"].get("labels") or {}).get(NODE_LABEL, "0") != "0"


def terminating(pod: dict) -> bool:
    return bool(pod["metadata"].get("deletionTimestamp"))


def attempt(pod: dict) -> int:
    try:
        return int(pod["metadata"]["labels"][ATTEMPT_LABEL])
    except (KeyError, ValueError):
        return 0


def slot_key(pod: dict) -> Slot:
    lb = pod["metadata"].get("labels", {})
    return lb.get(ROLE_LABEL, ""), lb.get(REGION_LABEL), lb.get(SLOT_LABEL)


def started_at(pod: dict) -> str | None:
    return (pod.get("status") or {}).get("startTime")


def ended(pod: dict) -> dict:
    """The terminated state of the pod's own container (named as its role), else {}."""
    role = pod["metadata"].get("labels", {}).get(ROLE_LABEL)
    for s in (pod.get("status") or {}).get("containerStatuses") or []:
        if s.get("name") == role:
            return (s.get("state") or {}).get("terminated") or {}
    return {}


def finished_at(pod: dict) -> str | None:
    return ended(pod).get("finishedAt")


def failed_at(pod: dict) -> str | None:
    """When a failed pod ended: its container's finish, else (a pod that failed without one, e.g.
    evicted) its newest condition's change, else its creation."""
    conds = (pod.get("status") or {}).get("conditions") or []
    changed = max((c["lastTransitionTime"] for c in conds if c.get("lastTransitionTime")), default=None)
    return finished_at(pod) or changed or started_at(pod) or pod["metadata"].get("creationTimestamp")


def in_a_row(pod: dict) -> int:
    """The failures in a row of a failed pod's slot, this one included: those before it (its
    annotation, set when it replaced a failed pod), unless it ran RESET_AFTER seconds, which
    ends a row, as the kubelet resets its crash-loop backoff."""
    try:
        before = int(pod["metadata"].get("annotations", {})[FAILURES_ANNOTATION])
    except (KeyError, ValueError):
        before = 0
    start, end = ended(pod).get("startedAt"), finished_at(pod)  # the container's run, not the image pull before it
    ran = since(start, datetime.datetime.fromisoformat(end.replace("Z", "+00:00"))) if start and end else 0.0
    return 1 if ran >= RESET_AFTER else before + 1


def termination(pod: dict) -> str:
    """Why a pod failed, as `kubectl describe pod` says it: its container's reason, exit code and
    message (the role's container first), else the pod's reason and message (evicted)."""
    st = pod.get("status") or {}
    role = pod["metadata"].get("labels", {}).get(ROLE_LABEL)
    statuses = sorted(st.get("containerStatuses") or [], key=lambda c: c.get("name") != role)
    for c in statuses:
        t = (c.get("state") or {}).get("terminated") or (c.get("lastState") or {}).get("terminated")
        if t:
            head = ", ".join(x for x in (t.get("reason"), f"exit code {t.get('exitCode')}") if x)
            said = (t.get("message") or "").strip()  # a log's end (FallbackToLogsOnError): its last line matters
            return head + (f": {'…' if len(said) > 300 else ''}{said[-300:]}" if said else "")
    head = ": ".join(x for x in (st.get("reason"), (st.get("message") or "")[:300]) if x)
    return head or "no reason given"


def refused(pod: dict) -> str | None:
    """Why the trainer pod's spec check refused the job (its init container exited with
    INVALID_EXIT), or None. The kubelet keeps the end of its log as its termination
    message: the last line is `error: FIELD: why`."""
    for s in (pod.get("status") or {}).get("initContainerStatuses") or []:
        end = (s.get("state") or {}).get("terminated") or {}
        if s.get("name") == builders.CHECK and end.get("exitCode") == INVALID_EXIT:
            lines = [x.strip() for x in (end.get("message") or "").splitlines() if x.strip()]
            why = lines[-1].removeprefix("error: ") if lines else "no reason given"
            return f"the trainer's check in pod {pod['metadata']['name']}: {why}"
    return None


class Pods:
    """This job's pods in each cluster that answered."""

    def __init__(self, by_cluster: dict[Cluster, list[dict]]):
        self.by_cluster = by_cluster

    def __iter__(self) -> Iterator[tuple[Cluster, dict]]:
        for cluster, pods in self.by_cluster.items():
            for p in pods:
                yield cluster, p

    def of(self, cluster: Cluster) -> list[dict]:
        return self.by_cluster.get(cluster, [])

    def current(self, cluster: Cluster, key: Slot) -> tuple[dict | None, list[dict]]:
        """The newest attempt's pod of a slot, and the older ones still there."""
        pods = self._slots.get((cluster, key), [])
        return (pods[-1], pods[:-1]) if pods else (None, [])

    def trainer(self) -> dict | None:
        return self.current(None, ("trainer", None, None))[0]

    @functools.cached_property
    def _slots(self) -> dict[tuple[Cluster, Slot], list[dict]]:
        """Each slot's pods, oldest attempt first: indexed once, where a search per slot would
        cost a job of thousands of workers millions of comparisons a cycle."""
        out: dict[tuple[Cluster, Slot], list[dict]] = {}
        for cluster, p in self:
            out.setdefault((cluster, slot_key(p)), []).append(p)
        return {k: sorted(v, key=attempt) for k, v in out.items()}

    @functools.cached_property
    def alive(self) -> set[str]:
        """The names of the pods not being deleted, in every cluster answering."""
        return {p["metadata"]["name"] for _, p in self if not terminating(p)}
