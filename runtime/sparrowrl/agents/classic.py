"""verifiers' own environments: vf.SingleTurnEnv, MultiTurnEnv, ToolEnv, StatefulToolEnv and
ReasoningGymEnv, as verifiers 0.3 ships them (`pip install 'sparrowrl[verifiers]'`), driven a
turn at a time through their own hooks, with the worker's engine in place of their client.

verifiers runs an episode as `rollout()`: init_state and setup_state, then until is_completed,
get_prompt_messages (env_response, after the first turn) and the model's reply through an OpenAI
client. Here the worker samples the reply from its own engine, token in and token out
(worker/episodes.py), and each environment turn calls the same hooks in the same order:
add_model_response, is_completed, get_prompt_messages. So an environment's setup_state, stop
conditions, env_response and tool arguments (StatefulToolEnv.update_tool_args) run as verifiers
runs them; its tools run each in a process of its own (agents/tools.py); its rubric's reward
functions score on the trainer, each given the arguments it names.

verifiers is imported only here, and only for a job whose environment is one of its own."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import uuid
from contextlib import contextmanager
from typing import Any, Callable, Iterator, cast

from sparrowrl.agents.sandbox import Limits
from sparrowrl.agents.tools import OPEN, ToolFailure, hermes, run

log = logging.getLogger(__name__)

Reply = tuple[list[dict[str, str]], bool, int, int]  # environment.Turn's fields
GROUP_ARGS = {"prompts", "completions", "answers", "states", "tasks", "infos"}  # verifiers' group reward functions'


def is_classic(env: object) -> bool:
    """Whether `env` is a verifiers Environment (0.3's `verifiers.legacy`, or 0.1-0.2's top level)."""
    return any(c.__module__.split(".")[0] == "verifiers" and c.__name__ == "Environment" for c in type(env).__mro__)


class Classic:
    """A verifiers environment, as agents/environment.py calls one: its data sets as rows, its
    tools, a turn (`reply`) and its rubric as one reward (`reward`). ValueError names what this
    cannot run."""

    def __init__(self, env: Any, what: str):
        import verifiers as vf

        if not isinstance(env, vf.MultiTurnEnv):  # EnvGroup and the like run rollout() their own way
            raise ValueError(
                f"{what}: a verifiers {type(env).__name__} is not a MultiTurnEnv (SingleTurnEnv, ToolEnv, "
                f"StatefulToolEnv and ReasoningGymEnv are): its episodes cannot be run a turn at a time"
            )
        self.env, self.what = env, what
        self.dataset = _rows(env.get_dataset())
        held_out = env.build_eval_dataset()  # built now, where its source is a function
        self.eval_dataset = _rows(held_out) if held_out is not None else None
        self.tools: list[Callable[..., Any]] = list(getattr(env, "tools", None) or [])
        self._loop: asyncio.AbstractEventLoop | None = None

    def _run(self, work: Any) -> Any:
        """One event loop for this process's calls, as verifiers runs them: clients an environment
        or a rubric made (a judge's, a sandbox's) stay bound to it."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(work)

    def schemas(self) -> list[dict[str, Any]]:
        """Its tools as the chat template shows them: verifiers' own definitions (a
        StatefulToolEnv's without the arguments it fills in itself)."""
        return [
            {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
            for t in self.env.tool_defs or []
        ]

    def reply(self, messages: list[dict[str, str]], state: dict[str, Any], tool: Any, last: bool) -> Reply:
        """The environment's turn after the model's (environment.reply's contract, as the fields
        of its Turn): verifiers' state lives in `state["vf"]`, the messages it was last prompted
        with in `state["vf_prompt"]`."""
        try:
            return cast(Reply, self._run(self._reply(messages, state, tool, last)))
        finally:
            if (vs := state.get("vf")) is not None:  # a state travels between processes: its usage as a plain dict
                vs.pop("usage_tracker", None)
                vs["usage"] = dict(vs.get("usage") or {})

    async def _reply(self, messages: list[dict[str, str]], state: dict[str, Any], tool: Any, last: bool) -> Reply:
        from verifiers.utils.message_utils import concat_messages, normalize_messages

        env = self.env
        vs = state.get("vf")
        try:
            if vs is None:  # the episode's first turn: its prompt is the row's, as the model saw it
                fields = state.get("fields", {})
                row = {**fields, "prompt": messages[:-1], "answer": state["answer"], "info": state["info"]}
                row.setdefault("example_id", 0)
                vs = await env.init_state(row, _no_client(), "sparrowrl", {})
                vs["client"] = None  # the worker's engine answers, not a client; and a state travels
                vs = await env.setup_state(vs) or vs
                state["vf_prompt"] = vs["prompt"]
            asked = state["vf_prompt"]
            state["vf"] = vs
            await env.add_model_response(vs, asked, _response(messages[-1]["content"], bool(self.tools), tool.calls))
            if await env.is_completed(vs):
                await env.cleanup(vs)
                return [], True, 0, 0
            if last:
                await env.cleanup(vs)
                return [], False, 0, 0  # it would go on: maxTurns ends it
            with self._walled(tool) as ran:
                nxt = normalize_messages(await env.get_prompt_messages(vs), field_name="prompt_messages")
            if ran.failure is not None:
                raise ran.failure
            before = concat_messages([vs["trajectory"][-1]["prompt"], vs["trajectory"][-1]["completion"]])
            if [_plain(m) for m in nxt[: len(before)]] != [_plain(m) for m in before]:
                raise ValueError(
                    "get_prompt_messages did not extend the conversation the model had (it rewrote or dropped "
                    "earlier messages): an episode here is one sequence of tokens, each turn appended"
                )
            new = [_plain(m) for m in nxt[len(before) :]]
            if vs.get("final_env_response") is not None or not new:
                await env.is_completed(vs)  # its stop condition, as verifiers records it
                await env.cleanup(vs)
                return [], True, ran.calls, ran.errors
            state["vf_prompt"] = nxt
            return new, False, ran.calls, ran.errors
        except BaseException:
            if vs is not None:
                await env.cleanup(vs)  # a @vf.cleanup handler frees what the episode held
            raise

    @contextmanager
    def _walled(self, tool: Any) -> Iterator[_Ran]:
        """Its tools, while a turn runs, each call in a process of its own behind `tool`'s limits
        (environment.ToolLimits); verifiers' ToolEnv calls them and words their errors. Once one
        has hung or died the episode is over: the turn's other calls are not run."""
        ran = _Ran()
        tools = getattr(self.env, "tool_map", None)
        if not tools:
            yield ran
            return

        def walled(name: str) -> Callable[..., str]:
            def call(**args: Any) -> str:
                if ran.failure is not None:
                    raise _ToolError("not run: an earlier call of this turn hung or died")
                if not name:  # not a call that parsed, or the calls beyond the limit (`_response`)
                    ran.calls += args.get("calls", 1)
                    ran.errors += args.get("calls", 1)
                    raise _ToolError(args.get("error", "the tool call is not well-formed"))
                ran.calls += 1
                try:
                    ok, text = run(tools, (name, args), Limits(tool.seconds, tool.memory), tool.output, tool.root)
                except ToolFailure as e:
                    ran.failure = e
                    raise
                if not ok:
                    ran.errors += 1
                    raise _ToolError(text.removeprefix("Error: "))
                return text

            return call

        self.env.tool_map = _Walled(walled, tools)  # a name the model made up too: tools.run answers which there are
        try:
            yield ran
        finally:
            self.env.tool_map = tools

    def reward_functions(self) -> list[tuple[Callable[..., Any], float, Any]]:
        """Its rubric's reward functions of weight other than 0, each with its weight and rubric
        (metrics, of weight 0, are not run); ValueError: none, or one that scores a group."""
        funcs = [(fn, w, r) for fn, w, r in _leaves(self.env.rubric) if w]
        if not funcs:
            raise ValueError(f"{self.what}: its rubric has no reward function of weight other than 0")
        for fn, _, _ in funcs:
            try:
                sig = inspect.signature(fn)
            except (TypeError, ValueError):
                continue
            group = GROUP_ARGS & set(sig.parameters)
            if (
                group
                or sig.return_annotation in (list, "list")
                or getattr(sig.return_annotation, "__origin__", None) is list
            ):
                raise ValueError(
                    f"{self.what}: its reward {getattr(fn, '__name__', fn)} scores a group of episodes together "
                    f"({', '.join(sorted(group)) or 'it returns a list'}); each episode is scored alone here (GRPO "
                    f"compares a group's rewards): give it one episode's arguments"
                )
        return funcs

    def reward(self) -> Callable[..., float]:
        """Its rubric as one reward, fn(prompt, completion, answer, **fields): each reward function
        given what it names of prompt, completion (verifiers' messages), answer, info, task (the
        row), the row's fields and its rubric's objects (its parser); and `state`, verifiers' state
        of the episode on its worker, where one is passed (trustWorkerRewards). A function that
        raises scores 0, as under verifiers."""
        funcs = self.reward_functions()
        tools = bool(self.tools)

        def reward(prompt: Any, completion: Any, answer: Any, **fields: Any) -> float:
            own = fields.pop("state", None)
            row = {**fields, "prompt": prompt, "answer": answer}
            given = {
                **fields,
                "prompt": _messages(prompt, tools),
                "completion": _messages(completion, tools),
                "answer": answer,
                "info": fields.get("info", {}),
                "task": row,
                "state": own.get("vf") if isinstance(own, dict) else None,
            }

            async def total() -> float:
                from verifiers.utils.async_utils import maybe_call_with_named_args

                out = 0.0
                for fn, w, rubric in funcs:
                    try:
                        out += w * float(await maybe_call_with_named_args(fn, **{**given, **rubric.class_objects}))
                    except Exception as e:
                        log.warning(
                            f"{self.what}: its reward {getattr(fn, '__name__', fn)} raised, and scores 0: {e!r}"
                        )
                return out

            return cast(float, self._run(total()))

        return reward


class _Ran:
    """A turn's tool calls: how many, how many failed, and the first that hung or died."""

    def __init__(self) -> None:
        self.calls, self.errors = 0, 0
        self.failure: ToolFailure | None = None


class _Walled(dict):
    """Each tool name, known or not, as its walled call."""

    def __init__(self, walled: Callable[[str], Callable[..., str]], tools: dict[str, Any]):
        super().__init__({name: walled(name) for name in tools})
        self.walled = walled

    def __missing__(self, name: str) -> Callable[..., str]:
        return self.walled(name)


class _ToolError(Exception):
    """What a tool call answers the model, as verifiers' ToolEnv words an error (its error_formatter)."""


def _leaves(rubric: Any) -> Iterator[tuple[Callable[..., Any], float, Any]]:
    """A rubric's functions with their weights and own rubric (a RubricGroup's, each of its rubrics')."""
    for sub in getattr(rubric, "rubrics", None) or []:
        yield from _leaves(sub)
    if not getattr(rubric, "rubrics", None):
        yield from ((fn, w, rubric) for fn, w in zip(rubric.funcs, rubric.weights, strict=True))


def _rows(data: Any) -> list[dict[str, Any]]:
    """verifiers' formatted rows (prompt as messages, with its system prompt), as plain values."""
    out = []
    for r in data:
        row = dict(r)
        row["prompt"] = [_plain(m) for m in row["prompt"]] if isinstance(row.get("prompt"), list) else row.get("prompt")
        if isinstance(row.get("info"), str):
            row["info"] = json.loads(row["info"] or "{}")
        out.append(row)
    return out


def _plain(m: Any) -> dict[str, str]:
    """A message as the chat template and the trainer read it: its role and its text."""
    content = m["content"] if isinstance(m, dict) else m.content
    if isinstance(content, list):  # content parts: their text
        content = "".join(p["text"] if isinstance(p, dict) else getattr(p, "text", "") for p in content)
    return {"role": m["role"] if isinstance(m, dict) else m.role, "content": content or ""}


def _calls(text: str, tag: str, limit: int | None = None) -> list[Any]:
    """A model turn's tool calls (Hermes' format) as verifiers' ToolCall, with ids `tag`_k: one
    that does not parse names no tool, and its arguments say why; those beyond `limit` are one
    such call, that says they were not run."""
    import verifiers as vf

    calls = hermes(text)
    out = [
        vf.ToolCall(id=f"{tag}_{k}", name=name, arguments=json.dumps(args if name else {"error": args}))
        for k, (name, args) in enumerate(calls[:limit])
    ]
    if limit is not None and len(calls) > limit:
        beyond = {"error": f"{len(calls) - limit} calls beyond the {limit} one turn may make were not run"}
        out.append(
            vf.ToolCall(id=f"{tag}_{limit}", name="", arguments=json.dumps({**beyond, "calls": len(calls) - limit}))
        )
    return out


def _content(text: str, calls: list[Any]) -> str:
    """A turn's text without its tool calls, as an OpenAI server's Hermes parser gives it."""
    return text[: text.find(OPEN)].strip() if calls and OPEN in text else text


def _response(text: str, tools: bool, limit: int) -> Any:
    """The model's turn as verifiers' Response, as its client would have made it."""
    import verifiers as vf

    calls = _calls(text, f"call_{uuid.uuid4().hex[:12]}", limit) if tools else []
    message = vf.ResponseMessage(
        content=_content(text, calls),
        tool_calls=calls or None,
        finish_reason="tool_calls" if calls else "stop",
        is_truncated=False,
    )
    return vf.Response(id=f"sparrowrl-{uuid.uuid4().hex[:12]}", created=0, model="sparrowrl", message=message)


def _messages(messages: Any, tools: bool) -> Any:
    """A transcript's messages as verifiers' own (its reward functions read `m.role`, and count
    an assistant message's tool_calls)."""
    if not isinstance(messages, list):
        return messages
    from verifiers.utils.message_utils import normalize_messages

    out, ids = [], []
    for j, m in enumerate(messages):
        if m["role"] == "assistant" and tools and (calls := _calls(m["content"], f"call_{j}")):
            m = {**m, "content": _content(m["content"], calls), "tool_calls": [c.model_dump() for c in calls]}
            ids = [c.id for c in calls]
        elif m["role"] == "tool":  # answers its turn's calls in order (one beyond them: the limit's)
            m = {**m, "tool_call_id": ids.pop(0) if ids else "call_beyond"}
        out.append(m)
    return normalize_messages(out, field_name="completion")


def _no_client() -> Any:
    """The client verifiers' init_state wants: none is called, the worker's engine samples here."""
    import verifiers as vf

    async def never(*_: Any, **__: Any) -> Any:
        raise RuntimeError("the worker's engine samples the model's turns here, not a client")

    return type("NoClient", (vf.Client,), dict.fromkeys(vf.Client.__abstractmethods__, never))(None)
