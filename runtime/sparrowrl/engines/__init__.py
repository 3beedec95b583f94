"""Rollout engines. Each holds the bf16 policy, exposes its parameters as the trainer names them
(so a delta applies straight into them), and samples groups of completions with their
behaviour log-probs."""

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
        """The live policy weights, by the trainer's names; writing them changes the policy."""

    def generate(self, prompt: list[int], n: int, seed: int, max_new_tokens: int,
                 temperature: float) -> list[Sample]:
        """n samples of one prompt, reproducible from `seed` and the weights."""


def make_engine(kind: str, model_dir: str) -> Engine:
    if kind == "hf":
        from sparrowrl.engines.hf import HFEngine
        return HFEngine(model_dir)
    raise ValueError(f"unknown engine {kind!r}")
