"""The trainer's slot: one pod, made, restarted after a failure up to runPolicy.backoffLimit, or
when it trains toward fewer steps than the job's (they were raised); the job succeeds when it
exits 0 having trained every step."""

from __future__ import annotations

from sparrowrl.spec.layout import Process
from sparrowrl_operator import builders
from sparrowrl_operator.constants import INVALID, RESTARTED, STEPS_ANNOTATION, SUCCEEDED
from sparrowrl_operator.cycle import Facts, Outcome
from sparrowrl_operator.pods import attempt, failed_at, phase_of, ready, refused, terminating
from sparrowrl_operator.times import since

ROLE = Process("trainer", "trainer")


def reconcile_trainer(c: Facts, out: Outcome, claim_going: bool, certified: bool = True) -> None:
    """The TrainerReady condition, and the job's success or failure by its trainer.
    `claim_going`: the state's claim is an earlier job's, being deleted; `certified`: a pod made
    now finds its serving certificate (the job's CA can sign)."""
    pod, older = c.pods.current(None, ("trainer", None, None))
    for p in older:
        out.remove(None, p)
    limit = c.spec.run_policy.backoff_limit
    if pod is None and claim_going:
        out.condition(
            "TrainerReady",
            False,
            "WaitingForClaim",
            f"PersistentVolumeClaim {builders.claim_name(c.job)}, an earlier job's of this name, is being "
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
    if pod is None:
        out.create_pod(None, c.pod(None, ROLE, out.status.restarts, None, template=c.spec.trainer.template))
        out.condition("TrainerReady", False, "Creating", "creating the trainer pod")
        return
    n, phase = attempt(pod), phase_of(pod)
    if terminating(pod):  # its successor is created once it is gone (the same name)
        out.condition("TrainerReady", False, "Terminating", f"pod {pod['metadata']['name']} is being deleted")
        return
    behind = _trains_for(c, pod)
    if phase != "Failed" and behind is not None and behind < c.spec.steps:
        out.remove(None, pod)  # its successor, made once it is gone, reads the raised steps
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
    if phase == "Failed":
        if n >= limit:
            out.fail("BackoffLimitExceeded", f"the trainer failed {n + 1} times; runPolicy.backoffLimit is {limit}")
            return
        out.condition("TrainerReady", False, "Restarting", f"the trainer failed (pod {pod['metadata']['name']})")
        if since(failed_at(pod), c.obs.now) >= c.backoff.delay(n):  # its container may never have run
            out.create_pod(None, c.pod(None, ROLE, n + 1, None, template=c.spec.trainer.template))
            out.remove(None, pod)
            out.update(restarts=n + 1)
            out.event(
                RESTARTED, f"the trainer failed; restart {n + 1} of {limit}, resuming from its volume", warning=True
            )
        return
    out.update(restarts=max(out.status.restarts, n))
    up = phase == "Running" and ready(pod)
    out.condition(
        "TrainerReady",
        up,
        "Ready" if up else "NotReady",
        f"pod {pod['metadata']['name']}" + ("" if up else f" is {phase}"),
    )


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
