#!/usr/bin/env python3
"""Scheduling benchmark: how long a batch takes with workers of unequal speed and unequal links,
for each way of splitting it, beside the ideal, all in one run.

The same job runs three times, once per `rollout.split`: `even` (each worker an equal quota),
`pull` (every ask gets groupsPerLease, what SparrowRL did before the scheduler) and `balanced`
(the scheduler). Real processes over loopback: a trainer and four workers, real generation,
real GRPO steps, real delta transfers.

- Speed, 4:1: two workers are held to FAST tokens/s and two to FAST/4 by the worker's own
  throttle (`--pace-tokens-per-s`: after generating a lease it sleeps until tokens/pace
  seconds have passed). The tiny model generates faster than either pace on this machine
  (checked: a worker logs each lease it could not generate within its pace, and the JSON
  counts them), so the pace is the true speed.
- Links: one fast and one slow worker download through a token-bucket cap (`--rate-mbit`),
  the others do not.
- Staleness 0, so that a batch starts when its version is published and every worker must
  fetch it first: the link is on the critical path, and batches do not overlap.

A batch's time is from its version's publish to its last group's admission (the trainer's
`rollout_s`). The ideal splits each batch in proportion to true speed, each worker starting
once its fetch would be done at its link's rate: `schedule.finish_time` with the true rates.
The first two batches are left out (the scheduler probes new workers).

    python3 hack/bench_sched.py [--json docs/bench_sched.json] [--plot docs/bench_sched.png]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import in_venv  # noqa: E402 (hack/ is this script's folder, first on sys.path)

in_venv.enter()

import yaml  # noqa: E402

from sparrowrl.cli.runner import free_port  # noqa: E402
from sparrowrl.rollout import schedule  # noqa: E402
from sparrowrl.rollout.schedule import Seat  # noqa: E402

EXE = str(Path(sys.executable).parent / "sparrowrl")
TOKEN = "bench-sched"
SPLITS = ("even", "pull", "balanced")


def job(split: str, steps: int, groups: int) -> dict:
    return {
        "apiVersion": "sparrowrl.dev/v1alpha1",
        "kind": "SparrowRLJob",
        "metadata": {"name": f"sched-{split}"},
        "spec": {
            "steps": steps,
            "seed": 0,
            "model": {"tiny": {"hidden": 128, "layers": 2, "heads": 4}},
            "task": {"builtin": "add"},
            "grpo": {"learningRate": 1e-5, "groupSize": 4, "promptsPerStep": groups, "maxNewTokens": 8},
            "rollout": {"groupsPerLease": 4, "split": split, "leaseSeconds": 300},
            "sync": {"staleness": 0, "streams": 2},
            "topology": {"regions": [{"name": "local", "workers": 4, "relay": False}]},
        },
    }


def run(split: str, workers: list[dict], steps: int, groups: int, root: Path) -> dict:
    d = root / split
    d.mkdir()
    (d / "job.yaml").write_text(yaml.safe_dump(job(split, steps, groups)))
    env = dict(os.environ, SPARROWRL_TOKEN=TOKEN, PYTHONUNBUFFERED="1")
    port = free_port()
    procs = []

    def start(name: str, args: list[str]) -> None:
        log = open(d / f"{name}.log", "w")
        procs.append(
            subprocess.Popen([EXE, *args], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        )

    t0 = time.perf_counter()
    start("trainer", ["trainer", str(d / "job.yaml"), "--state-dir", str(d / "state"), "--port", str(port)])
    for w in workers:
        start(
            w["name"],
            [
                "worker",
                "--trainer",
                f"http://127.0.0.1:{port}",
                "--name",
                w["name"],
                "--port",
                str(free_port()),
                "--pace-tokens-per-s",
                str(w["pace"]),
                *(["--rate-mbit", str(w["mbit"])] if w["mbit"] else []),
            ],
        )
    try:
        while not (d / "state" / "summary.json").exists():
            if procs[0].poll() is not None:
                sys.exit(
                    f"{split}: the trainer exited; see {d / 'trainer.log'}:\n" + (d / "trainer.log").read_text()[-2000:]
                )
            time.sleep(0.5)
            rows = d / "state" / "metrics.jsonl"
            print(
                f"\r  {split}: {sum(1 for _ in open(rows)) if rows.exists() else 0}"
                f"/{steps} steps, {time.perf_counter() - t0:.0f} s",
                end="",
                flush=True,
            )
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            p.wait()
    print()
    rows = [json.loads(x) for x in (d / "state" / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((d / "state" / "summary.json").read_text())
    missed = sum((d / f"{w['name']}.log").read_text().count("pace missed") for w in workers)
    return {"rows": rows, "summary": summary, "pace_missed": missed}


def ideal(groups: int, tokens_per_group: float, payload: float, workers: list[dict]) -> float:
    seats = {w["name"]: Seat(payload * 8 / (w["mbit"] * 1e6) if w["mbit"] else 0.0, w["pace"]) for w in workers}
    return schedule.finish_time(groups, tokens_per_group, seats)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    names = [*SPLITS, "ideal"]
    values = [result["modes"][s]["batch_s"] for s in SPLITS] + [result["ideal_batch_s"]]
    bars = ax.bar(names, values, color=["#999", "#c77", "#4a7", "#47a"])
    for b, v in zip(bars, values):
        ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.2f} s", ha="center", va="bottom")
    ax.set_ylabel("batch time (s), mean of steady batches")
    c = result["config"]
    ax.set_title(
        f"{c['groups']} groups, workers at {c['fast']:g}/{c['fast']:g}/{c['fast'] / 4:g}/{c['fast'] / 4:g} "
        f"tokens/s, 2 links at {c['slow_link_mbit']:g} Mbit/s",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--groups", type=int, default=48, help="prompt groups per batch")
    ap.add_argument("--fast", type=float, default=120.0, help="tokens/s of a fast worker; slow ones get a quarter")
    ap.add_argument("--slow-link-mbit", type=float, default=0.5)
    ap.add_argument("--json", type=Path, default=Path("docs/bench_sched.json"))
    ap.add_argument("--plot", type=Path, default=Path("docs/bench_sched.png"))
    a = ap.parse_args()
    workers = [
        {"name": "fast-near", "pace": a.fast, "mbit": None},
        {"name": "fast-far", "pace": a.fast, "mbit": a.slow_link_mbit},
        {"name": "slow-near", "pace": a.fast / 4, "mbit": None},
        {"name": "slow-far", "pace": a.fast / 4, "mbit": a.slow_link_mbit},
    ]
    result = {
        "config": {
            "steps": a.steps,
            "groups": a.groups,
            "fast": a.fast,
            "slow_link_mbit": a.slow_link_mbit,
            "workers": workers,
            "staleness": 0,
            "groups_per_lease": 4,
            "skipped_batches": 2,
        },
        "modes": {},
    }
    ideals = []
    with tempfile.TemporaryDirectory(prefix="bench-sched-") as tmp:
        for split in SPLITS:
            r = run(split, workers, a.steps, a.groups, Path(tmp))
            rows = r["rows"][2:]
            batch = [x["rollout_s"] for x in rows]
            tpg = statistics.mean(x["tokens"] for x in rows) / a.groups
            payload = statistics.mean(x["payload_bytes"] for x in rows)
            ideals.append(ideal(a.groups, tpg, payload, workers))
            result["modes"][split] = {
                "batch_s": statistics.mean(batch),
                "batch_s_each": batch,
                "tokens_per_group": tpg,
                "payload_bytes": payload,
                "ideal_batch_s": ideals[-1],
                "commits_verified": r["summary"]["weights_verified"],
                "commits_mismatched": r["summary"]["weights_mismatch"],
                "prompt_groups_lost": r["summary"]["prompt_groups_lost"],
                "leases_over_pace": r["pace_missed"],
            }
    result["ideal_batch_s"] = statistics.mean(ideals)
    print(f"{'split':10} {'batch s':>9} {'vs ideal':>9} {'payload B':>10} {'verified':>9}")
    for split, m in result["modes"].items():
        m["vs_ideal"] = m["batch_s"] / m["ideal_batch_s"]
        print(
            f"{split:10} {m['batch_s']:9.2f} {m['vs_ideal']:9.2f}x {m['payload_bytes']:10.0f} "
            f"{m['commits_verified']:9d}"
        )
    print(f"{'ideal':10} {result['ideal_batch_s']:9.2f}")
    a.json.write_text(json.dumps(result, indent=1))
    plot(result, a.plot)
    print(f"wrote {a.json} and {a.plot}")


if __name__ == "__main__":
    main()
