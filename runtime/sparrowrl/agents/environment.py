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

`state` is a dict of the episode's own: {"answer", "info", "turn"} to start, and whatever the
environment keeps there between its turns. It stays on the worker: the rubric never sees it, so
a reward is computed from the transcript alone (docs/environments.md)."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import pickle
import sys
from pathlib import Path
from typing import Any, Callable

ROLES = ("user", "tool")  # of the environment's messages


def load(ref: str, args: dict[str, Any]) -> Any:
    """The environment `ref` names, made by its load_environment(**args) and checked; ValueError
    names what is wrong. A FILE.py is loaded under a name of its own, never imported from the
    path (its folder goes last on the path, for its own helpers)."""
    what = f"environment {ref!r}"
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
        raise ValueError(f"{what}: no module {e.name!r} here (install it, or give a FILE.py)") from None
    except Exception as e:
        raise ValueError(f"{what}: loading it failed: {type(e).__name__}: {e}") from None
    make = getattr(module, "load_environment", None)
    if not callable(make):
        raise ValueError(f"{what} defines no function load_environment")
    try:
        env = make(**args)
    except Exception as e:
        raise ValueError(f"{what}: load_environment({_show(args)}) failed: {type(e).__name__}: {e}") from None
    check(env, what)
    return env


def check(env: object, what: str) -> None:
    for name in ("dataset", "env_response"):
        if getattr(env, name, None) is None:
            raise ValueError(f"{what}: the environment has no {name} (docs/environments.md says what it needs)")
    if not callable(getattr(env, "env_response")):
        raise ValueError(f"{what}: its env_response is not callable")
    reward_of(env, what)


def reward_of(env: object, what: str) -> Callable[..., float]:
    """The environment's rubric as one reward, fn(prompt, completion, answer, **fields): its own
    `reward`, or a verifiers Rubric's functions by weight, each given the arguments it names
    (prompt, completion, answer, parser, and the row's fields such as info). A function that
    needs `state` is refused: state stays on the worker, and the trainer scores transcripts."""
    own = getattr(env, "reward", None)
    rubric = getattr(env, "rubric", None)
    funcs = list(getattr(rubric, "funcs", None) or getattr(rubric, "reward_funcs", None) or [])
    if own is None and not funcs:
        raise ValueError(f"{what}: the environment has no reward and no rubric with functions")
    if own is not None and not callable(own):
        raise ValueError(f"{what}: its reward is not callable")
    for fn in [own] if own is not None else funcs:
        if "state" in _params(fn):
            raise ValueError(
                f"{what}: its reward {getattr(fn, '__name__', '')} takes `state`, which stays on the worker: the "
                f"trainer scores an episode from its transcript (prompt, completion, answer and the row's "
                f"fields); keep what the reward needs in the messages or the row"
            )
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


def _params(fn: Any) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a callable without a signature to read: its calls will tell
        return {}


def rows(env: object) -> list[dict[str, Any]]:
    """The environment's data set, as rows (a list, or any iterable of dicts: a `datasets` one)."""
    data = getattr(env, "dataset")
    try:
        return [dict(r) if not isinstance(r, dict) else r for r in data]
    except Exception as e:
        raise ValueError(f"the environment's dataset cannot be read as rows: {type(e).__name__}: {e}") from None


def reply(env: Any, messages: list[dict[str, str]], state: dict[str, Any]) -> tuple[list[dict[str, str]], bool]:
    """The environment's turn: its messages, checked, and whether the episode is over (it said so
    first, or it has nothing to say). ValueError: a reply that is not messages."""
    done = getattr(env, "is_completed", None)
    if done is not None and _awaited(done(messages, state)):
        return [], True
    out = _awaited(env.env_response(messages, state))
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):  # verifiers 0.1's (messages, state)
        out, new = out
        state.update(new)
    if out is None:
        return [], True
    if isinstance(out, str):
        out = [{"role": "user", "content": out}]
    if not isinstance(out, list):
        raise ValueError(f"env_response returned {type(out).__name__}, not a list of messages")
    for i, m in enumerate(out):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in ROLES:
            raise ValueError(
                f"env_response's message {i} is not {{'role': 'user' or 'tool', 'content': text}}: {str(m)[:200]}"
            )
    return [{"role": m["role"], "content": m["content"]} for m in out], not out


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


def turn_caller(ref: str, args: dict[str, Any]) -> Callable[[tuple[Any, ...]], tuple[str, object]]:
    """In an environment process (sparrowrl.calls): the environment loaded, and each call
    (messages, state) answered with ("ok", (its messages, the state, done)) or why it failed."""
    env = load(ref, args)

    def turn(item: tuple[Any, ...]) -> tuple[str, object]:
        messages, state = item
        try:
            out, done = reply(env, messages, state)
            pickle.dumps(state)  # it travels back: a state that cannot fails here, with a reason
        except BaseException as e:  # an environment's sys.exit() ends its episode, not the process
            return "raised", f"{type(e).__name__}: {str(e)[:500]}"
        return "ok", (out, state, done)

    return turn


def reward_caller(ref: str, args: dict[str, Any]) -> Callable[..., float]:
    """In a reward process on the trainer: the environment's rubric as one reward."""
    return reward_of(load(ref, args), f"environment {ref!r}")
