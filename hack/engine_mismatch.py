"""The engine mismatch: how far a rollout engine's behaviour log-probs are from the trainer's own
log-probs of the same tokens, on the same weights. Sync makes the weights bit-exact; the numbers
the two sides compute from them still differ (bf16 kernels against the trainer's fp32, and one
engine's kernels against another's). That gap is what an off-policy correction has to absorb.

Run it in the vLLM venv (`make .venv-vllm/.installed` sets it up):

    .venv-vllm/bin/python hack/engine_mismatch.py [--job examples/local-job.yaml] [--out FILE]

It builds the job's tiny model with its warm-up (what `make demo` starts from), loads the bf16
policy into the hf and vllm engines, samples with each at the job's sampling settings, and scores
every sampled token with the trainer's own function (`trainer/grpo.py` `token_logprobs`, fp32
master weights) and with the hf engine's bf16 model. It prints per-token |Δ| (nats) and the
sequence-level log-ratio, with this machine's CPU beside them: the figures are one CPU's."""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from sparrowrl.spec.job import load
from sparrowrl.trainer import grpo, models, tasks
from sparrowrl.worker.engines import Prompt, Sampling
from sparrowrl.worker.engines.hf import HFEngine
from sparrowrl.worker.engines.vllm import VLLMEngine

KERNEL_ENV = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")  # set: another CPU's code


def cpu() -> dict:
    info = {"machine": platform.machine(), "model": platform.processor() or "?", "avx512": False}
    info["kernels"] = torch.backends.cpu.get_cpu_capability()  # what PyTorch dispatches to (ATEN_CPU_CAPABILITY)
    info["env"] = {k: os.environ[k] for k in KERNEL_ENV if k in os.environ}
    try:
        text = Path("/proc/cpuinfo").read_text()
        info["model"] = next(
            line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")
        )
        info["avx512"] = " avx512f" in text
    except (OSError, StopIteration):
        pass
    return info


@torch.inference_mode()
def scored(model: torch.nn.Module, prompt: list[int], tokens: list[int], temperature: float) -> list[float]:
    ids = torch.tensor([prompt + tokens])
    return grpo.token_logprobs(model, ids, torch.ones_like(ids), len(prompt), temperature)[0].tolist()


def figures(a: list[float], b: list[float], seqs: list[tuple[int, int]]) -> dict:
    """a − b per token (nats), and per sequence the sum: the log of the importance ratio b/a."""
    d = np.array(a) - np.array(b)
    per_seq = np.array([d[i:j].sum() for i, j in seqs])
    ad = np.abs(d)
    return {
        "tokens": int(d.size),
        "abs_mean": float(ad.mean()),
        "abs_p50": float(np.percentile(ad, 50)),
        "abs_p99": float(np.percentile(ad, 99)),
        "abs_max": float(ad.max()),
        "mean": float(d.mean()),
        "ratio_outside_0.8_1.2": float(((np.exp(-d) < 0.8) | (np.exp(-d) > 1.2)).mean()),
        "seq_abs_max": float(np.abs(per_seq).max()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--job", default="examples/local-job.yaml")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument(
        "--sharp",
        action="store_true",
        help="no warm-up: weights drawn N(0, 0.2), embeddings N(0, 1), as the vLLM tests' model: large logits",
    )
    ap.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = ap.parse_args()
    con = Console(stderr=True)

    spec = load(args.job).spec
    t = spec.model.tiny
    if t is None:
        raise SystemExit(f"{args.job}: spec.model.tiny: this measure builds the job's tiny model")
    tok = models.char_tokenizer()
    prompts = models.Prompts.for_job(spec, tok)
    task, _ = tasks.for_job(spec, prompts)
    trainer = models.tiny_qwen3(len(tok), t.hidden, t.layers, t.heads, spec.seed)
    if args.sharp:
        with torch.no_grad():
            for name, p in trainer.named_parameters():
                if p.dim() == 2:
                    p.normal_(0, 1.0 if "embed" in name else 0.2)
    else:
        with con.status(f"warm-up: {t.warmup_steps} steps"):
            models.warm_up(trainer, prompts, task, t.warmup_steps)
    trainer.eval()
    policy = models.policy_state(trainer)

    g = spec.grpo
    sampling = Sampling(g.group_size, g.max_new_tokens, g.temperature, g.top_p, g.top_k, tuple(g.stop))
    batch = [Prompt(prompts.ids(task.example(i).prompt), i) for i in range(args.prompts)]
    with tempfile.TemporaryDirectory() as folder:
        trainer.config.save_pretrained(folder)
        tok.save_pretrained(folder)
        hf = HFEngine(folder)
        with con.status("starting vLLM"):
            vllm = VLLMEngine(folder)
        for engine in (hf, vllm):
            for n, x in engine.tensors().items():
                x.copy_(policy[n])
            engine.commit()
        results = {}
        for name, engine in (("hf", hf), ("vllm", vllm)):
            with con.status(f"{name}: sampling {len(batch)} groups of {g.group_size}"):
                groups = engine.generate(batch, sampling)
            behaviour, fp32, bf16, seqs = [], [], [], []
            for p, group in zip(batch, groups):
                for s in group:
                    seqs.append((len(behaviour), len(behaviour) + len(s.tokens)))
                    behaviour += s.logprobs
                    fp32 += scored(trainer, p.ids, s.tokens, g.temperature)
                    bf16 += scored(hf.model, p.ids, s.tokens, g.temperature)
            results[name] = {"vs_trainer_fp32": figures(behaviour, fp32, seqs)}
            if name == "vllm":
                results[name]["vs_hf_bf16"] = figures(behaviour, bf16, seqs)

    what = "sharp weights" if args.sharp else f"{args.job} after its warm-up"
    table = Table(title=f"behaviour log-probs − the reference's, nats ({what}; {cpu()['model']})")
    for col in ("engine", "reference", "tokens", "mean |Δ|", "p99 |Δ|", "max |Δ|", "mean Δ", "max |ΣΔ| seq"):
        table.add_column(col, justify="left" if col in ("engine", "reference") else "right")
    for name, against in results.items():
        for ref, f in against.items():
            table.add_row(
                name,
                ref.removeprefix("vs_").replace("_", " "),
                str(f["tokens"]),
                f"{f['abs_mean']:.4f}",
                f"{f['abs_p99']:.4f}",
                f"{f['abs_max']:.4f}",
                f"{f['mean']:+.4f}",
                f"{f['seq_abs_max']:.4f}",
            )
    Console().print(table)
    out = {
        "job": args.job,
        "weights": "sharp" if args.sharp else "warmed",
        "cpu": cpu(),
        "torch": torch.__version__,
        "sampling": sampling.__dict__,
        **results,
    }
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
