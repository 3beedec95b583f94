"""Rollout engines. Each exposes the bf16 policy as the trainer names it (a delta applies straight
into those tensors), makes them live with `commit`, reads back what it really computes with for
verification, and samples a lease's groups of completions with their behaviour log-probs.

Both engines sample alike: temperature, then top-k, then top-p (nucleus), and a completion ends
at its first EOS, at the token that completes a stop string in its text (kept: the trainer
scores exactly the tokens sampled), or at `max_new_tokens`. The behaviour log-probs are of the
full distribution at the sampling temperature, not of the top-k/top-p truncated one, as the
trainer computes its own (`trainer/grpo.py` `token_logprobs`): they divide the trainer's in the
behaviour weight, and the trainer refuses a sample whose numbers are too far from its own. They
are the engine's numbers, not the trainer's: bf16 kernels put them a little apart (docs/rl.md,
the engine mismatch and the objective)."""

from __future__ import annotations

from sparrowrl.worker.engines.base import FINISH, Engine, Prompt, Sample, Sampling

__all__ = ["FINISH", "Engine", "Prompt", "Sample", "Sampling", "make_engine"]


def make_engine(kind: str, model_dir: str, max_model_len: int | None = None, tensor_parallel_size: int = 1) -> Engine:
    if kind == "hf":
        from sparrowrl.worker.engines.hf import HFEngine

        return HFEngine(model_dir, max_model_len, tensor_parallel_size)
    if kind == "vllm":
        from sparrowrl.worker.engines.vllm import VLLMEngine

        return VLLMEngine(model_dir, max_model_len, tensor_parallel_size)
    raise ValueError(f"unknown engine {kind!r}")
