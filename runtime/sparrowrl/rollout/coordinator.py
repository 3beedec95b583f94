"""Hands out rollout work as leases and admits results, beside the trainer.

Batch b holds the prompt groups that train version b+1 from version b. Its groups may be
generated with any policy version w where b - staleness <= w, so with staleness 1 workers
generate batch b+1 with version b while the trainer makes version b+1 from batch b, and fetch
b+1 while they do. A lease is a few groups of one batch, a deadline and the batch's oldest
allowed version; a result is admitted only if its lease is still live, and its version is
allowed and hashes to what the trainer published. An expired lease's groups go back to the
queue; a result for a group already admitted is dropped and counted.

With refills on (`grpo.zeroVarianceGroups: refill`, DAPO's dynamic sampling) a batch also
waits for the trainer's rewards: the trainer scores each group as it is admitted (`unscored`,
`scored`), and each group whose samples all scored alike, which teaches nothing, is replaced by
a new one, from prompts beyond the job's own (`REFILL`), up to `refill` groups per batch. They
are the batch's groups, leased like the others, so within the same staleness bound. How many
groups a lease holds is the job's `split` policy (sizing.py).

It owns the job's state: leases, admitted results, commits, one `Worker` per worker with what
it said of itself (its region, its fetch times, the answers it refused), and when rollouts
began, all on one injected clock (facts.py). Everyone else reads it through methods that return
copies and counts: the trainer's HTTP routes call one method per request (control.py), the
ledger reports a `view()` of it. Pure bookkeeping, no I/O: tests call it directly. `state()` and
`restore()` carry it across a trainer restart (the trainer journals them, trainer/journal.py).
"""

from __future__ import annotations

import copy
import functools
import heapq
import time
from collections import Counter
from dataclasses import asdict

from sparrowrl.rollout.answers import Answers
from sparrowrl.rollout.facts import Batch, Counts, Lease, Score, View, Worker
from sparrowrl.rollout.fleet import Fleet, FleetView
from sparrowrl.rollout.sizing import Sizer, Split

# the first refill group's id: beyond every job's own groups (steps x promptsPerStep < 2^36), and
# with the most refills (10^7 steps x 63 x 4096 groups) below tasks.HELD_OUT's eval examples
REFILL = 1 << 40


class Coordinator:
    def __init__(
        self,
        prompts_per_step: int,
        groups_per_lease: int,
        lease_seconds: float,
        staleness: int,
        steps: int,
        split: Split,
        quorum: int = 1,
        refill: int = 0,
        clock=time.monotonic,
    ):
        self.per_step, self.lease_seconds = prompts_per_step, lease_seconds
        self.staleness, self.steps, self.clock = staleness, steps, clock
        self.refill = refill  # the most groups a batch adds in place of zero-variance ones (0: none, unscored)
        self._refills: dict[int, int] = {}  # untrained batch → refill groups added to it
        self._hashes: dict[int, str] = {}  # published version → state hash
        self._published_at: dict[int, float] = {}
        self._payload: dict[int, int] = {}  # published version → bytes a worker fetches for it
        self._batches: dict[int, Batch] = {}
        self._leases: dict[int, Lease] = {}
        self._counts = Counts()
        self._taken = 0  # batches handed to the trainer; their results are let go
        self._next_lease = 1
        self._answers = Answers(lease_seconds)  # a retried delivery's (answers.py)
        self._moves = 0  # bumps whenever a worker told to wait may have work now (see `moves`)
        self._sizer = Sizer(split, groups_per_lease, clock)
        self._deadlines: list[tuple[float, int]] = []  # a heap of (deadline, lease id) of the leases handed out
        self._events: list[list] = []  # changes since `changes()` was last called (the trainer journals them)
        self._fleet = Fleet(lease_seconds, quorum, clock, self._events.append)

    # ---- what others read: copies and counts, never the dicts themselves ----
    @property
    def fleet(self) -> FleetView:
        """The workers, to read: changing them is the coordinator's."""
        return self._fleet

    @property
    def published(self) -> int:
        return max(self._hashes, default=-1)

    def hash_of(self, version: int) -> str | None:
        """The state hash the trainer published for `version` (None: not published, or pruned)."""
        return self._hashes.get(version)

    @property
    def counts(self) -> Counts:
        return Counts(**asdict(self._counts))

    @property
    def moves(self) -> int:
        """How many times a worker told to wait may have had work since the start (see `work`). A
        batch complete is not one: what a waiter learns then (reach a version not yet published,
        or done) can wait for its next look, every 0.5-1.5 s each; woken at once, a thousand of
        them were answered one by one while the learner started on that batch, in 100-200 ms."""
        return self._moves

    @property
    def passes(self) -> int:
        """Passes over every worker (a balanced split solved, `staged` checked): what scale tests count."""
        return self._fleet.passes + self._sizer.solves

    @property
    def taken(self) -> int:
        """Batches handed to the trainer."""
        return self._taken

    def leases(self) -> list[Lease]:
        """Copies of the live leases."""
        return [copy.copy(x) for x in self._leases.values()]

    def results(self, b: int, groups: list[int]) -> dict[int, dict]:
        """The admitted results of `groups` of batch b, not yet trained."""
        return {g: self._batches[b].results[g] for g in groups}

    def untrained(self) -> dict[int, dict[int, dict]]:
        """The admitted results of every batch not yet trained: batch → group → result."""
        return {b: dict(x.results) for b, x in self._batches.items()}

    def batch(self, b: int) -> Batch | None:
        """A copy of batch b, while it is not trained."""
        return copy.deepcopy(self._batches.get(b))

    # ---- what the trainer does ----
    def publish(self, version: int, state_hash: str, payload_bytes: int = 0) -> None:
        self._hashes[version] = state_hash
        self._published_at[version], self._payload[version] = self.clock(), payload_bytes
        self._moves += 1  # a batch may open

    def min_version(self, batch: int) -> int:
        return batch - self.staleness

    def _batch(self, b: int) -> Batch:
        assert b >= self._taken, f"batch {b} was trained already"
        if b not in self._batches:
            groups = list(range(b * self.per_step, (b + 1) * self.per_step))
            groups += [self._refill_base(b) + k for k in range(self._refills.get(b, 0))]
            self._batches[b] = Batch(b, groups, list(groups), scoring=self.refill > 0)
        return self._batches[b]

    def _refill_base(self, b: int) -> int:
        """Batch b's first refill group: its refills are this and the next ones."""
        return REFILL + b * self.refill

    def batch_of(self, group: int) -> int:
        return (group - REFILL) // self.refill if self.refill and group >= REFILL else group // self.per_step

    def unscored(self) -> list[tuple[int, list[int]]]:
        """Admitted groups the trainer has yet to score (refills on), by batch, oldest first."""
        return [
            (b, [g for g in x.results if g not in x.scores])
            for b, x in sorted(self._batches.items())
            if x.scoring and len(x.scores) < len(x.results)
        ]

    def scored(self, b: int, scores: dict[int, Score]) -> None:
        """The trainer's rewards of admitted groups of batch b. The batch holds a new group for
        each of its groups whose samples all scored alike, up to `refill`: counted over all it has
        scored, so scoring a group again (after a restart) adds none. A group alike because its
        reward calls failed is not replaced (a failing reward would have every batch draw its
        most), nor is any group of a batch trained before (a restart trains it again)."""
        batch = self._batches.get(b) if b >= self._taken else None
        if batch is None:
            return
        batch.scores.update({g: s for g, s in scores.items() if g in batch.results})
        added = len(batch.groups) - self.per_step
        alike = sum(not varied and not any(failed.values()) for _, failed, varied in batch.scores.values())
        more = min(self.refill, alike) - added if b >= self.published else 0
        if more > 0:
            new = [self._refill_base(b) + k for k in range(added, added + more)]
            batch.groups += new
            batch.pending += new
            self._refills[b] = added + more
            self._counts.refilled += more
            self._events.append(["refills", b, added + more])
            self._moves += 1
        if batch.complete and batch.done is None:
            batch.done = self.clock()

    def _open_batches(self) -> list[int]:
        """Batches whose oldest allowed version is published and that still need groups."""
        first = min((b for b, x in self._batches.items() if not x.complete), default=self._taken)
        open_ = [
            b for b in range(first, min(self.steps, self.published + self.staleness + 1)) if not self._batch(b).complete
        ]
        for b in open_:
            if self._batches[b].opened is None:
                self._batches[b].opened = self._published_at.get(self.min_version(b), self.clock())
        return open_

    def expire(self) -> None:
        """Drop the leases whose deadline has passed: a heap, so a call costs nothing while none has."""
        now = self.clock()
        self._answers.expire(now)
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, lid = heapq.heappop(self._deadlines)
            lease = self._leases.get(lid)
            if lease is not None and lease.deadline == deadline:  # not delivered or dropped since
                self._counts.leases_expired += 1
                self._drop(lease)

    def _hand_out(self, lease: Lease) -> None:
        self._leases[lease.id] = lease
        heapq.heappush(self._deadlines, (lease.deadline, lease.id))
        if len(self._deadlines) > 2 * len(self._leases) + 64:  # delivered leases' entries, with long leases
            self._deadlines = [(x.deadline, x.id) for x in self._leases.values()]
            heapq.heapify(self._deadlines)

    def _drop(self, lease: Lease, refused: bool = False) -> None:
        del self._leases[lease.id]
        self._events.append(["drop", lease.id])
        self._counts.refused += len(lease.groups) if refused else 0
        if lease.batch < self._taken:  # trained without it: nothing goes back
            return
        batch = self._batches[lease.batch]
        back = [g for g in lease.groups if g not in batch.results]
        self._counts.requeued += len(back)
        batch.pending = sorted(batch.pending + back)
        self._moves += 1 if back else 0

    def work(self, worker: str, version: int, region: str | None = None) -> dict:
        """What `worker`, holding `version`, should do next: a lease, a version to reach first,
        `wait` (rollouts have not started, or everything is leased: ask again when something
        changes), or `done` with the final version, which the worker should still commit and
        verify. In a job of `many` workers, a worker with nothing to do until the next version,
        which is sure to come (its batch is complete), is told to reach it: its own fetcher waits
        for the publish, on a relay, rather than a thousand long polls here all waking at it,
        answered one by one (it asks again within UPDATE_WAIT_S meanwhile, worker.py)."""
        self.expire()
        self.heard(worker)
        self._fleet.locate(worker, region)
        if not self.started():
            return {"wait": True}
        if all(self._batch(b).complete for b in range(self._taken, self.steps)):
            return {"done": self.steps}
        for b in self._open_batches():
            batch = self._batches[b]
            if not batch.pending:
                continue
            if version < self.min_version(b):
                return {"update": self.min_version(b)}
            ready = functools.partial(self._ready, b=b)
            n = self._sizer.size(self._fleet[worker], batch, self._fleet, self._leases.values(), ready)
            if not n:  # the others finish this batch sooner: perhaps the next one
                continue
            groups, batch.pending = batch.pending[:n], batch.pending[n:]
            now = self.clock()
            lease = Lease(self._next_lease, worker, b, groups, now + self.lease_seconds, now)
            self._hand_out(lease)
            batch.given[worker] = batch.given.get(worker, 0) + n
            self._next_lease += 1
            self._events.append(["lease", lease.id, worker, b, groups])
            return {"lease": {"id": lease.id, "batch": b, "groups": groups, "deadline_s": self.lease_seconds}}
        coming = self.published + 1  # the oldest version the next batch allows
        if self._fleet.many and version < coming and coming + self.staleness < self.steps and self._trains(coming):
            return {"update": coming}
        return {"wait": True}

    def _trains(self, version: int) -> bool:
        """Whether `version` will be published whatever becomes of the leases out: its batch is complete."""
        b = version - 1
        return b < self._taken or (b in self._batches and self._batches[b].complete)

    def heard(self, worker: str) -> None:
        """A worker called (for work, with results, with a commit)."""
        self._fleet.heard(worker)

    def started(self) -> bool:
        """Whether rollouts have started (`Fleet.started`): a move the first time."""
        if not self._fleet.begun and self._fleet.started():
            self._moves += 1
        return self._fleet.begun

    def _ready(self, w: Worker, busy: float, b: int) -> float:
        """Seconds until `w` can start on batch b: its leases done (`busy`), the batch's version fetched."""
        need, fetch = self.min_version(b), 0.0
        if (w.committed or (-1,))[0] < need and need in self._published_at:
            fetch = max(0.0, w.speed.fetch_s(self._payload[need]) - (self.clock() - self._published_at[need]))
        return max(busy, fetch)

    def submit(
        self,
        lease_id: int,
        worker: str,
        version: int,
        state_hash: str,
        results: dict[int, dict],
        generate_s: float | None = None,
    ) -> dict:
        """Admit a lease's results, or refuse them all with the reason. `generate_s`, the seconds
        the worker took, measures its speed."""
        self.expire()
        self.heard(worker)
        lease = self._leases.get(lease_id)
        if lease is None:  # a retry gets the answer its delivery was given; others came late
            again = self._answers.get(lease_id, worker)
            return again or self._late(lease_id, worker, version, state_hash, results, generate_s)
        if lease.worker != worker:
            return {"admitted": 0, "refused": f"lease {lease_id} is not {worker}'s"}
        b = lease.batch
        if version < self.min_version(b) or self._hashes.get(version) != state_hash:
            self._drop(lease, refused=True)
            why = (
                f"version {version} is older than batch {b} allows ({self.min_version(b)})"
                if version < self.min_version(b)
                else f"state hash {state_hash[:16]} is not the trainer's v{version}"
            )
            return {"admitted": 0, "refused": why}
        if sorted(results) != sorted(lease.groups):
            self._drop(lease, refused=True)
            return {"admitted": 0, "refused": f"results cover groups {sorted(results)}, the lease has {lease.groups}"}
        del self._leases[lease_id]
        self._events.append(["drop", lease_id])
        self._sizer.measured(self._fleet[worker], results, generate_s)
        return self._admit(lease_id, worker, b, version, results, generate_s)

    def _admit(
        self, lease_id: int, worker: str, b: int, version: int, results: dict[int, dict], generate_s: float | None
    ) -> dict:
        """Keep the results of groups not yet admitted; count the others as discarded late (another
        worker's late results for the same groups came first, or the batch is trained)."""
        batch = self._batches.get(b) if b >= self._taken else None
        new = {g: r for g, r in results.items() if batch is not None and g not in batch.results}
        self._counts.discarded_late += len(results) - len(new)
        if batch is not None and new:  # nothing is new without a batch
            for g, r in new.items():
                batch.results[g] = {**r, "version": version, "worker": worker, "lease": lease_id}
            batch.pending = [x for x in batch.pending if x not in new]
            if batch.complete:
                batch.done = self.clock()  # not a move: see `moves`
            batch.worker_seconds += generate_s or 0.0
            self._events.append(["worker_seconds", b, batch.worker_seconds])
        self._counts.admitted += len(new)
        if new:
            self._answers.give(lease_id, worker, len(new), b)
            self._events.append(["delivered", lease_id, worker, len(new), b])
        return {"admitted": len(new), "batch": b, "groups": sorted(new)}

    def _late(
        self,
        lease_id: int,
        worker: str,
        version: int,
        state_hash: str,
        results: dict[int, dict],
        generate_s: float | None,
    ) -> dict:
        """Results of a lease that expired (or that a previous trainer process handed out):
        still good for groups nobody has delivered yet (a slow worker is not wasted), dropped and
        counted for groups already admitted. One lease is one batch's groups."""
        not_live = {"admitted": 0, "refused": f"lease {lease_id} is not live (expired or reassigned)"}
        if lease_id >= self._next_lease:
            return {"admitted": 0, "refused": f"lease {lease_id} was never handed out"}
        batches = {self.batch_of(g) for g in results}
        b = batches.pop() if len(batches) == 1 else -1
        if not 0 <= b < self.steps:
            return {"admitted": 0, "refused": f"lease {lease_id} is not live, and its groups are not one batch's"}
        if b >= self._taken:
            if version < self.min_version(b) or self._hashes.get(version) != state_hash:
                return not_live
            if not set(results) <= set(self._batch(b).groups):  # refill groups not (yet) added
                return not_live
        ans = self._admit(lease_id, worker, b, version, results, generate_s)
        return ans if ans["admitted"] else not_live

    def refuse(self, lease_id: int, worker: str) -> None:
        """Drop a live lease whose results were refused: its groups go back to the queue."""
        self.heard(worker)
        lease = self._leases.get(lease_id)
        if lease is not None and lease.worker == worker:
            self._drop(lease, refused=True)

    def commit(
        self, worker: str, version: int, state_hash: str, fetch_s: float | None = None, refused: int = 0
    ) -> bool:
        """A worker reports the weights it now holds, how long it took to fetch them, and how
        many answers from its servers it has refused so far; True if the weights are the
        trainer's, bit for bit."""
        ok = self._hashes.get(version) == state_hash
        self._fleet.committed(worker, version, state_hash, fetch_s, self._payload.get(version, 0), refused)
        if ok:
            self._counts.verified += 1
        else:
            self._counts.mismatched += 1
        return ok

    def take(self, b: int) -> Batch | None:
        """Batch b's results once every group is admitted; the coordinator lets them go."""
        batch = self._batches.get(b)
        if batch is None or not batch.complete or b != self._taken:
            return None
        del self._batches[b]
        self._sizer.forget(b)
        self._taken = b + 1
        self._answers.trained(b, self.clock())
        if self._refills.pop(b, 0):
            self._events.append(["refills", b, 0])
        self._counts.batches_trained += 1
        self._counts.trained += len(batch.results) - (len(batch.groups) - self.per_step)
        return batch

    def view(self) -> View:
        held = Counter(x.worker for x in self._leases.values())
        return View(
            published=self.published,
            state_hash=self._hashes.get(self.published),
            started=self._fleet.begun or self._fleet.quorate(),
            counts=self.counts,
            lost=self.lost,
            leases_active=len(self._leases),
            workers=self._fleet.views(held, self._hashes),
        )

    @property
    def lost(self) -> int:
        """Groups of the batches trained so far that the trainer did not train on: a batch is
        handed over only when every group of it is admitted, so this must stay 0."""
        return self._counts.batches_trained * self.per_step - self._counts.trained

    # ---- across a trainer restart ----
    def state(self) -> dict:
        """Everything but the admitted results (the trainer journals those as they come) and the
        hashes (the store holds them), as JSON: what `restore` takes, and `replay` updates."""
        return {
            "next_lease": self._next_lease,
            "counts": asdict(self._counts),
            **self._fleet.state(),
            "leases": {str(x.id): [x.worker, x.batch, x.groups] for x in self._leases.values()},
            "delivered": self._answers.state(),
            "worker_seconds": {str(b): x.worker_seconds for b, x in self._batches.items() if x.worker_seconds},
            "refills": {str(b): n for b, n in self._refills.items()},
        }

    def changes(self) -> list[list]:
        """What changed since the last call, as events `replay` applies to a `state`: a few
        entries per request, whatever the number of workers."""
        events = self._events[:]
        self._events.clear()  # in place: the fleet appends to it too
        return [*events, ["counts", asdict(self._counts)], ["next_lease", self._next_lease]]

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
            elif kind == "begun":
                state["begun"] = True
            elif kind in ("regions", "first", "worker_seconds"):  # one key's new value
                state[kind][str(e[1])] = e[2]
            elif kind == "refills":  # 0: the batch is trained
                state["refills"][str(e[1])] = e[2]
                if not e[2]:
                    del state["refills"][str(e[1])]
            else:  # counts, next_lease
                state[kind] = e[1]

    def restore(self, state: dict, taken: int, results: dict[int, dict[int, dict]]) -> None:
        """Pick up where a previous trainer process left off: `taken` batches are trained (the
        trainer's checkpoint says how many), `results` are the admitted results of the others
        (batch → group → result). Leases stay live, with a full period from now: their workers
        could not deliver while the trainer was away. Lease ids are never reused. The workers
        that had committed count as heard from now: they wait out the trainer's absence (backing
        off, some for seconds), and the trainer waits for them too, at every row and at the end."""
        self._taken, self._next_lease = taken, state["next_lease"]
        self._counts = Counts(**state["counts"])
        self._counts.batches_trained, self._counts.trained = taken, taken * self.per_step
        self._answers.restore(state["delivered"], taken)
        self._refills = {int(b): n for b, n in state["refills"].items() if int(b) >= taken}
        for b, groups in ((b, groups) for b, groups in results.items() if b >= taken):
            if refills := [g for g in groups if g >= REFILL]:  # a batch trained since the checkpoint let them go
                self._refills[b] = max(self._refills.get(b, 0), max(refills) - self._refill_base(b) + 1)
            batch = self._batch(b)  # with its refill groups
            batch.results.update(groups)
            batch.done = self.clock() if batch.complete else None
        for b, seconds in state["worker_seconds"].items():
            if int(b) >= taken:
                self._batch(int(b)).worker_seconds = seconds
        now = self.clock()
        for k, (worker, b, groups) in state["leases"].items():
            if b >= taken:
                self._hand_out(Lease(int(k), worker, b, groups, now + self.lease_seconds, now))
        for b in sorted({x.batch for x in self._leases.values()} | set(self._batches)):
            batch = self._batch(b)
            leased = {g for x in self._leases.values() if x.batch == b for g in x.groups}
            batch.pending = [g for g in batch.groups if g not in batch.results and g not in leased]
        self._fleet.restore(state)
