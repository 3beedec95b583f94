"""A two-turn arithmetic dialogue, written as verifiers writes a multi-turn environment: the
model adds two digits, then the environment asks it to add a third digit to its own first answer,
so the second question depends on the first reply. The rubric scores both answers from the
transcript, with partial credit per character so that a weak policy's samples differ.

    task:
      environment:
        load: envs/two_turn_sum.py
        args: {examples: 1000}
"""

import random


def char_match(got: str, want: str) -> float:
    hits = sum(a == b for a, b in zip(got, want))
    return hits / max(len(want), len(got), 1)


def dialogues(n: int, seed: int) -> list[dict]:
    r = random.Random(seed)
    out = []
    for _ in range(n):
        a, b, c = r.randrange(10), r.randrange(10), r.randrange(10)
        out.append({"prompt": f"{a}+{b}=", "answer": str(a + b), "info": {"then": c}})
    return out


class TwoTurnSum:
    def __init__(self, examples: int, seed: int):
        self.dataset = dialogues(examples, seed)
        self.eval_dataset = dialogues(64, seed + 1)  # task.eval's held-out dialogues

    def env_response(self, messages, state):
        """After the model's first answer, the next question; after its second, the end."""
        if state["turn"] >= 2:
            return []
        return [{"role": "user", "content": f"{messages[-1]['content'].strip()}+{state['info']['then']}="}]

    def reward(self, prompt, completion, answer, info, **fields):
        first = completion[0]["content"].strip()
        score = 0.5 * char_match(first, answer)
        if len(completion) == 3 and first.isdigit():
            score += 0.5 * char_match(completion[2]["content"].strip(), str(int(first) + info["then"]))
        return score


def load_environment(examples: int = 1000, seed: int = 0) -> TwoTurnSum:
    return TwoTurnSum(examples, seed)
