"""The two-turn arithmetic dialogue of two_turn_sum.py, written with verifiers itself (pip install
'sparrowrl[verifiers]'): a vf.MultiTurnEnv whose env_response asks the model to add a third digit
to its own first answer, a data set of verifiers' columns, and a vf.Rubric of two reward
functions. SparrowRL drives it through verifiers' own hooks (docs/environments.md).

    task:
      environment:
        load: envs/vf_two_turn_sum.py
        args: {examples: 1000}
"""

import random

import verifiers as vf
from datasets import Dataset


def char_match(got: str, want: str) -> float:
    hits = sum(a == b for a, b in zip(got, want))
    return hits / max(len(want), len(got), 1)


class TwoTurnSum(vf.MultiTurnEnv):
    async def env_response(self, messages: vf.Messages, state: vf.State, **kwargs) -> vf.Messages:
        return [vf.UserMessage(content=f"{messages[-1].content.strip()}+{state['info']['then']}=")]


def first(completion, answer) -> float:
    """The first answer, a character at a time."""
    return char_match(completion[0].content.strip(), answer)


def second(completion, info) -> float:
    """The second answer: the first plus the environment's digit (nothing without a first number)."""
    got = completion[0].content.strip()
    if len(completion) < 3 or not got.isdigit():
        return 0.0
    return char_match(completion[2].content.strip(), str(int(got) + info["then"]))


def dialogues(n: int, seed: int) -> Dataset:
    r = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b, c = r.randrange(10), r.randrange(10), r.randrange(10)
        rows.append({"question": f"{a}+{b}=", "answer": str(a + b), "info": {"then": c}})
    return Dataset.from_list(rows)


def load_environment(examples: int = 1000, seed: int = 0) -> vf.Environment:
    return TwoTurnSum(
        dataset=dialogues(examples, seed),
        eval_dataset=dialogues(64, seed + 1),
        rubric=vf.Rubric(funcs=[first, second], weights=[0.5, 0.5]),
        max_turns=2,
    )
