#!/usr/bin/env python3
"""Micro-batching benchmark: the peak memory of one GRPO training step on the same model and
batch, in one pass and in micro-batches of a token budget (`grpo.microBatchTokens`), with the
trainer's own code (`grpo.micro_batches`, `grpo.accumulate`, then AdamW).

Each setting runs in a fresh process, so each peak is its own: on the CPU the process's peak
resident memory (ru_maxrss; tracemalloc does not see torch's allocations), on CUDA
torch.cuda.max_memory_allocated, in bf16 autocast with fp32 master weights as the trainer's one
rank trains there. Both are also given above the process's figure once model and batch are built
(the step's own: activations, logits, gradients and AdamW's state, made at its first step).
The rows have prompts and completions of random lengths up to --prompt and --completion; the
vocabulary sets the size of the logits, which dominate at a real model's vocabulary.

    python3 hack/bench_microbatch.py [--vocab 8192 --hidden 256 --layers 4 --rows 32] \\
        [--budgets 4096,1024] [--out docs/bench_microbatch.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import in_venv  # noqa: E402 (hack/ is this script's folder, first on sys.path)

in_venv.enter()

import torch  # noqa: E402

from sparrowrl.trainer import grpo, models  # noqa: E402


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def one(args: argparse.Namespace, budget: int | None) -> dict:
    """One training step at `budget` (None: one pass), in this process."""
    dev = torch.device("cuda" if args.device == "cuda" else "cpu")
    torch.manual_seed(0)
    model = models.tiny_qwen3(args.vocab, args.hidden, args.layers, max(1, args.hidden // 64), 0).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(args.rows):
        p = int(torch.randint(args.prompt // 4, args.prompt + 1, (), generator=g))
        c = int(torch.randint(args.completion // 8, args.completion + 1, (), generator=g))
        ids = torch.randint(3, args.vocab, (p + c,), generator=g).tolist()
        rows.append((ids[:p], ids[p:], (-torch.rand(c, generator=g) - 8.0).tolist()))
    adv = torch.randn(args.rows, generator=g).to(dev)
    tokens = float(sum(len(c) for _, c, _ in rows))
    batches = grpo.micro_batches(rows, budget)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.max_memory_allocated()
    else:
        before = _rss()
    t0 = time.perf_counter()
    try:
        grpo.accumulate(
            model,
            None,
            rows,
            adv,
            torch.full((len(rows),), 1.0 / tokens, device=dev),
            batches,
            pad_id=0,
            objective=grpo.Objective(),
            device=dev,
            bf16=dev.type == "cuda",
        )
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
    except torch.OutOfMemoryError:
        return {"budget": budget, "passes": len(batches), "out_of_memory": True}
    took = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() if dev.type == "cuda" else _rss()
    padded = sum(len(b) * (max(len(rows[i][0]) for i in b) + max(len(rows[i][1]) for i in b)) for b in batches)
    return {
        "budget": budget,
        "passes": len(batches),
        "padded_tokens": padded,
        "completion_tokens": int(tokens),
        "step_s": took,
        "peak_bytes": peak,
        "step_peak_bytes": peak - before,
        "measure": "torch.cuda.max_memory_allocated" if dev.type == "cuda" else "ru_maxrss",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=64, help="the longest prompt")
    ap.add_argument("--completion", type=int, default=192, help="the longest completion")
    ap.add_argument("--budgets", default="4096,1024", help="token budgets beside one pass, comma-separated")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a child: this budget ("none": one pass)
    args = ap.parse_args()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.one is not None:
        print(json.dumps(one(args, None if args.one == "none" else int(args.one))))
        return
    settings = ["none", *args.budgets.split(",")]
    results = []
    for s in settings:
        argv = [sys.executable, __file__, *sys.argv[1:], "--device", args.device, "--one", s]
        p = subprocess.run(argv, capture_output=True, text=True, check=True)
        r = json.loads(p.stdout.strip().splitlines()[-1])
        results.append(r)
        if r.get("out_of_memory"):
            print(f"{str(r['budget']):>8} tokens: {r['passes']:3d} passes, out of memory", flush=True)
            continue
        print(
            f"{str(r['budget'] or 'one pass'):>8} {'tokens' if r['budget'] else '':6}: {r['passes']:3d} passes, "
            f"{r['padded_tokens']:7d} padded tokens, {r['step_s']:6.2f} s, peak {r['peak_bytes'] / 2**20:8.0f} MiB "
            f"({r['step_peak_bytes'] / 2**20:7.0f} MiB above the built model and batch; {r['measure']})",
            flush=True,
        )
    if args.out:
        env = {"python": platform.python_version(), "torch": torch.__version__, "device": args.device}
        if args.device == "cuda":
            env["gpu"] = torch.cuda.get_device_name()
        config = {k: v for k, v in vars(args).items() if k not in ("out", "one")}
        args.out.write_text(json.dumps({"environment": env, "config": config, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
