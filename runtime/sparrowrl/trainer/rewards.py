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

import ctypes
import logging
import math
import multiprocessing
import multiprocessing.connection
import numbers
import os
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import cast

from sparrowrl.trainer import tasks

log = logging.getLogger(__name__)

FAILURES = ("raised", "timeout", "nonfinite", "nonnumber", "outofrange")
MAX_REWARD = 1e6  # beyond, a reward is a bug in it: its square must stay finite in float32, as advantages take it
START_SECONDS = 120.0  # a worker process that has not loaded the reward by then is replaced

Item = tuple[str, str, str, dict]  # prompt (rendered), completion, answer, the example's other fields
Outcome = tuple[str, object]  # ("ok", reward) or (a kind of FAILURES, its message)


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


@dataclass
class _Worker:
    """One process of the pool, and the call it holds."""

    proc: BaseProcess
    conn: multiprocessing.connection.Connection
    ready: bool = False
    started: float = 0.0
    item: int | None = None  # the index of the call it holds (only once ready)
    deadline: float = math.inf  # of that call (none: never)


class Pool:
    """Worker processes that each run a user's reward, one call at a time."""

    def __init__(self, name: str, size: int, timeout: float):
        self.name, self.timeout = name, timeout
        self.ctx = multiprocessing.get_context("spawn")
        self.workers = [self._start() for _ in range(size)]

    def _start(self) -> _Worker:
        mine, theirs = self.ctx.Pipe()
        p = self.ctx.Process(target=_serve, args=(self.name, theirs, os.getpid()), daemon=True, name="reward")
        p.start()
        theirs.close()
        return _Worker(p, mine, started=time.monotonic())

    def _replace(self, w: _Worker) -> _Worker:
        w.proc.kill()
        w.proc.join()
        w.conn.close()
        return self._start()

    def run(self, items: list[Item]) -> list[Outcome]:
        out: list[Outcome | None] = [None] * len(items)
        todo = deque(range(len(items)))
        while todo or any(w.item is not None for w in self.workers):
            for i, w in enumerate(self.workers):
                if w.ready and w.item is None and todo:
                    w.item, w.deadline = todo.popleft(), time.monotonic() + self.timeout
                    try:
                        w.conn.send(items[w.item])
                    except OSError:  # its process died between calls
                        self._fail(i, out, todo, "raised", "its process died")
            watched = [w for w in self.workers if w.item is not None or not w.ready]
            soonest = min(w.deadline if w.ready else w.started + START_SECONDS for w in watched)
            ready = multiprocessing.connection.wait([w.conn for w in watched], max(0.0, soonest - time.monotonic()))
            now = time.monotonic()
            for i, w in enumerate(self.workers):
                if w.conn in ready:
                    try:
                        kind, value = w.conn.recv()
                    except (EOFError, OSError):
                        w.proc.join()
                        self._fail(i, out, todo, "raised", f"its process died (exit code {w.proc.exitcode})")
                        continue
                    if kind == "ready":
                        w.ready = True
                    elif kind == "load":  # it loaded at start: the file has changed since
                        self._fail(i, out, todo, "raised", value, every=True)
                    else:
                        assert w.item is not None  # an answer is to the call it holds
                        out[w.item], w.item, w.deadline = (kind, value), None, math.inf
                elif w.item is not None and w.ready and w.deadline <= now:
                    self._fail(i, out, todo, "timeout", f"no answer in {self.timeout:g} s (its process was replaced)")
                elif not w.ready and w.started + START_SECONDS <= now:
                    message = f"its process did not load the reward in {START_SECONDS:g} s"
                    self._fail(i, out, todo, "timeout", message, every=True)
        return cast(list[Outcome], out)  # every call answered: the loop ends when none is left

    def _fail(self, i: int, out: list, todo: deque, kind: str, message: str, every: bool = False) -> None:
        """Worker i failed, and its process is killed and replaced. The call it holds fails; a
        process that could not load the reward held none, and then every call still waiting
        fails (the next `run` tries again), so that `run` ends even if the reward cannot load."""
        w = self.workers[i]
        failed = [w.item] if w.item is not None else []
        if every:
            failed += todo
            todo.clear()
        for item in failed:
            out[item] = (kind, message)
        self.workers[i] = self._replace(w)

    def close(self) -> None:
        for w in self.workers:
            try:
                w.conn.send(None)
            except OSError:
                pass
        for w in self.workers:
            w.proc.join(5.0)
            if w.proc.exitcode is None:
                w.proc.kill()
                w.proc.join()
            w.conn.close()
        self.workers = []


def _serve(name: str, conn: multiprocessing.connection.Connection, parent: int) -> None:
    """A pool process: load the reward, then answer calls until told to stop (None)."""
    if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL) != 0:  # 1: PR_SET_PDEATHSIG
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the trainer died before the line above
        os._exit(1)
    try:
        fn = tasks.reward_function(name)
    except Exception as e:
        conn.send(("load", str(e)))
        return
    conn.send(("ready", None))
    try:
        while (item := conn.recv()) is not None:
            conn.send(call(fn, item))
    except EOFError:  # the trainer has gone
        pass


class Scorer:
    """A job's reward: `score` a batch's samples, in parallel when the reward is a user's."""

    def __init__(self, name: str, workers: int | None = None, timeout: float = 30.0):
        self.name = name
        self.fn = tasks.REWARDS.get(name)
        size = workers or min(4, os.cpu_count() or 1)
        self.pool = None if self.fn else Pool(name, size, timeout)
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
