"""The answers the coordinator gave deliveries, kept so that a retried delivery (its answer lost)
gets the same one, until a lease period after its batch is trained: a restarted trainer may train
the batch again from its journal before a worker, backing off through its absence, retries."""

from __future__ import annotations

from collections import deque


class Answers:
    def __init__(self, keep_seconds: float):
        self.keep_seconds = keep_seconds
        self._given: dict[int, tuple[str, int, int]] = {}  # lease → (worker, groups admitted, batch)
        self._forget: deque[tuple[float, int]] = deque()  # (when, lease) of those of trained batches

    def get(self, lease: int, worker: str) -> dict | None:
        """The answer `worker`'s delivery of `lease` was given, while it is kept."""
        given = self._given.get(lease)
        return {"admitted": given[1], "batch": given[2], "groups": []} if given and given[0] == worker else None

    def give(self, lease: int, worker: str, admitted: int, batch: int) -> None:
        self._given[lease] = (worker, admitted, batch)

    def trained(self, batch: int, now: float) -> None:
        """Batch `batch` is trained: its answers are let go a lease period from `now`."""
        self._forget.extend((now + self.keep_seconds, k) for k, g in self._given.items() if g[2] == batch)

    def expire(self, now: float) -> None:
        while self._forget and self._forget[0][0] <= now:
            self._given.pop(self._forget.popleft()[1], None)

    def state(self) -> dict[str, list]:
        return {str(k): list(g) for k, g in self._given.items()}

    def restore(self, state: dict[str, list], taken: int) -> None:
        """The answers of `state` for batches not yet trained (`taken` are)."""
        self._given = {int(k): (g[0], g[1], g[2]) for k, g in state.items() if g[2] >= taken}
