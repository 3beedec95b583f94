"""What every rollout engine offers and takes (see the package's docstring for how they sample)."""

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
