#!/usr/bin/env python3
"""Refill bench: what `grpo.zeroVarianceGroups` (skip, train, refill: DAPO's dynamic sampling)
does to learning on the demo job, per step and per group generated (figures in
docs/benchmarks.md).

The trainer is the real one (`Learner.train`, `Learner.score`) and so is the bookkeeping: the
trainer's `Coordinator` leases each batch's groups, admits them, takes the trainer's scores and
adds the refill groups. Only the rollout is this script's, bench_offpolicy's: batch b sampled
with version b − k (the demo's staleness 1, forced), log-probs exact. Each run is scored on
held-out prompts with the run's reward: sampled and greedy pass@1 (bench_offpolicy.evaluate).
Two rewards: the demo's `char_match` (partial credit) and `exact` (all or nothing, as a math
verifier is: DAPO's setting, where whole groups score alike).

    python3 hack/bench_refill.py [--steps 200 --seeds 3 --modes skip,train,refill
        --rewards char_match,exact --jobs 2] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import in_venv  # noqa: E402 (hack/ is this script's folder, first on sys.path)

in_venv.enter()

import torch  # noqa: E402
import yaml  # noqa: E402
from bench_offpolicy import evaluate, generate, snapshot, warm  # noqa: E402

from sparrowrl.rollout.coordinator import Coordinator  # noqa: E402
from sparrowrl.spec.job import JobSpec, parse  # noqa: E402
from sparrowrl.trainer.learner import Learner  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WORKER = "bench"


def job_spec(job: dict, reward: str, mode: str, gen_batches: int, seed: int, steps: int) -> JobSpec:
    d = copy.deepcopy(job)
    d["spec"].update(seed=seed, steps=steps)
    d["spec"]["task"]["reward"] = reward
    d["spec"]["grpo"].update(zeroVarianceGroups=mode, maxGenBatches=gen_batches)
    d["spec"]["model"]["tiny"]["warmupSteps"] = 0  # the seed's warmed model is loaded
    return parse(d).spec


def run(job: dict, state: dict, cell: dict, a: argparse.Namespace, eval_at: list[int]) -> dict:
    """One run: `a.steps` steps at forced staleness `a.staleness`, the coordinator deciding what
    each batch holds; evaluated at `eval_at`."""
    torch.set_num_threads(1)
    t0, k = time.perf_counter(), a.staleness
    with tempfile.TemporaryDirectory() as tmp:
        spec = job_spec(job, cell["reward"], cell["mode"], a.gen_batches, cell["seed"], a.steps)
        learner = Learner(spec, Path(tmp))
        try:
            learner.model.load_state_dict(state)
            g, n = spec.grpo, spec.grpo.group_size
            per_lease = g.prompts_per_step * g.max_gen_batches  # a batch's every group in one lease
            coord = Coordinator(g.prompts_per_step, per_lease, 1e9, k, a.steps, "pull", refill=g.refill_groups)
            gen = torch.Generator().manual_seed(cell["seed"])  # the same draws for every mode of a seed
            versions = {0: snapshot(learner.model, "exact")}
            coord.publish(0, "v0")
            evals, rows, generated = [{"step": 0, "groups": 0, **evaluate(learner, *a.ev)}], [], 0
            for b in range(a.steps):
                v = max(b - k, 0)
                while (batch := coord.take(b)) is None:
                    ans = coord.work(WORKER, v)
                    if "lease" in ans:
                        groups = ans["lease"]["groups"]
                        prompts = [learner.prompt_ids(x) for x in groups for _ in range(n)]
                        done = generate(versions[v], prompts, g.max_new_tokens, learner.tok.eos_token_id,
                                        g.temperature, gen)  # fmt: skip
                        results = {
                            x: {"samples": [{"tokens": t, "logprobs": lp} for t, lp in done[i * n : (i + 1) * n]]}
                            for i, x in enumerate(groups)
                        }
                        assert coord.submit(ans["lease"]["id"], WORKER, v, f"v{v}", results)["admitted"]
                        generated += len(groups)
                    for bb, groups in coord.unscored():  # the trainer scores as groups are admitted
                        coord.scored(bb, learner.score(coord.results(bb, groups)))
                rows.append(learner.train(batch))
                versions[b + 1] = snapshot(learner.model, "exact")
                versions.pop(b + 1 - k - 1, None)
                coord.publish(b + 1, f"v{b + 1}")
                if b + 1 in eval_at:
                    evals.append({"step": b + 1, "groups": generated, **evaluate(learner, *a.ev)})
        finally:
            learner.stop()
    return {
        **cell,
        "evals": evals,
        "groups_generated": generated,
        "zero_variance_groups": [round(r["zero_variance_groups"], 4) for r in rows],
        "groups_varied": [r["groups_varied"] for r in rows],
        "refill_groups": [r["refill_groups"] for r in rows],
        "train_reward": [round(r["reward_mean"], 4) for r in rows],
        "skipped": sum(r["skipped"] is not None for r in rows),
        "wall_s": time.perf_counter() - t0,
    }


def cells_of(runs: list[dict], rewards: list[str], modes: list[str], per_step: int) -> list[dict]:
    """Per reward and mode, over seeds: the last eval's pass@1 (mean, std), its paired gain over
    skip's run of the same seed, the groups generated and trained per step, the zero-variance
    share."""
    last = {(r["reward"], r["mode"], r["seed"]): r["evals"][-1] for r in runs}
    out = []
    for w, m in [(w, m) for w in rewards for m in modes]:
        rs = [r for r in runs if (r["reward"], r["mode"]) == (w, m)]
        c: dict = {"reward": w, "mode": m, "seeds": len(rs)}
        for key in ("pass1_sampled", "pass1_greedy"):
            xs = [r["evals"][-1][key] for r in rs]
            c[key], c[key + "_std"] = statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0
            c[key + "_start"] = statistics.fmean(r["evals"][0][key] for r in rs)
            gain = [last[w, m, r["seed"]][key] - last[w, "skip", r["seed"]][key] for r in rs]
            c[key + "_gain"] = {"mean": statistics.fmean(gain), "min": min(gain), "max": max(gain)} if gain else None
        steps = sum(len(r["groups_varied"]) for r in rs)
        c["groups_per_step"] = sum(r["groups_generated"] for r in rs) / steps
        c["varied_per_step"] = sum(sum(r["groups_varied"]) for r in rs) / steps
        c["zero_variance_share"] = statistics.fmean(x for r in rs for x in r["zero_variance_groups"])
        c["steps_short"] = sum(v < per_step for r in rs for v in r["groups_varied"])  # fewer than promptsPerStep vary
        c["wall_s"] = statistics.fmean(r["wall_s"] for r in rs)
        out.append(c)
    return out


def report(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    s = res["settings"]
    t = Table(
        "reward", "mode", "step 0", "sampled pass@1", "gain vs skip", "greedy pass@1", "groups generated / step",
        "groups trained / step", "zero-variance share", "steps short of full", "wall s / run",
        title=f"held-out pass@1 at step {s['steps']}, {s['seeds']} seeds, staleness {s['staleness']}, "
        f"maxGenBatches {s['gen_batches']} (gain: paired by seed)",
    )  # fmt: skip
    for c in res["cells"]:
        gain = c["pass1_sampled_gain"]
        t.add_row(
            c["reward"],
            c["mode"],
            f"{c['pass1_sampled_start']:.3f}",
            f"{c['pass1_sampled']:.3f} ± {c['pass1_sampled_std']:.3f}",
            "-" if gain is None else f"{gain['mean']:+.3f} ({gain['min']:+.3f}, {gain['max']:+.3f})",
            f"{c['pass1_greedy']:.3f} ± {c['pass1_greedy_std']:.3f}",
            f"{c['groups_per_step']:.1f}",
            f"{c['varied_per_step']:.1f}",
            f"{c['zero_variance_share']:.3f}",
            str(c["steps_short"]),
            f"{c['wall_s']:.0f}",
        )
    Console(width=160).print(t)


def plot(res: dict, path: Path) -> None:
    """Held-out sampled pass@1 against steps, and against groups generated (what refills cost):
    the mean over seeds per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = res["settings"]
    fig, axes = plt.subplots(len(s["rewards"]), 2, figsize=(11, 4 * len(s["rewards"])), squeeze=False)
    for row, w in zip(axes, s["rewards"]):
        for m in s["modes"]:
            rs = [r for r in res["runs"] if (r["reward"], r["mode"]) == (w, m)]
            at = range(len(rs[0]["evals"]))
            y = [statistics.fmean(r["evals"][i]["pass1_sampled"] for r in rs) for i in at]
            row[0].plot([rs[0]["evals"][i]["step"] for i in at], y, marker="o", label=m)
            row[1].plot([statistics.fmean(r["evals"][i]["groups"] for r in rs) for i in at], y, marker="o", label=m)
        row[0].set(xlabel="step", ylabel=f"reward {w}: held-out sampled pass@1")
        row[1].set(xlabel="prompt groups generated")
        row[1].sharey(row[0])
        for ax in row:
            ax.grid(alpha=0.3)
        row[1].legend(title="zeroVarianceGroups")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--job", default=str(ROOT / "examples/local-job.yaml"))
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--staleness", type=int, default=1)
    ap.add_argument("--modes", type=lambda s: s.split(","), default="skip,train,refill")
    ap.add_argument(
        "--rewards", type=lambda s: s.split(","), default="char_match,exact", help="the demo's, and all-or-nothing"
    )
    ap.add_argument("--gen-batches", type=int, default=3, help="grpo.maxGenBatches")
    ap.add_argument("--eval-prompts", type=int, default=256)
    ap.add_argument("--eval-samples", type=int, default=4)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "docs/bench_refill.json"))
    ap.add_argument("--plot", default=str(ROOT / "docs/bench_refill.png"))
    ap.add_argument("--quick", action="store_true", help="to try it: 20 steps, 1 seed")
    a = ap.parse_args()
    if a.quick:
        a.steps, a.seeds, a.eval_prompts, a.eval_every = 20, 1, 64, 10
    if not set(a.modes) <= {"skip", "train", "refill"} or "skip" not in a.modes:
        ap.error("--modes is of skip, train, refill, and holds skip (the others' gains are over it)")
    job = yaml.safe_load(Path(a.job).read_text())
    a.ev = (a.eval_prompts, a.eval_samples)
    eval_at = sorted({a.steps, *range(a.eval_every, a.steps, a.eval_every)})
    cells = [dict(reward=w, mode=m, seed=s) for s in range(a.seeds) for w in a.rewards for m in a.modes]

    from rich.progress import Progress

    t0, runs = time.perf_counter(), []
    with ProcessPoolExecutor(a.jobs, mp_context=get_context("spawn")) as pool, Progress() as bar:
        task = bar.add_task("warm-up per seed", total=a.seeds)
        futs = [pool.submit(warm, job, s, ["exact"]) for s in range(a.seeds)]
        warmed = [(f.result(), bar.advance(task))[0] for f in futs]
        task = bar.add_task(f"{len(cells)} runs", total=len(cells))
        for fut in as_completed([pool.submit(run, job, warmed[c["seed"]][0], c, a, eval_at) for c in cells]):
            r = fut.result()
            runs.append(r)
            e0, e1 = r["evals"][0], r["evals"][-1]
            bar.console.print(
                f"{r['reward']:<10} {r['mode']:<7} seed {r['seed']}: pass@1 sampled {e0['pass1_sampled']:.3f} → "
                f"{e1['pass1_sampled']:.3f}, greedy {e0['pass1_greedy']:.3f} → {e1['pass1_greedy']:.3f}, "
                f"{r['groups_generated']} groups, {r['wall_s']:.0f} s"
            )
            bar.advance(task)
    settings = {k: v for k, v in vars(a).items() if k not in ("out", "plot", "ev")} | {"eval_at": [0, *eval_at]}
    res = {
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(["python3", *sys.argv]),
        "wall_s": time.perf_counter() - t0,
        "settings": settings,
        "cells": cells_of(runs, a.rewards, a.modes, job["spec"]["grpo"]["promptsPerStep"]),
        "runs": sorted(runs, key=lambda r: (r["reward"], r["mode"], r["seed"])),
    }
    Path(a.out).write_text(json.dumps(res, indent=1))
    report(res)
    plot(res, Path(a.plot))
    print(f"wrote {a.out} and {a.plot}; the runs took {res['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
