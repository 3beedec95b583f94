"""The ranks of a sharded trainer on one machine (one pod). The trainer's process is rank 0: it
serves, coordinates and writes the store; it starts ranks 1..N-1 itself (no torchrun needed),
and they live and die together. A rank that exits ends rank 0 at once, and rank 0's end (even by
SIGKILL) ends the others, so the trainer restarts as a whole and resumes from its checkpoint.

Multi-node trainers (several pods) would set MASTER_ADDR to rank 0's pod and start their ranks
with `follow`; the state layout (resume.ShardedCheckpoints) is already one folder per version
that every rank writes its own files into.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from multiprocessing.process import BaseProcess

import torch
import torch.distributed as dist

from sparrowrl import logs

log = logging.getLogger(__name__)

TIMEOUT = timedelta(minutes=30)  # a collective that waits longer than this fails (a step can be long)


class Ranks:
    """Rank 0's handle on the others: `stop` them before a clean exit; any other exit of theirs
    ends this process."""

    def __init__(self, procs: Sequence[BaseProcess]):
        self.procs, self.stopping = procs, False
        threading.Thread(target=self._watch, daemon=True, name="ranks").start()

    def _watch(self) -> None:
        ready = multiprocessing.connection.wait([p.sentinel for p in self.procs])
        if self.stopping:
            return
        p = next(p for p in self.procs if p.sentinel in ready)
        p.join()
        log.error(
            f"trainer: rank {self.procs.index(p) + 1} exited (code {p.exitcode}); the trainer stops as a whole "
            f"and resumes from its checkpoint when started again"
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


def backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def start(world: int, follower: Callable[..., None], *args) -> Ranks:
    """Become rank 0 of `world` and start the others, each running `follower(*args)` inside the
    process group (they must make the same collective calls as rank 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=_rank, args=(r, world, port, os.getpid(), follower, args), name=f"rank{r}")
        for r in range(1, world)
    ]
    for p in procs:
        p.start()
    ranks = Ranks(procs)
    _join(0, world, port)
    log.info(f"trainer: {world} ranks ({backend()}), rank 0 serving")
    return ranks


def _join(rank: int, world: int, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # the ranks share this machine's cores
    dist.init_process_group(backend(), rank=rank, world_size=world, timeout=TIMEOUT)


def leave() -> None:
    """End a rank's process that has finished, without the interpreter's teardown: there, gloo's
    threads may still hold work whose release aborts the process (SIGABRT; pytorch/pytorch#179291),
    and a rank that finished must not look like one that failed. Call after destroy_process_group."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _rank(rank: int, world: int, port: int, parent: int, follower: Callable[..., None], args: tuple) -> None:
    if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL) != 0:  # 1: PR_SET_PDEATHSIG
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # rank 0 died before the line above
        os._exit(1)
    logs.adopt()  # rank 0's format and level, from the environment it was started with
    _join(rank, world, port)
    follower(*args)
    dist.destroy_process_group()
    leave()
