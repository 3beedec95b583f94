"""single_turn_add.py written with verifiers (a vf.SingleTurnEnv with a vf.Rubric): what
hack/bench_environment.py runs through verifiers' own hooks (agents/classic.py)."""

import random

import verifiers as vf
from datasets import Dataset


def char_match(completion, answer) -> float:
    got = completion[-1].content
    if not answer:
        return float(got == "")
    return sum(a == b for a, b in zip(got, answer)) / max(len(answer), len(got))


def load_environment(examples: int = 2000, seed: int = 0) -> vf.Environment:
    r = random.Random(seed)
    rows = []
    for _ in range(examples):
        a, b = r.randrange(10), r.randrange(10)
        rows.append({"question": f"{a}+{b}=", "answer": str(a + b)})
    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[char_match]))
