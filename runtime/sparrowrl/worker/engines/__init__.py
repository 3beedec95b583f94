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

from dataclasses import dataclass
from typing import Protocol

import torch

FINISH = ("eos", "stop", "length")  # why a completion ended: an EOS token, a stop string, or its length


@dataclass
class Sample:
    tokens: list[int]  # completion token ids, ending with EOS or a stop string unless cut at max_new_tokens
    logprobs: list[float]  # behaviour log-probs of those tokens at the sampling temperature
    finish: str  # one of FINISH: "length" is a completion cut at max_new_tokens (or at maxModelLen)


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    seed: int  # the group's: its samples depend only on the weights, not on what else is generated


@dataclass(frozen=True)
class Sampling:
    """How every group of a lease is sampled: the job's grpo fields."""

    n: int
    max_new_tokens: int
    temperature: float
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    stop: tuple[str, ...] = ()


class Engine(Protocol):
    def tensors(self) -> dict[str, torch.Tensor]:
        """The policy by the trainer's names, where deltas and full states are written."""

    def commit(self) -> None:
        """Make what `tensors()` holds the policy that `generate` samples from."""

    def readback(self) -> dict[str, torch.Tensor]:
        """The weights `generate` computes with, mapped back to the trainer's names (for the hash)."""

    def generate(self, prompts: list[Prompt], sampling: Sampling) -> list[list[Sample]]:
        """`sampling.n` samples of each prompt, in order, each group reproducible from its seed
        and the weights."""


def make_engine(kind: str, model_dir: str, max_model_len: int | None = None, tensor_parallel_size: int = 1) -> Engine:
    if kind == "hf":
        from sparrowrl.worker.engines.hf import HFEngine

        return HFEngine(model_dir, max_model_len, tensor_parallel_size)
    if kind == "vllm":
        from sparrowrl.worker.engines.vllm import VLLMEngine

        return VLLMEngine(model_dir, max_model_len, tensor_parallel_size)
    raise ValueError(f"unknown engine {kind!r}")
