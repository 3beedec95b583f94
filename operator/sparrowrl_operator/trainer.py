"""The trainer's slot: one pod (or one per node, a gang, for a trainer of several nodes), made,
restarted after a failure up to runPolicy.backoffLimit, or when it trains toward fewer steps
than the job's (they were raised); the job succeeds when it exits 0 having trained every step."""

from __future__ import annotations

from sparrowrl.spec.layout import Process
from sparrowrl_operator import builders
from sparrowrl_operator.constants import INVALID, RESTARTED, STEPS_ANNOTATION, SUCCEEDED
from sparrowrl_operator.cycle import Facts, Outcome
from sparrowrl_operator.model import TrainerNode
from sparrowrl_operator.pods import attempt, failed_at, phase_of, ready, refused, terminating, termination
from sparrowrl_operator.times import since

ROLE = Process("trainer", "trainer")


def node_role(node: int) -> Process:
    """Node `node` of a trainer of several: node 0 is the trainer (ROLE), which serves."""
    return ROLE if node == 0 else Process("trainer", f"trainer-node{node}")


def reconcile_trainer(c: Facts, out: Outcome, claim_going: bool, certified: bool = True) -> None:
    """The TrainerReady condition, and the job's success or failure by its trainer.
    `claim_going`: the state's claim is an earlier job's, being deleted; `certified`: a pod made
    now finds its serving certificate (the job's CA can sign). A trainer of several nodes is a
    gang: its pods are made together, and any one's failure restarts all of them, counted once."""
    pod, older = c.pods.current(None, ("trainer", None, None))
    for p in older:
        out.remove(None, p)
    others = _others(c, out)
    gang = [pod, *others]
    nodes = c.spec.trainer.nodes
    _report(c, out, gang)
    limit = c.spec.run_policy.backoff_limit
    if pod is None and claim_going:
        claims = " or ".join(builders.claim_name(c.job, k) for k in range(nodes))
        out.condition(
            "TrainerReady",
            False,
            "WaitingForClaim",
            f"PersistentVolumeClaim {claims}, an earlier job's of this name, is being "
            "deleted with it: the trainer starts on a new one",
        )
        return
    if pod is None and not certified:
        out.condition(
            "TrainerReady",
            False,
            "WaitingForCertificate",
            "waiting for the job's CA (the Encrypted condition says why)",
        )
        return
    if pod is None and any(p is not None for p in others):  # node 0 went: the gang starts again as a whole
        _remove(out, others)
        out.condition(
            "TrainerReady",
            False,
            "Terminating",
            f"the trainer's node 0 is gone: stopping its other {nodes - 1} node(s)",
        )
        return
    if pod is None:
        _create(c, out, out.status.restarts)
        out.condition(
            "TrainerReady",
            False,
            "Creating",
            "creating the trainer pod" if nodes == 1 else f"creating the trainer's {nodes} pods",
        )
        return
    n, phase = attempt(pod), phase_of(pod)
    if going := [p for p in gang if p is not None and terminating(p)]:  # successors are made once they are gone
        out.condition("TrainerReady", False, "Terminating", f"pod {going[0]['metadata']['name']} is being deleted")
        return
    behind = _trains_for(c, pod)
    if phase != "Failed" and behind is not None and behind < c.spec.steps:
        _remove(out, gang)  # its successor, made once it is gone, reads the raised steps
        out.condition(
            "TrainerReady",
            False,
            "Restarting",
            f"spec.steps raised from {behind} to {c.spec.steps}: restarting pod {pod['metadata']['name']}, "
            "which goes on from its volume",
        )
        out.update(progress=out.status.progress.model_copy(update={"steps": c.spec.steps}))
        return
    if phase == "Succeeded":
        out.condition("TrainerReady", False, "Finished", "the trainer finished the job")
        out.transition("Succeeded", True, SUCCEEDED, f"trained {c.spec.steps} steps")
        out.update(
            completion_time=out.status.completion_time or out.now,
            # it exits 0 only once every step is trained; its last /v1/status may have been missed
            progress=out.status.progress.model_copy(
                update={"step": c.spec.steps, "steps": c.spec.steps, "policy_version": c.spec.steps}
            ),
        )
        return
    if phase == "Failed" and (why := refused(pod)):  # the same job would fail again: no restart
        out.fail(INVALID, why)
        return
    if missing := [k for k, p in enumerate(others, 1) if p is None]:
        # never made (its create refused), or deleted: made again as this attempt. A node deleted while
        # the gang ran fails node 0's next collective, and the gang restarts as after any failure
        for k in missing:
            out.create_pod(None, c.pod(None, node_role(k), n, k, template=c.spec.trainer.template, node=k))
        out.condition("TrainerReady", False, "Creating", f"creating node {missing[0]}'s pod")
        return
    failed = [(k, p) for k, p in enumerate(gang) if p is not None and phase_of(p) == "Failed"]
    if failed:
        who = f"pod {pod['metadata']['name']}" if nodes == 1 else _failures(failed)
        if n >= limit:
            times = f"{n + 1} times" if nodes == 1 else f"{n + 1} times (last: {who})"
            out.fail("BackoffLimitExceeded", f"the trainer failed {times}; runPolicy.backoffLimit is {limit}")
            return
        again = "" if nodes == 1 else f": all {nodes} nodes restart together"
        out.condition("TrainerReady", False, "Restarting", f"the trainer failed ({who}){again}")
        if all(since(failed_at(p), c.obs.now) >= c.backoff.delay(n) for _, p in failed):  # it may never have run
            if nodes == 1:  # its successor at once (another name)
                out.create_pod(None, c.pod(None, ROLE, n + 1, None, template=c.spec.trainer.template))
            # a gang's are made once all of these are gone: no new node meets an old one
            _remove(out, gang)
            out.update(restarts=n + 1)
            whole = "" if nodes == 1 else f"; all {nodes} nodes restart, each resuming from its volume"
            out.event(
                RESTARTED,
                f"the trainer failed; restart {n + 1} of {limit}, resuming from its volume{whole}",
                warning=True,
            )
        return
    out.update(restarts=max(out.status.restarts, n))
    up = phase == "Running" and ready(pod)
    if nodes == 1:
        out.condition(
            "TrainerReady",
            up,
            "Ready" if up else "NotReady",
            f"pod {pod['metadata']['name']}" + ("" if up else f" is {phase}"),
        )
        return
    waiting = [(k, p) for k, p in enumerate(others, 1) if p is not None and phase_of(p) not in ("Running", "Succeeded")]
    if waiting:
        out.condition(
            "TrainerReady",
            False,
            "WaitingForNodes",
            "; ".join(f"node {k}: pod {p['metadata']['name']} is {_state(p)}" for k, p in waiting)
            + f" (node 0 waits trainer.joinTimeoutSeconds, {c.spec.trainer.join_timeout_seconds} s, for every node)",
        )
        return
    out.condition(
        "TrainerReady",
        up,
        "Ready" if up else "NotReady",
        f"{nodes} nodes running, node 0 in pod {pod['metadata']['name']}" + ("" if up else f" (it is {phase})"),
    )


def _others(c: Facts, out: Outcome) -> list[dict | None]:
    """The current pod of nodes 1.. of the trainer (older attempts removed)."""
    found: list[dict | None] = []
    for k in range(1, c.spec.trainer.nodes):
        p, older = c.pods.current(None, ("trainer", None, str(k)))
        for o in older:
            out.remove(None, o)
        found.append(p)
    return found


def _remove(out: Outcome, pods: list[dict | None]) -> None:
    for p in pods:
        if p is not None:
            out.remove(None, p)


def _create(c: Facts, out: Outcome, n: int) -> None:
    """The trainer's pods, attempt `n`: node 0's, and each other node's."""
    for k in range(c.spec.trainer.nodes):
        slot = k or None
        out.create_pod(None, c.pod(None, node_role(k), n, slot, template=c.spec.trainer.template, node=k))


def _failures(failed: list[tuple[int, dict]]) -> str:
    return "; ".join(f"node {k}: pod {p['metadata']['name']}, {termination(p)}" for k, p in failed)


def _state(p: dict) -> str:
    """A pod's phase, and why it waits where it says (unschedulable, an image not pulled)."""
    st = p.get("status") or {}
    why = next(
        (
            f"{c.get('reason')}: {c.get('message', '')}"
            for c in st.get("conditions") or []
            if c.get("type") == "PodScheduled" and c.get("status") == "False"
        ),
        None,
    )
    for cs in st.get("containerStatuses") or []:
        wait = (cs.get("state") or {}).get("waiting") or {}
        why = why or (f"{wait.get('reason')}: {wait.get('message', '')}" if wait.get("reason") else None)
    return phase_of(p) + (f" ({why.strip()[:200]})" if why else "")


def _report(c: Facts, out: Outcome, gang: list[dict | None]) -> None:
    """status.trainerNodes: each node's pod, for `kubectl describe` (a trainer of several nodes)."""
    if c.spec.trainer.nodes == 1:
        return
    rows = []
    for k, p in enumerate(gang):
        failed = p is not None and phase_of(p) == "Failed"
        rows.append(
            TrainerNode(
                node=k,
                pod=p["metadata"]["name"] if p else None,
                phase=phase_of(p) if p else "Absent",
                message=(termination(p) if failed else _state(p))[:512] if p else None,
            )
        )
    out.update(trainer_nodes=rows)


def _trains_for(c: Facts, pod: dict) -> int | None:
    """The steps the trainer pod trains toward: what it says when it runs and answers (it may
    have read its ConfigMap before a change reached it), else the steps it was made with
    (a pod made before that annotation: those it last reported)."""
    t = c.obs.trainer
    if t is not None and phase_of(pod) == "Running":
        return t.steps
    try:
        return int(pod["metadata"]["annotations"][STEPS_ANNOTATION])
    except (KeyError, ValueError):
        return c.prev.progress.steps or None


def logs_command(c: Facts) -> str:
    """The command that shows the running trainer's log."""
    pod = c.pods.trainer()
    name = pod["metadata"]["name"] if pod else builders.pod_name(c.job, ROLE, 0)
    return f"kubectl logs {name}"
