"""The workers of a job, one `Worker` object each: who has called, who is live, what each has
staged and committed, and when rollouts may start. The coordinator owns one (coordinator.py);
the trainer, the ledger and the control plane read it through `Coordinator.fleet`, a `FleetView`:
copies and counts, never its objects, and none of its changes."""

from __future__ import annotations

from typing import Callable, Iterator, Protocol

from sparrowrl.rollout.facts import Worker, WorkerView
from sparrowrl.rollout.schedule import EXACT_SEATS, Speed


class FleetView(Protocol):
    """What the trainer, its control plane and its ledger may ask of the workers."""

    @property
    def heard_from(self) -> int: ...
    @property
    def many(self) -> bool: ...
    def knows(self, name: str) -> bool: ...
    def refused_by(self, name: str) -> int: ...
    def region_of(self, name: str) -> str | None: ...
    def live(self) -> list[str]: ...
    def staged(self, version: int) -> bool: ...
    def transfer_s(self, version: int) -> float | None: ...
    def behind(self, version: int) -> list[str]: ...
    def held(self) -> list[int]: ...


class Fleet:
    def __init__(self, lease_seconds: float, quorum: int, clock: Callable[[], float], note: Callable[[list], None]):
        self.lease_seconds, self.quorum, self.clock = lease_seconds, quorum, clock
        self._note = note  # an event for the journal (Coordinator.changes)
        self._workers: dict[str, Worker] = {}
        self._heard = 0  # workers heard from by this process
        self._first_call: float | None = None  # when the first worker called
        self._fetched: dict[int, dict[str, float]] = {}  # version → worker → seconds to stage it
        self.begun = False  # rollouts have started (see `started`)
        self.commits = 0  # commits this process has checked
        self.passes = 0  # `staged`'s passes over every worker
        self._not_staged: tuple[int, int] | None = None  # see `staged`

    # ---- what the coordinator changes ----
    def heard(self, name: str) -> Worker:
        """A worker called (for work, with results, with a commit). One silent for a lease period
        comes back unmeasured: it may be another machine now."""
        now = self.clock()
        if self._first_call is None:
            self._first_call = now
        w = self._worker(name)
        if w.seen is None:
            self._heard += 1
        if w.seen is None or now - w.seen >= self.lease_seconds:
            w.speed = Speed()
        w.seen = now
        return w

    def _worker(self, name: str) -> Worker:
        if name not in self._workers:
            self._workers[name] = Worker(name)
        return self._workers[name]

    def __getitem__(self, name: str) -> Worker:
        return self._workers[name]

    def __contains__(self, name: str) -> bool:
        return name in self._workers

    def locate(self, name: str, region: str | None) -> None:
        w = self._workers[name]
        if region and w.region != region:
            w.region = region
            self._note(["regions", name, region])

    def committed(
        self, name: str, version: int, state_hash: str, fetch_s: float | None, payload: int, refused: int
    ) -> None:
        """A worker's commit: the weights it holds, how long it took to fetch `payload` bytes of
        them, and how many answers from its servers it has refused so far."""
        w = self.heard(name)
        if w.first is None:
            w.first = version
            self._note(["first", name, version])
        if fetch_s is not None:
            w.speed.fetched(payload, fetch_s)
            self._fetched.setdefault(version, {})[name] = fetch_s
        w.refused = max(w.refused, refused)
        w.committed = (version, state_hash)
        self.commits += 1
        self._note(["commit", name, version, state_hash])

    def started(self) -> bool:
        """Rollouts start once the job's quorum of workers has called in (every worker of the
        topology, so all of them share the first batch; in a cluster, each placement's
        minReplicas), or one lease period after the first called in, with those that have. The
        wait counts from the first call, not from the trainer's start: workers that take long to
        load their model still start together."""
        if not self.begun and self.quorate():
            self.begun = True
            self._note(["begun"])
        return self.begun

    def quorate(self) -> bool:
        waited = self._first_call is not None and self.clock() - self._first_call > self.lease_seconds
        return self._heard >= self.quorum or waited

    # ---- what everyone reads ----
    @property
    def heard_from(self) -> int:
        """Workers this trainer process has heard from."""
        return self._heard

    @property
    def many(self) -> bool:
        """More workers than EXACT_SEATS have called: the shortcuts of scale apply (a job of fewer
        behaves as it always has)."""
        return self._heard > EXACT_SEATS

    def knows(self, name: str) -> bool:
        """Whether `name` has called this trainer process."""
        w = self._workers.get(name)
        return w is not None and w.seen is not None

    def refused_by(self, name: str) -> int:
        """Answers from its servers that the worker said it refused."""
        w = self._workers.get(name)
        return 0 if w is None else w.refused

    def region_of(self, name: str) -> str | None:
        w = self._workers.get(name)
        return None if w is None else w.region

    def live(self) -> list[str]:
        """Workers heard from within a lease period: a lost one stops counting."""
        now = self.clock()
        return sorted(
            w.name for w in self._workers.values() if w.seen is not None and now - w.seen < self.lease_seconds
        )

    def _live(self) -> Iterator[Worker]:
        return map(self._workers.__getitem__, self.live())

    def live_workers(self) -> list[Worker]:
        """The live workers' objects, for the coordinator's lease sizing."""
        return list(self._live())

    def staged(self, version: int) -> bool:
        """Whether every live worker has staged `version` (or started past it). Asked at every
        request while a row waits: in a job of `many` workers, after a no with k workers missing,
        asked again only once k more commits have come (each stages one worker at most), so a step
        costs a few O(workers) checks, not one per commit."""
        if (
            self.many
            and self._not_staged is not None
            and self._not_staged[0] == version
            and self.commits < self._not_staged[1]
        ):
            return False  # a worker going stale can make it true too: the next scan sees it
        self.passes += 1
        staged = self._fetched.get(version, {})
        missing = sum(
            not (x.name in staged or (x.first is not None and x.first >= version) or _version(x) >= version)
            for x in self._live()
        )
        self._not_staged = (version, self.commits + missing) if missing else None
        return not missing

    def transfer_s(self, version: int) -> float | None:
        """The slowest worker's seconds to stage `version`."""
        return max(self._fetched.get(version, {}).values(), default=None)

    def behind(self, version: int) -> list[str]:
        """Live workers that have not committed `version` yet."""
        return [x.name for x in self._live() if _version(x) < version]

    def held(self) -> list[int]:
        """The versions live workers last committed: what they may still diff from."""
        return [x.committed[0] for x in self._live() if x.committed is not None]

    def views(self, leases: dict[str, int], hashes: dict[int, str]) -> tuple[WorkerView, ...]:
        """The workers heard from, for reports; `leases`: each one's live leases."""
        now, live = self.clock(), set(self.live())
        out = []
        for w in sorted(self._workers.values(), key=lambda w: w.name):
            if w.seen is None:
                continue
            c = w.committed
            out.append(
                WorkerView(
                    name=w.name,
                    region=w.region,
                    committed=c,
                    # None also where its version is pruned from the store (a restarted trainer knows no hash)
                    verified=None if c is None or c[0] not in hashes else hashes[c[0]] == c[1],
                    seconds_since_seen=now - w.seen,
                    leases=leases.get(w.name, 0),
                    live=w.name in live,
                    refused=w.refused,
                )
            )
        return tuple(out)

    # ---- across a trainer restart ----
    def state(self) -> dict:
        ws = self._workers.values()
        return {
            "commits": {w.name: list(w.committed) for w in ws if w.committed is not None},
            "begun": self.begun,
            "regions": {w.name: w.region for w in ws if w.region is not None},
            "first": {w.name: w.first for w in ws if w.first is not None},
        }

    def restore(self, state: dict) -> None:
        """The workers a previous trainer process knew. Those that had committed count as heard
        from now: they wait out the trainer's absence (backing off, some for seconds), and the
        trainer waits for them too, at every row and at the end."""
        for name, c in state["commits"].items():
            self._worker(name).committed = (c[0], c[1])
        for name, region in state["regions"].items():
            self._worker(name).region = region
        for name, version in state["first"].items():
            self._worker(name).first = version
        self.begun = state["begun"]
        for name in state["commits"]:
            self.heard(name)


def _version(w: Worker) -> int:
    """The version `w` last committed, -1 for none."""
    return -1 if w.committed is None else w.committed[0]
