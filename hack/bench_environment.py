#!/usr/bin/env python3
"""What the environment layer costs: the same single-turn task run through it (task.environment,
hack/envs/single_turn_add.py: the built-in add task as a one-turn environment; and
hack/envs/vf_single_turn_add.py: the same written with verifiers, a vf.SingleTurnEnv) and through
the single-turn path (task.builtin: add), side by side in one run on this machine.

Two measurements:
- one lease, in process: the hf engine's `generate` of 16 groups x 8 samples, against
  `Episodes.run` of the same groups (the same seeds, so the same tokens) with either environment,
  which adds the environment's turn in a process of its own and the bookkeeping. Tokens per
  second of each, best of --repeats.
- the whole job: `sparrowrl run` of the same job (the demo's model and settings, --steps steps)
  with each task; tokens per second and training seconds from each run's summary.

    python3 hack/bench_environment.py [--steps 30] [--repeats 5] [--out docs/bench_environment.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import in_venv  # noqa: E402 (hack/ is this script's folder, first on sys.path)

in_venv.enter()

import torch  # noqa: E402
import yaml  # noqa: E402

from sparrowrl.agents import environment  # noqa: E402
from sparrowrl.agents.turns import Turns  # noqa: E402
from sparrowrl.calls import Pool  # noqa: E402
from sparrowrl.spec.task import EnvironmentSpec  # noqa: E402
from sparrowrl.trainer import models  # noqa: E402
from sparrowrl.worker.engines import Prompt, Sampling, make_engine  # noqa: E402
from sparrowrl.worker.episodes import Episodes  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ENVS = {  # the same task, as an environment of SparrowRL's protocol and as a verifiers one
    "environment": str(ROOT / "hack" / "envs" / "single_turn_add.py"),
    "verifiers": str(ROOT / "hack" / "envs" / "vf_single_turn_add.py"),
}


def lease(repeats: int) -> dict:
    """One lease's generation, with and without the environment layer (either environment): the
    best of `repeats`."""
    torch.set_num_threads(1)  # as a worker
    tok = models.char_tokenizer()
    with tempfile.TemporaryDirectory() as folder:
        model = models.tiny_qwen3(len(tok), 128, 2, 4, 0)
        model.config.save_pretrained(folder)
        tok.save_pretrained(folder)
        engine = make_engine("hf", folder)
        for n, t in engine.tensors().items():
            t.copy_(models.policy_state(model)[n])
        rows = environment.rows(environment.load(ENVS["environment"], {}))[:16]
        prompts = [Prompt(models.prompt_ids(tok, r["prompt"]), 1000 + i) for i, r in enumerate(rows)]
        examples = [{"messages": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in rows]
        sampling = Sampling(n=8, max_new_tokens=4, temperature=1.0)
        best = dict.fromkeys(["generate", *ENVS], float("inf"))
        through = {}
        for name, ref in ENVS.items():
            env = EnvironmentSpec(load=ref, max_turns=1, max_episode_tokens=4)
            pool = Pool(partial(environment.turn_caller, ref, {}), 2, 30.0, "environment")
            episodes = Episodes(engine, Turns(tok, False, {tok.eos_token_id}), env, pool)
            try:
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    plain = engine.generate(prompts, sampling)
                    t1 = time.perf_counter()
                    through[name] = episodes.run(prompts, examples, sampling)
                    t2 = time.perf_counter()
                    best["generate"] = min(best["generate"], t1 - t0)
                    best[name] = min(best[name], t2 - t1)
            finally:
                pool.close()
    tokens = sum(len(s.tokens) for g in plain for s in g)
    for name in ENVS:  # the same samples, seed for seed
        assert tokens == sum(len(s["tokens"]) for g in through[name] for s in g)
    return {
        "groups": len(prompts),
        "samples": len(prompts) * sampling.n,
        "tokens": tokens,
        "generate_s": best["generate"],
        "generate_tokens_per_s": tokens / best["generate"],
        **{
            name: {
                "episodes_s": best[name],
                "episodes_tokens_per_s": tokens / best[name],
                "overhead_ms": 1000 * (best[name] - best["generate"]),
            }
            for name in ENVS
        },
    }


def job(steps: int) -> dict:
    """The same job run with either task: the demo's model and sampling, one region of two workers."""
    base = yaml.safe_load((ROOT / "examples" / "local-job.yaml").read_text())
    spec = base["spec"]
    spec["steps"] = steps
    spec["topology"] = {"regions": [{"name": "us", "workers": 2}]}
    spec["task"] = {"builtin": "add"}
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, task in [
            ("single_turn", {"builtin": "add"}),
            *(
                (name, {"environment": {"load": ref, "maxTurns": 1, "maxEpisodeTokens": 4}})
                for name, ref in ENVS.items()
            ),
        ]:
            spec["task"] = task
            f = Path(tmp) / f"{name}.yaml"
            f.write_text(yaml.safe_dump(base))
            run = Path(tmp) / name
            print(f"sparrowrl run: {name} ({steps} steps)", flush=True)
            subprocess.run(
                [sys.executable, "-m", "sparrowrl.cli", "run", str(f), "--run-dir", str(run)],
                check=True,
                stdout=subprocess.DEVNULL,
            )
            s = json.loads((run / "summary.json").read_text())
            out[name] = {
                "tokens_per_second": s["tokens_per_second"],
                "seconds": s["seconds"],
                "reward_first": s["reward_first"],
                "reward_last": s["reward_last"],
                "weights_mismatch": s["weights_mismatch"],
            }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench_environment.json"))
    a = ap.parse_args()
    one = lease(a.repeats)
    print(
        f"one lease ({one['samples']} samples, {one['tokens']} tokens): generate {one['generate_tokens_per_s']:.0f} "
        f"tokens/s; through the environment layer: "
        + ", ".join(
            f"{name} {one[name]['episodes_tokens_per_s']:.0f} tokens/s (+{one[name]['overhead_ms']:.1f} ms)"
            for name in ENVS
        ),
        flush=True,
    )
    whole = job(a.steps)
    for name, r in whole.items():
        print(
            f"{name:12s} {r['tokens_per_second']:7.0f} tokens/s over {r['seconds']:.1f} s of training, reward "
            f"{r['reward_first']:.3f} -> {r['reward_last']:.3f}, mismatched commits {r['weights_mismatch']}"
        )
    result = {"machine": platform.processor() or platform.machine(), "lease": one, "job": whole, "steps": a.steps}
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
