"""The job's run as a whole, as JobSet's run policies: suspended and resumed, stopped by its
deadlines, finished (its machines freed, its claim as the retention policy says, deleted after
its TTL), and reopened when a succeeded job's steps are raised."""

from __future__ import annotations

from sparrowrl_operator import builders
from sparrowrl_operator.conditions import find, is_true, reopen
from sparrowrl_operator.constants import RESUMED, STEPS_RAISED, SUSPENDED, TTL_EXPIRED
from sparrowrl_operator.cycle import Facts, Outcome
from sparrowrl_operator.home import claim_as_decided
from sparrowrl_operator.pods import Pods, phase_of
from sparrowrl_operator.times import since


def reopen_raised(c: Facts, out: Outcome) -> None:
    """A job that succeeded and whose steps were raised since trains on from the trainer's
    state: no longer finished, its deadline counting from now."""
    done = out.status.progress.steps
    conds = out.status.conditions
    if not is_true(conds, "Succeeded") or is_true(conds, "Failed") or c.spec.steps <= done:
        return
    message = f"spec.steps raised from {done} to {c.spec.steps} after the job succeeded: it trains on"
    out.update(
        conditions=reopen(list(conds), "Succeeded", STEPS_RAISED, message, out.now, out.generation),
        completion_time=None,
        active_since=None,
        progress=out.status.progress.model_copy(update={"steps": c.spec.steps}),
    )


def free(pods: Pods, out: Outcome) -> None:
    """A finished job frees its machines; finished pods stay for their logs."""
    for cluster, p in pods:
        if phase_of(p) not in ("Succeeded", "Failed"):
            out.remove(cluster, p)


def finish(c: Facts, out: Outcome) -> None:
    """A finished job: its machines freed, its claim as decided, and, once that is so, the job
    deleted after runPolicy.ttlSecondsAfterFinished."""
    free(c.pods, out)
    settled = claim_as_decided(c, out)
    ttl = c.spec.run_policy.ttl_seconds_after_finished
    if ttl is None or since(out.status.completion_time, c.obs.now) < ttl or not settled:
        return
    out.actions.delete_job = True
    names = [builders.claim_name(c.job, k) for k in range(c.spec.trainer.nodes)]
    claim = f"volume claim {names[0]}" if len(names) == 1 else f"volume claims {', '.join(names)}"
    if builders.retained(c.spec):
        out.event(
            TTL_EXPIRED,
            f"deleted after runPolicy.ttlSecondsAfterFinished ({ttl} s); its {claim}, with "
            "the trained model, is kept (trainer.state.retentionPolicy.whenDeleted: Retain)",
        )
    else:
        out.event(
            TTL_EXPIRED,
            f"deleted after runPolicy.ttlSecondsAfterFinished ({ttl} s); its {claim}, with "
            "the trained model, goes with it (trainer.state.retentionPolicy.whenDeleted: Delete)",
            warning=True,
        )


def suspend(c: Facts, out: Outcome) -> None:
    for cluster, p in c.pods:
        out.remove(cluster, p)
    if not is_true(out.status.conditions, "Suspended"):
        out.event(SUSPENDED, "suspended: pods deleted; the trainer's state is kept")
    out.condition("Suspended", True, "Suspended", "runPolicy.suspend is set")
    out.condition("TrainerReady", False, "Suspended")
    out.condition("RolloutReady", False, "Suspended")
    out.update(active_since=None)


def resume(out: Outcome) -> None:
    """An active job: resumed if it was suspended; its deadline counts from its start or resume."""
    if is_true(out.status.conditions, "Suspended"):
        out.event(RESUMED, "resumed: the trainer continues from its state")
    if find(out.status.conditions, "Suspended") is not None:
        out.condition("Suspended", False, "Resumed")
    out.update(start_time=out.status.start_time or out.now, active_since=out.status.active_since or out.now)


def past_deadline(c: Facts, out: Outcome) -> bool:
    """runPolicy.activeDeadlineSeconds, and startupDeadlineSeconds until the first rollout: past
    either, the job fails and finishes. Whether it did."""
    rp, active = c.spec.run_policy, since(out.status.active_since, c.obs.now)
    if rp.active_deadline_seconds is not None and active > rp.active_deadline_seconds:
        out.fail(
            "DeadlineExceeded",
            f"running for {active:.0f} s, over runPolicy.activeDeadlineSeconds ({rp.active_deadline_seconds})",
        )
    elif rp.startup_deadline_seconds is not None and not _started(c) and active > rp.startup_deadline_seconds:
        out.fail(
            "DeadlineExceeded",
            f"no rollout after {active:.0f} s, over runPolicy.startupDeadlineSeconds ({rp.startup_deadline_seconds})",
        )
    else:
        return False
    finish(c, out)
    return True


def _started(c: Facts) -> bool:
    t = c.obs.trainer
    return c.prev.progress.step > 0 or (t is not None and t.phase != "Pending")
