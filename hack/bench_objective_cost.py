"""What the corrected objective costs the trainer: the demo's step (`Learner.train`: scoring,
forward, backward, AdamW) with the behaviour weight off, beside the same step with each
correction, on the same batches, interleaved so that a noisy machine slows them alike.

    .venv/bin/python hack/bench_objective_cost.py [--steps 200] [--out docs/bench_objective_cost.json]

The batches are sampled from the demo's warmed-up model (16 prompts x 8, up to 4 tokens), with
log-probs a little apart from the trainer's, as a worker's engine reports them."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import yaml
from rich.console import Console
from rich.table import Table

from sparrowrl.rollout.coordinator import Batch
from sparrowrl.spec.job import parse
from sparrowrl.trainer.learner import Learner

ROOT = Path(__file__).resolve().parents[1]
OBJECTIVES = {  # name → grpo fields over the demo's
    "off": {"behaviour": {"correction": "off"}},
    "token-tis (default)": {},
    "sequence-mis": {"behaviour": {"correction": "mask", "level": "sequence", "floor": 0.5}},
    "gspo": {"ratioLevel": "sequence"},
}


def learner(fields: dict, where: Path) -> Learner:
    job = yaml.safe_load((ROOT / "examples" / "local-job.yaml").read_text())
    job["spec"]["grpo"].update(fields)
    job["spec"]["task"].pop("eval", None)
    return Learner(parse(job).spec, where)


@torch.no_grad()
def batch(lr: Learner, b: int, g: torch.Generator) -> Batch:
    """Batch b as workers would send it: each group's 8 samples of up to maxNewTokens tokens."""
    spec, results = lr.spec.grpo, {}
    groups = list(range(b * spec.prompts_per_step, (b + 1) * spec.prompts_per_step))
    for group in groups:
        p = lr.prompt_ids(group)
        samples = []
        for _ in range(spec.group_size):
            ids, lps = list(p), []
            for _ in range(spec.max_new_tokens):
                logits = lr.model(input_ids=torch.tensor([ids])).logits[0, -1].float() / spec.temperature
                logp = torch.log_softmax(logits, -1)
                t = int(torch.multinomial(logp.exp(), 1, generator=g))
                ids.append(t)
                lps.append(min(0.0, float(logp[t]) + 0.01 * float(torch.randn((), generator=g))))  # engine noise
                if t == lr.tok.eos_token_id:
                    break
            samples.append({"tokens": ids[len(p) :], "logprobs": lps})
        results[group] = {"version": b, "worker": "bench", "lease": 0, "samples": samples}
    return Batch(index=b, groups=groups, pending=[], results=results)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "bench_objective_cost.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        learners = {name: learner(f, Path(tmp) / str(i)) for i, (name, f) in enumerate(OBJECTIVES.items())}
        first = next(iter(learners.values()))
        times: dict[str, list[float]] = {n: [] for n in learners}
        g = torch.Generator().manual_seed(0)
        t0 = time.perf_counter()
        for b in range(args.steps):
            x = batch(first, b, g)
            order = list(learners) if b % 2 == 0 else list(reversed(learners))  # neither always goes first
            for name in order:
                times[name].append(learners[name].train(x)["train_s"])
            if b % 20 == 0:
                print(f"step {b}/{args.steps}", flush=True)
        for lr in learners.values():
            lr.stop()
    base = statistics.median(times["off"][10:])
    rows = {
        n: {
            "median_train_s": statistics.median(t[10:]),
            "p25": statistics.quantiles(t[10:], n=4)[0],
            "p75": statistics.quantiles(t[10:], n=4)[2],
            "over_off": statistics.median(t[10:]) / base - 1,
        }
        for n, t in times.items()
    }
    table = Table(title=f"trainer step (Learner.train), {args.steps} steps, the first 10 left out")
    for c in ("objective", "median s", "p25–p75 s", "vs off"):
        table.add_column(c)
    for n, r in rows.items():
        table.add_row(n, f"{r['median_train_s']:.4f}", f"{r['p25']:.4f}–{r['p75']:.4f}", f"{r['over_off']:+.1%}")
    Console().print(table)
    out = {
        "date": time.strftime("%Y-%m-%d"),
        "steps": args.steps,
        "seconds": time.perf_counter() - t0,
        "torch_threads": torch.get_num_threads(),
        "objectives": OBJECTIVES,
        "results": rows,
    }
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
