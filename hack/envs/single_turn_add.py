"""The built-in add task (two digits summed, char_match reward) as a one-turn environment: what
hack/bench_environment.py runs through the environment layer against the single-turn path."""

import random


def char_match(got: str, want: str) -> float:
    if not want:
        return float(got == "")
    return sum(a == b for a, b in zip(got, want)) / max(len(want), len(got))


class SingleTurnAdd:
    def __init__(self, examples: int, seed: int):
        r = random.Random(seed)
        self.dataset = []
        for _ in range(examples):
            a, b = r.randrange(10), r.randrange(10)
            self.dataset.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})

    def env_response(self, messages, state):
        return []

    def reward(self, prompt, completion, answer, **fields):
        return char_match(completion[-1]["content"], answer)


def load_environment(examples: int = 2000, seed: int = 0) -> SingleTurnAdd:
    return SingleTurnAdd(examples, seed)
