"""A tool environment, written as verifiers' ToolEnv is: the model multiplies two-digit numbers
and may ask a calculator. The tool is a plain Python function; SparrowRL runs each call in a
process of its own, behind its limits (docs/environments.md, "Tools").

A model with a chat template calls tools in Hermes' format (<tool_call>{"name": "calc",
"arguments": {"expression": "37*58"}}</tool_call>), which SparrowRL reads by default. The tiny
model's characters cannot write that, so this environment reads calls its own way
(`parse_tool_calls`): a turn that ends with "?" asks the calculator, as in "37*58?".

The tiny model knows nothing: its warm-up (standing in for pretraining) teaches each row's
`answer`, so here `answer` is the first move (ask the calculator), and the rubric reads the true
product from `info`.

    task:
      environment:
        load: envs/calculator.py
"""

import ast
import operator
import random

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calc(expression: str) -> str:
    """Evaluate an arithmetic expression of integers, +, - and *.

    Args:
        expression: the expression, such as 37*58
    """

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"not arithmetic: {ast.unparse(node)}")

    return str(value(ast.parse(expression, mode="eval").body))


def char_match(got: str, want: str) -> float:
    hits = sum(a == b for a, b in zip(got, want))
    return hits / max(len(want), len(got), 1)


class Calculator:
    tools = [calc]

    def __init__(self, examples: int, seed: int):
        r = random.Random(seed)
        self.dataset = []
        for _ in range(examples):
            a, b = r.randrange(10, 100), r.randrange(10, 100)
            self.dataset.append({"prompt": f"{a}*{b}=", "answer": f"{a}*{b}?", "info": {"product": a * b}})

    def parse_tool_calls(self, text):
        text = text.strip()
        return [("calc", {"expression": text[:-1]})] if text.endswith("?") else []

    def reward(self, prompt, completion, answer, info, **fields):
        """The final answer against the product, by character; a little for asking the calculator."""
        asked = any(m["role"] == "tool" for m in completion)
        return 0.8 * char_match(completion[-1]["content"].strip(), str(info["product"])) + 0.2 * asked


def load_environment(examples: int = 1000, seed: int = 0) -> Calculator:
    return Calculator(examples, seed)
