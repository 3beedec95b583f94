"""The trainer's side of weight sync: after each optimizer step, the bf16 policy's sparse delta
from the version before, into a store that an `Origin` (or `sparrowrl serve`) serves.

The version before is held in memory (this rank's part of it), so a step costs one diff of what
the trainer holds; the store is never read back. With DTensor weights (FSDP2, sharded on dim 0)
every rank makes a Publisher and calls `publish` together: each diffs its own shards, and rank 0,
the store's one writer, gathers the records (gather.py). With plain tensors under DDP, where
every rank holds all of them, make it on rank 0 only.
"""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import torch.distributed as dist
from torch.distributed.tensor import DTensor

from sparrowrl.store.store import Store
from sparrowrl.sync import gather
from sparrowrl.sync.gather import Weights
from sparrowrl.sync.origin import Origin

T = TypeVar("T")


class Publisher:
    """Versions of `weights`' bf16 cast in the store at `store`: version 0 is the weights as they
    are when a new store is made. An existing store (a restarted trainer) goes on from its newest
    version: the next delta is diffed against what subscribers hold, the store's newest, which is
    the weights' own cast when their hash says so and is read from the store otherwise.

    `base_every`: a full snapshot every K versions (default 10; new and lagging subscribers start
    from the nearest one; 1 ships every version whole); an existing store keeps its own, and
    refuses another. `cut_through`: a delta can be served while it is still written."""

    def __init__(self, weights: Weights, store: str | Path, *, base_every: int | None = None, cut_through: bool = True):
        if base_every is not None and (
            isinstance(base_every, bool) or not isinstance(base_every, int) or not 1 <= base_every <= 1_000_000
        ):
            raise ValueError(f"base_every: {base_every!r}, where 1 to 1,000,000 versions are allowed")
        self.weights, self.cut_through = weights, cut_through
        self.sharded = gather.sharded(weights)
        self.table = gather.specs(weights)
        if not self.table:
            raise ValueError("the weights hold no tensors")
        if self.sharded:
            plain = next((n for n, t in gather.named(weights) if not isinstance(t, DTensor)), None)
            if plain is not None:
                raise ValueError(
                    f"tensor '{plain}' is a plain tensor among DTensors: shard every tensor (each rank would "
                    f"publish all of it), or publish the plain ones with a Publisher of their own"
                )
        self.writer = not self.sharded or dist.get_rank() == 0  # the store's one writer
        path = Path(store)
        if self._agree(not (path / "store.json").exists()):
            self.store = gather.init_store(path, weights, base_every or 10, self.writer)
            self.policy = gather.policy(weights)
        else:
            self.store, self.policy = self._resume(path, base_every)

    def _resume(self, path: Path, base_every: int | None) -> tuple[Store | None, gather.Shards]:
        store = Store(path) if self.writer else None
        if self._agree(base_every is not None and store is not None and store.base_every != base_every):
            has = store.base_every if store is not None else "another"  # the other ranks hear rank 0's decision only
            raise ValueError(f"base_every: {base_every}, where the store at {path} has {has}")
        if store is not None:
            store.drop_partial()  # a delta a killed publisher was writing: written again, as the next version's
        newest = self._agree(store.newest if store is not None else -1)  # rank 0's: the others' -1 is not read
        held = self.weights_hash()
        same = self._agree(store is not None and store.versions[newest].state_hash == held)
        full = None
        if same:
            policy = gather.policy(self.weights)
        else:  # hash-checked on the way: the weights that subscribers hold
            full = store.materialize(newest) if store is not None else None
            if self.sharded:
                policy = gather.policy_from_rank0(self.weights, full)
            else:
                assert full is not None  # unsharded, this process holds the store
                at = {n: t.device for n, t in gather.named(self.weights)}
                policy = {n: (0, t.reshape(-1).to(at[n])) for n, t in full.items()}
        if self._agree(store is not None and store.base_due(newest) and not store.versions[newest].base):
            if same:  # stopped before its snapshot: from the weights (collective)
                gather.snapshot(store, newest, self.weights)
            elif store is not None:  # rank 0 holds it whole
                assert full is not None  # read from the store above
                store.snapshot(newest, full)
        return store, policy

    def _agree(self, decision: T) -> T:
        """Rank 0's decision, on every rank (what only the store's holder can see)."""
        if not self.sharded:
            return decision
        box = [decision]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    @property
    def version(self) -> int:
        """The newest version published (on every rank)."""
        return self._agree(self.store.newest if self.store is not None else -1)  # rank 0's: the others' -1 is not read

    @property
    def state_hash(self) -> str | None:
        """The newest version's state hash: what a subscriber's tensors hash to there (rank 0's)."""
        return self.store.versions[self.store.newest].state_hash if self.store is not None else None

    def weights_hash(self) -> str | None:
        """The state hash of the weights' bf16 cast as they are now (rank 0's; collective where
        they are sharded)."""
        return gather.state_hash(self.table, gather.policy(self.weights), collective=self.sharded)

    def publish(self) -> int:
        """The weights as they are now, as the next version: its delta streams into the store as it
        is encoded (served while written, with `cut_through`), then a base snapshot when one is
        due. Returns the new version (on every rank)."""
        if not self.policy:
            raise RuntimeError("this publisher is closed")
        new = gather.policy(self.weights)
        if not self.sharded:  # the whole policy is here: diff it straight into the store's writer
            assert self.store is not None  # unsharded, this process holds the store
            with self.store.publish(self.table, self.cut_through) as w:
                w.add((t.name, self.policy[t.name][1].view(t.shape), new[t.name][1].view(t.shape)) for t in self.table)
        else:  # each rank encodes its shards; rank 0 gathers their records and writes them
            gather.publish(self.store, self.table, self.policy, new, self.cut_through)
        if self._agree(self.store is not None and self.store.base_due(self.store.newest)):
            gather.snapshot(self.store, self.store.newest if self.store is not None else 0, self.weights)
        self.policy = new
        return self.version

    def serve(
        self,
        secret: str = "",
        host: str = "127.0.0.1",
        port: int = 0,
        tls_cert: str | Path | None = None,
        tls_key: str | Path | None = None,
    ) -> Origin:
        """The store served from a thread of this process (rank 0's): see `Origin`."""
        if self.store is None:
            raise RuntimeError("only rank 0 holds the store: serve it there")
        return Origin(self.store.path, secret, host, port, tls_cert, tls_key)

    def close(self) -> None:
        """Let go of the version held in memory."""
        self.policy = {}

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
