"""Which versions the trainer's store keeps: after each publish, what can no longer be asked of
it is pruned (`Store.prune`), so that a long run does not fill its volume.

Every version from the *oldest needed* one to the newest stays materializable: the base at or
before it stays, with every delta after; what comes before that base goes, files and index
entries. The oldest needed version is the oldest of:

- each live worker's committed version (`Coordinator.live`): a worker that holds v catches up
  by v's chain of deltas or by the newest base, whichever the server's plan finds fewer bytes,
  and its fetcher asks for v+1, v+2, ... as they appear. A relay mirrors ahead of the workers it
  serves, so what they hold keeps what it needs too.
- newest - staleness: a result generated with such a version is still admitted, and a trainer
  restarted on its state dir checks results and commits against the hashes its store lists.
- the version before the newest base: a client that planned its route before that base was
  written (a worker starting, a relay fetching a base for one) finds the previous base and its
  chain for `baseEvery` more versions.
- the version an export is being written of (outputs.py, in a thread).

The newest version is always kept (a restarted trainer goes on from it). A worker that is not
live (silent for a lease period: lost, frozen) holds nothing back: started again, it begins at
the newest base. So the store holds about baseEvery to 2 x baseEvery versions, two bases at most,
plus however far the slowest live worker lags.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from sparrowrl.rollout.coordinator import Coordinator
from sparrowrl.store.store import Store


@dataclass(frozen=True)
class Held:
    """What the trainer's store holds: how many versions it has pruned (it starts at v0, so every
    one before its oldest), how many it keeps, and the bytes of their bases and deltas."""

    pruned: int
    versions: int
    bytes: int

    @classmethod
    def of(cls, store: Store) -> Held:
        kept = store.versions.values()
        return cls(min(store.versions), len(kept), sum(v.base_bytes + v.delta_bytes for v in kept))


def oldest_needed(newest: int, bases: Iterable[int], held: Iterable[int], staleness: int) -> int:
    """The oldest version that must stay materializable (see the module's docstring): `bases`
    are the versions with a base snapshot, `held` those live workers hold and exports read."""
    newest_base = max(b for b in bases if b <= newest)
    return max(0, min(newest - staleness, newest_base - 1, *held))


def needed(store: Store, coord: Coordinator, exporting: int | None) -> int:
    """`oldest_needed` of the trainer's store now (on the event loop, which owns the coordinator)."""
    held = coord.fleet.held()
    bases = [v for v, x in store.versions.items() if x.base]
    return oldest_needed(store.newest, bases, held + ([exporting] if exporting is not None else []), coord.staleness)


def prune(store: Store, oldest: int) -> Held:
    """Drop what no one needs (file unlinks: in a thread, off the event loop); what is left."""
    store.prune(store.newest - oldest + 1)
    return Held.of(store)
