"""How much of a batch a worker takes, so that workers of unequal speed and unequal links finish
the batch together.

A worker's expected finish is when it can start (its outstanding leases done, the batch's
version fetched) plus its share's tokens over its generation rate. `split` equalizes that over
the live workers (water-filling), and the coordinator hands the asking worker its share, a
lease at a time. Every ask solves again from what is then known (beyond EXACT_SEATS workers, a
solution stands for half a second). Three rules:

- only a worker that holds an eligible version gets work (the coordinator tells the others to
  update first);
- a worker never measured (new, or back after a lease period of silence) gets a probe share
  of one group, and its leases may grow to twice its last one (ramp-up);
- a worker's rate is its tokens over its seconds across its last WINDOW leases, so one lucky
  or unlucky lease moves it little; a lease at under RESET of that rate starts the window
  afresh (the machine changed, or is shared now), so a collapse is caught at once. With many
  workers, the coordinator shrinks each rate toward the fleet's by how noisy its window is
  (`shrink`): workers that only look different get equal shares, ones truly slower keep theirs,
  and a rate of one lease (new, or just collapsed) is taken as it is.

An earlier rule took a slower lease's rate at once and a faster one by half. On a fleet of
identical workers with ±25% lease noise that spread estimates ±12% and handed the last groups
of each batch to whoever had been luckiest, who then finished last (a 1,000-worker step took
1.25× the 10-worker one).

Pure functions and plain data: the coordinator calls them, tests call them with a table.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

PROBE = 1  # groups a worker not yet measured takes
EMA = 0.5  # weight of a new measurement of a link, or of the tokens a group takes
WINDOW = 8  # leases a worker's generation rate is measured over
RESET = 0.5  # a lease slower than this fraction of the estimate starts the window afresh
EXACT_SEATS = 64  # up to this many measured workers, every ask solves the balanced split afresh
SOLVE_EVERY_S = 0.5  # beyond, how old a batch's solution may be before an ask solves it again


@dataclass
class Speed:
    """What has been measured of one worker."""

    tokens_per_s: float | None = None  # generation rate; None: not measured (yet, or since it came back)
    bytes_per_s: float | None = None  # goodput of its version fetches
    last_lease: int = 0  # groups in its last delivered lease
    leases: list[tuple[int, float]] = field(default_factory=list)  # (tokens, seconds) of its last WINDOW leases

    def generated(self, tokens: int, seconds: float, groups: int) -> None:
        rate = tokens / seconds if tokens > 0 and math.isfinite(seconds) and seconds > 0 else math.inf
        if not math.isfinite(
            rate
        ):  # 5e-324 seconds passes a bound on seconds; an infinite rate would poison the fleet's mean
            return
        if self.tokens_per_s is not None and rate < RESET * self.tokens_per_s:
            self.leases.clear()
        self.leases.append((tokens, seconds))
        del self.leases[:-WINDOW]
        self.tokens_per_s = sum(t for t, _ in self.leases) / sum(s for _, s in self.leases)
        self.last_lease = groups

    @property
    def noise(self) -> float | None:
        """The variance of the log of its rate as an estimate (a lease's noise is relative to
        its rate): its leases' log-rates' variance over their count. None with fewer than two."""
        n = len(self.leases)
        if n < 2:
            return None
        logs = [math.log(t / s) for t, s in self.leases]
        mean = sum(logs) / n
        return sum((x - mean) ** 2 for x in logs) / (n - 1) / n

    def fetched(self, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or not math.isfinite(seconds) or seconds <= 0:
            return
        rate = nbytes / seconds
        self.bytes_per_s = rate if self.bytes_per_s is None else (1 - EMA) * self.bytes_per_s + EMA * rate

    def fetch_s(self, nbytes: int) -> float:
        """Seconds to fetch `nbytes`: 0 while the link is not measured (it will be at the first fetch)."""
        return nbytes / self.bytes_per_s if self.bytes_per_s else 0.0

    @property
    def cap(self) -> int:
        """The largest lease it may take now: ramping up from the probe."""
        return max(PROBE, 2 * self.last_lease)


@dataclass(frozen=True)
class Seat:
    """One worker as a split sees it: when it can start (seconds from now) and how fast it generates."""

    ready_s: float
    tokens_per_s: float


def finish_time(groups: int, tokens_per_group: float, seats: dict[str, Seat]) -> float:
    """The time T (seconds from now) at which the live workers, starting at their `ready_s` and
    sharing `groups` in proportion to their rates, all finish: sum of rate·(T - ready) over the
    workers with ready < T covers the batch's tokens."""
    need = groups * tokens_per_group
    order = sorted(seats.values(), key=lambda s: s.ready_s)
    rate = weighted = 0.0
    for i, s in enumerate(order):
        rate += s.tokens_per_s
        weighted += s.tokens_per_s * s.ready_s
        t = (need + weighted) / rate
        if i + 1 == len(order) or t <= order[i + 1].ready_s:
            return t
    raise ValueError("no workers to split among")


def split(groups: int, tokens_per_group: float, seats: dict[str, Seat]) -> dict[str, int]:
    """Whole groups per worker, summing to `groups`, with the latest finish as early as whole
    groups allow: each worker's exact share floored, then each group left over to whoever would
    finish it first (for groups of one size, the optimal makespan; on a tie, whoever can start
    first)."""
    if groups <= 0 or not seats:
        return {w: 0 for w in seats}
    t = finish_time(groups, tokens_per_group, seats)
    shares = {
        w: max(0, math.floor(s.tokens_per_s * (t - s.ready_s) / tokens_per_group + 1e-9)) for w, s in seats.items()
    }

    def finish_with_one_more(w: str) -> tuple[float, float, str]:
        s = seats[w]
        return s.ready_s + (shares[w] + 1) * tokens_per_group / s.tokens_per_s, s.ready_s, w

    left = groups - sum(shares.values())
    if left:  # fewer than one a worker: a heap of who would finish one more first
        heap = [finish_with_one_more(w) for w in seats]
        heapq.heapify(heap)
        for _ in range(left):
            w = heapq.heappop(heap)[2]
            shares[w] += 1
            heapq.heappush(heap, finish_with_one_more(w))
    return shares


@dataclass
class Shares:
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


def solve(pending: int, tokens_per_group: float, now: float, seats: dict[str, Seat]) -> Shares:
    """The balanced split of `pending` groups over `seats`; beyond EXACT_SEATS of them, with the
    holders' planned finishes, for `Shares.steal`."""
    rates = {w: s.tokens_per_s for w, s in seats.items()}
    shares = split(pending, tokens_per_group, seats)
    ends = []
    if len(seats) > EXACT_SEATS:
        ends = [(-(now + seats[w].ready_s + k * tokens_per_group / rates[w]), w) for w, k in shares.items() if k]
        heapq.heapify(ends)
    return Shares(now, pending, shares, rates, ends)


def shrink(rates: dict[str, float], noise: dict[str, float | None]) -> dict[str, float]:
    """Each rate pulled toward the fleet's by how much of its distance is noise, on a log scale
    (the James-Stein estimator): the spread of the fleet's log-rates, less their mean noise, is
    the true spread B; a log-rate of noise v keeps B / (B + v) of its distance from the mean.
    Identical workers (B = 0) all get the mean. A rate without a noise (one lease: a new worker,
    one that just collapsed, or one so slow it has delivered one lease yet) is kept as
    measured, and counts neither in the mean nor in B. Needs a fleet to measure its spread: the
    coordinator uses it beyond EXACT_SEATS workers."""
    known = {w: v for w, v in noise.items() if v is not None and w in rates}
    if len(known) < 3:
        return dict(rates)
    logs = {w: math.log(rates[w]) for w in known}
    mean = sum(logs.values()) / len(logs)
    spread = sum((x - mean) ** 2 for x in logs.values()) / (len(logs) - 1)
    b = max(0.0, spread - sum(known.values()) / len(known))
    out = dict(rates)
    for w, x in logs.items():
        v = known[w]
        out[w] = math.exp(mean + (b / (b + v) if b + v > 0 else 0.0) * (x - mean))
    return out


def even(groups: int, workers: int) -> int:
    """A worker's quota of a batch split evenly, the baseline the benchmark compares against."""
    return -(-groups // max(1, workers))
