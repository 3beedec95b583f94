"""`sparrowrl relay`: one per region. Fetches each version once across the WAN and serves the
region's workers with the same API as the origin, cut-through.

The relay mirrors the origin's store into a local directory: it starts at the newest base
version, then follows the origin's versions by long-poll. A delta that the origin is still
writing is fetched cut-through over parallel streams (one TCP flow is often capped on a WAN):
each piece as soon as the origin lists it, written at its offset in the mirror's `.partial`
file once it verifies, and listed to the relay's own workers at once (`Mirror`, in arrival
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
import os
import re
import time
import traceback
import uuid
from pathlib import Path

from aiohttp import hdrs, web

from sparrowrl.auth.signing import trust
from sparrowrl.store.store import Store, StoreError, Version
from sparrowrl.transport.client import Client
from sparrowrl.transport.failover import FetchError
from sparrowrl.transport.http import add_health, more_open_files
from sparrowrl.transport.metrics import add_metrics, family
from sparrowrl.transport.server import SERVED, listing_json, make_app, over
from sparrowrl.transport.streams import Piece

MARK = ".sparrowrl-relay"  # names a folder as a relay's cache: the only kind a relay deletes files in
FAILED_S = 30.0  # how long a failed base fetch is answered with its error before a new one starts


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


class Mirror:
    """A file being mirrored (a delta, or a base): the pieces that have verified so far, in
    arrival order, as the relay's workers see them. A `server.Served`: it lists them (long-polled)
    and sends only their bytes, until it closes: stored (the store answers from then on), or
    failed (a 503 with the error: its clients try another server)."""

    def __init__(self, what: str, v: int, path: Path, size: int | None = None) -> None:
        self.what, self.v = what, v  # "delta" or "base", of version v
        self.path = path  # where the verified pieces are written
        self.size = size  # a base's, known from the listing; a delta's is not known until its end
        self.pieces: list[list] = []
        self.changed = asyncio.Event()
        self.epoch = uuid.uuid4().hex  # this list's order; a retried mirror lists in another
        self.closed, self.error = False, None

    def add(self, piece: list) -> None:
        self.pieces.append(piece)
        self.changed.set()
        self.changed = asyncio.Event()

    def writer(self, fd: int):
        """`keep(piece, bytes)` for the client: each verified piece written at its offset into
        `fd` (this table's file), then listed."""

        def keep(p: Piece, data: bytes) -> None:
            os.pwrite(fd, data, p.offset)
            self.add(p.entry())  # with the trainer's signature, untouched

        return keep

    def close(self, error: str | None = None) -> None:
        self.closed, self.error = True, error
        self.changed.set()

    def _failed(self) -> None:
        if self.error:
            raise web.HTTPServiceUnavailable(text=f"relay could not fetch {self.what} v{self.v}: {self.error}")

    async def listing(self, request: web.Request, after: int, deadline: float) -> web.Response | None:
        loop = asyncio.get_running_loop()
        while len(self.pieces) <= after and not self.closed and loop.time() < deadline and not over(request):
            try:
                await asyncio.wait_for(self.changed.wait(), min(1.0, deadline - loop.time()))  # 1 s: see over
            except TimeoutError:
                pass
        self._failed()
        if len(self.pieces) > after or not self.closed:
            return listing_json(self.pieces, after, False, None, self.epoch)
        return None

    async def send(self, request: web.Request) -> web.StreamResponse | None:
        """Only pieces that have verified, answered at once (503 for a range not yet in, never a
        wait past a client's read timeout), read from a descriptor opened here so that the
        fetch may finish meanwhile; ranges as the origin answers them. None once the fetch has
        finished: the stored file answers. A client that listed its pieces elsewhere (the
        origin, before falling back here) may ask for any range: it gets no byte that has not
        verified."""
        self._failed()
        listing = "pieces" if self.what == "delta" else "base/pieces"
        size, v = self.size, self.v
        total = "*" if size is None else size
        try:
            r = request.http_range
        except ValueError:
            raise web.HTTPRequestRangeNotSatisfiable(headers={"Content-Range": f"bytes */{total}"}) from None
        if size is None and (r.start is None or r.start < 0 or r.stop is None):
            raise web.HTTPServiceUnavailable(
                headers={"Retry-After": "1"},
                text=(
                    f"delta v{v} is still reaching this relay: its size is not known yet, so ask for a range "
                    f"with both ends (/v1/versions/{v}/pieces lists those that are here)"
                ),
            )
        start = 0 if r.start is None else max(0, size + r.start) if r.start < 0 else r.start
        stop = r.stop if size is None else size if r.stop is None else min(r.stop, size)
        if start >= stop:
            raise web.HTTPRequestRangeNotSatisfiable(headers={"Content-Range": f"bytes */{total}"})
        if not _covered(self.pieces, start, stop):
            raise web.HTTPServiceUnavailable(
                headers={"Retry-After": "1"},
                text=(
                    f"{self.what} v{v}: bytes {start}-{stop - 1} have not reached this relay yet "
                    f"(/v1/versions/{v}/{listing} lists the pieces that have)"
                ),
            )
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            self._failed()
            return None
        with f:
            ranged = hdrs.RANGE in request.headers
            resp = web.StreamResponse(
                status=206 if ranged else 200,
                headers={
                    hdrs.ACCEPT_RANGES: "bytes",
                    hdrs.CONTENT_TYPE: "application/octet-stream",
                    **({hdrs.CONTENT_RANGE: f"bytes {start}-{stop - 1}/{total}"} if ranged else {}),
                },
            )
            resp.content_length = stop - start
            try:
                await resp.prepare(request)
                if request.method == "GET":  # as aiohttp's FileResponse sends: sendfile, past the writer
                    if request.transport is None:
                        raise ConnectionResetError("connection lost")
                    await asyncio.get_running_loop().sendfile(request.transport, f, start, stop - start)
                await resp.write_eof()
            except ConnectionResetError:  # the client went away: nothing to answer
                pass
            return resp


def _covered(pieces: list[list], start: int, stop: int) -> bool:
    """Whether pieces ([offset, length, …], any order) cover bytes start..stop-1."""
    for offset, length, *_ in sorted(pieces):
        if offset > start:
            return False
        start = max(start, offset + length)
        if start >= stop:
            return True
    return start >= stop


class Relay:
    def __init__(self, upstream: list[str], mirror: Path, keep: int = 8, **client_kw):
        self.upstream, self.mirror, self.keep, self.client_kw = upstream, Path(mirror), keep, client_kw
        self.tables: dict[int, Mirror] = {}  # version being mirrored → its verified pieces so far
        self.bases: dict[int, tuple[Mirror, asyncio.Task]] = {}  # base being fetched on request → its parts so far
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
                        print(f"relay: {e}", flush=True)
                        await asyncio.sleep(1.0)
                    except Exception:  # a bug, not the network: say so loudly, and keep mirroring
                        traceback.print_exc()
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
                print(
                    f"relay: v{v} mirrored, {size:,} bytes in {time.perf_counter() - t0:.2f} s"
                    f" ({c.stats.retries - retries} retries)",
                    flush=True,
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
                    print(f"relay: upstream listed no base snapshot of v{v}", flush=True)
            if entry is not None:
                self._list_bases([entry])
            store = self._store()
        if store is not None:
            self.synced.set()
            if len(store.versions) > self.keep:
                store.prune(self.keep)
                kept = self._store().versions
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
        table = self.tables[v] = Mirror("delta", v, partial)
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

    def arriving(self, what: str, v: int, start: bool) -> Mirror | None:
        """What the relay's server answers from while it is still arriving (`server.Served`)."""
        return self.tables.get(v) if what == "delta" else self.base_table(v, start)

    def base_table(self, v: int, start: bool = True) -> Mirror | None:
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
        table = Mirror(
            "base", v, self.mirror / "bases" / f".{info.base}.{uuid.uuid4().hex[:12]}.partial", info.base_bytes
        )
        self.bases[v] = table, asyncio.create_task(self._fetch_base(self.client, info, table))
        return table

    async def _fetch_base(self, c: Client, info: Version, table: Mirror) -> None:
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
            os.replace(table.path, self.mirror / "bases" / info.base)  # before close(): no reader finds neither
            print(
                f"relay: v{v} base fetched on request, {info.base_bytes:,} bytes in {time.perf_counter() - t0:.2f} s",
                flush=True,
            )
        except asyncio.CancelledError:
            error = table.error or "cancelled"
            raise
        except FetchError as e:
            error = str(e)
            print(f"relay: base v{v} not fetched: {e}", flush=True)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        finally:
            if error is not None:
                table.path.unlink(missing_ok=True)
            if self.bases.get(v, (None,))[0] is table:
                if error is None:
                    del self.bases[v]
                else:
                    asyncio.get_running_loop().call_later(FAILED_S, self._forget, v, table)
            table.close(error)

    def _forget(self, v: int, table: Mirror) -> None:
        if self.bases.get(v, (None,))[0] is table:
            del self.bases[v]

    def _drop_bases(self, doomed) -> None:
        """Stop the base fetches of versions for which `doomed(v)` holds; their clients are
        told so at once (and go to another server, or ask again)."""
        for v in [v for v in self.bases if doomed(v)]:
            table, task = self.bases.pop(v)
            task.cancel()
            table.close("the relay dropped it (pruned, or restarted its mirror)")


def make_relay_app(relay: Relay, token: str, metrics_at: tuple[str, int] | None = None) -> web.Application:
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
            family("counter", "sent_bytes", "Bytes sent to this region's workers, by kind", by=("kind", app[SERVED])),
            family(
                "gauge",
                "newest_version",
                "The newest version this relay holds",
                None if store is None else store.newest,
            ),
        ]

    add_metrics(app, metrics, metrics_at)

    async def mirror_loop(app: web.Application):
        task = asyncio.create_task(relay.run())
        yield
        task.cancel()

    app.cleanup_ctx.append(mirror_loop)
    return app
