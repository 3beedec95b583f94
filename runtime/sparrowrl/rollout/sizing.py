"""How many groups a lease holds: the job's `split` policy.

`balanced` (default) sizes each lease so that workers of unequal speed and links finish the
batch together (schedule.py), `pull` gives every ask the same `groups_per_lease`, `even` gives
each live worker an equal quota of each batch. `groups_per_lease` bounds every lease (a lease's
results travel in one request). A balanced split over N workers costs O(N log N): with up to
EXACT_SEATS workers every ask solves it afresh; with more, an ask takes its share of the
batch's last solution (`schedule.Shares`), solved again once it is SOLVE_EVERY_S old, or groups
came back, or the asker is not in it. So a thousand workers asking at once after a publish cost
a few solves, not a thousand (`solves`).
"""

from __future__ import annotations

from typing import Callable, Iterable, Literal

from sparrowrl.rollout import schedule
from sparrowrl.rollout.facts import Batch, Lease, Worker
from sparrowrl.rollout.fleet import Fleet
from sparrowrl.rollout.schedule import EXACT_SEATS, Seat, Shares

Split = Literal["balanced", "pull", "even"]
Ready = Callable[[Worker, float], float]  # seconds until a worker can start, given when its leases are done


class Sizer:
    def __init__(self, split: Split, per_lease: int, clock: Callable[[], float]):
        self.split, self.per_lease, self.clock = split, per_lease, clock
        self.tokens_per_group: float | None = None  # measured over every worker's results
        self.solves = 0
        self._shares: dict[int, Shares] = {}  # batch → its last balanced split

    def size(self, worker: Worker, batch: Batch, fleet: Fleet, leases: Iterable[Lease], ready: Ready) -> int:
        """How many of the batch's pending groups `worker` takes now (it takes them)."""
        pending = len(batch.pending)
        if self.split == "pull":
            return min(self.per_lease, pending)
        if self.split == "even":
            live = fleet.live_workers()
            quota = schedule.even(len(batch.groups), len(live))
            mine = quota - batch.given.get(worker.name, 0)
            if mine <= 0:
                if any(batch.given.get(w.name, 0) < quota for w in live if w.name != worker.name):
                    return 0  # the rest is other workers' quota
                mine = pending  # every quota is out: groups that came back go to whoever asks
            return min(mine, self.per_lease, pending)
        speed, tpg = worker.speed, self.tokens_per_group
        if speed.tokens_per_s is None or tpg is None:
            return min(schedule.PROBE, pending)
        plan = self._shares.get(batch.index)
        if plan is None or worker.name not in plan.shares or not plan.fresh(self.clock(), pending):
            plan = self._shares[batch.index] = self._solve(pending, tpg, fleet, leases, ready)
        n = min(plan.shares[worker.name], speed.cap, self.per_lease, pending)
        if not n:  # the asker is idle (a worker asks between leases); a solution of few workers has no `ends`
            idle_at = self.clock() + ready(worker, 0.0) + tpg / plan.rates[worker.name]
            return int(plan.steal(idle_at, tpg))
        plan.shares[worker.name] -= n
        plan.pending -= n
        return n

    def _solve(self, pending: int, tpg: float, fleet: Fleet, leases: Iterable[Lease], ready: Ready) -> Shares:
        """The balanced split of a batch's pending groups over the live measured workers. Beyond
        EXACT_SEATS of them, their rates are shrunk toward the fleet's (schedule.shrink)."""
        self.solves += 1
        now = self.clock()
        busy: dict[str, float] = {}  # worker → seconds until its leases are done (the longest)
        for x in leases:
            rate = fleet[x.worker].speed.tokens_per_s if x.worker in fleet else None
            if rate is not None:
                busy[x.worker] = max(busy.get(x.worker, 0.0), len(x.groups) * tpg / rate - (now - x.start))
        measured = {w.name: w for w in fleet.live_workers() if w.speed.tokens_per_s is not None}
        rates = {name: r for name, w in measured.items() if (r := w.speed.tokens_per_s) is not None}  # all of them
        if len(rates) > EXACT_SEATS:
            rates = schedule.shrink(rates, {name: w.speed.noise for name, w in measured.items()})
        seats = {name: Seat(ready(measured[name], busy.get(name, 0.0)), r) for name, r in rates.items()}
        return schedule.solve(pending, tpg, now, seats)

    def measured(self, worker: Worker, results: dict[int, dict], generate_s: float | None) -> None:
        """A delivered lease: the tokens a group takes, and the worker's generation rate."""
        tokens = sum(len(s["tokens"]) for r in results.values() for s in r.get("samples", []))
        if generate_s is None or not results or not tokens:
            return
        per_group = tokens / len(results)
        self.tokens_per_group = (
            per_group
            if self.tokens_per_group is None
            else (1 - schedule.EMA) * self.tokens_per_group + schedule.EMA * per_group
        )
        worker.speed.generated(tokens, generate_s, len(results))

    def forget(self, b: int) -> None:
        """Batch b is trained."""
        self._shares.pop(b, None)
