"""What the trainer reports of the job, as pure functions of a `Snapshot` (the ledger's rows and
totals, and the coordinator's `View`): the step line a user watches, the job's status
(TrainerStatus, at /v1/status), Prometheus metrics (/metrics) and the summary (summary.json), with
the job's cost where the spec gives prices (cost.py)."""

from __future__ import annotations

from dataclasses import dataclass

from sparrowrl.rollout.facts import View
from sparrowrl.spec.status import TrainerStatus, WorkerStatus
from sparrowrl.trainer import cost, retention
from sparrowrl.trainer.learner import SKIPPED
from sparrowrl.trainer.rewards import FAILURES
from sparrowrl.transport.metrics import family

PHASES = ("generate", "train", "extract", "transfer", "wait")


def reward_failed(rows: list[dict]) -> dict[str, int]:
    """Samples whose reward call failed, by kind (rewards.FAILURES), over the rows."""
    total = dict.fromkeys(FAILURES, 0)
    for r in rows:
        for kind, n in r.get("reward_failed", {}).items():  # rows written before rewards were counted have none
            total[kind] = total.get(kind, 0) + n
    return total


def episode_ends(rows: list[dict]) -> dict[str, int]:
    """Episodes (task.environment) by how they ended, over the rows."""
    total: dict[str, int] = {}
    for r in rows:
        for end, n in r.get("episode_ends", {}).items():
            total[end] = total.get(end, 0) + n
    return total


def refused_samples(rows: list[dict]) -> dict[tuple[str, str], int]:
    """Samples not trained because their worker's log-probs were false, by (worker, reason)."""
    total: dict[tuple[str, str], int] = {}
    for r in rows:
        for worker, reasons in (r.get("refused_samples") or {}).items():
            for why, n in reasons.items():
                total[worker, why] = total.get((worker, why), 0) + n
    return total


def skipped_steps(rows: list[dict]) -> dict[str, int]:
    """Steps that changed no weight, by why (learner.SKIPPED)."""
    total = dict.fromkeys(SKIPPED, 0)
    for r in rows:
        if r.get("skipped"):
            total[r["skipped"]] = total.get(r["skipped"], 0) + 1
    return total


CLIPS = ("low", "high", "dual")


@dataclass(frozen=True)
class Snapshot:
    """What the reports are made of, at one moment."""

    job: View
    steps: int  # the job's
    rows: list[dict]  # one per published version, in order
    seconds: float  # the training loop's, over every trainer process
    sent: dict[str, int]  # bytes the origin sent, by kind
    restarts: int  # unplanned: trainer processes started again after one died
    redone: int  # steps trained again after restarts
    finished: bool
    store: retention.Held | None = None  # what the trainer's store holds
    dollars: float | None = None  # what the job has cost so far; None: the spec gives no prices
    resumes: int = 0  # planned: trainer processes started to go on from a finished job, or with more steps
    evals: tuple[dict, ...] = ()  # task.eval's rows, by version


def step_line(row: dict, steps: int) -> str:
    """The trainer's log line for a published version: what a user watches a job by."""
    kl = f" kl {row['kl']:.4f}" if "kl" in row else ""
    lr = f" lr {row['lr']:.3g}" if "lr" in row else ""
    failed = sum((row.get("reward_failed") or {}).values())
    refused = sum(n for reasons in (row.get("refused_samples") or {}).values() for n in reasons.values())
    loss = "-" if row["loss"] is None else f"{row['loss']:.4f}"
    return (
        f"trainer: step {row['version']}/{steps} reward {row['reward_mean']:.3f} loss {loss}{kl}{lr} "
        f"len {row['completion_tokens_mean']:.1f} {row['tokens'] / max(row['step_s'], 1e-9):,.0f} tok/s "
        f"payload {row['payload_bytes']:,} B ({row['changed_fraction']:.2%} changed) {row['step_s']:.2f} s"
        + (f" rewards failed {failed}" if failed else "")
        + (f" samples refused {refused}" if refused else "")
        + (f" groups refilled {row['refill_groups']}" if row.get("refill_groups") else "")
        + (f" SKIPPED ({row['skipped']}): no weight changed" if row.get("skipped") else "")
    )


# ---- /v1/status, /metrics, summary.json: pure functions of a snapshot ----
def tokens_per_dollar(s: Snapshot) -> float | None:
    return None if s.dollars is None else cost.tokens_per_dollar(sum(r["tokens"] for r in s.rows), s.dollars)


def status(s: Snapshot) -> TrainerStatus:
    rows, job, c = s.rows, s.job, s.job.counts
    refused: dict[str, int] = {}
    for (worker, _), n in refused_samples(rows).items():
        refused[worker] = refused.get(worker, 0) + n
    workers = [
        WorkerStatus(
            name=w.name,
            region=w.region,
            committed_version=None if w.committed is None else w.committed[0],
            staleness=None if w.committed is None else max(0, job.published - w.committed[0]),
            last_verification=None if w.verified is None else "ok" if w.verified else "mismatch",
            seconds_since_seen=w.seconds_since_seen,
            leases_held=w.leases,
            stale=not w.live,
            refused_answers=w.refused,
            refused_samples=refused.get(w.name, 0),
        )
        for w in job.workers
    ]
    return TrainerStatus(
        phase="Succeeded" if s.finished else "Running" if job.started else "Pending",
        step=len(rows),
        steps=s.steps,
        version=job.published,
        reward_last=rows[-1]["reward_mean"] if rows else None,
        reward_mean_10=sum(r["reward_mean"] for r in rows[-10:]) / len(rows[-10:]) if rows else None,
        tokens_per_second=sum(r["tokens"] for r in rows) / s.seconds if rows and s.seconds else None,
        last_payload_bytes=rows[-1]["payload_bytes"] if rows else None,
        last_changed_fraction=rows[-1]["changed_fraction"] if rows else None,
        leases_active=job.leases_active,
        leases_expired=c.leases_expired,
        prompt_groups_admitted=c.admitted,
        prompt_groups_requeued=c.requeued,
        prompt_groups_lost=job.lost,
        prompt_groups_discarded_late=c.discarded_late,
        prompt_groups_refilled=c.refilled,
        commits_verified=c.verified,
        commits_mismatched=c.mismatched,
        origin_sent_delta_bytes=s.sent["delta"],
        origin_sent_base_bytes=s.sent["base"],
        trainer_restarts=s.restarts,
        trainer_resumes=s.resumes,
        eval_version=s.evals[-1]["version"] if s.evals else None,
        eval_pass_at_1=s.evals[-1]["pass_at_1"] if s.evals else None,
        eval_pass_at_k=s.evals[-1].get("pass_at_k") if s.evals else None,
        steps_skipped=sum(skipped_steps(rows).values()),
        samples_refused=sum(refused.values()),
        cost_dollars=s.dollars,
        tokens_per_dollar=tokens_per_dollar(s),
        workers=workers,
        stale_workers=[w.name for w in workers if w.stale],
    )


def metrics(snap: Snapshot) -> list:
    """/metrics: the status's counts, and the last step's phases."""
    s, c = status(snap), snap.job.counts
    last = snap.rows[-1] if snap.rows else {}
    return [
        family("counter", "versions_published", "Policy versions published", s.version),
        family("counter", "steps", "Optimizer steps taken", s.step),
        family("counter", "tokens", "Completion tokens trained on", sum(r["tokens"] for r in snap.rows)),
        family("gauge", "leases_active", "Leases out now", s.leases_active),
        family("counter", "leases_expired", "Leases whose deadline passed before their results", s.leases_expired),
        family(
            "counter",
            "prompt_groups",
            "Prompt groups by what became of them",
            by=(
                "state",
                {
                    "admitted": c.admitted,
                    "refused": c.refused,
                    "requeued": c.requeued,
                    "discarded_late": c.discarded_late,
                    "refilled": c.refilled,
                    "lost": s.prompt_groups_lost,
                },
            ),
        ),
        family(
            "counter",
            "commit_verifications",
            "Worker commits, by whether their state hash was the trainer's",
            by=("result", {"ok": c.verified, "mismatch": c.mismatched}),
        ),
        family(
            "counter",
            "sent_bytes",
            "Bytes the origin sent, by kind",
            by=("kind", {"delta": s.origin_sent_delta_bytes, "base": s.origin_sent_base_bytes}),
        ),
        family(
            "counter",
            "trainer_restarts",
            "Trainer processes started again after one died, on its state dir (not planned resumes)",
            s.trainer_restarts,
        ),
        family(
            "counter",
            "trainer_resumes",
            "Trainer processes started on purpose to go on from its state dir (sparrowrl run --resume, raised steps)",
            s.trainer_resumes,
        ),
        family("counter", "steps_redone", "Steps trained again after a restart, from their checkpoint", snap.redone),
        family(
            "gauge",
            "step_seconds",
            "The last step's time, by phase",
            by=("phase", {p: last[f"{p}_s"] for p in PHASES if last.get(f"{p}_s") is not None}),
        ),
        family("gauge", "reward", "The last step's mean reward", last.get("reward_mean")),
        family("gauge", "loss", "The last step's policy loss", last.get("loss")),
        family("gauge", "kl", "The last step's KL to the reference (with grpo.klCoef > 0)", last.get("kl")),
        family("gauge", "learning_rate", "The last step's learning rate", last.get("lr")),
        # the objective's diagnostics (docs/rl.md, "What a step shows")
        family("gauge", "entropy", "The last step's mean entropy over completion tokens", last.get("entropy")),
        family(
            "gauge",
            "is_weight_mean",
            "The last step's mean behaviour weight pi_prox/mu, before truncation or masking",
            last.get("is_weight_mean"),
        ),
        family("gauge", "is_weight_min", "The last step's least behaviour weight", last.get("is_weight_min")),
        family(
            "gauge",
            "is_weight_max",
            "The last step's greatest behaviour weight (its log clamped to 20)",
            last.get("is_weight_max"),
        ),
        family(
            "gauge",
            "is_masked",
            "Share of the last step's tokens of behaviour weight 0 (masked, or their sample refused)",
            last.get("is_masked"),
        ),
        family(
            "gauge",
            "is_truncated",
            "Share of the last step's tokens whose weight was truncated",
            last.get("is_truncated"),
        ),
        family(
            "gauge",
            "is_ess",
            "Effective sample size of the last step's applied behaviour weights, over tokens (1: all equal)",
            last.get("is_ess"),
        ),
        family(
            "gauge",
            "mismatch",
            "The last step's |log pi_prox - log mu| per token (the worker's log-probs against the trainer's): mean "
            "and max",
            by=("stat", {k: last[f"mismatch_{k}"] for k in ("mean", "max") if last.get(f"mismatch_{k}") is not None}),
        ),
        family("gauge", "mismatch_kl", "The last step's KL(mu || pi_prox) per token (k3)", last.get("mismatch_kl")),
        family(
            "gauge",
            "zero_variance_groups",
            "Share of the last step's groups whose samples all scored alike",
            last.get("zero_variance_groups"),
        ),
        family(
            "gauge",
            "eval_pass_at_1",
            "The last eval's pass@1 on task.eval's held-out prompts (the share of samples that score 1)",
            s.eval_pass_at_1,
        ),
        family(
            "gauge",
            "eval_pass_at_k",
            "The last eval's pass@k, k = task.eval.samples (with more than one sample per prompt)",
            s.eval_pass_at_k,
        ),
        family("gauge", "eval_version", "The version the last eval was of", s.eval_version),
        family(
            "gauge",
            "truncated",
            "Share of the last step's completions cut at maxNewTokens (read from their tokens)",
            last.get("truncated"),
        ),
        family(
            "gauge",
            "completion_length",
            "The last step's completion lengths in tokens: min, mean and max",
            by=(
                "stat",
                {
                    k: last[f]
                    for k, f in (
                        ("min", "completion_len_min"),
                        ("mean", "completion_tokens_mean"),
                        ("max", "completion_len_max"),
                    )
                    if last.get(f) is not None
                },
            ),
        ),
        family(
            "gauge",
            "clip_fraction",
            "Share of the last step's tokens whose PPO ratio was clipped, by bound",
            by=("bound", {b: last[f"clip_{b}"] for b in CLIPS if last.get(f"clip_{b}") is not None}),
        ),
        family(
            "gauge",
            "mismatch_by_age",
            "The last step's mean |log pi_prox - log mu| per token, by the age of the sampling version",
            by=("age", {a: d["mismatch_mean"] for a, d in (last.get("by_age") or {}).items()}),
        ),
        family(
            "gauge",
            "worker_mismatch",
            "The last step's mean |log pi_prox - log mu| per token of a worker's samples",
            by=("worker", {w: d["mismatch_mean"] for w, d in (last.get("by_worker") or {}).items()}),
        ),
        family(
            "counter",
            "worker_refused_samples",
            "Samples not trained: their worker's log-probs were further from the trainer's than grpo.behaviour."
            "refuseGap, by worker and reason",
            by=(("worker", "reason"), refused_samples(snap.rows)),
        ),
        family(
            "counter",
            "steps_skipped",
            "Steps that changed no weight, by reason (nothing_to_train, all_refused, nonfinite)",
            by=("reason", skipped_steps(snap.rows)),
        ),
        family(
            "gauge", "completion_tokens", "The last step's mean completion length", last.get("completion_tokens_mean")
        ),
        family(
            "counter",
            "reward_failures",
            "Samples scored 0.0 because their reward call failed, by kind",
            by=("kind", reward_failed(snap.rows)),
        ),
        family(
            "counter",
            "episodes",
            "Episodes of an environment (task.environment) by how they ended: done, max_turns, max_tokens, length, "
            "timeout, error",
            by=("end", episode_ends(snap.rows)),
        ),
        family(
            "counter", "tool_calls", "Tool calls of episodes", sum(r.get("episode_tool_calls", 0) for r in snap.rows)
        ),
        family(
            "counter",
            "tool_errors",
            "Tool calls that answered with an error (the model's mistake, or the tool's)",
            sum(r.get("episode_tool_errors", 0) for r in snap.rows),
        ),
        family(
            "gauge", "episode_turns", "The last step's mean model turns per episode", last.get("episode_turns_mean")
        ),
        family("gauge", "changed_fraction", "Share of elements the last step changed", s.last_changed_fraction),
        family("gauge", "payload_bytes", "Bytes the last step shipped", s.last_payload_bytes),
        family(
            "gauge",
            "worker_staleness",
            "Versions a worker's committed weights lag the newest",
            by=("worker", {w.name: w.staleness for w in s.workers if w.staleness is not None}),
        ),
        family(
            "gauge", "worker_leases", "Leases a worker holds", by=("worker", {w.name: w.leases_held for w in s.workers})
        ),
        family(
            "counter",
            "worker_refused_answers",
            "Answers a worker's relay (or the origin) gave it that did not verify, as the worker reports them",
            by=("worker", {w.name: w.refused_answers for w in s.workers}),
        ),
        *(
            [
                family("counter", "cost_dollars", "What the job has cost, from the spec's costPerHour", snap.dollars),
                family("gauge", "tokens_per_dollar", "Completion tokens trained on per dollar", s.tokens_per_dollar),
            ]
            if snap.dollars is not None
            else []
        ),
        *(
            [
                family(
                    "counter",
                    "store_pruned_versions",
                    "Versions the trainer's store has pruned: no live worker, restart or export could need them",
                    snap.store.pruned,
                ),
                family("gauge", "store_versions", "Versions the trainer's store holds", snap.store.versions),
                family(
                    "gauge", "store_bytes", "Bytes of the bases and deltas the trainer's store holds", snap.store.bytes
                ),
            ]
            if snap.store is not None
            else []
        ),
    ]


def summary(s: Snapshot) -> dict:
    """summary.json: the job's figures, from metrics.jsonl's rows."""
    rows, c = s.rows, s.job.counts
    tenth = max(1, len(rows) // 10)
    return {
        "steps": len(rows),
        "reward_first": sum(r["reward_mean"] for r in rows[:tenth]) / tenth,
        "reward_last": sum(r["reward_mean"] for r in rows[-tenth:]) / tenth,
        "weights_verified": c.verified,
        "weights_mismatch": c.mismatched,
        "payload_bytes_total": sum(r["payload_bytes"] for r in rows),
        "dense_bytes_total": sum(r["dense_bytes"] for r in rows),
        "origin_sent_delta_bytes": s.sent["delta"],
        "origin_sent_base_bytes": s.sent["base"],
        "prompt_groups_admitted": c.admitted,
        "prompt_groups_lost": s.job.lost,
        "prompt_groups_discarded_late": c.discarded_late,
        "prompt_groups_requeued": c.requeued,
        "prompt_groups_refilled": c.refilled,
        "leases_expired": c.leases_expired,
        "trainer_restarts": s.restarts,
        "trainer_resumes": s.resumes,
        "steps_redone": s.redone,
        "reward_failed": reward_failed(rows),
        "steps_skipped": skipped_steps(rows),
        **({"eval_first": s.evals[0], "eval_last": s.evals[-1]} if s.evals else {}),
        "samples_refused": {f"{w}/{why}": n for (w, why), n in sorted(refused_samples(rows).items())},
        "tokens_per_second": sum(r["tokens"] for r in rows) / s.seconds,
        "seconds": s.seconds,
        "final_version": s.job.published,
        "final_state_hash": s.job.state_hash,
        **({"store_versions_pruned": s.store.pruned, "store_bytes": s.store.bytes} if s.store is not None else {}),
        **({"cost_dollars": s.dollars, "tokens_per_dollar": tokens_per_dollar(s)} if s.dollars is not None else {}),
    }
