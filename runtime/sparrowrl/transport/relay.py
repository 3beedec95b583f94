"""`sparrowrl relay`: one per region. Fetches each version once across the WAN and serves the
region's workers with the same API as the origin, cut-through.

The relay mirrors the origin's store into a local directory: it starts at the newest base
version, then follows the origin's versions by long-poll. A delta that the origin is still
writing is fetched cut-through over parallel streams (one TCP flow is often capped on a WAN):
each piece as soon as the origin lists it, written at its offset in the mirror's `.partial`
file once it verifies, and listed to the relay's own workers at once (`PieceTable`, in arrival
order), so a worker's first chunk does not wait for the relay's last. Finished deltas take the same
path. Only the newest `keep` versions are kept.

Base snapshots are listed as soon as the origin lists them but cross the WAN only when a client
first asks for one (a worker starting, or full sync): a base is the whole model, and in sparse
sync almost no step needs one. That one fetch goes through the relay's one upstream client (its
streams, local ports and rate cap), and is served cut-through the same way: each part listed
to the clients as soon as it has verified.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import os
import re
import time
import uuid
from pathlib import Path

from aiohttp import web

from sparrowrl.auth.signing import trust
from sparrowrl.store.index import Version
from sparrowrl.store.store import Store, StoreError
from sparrowrl.transport.client import Client
from sparrowrl.transport.failover import FetchError
from sparrowrl.transport.http import ServingTLS, add_health, more_open_files
from sparrowrl.transport.metrics import add_metrics, family
from sparrowrl.transport.piece_table import PieceTable
from sparrowrl.transport.server import SENT, make_app

MARK = ".sparrowrl-relay"  # names a folder as a relay's cache: the only kind a relay deletes files in
FAILED_S = 30.0  # how long a failed base fetch is answered with its error before a new one starts

log = logging.getLogger(__name__)


_CACHED = re.compile(r"\.?v\d{8}(-[0-9a-f]{16}\.spd|\.safetensors)?(\.[0-9a-f]{12})?(\.partial)?")


def _own_cache(folder: Path) -> bool:
    """A folder a relay may delete files in: new, empty, marked as a relay's cache, or (made
    before the mark) holding nothing but a mirror's index, lock and version files."""
    if not folder.exists():
        return True
    if not folder.is_dir():
        return False
    names = {p.name for p in folder.iterdir()}
    if MARK in names or not names:
        return True
    return names <= {"store.json", ".lock", "deltas", "bases"} and all(
        sub.is_dir() and all(_CACHED.fullmatch(f.name) for f in sub.iterdir())
        for sub in (folder / "deltas", folder / "bases")
        if sub.exists()
    )


class Relay:
    def __init__(self, upstream: list[str], mirror: Path, keep: int = 8, **client_kw):
        self.upstream, self.mirror, self.keep, self.client_kw = upstream, Path(mirror), keep, client_kw
        self.tables: dict[int, PieceTable] = {}  # version being mirrored → its verified pieces so far
        self.bases: dict[int, tuple[PieceTable, asyncio.Task]] = {}  # base being fetched on request → its parts so far
        self.client: Client | None = None  # the one upstream client: deltas and bases share its streams and cap
        if not _own_cache(self.mirror):
            raise ValueError(
                f"--cache {self.mirror}: not empty, and not a relay's cache: a relay deletes old "
                f"versions in its cache, so it takes only a new or empty folder, or its own"
            )
        try:
            (self.mirror / "deltas").mkdir(parents=True, exist_ok=True)
            (self.mirror / "bases").mkdir(exist_ok=True)
            (self.mirror / MARK).touch()
        except OSError as e:
            raise ValueError(f"--cache {self.mirror}: {e.strerror} ({e.filename})") from None
        for stale in [*(self.mirror / "deltas").glob(".*.partial"), *(self.mirror / "bases").glob(".*.partial")]:
            stale.unlink()  # a fetch cut short by the relay's last exit (a persistent --cache)
        self.synced = asyncio.Event()  # set once the first version is mirrored

    def _store(self) -> Store | None:
        try:
            return Store(self.mirror)
        except StoreError:
            return None

    async def run(self) -> None:
        async with Client(self.upstream, **self.client_kw) as c:
            self.client = c
            try:
                while True:
                    try:
                        store = self._store()
                        listing = await c.versions(after=store.newest if store else None, wait=30)
                        await self.sync(c, listing)
                    except FetchError as e:  # upstream unreachable for a while: keep serving, try again
                        log.warning(f"relay: {e}")
                        await asyncio.sleep(1.0)
                    except Exception:  # a bug, not the network: say so loudly, and keep mirroring
                        log.exception("relay: mirroring failed (not the network); trying again")
                        await asyncio.sleep(1.0)
            finally:
                self._drop_bases(lambda v: True)
                self.client = None

    async def sync(self, c: Client, listing: dict) -> None:
        entries = {v["version"]: v for v in listing["versions"]}
        every = listing["base_every"]
        store = self._store()
        wanted = sorted(
            v for v in set(entries) | set(listing.get("producing", [])) if store is None or v > store.newest
        )
        if store is None or (wanted and wanted[0] != store.newest + 1):  # new, or fell behind the origin's window
            start = max((v for v, e in entries.items() if e["base"]), default=None)
            if start is None:
                raise FetchError("upstream lists no base snapshot to start from")
            self._drop_bases(lambda v: True)
            for f in [*(self.mirror / "deltas").iterdir(), *(self.mirror / "bases").iterdir()]:
                f.unlink()
            store = Store.mirror(self.mirror, every, start, entries[start]["state_hash"])
            wanted = [v for v in wanted if v > start]
        self._list_bases(entries.values())  # also any whose listing an earlier pass missed
        for v in wanted:
            t0, retries = time.perf_counter(), c.stats.retries
            partial, digest, size = await self._mirror_delta(c, v)
            try:
                try:
                    table_sig = await c.table_sig(v)  # before it is stored: its readers never find it missing
                except FetchError:
                    table_sig = ""  # its workers check each piece's instead
                log.info(
                    f"relay: v{v} mirrored, {size:,} bytes in {time.perf_counter() - t0:.2f} s"
                    f" ({c.stats.retries - retries} retries)"
                )
                entry = entries.get(v)
                if entry is None or entry["delta"] is None:  # still being produced when listed
                    entry = await self._listed(c, v, "delta")
                    if entry is None:
                        raise FetchError(f"upstream did not list delta v{v} as stored")
                if entry["delta"]["sha256"] != digest:
                    raise FetchError(
                        f"delta v{v} from upstream hashes to {digest[:16]}, listing says "
                        f"{entry['delta']['sha256'][:16]}"
                    )
            except BaseException:
                partial.unlink(missing_ok=True)
                self.tables.pop(v).close()
                raise
            # stored, indexed and unlisted as in flight in one go: its readers never see it missing
            name = f"v{v:08d}-{digest[:16]}.spd"
            os.replace(partial, self.mirror / "deltas" / name)
            sigs = [p[4] for p in sorted(self.tables[v].pieces)]  # served with the stored file
            assert store is not None  # made above where new; read again after each version
            store.record(
                Version(
                    v,
                    entry["state_hash"],
                    name,
                    digest,
                    size,
                    changed=entry["changed"],
                    delta_sigs=sigs if all(sigs) else [],
                    delta_table_sig=table_sig,
                )
            )
            self.tables.pop(v).close()
            if store.base_due(v) and not entry["base"]:  # its snapshot is written after its delta
                entry = await self._listed(c, v, "base")
                if entry is None:
                    log.warning(f"relay: upstream listed no base snapshot of v{v}")
            if entry is not None:
                self._list_bases([entry])
            store = self._store()
        if store is not None:
            self.synced.set()
            if len(store.versions) > self.keep:
                store.prune(self.keep)
                pruned = self._store()
                assert pruned is not None  # pruned, not gone
                kept = pruned.versions
                self._drop_bases(lambda v: v not in kept)

    def _list_bases(self, entries) -> None:
        """Put upstream's base snapshots of versions this mirror holds into its index, without
        their files: fetched on the first request (`base_table`)."""
        store = self._store()
        if store is None:
            return
        new = [
            e
            for e in entries
            if e["base"]
            and e["version"] in store.versions
            and not store.versions[e["version"]].base
            and e["state_hash"] == store.versions[e["version"]].state_hash
        ]
        if new:
            store.record(
                *(
                    dataclasses.replace(
                        store.versions[e["version"]],
                        base=f"v{e['version']:08d}.safetensors",
                        base_bytes=e["base"]["bytes"],
                        base_parts=list(e["base"]["parts"]),
                        base_part_bytes=e["base"]["part_bytes"],
                        base_sig=e["base"]["sig"],
                    )
                    for e in new
                )
            )

    async def _mirror_delta(self, c: Client, v: int) -> tuple[Path, str, int]:
        """Fetch delta v (also while upstream still writes it) into the mirror's partial file,
        each piece written at its offset and listed for workers as soon as it has verified,
        in whatever order the streams deliver: one slow piece holds back only itself. The
        piece table stays listed until the caller has stored the file."""
        partial = self.mirror / "deltas" / f".v{v:08d}.partial"
        table = self.tables[v] = PieceTable("delta", v, partial)
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            try:
                d = await c.delta(v, table.writer(fd))
            finally:
                os.close(fd)
        except BaseException:
            partial.unlink(missing_ok=True)
            del self.tables[v]
            table.close()
            raise
        return partial, hashlib.sha256(d.data).hexdigest(), len(d.data)

    async def _listed(self, c: Client, v: int, what: str, timeout: float = 60.0) -> dict | None:
        """Upstream's entry for v once it lists v's `what` ("delta" or "base"), long-polled: the
        origin indexes a delta only after hashing its file, a moment after the last byte can be
        read, and writes a base snapshot after the delta (it may take a while for a large
        model). None after `timeout`, or once v has left upstream's window."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            listing = await c.versions(**{what: v}, wait=min(20.0, left))
            entry = next((e for e in listing["versions"] if e["version"] == v), None)
            if entry is not None and entry[what] is not None:
                return entry
            if (
                entry is None
                and v <= listing["newest"]
                and v not in listing["producing"]
                or entry is not None
                and what == "delta"
            ):  # stored without a delta: it will never have one
                return None
        return None

    def arriving(self, what: str, v: int, start: bool) -> PieceTable | None:
        """What the relay's server answers from while it is still arriving (`server.Served`)."""
        return self.tables.get(v) if what == "delta" else self.base_table(v, start)

    def base_table(self, v: int, start: bool = True) -> PieceTable | None:
        """The parts of v's base snapshot that have arrived, where the mirror lists the base but
        does not hold its file: the first request (`start`) starts the one fetch, later ones
        share it. A fetch that failed stays here, failed, for FAILED_S: its clients go to
        another server instead of starting a fetch each. None where the file is here, or v
        lists no base."""
        if v in self.bases or not start:
            return self.bases.get(v, (None,))[0]
        store = self._store()
        info = store.versions.get(v) if store else None
        if info is None or not info.base or (self.mirror / "bases" / info.base).exists() or self.client is None:
            return None
        table = PieceTable(
            "base", v, self.mirror / "bases" / f".{info.base}.{uuid.uuid4().hex[:12]}.partial", info.base_bytes
        )
        self.bases[v] = table, asyncio.create_task(self._fetch_base(self.client, info, table))
        return table

    async def _fetch_base(self, c: Client, info: Version, table: PieceTable) -> None:
        v, t0, error = info.version, time.perf_counter(), None
        entry = {"base": {"bytes": info.base_bytes, "part_bytes": info.base_part_bytes, "parts": info.base_parts}}
        try:
            fd = os.open(table.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                await c.base_parts(v, entry, table.writer(fd))
            finally:
                os.close(fd)
            store = self._store()
            kept = store.versions.get(v) if store else None
            if kept is None or kept.base != info.base:
                raise FetchError("pruned while it was being fetched")
            assert info.base is not None  # base_table fetches the bases listed
            os.replace(table.path, self.mirror / "bases" / info.base)  # before close(): no reader finds neither
            log.info(
                f"relay: v{v} base fetched on request, {info.base_bytes:,} bytes in {time.perf_counter() - t0:.2f} s"
            )
        except asyncio.CancelledError:
            error = table.error or "cancelled"
            raise
        except FetchError as e:
            error = str(e)
            log.warning(f"relay: base v{v} not fetched: {e}")
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
            log.exception(f"relay: base v{v} not fetched")
        finally:
            if error is not None:
                table.path.unlink(missing_ok=True)
            if self.bases.get(v, (None,))[0] is table:
                if error is None:
                    del self.bases[v]
                else:
                    asyncio.get_running_loop().call_later(FAILED_S, self._forget, v, table)
            table.close(error)

    def _forget(self, v: int, table: PieceTable) -> None:
        if self.bases.get(v, (None,))[0] is table:
            del self.bases[v]

    def _drop_bases(self, doomed) -> None:
        """Stop the base fetches of versions for which `doomed(v)` holds; their clients are
        told so at once (and go to another server, or ask again)."""
        for v in [v for v in self.bases if doomed(v)]:
            table, task = self.bases.pop(v)
            task.cancel()
            table.close("the relay dropped it (pruned, or restarted its mirror)")


def make_relay_app(
    relay: Relay, token: str, metrics_at: tuple[str, int] | None = None, served: ServingTLS | None = None
) -> web.Application:
    """The origin's API over the relay's mirror, with the mirroring loop running beside it. A
    delta being mirrored lists its verified pieces in arrival order; once stored, the origin's
    own handler serves it. Raises the process's limit of open files (`more_open_files`)."""
    more_open_files("relay")
    app = make_app(relay.mirror, token, arriving=relay.arriving, trust=trust(token), written_here=True)  # no signer
    add_health(app, relay.synced.is_set)  # ready once it has listed upstream and mirrors its versions

    @web.middleware
    async def until_synced(request: web.Request, handler):
        """Before its first sync a relay asks its workers to come back, rather than sending them to
        the origin: each would pull a whole base across the WAN."""
        if not relay.synced.is_set() and request.path.startswith("/v1/"):
            raise web.HTTPServiceUnavailable(
                headers={"Retry-After": "1"}, text="relay: not synced with its upstream yet"
            )
        return await handler(request)

    app.middlewares.append(until_synced)  # after auth: a request without the token is still a 401

    def metrics() -> list:
        store = relay._store()
        return [
            family(
                "counter",
                "received_bytes",
                "Verified bytes fetched from upstream, by kind",
                by=("kind", relay.client.stats.kinds if relay.client else {"delta": 0, "base": 0}),
            ),
            family(
                "counter",
                "received_stream_bytes",
                "Verified bytes fetched from upstream, by kind, server and stream",
                by=(("kind", "server", "stream"), relay.client.stats.sources if relay.client else {}),
            ),
            family("counter", "sent_bytes", "Bytes sent to this region's workers, by kind", by=("kind", app[SENT])),
            family(
                "gauge",
                "newest_version",
                "The newest version this relay holds",
                None if store is None else store.newest,
            ),
        ]

    add_metrics(app, metrics, metrics_at, served)

    async def mirror_loop(app: web.Application):
        task = asyncio.create_task(relay.run())
        yield
        task.cancel()

    app.cleanup_ctx.append(mirror_loop)
    return app
