#!/usr/bin/env python3
"""Off-policy bench: how GRPO on the demo job learns when its samples come from a stale policy and
from an engine whose log-probs drift from the trainer's, under each behaviour correction. It picks
the default `grpo.behaviour` (docs/rl.md, "The objective"; figures in docs/benchmarks.md).

Staleness is forced: batch b is sampled with the policy of version b − k (version 0 while b < k).
The trainer is the real one (`Learner.train`, its loss in trainer/grpo.py); only the rollout is
this script's, as a worker would make it:

- exact: sample, and report log-probs, with an fp32 copy of the version (μ's numbers are the
  trainer's own function: the only mismatch is staleness);
- bf16: that copy cast to bfloat16 and run in bf16, logits in fp32 for the softmax (an engine's
  bf16 kernels; docs/engine_mismatch.json has vLLM's CPU build on this model, for scale);
- bf16x5: sampled as bf16, the reported deviation from fp32 scaled by 5 (the larger gaps reported
  for GPU engines).

Each run is scored on held-out prompts (group ids no batch uses) with the task's reward: pass@1
(reward == 1) of greedy decoding, and of samples at the job's temperature (`--eval-samples` each).

    python3 hack/bench_offpolicy.py [--steps 200 --seeds 3 --staleness 0,2,4,8 --drift exact,bf16]
        [--objectives uncorrected,token-tis,sequence-mis,gspo] [--jobs 2] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import in_venv  # noqa: E402 (hack/ is this script's folder, first on sys.path)

in_venv.enter()

import torch  # noqa: E402
import yaml  # noqa: E402

from sparrowrl.rollout.coordinator import Batch  # noqa: E402
from sparrowrl.spec.job import JobSpec, parse  # noqa: E402
from sparrowrl.trainer import grpo, models  # noqa: E402
from sparrowrl.trainer.learner import Learner  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OBJECTIVES: dict[str, dict] = {  # the job's `grpo` fields each objective sets
    "uncorrected": {"behaviour": {"correction": "off"}},
    "token-tis": {"behaviour": {"correction": "truncate", "level": "token", "cap": 2.0}},
    "sequence-mis": {"behaviour": {"correction": "mask", "level": "sequence", "cap": 2.0, "floor": 0.5}},
    "gspo": {"ratioLevel": "sequence", "behaviour": {"correction": "truncate", "level": "token", "cap": 2.0}},
}
DRIFT = {"exact": 0.0, "bf16": 1.0, "bf16x5": 5.0}  # scale of the engine's reported deviation from fp32
HELD_OUT = 10_000_000  # eval prompts' group ids: far beyond any batch's
MISMATCH = ("mismatch_mean", "mismatch_max", "is_weight_mean", "is_weight_min", "is_weight_max")
MISMATCH += ("is_masked", "is_truncated", "is_ess")
Policy = tuple[torch.nn.Module, torch.nn.Module | None]  # (fp32 copy, bf16 engine or None)


def mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def job_spec(job: dict, objective: str, seed: int, steps: int, warmup: int | None = None) -> JobSpec:
    """The demo job with this objective's `grpo` fields, this seed and step count."""
    d = copy.deepcopy(job)
    d["spec"].update(seed=seed, steps=steps)
    d["spec"]["grpo"].update(copy.deepcopy(OBJECTIVES[objective]))
    if warmup is not None:
        d["spec"]["model"]["tiny"]["warmupSteps"] = warmup
    return parse(d).spec


def snapshot(model: torch.nn.Module, drift: str) -> Policy:
    """A version as a worker holds it: the fp32 weights, and the engine's bf16 cast unless exact."""
    fp32 = copy.deepcopy(model).eval().requires_grad_(False)
    return fp32, None if drift == "exact" else copy.deepcopy(fp32).to(torch.bfloat16)


def next_logp(model: torch.nn.Module, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-probs of the next token, [rows, vocab]: the full softmax at the temperature, in fp32."""
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, -1].float()
    return torch.log_softmax(logits / temperature, -1)


@torch.no_grad()
def generate(
    policy: Policy,
    prompts: list[list[int]],
    max_new: int,
    eos: int,
    temp: float,
    gen: torch.Generator | None,
    scale=0.0,
) -> list[tuple[list[int], list[float]]]:
    """(tokens up to and with EOS, reported log-probs) per prompt: sampled with `gen` from the
    engine's distribution (fp32's when exact), or greedy without. The reported log-prob is fp32's
    plus `scale` × (engine's − fp32's). No KV cache: completions are a few tokens."""
    fp32, engine = policy
    out: list[tuple[list[int], list[float]]] = [([], []) for _ in prompts]
    by_len: dict[int, list[int]] = defaultdict(list)
    for i, p in enumerate(prompts):
        by_len[len(p)].append(i)
    for idx in by_len.values():
        ids, live = torch.tensor([prompts[i] for i in idx]), torch.ones(len(idx), dtype=torch.bool)
        for _ in range(max_new):
            lp32 = next_logp(fp32, ids, temp)
            lp = lp32 if engine is None else next_logp(engine, ids, temp)
            nxt = lp.argmax(-1) if gen is None else torch.multinomial(lp.exp(), 1, generator=gen)[:, 0]
            told = lp if scale == 1.0 else (lp32 + scale * (lp - lp32)).clamp(max=0.0)
            told = told.gather(-1, nxt[:, None])[:, 0]
            for j in live.nonzero()[:, 0].tolist():
                out[idx[j]][0].append(int(nxt[j]))
                out[idx[j]][1].append(float(told[j]))
            live &= nxt != eos
            if not live.any():
                break
            ids = torch.cat([ids, nxt[:, None]], 1)
    return out


def evaluate(learner: Learner, n: int, samples: int) -> dict[str, float]:
    """Held-out pass@1 (reward == 1) and mean reward of the trainer's fp32 model: greedy on `n`
    prompts, and `samples` samples of each at the job's temperature (the same draws every time)."""
    g, tok = learner.spec.grpo, learner.tok
    exs = [learner.prompt(HELD_OUT + i) for i in range(n)]
    ids = [learner.prompt_ids(HELD_OUT + i) for i in range(n)]
    out = {}
    for how, reps, gen in (("greedy", 1, None), ("sampled", samples, torch.Generator().manual_seed(7))):
        done = generate((learner.model, None), [p for p in ids for _ in range(reps)], g.max_new_tokens,
                        tok.eos_token_id, g.temperature, gen)  # fmt: skip
        items = [(e.prompt, models.completion_text(tok, t), e.answer, e.fields) for e, (t, _) in zip(
            [e for e in exs for _ in range(reps)], done)]  # fmt: skip
        rewards, _ = learner.scorer.score(items)
        out[f"pass1_{how}"] = sum(r == 1.0 for r in rewards) / len(rewards)
        out[f"reward_{how}"] = sum(rewards) / len(rewards)
    return out


def drift_of(learner: Learner, policy: Policy, scale: float, groups: int) -> dict[str, float]:
    """Per-token |reported − trainer's| log-prob (nats) on `groups` groups sampled at these
    weights; the trainer's by its own function (grpo.proximal, fp32)."""
    g = learner.spec.grpo
    prompts = [learner.prompt_ids(2 * HELD_OUT + i) for i in range(groups) for _ in range(g.group_size)]
    done = generate(policy, prompts, g.max_new_tokens, learner.tok.eos_token_id, g.temperature,
                    torch.Generator().manual_seed(12345), scale)  # fmt: skip
    rows = [(p, t, lp) for p, (t, lp) in zip(prompts, done)]
    prox = grpo.proximal(learner.model, rows, grpo.micro_batches(rows, None), pad_id=learner.tok.pad_token_id,
                         temperature=g.temperature, device=learner.device)  # fmt: skip
    d = torch.cat([(p - torch.tensor(lp)).abs() for p, (_, _, lp) in zip(prox, rows)])
    return {
        "tokens": len(d),
        "abs_mean": float(d.mean()),
        "abs_p99": float(d.quantile(0.99)),
        "abs_max": float(d.max()),
    }


def warm(job: dict, seed: int, drifts: list[str]) -> tuple[dict[str, torch.Tensor], dict]:
    """The seed's warmed-up model (the Learner's own warm-up, once per seed: every run of the
    seed starts from it), and each drift's measured gap at those weights."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        learner = Learner(job_spec(job, "token-tis", seed, 1), Path(tmp))
        try:
            state = {k: v.detach().clone() for k, v in learner.model.state_dict().items()}
            return state, {d: drift_of(learner, snapshot(learner.model, d), DRIFT[d], 64) for d in drifts}
        finally:
            learner.stop()


def run(job: dict, state: dict[str, torch.Tensor], cell: dict, steps: int, eval_at: list[int], ev: tuple) -> dict:
    """One run of the grid: `steps` GRPO steps at forced staleness k, evaluated at `eval_at`."""
    torch.set_num_threads(1)
    t0, k, drift = time.perf_counter(), cell["staleness"], cell["drift"]
    with tempfile.TemporaryDirectory() as tmp:
        learner = Learner(job_spec(job, cell["objective"], cell["seed"], steps, warmup=0), Path(tmp))
        try:
            learner.model.load_state_dict(state)
            g, eos, n = learner.spec.grpo, learner.tok.eos_token_id, learner.spec.grpo.group_size
            gen = torch.Generator().manual_seed(cell["seed"])  # the same draws for every objective of a seed
            versions = {0: snapshot(learner.model, drift)}
            evals = [{"step": 0, **evaluate(learner, *ev)}]
            rows = []
            for b in range(steps):
                v = max(b - k, 0)
                groups = list(range(b * g.prompts_per_step, (b + 1) * g.prompts_per_step))
                prompts = [learner.prompt_ids(x) for x in groups for _ in range(n)]
                done = generate(versions[v], prompts, g.max_new_tokens, eos, g.temperature, gen, DRIFT[drift])
                results = {
                    x: {"version": v, "worker": "bench", "lease": 0,
                        "samples": [{"tokens": t, "logprobs": lp} for t, lp in done[i * n : (i + 1) * n]]}
                    for i, x in enumerate(groups)
                }  # fmt: skip
                rows.append(learner.train(Batch(index=b, groups=groups, pending=[], results=results)))
                versions[b + 1] = snapshot(learner.model, drift)
                versions.pop(b + 1 - k - 1, None)  # batch b + 1 needs version b + 1 − k at the oldest
                if b + 1 in eval_at:
                    evals.append({"step": b + 1, **evaluate(learner, *ev)})
        finally:
            learner.stop()
    return {**cell, "evals": evals, **summary(rows), "wall_s": time.perf_counter() - t0}


def summary(rows: list[dict]) -> dict:
    """A run's mismatch over its steps (means; extremes of the extremes), its median train time,
    and the gap by the sampling version's age (token-weighted)."""
    on = [r for r in rows if "mismatch_mean" in r]  # a step with nothing to train has none
    ext = {"mismatch_max": max, "is_weight_max": max, "is_weight_min": min}
    ages: dict[str, list[float]] = {}
    for r in rows:
        for age, d in r["by_age"].items():
            a = ages.setdefault(age, [0.0, 0.0, 0.0])
            a[0], a[1], a[2] = a[0] + d["mismatch_mean"] * d["tokens"], a[1] + d["tokens"], max(a[2], d["mismatch_max"])
    return {
        **{k: (ext[k] if k in ext else mean)([r[k] for r in on]) if on else None for k in MISMATCH},
        "by_age": {
            a: {"mismatch_mean": s / max(t, 1), "mismatch_max": m, "tokens": t} for a, (s, t, m) in ages.items()
        },
        "train_s": statistics.median(r["train_s"] for r in rows),
        "skipped": sum(r["skipped"] is not None for r in rows),
        "train_reward": [round(r["reward_mean"], 4) for r in rows],
    }


def cells_of(runs: list[dict], drifts: list[str], stale: list[int], objs: list[str]) -> list[dict]:
    """Runs by (drift, staleness, objective): the last eval's figures, mean and std over seeds, and
    the sampled pass@1's gain over uncorrected; the mismatch (and |Δ| by age) averaged over seeds."""
    out, last = [], {(r["drift"], r["staleness"], r["objective"], r["seed"]): r["evals"][-1] for r in runs}
    for d, k, o in [(d, k, o) for d in drifts for k in stale for o in objs]:
        rs = [r for r in runs if (r["drift"], r["staleness"], r["objective"]) == (d, k, o)]
        c = {"drift": d, "staleness": k, "objective": o, "seeds": len(rs)}
        # a seed's runs start from the same model: the gain over its uncorrected run is paired
        gain = [last[(d, k, o, r["seed"])]["pass1_sampled"] - last[(d, k, "uncorrected", r["seed"])]["pass1_sampled"]
                for r in rs if (d, k, "uncorrected", r["seed"]) in last]  # fmt: skip
        if gain:
            c["gain_sampled"] = {"mean": statistics.fmean(gain), "min": min(gain), "max": max(gain)}
        for key in ("pass1_greedy", "pass1_sampled", "reward_greedy", "reward_sampled"):
            xs = [r["evals"][-1][key] for r in rs]
            c[key], c[key + "_std"] = statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0
            c[key + "_start"] = statistics.fmean(r["evals"][0][key] for r in rs)
        ages = sorted({age for r in rs for age in r["by_age"]}, key=int)
        c["by_age"] = {age: mean(r["by_age"].get(age, {}).get("mismatch_mean") for r in rs) for age in ages}
        out.append(c | {key: mean(r[key] for r in rs) for key in (*MISMATCH, "train_s")})
    return out


def report(res: dict) -> None:
    """The figures as tables: pass@1 per cell, the mismatch each objective saw, the drift, train time."""
    from rich.console import Console
    from rich.table import Table

    con, s = Console(width=150), res["settings"]
    f = lambda x, p=4: "-" if x is None else f"{x:.{p}f}" if x == 0 or abs(x) >= 1e-3 else f"{x:.1e}"  # noqa: E731
    by = {(c["drift"], c["staleness"], c["objective"]): c for c in res["cells"]}
    for key in ("pass1_sampled", "pass1_greedy"):
        t = Table("drift", "k", "step 0", *s["objectives"], title=f"held-out {key} at step {s['steps']} (± std, seeds)")
        for d in s["drift"]:
            for k in s["staleness"]:
                cs = [by[(d, k, o)] for o in s["objectives"]]
                t.add_row(
                    d, str(k), f(cs[0][key + "_start"], 3), *(f"{c[key]:.3f} ± {c[key + '_std']:.3f}" for c in cs)
                )
        con.print(t)
    objs = [o for o in s["objectives"] if o != "uncorrected"]
    t = Table("drift", "k", *objs, title="pass1_sampled gain over uncorrected, same seed: mean (min, max)")
    for d in s["drift"]:
        for k in s["staleness"]:
            gs = [by[(d, k, o)].get("gain_sampled") for o in objs]
            t.add_row(d, str(k), *(f"{g['mean']:+.3f} ({g['min']:+.3f}, {g['max']:+.3f})" if g else "-" for g in gs))
    con.print(t)
    cols = ("|Δ| mean", "|Δ| max", "w mean", "w min", "w max", "masked", "truncated", "ESS")
    m = Table(
        "drift", "k", "objective", *cols, title="behaviour mismatch (means over steps, seeds; max, min: extremes)"
    )
    for c in res["cells"]:
        m.add_row(c["drift"], str(c["staleness"]), c["objective"], *(f(c[k]) for k in MISMATCH))
    con.print(m)
    t = Table(
        "sampler", "tokens", "mean", "p99", "max", title="engine drift: |reported − trainer fp32| log-prob (nats)"
    )
    for name, g in res["drift"].items():
        t.add_row(name, str(int(g["tokens"])), *(f(g[k]) for k in ("abs_mean", "abs_p99", "abs_max")))
    con.print(t)
    con.print("median train_s per step: " + ", ".join(f"{o} {v:.3f}" for o, v in res["train_s"].items()))


def plot(res: dict, path: Path) -> None:
    """pass@1 at the last step against staleness, a line per objective: a panel per drift, a row
    per decoding (sampled, greedy); error bars are the std over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = res["settings"]
    fig, axes = plt.subplots(2, len(s["drift"]), figsize=(4.5 * len(s["drift"]), 7), sharey="row", squeeze=False)
    for row, key in enumerate(("pass1_sampled", "pass1_greedy")):
        for ax, d in zip(axes[row], s["drift"]):
            for i, o in enumerate(s["objectives"]):
                cs = [c for c in res["cells"] if c["drift"] == d and c["objective"] == o]
                x = [c["staleness"] + (i - 1.5) * 0.1 for c in cs]
                ax.errorbar(x, [c[key] for c in cs], [c[key + "_std"] for c in cs], marker="o", capsize=3, label=o)
            ax.axhline(cs[0][key + "_start"], color="grey", ls=":", label="step 0")
            ax.set(title=f"engine: {d}", xlabel="staleness k (versions)", xticks=s["staleness"])
            ax.grid(alpha=0.3)
        axes[row][0].set_ylabel(f"held-out {key.replace('pass1_', '')} pass@1, step {s['steps']}")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--job", default=str(ROOT / "examples/local-job.yaml"))
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--staleness", type=lambda s: [int(x) for x in s.split(",")], default="0,2,4,8")
    ap.add_argument("--drift", type=lambda s: s.split(","), default="exact,bf16")
    ap.add_argument("--objectives", type=lambda s: s.split(","), default=",".join(OBJECTIVES))
    ap.add_argument("--eval-prompts", type=int, default=256)
    ap.add_argument("--eval-samples", type=int, default=4, help="samples per held-out prompt for sampled pass@1")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "docs/bench_offpolicy.json"))
    ap.add_argument("--plot", default=str(ROOT / "docs/bench_offpolicy.png"))
    ap.add_argument("--from-json", help="no runs: the tables and plot again from a saved JSON's runs")
    ap.add_argument("--quick", action="store_true", help="a tiny grid, to try it: 20 steps, 1 seed, k 0 and 4")
    a = ap.parse_args()
    if a.quick:
        a.steps, a.seeds, a.staleness, a.eval_prompts, a.eval_every = 20, 1, [0, 4], 64, 10
    if not (set(a.drift) <= set(DRIFT) and set(a.objectives) <= set(OBJECTIVES)):
        ap.error(f"--drift is of {', '.join(DRIFT)}; --objectives of {', '.join(OBJECTIVES)}")
    if a.from_json:
        res = json.loads(Path(a.from_json).read_text())
        s = res["settings"]
        res["cells"] = cells_of(res["runs"], s["drift"], s["staleness"], s["objectives"])
    else:
        res = grid(a)
    Path(a.out).write_text(json.dumps(res, indent=1))
    report(res)
    plot(res, Path(a.plot))
    print(f"wrote {a.out} and {a.plot}; the grid took {res['wall_s']:.0f} s")


def grid(a: argparse.Namespace) -> dict:
    """Every run of the grid, `a.jobs` at a time, each seed's warm-up first."""
    stale, drifts, objs = a.staleness, a.drift, a.objectives
    eval_at = sorted({a.steps, *range(a.eval_every, a.steps, a.eval_every)})
    job = yaml.safe_load(Path(a.job).read_text())
    cells = [dict(drift=d, staleness=k, objective=o, seed=s) for s in range(a.seeds) for d in drifts for k in stale
             for o in objs]  # fmt: skip

    from rich.progress import Progress

    t0, runs = time.perf_counter(), []
    with ProcessPoolExecutor(a.jobs, mp_context=get_context("spawn")) as pool, Progress() as bar:
        task = bar.add_task("warm-up per seed", total=a.seeds)
        futs = [pool.submit(warm, job, s, drifts) for s in range(a.seeds)]
        warmed = [(f.result(), bar.advance(task))[0] for f in futs]
        task = bar.add_task(f"{len(cells)} runs", total=len(cells))
        ev = (a.eval_prompts, a.eval_samples)
        for fut in as_completed([pool.submit(run, job, warmed[c["seed"]][0], c, a.steps, eval_at, ev) for c in cells]):
            r = fut.result()
            runs.append(r)
            e0, e1 = r["evals"][0], r["evals"][-1]
            bar.console.print(
                f"{r['drift']:>6} k={r['staleness']} {r['objective']:<12} seed {r['seed']}: pass@1 sampled "
                f"{e0['pass1_sampled']:.3f} → {e1['pass1_sampled']:.3f}, greedy {e0['pass1_greedy']:.3f} → "
                f"{e1['pass1_greedy']:.3f}, |Δ| {r['mismatch_mean'] or 0:.4f}, {r['wall_s']:.0f} s"
            )
            bar.advance(task)
    gaps = {f"{d} sampler": {k: mean(w[1][d][k] for w in warmed) for k in warmed[0][1][d]} for d in drifts}
    vllm = json.loads((ROOT / "docs/engine_mismatch.json").read_text())["vllm"]["vs_trainer_fp32"]
    gaps["vLLM CPU (engine_mismatch.json)"] = vllm
    return {
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(["python3", *sys.argv]),
        "wall_s": time.perf_counter() - t0,
        "settings": {k: v for k, v in vars(a).items() if k not in ("out", "plot", "from_json")}
        | {"eval_at": [0, *eval_at]},
        "drift": gaps,
        "cells": cells_of(runs, drifts, stale, objs),
        "train_s": {o: statistics.median(r["train_s"] for r in runs if r["objective"] == o) for o in objs},
        "runs": sorted(runs, key=lambda r: (r["drift"], r["staleness"], r["objective"], r["seed"])),
    }


if __name__ == "__main__":
    main()
