"""Hands out rollout work as leases and admits results, beside the trainer.

Batch b holds the prompt groups that train version b+1 from version b. Its groups may be
generated with any policy version w where b - staleness <= w, so with staleness 1 workers
generate batch b+1 with version b while the trainer makes version b+1 from batch b, and fetch
b+1 while they do. A lease is a few groups of one batch, a deadline and the batch's oldest
allowed version; a result is admitted only if its lease is still live, and its version is
allowed and hashes to what the trainer published. An expired lease's groups go back to the
queue; a result for a group already admitted is dropped and counted.

Pure bookkeeping, no I/O: the trainer's HTTP routes call it, tests call it directly. `state()`
and `restore()` carry it across a trainer restart (the trainer journals them, see `journal.py`).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field


@dataclass
class Lease:
    id: int
    worker: str
    batch: int
    groups: list[int]
    deadline: float


@dataclass
class Batch:
    index: int
    groups: list[int]
    pending: list[int]
    results: dict[int, dict] = field(default_factory=dict)  # group → admitted result

    @property
    def complete(self) -> bool:
        return len(self.results) == len(self.groups)


@dataclass
class Counts:
    admitted: int = 0
    batches_trained: int = 0  # batches handed to the trainer
    trained: int = 0  # admitted groups in them
    requeued: int = 0  # leased groups that went back to the queue: their lease expired or was refused
    refused: int = 0  # groups whose results were refused (a stale version, a wrong hash, malformed)
    leases_expired: int = 0  # leases whose deadline passed before their results came
    duplicated: int = 0  # results for groups already admitted (a reassigned lease came back twice)
    verified: int = 0  # worker commits whose state hash matched the trainer's
    mismatched: int = 0


class Coordinator:
    def __init__(self, prompts_per_step: int, groups_per_lease: int, lease_seconds: float, staleness: int,
                 steps: int, clock=time.monotonic):
        self.per_step, self.per_lease, self.lease_seconds = prompts_per_step, groups_per_lease, lease_seconds
        self.staleness, self.steps, self.clock = staleness, steps, clock
        self.hashes: dict[int, str] = {}  # published version → state hash
        self.batches: dict[int, Batch] = {}
        self.leases: dict[int, Lease] = {}
        self.counts = Counts()
        self.commits: dict[str, tuple[int, str]] = {}  # worker → (version, hash) it last committed
        self.taken = 0  # batches handed to the trainer; their results are let go
        self.next_lease = 1
        self.delivered: dict[int, tuple[str, int, int]] = {}  # lease → (worker, groups admitted, batch), untrained
        self._events: list[list] = []  # changes since `changes()` was last called (the trainer journals them)

    @property
    def published(self) -> int:
        return max(self.hashes, default=-1)

    def publish(self, version: int, state_hash: str) -> None:
        self.hashes[version] = state_hash

    def min_version(self, batch: int) -> int:
        return batch - self.staleness

    def _batch(self, b: int) -> Batch:
        assert b >= self.taken, f"batch {b} was trained already"
        if b not in self.batches:
            groups = list(range(b * self.per_step, (b + 1) * self.per_step))
            self.batches[b] = Batch(b, groups, list(groups))
        return self.batches[b]

    def _open_batches(self) -> list[int]:
        """Batches whose oldest allowed version is published and that still need groups."""
        first = min((b for b, x in self.batches.items() if not x.complete), default=self.taken)
        return [b for b in range(first, min(self.steps, self.published + self.staleness + 1))
                if not self._batch(b).complete]

    def expire(self) -> None:
        now = self.clock()
        for lease in [x for x in self.leases.values() if x.deadline <= now]:
            self.counts.leases_expired += 1
            self._drop(lease)

    def _drop(self, lease: Lease, refused: bool = False) -> None:
        del self.leases[lease.id]
        self._events.append(["drop", lease.id])
        self.counts.refused += len(lease.groups) if refused else 0
        if lease.batch < self.taken:  # trained without it: nothing goes back
            return
        batch = self.batches[lease.batch]
        back = [g for g in lease.groups if g not in batch.results]
        self.counts.requeued += len(back)
        batch.pending = sorted(batch.pending + back)

    def work(self, worker: str, version: int) -> dict:
        """What `worker`, holding `version`, should do next: a lease, a version to reach first,
        `wait` (everything is leased; ask again when something changes), or `done` with the
        final version, which the worker should still commit and verify."""
        self.expire()
        if all(self._batch(b).complete for b in range(self.taken, self.steps)):
            return {"done": self.steps}
        for b in self._open_batches():
            batch = self.batches[b]
            if not batch.pending:
                continue
            if version < self.min_version(b):
                return {"update": self.min_version(b)}
            groups, batch.pending = batch.pending[:self.per_lease], batch.pending[self.per_lease:]
            lease = Lease(self.next_lease, worker, b, groups, self.clock() + self.lease_seconds)
            self.leases[lease.id] = lease
            self.next_lease += 1
            self._events.append(["lease", lease.id, worker, b, groups])
            return {"lease": {"id": lease.id, "batch": b, "groups": groups, "deadline_s": self.lease_seconds}}
        return {"wait": True}

    def submit(self, lease_id: int, worker: str, version: int, state_hash: str, results: dict[int, dict]) -> dict:
        """Admit a lease's results, or refuse them all with the reason."""
        self.expire()
        lease = self.leases.get(lease_id)
        if lease is None:
            if (d := self.delivered.get(lease_id)) and d[0] == worker:  # delivered again (a retry): the same answer
                return {"admitted": d[1], "batch": d[2], "groups": []}
            return self._late(lease_id, worker, version, state_hash, results)
        if lease.worker != worker:
            return {"admitted": 0, "refused": f"lease {lease_id} is not {worker}'s"}
        b = lease.batch
        if version < self.min_version(b) or self.hashes.get(version) != state_hash:
            self._drop(lease, refused=True)
            why = (f"version {version} is older than batch {b} allows ({self.min_version(b)})"
                   if version < self.min_version(b) else f"state hash {state_hash[:16]} is not the trainer's v{version}")
            return {"admitted": 0, "refused": why}
        if sorted(results) != sorted(lease.groups):
            self._drop(lease, refused=True)
            return {"admitted": 0, "refused": f"results cover groups {sorted(results)}, the lease has {lease.groups}"}
        del self.leases[lease_id]
        self._events.append(["drop", lease_id])
        return self._admit(lease_id, worker, b, version, results)

    def _admit(self, lease_id: int, worker: str, b: int, version: int, results: dict[int, dict]) -> dict:
        """Keep the results of groups not yet admitted; count the others as duplicated (another
        worker's late results for the same groups came first, or the batch is trained)."""
        batch = self.batches.get(b) if b >= self.taken else None
        new = {g: r for g, r in results.items() if batch is not None and g not in batch.results}
        self.counts.duplicated += len(results) - len(new)
        for g, r in new.items():
            batch.results[g] = {**r, "version": version}
        if new:
            batch.pending = [x for x in batch.pending if x not in new]
        self.counts.admitted += len(new)
        if new:
            self.delivered[lease_id] = (worker, len(new), b)
            self._events.append(["delivered", lease_id, worker, len(new), b])
        return {"admitted": len(new), "batch": b, "groups": sorted(new)}

    def _late(self, lease_id: int, worker: str, version: int, state_hash: str, results: dict[int, dict]) -> dict:
        """Results of a lease that expired (or that a previous trainer process handed out):
        still good for groups nobody has delivered yet (a slow worker is not wasted), dropped and
        counted for groups already admitted. One lease is one batch's groups."""
        not_live = {"admitted": 0, "refused": f"lease {lease_id} is not live (expired or reassigned)"}
        if lease_id >= self.next_lease:
            return {"admitted": 0, "refused": f"lease {lease_id} was never handed out"}
        batches = {g // self.per_step for g in results}
        b = batches.pop() if len(batches) == 1 else -1
        if not 0 <= b < self.steps:
            return {"admitted": 0, "refused": f"lease {lease_id} is not live, and its groups are not one batch's"}
        if b >= self.taken:
            if version < self.min_version(b) or self.hashes.get(version) != state_hash:
                return not_live
            self._batch(b)
        ans = self._admit(lease_id, worker, b, version, results)
        return ans if ans["admitted"] else not_live

    def refuse(self, lease_id: int, worker: str) -> None:
        """Drop a live lease whose results were refused: its groups go back to the queue."""
        lease = self.leases.get(lease_id)
        if lease is not None and lease.worker == worker:
            self._drop(lease, refused=True)

    def commit(self, worker: str, version: int, state_hash: str) -> bool:
        """A worker reports the weights it now holds; True if they are the trainer's, bit for bit."""
        ok = self.hashes.get(version) == state_hash
        if ok:
            self.counts.verified += 1
        else:
            self.counts.mismatched += 1
        self.commits[worker] = (version, state_hash)
        self._events.append(["commit", worker, version, state_hash])
        return ok

    def take(self, b: int) -> Batch | None:
        """Batch b's results once every group is admitted; the coordinator lets them go."""
        batch = self.batches.get(b)
        if batch is None or not batch.complete or b != self.taken:
            return None
        del self.batches[b]
        self.taken = b + 1
        self.delivered = {k: d for k, d in self.delivered.items() if d[2] > b}
        self.counts.batches_trained += 1
        self.counts.trained += len(batch.results)
        return batch

    @property
    def lost(self) -> int:
        """Groups of the batches trained so far that the trainer did not train on: a batch is
        handed over only when every group of it is admitted, so this must stay 0."""
        return self.counts.batches_trained * self.per_step - self.counts.trained

    # ---- across a trainer restart ----
    def state(self) -> dict:
        """Everything but the admitted results (the trainer journals those as they come) and the
        hashes (the store holds them), as JSON: what `restore` takes, and `replay` updates."""
        return {"next_lease": self.next_lease, "counts": asdict(self.counts),
                "commits": {w: list(c) for w, c in self.commits.items()},
                "leases": {str(x.id): [x.worker, x.batch, x.groups] for x in self.leases.values()},
                "delivered": {str(k): list(d) for k, d in self.delivered.items()}}

    def changes(self) -> list[list]:
        """What changed since the last call, as events `replay` applies to a `state`: a few
        entries per request, whatever the number of workers."""
        events, self._events = self._events, []
        return [*events, ["counts", asdict(self.counts)], ["next_lease", self.next_lease]]

    @staticmethod
    def replay(state: dict, events: list[list]) -> None:
        """Apply `changes()` to a `state()` in place."""
        for e in events:
            kind = e[0]
            if kind == "lease":
                state["leases"][str(e[1])] = e[2:]
            elif kind == "drop":
                state["leases"].pop(str(e[1]), None)
            elif kind == "delivered":
                state["delivered"][str(e[1])] = e[2:]
            elif kind == "commit":
                state["commits"][e[1]] = e[2:]
            else:  # counts, next_lease
                state[kind] = e[1]

    def restore(self, state: dict, taken: int, results: dict[int, dict[int, dict]]) -> None:
        """Pick up where a previous trainer process left off: `taken` batches are trained (the
        trainer's checkpoint says how many), `results` are the admitted results of the others
        (batch → group → result). Leases stay live, with a full period from now: their workers
        could not deliver while the trainer was away. Lease ids are never reused."""
        self.taken, self.next_lease = taken, state["next_lease"]
        self.counts = Counts(**state["counts"])
        self.counts.batches_trained, self.counts.trained = taken, taken * self.per_step
        self.commits = {w: (c[0], c[1]) for w, c in state["commits"].items()}
        self.delivered = {int(k): (d[0], d[1], d[2]) for k, d in state["delivered"].items() if d[2] >= taken}
        for b, groups in results.items():
            if b >= taken:
                self._batch(b).results.update(groups)
        deadline = self.clock() + self.lease_seconds
        for k, (worker, b, groups) in state["leases"].items():
            if b >= taken:
                self.leases[int(k)] = Lease(int(k), worker, b, groups, deadline)
        for b in sorted({x.batch for x in self.leases.values()} | set(self.batches)):
            batch = self._batch(b)
            leased = {g for x in self.leases.values() if x.batch == b for g in x.groups}
            batch.pending = [g for g in batch.groups if g not in batch.results and g not in leased]
