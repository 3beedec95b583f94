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
are the batch's groups, leased like the others, so within the same staleness bound.

How many groups a lease holds is the `split` policy's: `balanced` (default) sizes each lease
so that workers of unequal speed and links finish the batch together (schedule.py), `pull`
gives every ask the same `groups_per_lease`, `even` gives each live worker an equal quota of
each batch. `groups_per_lease` bounds every lease (a lease's results travel in one request).
A balanced split over N workers costs O(N log N): with up to EXACT_SEATS workers every ask
solves it afresh; with more, an ask takes its share of the batch's last solution (a `Plan`),
solved again once it is SOLVE_EVERY_S old, or groups came back, or the asker is not in it. So a
thousand workers asking at once after a publish cost a few solves, not a thousand (`passes`).

It owns the job's state: leases, admitted results, commits, what each worker said of itself
(its region, its fetch times, the answers it refused) and when rollouts began, all on one
injected clock. Everyone else reads it: the trainer's HTTP routes call one method per request
(control.py), the ledger reports a `view()` of it. Pure bookkeeping, no I/O: tests call it
directly. `state()` and `restore()` carry it across a trainer restart (the trainer journals
them, see `resume.py`).
"""

from __future__ import annotations

import heapq
import time
from dataclasses import asdict, dataclass, field
from typing import Literal

from sparrowrl.rollout import schedule
from sparrowrl.rollout.schedule import Seat, Speed

Split = Literal["balanced", "pull", "even"]
EXACT_SEATS = 64  # up to this many measured workers, every ask solves the balanced split afresh
SOLVE_EVERY_S = 0.5  # beyond, how old a batch's solution may be before an ask solves it again
# the first refill group's id: beyond every job's own groups (steps x promptsPerStep < 2^36), and
# with the most refills (10^7 steps x 63 x 4096 groups) below tasks.HELD_OUT's eval examples
REFILL = 1 << 40


Score = tuple[list[float], dict[str, int], bool]  # a group's rewards, its failed calls by kind, whether they vary


@dataclass
class Lease:
    id: int
    worker: str
    batch: int
    groups: list[int]
    deadline: float
    start: float


@dataclass
class Batch:
    index: int
    groups: list[int]
    pending: list[int]
    opened: float | None = None  # when it opened: its oldest allowed version was published
    results: dict[int, dict] = field(default_factory=dict)  # group → admitted result
    given: dict[str, int] = field(default_factory=dict)  # worker → groups leased to it
    done: float | None = None  # when its last group was admitted
    worker_seconds: float = 0.0  # workers' time generating its admitted groups
    scoring: bool = False  # it waits for the trainer's rewards of its groups (refills on)
    scores: dict[int, Score] = field(default_factory=dict)  # group → the trainer's rewards of it

    @property
    def complete(self) -> bool:
        return len(self.results) == len(self.groups) and (not self.scoring or len(self.scores) == len(self.groups))


@dataclass
class Plan:
    """A batch's balanced split as last solved: each worker's share not yet taken."""

    made: float
    pending: int  # the batch's pending groups the shares cover
    shares: dict[str, int]
    rates: dict[str, float]  # the tokens/s it took each worker at
    ends: list[tuple[float, str]] = field(default_factory=list)  # a heap of (-planned finish, holder)

    def fresh(self, now: float, pending: int) -> bool:
        """Good for another ask: many workers (few are solved every ask), young, and no group came back."""
        return len(self.shares) > EXACT_SEATS and now - self.made < SOLVE_EVERY_S and pending <= self.pending

    def steal(self, finish: float, tokens_per_group: float) -> bool:
        """Move one group from the holder planned to finish last to an asker who would finish
        it at `finish`, if that is sooner. A solution stands for SOLVE_EVERY_S, and the workers
        it gave nothing ask meanwhile: idle, while the last groups wait for workers still busy."""
        while self.ends and self.shares.get(self.ends[0][1], 0) <= 0:  # taken since
            heapq.heappop(self.ends)
        if not self.ends or finish >= -self.ends[0][0]:
            return False
        end, holder = heapq.heappop(self.ends)
        self.shares[holder] -= 1
        if self.shares[holder]:
            heapq.heappush(self.ends, (end + tokens_per_group / self.rates[holder], holder))
        self.pending -= 1
        return True


@dataclass
class Counts:
    admitted: int = 0
    batches_trained: int = 0  # batches handed to the trainer
    trained: int = 0  # admitted groups in them
    requeued: int = 0  # leased groups that went back to the queue: their lease expired or was refused
    refused: int = 0  # groups whose results were refused (a stale version, a wrong hash, malformed)
    leases_expired: int = 0  # leases whose deadline passed before their results came
    discarded_late: int = 0  # results for groups already admitted, dropped (a reassigned lease came back too)
    verified: int = 0  # worker commits whose state hash matched the trainer's
    mismatched: int = 0
    refilled: int = 0  # groups added to batches in place of groups whose samples all scored alike


@dataclass(frozen=True)
class WorkerView:
    name: str
    region: str | None
    committed: tuple[int, str] | None  # the version it last committed, and its hash
    verified: bool | None  # whether that hash was the trainer's (None: not known, or no longer)
    seconds_since_seen: float
    leases: int
    live: bool  # heard from within a lease period
    refused: int  # answers from its servers that did not verify (it says)


@dataclass(frozen=True)
class View:
    """The job's state at one moment, for reports: a copy, so readers cannot change it."""

    published: int
    state_hash: str | None  # the newest version's
    started: bool
    counts: Counts
    lost: int
    leases_active: int
    workers: tuple[WorkerView, ...]


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
        self.per_step, self.per_lease, self.lease_seconds = prompts_per_step, groups_per_lease, lease_seconds
        self.staleness, self.steps, self.split, self.clock = staleness, steps, split, clock
        self.quorum = quorum  # workers that start rollouts together (see `started`)
        self.refill = refill  # the most groups a batch adds in place of zero-variance ones (0: none, unscored)
        self.refills: dict[int, int] = {}  # untrained batch → refill groups added to it
        self.hashes: dict[int, str] = {}  # published version → state hash
        self.published_at: dict[int, float] = {}
        self.payload: dict[int, int] = {}  # published version → bytes a worker fetches for it
        self.speeds: dict[str, Speed] = {}  # measured afresh by each trainer process
        self.seen: dict[str, float] = {}  # worker → when it last called
        self.first_call: float | None = None  # when the first worker called
        self.tokens_per_group: float | None = None
        self.batches: dict[int, Batch] = {}
        self.leases: dict[int, Lease] = {}
        self.counts = Counts()
        self.commits: dict[str, tuple[int, str]] = {}  # worker → (version, hash) it last committed
        self.taken = 0  # batches handed to the trainer; their results are let go
        self.next_lease = 1
        self.delivered: dict[int, tuple[str, int, int]] = {}  # lease → (worker, groups admitted, batch), untrained
        self.regions: dict[str, str] = {}  # worker → the region it says it is in
        self.first: dict[str, int] = {}  # worker → the first version it committed
        self.fetched: dict[int, dict[str, float]] = {}  # version → worker → seconds to stage it
        self.refused: dict[str, int] = {}  # worker → answers from its servers that did not verify (it says)
        self.begun = False  # rollouts have started (see `started`)
        # bumps whenever a worker told to wait may have work now (see `work`). A batch complete
        # gives none: what a waiter learns then (reach a version not yet published, or done) can
        # wait for its next look, every 0.5-1.5 s each; woken at once, a thousand of them were
        # answered one by one while the learner started on that batch, in 100-200 ms
        self.moves = 0
        self.passes = (
            0  # passes over every worker (a balanced split solved, `staged` checked): what a scale test counts
        )
        self._plans: dict[int, Plan] = {}  # batch → its last balanced split
        self._deadlines: list[tuple[float, int]] = []  # a heap of (deadline, lease id) of the leases handed out
        self._not_staged: tuple[int, int] | None = None  # see `staged`
        self._events: list[list] = []  # changes since `changes()` was last called (the trainer journals them)

    @property
    def published(self) -> int:
        return max(self.hashes, default=-1)

    def publish(self, version: int, state_hash: str, payload_bytes: int = 0) -> None:
        self.hashes[version] = state_hash
        self.published_at[version], self.payload[version] = self.clock(), payload_bytes
        self.moves += 1  # a batch may open

    def min_version(self, batch: int) -> int:
        return batch - self.staleness

    def _batch(self, b: int) -> Batch:
        assert b >= self.taken, f"batch {b} was trained already"
        if b not in self.batches:
            groups = list(range(b * self.per_step, (b + 1) * self.per_step))
            groups += [self._refill_base(b) + k for k in range(self.refills.get(b, 0))]
            self.batches[b] = Batch(b, groups, list(groups), scoring=self.refill > 0)
        return self.batches[b]

    def _refill_base(self, b: int) -> int:
        """Batch b's first refill group: its refills are this and the next ones."""
        return REFILL + b * self.refill

    def batch_of(self, group: int) -> int:
        return (group - REFILL) // self.refill if self.refill and group >= REFILL else group // self.per_step

    def unscored(self) -> list[tuple[int, list[int]]]:
        """Admitted groups the trainer has yet to score (refills on), by batch, oldest first."""
        return [
            (b, [g for g in x.results if g not in x.scores])
            for b, x in sorted(self.batches.items())
            if x.scoring and len(x.scores) < len(x.results)
        ]

    def scored(self, b: int, scores: dict[int, Score]) -> None:
        """The trainer's rewards of admitted groups of batch b. The batch holds a new group for
        each of its groups whose samples all scored alike, up to `refill`: counted over all it has
        scored, so scoring a group again (after a restart) adds none. A group alike because its
        reward calls failed is not replaced (a failing reward would have every batch draw its
        most), nor is any group of a batch trained before (a restart trains it again)."""
        batch = self.batches.get(b) if b >= self.taken else None
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
            self.refills[b] = added + more
            self.counts.refilled += more
            self._events.append(["refills", b, added + more])
            self.moves += 1
        if batch.complete and batch.done is None:
            batch.done = self.clock()

    def _open_batches(self) -> list[int]:
        """Batches whose oldest allowed version is published and that still need groups."""
        first = min((b for b, x in self.batches.items() if not x.complete), default=self.taken)
        open_ = [
            b for b in range(first, min(self.steps, self.published + self.staleness + 1)) if not self._batch(b).complete
        ]
        for b in open_:
            if self.batches[b].opened is None:
                self.batches[b].opened = self.published_at.get(self.min_version(b), self.clock())
        return open_

    def expire(self) -> None:
        """Drop the leases whose deadline has passed: a heap, so a call costs nothing while none has."""
        now = self.clock()
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, lid = heapq.heappop(self._deadlines)
            lease = self.leases.get(lid)
            if lease is not None and lease.deadline == deadline:  # not delivered or dropped since
                self.counts.leases_expired += 1
                self._drop(lease)

    def _hand_out(self, lease: Lease) -> None:
        self.leases[lease.id] = lease
        heapq.heappush(self._deadlines, (lease.deadline, lease.id))
        if len(self._deadlines) > 2 * len(self.leases) + 64:  # delivered leases' entries, with long leases
            self._deadlines = [(x.deadline, x.id) for x in self.leases.values()]
            heapq.heapify(self._deadlines)

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
        self.moves += 1 if back else 0

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
        if region and self.regions.get(worker) != region:
            self.regions[worker] = region
            self._events.append(["regions", worker, region])
        if not self.started():
            return {"wait": True}
        if all(self._batch(b).complete for b in range(self.taken, self.steps)):
            return {"done": self.steps}
        for b in self._open_batches():
            batch = self.batches[b]
            if not batch.pending:
                continue
            if version < self.min_version(b):
                return {"update": self.min_version(b)}
            n = self._size(worker, batch)
            if not n:  # the others finish this batch sooner: perhaps the next one
                continue
            groups, batch.pending = batch.pending[:n], batch.pending[n:]
            now = self.clock()
            lease = Lease(self.next_lease, worker, b, groups, now + self.lease_seconds, now)
            self._hand_out(lease)
            batch.given[worker] = batch.given.get(worker, 0) + n
            self.next_lease += 1
            self._events.append(["lease", lease.id, worker, b, groups])
            return {"lease": {"id": lease.id, "batch": b, "groups": groups, "deadline_s": self.lease_seconds}}
        coming = self.published + 1  # the oldest version the next batch allows
        if self.many and version < coming and coming + self.staleness < self.steps and self._trains(coming):
            return {"update": coming}
        return {"wait": True}

    @property
    def many(self) -> bool:
        """More workers than EXACT_SEATS have called: the shortcuts of scale apply (a job of fewer
        behaves as it always has)."""
        return len(self.seen) > EXACT_SEATS

    def _trains(self, version: int) -> bool:
        """Whether `version` will be published whatever becomes of the leases out: its batch is complete."""
        b = version - 1
        return b < self.taken or (b in self.batches and self.batches[b].complete)

    # ---- how many groups a lease holds ----
    def heard(self, worker: str) -> None:
        """A worker called (for work, with results, with a commit). One silent for a lease period
        comes back unmeasured: it may be another machine now."""
        now = self.clock()
        if self.first_call is None:
            self.first_call = now
        if now - self.seen.get(worker, -float("inf")) >= self.lease_seconds:
            self.speeds[worker] = Speed()
        self.seen[worker] = now

    def _quorate(self) -> bool:
        waited = self.first_call is not None and self.clock() - self.first_call > self.lease_seconds
        return len(self.seen) >= self.quorum or waited

    def started(self) -> bool:
        """Rollouts start once the job's quorum of workers has called in (every worker of the
        topology, so all of them share the first batch; in a cluster, each placement's
        minReplicas), or one lease period after the first called in, with those that have. The
        wait counts from the first call, not from the trainer's start: workers that take long to
        load their model still start together."""
        if not self.begun and self._quorate():
            self.begun, self.moves = True, self.moves + 1
            self._events.append(["begun"])
        return self.begun

    def live(self) -> list[str]:
        """Workers heard from within a lease period: a lost one stops counting."""
        now = self.clock()
        return sorted(w for w, t in self.seen.items() if now - t < self.lease_seconds)

    def _size(self, worker: str, batch: Batch) -> int:
        """How many of the batch's pending groups `worker` takes now (it takes them)."""
        pending = len(batch.pending)
        if self.split == "pull":
            return min(self.per_lease, pending)
        if self.split == "even":
            live = self.live()
            quota = schedule.even(len(batch.groups), len(live))
            mine = quota - batch.given.get(worker, 0)
            if mine <= 0:
                if any(batch.given.get(w, 0) < quota for w in live if w != worker):
                    return 0  # the rest is other workers' quota
                mine = pending  # every quota is out: groups that came back go to whoever asks
            return min(mine, self.per_lease, pending)
        speed = self.speeds[worker]
        if speed.tokens_per_s is None or self.tokens_per_group is None:
            return min(schedule.PROBE, pending)
        plan = self._plans.get(batch.index)
        if plan is None or worker not in plan.shares or not plan.fresh(self.clock(), pending):
            plan = self._plans[batch.index] = self._solve(batch)
        n = min(plan.shares[worker], speed.cap, self.per_lease, pending)
        if not n:  # the asker is idle (a worker asks between leases); a plan of few workers has no `ends`
            mine = self.clock() + self._ready(worker, batch.index, 0.0) + self.tokens_per_group / plan.rates[worker]
            return int(plan.steal(mine, self.tokens_per_group))
        plan.shares[worker] -= n
        plan.pending -= n
        return n

    def _solve(self, batch: Batch) -> Plan:
        """The balanced split of the batch's pending groups over the live measured workers. Beyond
        EXACT_SEATS of them, their rates are shrunk toward the fleet's (schedule.shrink), and the
        plan keeps its holders' planned finishes for `Plan.steal`."""
        self.passes += 1
        now, tpg = self.clock(), self.tokens_per_group
        busy: dict[str, float] = {}  # worker → seconds until its leases are done (the longest)
        for x in self.leases.values():
            rate = self.speeds[x.worker].tokens_per_s if x.worker in self.speeds else None
            if rate is not None:
                busy[x.worker] = max(busy.get(x.worker, 0.0), len(x.groups) * tpg / rate - (now - x.start))
        rates = {w: r for w in self.live() if (r := self.speeds[w].tokens_per_s) is not None}
        many = len(rates) > EXACT_SEATS
        if many:
            rates = schedule.shrink(rates, {w: self.speeds[w].noise for w in rates})
        seats = {w: Seat(self._ready(w, batch.index, busy.get(w, 0.0)), r) for w, r in rates.items()}
        shares = schedule.split(len(batch.pending), tpg, seats)
        ends = [(-(now + seats[w].ready_s + k * tpg / rates[w]), w) for w, k in shares.items() if k] if many else []
        heapq.heapify(ends)
        return Plan(now, len(batch.pending), shares, rates, ends)

    def _ready(self, worker: str, b: int, busy: float) -> float:
        """Seconds until `worker` can start on batch b: its leases done (`busy`), the batch's version fetched."""
        now, speed = self.clock(), self.speeds[worker]
        need = self.min_version(b)
        fetch = 0.0
        if self.commits.get(worker, (-1,))[0] < need and need in self.published_at:
            fetch = max(0.0, speed.fetch_s(self.payload[need]) - (now - self.published_at[need]))
        return max(busy, fetch)

    def _measured(self, worker: str, results: dict[int, dict], generate_s: float | None) -> None:
        tokens = sum(len(s["tokens"]) for r in results.values() for s in r.get("samples", []))
        if generate_s is None or not results or not tokens:
            return
        per_group = tokens / len(results)
        self.tokens_per_group = (
            per_group
            if self.tokens_per_group is None
            else (1 - schedule.EMA) * self.tokens_per_group + schedule.EMA * per_group
        )
        self.speeds[worker].generated(tokens, generate_s, len(results))

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
        lease = self.leases.get(lease_id)
        if lease is None:
            if (d := self.delivered.get(lease_id)) and d[0] == worker:  # delivered again (a retry): the same answer
                return {"admitted": d[1], "batch": d[2], "groups": []}
            return self._late(lease_id, worker, version, state_hash, results, generate_s)
        if lease.worker != worker:
            return {"admitted": 0, "refused": f"lease {lease_id} is not {worker}'s"}
        b = lease.batch
        if version < self.min_version(b) or self.hashes.get(version) != state_hash:
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
        del self.leases[lease_id]
        self._events.append(["drop", lease_id])
        self._measured(worker, results, generate_s)
        return self._admit(lease_id, worker, b, version, results, generate_s)

    def _admit(
        self, lease_id: int, worker: str, b: int, version: int, results: dict[int, dict], generate_s: float | None
    ) -> dict:
        """Keep the results of groups not yet admitted; count the others as discarded late (another
        worker's late results for the same groups came first, or the batch is trained)."""
        batch = self.batches.get(b) if b >= self.taken else None
        new = {g: r for g, r in results.items() if batch is not None and g not in batch.results}
        self.counts.discarded_late += len(results) - len(new)
        for g, r in new.items():
            batch.results[g] = {**r, "version": version, "worker": worker, "lease": lease_id}
        if new:
            batch.pending = [x for x in batch.pending if x not in new]
            if batch.complete:
                batch.done = self.clock()  # not a move: see `moves`
            batch.worker_seconds += generate_s or 0.0
            self._events.append(["worker_seconds", b, batch.worker_seconds])
        self.counts.admitted += len(new)
        if new:
            self.delivered[lease_id] = (worker, len(new), b)
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
        if lease_id >= self.next_lease:
            return {"admitted": 0, "refused": f"lease {lease_id} was never handed out"}
        batches = {self.batch_of(g) for g in results}
        b = batches.pop() if len(batches) == 1 else -1
        if not 0 <= b < self.steps:
            return {"admitted": 0, "refused": f"lease {lease_id} is not live, and its groups are not one batch's"}
        if b >= self.taken:
            if version < self.min_version(b) or self.hashes.get(version) != state_hash:
                return not_live
            if not set(results) <= set(self._batch(b).groups):  # refill groups not (yet) added
                return not_live
        ans = self._admit(lease_id, worker, b, version, results, generate_s)
        return ans if ans["admitted"] else not_live

    def refuse(self, lease_id: int, worker: str) -> None:
        """Drop a live lease whose results were refused: its groups go back to the queue."""
        self.heard(worker)
        lease = self.leases.get(lease_id)
        if lease is not None and lease.worker == worker:
            self._drop(lease, refused=True)

    def commit(
        self, worker: str, version: int, state_hash: str, fetch_s: float | None = None, refused: int = 0
    ) -> bool:
        """A worker reports the weights it now holds, how long it took to fetch them, and how
        many answers from its servers it has refused so far; True if the weights are the
        trainer's, bit for bit."""
        ok = self.hashes.get(version) == state_hash
        self.heard(worker)
        if worker not in self.first:
            self.first[worker] = version
            self._events.append(["first", worker, version])
        if fetch_s is not None:
            self.speeds[worker].fetched(self.payload.get(version, 0), fetch_s)
            self.fetched.setdefault(version, {})[worker] = fetch_s
        self.refused[worker] = max(self.refused.get(worker, 0), refused)
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
        self._plans.pop(b, None)
        self.taken = b + 1
        self.delivered = {k: d for k, d in self.delivered.items() if d[2] > b}
        if self.refills.pop(b, 0):
            self._events.append(["refills", b, 0])
        self.counts.batches_trained += 1
        self.counts.trained += len(batch.results) - (len(batch.groups) - self.per_step)
        return batch

    def staged(self, version: int) -> bool:
        """Whether every live worker has staged `version` (or started past it). Asked at every
        request while a row waits: in a job of `many` workers, after a no with k workers missing,
        asked again only once k more commits have come (each stages one worker at most), so a step
        costs a few O(workers) checks, not one per commit."""
        commits = self.counts.verified + self.counts.mismatched
        if (
            self.many
            and self._not_staged is not None
            and self._not_staged[0] == version
            and commits < self._not_staged[1]
        ):
            return False  # a worker going stale can make it true too: the next scan sees it
        self.passes += 1
        staged = self.fetched.get(version, {})
        missing = sum(
            not (w in staged or self.first.get(w, -1) >= version or self.commits.get(w, (-1,))[0] >= version)
            for w in self.live()
        )
        self._not_staged = (version, commits + missing) if missing else None
        return not missing

    def transfer_s(self, version: int) -> float | None:
        """The slowest worker's seconds to stage `version`."""
        return max(self.fetched.get(version, {}).values(), default=None)

    def behind(self, version: int) -> list[str]:
        """Live workers that have not committed `version` yet."""
        return [w for w in self.live() if self.commits.get(w, (-1,))[0] < version]

    def held(self) -> list[int]:
        """The versions live workers last committed: what they may still diff from."""
        return [self.commits[w][0] for w in self.live() if w in self.commits]

    def view(self) -> View:
        now, held, live = self.clock(), {}, set(self.live())
        for lease in self.leases.values():
            held[lease.worker] = held.get(lease.worker, 0) + 1
        workers = []
        for w in sorted(self.seen):
            c = self.commits.get(w)
            workers.append(
                WorkerView(
                    name=w,
                    region=self.regions.get(w),
                    committed=c,
                    # None also where its version is pruned from the store (a restarted trainer knows no hash)
                    verified=None if c is None or c[0] not in self.hashes else self.hashes[c[0]] == c[1],
                    seconds_since_seen=now - self.seen[w],
                    leases=held.get(w, 0),
                    live=w in live,
                    refused=self.refused.get(w, 0),
                )
            )
        return View(
            published=self.published,
            state_hash=self.hashes.get(self.published),
            started=self.begun or self._quorate(),
            counts=Counts(**asdict(self.counts)),
            lost=self.lost,
            leases_active=len(self.leases),
            workers=tuple(workers),
        )

    @property
    def lost(self) -> int:
        """Groups of the batches trained so far that the trainer did not train on: a batch is
        handed over only when every group of it is admitted, so this must stay 0."""
        return self.counts.batches_trained * self.per_step - self.counts.trained

    # ---- across a trainer restart ----
    def state(self) -> dict:
        """Everything but the admitted results (the trainer journals those as they come) and the
        hashes (the store holds them), as JSON: what `restore` takes, and `replay` updates."""
        return {
            "next_lease": self.next_lease,
            "counts": asdict(self.counts),
            "commits": {w: list(c) for w, c in self.commits.items()},
            "leases": {str(x.id): [x.worker, x.batch, x.groups] for x in self.leases.values()},
            "delivered": {str(k): list(d) for k, d in self.delivered.items()},
            "begun": self.begun,
            "regions": dict(self.regions),
            "first": dict(self.first),
            "worker_seconds": {str(b): x.worker_seconds for b, x in self.batches.items() if x.worker_seconds},
            "refills": {str(b): n for b, n in self.refills.items()},
        }

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
            elif kind == "begun":
                state["begun"] = True
            elif kind in ("regions", "first", "worker_seconds"):  # one key's new value
                state[kind][str(e[1])] = e[2]
            elif kind == "refills":  # 0: the batch is trained
                refills = state.setdefault("refills", {})  # a journal from before refills has none
                refills[str(e[1])] = e[2]
                if not e[2]:
                    del refills[str(e[1])]
            else:  # counts, next_lease
                state[kind] = e[1]

    def restore(self, state: dict, taken: int, results: dict[int, dict[int, dict]]) -> None:
        """Pick up where a previous trainer process left off: `taken` batches are trained (the
        trainer's checkpoint says how many), `results` are the admitted results of the others
        (batch → group → result). Leases stay live, with a full period from now: their workers
        could not deliver while the trainer was away. Lease ids are never reused. The workers
        that had committed count as heard from now: they wait out the trainer's absence (backing
        off, some for seconds), and the trainer waits for them too, at every row and at the end."""
        self.taken, self.next_lease = taken, state["next_lease"]
        counts = state["counts"]
        if "duplicated" in counts:  # a journal written before the count was named for what it is
            counts["discarded_late"] = counts.pop("duplicated")
        self.counts = Counts(**counts)
        self.counts.batches_trained, self.counts.trained = taken, taken * self.per_step
        self.commits = {w: (c[0], c[1]) for w, c in state["commits"].items()}
        self.begun, self.regions, self.first = state["begun"], state["regions"], state["first"]
        self.delivered = {int(k): (d[0], d[1], d[2]) for k, d in state["delivered"].items() if d[2] >= taken}
        self.refills = {int(b): n for b, n in state.get("refills", {}).items() if int(b) >= taken}
        for b, groups in results.items():  # a batch trained since the checkpoint has let its refills go
            if b >= taken and (refills := [g for g in groups if g >= REFILL]):
                self.refills[b] = max(self.refills.get(b, 0), max(refills) - self._refill_base(b) + 1)
        for b, groups in results.items():
            if b >= taken:
                batch = self._batch(b)
                batch.results.update(groups)
                batch.done = self.clock() if batch.complete else None
        for b, seconds in state["worker_seconds"].items():
            if int(b) >= taken:
                self._batch(int(b)).worker_seconds = seconds
        now = self.clock()
        for k, (worker, b, groups) in state["leases"].items():
            if b >= taken:
                self._hand_out(Lease(int(k), worker, b, groups, now + self.lease_seconds, now))
        for b in sorted({x.batch for x in self.leases.values()} | set(self.batches)):
            batch = self._batch(b)
            leased = {g for x in self.leases.values() if x.batch == b for g in x.groups}
            batch.pending = [g for g in batch.groups if g not in batch.results and g not in leased]
        for w in self.commits:
            self.heard(w)
