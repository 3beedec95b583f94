"""The status's figures, computed in one place (as KubeRay's calculateStatus): the trainer's
progress and leases, the worst of its workers, the columns `kubectl get` shows, and the phase,
derived from the conditions alone."""

from __future__ import annotations

from sparrowrl.spec.status import TrainerStatus, WorkerStatus
from sparrowrl_operator.conditions import find, is_true
from sparrowrl_operator.cycle import Facts, Outcome
from sparrowrl_operator.model import (
    MAX_LISTED,
    Display,
    LeaseHealth,
    Progress,
    Staleness,
    WorkerCounts,
    WorkerProgress,
)


def progress(c: Facts, out: Outcome, stale: dict[str, float]) -> None:
    """Progress and leases, from the trainer's /v1/status; left as last written when it did not
    answer. `stale`: the workers it has not heard from."""
    t = c.obs.trainer
    if t is None:
        return
    alive = c.pods.alive
    listed, counts = worker_view(t, alive, stale, c.spec.sync.staleness)
    held_by_stale = sum(w.leases_held for w in t.workers if w.name in stale)
    out.update(
        progress=Progress(
            step=t.step,
            steps=c.spec.steps,  # a trainer about to restart with raised steps still says the old ones
            policy_version=t.version,
            reward=rounded(t.reward_last, 4),
            recent_reward=rounded(t.reward_mean_10, 4),
            tokens_per_second=rounded(t.tokens_per_second, 1),
            payload_bytes=t.last_payload_bytes,
            changed_fraction=rounded(t.last_changed_fraction, 5),
            commits_verified=t.commits_verified,
            commits_mismatched=t.commits_mismatched,
            steps_skipped=t.steps_skipped,
            samples_refused=t.samples_refused,
            cost_dollars=rounded(t.cost_dollars, 4),
            tokens_per_dollar=rounded(t.tokens_per_dollar, 1),
            worker_counts=counts,
            workers=listed,
        ),
        leases=LeaseHealth(
            active=t.leases_active,
            healthy=max(t.leases_active - held_by_stale, 0),
            expired=t.leases_expired,
            requeued=t.prompt_groups_requeued,
            stale_workers=sorted(stale, key=lambda n: (-stale[n], n))[:MAX_LISTED],
            oldest_heartbeat_seconds=rounded(
                max((w.seconds_since_seen for w in t.workers if w.name in alive), default=None), 1
            ),
        ),
    )


def worker_view(
    t: TrainerStatus, alive: set[str], stale: dict[str, float], sync_staleness: int
) -> tuple[list[WorkerProgress], WorkerCounts]:
    """The trainer's workers as the status shows them: every live one counted, and the worst
    MAX_LISTED listed (a hash mismatch, then most refused samples (false log-probs), then stale,
    then most versions behind, then most refused answers, then longest unheard), so a status of
    thousands of workers stays small and shows what needs looking at. Workers whose pods are gone
    are left out: the trainer still lists them for a while."""
    live = [w for w in t.workers if w.name in alive]

    def badness(w: WorkerStatus) -> tuple:
        return (
            w.last_verification != "mismatch",
            -w.refused_samples,
            w.name not in stale,
            -(w.staleness or 0),
            -w.refused_answers,
            -w.seconds_since_seen,
            w.name,
        )

    by = {"current": 0, "one": 0, "two": 0, "three_or_more": 0, "unknown": 0}
    for w in live:
        if w.committed_version is None or w.staleness is None:
            by["unknown"] += 1
        else:
            by[("current", "one", "two")[w.staleness] if w.staleness < 3 else "three_or_more"] += 1
    counts = WorkerCounts(
        total=len(t.workers),
        live=len(live),
        stale=sum(w.name in stale for w in live),
        mismatched=sum(w.last_verification == "mismatch" for w in live),
        behind=sum(w.committed_version is not None and (w.staleness or 0) > sync_staleness for w in live),
        refusing=sum(w.refused_answers > 0 for w in live),
        untrusted=sum(w.refused_samples > 0 for w in live),
        by_staleness=Staleness(**by),
    )
    listed = [
        WorkerProgress(
            name=w.name,
            region=w.region,
            committed_version=w.committed_version,
            verification=w.last_verification,
            behind=w.staleness,
            stale=True if w.name in stale else None,
            refused_answers=w.refused_answers or None,
            refused_samples=w.refused_samples or None,
        )
        for w in sorted(live, key=badness)[:MAX_LISTED]
    ]
    return listed, counts


def display(c: Facts, out: Outcome, clusters: tuple[int, int]) -> None:
    """The columns of `kubectl get`, as short strings. `clusters`: reachable, used."""
    s, p = out.status, out.status.progress
    reachable, used = clusters
    payload = (
        ""
        if p.payload_bytes is None
        else human_bytes(p.payload_bytes) + (f" ({p.changed_fraction:.2%})" if p.changed_fraction is not None else "")
    )
    out.update(
        display=Display(
            step=f"{p.step}/{p.steps or c.spec.steps}",
            rollout=f"{sum(x.ready for x in s.placements)}/{sum(x.desired for x in s.placements)}",
            leases=f"{s.leases.healthy}/{s.leases.active}",
            clusters=f"{reachable}/{used}" if used else "",
            payload=payload,
            tokens_per_dollar=None if p.tokens_per_dollar is None else human_count(p.tokens_per_dollar),
        )
    )


def derive_phase(conditions: list, trainer_serving: bool) -> str:
    """The phase `kubectl get` shows, from the conditions alone (as JobSet derives its terminal
    state): terminal ones first, then suspension, then how the trainer's pod is."""
    trainer = find(conditions, "TrainerReady")
    for type_ in ("Failed", "Succeeded", "Suspended"):
        if is_true(conditions, type_):
            return type_
    if trainer is not None and trainer.reason == "Restarting":
        return "Restarting"
    if trainer is not None and trainer.status == "True":
        return "Running" if trainer_serving else "Starting"  # serving: its own status is past Pending
    return "Pending"


def rounded(x: float | None, digits: int) -> float | None:
    """What a person reads in `kubectl describe`; the trainer's /v1/status has every digit."""
    return None if x is None else round(x, digits)


def human_count(x: float) -> str:
    """14.4M, not the 1.44e+07 that a number column would show; short at any size (the column's
    field has a length bound)."""
    for unit in ("", "k", "M", "G", "T"):
        if x < 1000:
            return f"{x:.0f}" if not unit else f"{x:.1f}{unit}"
        x /= 1000
    return f"{x * 1e15:.2g}"


def counted(n: int, what: str) -> str:
    """`1 sample`, `3 samples`."""
    return f"{n} {what}" + ("" if n == 1 else "s")


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return ""
