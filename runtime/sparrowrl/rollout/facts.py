"""What the coordinator keeps (leases, batches, counts, one object per worker) and the read-only
views it hands out. Plain data: the coordinator alone changes it (coordinator.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from sparrowrl.rollout.schedule import Speed

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


@dataclass
class Worker:
    """One worker, as its calls and the journal tell of it. A worker known only from a previous
    trainer process's journal has not been heard from (`seen` None) until it calls."""

    name: str
    seen: float | None = None  # when it last called
    speed: Speed = field(default_factory=Speed)  # measured afresh by each trainer process
    region: str | None = None  # the region it says it is in
    committed: tuple[int, str] | None = None  # the version it last committed, and its hash
    first: int | None = None  # the first version it committed
    refused: int = 0  # answers from its servers that did not verify (it says)


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
