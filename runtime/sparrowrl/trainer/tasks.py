"""Verifiable tasks: prompts with known answers, and the reward of a completion.

Built-in tasks a tiny model learns on a CPU in minutes, whose rewards give partial credit per
character (so that a weak policy's samples differ in reward and GRPO has a signal), and user
tasks read from JSONL (`prompt`, `answer`) scored by exact match, by number, or by a function
in a file beside the job (`module:function`, resolved by the job loader to FILE.py:function)
taking (prompt, completion, answer) and returning a float.
"""

from __future__ import annotations

import importlib.util
import json
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from sparrowrl.spec.limits import MAX_TASK_BYTES, read_bounded

if TYPE_CHECKING:
    from sparrowrl.spec.job import JobSpec

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
    """A named reward, or FILE.py:function (`module:function`: module.py in the current folder).

    Loaded from the file itself under a name of its own, never imported from the Python path:
    a job cannot name an arbitrary installed callable (`os:system`), and a file beside the job
    cannot shadow the standard library. The file's folder goes last on the path, for its own
    helper modules. It is code the trainer runs: the job's author is trusted with it."""
    if name in REWARDS:
        return REWARDS[name]
    file, _, attr = name.rpartition(":")
    if not file or not attr.isidentifier():
        raise ValueError(f"reward '{name}': not one of {sorted(REWARDS)} and not module:function")
    path = Path(file if file.endswith(".py") else file + ".py").resolve()
    if not path.is_file():
        raise ValueError(f"reward '{name}': no file {path} (a reward module is a .py file beside the job file)")
    module_name = f"sparrowrl_reward_{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[module_name]
        raise ValueError(f"reward '{name}': loading {path.name} failed: {type(e).__name__}: {e}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward '{name}': {path.name} defines no function {attr}")
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
        try:
            text = read_bounded(path, MAX_TASK_BYTES, "a JSONL task file").decode()
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        self.rows: list[Example] = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                self.rows.append(Example(str(row["prompt"]), str(row["answer"])))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(
                    f"{path}:{n}: each line must be a JSON object with 'prompt' and 'answer' ({e})"
                ) from None
        if not self.rows:
            raise ValueError(f"{path}: no examples")
        self.order = list(range(len(self.rows)))
        random.Random(seed).shuffle(self.order)

    def example(self, i: int) -> Example:
        return self.rows[self.order[i % len(self.rows)]]


BUILTIN: dict[str, type[Task]] = {"add": Add, "reverse": Reverse}


def for_job(spec: JobSpec) -> tuple[Task, Reward]:
    """The job's task and its reward function (a user's file is read here: errors name it)."""
    t = spec.task
    task = BUILTIN[t.builtin](spec.seed) if t.builtin else Jsonl(spec.seed, t.jsonl)
    return task, reward_function(t.reward or task.default_reward)
