"""A user's environment, loaded as verifiers loads one: a module or FILE.py whose
`load_environment(**args)` returns it. SparrowRL calls what verifiers' classic MultiTurnEnv
offers, so such an environment is one here:

    dataset        rows of {"prompt": text or [{"role", "content"}], "answer": ..., "info": {...}}
    env_response(messages, state) -> [{"role": "user" | "tool", "content": ...}]
                   the environment's turn after each of the model's; [] ends the episode
    is_completed(messages, state) -> bool
                   optional: asked first, after each model turn
    reward(prompt, completion, answer, **fields) -> float, or a verifiers `rubric`
                   the rubric, on the trainer: `prompt` and `completion` are the episode's
                   messages before and after its first model turn, `fields` the row's others
                   (such as `info`)

`state` is a dict of the episode's own: {"answer", "info", "fields" (the row's), "turn"} to
start, and whatever the environment keeps there between its turns. It stays on the worker: the
rubric never sees it, so a reward is computed from the transcript alone (docs/environments.md).

A verifiers environment itself (vf.SingleTurnEnv, MultiTurnEnv, ToolEnv, ...) is one too: it is
driven through its own hooks (agents/classic.py)."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import math
import os
import pickle
import signal
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from sparrowrl.agents.classic import Classic, is_classic
from sparrowrl.agents.sandbox import Limits, available
from sparrowrl.agents.tools import ToolFailure, hermes, run
from sparrowrl.spec.messages import MAX_MESSAGE_CHARS, MAX_TURN_MESSAGES
from sparrowrl.spec.task import EnvironmentSpec

log = logging.getLogger(__name__)

ROLES = ("user", "tool")  # of the environment's messages


def load(ref: str, args: dict[str, Any], trusted: bool = False) -> Any:
    """The environment `ref` names, made by its load_environment(**args) and checked (`trusted`:
    its rubric may take the worker's state, trustWorkerRewards); ValueError names what is wrong.
    A FILE.py is loaded under a name of its own, never imported from the path (its folder goes
    last on the path, for its own helpers)."""
    what = f"environment {ref!r}"
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")  # verifiers' rows are map()ped: a bar per load
    try:
        if ref.endswith(".py"):
            path = Path(ref).resolve()
            if not path.is_file():
                raise ValueError(f"{what}: no file {path}")
            name = f"sparrowrl_env_{path.stem}"
            spec = importlib.util.spec_from_file_location(name, path)
            if spec is None or spec.loader is None:
                raise ValueError(f"{what}: {path.name} cannot be loaded as a module")
            module = importlib.util.module_from_spec(spec)
            if str(path.parent) not in sys.path:
                sys.path.append(str(path.parent))
            sys.modules[name] = module
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(ref.replace("-", "_"))
    except ValueError:
        raise
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] == "verifiers":
            raise ValueError(f"{what}: verifiers is not installed here: pip install 'sparrowrl[verifiers]'") from None
        raise ValueError(f"{what}: no module {e.name!r} here (install it, or give a FILE.py)") from None
    except AttributeError as e:
        raise ValueError(f"{what}: loading it failed: AttributeError: {e}{_verifiers_hint()}") from None
    except Exception as e:
        raise ValueError(f"{what}: loading it failed: {type(e).__name__}: {e}") from None
    make = getattr(module, "load_environment", None)
    if not callable(make):
        raise ValueError(f"{what} defines no function load_environment")
    try:
        with _own_signals():
            env = make(**args)
    except Exception as e:
        raise ValueError(f"{what}: load_environment({_show(args)}) failed: {type(e).__name__}: {e}") from None
    if is_classic(env):
        try:
            env = Classic(env, what)
        except ValueError:
            raise
        except Exception as e:
            raise ValueError(f"{what}: reading the verifiers environment failed: {type(e).__name__}: {e}") from None
    check(env, what, trusted)
    return env


def _verifiers_hint() -> str:
    """Why verifiers' classic names may be missing: a verifiers without them is installed."""
    import importlib.metadata

    try:
        version = importlib.metadata.version("verifiers")
    except importlib.metadata.PackageNotFoundError:
        return ""
    if importlib.util.find_spec("verifiers.legacy") is not None or version.startswith(("0.1.", "0.2.")):
        return ""
    return (
        f" (verifiers {version} is installed, which has only verifiers.v1: its classic environments, "
        f"MultiTurnEnv and the rest, run here with verifiers 0.3.1, pip install 'sparrowrl[verifiers]')"
    )


@contextmanager
def _own_signals() -> Iterator[None]:
    """While an environment is made, its signal handlers are not installed: verifiers' Environment
    sets SIGINT's and SIGTERM's as it is made (and cannot, outside the main thread), and this
    process keeps its own (a trainer's and a worker's stop cleanly on SIGTERM)."""
    install = signal.signal
    signal.signal = lambda sig, handler: signal.getsignal(sig)  # type: ignore[assignment]
    try:
        yield
    finally:
        signal.signal = install


def check(env: object, what: str, trusted: bool = False) -> None:
    if isinstance(env, Classic):
        reward_of(env, what, trusted)
        return
    if getattr(env, "dataset", None) is None:
        raise ValueError(f"{what}: the environment has no dataset (docs/environments.md says what it needs)")
    if getattr(env, "env_response", None) is None and not tools_of(env):
        raise ValueError(f"{what}: the environment has no env_response and no tools")
    if getattr(env, "env_response", None) is not None and not callable(getattr(env, "env_response")):
        raise ValueError(f"{what}: its env_response is not callable")
    for name, fn in tools_of(env).items():
        if not callable(fn):
            raise ValueError(f"{what}: its tool {name!r} is not callable")
    reward_of(env, what, trusted)


def tools_of(env: object) -> dict[str, Any]:
    """The environment's tools by name: `tools`, a list of functions (as verifiers' ToolEnv takes them)."""
    return {getattr(fn, "__name__", str(i)): fn for i, fn in enumerate(getattr(env, "tools", None) or [])}


def schemas(env: object) -> list[dict[str, Any]]:
    """The environment's tools as JSON schemas, for the chat template to show the model (from
    each function's signature and docstring, as transformers reads them). ValueError names a
    tool whose docstring does not describe it."""
    from transformers.utils import get_json_schema

    if isinstance(env, Classic):
        return env.schemas()
    out = []
    for name, fn in tools_of(env).items():
        try:
            out.append(get_json_schema(fn))
        except Exception as e:
            raise ValueError(
                f"its tool {name}: no JSON schema for the chat template to show the model ({e}); give it a "
                f"docstring with an Args: section that describes each argument, and type hints"
            ) from None
    return out


def reward_of(env: object, what: str, trusted: bool = False) -> Callable[..., float]:
    """The environment's rubric as one reward, fn(prompt, completion, answer, **fields): its own
    `reward`, or a verifiers Rubric's functions by weight, each given the arguments it names
    (prompt, completion, answer, parser, and the row's fields such as info). A function that
    needs `state` is refused: state stays on the worker, and the trainer scores transcripts;
    unless `trusted` (trustWorkerRewards), where workers score, and pass it."""
    if isinstance(env, Classic):
        for fn, _, _ in env.reward_functions():
            _needs_state(fn, what, trusted)
        return env.reward()
    own = getattr(env, "reward", None)
    rubric = getattr(env, "rubric", None)
    funcs = list(getattr(rubric, "funcs", None) or getattr(rubric, "reward_funcs", None) or [])
    if own is None and not funcs:
        raise ValueError(f"{what}: the environment has no reward and no rubric with functions")
    if own is not None and not callable(own):
        raise ValueError(f"{what}: its reward is not callable")
    for fn in [own] if own is not None else funcs:
        _needs_state(fn, what, trusted)
    if own is not None:
        return own
    weights = list(getattr(rubric, "weights", None) or getattr(rubric, "reward_weights", None) or [1.0] * len(funcs))
    parser = getattr(rubric, "parser", None)

    def reward(prompt: Any, completion: Any, answer: Any, **fields: Any) -> float:
        given = {"prompt": prompt, "completion": completion, "answer": answer, "parser": parser, **fields}
        total = 0.0
        for fn, w in zip(funcs, weights, strict=True):
            params = _params(fn)
            takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
            total += w * float(_awaited(fn(**(given if takes_all else {k: given[k] for k in params if k in given}))))
        return total

    return reward


def _needs_state(fn: Any, what: str, trusted: bool) -> None:
    """A reward that takes `state` is refused unless `trusted`: state stays on the worker."""
    if "state" in _params(fn) and not trusted:
        raise ValueError(
            f"{what}: its reward {getattr(fn, '__name__', '')} takes `state`, which stays on the worker: the "
            f"trainer scores an episode from its transcript (prompt, completion, answer and the row's "
            f"fields); keep what the reward needs in the messages or the row, or set "
            f"task.environment.trustWorkerRewards to use the workers' own scores"
        )


def _params(fn: Any) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a callable without a signature to read: its calls will tell
        return {}


def rows(env: object, which: str = "dataset") -> list[dict[str, Any]]:
    """The environment's data set (or `eval_dataset`), as rows (a list, or any iterable of dicts:
    a `datasets` one)."""
    data = getattr(env, which)
    try:
        return [dict(r) if not isinstance(r, dict) else r for r in data]
    except Exception as e:
        raise ValueError(f"the environment's {which} cannot be read as rows: {type(e).__name__}: {e}") from None


@dataclass
class Turn:
    """The environment's turn: its messages, whether the episode is over, and its tool calls."""

    messages: list[dict[str, str]]
    done: bool
    tool_calls: int = 0
    tool_errors: int = 0


def reply(
    env: Any,
    messages: list[dict[str, str]],
    state: dict[str, Any],
    tool: ToolLimits | None = None,
    last: bool = False,
) -> Turn:
    """The environment's turn after the model's: the tools the model called, run (each in a
    process of its own), or else env_response's messages, checked; the episode is over when the
    environment says so first (is_completed), or has nothing to say (no tool called, and no
    env_response or an empty one). After the model's `last` turn (maxTurns) only whether it is
    over is asked: a call is not run. ValueError: a reply that is not messages; ToolFailure: a
    tool that hung or died."""
    if isinstance(env, Classic):
        return Turn(*_checked_reply(env.reply(messages, state, tool or ToolLimits(), last)))
    done = getattr(env, "is_completed", None)
    if done is not None and _awaited(done(messages, state)):
        return Turn([], True)
    tools = tools_of(env)
    if tools:
        parse = getattr(env, "parse_tool_calls", None) or hermes
        calls = parse(messages[-1]["content"])
        if calls and last:
            return Turn([], False)  # it would go on: maxTurns ends it
        if calls:
            limits = tool or ToolLimits()
            out, errors = [], 0
            for call in calls[: limits.calls]:
                ok, text = run(tools, call, Limits(limits.seconds, limits.memory), limits.output, limits.root)
                errors += not ok
                out.append({"role": "tool", "content": text})
            if len(calls) > limits.calls:
                out.append(
                    {
                        "role": "tool",
                        "content": f"Error: {len(calls) - limits.calls} calls beyond the "
                        f"{limits.calls} one turn may make were not run",
                    }
                )
                errors += len(calls) - limits.calls
            return Turn(out, False, len(calls), errors)
        if getattr(env, "env_response", None) is None:
            return Turn([], True)
    out = _awaited(env.env_response(messages, state))
    if out is None:
        return Turn([], True)
    if isinstance(out, str):
        out = [{"role": "user", "content": out}]
    out = _checked(out, "env_response")
    return Turn(out, not out)


def _checked_reply(turn: tuple[list[dict[str, str]], bool, int, int]) -> tuple[list[dict[str, str]], bool, int, int]:
    return _checked(turn[0], "the environment's turn"), turn[1], turn[2], turn[3]


def _checked(out: Any, what: str) -> list[dict[str, str]]:
    """The environment's messages, as the trainer will check them (spec/messages.py): ValueError
    names the first that is not a user or tool message of text within its bounds."""
    if not isinstance(out, list):
        raise ValueError(f"{what} returned {type(out).__name__}, not a list of messages")
    for i, m in enumerate(out):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in ROLES:
            raise ValueError(
                f"{what}'s message {i} is not {{'role': 'user' or 'tool', 'content': text}}: {str(m)[:200]}"
            )
        try:
            m["content"].encode()
        except UnicodeEncodeError as e:
            raise ValueError(f"{what}'s message {i} is not text that UTF-8 can carry ({e.reason})") from None
        if len(m["content"]) > MAX_MESSAGE_CHARS:
            raise ValueError(f"{what}'s message {i} is {len(m['content']):,} characters (limit {MAX_MESSAGE_CHARS:,})")
    if len(out) > MAX_TURN_MESSAGES:
        raise ValueError(f"{what} returned {len(out)} messages (limit {MAX_TURN_MESSAGES})")
    return [{"role": m["role"], "content": m["content"]} for m in out]


def _awaited(x: Any) -> Any:
    """verifiers' methods are coroutines: run one to its end (this process has no loop running)."""
    if inspect.isawaitable(x):
        import asyncio

        async def wait() -> Any:
            return await x

        return asyncio.run(wait())
    return x


def _show(args: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in args.items())[:300]


@dataclass(frozen=True)
class ToolLimits:
    """Each tool call's (task.environment's tool fields)."""

    seconds: float = 10.0
    memory: int = 1 << 30
    output: int = 8192  # characters of its answer
    calls: int = 8  # per turn
    root: str | None = None  # where each call's folder is made (the worker's, removed when it ends)

    @classmethod
    def of(cls, env: EnvironmentSpec, root: str | None = None) -> ToolLimits:
        return cls(env.tool_seconds, env.tool_memory_mib << 20, env.tool_output_chars, env.max_tool_calls, root)


def turn_caller(
    ref: str, args: dict[str, Any], tool: ToolLimits | None = None, trusted: bool = False
) -> Callable[[tuple[Any, ...]], tuple[str, object]]:
    """In an environment process (sparrowrl.calls): the environment loaded, and each call
    answered with ("ok", value) or why it failed: ("turn", messages, state, last, turn), with (its
    Turn, the state); ("score", prompt, completion, answer, fields, state), with the rubric's
    reward, for trustWorkerRewards (`trusted`). A state comes back pickled, and goes in so or as
    its first dict: the worker holds it and never reads it (what it holds may be of classes only
    the environment's processes have)."""
    env = load(ref, args, trusted)
    rubric = reward_of(env, f"environment {ref!r}", trusted) if trusted else None
    if tools_of(env) and (missing := {"landlock", "seccomp"} - set(available())):
        log.warning(
            f"environment {ref!r}: this kernel lacks {' and '.join(sorted(missing))}: tool calls run without "
            f"{'the filesystem wall (writes are bounded by size only)' if 'landlock' in missing else ''}"
            f"{' and ' if len(missing) == 2 else ''}{'the wall against new processes' if 'seccomp' in missing else ''}"
        )

    def turn(item: tuple[Any, ...]) -> tuple[str, object]:
        if item[0] == "score":
            assert rubric is not None  # asked for with trustWorkerRewards only
            _, prompt, completion, answer, fields, held = item
            return score(rubric, prompt, completion, answer, fields, _state(held))
        _, messages, held, last, n = item
        try:
            state = _state(held)
            state["turn"] = n
            out = reply(env, messages, state, tool, last)
            kept = pickle.dumps(state)  # it travels back: a state that cannot fails here, with a reason
        except ToolFailure as e:
            return "tool", str(e)
        except BaseException as e:  # an environment's sys.exit() ends its episode, not the process
            return "raised", f"{type(e).__name__}: {str(e)[:500]}"
        return "ok", (out, kept)

    return turn


def _state(held: bytes | dict[str, Any]) -> dict[str, Any]:
    return pickle.loads(held) if isinstance(held, bytes) else held


MAX_REWARD = 1e6  # as the trainer's (rewards.MAX_REWARD)


def score(
    rubric: Callable[..., float], prompt: Any, completion: Any, answer: str, fields: dict, state: dict
) -> tuple[str, object]:
    """A worker's own score of its episode (trustWorkerRewards): ("ok", a finite, bounded number) or why not."""
    params = _params(rubric)
    takes = "state" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    try:
        r = float(rubric(prompt, completion, answer, **({**fields, "state": state} if takes else fields)))
    except BaseException as e:
        return "raised", f"{type(e).__name__}: {str(e)[:500]}"
    if not math.isfinite(r) or abs(r) > MAX_REWARD:
        return "raised", f"returned {r:g}, not a finite number within ±{MAX_REWARD:g}"
    return "ok", r


def reward_caller(ref: str, args: dict[str, Any], trusted: bool = False) -> Callable[..., float]:
    """In a reward process on the trainer: the environment's rubric as one reward."""
    return reward_of(load(ref, args, trusted), f"environment {ref!r}", trusted)
