#!/usr/bin/env python3
"""The figures of docs/benchmarks.md, from the JSON that hack/bench_e2e.py and hack/project.py
write (no run of their own):

    e2e_throughput.png  tokens/s per mode         e2e_phases.png    step time by phase
    e2e_payload.png     bytes shipped per step    e2e_ablations.png one mechanism off at a time
    e2e_reward.png      reward of full and sparse projection.png    real models, real links

    python3 hack/plot_e2e.py [--e2e docs/bench_e2e.json] [--projection docs/bench_projection.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import in_venv  # noqa: E402 (hack/ is this script's folder, first on sys.path)

in_venv.enter()

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DOCS = Path(__file__).resolve().parent.parent / "docs"
COLORS = {"full": "#c77", "sparse": "#4a7", "ideal": "#47a"}


def _bars(ax, names, values, colors, fmt):
    bars = ax.bar(names, values, color=colors)
    for b, v in zip(bars, values):
        ax.text(b.get_x() + b.get_width() / 2, v, fmt(v), ha="center", va="bottom", fontsize=9)


def throughput(e2e: dict, out: Path) -> None:
    m = e2e["modes"]
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    _bars(
        ax, list(m), [x["tokens_per_s"] for x in m.values()], [COLORS.get(k, "#999") for k in m], lambda v: f"{v:.0f}"
    )
    for i, (k, x) in enumerate(m.items()):
        if k != "full" and "speedup_over_full" in x:
            ax.text(
                i, x["tokens_per_s"] / 2, f"{x['speedup_over_full']:.2f}x full", ha="center", color="white", fontsize=9
            )
    ax.set_ylabel("training throughput (tokens/s)")
    ax.set_title("the same RL job on the same emulated WAN", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "e2e_throughput.png", dpi=120)


def phases(e2e: dict, out: Path) -> None:
    m = e2e["modes"]
    keys = ["wait", "train", "extract", "transfer"]
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    width = 0.8 / len(keys)
    for j, k in enumerate(keys):
        ax.bar([i + j * width for i in range(len(m))], [x["phases_s"][k] for x in m.values()], width, label=k)
    ax.plot(
        [i + 0.4 - width / 2 for i in range(len(m))],
        [x["step_s"] for x in m.values()],
        "k_",
        markersize=40,
        label="step",
    )
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(m))], list(m))
    ax.set_ylabel("seconds per step (mean)")
    ax.set_title("trainer: wait for the batch, train, extract; workers: transfer (overlapped)", fontsize=9)
    ax.set_ylim(top=1.3 * max(x["step_s"] for x in m.values()))
    ax.legend(fontsize=8, ncol=5, loc="upper center")
    fig.tight_layout()
    fig.savefig(out / "e2e_phases.png", dpi=120)


def payload(e2e: dict, out: Path) -> None:
    m = e2e["modes"]
    fig, ax = plt.subplots(figsize=(5, 3.4))
    _bars(
        ax,
        list(m),
        [x["payload_bytes"] for x in m.values()],
        [COLORS.get(k, "#999") for k in m],
        lambda v: f"{v / 1e3:,.0f} kB",
    )
    ax.set_yscale("log")
    ax.set_ylabel("bytes shipped per step")
    fig.tight_layout()
    fig.savefig(out / "e2e_payload.png", dpi=120)


def ablations(e2e: dict, out: Path) -> None:
    a = {"sparse (all on)": e2e["modes"]["sparse"], **e2e["ablations"]}
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    _bars(
        ax, list(a), [x["tokens_per_s"] for x in a.values()], ["#4a7"] + ["#999"] * (len(a) - 1), lambda v: f"{v:.0f}"
    )
    ax.set_ylabel("tokens/s")
    ax.set_title("one mechanism off at a time", fontsize=10)
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "e2e_ablations.png", dpi=120)


def reward(e2e: dict, out: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 3.4))
    for k, x in e2e["modes"].items():
        ax.plot(range(1, len(x["reward"]) + 1), x["reward"], label=k, color=COLORS.get(k))
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "e2e_reward.png", dpi=120)


def projection(proj: dict, out: Path) -> None:
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    by_model: dict[str, list] = {}
    for p in proj["projection"].values():
        by_model.setdefault(p["model"], []).append(p)
    for model, ps in by_model.items():
        ax.plot([p["link_gbit"] for p in ps], [p["speedup"] for p in ps], "o-", label=model)
    ax.axhspan(2.4, 9.5, color="#ddd", label="published: 2.4-9.5x")
    ax.set_xscale("log")
    ax.set_xlabel("WAN link (Gbit/s)")
    ax.set_ylabel("sparse over full (tokens/s)")
    ax.set_title(
        "projected (hack/project.py); the models coincide: their times are assumed\n"
        "proportional to their size, and their densities are alike",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "projection.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--e2e", type=Path, default=DOCS / "bench_e2e.json")
    ap.add_argument("--projection", type=Path, default=DOCS / "bench_projection.json")
    ap.add_argument("--out", type=Path, default=DOCS)
    a = ap.parse_args()
    e2e = json.loads(a.e2e.read_text())
    throughput(e2e, a.out)
    phases(e2e, a.out)
    payload(e2e, a.out)
    reward(e2e, a.out)
    if e2e.get("ablations"):
        ablations(e2e, a.out)
    if a.projection.exists():
        projection(json.loads(a.projection.read_text()), a.out)
    print(f"wrote figures to {a.out}")


if __name__ == "__main__":
    main()
