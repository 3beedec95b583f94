"""`sparrowrl relay`: one per region. Fetches each version once across the WAN and serves the
region's workers with the same API as the origin, cut-through.

The relay mirrors the origin's store into a local directory: it starts from the newest base
snapshot, then follows the origin's versions by long-poll. A delta that the origin is still
writing is fetched cut-through over parallel streams (one TCP flow is often capped on a WAN):
each piece as soon as the origin lists it, written at its offset in the mirror's `.partial`
file once it verifies, and listed to the relay's own workers at once (`Table`, in arrival
order), so a worker's first chunk does not wait for the relay's last. Finished deltas take the same
path; bases are fetched over parallel verified streams too. Only the newest `keep` versions
are kept.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
import traceback
import uuid
from pathlib import Path

from aiohttp import web

from sparrowrl.store import Store, StoreError, Version
from sparrowrl.transport.client import Client, FetchError, Piece
from sparrowrl.transport.server import make_app


class Table:
    """The verified pieces of a delta being mirrored, as the relay's workers see them."""

    def __init__(self) -> None:
        self.pieces: list[list] = []
        self.changed = asyncio.Event()
        self.epoch = uuid.uuid4().hex  # this list's order; a retried mirror lists in another

    def add(self, piece: list) -> None:
        self.pieces.append(piece)
        self.changed.set()
        self.changed = asyncio.Event()

    def close(self) -> None:
        self.changed.set()


class Relay:
    def __init__(self, upstream: list[str], mirror: Path, keep: int = 8, **client_kw):
        self.upstream, self.mirror, self.keep, self.client_kw = upstream, Path(mirror), keep, client_kw
        self.tables: dict[int, Table] = {}  # version being mirrored → its verified pieces so far
        (self.mirror / "deltas").mkdir(parents=True, exist_ok=True)
        (self.mirror / "bases").mkdir(exist_ok=True)
        self.synced = asyncio.Event()  # set once the first version is mirrored

    def _store(self) -> Store | None:
        try:
            return Store(self.mirror)
        except StoreError:
            return None

    async def run(self) -> None:
        async with Client(self.upstream, **self.client_kw) as c:
            while True:
                try:
                    store = self._store()
                    listing = await c.versions(after=store.newest if store else None, wait=30)
                    await self.sync(c, listing)
                except FetchError as e:  # upstream unreachable for a while: keep serving, try again
                    print(f"relay: {e}", flush=True)
                    await asyncio.sleep(1.0)
                except Exception:  # a bug, not the network: say so loudly, and keep mirroring
                    traceback.print_exc()
                    await asyncio.sleep(1.0)

    async def sync(self, c: Client, listing: dict) -> None:
        entries = {v["version"]: v for v in listing["versions"]}
        every = listing["base_every"]
        store = self._store()
        wanted = sorted(v for v in set(entries) | set(listing.get("producing", []))
                        if store is None or v > store.newest)
        if store is None or (wanted and wanted[0] != store.newest + 1):  # new, or fell behind the origin's window
            start = max((v for v, e in entries.items() if e["base"]), default=None)
            if start is None:
                raise FetchError("upstream lists no base snapshot to start from")
            for f in [*(self.mirror / "deltas").iterdir(), *(self.mirror / "bases").iterdir()]:
                f.unlink()
            await self._fetch_base(c, entries[start], {}, every)
            store = self._store()
            wanted = [v for v in wanted if v > start]
        for v in wanted:
            versions = dict(store.versions)
            t0, retries = time.perf_counter(), c.stats.retries
            partial, digest, size = await self._mirror_delta(c, v)
            try:
                print(f"relay: v{v} mirrored, {size:,} bytes in {time.perf_counter() - t0:.2f} s"
                      f" ({c.stats.retries - retries} retries)", flush=True)
                entry = entries.get(v)
                if entry is None or entry["delta"] is None:  # still being produced when listed
                    entry = await self._listed(c, v, lambda e: e["delta"] is not None)
                    if entry is None:
                        raise FetchError(f"upstream did not list delta v{v} as stored")
                if entry["delta"]["sha256"] != digest:
                    raise FetchError(f"delta v{v} from upstream hashes to {digest[:16]}, listing says "
                                     f"{entry['delta']['sha256'][:16]}")
            except BaseException:
                partial.unlink(missing_ok=True)
                self.tables.pop(v).close()
                raise
            # stored, indexed and unlisted as in flight in one go: its readers never see it missing
            name = f"v{v:08d}-{digest[:16]}.spd"
            os.replace(partial, self.mirror / "deltas" / name)
            versions[v] = Version(v, entry["state_hash"], name, digest, size, changed=entry["changed"])
            Store._write_index(self.mirror, every, versions)
            self.tables.pop(v).close()
            if v % every == 0:  # a base version: its snapshot is written after its delta
                entry = entry if entry["base"] else await self._await_base(c, v)
                if entry is not None:
                    await self._fetch_base(c, entry, versions, every)
            store = self._store()
        if store is not None:
            self.synced.set()
            if len(store.versions) > self.keep:
                store.prune(self.keep)

    async def _mirror_delta(self, c: Client, v: int) -> tuple[Path, str, int]:
        """Fetch delta v (also while upstream still writes it) into the mirror's partial file,
        each piece written at its offset and listed for workers as soon as it has verified,
        in whatever order the streams deliver: one slow piece holds back only itself. The
        piece table stays listed until the caller has stored the file."""
        partial = self.mirror / "deltas" / f".v{v:08d}.partial"
        table = self.tables[v] = Table()
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            def write(p: Piece, data: bytes) -> None:
                os.pwrite(fd, data, p.offset)
                table.add([p.offset, p.length, p.sha256])
            try:
                d = await c.delta(v, write)
            finally:
                os.close(fd)
        except BaseException:
            partial.unlink(missing_ok=True)
            del self.tables[v]
            table.close()
            raise
        return partial, hashlib.sha256(d.data).hexdigest(), len(d.data)

    async def _listed(self, c: Client, v: int, ready, timeout: float = 60.0) -> dict | None:
        """Upstream's entry for v once `ready(entry)` holds. The origin indexes a delta only after
        hashing its file, a moment after the last byte can be read, and writes a base snapshot
        after the delta. None after `timeout`, or once v has left upstream's window."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            listing = await c.versions()
            entry = next((e for e in listing["versions"] if e["version"] == v), None)
            if entry is not None and ready(entry):
                return entry
            if entry is None and v <= listing["newest"] and v not in listing["producing"]:
                return None
            await asyncio.sleep(0.05)
        return None

    async def _await_base(self, c: Client, v: int) -> dict | None:
        """Upstream's entry for v once it lists v's base snapshot (workers syncing in full mode
        need it), or None."""
        entry = await self._listed(c, v, lambda e: e["base"] is not None)
        if entry is None:
            print(f"relay: upstream listed no base snapshot of v{v}", flush=True)
        return entry

    async def _fetch_base(self, c: Client, entry: dict, versions: dict[int, Version], every: int) -> None:
        v, size, step = entry["version"], entry["base"]["bytes"], entry["base"]["part_bytes"]
        pieces = [Piece(i * step, min(step, size - i * step), p) for i, p in enumerate(entry["base"]["parts"])]
        data = await c.download(f"/v1/versions/{v}/base", size, pieces)
        name = f"v{v:08d}.safetensors"
        tmp = self.mirror / "bases" / f".{name}.partial"
        tmp.write_bytes(data)
        os.replace(tmp, self.mirror / "bases" / name)
        info = versions.get(v) or Version(v, entry["state_hash"])
        info.base, info.base_bytes, info.base_parts = name, size, list(entry["base"]["parts"])
        versions[v] = info
        Store._write_index(self.mirror, every, versions)


def make_relay_app(relay: Relay, token: str) -> web.Application:
    """The origin's API over the relay's mirror, with the mirroring loop running beside it. A
    delta being mirrored lists its verified pieces in arrival order; once stored, the origin's
    own handler serves it."""
    app = make_app(relay.mirror, token, pieces_override=lambda v: relay.tables.get(v))

    async def mirror_loop(app: web.Application):
        task = asyncio.create_task(relay.run())
        yield
        task.cancel()

    app.cleanup_ctx.append(mirror_loop)
    return app
