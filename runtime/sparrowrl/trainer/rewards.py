"""Scoring a batch's samples: every reward call of a step in one `score`, and no reward's fault
stops the trainer.

The built-in rewards (tasks.REWARDS) are ours and cannot hang: they run here, in the calling
thread (the learner's, off the event loop). A user's reward (FILE.py:function) runs in a small
pool of worker processes (spawned; each loads the reward from its file itself), one call per
process at a time, so a batch's calls run in parallel, each bounded by a timeout.

A call that raises, outlives its timeout (its process is killed and replaced), or returns a
non-finite number, one beyond ±MAX_REWARD, or something that is not a number scores its sample 0.0: a sample that could
not be scored earns nothing, as a wrong answer, and its group's other samples still count. Each
failure is counted by kind (FAILURES) for the step's metrics, and the first of each kind is
logged with its message, once.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
import threading
from functools import partial
from typing import Callable, cast

from sparrowrl.agents import environment
from sparrowrl.calls import Outcome, Pool
from sparrowrl.spec.job import JobSpec
from sparrowrl.trainer import tasks

log = logging.getLogger(__name__)

FAILURES = ("raised", "timeout", "nonfinite", "nonnumber", "outofrange")
MAX_REWARD = 1e6  # beyond, a reward is a bug in it: its square must stay finite in float32, as advantages take it

Item = tuple[
    object, object, str, dict
]  # prompt and completion (text, or an episode's messages), answer, the example's other fields


def call(fn: tasks.Reward, item: Item) -> Outcome:
    """One reward call, judged; never raises."""
    prompt, completion, answer, fields = item
    try:
        r = fn(prompt, completion, answer, **fields)
    except BaseException as e:  # a reward's sys.exit() is its failure too, not the process's end
        return "raised", f"{type(e).__name__}: {str(e)[:500]}"
    if not isinstance(r, numbers.Real):
        return "nonnumber", f"returned {type(r).__name__} {str(r)[:100]!r}, not a number"
    if not math.isfinite(r := float(r)):
        return "nonfinite", f"returned {r}"
    if abs(r) > MAX_REWARD:
        return "outofrange", f"returned {r:g}, beyond ±{MAX_REWARD:g}"
    return "ok", r


def judged(load: Callable[[], tasks.Reward]) -> Callable[[Item], Outcome]:
    """In a pool process: the reward `load` returns, each call judged (`call`)."""
    return partial(call, load())


def named(name: str) -> Callable[[Item], Outcome]:
    return judged(partial(tasks.reward_function, name))


class Scorer:
    """A job's reward: `score` a batch's samples, in parallel when the reward is a user's.
    `load`: where a pool process gets the reward (default: by its name, `tasks.reward_function`)."""

    def __init__(
        self,
        name: str,
        workers: int | None = None,
        timeout: float = 30.0,
        load: Callable[[], Callable[[Item], Outcome]] | None = None,
    ):
        self.name = name
        self.fn = tasks.REWARDS.get(name) if load is None else None
        size = workers or min(4, os.cpu_count() or 1)
        self.pool = None if self.fn else Pool(load or partial(named, name), size, timeout, "reward")
        self.logged: set[str] = set()
        self.lock = threading.Lock()  # one call at a time: a step's, an eval round's, admitted groups' (refills)

    def score(self, items: list[Item]) -> tuple[list[float], dict[str, int]]:
        """Each item's reward (0.0 where it failed), and the failures by kind."""
        with self.lock:
            if self.pool is not None:
                outcomes = self.pool.run(items)
            else:
                assert self.fn is not None  # a reward of this process's, without a pool
                outcomes = [call(self.fn, x) for x in items]
        rewards: list[float] = []
        failed = dict.fromkeys(FAILURES, 0)
        for kind, value in outcomes:
            if kind == "ok":
                rewards.append(cast(float, value))  # call()'s float
                continue
            rewards.append(0.0)
            failed[kind] += 1
            if kind not in self.logged:
                self.logged.add(kind)
                log.warning(
                    f"trainer: reward {self.name}: a call failed ({kind}): {value}; such samples score 0.0 and are "
                    f"counted in metrics.jsonl's reward_failed (this is said once per kind)"
                )
        return rewards, failed

    def close(self) -> None:
        if self.pool:
            self.pool.close()


def for_job(spec: JobSpec, name: str) -> Scorer:
    """The job's reward: `name`'s, or task.environment's rubric (its processes load the environment)."""
    t, env = spec.task, spec.task.environment
    load = (
        None
        if env is None
        else partial(judged, partial(environment.reward_caller, env.load, env.args, env.trust_worker_rewards))
    )
    return Scorer(name, t.reward_workers, t.reward_timeout_seconds, load)
