"""Held-out evaluation rounds (`task.eval`), beside the coordinator's training batches.

Every `every` versions (and at version 0 and the last) a round opens: each of the eval prompts
is to be generated, `samples` times, by a worker that holds exactly that version. A worker that
asks for work while it holds a round's version gets an eval lease first (a round is small, and
no other version can stand in for it); the trainer scores what comes back with the job's reward
and never trains on it. A round whose version every worker has left behind stays partial: it is
closed when the next one opens, and scored on what it has. Rounds live only in the trainer's
memory: a restarted trainer opens the next one on time, and a round cut short by the restart is
not scored.

Pure bookkeeping on an injected clock, as `Coordinator` is: tests call it directly."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

FIRST_LEASE = 1 << 61  # eval lease ids: apart from the training leases', and within what a body may carry


def pass_at(n: int, correct: int, k: int) -> float:
    """The chance that k of a prompt's n samples, drawn without replacement, hold a correct one
    (Codex's unbiased estimator)."""
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


@dataclass
class Round:
    version: int
    pending: list[int]  # eval prompt indices not yet leased
    results: dict[int, dict] = field(default_factory=dict)  # prompt index → {"samples": [...], "worker": ...}
    closed: bool = False  # superseded before it was complete: scored on what it has

    def complete(self, prompts: int) -> bool:
        return len(self.results) == prompts


@dataclass
class EvalLease:
    id: int
    worker: str
    version: int
    prompts: list[int]
    deadline: float


class Evals:
    def __init__(
        self, prompts: int, every: int, steps: int, per_lease: int, lease_seconds: float, clock=time.monotonic
    ):
        self.prompts, self.every, self.steps = prompts, every, steps
        self.per_lease, self.lease_seconds, self.clock = per_lease, lease_seconds, clock
        self.rounds: dict[int, Round] = {}  # version → its round, until scored
        self.leases: dict[int, EvalLease] = {}
        self.next_lease = FIRST_LEASE

    def due(self, version: int) -> bool:
        return version % self.every == 0 or version == self.steps

    def open(self, version: int) -> None:
        """Version `version` is published: its round opens if one is due; rounds before it close."""
        if not self.due(version) or version in self.rounds:
            return
        self.close()
        self.rounds[version] = Round(version, list(range(self.prompts)))

    def close(self) -> None:
        """Every round is over: what is incomplete is scored on what it has."""
        for r in self.rounds.values():
            r.closed = True

    def is_lease(self, lease_id: int) -> bool:
        return lease_id >= FIRST_LEASE

    def expire(self) -> None:
        now = self.clock()
        for lease in [x for x in self.leases.values() if x.deadline <= now]:
            self._drop(lease)

    def _drop(self, lease: EvalLease) -> None:
        del self.leases[lease.id]
        r = self.rounds.get(lease.version)
        if r is not None and not r.closed:
            r.pending = sorted(r.pending + [p for p in lease.prompts if p not in r.results])

    def work(self, worker: str, version: int) -> dict | None:
        """An eval lease for `worker`, which holds `version`, if that version's round has prompts
        to generate; else None (training work)."""
        self.expire()
        r = self.rounds.get(version)
        if r is None or r.closed or not r.pending:
            return None
        prompts, r.pending = r.pending[: self.per_lease], r.pending[self.per_lease :]
        lease = EvalLease(self.next_lease, worker, version, prompts, self.clock() + self.lease_seconds)
        self.leases[lease.id] = lease
        self.next_lease += 1
        return {"id": lease.id, "version": version, "prompts": prompts, "deadline_s": self.lease_seconds}

    def submit(self, lease_id: int, worker: str, version: int, results: dict[int, dict]) -> dict:
        """An eval lease's results (their state hash already checked), or why they are refused."""
        self.expire()
        lease = self.leases.get(lease_id)
        if lease is None or lease.worker != worker:
            return {"admitted": 0, "refused": f"eval lease {lease_id} is not live, or not {worker}'s"}
        if version != lease.version or sorted(results) != sorted(lease.prompts):
            self._drop(lease)
            return {
                "admitted": 0,
                "refused": f"eval lease {lease_id} is for v{lease.version}, prompts {lease.prompts}",
            }
        del self.leases[lease_id]
        r = self.rounds.get(version)
        if r is None:
            return {"admitted": 0, "refused": f"the eval of v{version} is over"}
        for p, res in results.items():
            r.results.setdefault(p, {**res, "worker": worker})
        return {"admitted": len(results)}

    def ready(self) -> list[Round]:
        """Rounds to score now: complete, or closed; they leave the book."""
        out = [r for r in self.rounds.values() if r.complete(self.prompts) or r.closed]
        for r in out:
            del self.rounds[r.version]
            for lid in [i for i, x in self.leases.items() if x.version == r.version]:
                del self.leases[lid]
        return [r for r in out if r.results]

    def waiting(self, version: int) -> bool:
        """Whether the round of `version` is still to complete."""
        r = self.rounds.get(version)
        return r is not None and not r.closed and not r.complete(self.prompts)
