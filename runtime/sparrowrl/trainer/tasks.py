"""Verifiable tasks: prompts with known answers, and the reward of a completion.

Built-in tasks a tiny model learns on a CPU in minutes, whose rewards give partial credit per
character (so that a weak policy's samples differ in reward and GRPO has a signal), and user
tasks: lines of a JSONL file or rows of a `datasets` data set (local, or downloaded from the
Hugging Face Hub into the state dir by hub.py), each a plain prompt or chat messages, an answer,
and any other fields, which go to the reward. Every user example is read, rendered
(models.Prompts) and checked once, at start: a bad one stops the job, named by its line or row
and the reason, or is counted and skipped (task.onBadRow).

A reward is exact, numeric, char_match, or a function in a file beside the job
(`module:function`, resolved by the job loader to FILE.py:function), called as
fn(prompt, completion, answer, **fields) and returning a number. rewards.py runs it.
"""

from __future__ import annotations

import importlib.util
import inspect
import itertools
import json
import math
import random
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol

from sparrowrl.agents import environment
from sparrowrl.cachedir import own, writable
from sparrowrl.spec.limits import MAX_TASK_BYTES, read_bounded
from sparrowrl.trainer.hub import dataset_repo

if TYPE_CHECKING:
    from sparrowrl.spec.job import JobSpec
    from sparrowrl.spec.task import DatasetSpec, EnvironmentSpec, TaskSpec

Reward = Callable[..., float]
ROLES = ("system", "user", "assistant")
ARGUMENTS = ("prompt", "completion", "answer")  # a reward's own: fields of these names are not passed


@dataclass(frozen=True)
class Source:
    """An example as the data holds it: a plain prompt or chat messages ((role, content), ...)."""

    prompt: str | None
    messages: tuple[tuple[str, str], ...] | None
    answer: str
    fields: dict = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class Example:
    """An example as the policy sees it: `prompt` is the rendered text (what a reward gets)."""

    prompt: str
    answer: str
    fields: dict = field(default_factory=dict, hash=False)
    messages: tuple[tuple[str, str], ...] = field(default=(), compare=False)  # the prompt's (an environment's)

    def shown(self) -> dict:
        """What an episode's environment is shown of it (a lease carries it to the worker): the
        prompt's messages, the answer and the row's other fields."""
        messages = [{"role": r, "content": c} for r, c in self.messages]
        return {"messages": messages, "answer": self.answer, "fields": self.fields}


class Prompts(Protocol):
    """How examples are rendered for the job's tokenizer (models.Prompts)."""

    def render(self, src: Source) -> Example: ...

    def ids(self, text: str) -> list[int]: ...

    @property
    def templated(self) -> bool: ...

    def with_tools(self, tools: list) -> Prompts: ...


def char_match(prompt: str, completion: str, answer: str, **fields) -> float:
    """Share of answer characters right at their position; extra characters count against."""
    if not answer:
        return float(completion == "")
    hits = sum(a == b for a, b in zip(completion, answer))
    return hits / max(len(answer), len(completion))


def exact(prompt: str, completion: str, answer: str, **fields) -> float:
    return float(completion.strip() == answer.strip())


def numeric(prompt: str, completion: str, answer: str, **fields) -> float:
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
    if spec is None or spec.loader is None:  # a .py file's has both
        raise ValueError(f"reward '{name}': {path.name} cannot be loaded as a module")
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


def check_reward(fn: Reward, name: str, field_sets: Iterable[frozenset[str]]) -> None:
    """The reward takes (prompt, completion, answer) and each example's fields by keyword:
    checked once, at start, not found out by a failing call per sample."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a callable without a signature to read: its calls will tell
        return
    for names in sorted(field_sets, key=sorted):
        try:
            sig.bind("", "", "", **dict.fromkeys(names))
        except TypeError as e:
            has = f"the fields {', '.join(sorted(names))}" if names else "no other fields"
            raise ValueError(
                f"reward '{name}' cannot be called as fn(prompt, completion, answer, **fields) for examples with "
                f"{has}: {e} (give it **fields, or a parameter with a default for each field)"
            ) from None


class Task:
    """An endless, seeded stream of rendered examples: example(i) is the same for every process."""

    default_reward = "exact"

    def __init__(self, seed: int, prompts: Prompts):
        self.seed, self.prompts = seed, prompts
        self.skipped: str | None = None  # one line on the bad examples skipped, if any were
        self.field_sets: set[frozenset[str]] = {frozenset()}  # the examples' field names, each set once

    def example(self, i: int) -> Example:
        return self.prompts.render(self.source(i))

    def source(self, i: int) -> Source:
        raise NotImplementedError


N = 10  # operands below N


class Add(Task):
    """Sum of two digits: `7+8=` → `15`."""

    default_reward = "char_match"

    def source(self, i: int) -> Source:
        r = random.Random(self.seed * 1_000_003 + i)
        a, b = r.randrange(N), r.randrange(N)
        return Source(f"{a}+{b}=", None, str(a + b))


class Reverse(Task):
    """Reverse three letters of a..f: `abc<` → `cba`."""

    default_reward = "char_match"

    def source(self, i: int) -> Source:
        r = random.Random(self.seed * 1_000_003 + i)
        s = "".join(r.choice("abcdef") for _ in range(3))
        return Source(f"{s}<", None, s[::-1])


BUILTIN: dict[str, type[Task]] = {"add": Add, "reverse": Reverse}


def _kind(x: object) -> str:
    return {dict: "an object", list: "a list", bool: "a boolean", type(None): "null"}.get(type(x), type(x).__name__)


def source(row: object, prompt_key: str | None, messages_key: str | None, answer_key: str) -> Source | str:
    """One example from a JSONL line's object or a data set's row, or why it is not one."""
    if not isinstance(row, dict):
        return f"{_kind(row)}, not a JSON object"
    p = row.get(prompt_key) if prompt_key else None
    m = row.get(messages_key) if messages_key else None
    if p is None and m is None:
        return "no " + " and no ".join(repr(k) for k in (prompt_key, messages_key) if k)
    if p is not None and m is not None:
        return f"both {prompt_key!r} and {messages_key!r}: give one"
    a = row.get(answer_key)
    if a is None:
        return f"no {answer_key!r}"
    if isinstance(a, bool) or not isinstance(a, (str, int, float)):
        return f"{answer_key!r} is {_kind(a)}, not a string or a number"
    fields = {k: v for k, v in row.items() if k not in (prompt_key, messages_key, answer_key, *ARGUMENTS)}
    if p is not None:
        if not isinstance(p, str):
            return f"{prompt_key!r} is {_kind(p)}, not a string"
        return Source(p, None, str(a), fields)
    if not isinstance(m, list) or not m:
        return f"{messages_key!r} is not a list of messages"
    messages = []
    for i, x in enumerate(m):
        if not isinstance(x, dict) or not isinstance(x.get("content"), str):
            return f'{messages_key}[{i}] is not a message {{"role": ..., "content": "text"}}'
        if x.get("role") not in ROLES:
            return f"{messages_key}[{i}]: role {x.get('role')!r} is not one of {', '.join(ROLES)}"
        messages.append((x["role"], x["content"]))
    if all(r != "user" for r, _ in messages):
        return f"{messages_key!r} has no user message"
    return Source(None, tuple(messages), str(a), fields)


def jsonl(path: str | Path) -> Iterator[tuple[str, Source | str]]:
    """(FILE:LINE, the line's example or why it is not one) for each line that is not blank."""
    try:
        text = read_bounded(path, MAX_TASK_BYTES, "a JSONL task file").decode()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            yield f"{path}:{n}", f"not JSON ({e})"
            continue
        except RecursionError:
            yield f"{path}:{n}", "JSON nested too deeply"
            continue
        yield f"{path}:{n}", source(row, "prompt", "messages", "answer")


DATA_FILES = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv", ".arrow": "arrow"}


def dataset(d: DatasetSpec) -> tuple[str, Iterator[tuple[str, Source | str]]]:
    """A data set's name for messages, and (NAME row I, its example or why not) for each row. A
    local file or folder: a data set from the hub is read from its download (hub.localize)."""
    try:
        import datasets  # only a job with a data set pays for importing it
    except ImportError:
        raise ValueError(
            "dataset: the datasets package is not installed here (it comes with sparrowrl[runtime])"
        ) from None

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    what = f"{d.path}{f' ({d.name})' if d.name else ''} [{d.split}]"
    path = Path(d.path)
    # where it caches what it reads: under HOME, unless that cannot be written (sparrowrl.cachedir)
    cache = None if writable(datasets.config.HF_DATASETS_CACHE) else own("datasets")
    try:
        if path.is_dir() and any((path / f).is_file() for f in ("state.json", "dataset_dict.json")):
            data = datasets.load_from_disk(str(path))  # written by save_to_disk
            if isinstance(data, datasets.DatasetDict):
                if d.split not in data:
                    raise ValueError(f"no split {d.split!r} (it has {', '.join(data)})")
                data = data[d.split]
        elif path.is_file():
            if path.suffix not in DATA_FILES:
                raise ValueError(f"a data file is {', '.join(DATA_FILES)}")
            data = datasets.load_dataset(DATA_FILES[path.suffix], data_files=str(path), split=d.split, cache_dir=cache)
        elif path.is_dir():  # a folder of data files: the user's, or one downloaded from the hub (hub.py)
            data = datasets.load_dataset(str(path), d.name, split=d.split, cache_dir=cache)
        else:  # never a name on the hub here: hub.localize has made that the downloaded folder
            raise ValueError("no such file or folder")
    except Exception as e:  # datasets raises many kinds: each means this data set cannot be read
        raise ValueError(f"dataset {what}: {(str(e).strip().splitlines() or [type(e).__name__])[0]}") from None
    if data.data.nbytes > MAX_TASK_BYTES:
        raise ValueError(
            f"dataset {what}: {data.data.nbytes:,} bytes (limit {MAX_TASK_BYTES:,}); take a slice, e.g. "
            f'split: "{d.split}[:10000]"'
        )
    prompt_key, messages_key = (None, d.messages_field) if d.messages_field else (d.prompt_field, None)
    for column in (prompt_key or messages_key, d.answer_field):
        if column not in data.column_names:
            raise ValueError(f"dataset {what}: no column {column!r} (its columns: {', '.join(data.column_names)})")
    return what, (
        (f"{what} row {i}", source(row, prompt_key, messages_key, d.answer_field)) for i, row in enumerate(data)
    )


def _environment(e: EnvironmentSpec, prompts: Prompts) -> tuple[object, Prompts]:
    """task.environment loaded, and the prompts that show its tools to a chat template."""
    env = environment.load(e.load, e.args, e.trust_worker_rewards)
    return env, prompts.with_tools(environment.schemas(env)) if prompts.templated else prompts


def environment_rows(env: object, which: str = "dataset") -> Iterator[tuple[str, Source | str]]:
    """An environment's data set (or `eval_dataset`) as examples: verifiers' columns (a prompt as
    text or messages, or a question; an answer, if any; info and the rest as fields)."""
    for i, row in enumerate(environment.rows(env, which)):
        r = dict(row)
        if "prompt" not in r and "question" in r:
            r["prompt"] = r.pop("question")
        r.setdefault("answer", "")
        chat = isinstance(r.get("prompt"), list)
        src = source(r, None if chat else "prompt", "prompt" if chat else None, "answer")
        if not isinstance(src, str):
            try:
                json.dumps(src.fields, allow_nan=False)  # they travel to workers, in leases
            except (TypeError, ValueError) as e:
                src = f"its fields are not plain JSON values ({e})"
        yield f"the environment's {which} row {i}", src


class Rows(Task):
    """User examples, each rendered and checked once here, cycled in a seeded order."""

    def __init__(self, seed: int, prompts: Prompts, rows: Iterable[tuple[str, Source | str]], t: TaskSpec, what: str):
        super().__init__(seed, prompts)
        self.rows: list[Example] = []
        bad, first = 0, None
        for where, src in rows:
            reason = src if isinstance(src, str) else None
            if not isinstance(src, str):  # reason is None
                try:
                    ex = prompts.render(src)
                except ValueError as e:
                    reason = str(e)
                else:
                    if (n := len(prompts.ids(ex.prompt))) > t.max_prompt_tokens:
                        reason = f"its prompt is {n:,} tokens (task.maxPromptTokens: {t.max_prompt_tokens:,})"
                    else:
                        self.rows.append(ex)
                        continue
            if t.on_bad_row == "refuse":
                raise ValueError(f"{where}: {reason} (or set task.onBadRow: skip)")
            bad, first = bad + 1, first or f"{where}: {reason}"
        if not self.rows:
            raise ValueError(
                f"{what}: no examples" + (f" ({bad:,} bad, all skipped; the first: {first})" if bad else "")
            )
        if bad:
            self.skipped = (
                f"skipped {bad:,} bad examples of {bad + len(self.rows):,} (task.onBadRow: skip); the first: {first}"
            )
        self.field_sets = {frozenset(ex.fields) for ex in self.rows}
        self.order = list(range(len(self.rows)))
        random.Random(seed).shuffle(self.order)

    def example(self, i: int) -> Example:
        return self.rows[self.order[i % len(self.rows)]]


def check_unrendered(spec: JobSpec) -> None:
    """What can be checked of the task before the model's tokenizer is here (the trainer has yet
    to download the model from the hub): the user's data read (unless it comes from the hub too)
    and the reward loaded, and callable with the fields of the examples that read. Rendering each
    example waits for the tokenizer (for_job). ValueError names the file."""
    t = spec.task
    rows: Iterable[tuple[str, Source | str]] | None
    if t.environment:
        e = t.environment
        environment.load(e.load, e.args, e.trust_worker_rewards)  # its data set, env_response and rubric
        return
    if t.builtin:
        name, rows = t.reward or BUILTIN[t.builtin].default_reward, []
    else:
        name = t.reward or Task.default_reward
        if t.jsonl:
            rows = jsonl(t.jsonl)
        else:
            assert t.dataset is not None  # a task's one source (TaskSpec)
            rows = dataset(t.dataset)[1] if dataset_repo(t.dataset.path) is None else None
    fn = reward_function(name)
    if rows is not None:
        check_reward(fn, name, {frozenset(src.fields) for _, src in rows if not isinstance(src, str)})


def for_job(spec: JobSpec, prompts: Prompts) -> tuple[Task, str]:
    """The job's task, every user example read, rendered and checked, and the name of its reward,
    checked to take the examples' fields (a user's file is loaded here: errors name it)."""
    t = spec.task
    if t.environment:
        env, shown = _environment(t.environment, prompts)
        what = f"environment {t.environment.load!r}"
        return Rows(spec.seed, shown, environment_rows(env), t, what), what
    if t.builtin:
        task = BUILTIN[t.builtin](spec.seed, prompts)
    elif t.jsonl:
        task = Rows(spec.seed, prompts, jsonl(t.jsonl), t, str(t.jsonl))
    else:
        assert t.dataset is not None  # a task's one source (TaskSpec)
        what, rows = dataset(t.dataset)
        task = Rows(spec.seed, prompts, rows, t, f"dataset {what}")
    name = t.reward or task.default_reward
    check_reward(reward_function(name), name, task.field_sets)
    return task, name


HELD_OUT = 1 << 42  # a built-in task's eval examples are drawn from here on: beyond any training group


def held_out(spec: JobSpec, prompts: Prompts, task: Task) -> list[Example]:
    """The job's eval examples (`task.eval`), read, rendered and checked as the task's are: the
    first `prompts` of its file or data set, in order; or for a built-in task without either,
    examples at indices training never reaches (its problems may recur: a small task has few).
    Its reward must take their fields. None asked: []."""
    e, t = spec.task.eval, spec.task
    if e is None:
        return []
    if t.environment:
        env, shown = _environment(t.environment, prompts)
        if getattr(env, "eval_dataset", None) is None:
            raise ValueError(f"eval: the environment {t.environment.load!r} has no eval_dataset to evaluate on")
        what = f"eval of environment {t.environment.load!r}"
        return Rows(spec.seed, shown, itertools.islice(environment_rows(env, "eval_dataset"), e.prompts), t, what).rows
    if e.jsonl:
        rows = Rows(spec.seed, prompts, itertools.islice(jsonl(e.jsonl), e.prompts), t, f"eval {e.jsonl}").rows
    elif e.dataset:
        what, data = dataset(e.dataset)
        rows = Rows(spec.seed, prompts, itertools.islice(data, e.prompts), t, f"eval dataset {what}").rows
    else:
        rows = [task.example(HELD_OUT + i) for i in range(e.prompts)]
    name = t.reward or task.default_reward
    check_reward(reward_function(name), name, {frozenset(x.fields) for x in rows})
    return rows
