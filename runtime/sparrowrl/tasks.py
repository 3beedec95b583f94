"""Verifiable tasks: prompts with known answers, and the reward of a completion.

Built-in tasks a tiny model learns on a CPU in minutes, whose rewards give partial credit per
character (so that a weak policy's samples differ in reward and GRPO has a signal), and user
tasks read from JSONL (`prompt`, `answer`) scored by exact match, by number, or by a function
given as `module:function` taking (prompt, completion, answer) and returning a float.
"""

from __future__ import annotations

import importlib
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

Reward = Callable[[str, str, str], float]


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str


def char_match(prompt: str, completion: str, answer: str) -> float:
    """Share of answer characters right at their position; extra characters count against."""
    if not answer:
        return float(completion == "")
    hits = sum(a == b for a, b in zip(completion, answer))
    return hits / max(len(answer), len(completion))


def exact(prompt: str, completion: str, answer: str) -> float:
    return float(completion.strip() == answer.strip())


def numeric(prompt: str, completion: str, answer: str) -> float:
    """1 when the completion reads as the answer's number (relative tolerance 1e-6)."""
    try:
        got, want = float(completion.strip()), float(answer.strip())
    except ValueError:
        return 0.0
    return float(math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9))


REWARDS: dict[str, Reward] = {"exact": exact, "numeric": numeric, "char_match": char_match}


def reward_function(name: str) -> Reward:
    """A named reward, or `module:function` importable from the job's Python path."""
    if name in REWARDS:
        return REWARDS[name]
    module, _, attr = name.partition(":")
    if not module or not attr:
        raise ValueError(f"reward '{name}': not one of {sorted(REWARDS)} and not module:function")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"reward '{name}': {e}") from None
    if not callable(fn):
        raise ValueError(f"reward '{name}': {attr} is not callable")
    return fn


class Task:
    """An endless, seeded stream of examples: example(i) is the same for every process."""

    default_reward = "exact"

    def __init__(self, seed: int):
        self.seed = seed

    def example(self, i: int) -> Example:
        raise NotImplementedError


N = 10  # operands below N

class Add(Task):
    """Sum of two digits: `7+8=` → `15`."""

    default_reward = "char_match"

    def example(self, i: int) -> Example:
        r = random.Random(self.seed * 1_000_003 + i)
        a, b = r.randrange(N), r.randrange(N)
        return Example(f"{a}+{b}=", str(a + b))


class Reverse(Task):
    """Reverse three letters of a..f: `abc<` → `cba`."""

    default_reward = "char_match"

    def example(self, i: int) -> Example:
        r = random.Random(self.seed * 1_000_003 + i)
        s = "".join(r.choice("abcdef") for _ in range(3))
        return Example(f"{s}<", s[::-1])


class Jsonl(Task):
    """User examples, cycled in a seeded order."""

    def __init__(self, seed: int, path: str | Path):
        super().__init__(seed)
        self.rows: list[Example] = []
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                self.rows.append(Example(str(row["prompt"]), str(row["answer"])))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: each line must be a JSON object with 'prompt' and 'answer' ({e})") from None
        if not self.rows:
            raise ValueError(f"{path}: no examples")
        self.order = list(range(len(self.rows)))
        random.Random(seed).shuffle(self.order)

    def example(self, i: int) -> Example:
        return self.rows[self.order[i % len(self.rows)]]


BUILTIN: dict[str, type[Task]] = {"add": Add, "reverse": Reverse}
