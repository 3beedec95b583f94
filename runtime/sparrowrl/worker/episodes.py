"""A lease's episodes (task.environment), run against this worker's own engine, token in and
token out: every episode of the lease at once, turn by turn.

Each round the engine samples the model's turn of every episode still running, in one
`generate` call (the first round a group's samples together, from the group's seed, as a
single-turn lease; later ones each episode's own context, seeded by its group, sample and turn),
and then the environment takes its turn in each, in parallel, in processes of its own
(sparrowrl.calls: one that raises, hangs past task.environment.turnSeconds, or dies ends its
episode with the reason, and is replaced). Its messages are appended as tokens (agents/turns.py):
the engine never re-renders what it sampled.

An episode ends when the environment says so, or at a limit: its model turns (maxTurns), its
tokens (maxEpisodeTokens, the environment's included), its wall time (episodeSeconds), or a model
turn cut at grpo.maxNewTokens. Nothing here stops the lease: a failing episode ends, with its
reason, and the trainer scores it 0."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, cast

from sparrowrl.agents.environment import Turn
from sparrowrl.agents.turns import Turns
from sparrowrl.calls import Pool
from sparrowrl.spec.task import EnvironmentSpec
from sparrowrl.worker.engines import Prompt, Sample, Sampling

MAX_REASON = 1000  # characters of an episode's reason


@dataclass
class Episode:
    prompt: list[int]
    seed: int
    messages: list[dict[str, str]]  # the conversation so far: what the environment is shown
    state: dict[str, Any] | bytes  # the environment's, pickled after its first turn: never read here
    started: float = field(default_factory=time.monotonic)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[dict[str, Any]] = field(default_factory=list)
    model_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    finish: str = "eos"
    end: str | None = None
    reason: str | None = None
    reward: float | None = None  # trustWorkerRewards: the rubric's score here
    seconds: float = 0.0

    def sampled(self, s: Sample, turns: Turns) -> None:
        self.tokens += s.tokens
        self.logprobs += s.logprobs
        self.finish = s.finish
        self.model_turns += 1
        self.messages.append({"role": "assistant", "content": turns.text(s.tokens)})

    def replied(self, messages: list[dict[str, str]], ids: list[int]) -> None:
        self.turns.append({"at": len(self.tokens), "tokens": len(ids), "messages": messages})
        self.tokens += ids
        self.logprobs += [0.0] * len(ids)
        self.messages += messages

    def unreply(self) -> None:
        """The environment's last turn taken back: the episode ends with the model's."""
        turn = self.turns.pop()
        del self.tokens[turn["at"] :], self.logprobs[turn["at"] :], self.messages[-len(turn["messages"]) :]

    def close(self, end: str, reason: str | None = None) -> None:
        self.end, self.reason = end, reason[:MAX_REASON] if reason else None
        self.seconds = time.monotonic() - self.started

    def result(self) -> dict[str, Any]:
        episode = {
            "turns": self.turns,
            "end": self.end,
            "reason": self.reason,
            "seconds": self.seconds,
            "tool_calls": self.tool_calls,
            "tool_errors": self.tool_errors,
            **({"reward": self.reward} if self.reward is not None else {}),
        }
        return {"tokens": self.tokens, "logprobs": self.logprobs, "finish": self.finish, "episode": episode}


def turn_seed(seed: int, sample: int, turn: int) -> int:
    return ((seed * 1_000_003 + sample) * 1_000_033 + turn) % 2**63


class Sampler(Protocol):
    """What episodes need of an engine (engines.Engine has it)."""

    def generate(self, prompts: list[Prompt], sampling: Sampling) -> list[list[Sample]]: ...


class Episodes:
    def __init__(self, engine: Sampler, turns: Turns, env: EnvironmentSpec, pool: Pool):
        self.engine, self.turns, self.env, self.pool = engine, turns, env, pool

    def run(self, prompts: list[Prompt], examples: list[dict[str, Any]], sampling: Sampling) -> list[list[dict]]:
        """Each group's `sampling.n` episodes, as results: their tokens, behaviour log-probs (0 on
        the environment's tokens) and turns."""
        budget = self.env.max_episode_tokens
        groups = [
            [
                Episode(
                    p.ids,
                    p.seed,
                    [dict(m) for m in ex["messages"]],
                    {
                        "answer": ex["answer"],
                        "info": ex.get("fields", {}).get("info", {}),
                        "fields": ex.get("fields", {}),
                        "turn": 0,
                    },
                )
                for _ in range(sampling.n)
            ]
            for p, ex in zip(prompts, examples, strict=True)
        ]
        first = replace(sampling, max_new_tokens=min(sampling.max_new_tokens, budget))
        for episodes, samples in zip(groups, self.engine.generate(prompts, first), strict=True):
            for e, s in zip(episodes, samples, strict=True):
                e.sampled(s, self.turns)
        flat = [e for episodes in groups for e in episodes]
        index = {id(e): j for episodes in groups for j, e in enumerate(episodes)}
        while running := self._environment([e for e in flat if e.end is None]):
            by_room: dict[int, list[Episode]] = {}
            for e in running:
                by_room.setdefault(min(sampling.max_new_tokens, budget - len(e.tokens)), []).append(e)
            for room, batch in by_room.items():
                self._turn(batch, replace(sampling, n=1, max_new_tokens=room), index)
        if self.env.trust_worker_rewards:
            self._score([(e, ex) for episodes, ex in zip(groups, examples) for e in episodes if e.end != "error"])
        return [[e.result() for e in episodes] for episodes in groups]

    def _score(self, done: list[tuple[Episode, dict[str, Any]]]) -> None:
        """trustWorkerRewards: each episode scored here, by the rubric with the episode's state."""
        asks = []
        for e, ex in done:
            n = len(ex["messages"])
            asks.append(("score", e.messages[:n], e.messages[n:], ex["answer"], ex.get("fields", {}), e.state))
        for (e, _), (kind, value) in zip(done, self.pool.run(asks), strict=True):
            if kind == "ok":
                e.reward = cast(float, value)
            else:
                e.reason = f"the rubric failed here ({kind}): {value}"[:MAX_REASON]

    def _turn(self, batch: list[Episode], sampling: Sampling, index: dict[int, int]) -> None:
        """The model's next turn in each episode of `batch`, in one call. Where the engine refuses
        the call (a context beyond rollout.maxModelLen), each is asked alone, and one it refuses
        ends without the environment's turn that left it no room: its tokens end with the model's."""
        asked = [Prompt(e.prompt + e.tokens, turn_seed(e.seed, index[id(e)], e.model_turns)) for e in batch]
        try:
            out = self.engine.generate(asked, sampling)
        except ValueError as x:
            if len(batch) > 1:
                for e in batch:
                    self._turn([e], sampling, index)
                return
            batch[0].unreply()
            batch[0].close("max_tokens", f"the engine refused the model's next turn: {x}")
            return
        for e, [s] in zip(batch, out, strict=True):
            e.sampled(s, self.turns)

    def _environment(self, episodes: list[Episode]) -> list[Episode]:
        """The environment's turn in every episode that goes on; the ones that continue, each with
        room for a model turn after the environment's."""
        env, asked = self.env, []  # an episode at maxTurns is asked too: its end may be its own
        for e in episodes:
            if e.finish != "eos":
                e.close("length", f"a model turn reached grpo.maxNewTokens or the episode's tokens ({e.finish})")
            elif time.monotonic() - e.started > env.episode_seconds:
                e.close("timeout", f"the episode ran past episodeSeconds ({env.episode_seconds:g} s)")
            else:
                asked.append(e)
        going = []
        asks = [("turn", e.messages, e.state, e.model_turns >= env.max_turns, e.model_turns) for e in asked]
        for e, (kind, value) in zip(asked, self.pool.run(asks), strict=True):
            if kind != "ok":
                e.close("error", f"the environment's turn failed ({kind}): {value}")
                continue
            turn, e.state = cast(tuple[Turn, bytes], value)  # turn_caller's
            messages, done = turn.messages, turn.done
            e.tool_calls += turn.tool_calls
            e.tool_errors += turn.tool_errors
            if done:
                e.close("done")
                continue
            if e.model_turns >= env.max_turns:  # the environment would go on: the limit ends it
                e.close("max_turns")
                continue
            try:
                ids = self.turns.tokens(messages, e.tokens[-1])
            except ValueError as x:
                e.close("error", str(x))
                continue
            if len(e.tokens) + len(ids) >= env.max_episode_tokens:
                e.close(
                    "max_tokens",
                    f"the environment's turn of {len(ids)} tokens leaves no room in maxEpisodeTokens "
                    f"({env.max_episode_tokens}) after {len(e.tokens)}",
                )
                continue
            e.replied(messages, ids)
            going.append(e)
        return going
