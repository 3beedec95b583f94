"""reasoning-gym's procedural tasks as an environment: a data set generated offline from a seed,
each question scored by the task's own `score_answer`. A job names it as an installed module:

    task:
      environment:
        load: sparrowrl.agents.reasoning_gym
        args: {dataset: basic_arithmetic, size: 1000, config: {max_terms: 2}}

The trainer's reward processes generate the same data set from the same arguments, so a row's
index (its `info`) is all the rubric needs. Needs `pip install 'sparrowrl[reasoning-gym]'`."""

from __future__ import annotations

from typing import Any


class ReasoningGym:
    def __init__(self, dataset: str, size: int, seed: int, config: dict[str, Any], answer_tag: str | None):
        try:
            import reasoning_gym
        except ImportError:
            raise ValueError("reasoning-gym is not installed here: pip install 'sparrowrl[reasoning-gym]'") from None
        self.data = reasoning_gym.create_dataset(dataset, size=size, seed=seed, **config)
        self.tag = answer_tag
        self.dataset = [
            {"prompt": e["question"], "answer": str(e["answer"]), "info": {"index": i}} for i, e in enumerate(self.data)
        ]

    def env_response(self, messages: list[dict[str, str]], state: dict[str, Any]) -> list[dict[str, str]]:
        return []  # one turn: the answer

    def reward(self, prompt: Any, completion: list[dict[str, str]], answer: str, info: dict, **fields: Any) -> float:
        text = completion[-1]["content"]
        if self.tag is not None:
            from reasoning_gym.utils import extract_answer

            got = extract_answer(text, tag_name=self.tag)
        else:
            got = text.strip()
        return float(self.data.score_answer(answer=got, entry=self.data[info["index"]]))


def load_environment(
    dataset: str = "basic_arithmetic",
    size: int = 1000,
    seed: int = 0,
    config: dict[str, Any] | None = None,
    answer_tag: str | None = None,
) -> ReasoningGym:
    """`dataset`: a reasoning-gym task's name; `config`: its settings; `answer_tag`: read the
    answer from <tag>...</tag> in the model's reply (reasoning-gym's `extract_answer`), not the
    whole reply."""
    return ReasoningGym(dataset, size, seed, config or {}, answer_tag)
