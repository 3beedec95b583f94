"""The ranks of a sharded trainer on one node (one pod, or one process group of `sparrowrl run`).
A node's first process meets the other nodes (rendezvous.py), starts its node's other ranks
itself (no torchrun needed), and they live and die together: a rank that exits ends the node's
first process at once, and its end (even by SIGKILL) ends the others. So a node stops as a whole,
and whoever runs the nodes (the operator, `sparrowrl run`) starts the gang again as a whole; it
resumes from its checkpoint. On node 0 the first process is rank 0: it serves, coordinates and
writes the store.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from multiprocessing.process import BaseProcess

import torch.distributed as dist

from sparrowrl import logs
from sparrowrl.trainer import rendezvous

log = logging.getLogger(__name__)


class Ranks:
    """A node's first rank's handle on the node's others: `stop` them before a clean exit; any
    other exit of theirs ends this process."""

    def __init__(self, procs: Sequence[BaseProcess], first: int = 0):
        self.procs, self.first, self.stopping = procs, first, False
        if procs:
            threading.Thread(target=self._watch, daemon=True, name="ranks").start()

    def _watch(self) -> None:
        ready = multiprocessing.connection.wait([p.sentinel for p in self.procs])
        if self.stopping:
            return
        p = next(p for p in self.procs if p.sentinel in ready)
        p.join()
        log.error(
            f"trainer: rank {self.first + self.procs.index(p) + 1} exited (code {p.exitcode}); the trainer stops "
            f"as a whole and resumes from its checkpoint when started again"
        )
        os._exit(1)

    def stop(self, tell: Callable[[], None], timeout: float = 60.0) -> None:
        """`tell` the others to exit (the last collective), and wait for them."""
        self.stopping = True
        tell()
        for p in self.procs:
            p.join(timeout)
            if p.exitcode is None:
                p.kill()
        dist.destroy_process_group()


def start(gang: rendezvous.Gang, me: dict, follower: Callable[..., None], *args) -> Ranks:
    """Join the gang as this node's first rank (`me`: what this node is, rendezvous.describe) and
    start the node's others, each running `follower(*args)` inside the process group (they make
    the same collective calls as rank 0)."""
    store = rendezvous.meet(gang, me)
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=_rank, args=(gang, r, os.getpid(), follower, args), name=f"rank{r}")
        for r in range(gang.first + 1, gang.first + gang.per_node)
    ]
    for p in procs:
        p.start()
    ranks = Ranks(procs, gang.first)
    rendezvous.join(gang, gang.first, store)
    if gang.node == 0:
        log.info(f"trainer: {gang.world} ranks on {gang.nodes} node(s) ({rendezvous.backend()}), rank 0 serving")
    return ranks


def leave() -> None:
    """End a rank's process that has finished, without the interpreter's teardown: there, gloo's
    threads may still hold work whose release aborts the process (SIGABRT; pytorch/pytorch#179291),
    and a rank that finished must not look like one that failed. Call after destroy_process_group."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _rank(gang: rendezvous.Gang, rank: int, parent: int, follower: Callable[..., None], args: tuple) -> None:
    if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL) != 0:  # 1: PR_SET_PDEATHSIG
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # rank 0 died before the line above
        os._exit(1)
    logs.adopt()  # rank 0's format and level, from the environment it was started with
    rendezvous.join(gang, rank)
    follower(*args)
    dist.destroy_process_group()
    leave()
