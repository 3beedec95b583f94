"""What a job is doing, in one model: the trainer serves it at GET /v1/status, `sparrowrl status`
prints it, and the operator copies it into the custom resource's status. No torch here: the
operator's image imports this."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field
from rich.table import Table

Count = Annotated[int, Field(ge=0, lt=1 << 62)]
Version = Annotated[int, Field(ge=-1, lt=10**8)]


class _Status(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class WorkerStatus(_Status):
    name: Annotated[str, Field(max_length=253)]
    region: Annotated[str, Field(max_length=63)] | None = None
    committed_version: Version | None = None
    staleness: Count | None = None  # versions behind the trainer's newest
    last_verification: Literal["ok", "mismatch"] | None = None
    seconds_since_seen: Annotated[float, Field(ge=0)]
    leases_held: Count = 0
    stale: bool = False  # not heard from within a lease period
    refused_answers: Count = 0  # from its relay (or the origin) that did not verify: forged, altered or malformed
    refused_samples: Count = 0  # its samples not trained: their log-probs were further from the trainer's than allowed


class TrainerStatus(_Status):
    phase: Literal["Pending", "Running", "Succeeded"]  # Pending: until the workers have called in
    step: Count
    steps: Count
    version: Version  # the newest published policy version
    reward_last: float | None = None
    reward_mean_10: float | None = None  # over the last 10 steps
    tokens_per_second: Annotated[float, Field(ge=0)] | None = None
    last_payload_bytes: Count | None = None
    last_changed_fraction: Annotated[float, Field(ge=0, le=1)] | None = None
    leases_active: Count = 0
    leases_expired: Count = 0
    prompt_groups_admitted: Count = 0
    prompt_groups_requeued: Count = 0  # went back to the queue: their lease expired or was refused
    prompt_groups_lost: Count = 0  # never trained on: 0 once the job has succeeded
    prompt_groups_discarded_late: Count = 0
    prompt_groups_refilled: Count = 0  # added in place of groups whose samples all scored alike (refill)
    commits_verified: Count = 0
    commits_mismatched: Count = 0
    origin_sent_delta_bytes: Count = 0
    origin_sent_base_bytes: Count = 0
    trainer_restarts: Count = 0  # started again after one died
    trainer_resumes: Count = 0  # started on purpose to go on: `sparrowrl run --resume`, raised steps
    eval_version: Version | None = None  # the version the last held-out eval (task.eval) was of
    eval_pass_at_1: Annotated[float, Field(ge=0, le=1)] | None = None
    eval_pass_at_k: Annotated[float, Field(ge=0, le=1)] | None = None  # k = task.eval.samples, when above 1
    steps_skipped: Count = 0  # steps that changed no weight: nothing to train, every sample refused, not finite
    samples_refused: Count = 0  # samples not trained: their worker's log-probs were false
    cost_dollars: Annotated[float, Field(ge=0)] | None = None  # with the spec's costPerHour
    tokens_per_dollar: Annotated[float, Field(ge=0)] | None = None  # completion tokens trained on
    workers: Annotated[list[WorkerStatus], Field(max_length=4096)] = []
    stale_workers: Annotated[list[str], Field(max_length=4096)] = []


def table(s: TrainerStatus, url: str) -> Table:
    """`sparrowrl status`: the job, then one row per worker."""

    def num(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    t = Table(title=f"{url}: {s.phase}, step {s.step}/{s.steps}, policy v{s.version}", show_header=False)
    t.add_column(style="bold")
    t.add_column(justify="right")
    t.add_row("reward last / mean of last 10", f"{num(s.reward_last, '.3f')} / {num(s.reward_mean_10, '.3f')}")
    t.add_row("tokens per second", num(s.tokens_per_second, ".0f"))
    t.add_row(
        "last step: payload, changed", f"{num(s.last_payload_bytes, ',')} B, {num(s.last_changed_fraction, '.2%')}"
    )
    t.add_row("leases active / expired", f"{s.leases_active} / {s.leases_expired}")
    t.add_row(
        "groups admitted / requeued / lost / late",
        f"{s.prompt_groups_admitted} / {s.prompt_groups_requeued} / {s.prompt_groups_lost} / "
        f"{s.prompt_groups_discarded_late}",
    )
    t.add_row("commits verified / mismatched", f"{s.commits_verified} / {s.commits_mismatched}")
    t.add_row("origin sent: deltas + bases", f"{s.origin_sent_delta_bytes:,} B + {s.origin_sent_base_bytes:,} B")
    t.add_row("trainer restarts / resumes", f"{s.trainer_restarts} / {s.trainer_resumes}")
    t.add_row("steps skipped / samples refused", f"{s.steps_skipped} / {s.samples_refused}")
    if s.prompt_groups_refilled:
        t.add_row("groups refilled (zero variance)", str(s.prompt_groups_refilled))
    if s.eval_version is not None:
        k = "" if s.eval_pass_at_k is None else f", pass@k {s.eval_pass_at_k:.3f}"
        t.add_row("held-out eval", f"v{s.eval_version}: pass@1 {s.eval_pass_at_1:.3f}{k}")
    if s.cost_dollars is not None:
        t.add_row("cost, tokens per dollar", f"${s.cost_dollars:,.4f}, {num(s.tokens_per_dollar, ',.0f')}")
    w = Table(
        "worker",
        "region",
        "committed",
        "behind",
        "verified",
        "last heard",
        "leases",
        "refused",
        "false",
        title="workers",
    )
    for x in s.workers:
        w.add_row(
            x.name + (" (stale)" if x.stale else ""),
            x.region or "-",
            num(x.committed_version, "d"),
            num(x.staleness, "d"),
            x.last_verification or "-",
            f"{x.seconds_since_seen:.1f} s ago",
            str(x.leases_held),
            str(x.refused_answers),
            str(x.refused_samples),
        )
    grid = Table.grid()
    grid.add_row(t)
    grid.add_row(w)
    return grid
