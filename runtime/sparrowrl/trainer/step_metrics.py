"""A GRPO step's metrics beyond its loss, from the statistics of its passes: importance weights and
log-prob gaps over the step, and by the age of the version that sampled and by worker, which is
where a stale or misbehaving worker shows."""

from __future__ import annotations

import math

from sparrowrl.rollout.coordinator import Batch
from sparrowrl.trainer import grpo


def finite(x: float) -> float | None:
    """A metric as JSON can carry it: None for a non-finite one."""
    return x if math.isfinite(x) else None


def by_sample(rows: list[tuple[int, tuple]], world: int, n: int) -> dict[tuple[int, int], tuple]:
    """Every rank's row stats by (group, sample): rank k's rows are the batch's groups k,
    k + world, ..., their `n` samples each in order."""
    per_rank = [[x for rank, x in rows if rank == k] for k in range(world)]
    return {(k + world * (m // n), m % n): x for k, part in enumerate(per_rank) for m, x in enumerate(part)}


def diagnostics(st: grpo.Stats) -> dict[str, float]:
    """The step's means over its completion tokens (and every update of it)."""
    s, h = st.sums, st.highs
    n = max(s.get("tokens", 0.0), 1.0)
    out: dict[str, float] = {k: s[k] / n for k in ("entropy", "clip_low", "clip_high", "clip_dual", "kl") if k in s}
    if "tokens" not in s:
        return out
    return {
        **out,
        "is_weight_mean": s["weight"] / n,
        "is_weight_min": -h.get("weight_neg", -1.0),
        "is_weight_max": h.get("weight", 1.0),
        "is_masked": s["masked"] / n,
        "is_truncated": s.get("truncated", 0.0) / n,
        "is_ess": s["weight_applied"] ** 2 / (n * s["weight_applied_sq"]) if s["weight_applied_sq"] else 0.0,
        "mismatch_mean": s["gap"] / n,
        "mismatch_max": h.get("gap", 0.0),
        "mismatch_kl": s["mismatch_kl"] / n,
    }


def behaviour(
    batch: Batch,
    seen: dict[tuple[int, int], tuple],
    claims: set[tuple[int, int]],
    unread: frozenset[tuple[int, int]] | set[tuple[int, int]] = frozenset(),
) -> dict:
    """The samples' gaps between the worker's log-probs and the trainer's, by the age of the
    version that sampled them and by worker; and the refused samples, by worker and reason
    (`claims`: those whose worker said they ended otherwise than their tokens show; `unread`:
    episodes whose tokens are not their turns)."""
    by_age: dict[str, dict] = {}
    by_worker: dict[str, dict] = {}
    refused: dict[str, dict[str, int]] = {}
    for i, group in enumerate(batch.groups):
        res = batch.results[group]
        worker = res.get("worker", "unknown")  # results journaled before workers were kept have none
        for j in range(len(res["samples"])):
            gapped = (i, j) in seen and seen[i, j][3]
            reasons = (("logprob_gap", gapped), ("finish_claim", (i, j) in claims), ("episode_turns", (i, j) in unread))
            why = [w for w, yes in reasons if yes]
            for w in why:
                refused.setdefault(worker, {}).setdefault(w, 0)
                refused[worker][w] += 1
            if (i, j) not in seen:  # a step with nothing to train makes no pass
                continue
            t, gap, top, _ = seen[i, j]
            for key, into in ((str(batch.index - res["version"]), by_age), (worker, by_worker)):
                d = into.setdefault(key, {"samples": 0, "tokens": 0, "gap": 0.0, "mismatch_max": 0.0, "refused": 0})
                d["samples"] += 1
                d["tokens"] += t
                d["gap"] += gap
                d["mismatch_max"] = max(d["mismatch_max"], top)
                d["refused"] += bool(why)
    for d in (*by_age.values(), *by_worker.values()):
        d["mismatch_mean"] = d.pop("gap") / max(d["tokens"], 1)
    return {"by_age": by_age, "by_worker": by_worker, "refused_samples": refused}


def episodes(samples: list[list[dict]], unread: set[tuple[int, int]], trusted: bool) -> dict:
    """A step's episodes (task.environment): model turns, tool calls and errors, seconds, and how
    they ended, as their workers say; how many did not read as their turns (refused); and whose
    rewards these are."""
    eps = [s["episode"] for group in samples for s in group]
    turns = [len(e["turns"]) + 1 for e in eps]
    seconds = [e["seconds"] for e in eps]
    ends: dict[str, int] = {}
    for e in eps:
        ends[e["end"]] = ends.get(e["end"], 0) + 1
    return {
        "episode_turns_mean": sum(turns) / len(turns),
        "episode_turns_max": max(turns),
        "episode_seconds_mean": sum(seconds) / len(seconds),
        "episode_seconds_max": max(seconds),
        "episode_tool_calls": sum(e.get("tool_calls", 0) for e in eps),
        "episode_tool_errors": sum(e.get("tool_errors", 0) for e in eps),
        "episode_ends": ends,
        "episode_unread": len(unread),
        "reward_from_workers": trusted,  # trustWorkerRewards: the rewards are the workers' own, unchecked
    }
