"""The rollout side of weight sync: a set of tensors kept at the publisher's versions, pulled
through relays from the origin, checked against the trainer's signatures piece by piece, and
applied in place only once the whole update has verified against the state hash it must reach.

Fetching and applying are apart, so a server can stage the next version while it generates with
this one, and apply it between requests: `fetch` (async, network) stages one version's update in
memory; `apply` (sync, compute) writes it into the tensors. `pull` does both; `follow` says when
each new version appears.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import torch

from sparrowrl.auth.credential import Credential
from sparrowrl.auth.signing import trust
from sparrowrl.delta import DeltaFile, apply_delta, state_hash
from sparrowrl.delta.errors import MismatchError
from sparrowrl.transport.client import Client
from sparrowrl.transport.failover import Stats
from sparrowrl.transport.http import is_loopback

MAX_WAIT_S = 300.0  # one long poll of `follow`
MAX_VERSION = 10**12  # the version numbers the server's routes take


def _version(name: str, v: object) -> int:
    """A version number from the caller, bounded."""
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < MAX_VERSION:
        raise ValueError(f"{name}: {v!r}, where a version number 0 to {MAX_VERSION - 1:,} is expected")
    return v


@dataclass(frozen=True)
class Staged:
    """One version's update, fetched and verified, not yet applied: a delta from the version
    before it, or a full state."""

    version: int
    delta: DeltaFile | None
    state: dict[str, torch.Tensor] | None
    state_hash: str
    fetch_s: float


class Subscriber:
    """Keeps `tensors` (by the trainer's names; CPU or CUDA, bf16, written in place) at the
    publisher's versions, from `servers`: relays first, the origin last, each tried in turn.

    `held`: the version the tensors hold already (loaded from the checkpoint version 0 was made
    from, say), checked by its hash at the first update; None: they hold nothing yet, and the
    first pull brings the whole state. `token` (default `SPARROWRL_TOKEN`, or the file
    `SPARROWRL_TOKEN_FILE` names, read again when it changes): the job's secret or a role token;
    `trainer_key` (default `SPARROWRL_TRAINER_KEY`, else the one the secret derives): whose
    signatures every version must carry. `snapshots`: fetch each version as its own full
    snapshot (from a publisher with `base_every=1`: full-weight sync) instead of as a delta.
    `transport`: the client's options (`streams`, `attempts`, `read_timeout`, `rate_mbit`,
    `ssl_context`, `local_ports`)."""

    def __init__(
        self,
        servers: str | Sequence[str],
        tensors: Mapping[str, torch.Tensor],
        *,
        held: int | None = None,
        token: str | Credential | None = None,
        trainer_key: str | None = None,
        snapshots: bool = False,
        **transport: Any,
    ):
        credential = Credential.of(token)
        urls = [servers] if isinstance(servers, str) else list(servers)
        checks = trust(credential.get(), trainer_key)
        far = [u for u in urls if not is_loopback(urlsplit(u).hostname or "")]
        if checks is None and far:
            raise ValueError(
                f"servers: {far[0]} is not on loopback, and without a token or trainer_key (or SPARROWRL_TOKEN, "
                f"SPARROWRL_TRAINER_KEY) no signature would be checked"
            )
        if held is not None:
            _version("held", held)
        # the same storage, without autograd: a model's parameters refuse in-place writes on CUDA
        self.tensors = {n: t.detach() for n, t in tensors.items()}
        self.snapshots = snapshots
        self.client = Client(urls, token=credential, trust=checks, **transport)
        self.version = -1 if held is None else held
        self.state_hash = "" if held is None else state_hash(self.tensors)

    async def __aenter__(self) -> Subscriber:
        await self.client.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.__aexit__(*exc)

    @property
    def stats(self) -> Stats:
        """Bytes fetched by kind and server, and answers refused by server (transport.failover.Stats)."""
        return self.client.stats

    @property
    def server_url(self) -> str:
        """The server in use now."""
        return self.client.server_url

    async def newest(self) -> int:
        """The newest version the servers hold."""
        newest: int = (await self.client.versions())["newest"]
        return newest

    async def find(self) -> int | None:
        """Which listed version the tensors hold, by their state hash (a server started from the
        checkpoint that version was made from), taken as held; None where they hold none."""
        h = await asyncio.to_thread(state_hash, dict(self.tensors))
        listing = await self.client.versions()
        at = max((e["version"] for e in listing["versions"] if e["state_hash"] == h), default=None)
        if at is not None:  # the hash first: a thread that sees the version sees its hash
            self.state_hash = h
            self.version = at
        return at

    async def follow(self, after: int | None = None, wait: float = 30.0) -> AsyncIterator[int]:
        """Each version after `after` (default: the one held), in order, as soon as the publisher
        starts writing it: its `fetch` then pulls it while it is written (cut-through)."""
        known = self.version if after is None else after
        if not (isinstance(wait, int | float) and math.isfinite(wait) and 0 < wait <= MAX_WAIT_S):
            raise ValueError(f"wait: {wait!r} seconds, where (0, {MAX_WAIT_S:g}] are allowed")
        while True:
            listing = await self.client.versions(after=known, wait=wait)
            newest = max([listing["newest"], *listing["producing"]])
            while known < newest:
                known += 1
                yield known

    async def fetch(self, version: int, full: bool | None = None) -> Staged:
        """Version `version`'s update, staged in memory and verified piece by piece; nothing held
        changes. `full`: the whole state, by the servers' cheapest plan (the nearest base and the
        deltas after it), checked by its state hash, rather than the delta from the version before;
        by default, while the tensors hold nothing."""
        _version("version", version)
        t0 = time.perf_counter()
        if self.version < 0 if full is None else full:
            state, h = await self.client.advance(version)
            return Staged(version, None, state, h, time.perf_counter() - t0)
        if self.snapshots:  # the whole version, once the publisher has stored it
            listing = await self.client.versions()
            if listing["base_every"] != 1:
                raise ValueError(
                    f"snapshots: every version whole needs a publisher with base_every=1; this one has "
                    f"{listing['base_every']}"
                )
            while not any(e["version"] == version and e["base"] for e in listing["versions"]):
                listing = await self.client.versions(base=version, wait=30)
            state, h = await self.client.base(version, listing)
            return Staged(version, None, state, h, time.perf_counter() - t0)
        delta = await self.client.delta(version)
        return Staged(version, delta, None, delta.manifest["target_hash"], time.perf_counter() - t0)

    def apply(self, staged: Staged) -> str:
        """Write a staged update into the tensors, in place; returns their new state hash. A delta
        is checked whole (its base is what the tensors hold, its records, the hash it reaches)
        before any element changes: on MismatchError or DeltaError the tensors are as they were."""
        if staged.state is not None:
            if staged.version <= self.version:
                raise MismatchError(f"v{staged.version} is not ahead of v{self.version}, which the tensors hold")
            if set(self.tensors) != set(staged.state):
                raise MismatchError(
                    f"v{staged.version}: the publisher's tensors are not these: "
                    f"{sorted(set(self.tensors) ^ set(staged.state))[:3]}"
                )
            for n, t in staged.state.items():
                if self.tensors[n].shape != t.shape or self.tensors[n].dtype != t.dtype:
                    raise MismatchError(
                        f"tensor '{n}': {t.dtype}{list(t.shape)} from the publisher, "
                        f"{self.tensors[n].dtype}{list(self.tensors[n].shape)} here"
                    )
            for n, t in staged.state.items():
                self.tensors[n].copy_(t)
            h = staged.state_hash
        else:
            if staged.version != self.version + 1:
                raise MismatchError(f"v{staged.version}'s delta applies to v{staged.version - 1}, not v{self.version}")
            assert staged.delta is not None  # a Staged holds a state or a delta
            h = apply_delta(staged.delta, self.tensors, base_hash=self.state_hash)
        self.version, self.state_hash = staged.version, h
        return h

    async def pull(self, version: int | None = None) -> int:
        """Bring the tensors to `version` (default: the newest), by the servers' cheapest plan: the
        deltas from the version held, one verified update at a time, or (holding nothing, or far
        behind, or past what the servers still keep) the whole state. Returns the version held.
        Each update is applied off the event loop; one that fails changes nothing, and `version`
        says what the updates before it reached."""
        target = await self.newest() if version is None else _version("version", version)
        if target < self.version:
            raise ValueError(f"v{target} is behind v{self.version}, which the tensors hold: versions only go forward")
        if target == self.version:
            return target
        if self.version < 0 or (await self.client.plan(target, self.version))["route"] == "base":
            await asyncio.to_thread(self.apply, await self.fetch(target, full=True))
        while self.version < target:
            await asyncio.to_thread(self.apply, await self.fetch(self.version + 1))
        return self.version
