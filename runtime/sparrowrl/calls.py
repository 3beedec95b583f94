"""Calls into a user's code (a reward, an environment's turn) in child processes: each call
bounded by a timeout, and no call's fault (a raise, a hang, a crash, an exit) reaches the caller
but as an outcome that says what went wrong. A process that hangs or dies is killed and replaced.

Processes are spawned, not forked: each loads the code itself, and holds nothing of its parent's
(no torch threads, no open sockets)."""

from __future__ import annotations

import ctypes
import math
import multiprocessing
import multiprocessing.connection
import os
import signal
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any, Callable, cast

START_SECONDS = 120.0  # a process that has not loaded the code by then is replaced
Outcome = tuple[str, object]  # ("ok", value) or (a kind of failure, its message)


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
    """Child processes that each load a user's code (`load()`, in the child) and answer calls
    with what it returns, one call at a time. `what` names the code in failures."""

    def __init__(self, load: Callable[[], Callable[[Any], Outcome]], size: int, timeout: float, what: str):
        self.load, self.timeout, self.what = load, timeout, what
        self.ctx = multiprocessing.get_context("spawn")
        self.workers = [self._start() for _ in range(size)]

    def _start(self) -> _Worker:
        mine, theirs = self.ctx.Pipe()
        p = self.ctx.Process(target=_serve, args=(self.load, theirs, os.getpid()), daemon=True, name=self.what)
        p.start()
        theirs.close()
        return _Worker(p, mine, started=time.monotonic())

    def _replace(self, w: _Worker) -> _Worker:
        w.proc.kill()
        w.proc.join()
        w.conn.close()
        return self._start()

    def run(self, items: list[Any]) -> list[Outcome]:
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
                    message = f"its process did not load the {self.what} in {START_SECONDS:g} s"
                    self._fail(i, out, todo, "timeout", message, every=True)
        return cast(list[Outcome], out)  # every call answered: the loop ends when none is left

    def _fail(self, i: int, out: list, todo: deque, kind: str, message: str, every: bool = False) -> None:
        """Worker i failed, and its process is killed and replaced. The call it holds fails; a
        process that could not load the code held none, and then every call still waiting
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


def _serve(
    load: Callable[[], Callable[[Any], Outcome]], conn: multiprocessing.connection.Connection, parent: int
) -> None:
    """A pool process: load the code, then answer calls until told to stop (None)."""
    if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL) != 0:  # 1: PR_SET_PDEATHSIG
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the trainer died before the line above
        os._exit(1)
    try:
        fn = load()
    except Exception as e:
        conn.send(("load", str(e)))
        return
    conn.send(("ready", None))
    try:
        while (item := conn.recv()) is not None:
            conn.send(fn(item))
    except EOFError:  # the trainer has gone
        pass
