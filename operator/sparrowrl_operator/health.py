"""The trainer's word on its workers, as conditions with their Events: LeasesHealthy (workers it
has not heard from: stale), WeightsInSync (their committed weights' hashes and versions) and
WorkersTrusted (samples it refused as false). An Event as each changes, not one per worker per
cycle: 4,000 stale workers made 4,000 Events every cycle."""

from __future__ import annotations

from sparrowrl_operator import trainer
from sparrowrl_operator.constants import SAMPLES_REFUSED, STALE, STEPS_SKIPPED
from sparrowrl_operator.cycle import Facts, Outcome
from sparrowrl_operator.model import MAX_LISTED
from sparrowrl_operator.pods import phase_of, terminating
from sparrowrl_operator.status import counted
from sparrowrl_operator.times import since


def stale_workers(c: Facts) -> dict[str, float]:
    """Workers whose pods run, that the trainer has not heard from for staleAfterSeconds, with
    the seconds since. Not while the trainer itself has been up for less: a trainer that was down
    was heard by no one, and its workers are still backing off."""
    t = c.obs.trainer
    limit = c.spec.health.stale_after_seconds
    pod = c.pods.trainer()
    up = since((pod or {}).get("status", {}).get("startTime"), c.obs.now) if pod else 0.0
    if t is None or up <= limit:
        return {}
    alive = {p["metadata"]["name"] for _, p in c.pods if phase_of(p) == "Running" and not terminating(p)}
    return {w.name: w.seconds_since_seen for w in t.workers if w.name in alive and w.seconds_since_seen > limit}


def leases(c: Facts, out: Outcome, stale: dict[str, float]) -> bool:
    """LeasesHealthy. Whether the job failed by it (health.onStale: FailJob)."""
    t = c.obs.trainer
    if t is None:
        return False
    if not stale:
        out.condition(
            "LeasesHealthy", True, "AllWorkersReporting", f"{t.leases_active} leases active, {t.leases_expired} expired"
        )
        return False
    names = ", ".join(f"{n} ({s:.0f} s)" for n, s in sorted(stale.items())[:8])
    out.transition("LeasesHealthy", False, "StaleWorkers", f"not heard from: {names}", warning=True)
    _stale_events(c, out, stale)
    if c.spec.health.on_stale != "FailJob":
        return False
    out.fail("StaleWorkers", f"not heard from: {names}; health.onStale is FailJob")
    return True


def _stale_events(c: Facts, out: Outcome, stale: dict[str, float]) -> None:
    """An Event per worker as it goes stale. The last status lists up to MAX_LISTED stale
    workers; beyond that many, one Event says how many when the count changes."""
    on_stale = c.spec.health.on_stale
    before, named_all = c.prev.leases.stale_workers, c.prev.progress.worker_counts.stale <= MAX_LISTED
    if len(stale) <= MAX_LISTED and named_all:
        for n in sorted(set(stale) - set(before)):
            out.event(STALE, f"worker {n} not heard from for {stale[n]:.0f} s; health.onStale is {on_stale}", True)
    elif len(stale) != c.prev.progress.worker_counts.stale:
        worst = ", ".join(f"{n} ({s:.0f} s)" for n, s in sorted(stale.items(), key=lambda x: -x[1])[:8])
        out.event(
            STALE, f"{len(stale)} workers not heard from, the longest {worst}; health.onStale is {on_stale}", True
        )


def weights(c: Facts, out: Outcome) -> None:
    """WeightsInSync, from every live worker that has committed a version, not only those the
    status lists."""
    t = c.obs.trainer
    if t is None:
        return
    alive, staleness = c.pods.alive, c.spec.sync.staleness
    reported = [w for w in t.workers if w.name in alive and w.committed_version is not None]
    bad = [w.name for w in reported if w.last_verification == "mismatch"]
    behind = [w.name for w in reported if (w.staleness or 0) > staleness]
    if bad:
        out.transition(
            "WeightsInSync",
            False,
            "HashMismatch",
            f"committed weights differ from the trainer's: {', '.join(bad[:8])}",
            warning=True,
        )
    elif behind:
        out.condition("WeightsInSync", False, "Behind", f"beyond sync.staleness ({staleness}): {', '.join(behind[:8])}")
    elif reported:
        out.condition(
            "WeightsInSync",
            True,
            "Verified",
            f"{len(reported)} workers within {staleness} version(s) of v{t.version}, each commit hash-verified",
        )


def trust(c: Facts, out: Outcome) -> None:
    """WorkersTrusted, from the trainer's count of each live worker's refused samples: samples
    whose log-probs were further from the trainer's than grpo.behaviour.refuseGap, from a
    worker sending false numbers (compromised, broken or buggy). Not a failure, and no part of
    the phase: the run goes on, those samples are not trained. A count is the trainer's over
    the job, for the worker's pod name, so the condition holds while that pod lives. Then the
    steps that changed no weight, with an Event when there are more."""
    t = c.obs.trainer
    if t is None:
        return
    refused = {w.name: w.refused_samples for w in t.workers if w.name in c.pods.alive and w.refused_samples}
    if refused:
        worst = sorted(refused, key=lambda n: (-refused[n], n))
        names = ", ".join(f"{n} ({refused[n]})" for n in worst[:8])
        more = f" and {len(worst) - 8} more" if len(worst) > 8 else ""
        out.transition(
            "WorkersTrusted",
            False,
            "FalseSamples",
            f"samples refused, their log-probs further from the trainer's than grpo.behaviour.refuseGap: {names}{more}",
            warning=True,
        )
        _refused_events(c, out, refused, worst)
    else:
        out.condition("WorkersTrusted", True, "AllSamplesTrusted", "no live worker has had a sample refused")
    grew = t.steps_skipped - c.prev.progress.steps_skipped
    if grew > 0:
        out.event(
            STEPS_SKIPPED,
            f"{counted(grew, 'more step')} changed no weight ({t.steps_skipped} of {t.step} so far): nothing "
            "to train (every group scored alike), every sample refused, or a loss not finite; "
            f"{trainer.logs_command(c)} says which, step by step",
        )  # Normal: a solved task's batches have nothing to train, which is no fault


def _refused_events(c: Facts, out: Outcome, refused: dict[str, int], worst: list[str]) -> None:
    """An Event per worker as its refused samples grow. The last status's listing holds each
    one's last count while it lists every such worker (they sort right after hash mismatches);
    beyond that, one Event when the job's count grows."""
    prev, logs = c.prev.progress, trainer.logs_command(c)
    before = {w.name: w.refused_samples for w in prev.workers if w.refused_samples}
    named_all = len(before) == prev.worker_counts.untrusted
    names_all = sum(bool(w.refused_samples) for w in out.status.progress.workers) == len(refused)
    if named_all and names_all:
        for n in worst:
            if refused[n] > before.get(n, 0):
                out.event(
                    SAMPLES_REFUSED,
                    f"worker {n} has had {counted(refused[n], 'sample')} refused ({refused[n] - before.get(n, 0)} "
                    "since the last count): their log-probs were further from the trainer's than "
                    f"grpo.behaviour.refuseGap, so they are not trained; {logs} says which steps "
                    f"(`refused N samples of worker {n}`)",
                    True,
                )
    elif (t := c.obs.trainer) is not None and t.samples_refused > prev.samples_refused:
        most = ", ".join(f"{n} ({refused[n]})" for n in worst[:8])
        out.event(
            SAMPLES_REFUSED,
            f"{counted(len(refused), 'worker')} had samples refused, the most: {most}; "
            f"{t.samples_refused - prev.samples_refused} more since the last count, {t.samples_refused} in all: "
            f"their log-probs were further from the trainer's than grpo.behaviour.refuseGap; {logs} says which",
            True,
        )
