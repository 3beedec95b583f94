#!/usr/bin/env python3
"""Parity with TRL: the same tiny model, task, reward, group size, learning rate and steps, trained
by TRL's `GRPOTrainer` (in the `make test-vllm` venv, .venv-vllm) and by `sparrowrl run` at
staleness 0, with `grpo.zeroVarianceGroups` skip (the default) and train (TRL's behaviour).

Per seed, the demo's starting model (examples/local-job.yaml: a tiny Qwen3, hidden 128, 2 layers,
4 heads, made and warmed up 400 steps by the trainer's own functions) is saved once as a Hugging
Face folder, and every run starts from it. Both sides see group i's prompt as the `add` task's
example(i), rendered without a chat template (BOS and the characters), and score completions
with the task's own reward. The TRL side runs in a subprocess of this script (`--trl`) under
.venv-vllm/bin/python; the SparrowRL side is `sparrowrl run` on a job written here.

    python3 hack/bench_trl_parity.py [--seeds 0 1 2] [--steps 300] \\
        [--out docs/bench_trl_parity.json] [--plot docs/bench_trl_parity.png] [--quick | --replot]

About 40 minutes on 2 cores for 3 seeds of 300 steps; --quick: one seed, 20 steps (4 minutes);
--replot: the summary and plot again from the runs in --out. Needs .venv-vllm (TRL 1.16).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import in_venv  # noqa: E402 (hack/ is this script's folder, first on sys.path)

in_venv.enter()  # .venv-vllm's python has sparrowrl and torch: the --trl side stays there

import torch  # noqa: E402

from sparrowrl.trainer import models, tasks  # noqa: E402

ROOT = in_venv.ROOT
TRL_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
SPARROWRL = ROOT / ".venv" / "bin" / "sparrowrl"
# the demo's job (examples/local-job.yaml)
HIDDEN, LAYERS, HEADS, WARMUP = 128, 2, 4, 400
LR, GROUP, PROMPTS, MAX_NEW = 2.0e-5, 8, 16, 4
SMOOTH = 10  # steps in the moving average of the plot
SIDES = ("trl", "sparrowrl_skip", "sparrowrl_train")


def task_for(tok, seed: int) -> tasks.Task:
    """The builtin `add` task as the trainer makes it for a job of this seed (no chat template)."""
    return tasks.Add(seed, models.Prompts(tok))


def start_model(seed: int, folder: Path) -> None:
    """The demo's model at this seed, warmed up as `Learner._models` does, saved as a HF folder."""
    tok = models.char_tokenizer()
    task = task_for(tok, seed)
    model = models.tiny_qwen3(len(tok), HIDDEN, LAYERS, HEADS, seed)
    models.warm_up(model, task.prompts, task, WARMUP)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)


def sparrowrl_side(folder: Path, seed: int, steps: int, zero_variance: str, work: Path) -> dict:
    """`sparrowrl run` at staleness 0 from `folder`: the reward of each step and the wall time."""
    job = work / f"job-{zero_variance}.yaml"
    job.write_text(
        f"""apiVersion: sparrowrl.dev/v1alpha1
kind: SparrowRLJob
metadata: {{name: trl-parity}}
spec:
  steps: {steps}
  seed: {seed}
  model: {{path: {folder}}}
  task: {{builtin: add}}
  grpo:
    learningRate: {LR}
    groupSize: {GROUP}
    promptsPerStep: {PROMPTS}
    maxNewTokens: {MAX_NEW}
    zeroVarianceGroups: {zero_variance}
  rollout: {{engine: hf, groupsPerLease: {PROMPTS}}}
  sync: {{mode: sparse, staleness: 0}}
  topology:
    regions: [{{name: local, workers: 1, relay: false}}]
"""
    )
    run_dir = work / f"run-{zero_variance}"
    t0 = time.perf_counter()
    subprocess.run([str(SPARROWRL), "run", str(job), "--run-dir", str(run_dir)], check=True, stdout=subprocess.DEVNULL)
    process = time.perf_counter() - t0
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows.sort(key=lambda r: r["step"])
    return {
        "reward": [r["reward_mean"] for r in rows],
        "zero_variance_groups": [r["zero_variance_groups"] for r in rows],
        "grad_norm": [r["grad_norm"] for r in rows],  # before clipping
        # |log π_prox − log μ| (bf16 worker against fp32 trainer), and the behaviour weight π_prox/μ;
        # absent in a step that trained nothing
        "mismatch_mean": [r.get("mismatch_mean") for r in rows],
        "is_weight_range": [[r.get("is_weight_min"), r.get("is_weight_max")] for r in rows],
        "is_truncated": [r.get("is_truncated") for r in rows],
        "step_s": [r["step_s"] for r in rows],
        "wall_s": json.loads((run_dir / "summary.json").read_text())["seconds"],  # the training loop's
        "process_wall_s": process,
    }


def trl_side(folder: Path, seed: int, steps: int, out: Path) -> None:
    """TRL 1.16's GRPOTrainer from `folder` (run under .venv-vllm): writes the rewards to `out`."""
    from datasets import Dataset
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    tok = models.load_tokenizer(folder)
    task = task_for(tok, seed)
    examples = [task.example(i) for i in range(steps * PROMPTS)]  # group i's prompt, as SparrowRL's
    want = [task.prompts.ids(e.prompt) for e in examples]  # what SparrowRL's workers and trainer feed
    plain = tok(text=[e.prompt for e in examples])["input_ids"]  # what TRL would feed (no BOS)
    # TRL tokenizes a plain prompt with the tokenizer's own special tokens, and this one adds none:
    # a post-processor that puts BOS first makes TRL feed exactly SparrowRL's ids
    tok._tokenizer.post_processor = TemplateProcessing(
        single=f"{tok.bos_token} $A", special_tokens=[(tok.bos_token, tok.bos_token_id)]
    )
    fed = tok(text=[e.prompt for e in examples])["input_ids"]
    if fed != want:
        raise SystemExit("TRL's prompt ids differ from SparrowRL's")
    score = tasks.REWARDS[tasks.Add.default_reward]

    def reward(prompts: list[str], completions: list[str], answer: list[str], **_: object) -> list[float]:
        return [score(p, c, a) for p, c, a in zip(prompts, completions, answer)]

    reward.__name__ = tasks.Add.default_reward
    data = Dataset.from_list([{"prompt": e.prompt, "answer": e.answer} for e in examples])
    config = GRPOConfig(
        output_dir=str(out.parent / "trl-out"),
        per_device_train_batch_size=PROMPTS * GROUP,  # completions: one step is 16 prompts x 8
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=GROUP,
        num_iterations=1,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        weight_decay=0.0,
        beta=0.0,
        epsilon=0.2,
        loss_type="dapo",
        scale_rewards="group",
        max_completion_length=MAX_NEW,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        use_vllm=False,
        bf16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        shuffle_dataset=False,
        seed=seed,
        max_steps=steps,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=config, train_dataset=data, processing_class=tok)
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    logs = [x for x in trainer.state.log_history if "reward" in x]
    out.write_text(
        json.dumps(
            {
                "reward": [x["reward"] for x in logs],
                "zero_variance_groups": [x.get("frac_reward_zero_std") for x in logs],
                "step_s": [x.get("step_time") for x in logs],
                "grad_norm": [x.get("grad_norm") for x in logs],
                "wall_s": wall,
                "prompt_ids_match_without_bos_fix": plain == want,
                "prompt_ids_example": {"text": examples[0].prompt, "sparrowrl": want[0], "trl_plain": plain[0]},
            }
        )
    )


def run_trl(folder: Path, seed: int, steps: int, work: Path) -> dict:
    out = work / "trl.json"
    cmd = [str(TRL_PYTHON), __file__, "--trl", str(folder), "--seed", str(seed), "--steps", str(steps)]
    t0 = time.perf_counter()
    subprocess.run([*cmd, "--trl-out", str(out)], check=True, stdout=subprocess.DEVNULL)
    return {**json.loads(out.read_text()), "process_wall_s": time.perf_counter() - t0}


def smooth(xs: list[float], k: int = SMOOTH) -> list[float]:
    """Trailing mean over up to k steps."""
    return [sum(xs[max(0, i - k + 1) : i + 1]) / len(xs[max(0, i - k + 1) : i + 1]) for i in range(len(xs))]


def summarize(runs: dict[str, list[dict]], steps: int) -> dict:
    """Per side: the mean reward of the first tenth, the last tenth and every step (mean and std
    over seeds); SparrowRL's less TRL's at the same seed (mean and its standard error); times."""
    tenth = max(1, steps // 10)
    parts = {"first_tenth": slice(None, tenth), "last_tenth": slice(-tenth, None), "all_steps": slice(None)}
    per = {
        side: {k: torch.tensor([sum(r["reward"][at]) / len(r["reward"][at]) for r in rs]) for k, at in parts.items()}
        for side, rs in runs.items()
    }
    out = {}
    for side, rs in runs.items():
        row, n = {}, len(rs)
        for k, t in per[side].items():
            row[k], row[f"{k}_std"] = float(t.mean()), float(t.std()) if n > 1 else 0.0
            if side != "trl":
                d = t - per["trl"][k]
                row[f"{k}_vs_trl"], row[f"{k}_vs_trl_se"] = float(d.mean()), float(d.std()) / n**0.5 if n > 1 else 0.0
        row["wall_s"] = sum(r["wall_s"] for r in rs) / n  # the training loop's (TRL: train()), mean over seeds
        row["process_wall_s"] = sum(r["process_wall_s"] for r in rs) / n
        row["step_s_median"] = float(torch.tensor([x for r in rs for x in r["step_s"] if x is not None]).median())
        row["zero_variance_groups"] = sum(sum(r["zero_variance_groups"]) for r in rs) / sum(
            len(r["reward"]) for r in rs
        )
        out[side] = row
    return out


def plot(runs: dict[str, list[dict]], path: Path) -> None:
    """Left: each side's smoothed reward, mean ± std over seeds; right: SparrowRL less TRL, seed by seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {"trl": "TRL GRPOTrainer", "sparrowrl_skip": "SparrowRL (skip)", "sparrowrl_train": "SparrowRL (train)"}
    fig, (ax, dx) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    curves = {side: torch.tensor([smooth(r["reward"]) for r in rs]) for side, rs in runs.items()}
    for side, c in curves.items():
        mean, x = c.mean(0), range(1, c.shape[1] + 1)
        std = c.std(0) if len(c) > 1 else torch.zeros_like(mean)
        ax.plot(x, mean, label=f"{labels[side]} ({len(c)} seed{'s' if len(c) > 1 else ''})")
        ax.fill_between(x, mean - std, mean + std, alpha=0.2)
        if side != "trl":
            d = c - curves["trl"]
            dx.plot(x, d.mean(0), label=f"{labels[side]} − TRL, mean over seeds", color=ax.lines[-1].get_color())
            for row in d:
                dx.plot(x, row, color=ax.lines[-1].get_color(), alpha=0.25, linewidth=0.8)
    ax.set(xlabel="step", ylabel=f"reward (char_match), mean over {SMOOTH} steps")
    ax.set_title("GRPO on `add` from the same tiny Qwen3, staleness 0")
    dx.axhline(0, color="black", linewidth=0.8)
    dx.set(xlabel="step", ylabel="reward difference (same seed)", title="SparrowRL less TRL (faint: each seed)")
    for a in (ax, dx):
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "bench_trl_parity.json")
    p.add_argument("--plot", type=Path, default=ROOT / "docs" / "bench_trl_parity.png")
    p.add_argument("--quick", action="store_true", help="one seed, 20 steps, to try it")
    p.add_argument("--replot", action="store_true", help="only summarize and plot the runs already in --out")
    p.add_argument("--trl", type=Path, help=argparse.SUPPRESS)  # internal: the TRL side, from this folder
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--trl-out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trl:
        trl_side(args.trl, args.seed, args.steps, args.trl_out)
        return
    if args.replot:
        result = json.loads(args.out.read_text())
        result["summary"] = summarize(result["runs"], result["steps"])
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        plot(result["runs"], args.plot)
        return
    if not TRL_PYTHON.exists():
        raise SystemExit(f"{TRL_PYTHON}: missing; `make .venv-vllm/.installed` (what `make test-vllm` uses) makes it")
    if args.quick:
        args.seeds, args.steps = args.seeds[:1], 20
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="trl-parity-") as tmp:
        for seed in args.seeds:
            work = Path(tmp) / f"seed-{seed}"
            folder = work / "model"
            work.mkdir()
            start_model(seed, folder)
            print(f"seed {seed}: starting model in {folder}", flush=True)
            runs["trl"].append(run_trl(folder, seed, args.steps, work))
            for zv in ("skip", "train"):
                runs[f"sparrowrl_{zv}"].append(sparrowrl_side(folder, seed, args.steps, zv, work))
            for side in SIDES:
                r = runs[side][-1]
                print(
                    f"seed {seed} {side}: reward {r['reward'][0]:.3f} -> {r['reward'][-1]:.3f}, {r['wall_s']:.0f} s",
                    flush=True,
                )
            write(args, runs, time.perf_counter() - t_all)  # after each seed: a failed later one keeps these
    plot(runs, args.plot)
    print(json.dumps(json.loads(args.out.read_text())["summary"], indent=1))


def machine() -> str:
    cpu = next(
        (
            x.split(":", 1)[1].strip()
            for x in Path("/proc/cpuinfo").read_text().splitlines()
            if x.startswith("model name")
        ),
        platform.machine(),
    )
    return f"{cpu}, {os.cpu_count()} cores"


def write(args: argparse.Namespace, runs: dict[str, list[dict]], seconds: float) -> None:
    setup = {
        "hidden": HIDDEN,
        "layers": LAYERS,
        "heads": HEADS,
        "warmup_steps": WARMUP,
        "lr": LR,
        "group_size": GROUP,
        "prompts_per_step": PROMPTS,
        "max_new_tokens": MAX_NEW,
    }
    result = {
        "date": date.today().isoformat(),
        "machine": machine(),
        "seeds": args.seeds[: len(runs["trl"])],
        "steps": args.steps,
        "setup": setup,
        "summary": summarize(runs, args.steps),
        "total_s": seconds,
        "runs": runs,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
