"""Rollout engines. Each exposes the bf16 policy as the trainer names it (a delta applies straight
into those tensors), makes them live with `commit`, reads back what it really computes with for
verification, and samples groups of completions with their behaviour log-probs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class Sample:
    tokens: list[int]  # completion token ids, ending with EOS unless cut at max_new_tokens
    logprobs: list[float]  # behaviour log-probs of those tokens at the sampling temperature


class Engine(Protocol):
    def tensors(self) -> dict[str, torch.Tensor]:
        """The policy by the trainer's names, where deltas and full states are written."""

    def commit(self) -> None:
        """Make what `tensors()` holds the policy that `generate` samples from."""

    def readback(self) -> dict[str, torch.Tensor]:
        """The weights `generate` computes with, mapped back to the trainer's names (for the hash)."""

    def generate(self, prompt: list[int], n: int, seed: int, max_new_tokens: int, temperature: float) -> list[Sample]:
        """n samples of one prompt, reproducible from `seed` and the weights."""


def make_engine(kind: str, model_dir: str) -> Engine:
    if kind == "hf":
        from sparrowrl.worker.engines.hf import HFEngine

        return HFEngine(model_dir)
    if kind == "vllm":
        from sparrowrl.worker.engines.vllm import VLLMEngine

        return VLLMEngine(model_dir)
    raise ValueError(f"unknown engine {kind!r}")
