"""What a run leaves behind for people: plots of metrics.jsonl, and the summary as a table."""

from __future__ import annotations

import json
import os
from pathlib import Path

from sparrowrl.cachedir import under_home

_CONFIG = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
under_home("MPLCONFIGDIR", "matplotlib", _CONFIG / "matplotlib")  # its font cache, before it loads

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from rich.table import Table  # noqa: E402

PHASES = ("generate_s", "train_s", "extract_s", "transfer_s", "wait_s")


def read_metrics(run_dir: Path) -> list[dict]:
    return read_rows(run_dir / "metrics.jsonl")


def read_rows(path: Path) -> list[dict]:
    """A JSONL file's rows; none if it is not there (eval.jsonl, without task.eval)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def plots(run_dir: Path, mode: str) -> list[Path]:
    rows = read_metrics(run_dir)
    if not rows:
        return []
    v = [r["version"] for r in rows]
    out = []

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(v, [r["reward_mean"] for r in rows], lw=1, alpha=0.5, label="reward (mean of the batch)")
    k = max(1, len(rows) // 10)
    smooth = [
        sum(r["reward_mean"] for r in rows[max(0, i - k + 1) : i + 1]) / len(rows[max(0, i - k + 1) : i + 1])
        for i in range(len(rows))
    ]
    ax.plot(v, smooth, lw=2, label=f"running mean of {k}")
    ax.set(xlabel="version", ylabel="reward", title="Reward per step")
    ax.legend()
    out.append(_save(fig, run_dir / "reward.png"))

    fig, ax = plt.subplots(figsize=(7, 3.5))
    bottom = [0.0] * len(rows)
    for phase in PHASES:
        vals = [r.get(phase) or 0.0 for r in rows]
        ax.bar(v, vals, bottom=bottom, label=phase.removesuffix("_s"), width=0.9)
        bottom = [b + x for b, x in zip(bottom, vals)]
    ax.set(xlabel="version", ylabel="seconds", title="Step time by phase (transfer overlaps generation)")
    if len(rows) > 2:  # the first step also waits for the workers to start: keep it from flattening the rest
        top = max(bottom[1:]) * 1.15
        if bottom[0] > top:
            ax.set_ylim(0, top)
            ax.annotate(
                f"first step: {bottom[0]:.1f} s (workers starting)",
                (v[0], top),
                xytext=(5, -12),
                textcoords="offset points",
                fontsize=8,
            )
    ax.legend(fontsize=8)
    out.append(_save(fig, run_dir / "step_time.png"))

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(v, [r["payload_bytes"] for r in rows], marker=".", label=f"shipped per worker ({mode})")
    ax.plot(v, [r["dense_bytes"] for r in rows], ls="--", label="dense bf16 weights")
    ax.set_yscale("log")
    ax.set(xlabel="version", ylabel="bytes", title="Payload per step")
    ax.legend()
    out.append(_save(fig, run_dir / "payload.png"))

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True)
    for key, label in (("mismatch_mean", "mean |log π_prox − log μ|"), ("mismatch_kl", "KL(μ ‖ π_prox)")):
        top.plot(v, [r.get(key) for r in rows], lw=1, label=label)
    top.set(ylabel="nats per token", title="What the workers sampled, against the trainer's policy")
    top.legend(fontsize=8)
    for key, label in (
        ("entropy", "entropy (nats)"),
        ("is_masked", "behaviour weight 0 (share)"),
        ("is_truncated", "behaviour weight truncated (share)"),
        ("zero_variance_groups", "zero-variance groups (share)"),
        ("truncated", "completions cut at maxNewTokens (share)"),
    ):
        bottom.plot(v, [r.get(key) for r in rows], lw=1, label=label)
    bottom.set(xlabel="version", title="The objective, per step")
    bottom.legend(fontsize=8)
    out.append(_save(fig, run_dir / "objective.png"))

    evals = read_rows(run_dir / "eval.jsonl")
    if evals:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        ev = [r["version"] for r in evals]
        ax.plot(ev, [r["pass_at_1"] for r in evals], marker="o", label="pass@1")
        if "pass_at_k" in evals[-1]:
            # a row without pass@k is a gap: matplotlib draws None so, where its stubs take numbers only
            ax.plot(ev, [r.get("pass_at_k") for r in evals], marker="s", label=f"pass@{evals[-1]['samples']}")  # type: ignore[arg-type]
        ax.set(
            xlabel="version",
            ylabel="held-out",
            ylim=(0, 1.02),
            title=f"Held-out eval: {evals[-1]['prompts']} prompts, {evals[-1]['decoding']}",
        )
        ax.legend()
        out.append(_save(fig, run_dir / "eval.png"))

    if any("episode_ends" in r for r in rows):
        out.append(_episodes(rows, run_dir / "episodes.png"))
    return out


def _episodes(rows: list[dict], path: Path) -> Path:
    """task.environment's episodes per step: how they ended (stacked), and their turns and tool calls."""
    rows = [r for r in rows if "episode_ends" in r]
    v = [r["version"] for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True)
    base = [0] * len(rows)
    for end in ("done", "max_turns", "max_tokens", "length", "timeout", "error"):
        n = [r["episode_ends"].get(end, 0) for r in rows]
        if any(n):
            top.bar(v, n, bottom=base, label=end, width=0.9)
            base = [b + x for b, x in zip(base, n)]
    top.set(ylabel="episodes", title="Episodes per step, by how they ended")
    top.legend(fontsize=8)
    bottom.plot(v, [r["episode_turns_mean"] for r in rows], lw=1, label="model turns per episode (mean)")
    calls = [r["episode_tool_calls"] / max(sum(r["episode_ends"].values()), 1) for r in rows]
    if any(calls):
        bottom.plot(v, calls, lw=1, label="tool calls per episode")
        errors = [r["episode_tool_errors"] / max(sum(r["episode_ends"].values()), 1) for r in rows]
        bottom.plot(v, errors, lw=1, label="tool errors per episode")
    bottom.set(xlabel="version", title="Turns and tool calls")
    bottom.legend(fontsize=8)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def summary_table(s: dict) -> Table:
    t = Table(title="SparrowRL run", show_header=False)
    t.add_column(style="bold")
    t.add_column(justify="right")
    t.add_row("steps", str(s["steps"]))
    t.add_row("reward first → last tenth", f"{s['reward_first']:.3f} → {s['reward_last']:.3f}")
    t.add_row("weights verified / mismatched", f"{s['weights_verified']} / {s['weights_mismatch']}")
    t.add_row(
        f"payload ({s['mode']}) / dense",
        f"{_mb(s['payload_bytes_total'])} / {_mb(s['dense_bytes_total'])} "
        f"({s['payload_bytes_total'] / max(1, s['dense_bytes_total']):.1%})",
    )
    t.add_row(
        "origin sent: deltas + bases", f"{_mb(s['origin_sent_delta_bytes'])} + {_mb(s['origin_sent_base_bytes'])}"
    )
    t.add_row(
        "prompt groups admitted / lost / discarded late",
        f"{s['prompt_groups_admitted']} / {s['prompt_groups_lost']} / {s['prompt_groups_discarded_late']}",
    )
    t.add_row("leases expired / groups requeued", f"{s['leases_expired']} / {s['prompt_groups_requeued']}")
    t.add_row("trainer restarts", str(s["trainer_restarts"]))
    t.add_row("tokens per second", f"{s['tokens_per_second']:.0f}")
    if "cost_dollars" in s:  # the spec gave prices (costPerHour)
        per = s["tokens_per_dollar"]
        t.add_row("cost, tokens per dollar", f"${s['cost_dollars']:,.4f}, {'-' if per is None else f'{per:,.0f}'}")
    t.add_row("training time", f"{s['seconds']:.0f} s")
    return t


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"
