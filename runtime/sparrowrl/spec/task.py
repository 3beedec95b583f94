"""The job's `task`: where prompts and answers come from, how completions are scored, and the
held-out examples evaluated."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, ConfigDict, Field, model_validator

from sparrowrl.spec.section import Section, Text

REWARD = re.compile(r"exact|numeric|char_match|[A-Za-z_][A-Za-z0-9_]*:[A-Za-z_][A-Za-z0-9_]*|[^:]+\.py:[A-Za-z_]\w*")


def _reward(name: str) -> str:
    if not REWARD.fullmatch(name):
        raise ValueError(
            f"{name!r} is not exact, numeric, char_match, module:function (module.py beside the "
            f"job file) or FILE.py:function"
        )
    return name


FieldName = Annotated[str, Field(min_length=1, max_length=256)]
MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*|[^:]+\.py")
MAX_ENV_ARGS_CHARS = 65536  # its arguments as JSON
MAX_EPISODE_TOKENS = 16384  # of one episode, after its prompt: a sample travels in one request


def _module(name: str) -> str:
    if not MODULE.fullmatch(name.replace("-", "_")):
        raise ValueError(f"{name!r} is not an installed module's name (my_env) or a FILE.py beside the job file")
    return name


def _args(args: dict[str, Any]) -> dict[str, Any]:
    try:
        text = json.dumps(args, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"not plain JSON values ({e})") from None
    if len(text) > MAX_ENV_ARGS_CHARS:
        raise ValueError(f"{len(text):,} characters as JSON (limit {MAX_ENV_ARGS_CHARS:,})")
    return args


class EnvironmentSpec(Section):
    """An environment: multi-turn episodes, with tools or a game or a user played by code, as
    verifiers' environments are. Its data set supplies the prompts and its rubric the rewards."""

    load: Annotated[Text, AfterValidator(_module)] = Field(
        description=(
            "The environment's code: an installed module's name (as verifiers' load_environment takes it: "
            "my-env or my_env) or a FILE.py (relative to the job file), with a function "
            "load_environment(**args) that returns it (docs/environments.md)."
        )
    )
    args: Annotated[dict[str, Any], AfterValidator(_args)] = Field(
        {},
        description="Keyword arguments of load_environment.",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )
    max_turns: int = Field(8, ge=1, le=256, description="Model turns per episode at most; then it ends, truncated.")
    max_episode_tokens: int = Field(
        1024,
        ge=1,
        le=MAX_EPISODE_TOKENS,
        description=(
            "Tokens per episode after its prompt at most (the model's and the environment's turns): a turn that "
            "would go beyond ends it, truncated. Each model turn is also at most grpo.maxNewTokens."
        ),
    )
    episode_seconds: float = Field(
        300.0, gt=0, le=86400, description="An episode still running after this long ends, truncated."
    )
    turn_seconds: float = Field(
        30.0,
        gt=0,
        le=3600,
        description=(
            "The environment's turn (its reply, with its tool calls) at most: a turn that takes longer ends its "
            "episode with reward 0, and its process is replaced."
        ),
    )
    processes: int | None = Field(
        None, ge=1, le=64, description="Processes per worker that run the environment's turns; default: min(4, CPUs)."
    )
    tool_seconds: float = Field(
        10.0,
        gt=0,
        le=3600,
        description="A tool call at most: one that takes longer, or whose process dies, ends its episode (reward 0).",
    )
    tool_memory_mib: int = Field(
        1024, ge=64, le=1 << 20, alias="toolMemoryMiB", description="A tool call's address space at most, in MiB."
    )
    tool_output_chars: int = Field(
        8192, ge=1, le=1 << 18, description="A tool's answer beyond this is cut, and says so."
    )
    trust_worker_rewards: bool = Field(
        False,
        description=(
            "Use the workers' own scores, by the rubric with each episode's state, unchecked: for a rubric that "
            "needs state its transcript does not carry. Workers are not trusted otherwise (docs/environments.md)."
        ),
    )
    max_tool_calls: int = Field(
        8, ge=1, le=32, description="Tool calls in one model turn at most; the others are answered with an error."
    )


class DatasetSpec(Section):
    """A `datasets` data set: a local file or folder, or a name on the Hugging Face Hub."""

    path: Text = Field(
        description=(
            "A local file (.parquet, .json, .jsonl, .csv or .arrow), a folder of such files, a folder written by "
            "save_to_disk (relative to the job file), or a data set's name on the Hugging Face Hub (HF_ENDPOINT "
            "and HF_TOKEN are honoured)."
        )
    )
    name: Text | None = Field(None, description="The data set's configuration, if it has several.")
    split: Text = Field("train", description='The split, with datasets\' slicing if wanted: "train[:1000]".')
    prompt_field: FieldName = Field("prompt", description="The column that holds the prompt text.")
    answer_field: FieldName = Field("answer", description="The column that holds the answer.")
    messages_field: FieldName | None = Field(
        None,
        description="The column that holds chat messages ([{role, content}]): the prompt comes from it instead.",
    )


class EvalSpec(Section):
    """Held-out prompts that workers generate at a version and the trainer scores, never trains on."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.jsonl) || !has(self.dataset)",
                    "message": "give eval.jsonl or eval.dataset, not both",
                }
            ]
        }
    )
    jsonl: Text | None = Field(None, description="A file of held-out examples, as task.jsonl's.")
    dataset: DatasetSpec | None = Field(None, description="A data set of held-out examples, as task.dataset's.")
    prompts: int = Field(
        64,
        ge=1,
        le=65_536,
        description=(
            "How many: the first of the file or data set (an environment's: its eval_dataset), or, for a built-in "
            "task without either, examples training never draws."
        ),
    )
    every: int = Field(10, ge=1, le=10_000_000, description="Every this many versions (and at v0 and the last).")
    samples: int = Field(
        1, ge=1, le=256, description="Samples per prompt: pass@1 over them, and pass@k for k = samples."
    )
    decoding: Literal["greedy", "sampled"] = Field(
        "greedy", description="greedy: the most likely token each time; sampled: as rollouts sample (grpo's settings)."
    )

    @model_validator(mode="after")
    def _one_source(self) -> EvalSpec:
        if self.jsonl is not None and self.dataset is not None:
            raise ValueError("give eval.jsonl or eval.dataset, not both")
        return self


class TaskSpec(Section):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "(has(self.builtin) ? 1 : 0) + (has(self.jsonl) ? 1 : 0) + (has(self.dataset) ? 1 : 0) "
                    "+ (has(self.environment) ? 1 : 0) == 1",
                    "message": "give exactly one of task.builtin, task.jsonl, task.dataset and task.environment",
                },
                {
                    "rule": "!has(self.environment) || !has(self.reward)",
                    "message": "an environment brings its own rubric: give no task.reward",
                },
                {
                    "rule": "!has(self.environment) || !has(self.eval) || (!has(self.eval.jsonl) && "
                    "!has(self.eval.dataset))",
                    "message": "an environment's eval examples are its eval_dataset: give no eval.jsonl or "
                    "eval.dataset",
                },
                {
                    "rule": "!has(self.eval) || has(self.eval.jsonl) || has(self.eval.dataset) || has(self.builtin) "
                    "|| has(self.environment)",
                    "message": "eval: give eval.jsonl or eval.dataset (held-out examples are drawn only for a "
                    "built-in task)",
                },
            ]
        }
    )
    builtin: Literal["add", "reverse"] | None = None
    jsonl: Text | None = Field(
        None, description='A file of {"prompt", "answer", ...} or {"messages", "answer", ...} lines.'
    )
    dataset: DatasetSpec | None = None
    environment: EnvironmentSpec | None = Field(
        None, description="Multi-turn episodes from an environment's code: its data set, turns and rubric."
    )
    reward: Annotated[Text, AfterValidator(_reward)] | None = Field(
        None,
        description=(
            "exact | numeric | char_match | module:function, where module.py is a file beside the job file "
            "(or FILE.py:function, relative to it): code the trainer runs, called as fn(prompt, completion, "
            "answer, **fields) with the example's other fields. Default: the built-in task's own, exact for "
            "JSONL and data sets."
        ),
    )
    chat_template: bool | None = Field(
        None,
        description=(
            "Render prompts with the tokenizer's chat template. Unset: when the tokenizer has one; true: "
            "required; false: never."
        ),
    )
    system_prompt: Annotated[str, Field(max_length=65536)] | None = Field(
        None,
        description=(
            "Prepended to each prompt: as a system message under a chat template (unless the example has its "
            "own), else as text and a newline."
        ),
    )
    max_prompt_tokens: int = Field(
        2048, ge=1, le=131072, description="An example whose rendered prompt is longer is a bad row."
    )
    on_bad_row: Literal["refuse", "skip"] = Field(
        "refuse",
        description="A bad example (unreadable, incomplete, too long) stops the job at start, or is counted and "
        "skipped.",
    )
    reward_workers: int | None = Field(
        None, ge=1, le=64, description="Processes that run a user's reward in parallel; default: min(4, CPUs)."
    )
    reward_timeout_seconds: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="A user's reward call that takes longer is stopped; its sample scores 0 and is counted.",
    )

    eval: EvalSpec | None = Field(
        None, description="Held-out evaluation: pass@1 (and pass@k) per version, in metrics, status and plots."
    )

    @model_validator(mode="after")
    def _one_source(self) -> TaskSpec:
        if sum(x is not None for x in (self.builtin, self.jsonl, self.dataset, self.environment)) != 1:
            raise ValueError("give exactly one of task.builtin, task.jsonl, task.dataset and task.environment")
        if self.environment is not None and self.reward is not None:
            raise ValueError("an environment brings its own rubric: give no task.reward")
        if self.environment is not None and self.eval is not None and (self.eval.jsonl or self.eval.dataset):
            raise ValueError("an environment's eval examples are its eval_dataset: give no eval.jsonl or eval.dataset")
        e = self.eval
        if e is not None and e.jsonl is None and e.dataset is None and self.builtin is None and not self.environment:
            raise ValueError(
                "eval: give eval.jsonl or eval.dataset (held-out examples are drawn only for a built-in task)"
            )
        return self
