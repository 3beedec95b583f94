"""`sparrowrl serve`: publish a checkpoint store over HTTP.

    GET /v1/versions[?after=N&wait=S]   versions (JSON); with `after`, waits up to S seconds
                                        for a version newer than N (long-poll, no tight loops);
                                        with `base=V`, for V's base snapshot (full sync); with
                                        `delta=V`, until V is stored and indexed
    GET /v1/plan?to=V[&from=U]          the store's cheapest route from U to V
    GET /v1/versions/V/manifest         a delta's header, chunk table and manifest (JSON)
    GET /v1/versions/V/delta            the delta file (HTTP Range: 206 Partial Content), also
                                        while it is being written (ranges of what is written)
    GET /v1/versions/V/pieces?after=I   the delta's complete pieces (header, chunks, tail) with
                                        their sha256, from the I-th on; long-polls while it grows.
                                        `epoch` names the list's order: file order ("file"), or
                                        a relay's arrival order while it mirrors the delta
    GET /v1/versions/V/base/pieces?after=I&wait=S
                                        the base snapshot's parts that can be read, as for a
                                        delta: all of them at the origin; at a relay still
                                        fetching the base, those that have arrived and verified
    GET /v1/versions/V/base             the base snapshot file (Range), verified in parts

Every endpoint wants `Authorization: Bearer TOKEN` when the server has a token: the job's
secret, or a role token that the trainer's key signed (tokens.py says who may do what). A
server given a `Signer` (the trainer's) signs what it lists: each delta piece and each base
(signing.py); a relay forwards the signatures it was given.
Files are immutable and content-hashed, so responses carry strong ETags.
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Callable, Protocol, overload

from aiohttp import web

from sparrowrl.auth.signing import Signer, Verifier, base_statement, piece_statement, table_statement
from sparrowrl.auth.tokens import Gate
from sparrowrl.delta.errors import DeltaError
from sparrowrl.store.changes import listen
from sparrowrl.store.index import Version
from sparrowrl.store.store import Store, StoreError
from sparrowrl.transport.http import GATE, auth
from sparrowrl.transport.pieces import Pieces
from sparrowrl.transport.watch import Watch

MAX_WAIT = 60.0
MAX_INDEX = 1 << 62  # versions, piece indexes: far beyond any store, small enough to stay exact
STORE = web.AppKey("store", Path)
SIGNER = web.AppKey[Signer | None]("signer")  # None: signatures come from the store
MANIFESTS = web.AppKey("manifests", dict)
CACHE = web.AppKey("cache", dict)
STOPPING = web.AppKey("stopping", asyncio.Event)
PIECES = web.AppKey("pieces", dict)
ARRIVING = web.AppKey[Callable[[str, int, bool], "Served | None"]]("arriving")
SENT = web.AppKey("sent", dict)  # bytes sent, by kind: the origin's and relays' counters
WATCH = web.AppKey("watch", Watch)


def _store(request: web.Request) -> Store:
    """The store's index, re-read only when store.json changes (long-polls stat it often)."""
    path = request.app[STORE]
    try:
        st = (path / "store.json").stat()
        seen = st.st_ino, st.st_mtime_ns  # each write is a new file (renamed into place): a new inode
        cached = request.app[CACHE]
        if cached.get("seen") != seen:
            cached.update(seen=seen, store=Store(path))
        return cached["store"]
    except (StoreError, OSError) as e:
        raise web.HTTPServiceUnavailable(text=f"store unavailable: {e}") from None


def _version(request: web.Request, store: Store) -> int:
    v = int(request.match_info["version"])  # the route's pattern admits digits only
    if v not in store.versions:
        raise web.HTTPNotFound(text=f"version {v} is not in the store")
    return v


def base_sig(signer: Signer | None, v: Version) -> str:
    """The trainer's signature of v's base: made here (the trainer), or as the mirror got it."""
    if signer is None:
        return v.base_sig
    return signer.sign(base_statement(v.version, v.state_hash, v.base_bytes, v.base_part_bytes, v.base_parts))


def _listing(store: Store, signer: Signer | None) -> dict:
    return {
        "newest": store.newest,
        "base_every": store.base_every,
        "producing": store.producing(),
        "versions": [
            {
                "version": v.version,
                "state_hash": v.state_hash,
                "changed": v.changed,
                "delta": {"bytes": v.delta_bytes, "sha256": v.delta_sha256} if v.delta else None,
                "base": {
                    "bytes": v.base_bytes,
                    "part_bytes": v.base_part_bytes,
                    "parts": v.base_parts,
                    "sig": base_sig(signer, v),
                }
                if v.base
                else None,
            }
            for v in (store.versions[k] for k in sorted(store.versions))
        ],
    }


@overload
def _int_param(request: web.Request, name: str, default: int) -> int: ...
@overload
def _int_param(request: web.Request, name: str, default: None = None) -> int | None: ...
def _int_param(request: web.Request, name: str, default: int | None = None) -> int | None:
    """An integer query parameter in 0..MAX_INDEX (a negative one would slice from the end)."""
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise web.HTTPBadRequest(text=f"query parameter {name}={raw!r} is not an integer") from None
    if not 0 <= value <= MAX_INDEX:
        raise web.HTTPBadRequest(text=f"query parameter {name}={raw!r} is out of range 0..{MAX_INDEX}")
    return value


def _wait(request: web.Request) -> float:
    """The `wait` query parameter: finite seconds, not negative (NaN would make a deadline that
    never passes); more than MAX_WAIT waits MAX_WAIT."""
    raw = request.query.get("wait", "0")
    try:
        value = float(raw)
    except ValueError:
        raise web.HTTPBadRequest(text=f"query parameter wait={raw!r} is not a number") from None
    if not (math.isfinite(value) and value >= 0):
        raise web.HTTPBadRequest(text=f"query parameter wait={raw!r} must be a finite number of seconds, 0 or more")
    return min(value, MAX_WAIT)


def over(request: web.Request) -> bool:
    """Whether a long-poll should stop waiting: the server is stopping, or its client has gone
    (aiohttp does not cancel a handler when its client disconnects)."""
    transport = request.transport
    return request.app[STOPPING].is_set() or transport is None or transport.is_closing()


async def versions(request: web.Request) -> web.Response:
    after, base, delta = _int_param(request, "after"), _int_param(request, "base"), _int_param(request, "delta")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _wait(request)

    def waiting(store: Store) -> bool:  # with several, for all
        gone = (
            base is not None and base not in store.versions and base <= store.newest and base not in store.producing()
        )  # pruned: its snapshot will never come
        return (
            (after is not None and max([store.newest, *store.producing()]) <= after)
            or (base is not None and not gone and not getattr(store.versions.get(base), "base", None))
            or (delta is not None and delta > store.newest)
        )  # versions are indexed in order, once stored

    store = _store(request)
    while waiting(store) and loop.time() < deadline and not over(request):
        await request.app[WATCH].changed(min(1.0, deadline - loop.time()))  # 1 s: see over
        store = _store(request)
    return web.json_response(_listing(store, request.app[SIGNER]))


async def plan(request: web.Request) -> web.Response:
    to, have = _int_param(request, "to"), _int_param(request, "from")
    if to is None:
        raise web.HTTPBadRequest(text="query parameter 'to' is required")
    try:
        p = _store(request).plan(have, to)
    except StoreError as e:
        raise web.HTTPNotFound(text=str(e)) from None
    return web.json_response(vars(p))


async def manifest(request: web.Request) -> web.Response:
    store = _store(request)
    v = _version(request, store)
    info = store.versions[v]
    if not info.delta:
        raise web.HTTPNotFound(text=f"version {v} has no delta (it is the oldest kept)")
    cache = request.app[MANIFESTS]
    if info.delta_sha256 not in cache:
        try:
            d = store.delta(v)
        except (StoreError, DeltaError) as e:
            raise web.HTTPInternalServerError(text=f"stored delta v{v} is damaged: {e}") from None
        cache[info.delta_sha256] = {
            "version": v,
            "bytes": len(d.data),
            "sha256": info.delta_sha256,
            "header": d.header,
            "manifest": d.manifest,
        }
    return web.json_response(cache[info.delta_sha256])


def _file(store: Store, sub: str, name: str, etag: str | None) -> web.FileResponse:
    resp = web.FileResponse(store.path / sub / name, headers={"Cache-Control": "public, max-age=31536000, immutable"})
    resp.etag = etag
    return resp


class Served(Protocol):
    """A file the server answers for: a delta or a base, stored here (`StoredDelta`,
    `StoredBase`) or still arriving (a relay's copy in flight, `piece_table.PieceTable`). It lists its
    pieces, long-polled until `deadline` (the loop's time), and sends its bytes (HTTP Range).
    None: not, or no longer, this source's to answer (it is stored now): the store answers."""

    async def listing(self, request: web.Request, after: int, deadline: float) -> web.Response | None: ...

    async def send(self, request: web.Request) -> web.StreamResponse | None: ...


def listing_json(
    pieces: list[list], after: int, complete: bool, size: int | None, epoch: str, table_sig: str = ""
) -> web.Response:
    """`table_sig`: the trainer's signature of the whole table, sent with a complete one from its start."""
    return web.json_response(
        {
            "pieces": pieces[after:],
            "complete": complete,
            "bytes": size,
            "epoch": epoch,
            **({"table_sig": table_sig} if table_sig and complete and after == 0 else {}),
        }
    )


class StoredDelta:
    """A delta in the store, or growing there (the trainer writing it: cut-through, in file order)."""

    def __init__(self, request: web.Request, v: int):
        self.store, self.v = _store(request), v

    def _open(self):
        """The delta file of v, growing (being written) or finished; None if neither."""
        try:
            return open(self.store.partial_path(self.v), "rb")
        except FileNotFoundError:
            info = self.store.versions.get(self.v)
            if info is None or not info.delta:
                return None
            return open(self.store.path / "deltas" / info.delta, "rb")

    async def listing(self, request: web.Request, after: int, deadline: float) -> web.Response:
        f = self._open()
        if f is None:
            raise web.HTTPNotFound(text=f"version {self.v} is neither stored nor being written")
        loop = asyncio.get_running_loop()
        with f:
            # hashed (and signed) once
            st, sigs = request.app[PIECES].setdefault((self.v, os.fstat(f.fileno()).st_ino), (Pieces(), []))
            while True:
                st.scan(f.fileno(), os.fstat(f.fileno()).st_size)
                if len(st.pieces) > after or st.complete or loop.time() >= deadline or over(request):
                    break
                await request.app[WATCH].changed(min(1.0, deadline - loop.time()))  # 1 s: see over
        signer, table = request.app[SIGNER], ""
        signed = self._signed(st.pieces, sigs, signer)
        if st.complete and after == 0:
            info = self.store.versions.get(self.v)
            table = signer.sign(table_statement(self.v, signed)) if signer else info.delta_table_sig if info else ""
        return listing_json(signed, after, st.complete, st.bytes, "file", table)

    def _signed(self, pieces: list[list], sigs: list[str], signer: Signer | None) -> list[list]:
        """Each piece with the trainer's signature: made here, or as a relay's mirror got them."""
        if signer is None:
            info = self.store.versions.get(self.v)
            got = info.delta_sigs if info is not None and len(info.delta_sigs) == len(pieces) else []
            sigs[:] = got or [""] * len(pieces)
        else:
            while len(sigs) < len(pieces):
                sigs.append(signer.sign(piece_statement(self.v, *pieces[len(sigs)])))
        return [[*p, s] for p, s in zip(pieces, sigs)]

    async def send(self, request: web.Request) -> web.StreamResponse:
        store, v = self.store, self.v
        if v not in store.versions and store.partial_path(v).exists():  # growing: ranges of what is written
            return web.FileResponse(store.partial_path(v))
        v = _version(request, store)
        info = store.versions[v]
        if not info.delta:
            raise web.HTTPNotFound(text=f"version {v} has no delta")
        return _file(store, "deltas", info.delta, info.delta_sha256)


class StoredBase:
    """A base snapshot this store lists. A relay lists bases it does not hold (it fetches one on
    request): without the file, and not arriving, a 503 says to ask again (a 404 would say it
    does not exist)."""

    def __init__(self, store: Store, v: int, info):
        self.store, self.v, self.info = store, v, info

    def _here(self) -> None:
        if not (self.store.path / "bases" / self.info.base).exists():
            raise web.HTTPServiceUnavailable(
                headers={"Retry-After": "1"},
                text=(f"base v{self.v} is not at this relay yet (/v1/versions/{self.v}/base/pieces fetches it)"),
            )

    async def listing(self, request: web.Request, after: int, deadline: float) -> web.Response:
        self._here()
        size, step = self.info.base_bytes, self.info.base_part_bytes
        n = len(self.info.base_parts)  # covered by the base's signature in the version listing
        parts = [[i * step, min(step, size - i * step), h, i == n - 1, ""] for i, h in enumerate(self.info.base_parts)]
        return listing_json(parts, after, True, size, "file")

    async def send(self, request: web.Request) -> web.StreamResponse:
        self._here()
        return _file(self.store, "bases", self.info.base, f"base-{self.info.state_hash}")


def _base(request: web.Request) -> StoredBase:
    store = _store(request)
    v = _version(request, store)
    info = store.versions[v]
    if not info.base:
        raise web.HTTPNotFound(text=f"version {v} has no base snapshot")
    return StoredBase(store, v, info)


def _sources(request: web.Request, kind: str, v: int, start: bool, stored: Callable[[], Served]) -> Iterator[Served]:
    """Who answers for file `kind` of version v: what is arriving (a relay's; `start`: a request
    that may start a base's fetch), then the store."""
    arriving = request.app[ARRIVING](kind, v, start)
    if arriving is not None:
        yield arriving
    yield stored()


async def delta(request: web.Request) -> web.StreamResponse:
    v = int(request.match_info["version"])
    for src in _sources(request, "delta", v, False, lambda: StoredDelta(request, v)):
        if (resp := await src.send(request)) is not None:
            return resp
    raise AssertionError("unreachable: the store, the last source, always answers")


async def pieces(request: web.Request) -> web.Response:
    """GET /v1/versions/V/pieces?after=I&wait=S: the complete pieces of a delta from the I-th on,
    waiting up to S seconds for more while it is being written (multi-stream cut-through)."""
    v = int(request.match_info["version"])
    after = _int_param(request, "after", 0)
    deadline = asyncio.get_running_loop().time() + _wait(request)
    for src in _sources(request, "delta", v, False, lambda: StoredDelta(request, v)):
        if (resp := await src.listing(request, after, deadline)) is not None:
            return resp
    raise AssertionError("unreachable: the store, the last source, always answers")


async def base_pieces(request: web.Request) -> web.Response:
    """GET /v1/versions/V/base/pieces?after=I&wait=S: the base's parts that can be read, from the
    I-th on: all of them where the file is here (the origin); at a relay still fetching it, the
    parts that have verified so far, in arrival order, waiting up to S seconds for more."""
    stored = _base(request)
    after = _int_param(request, "after", 0)
    deadline = asyncio.get_running_loop().time() + _wait(request)
    for src in _sources(request, "base", stored.v, request.method == "GET", lambda: stored):
        if (resp := await src.listing(request, after, deadline)) is not None:
            return resp
    raise AssertionError("unreachable: the store, the last source, always answers")


async def base(request: web.Request) -> web.StreamResponse:
    """The base snapshot. A relay that lists it but does not hold it fetches it once its parts
    are listed (`base_pieces`), and meanwhile sends only parts that have verified."""
    stored = _base(request)
    for src in _sources(request, "base", stored.v, False, lambda: stored):
        if (resp := await src.send(request)) is not None:
            return resp
    raise AssertionError("unreachable: the store, the last source, always answers")


def make_app(
    store: str | Path,
    token: str = "",
    arriving=lambda kind, v, start: None,
    max_body: int = 1 << 20,
    signer: Signer | None = None,
    trust: Verifier | None = None,
    written_here: bool = False,
) -> web.Application:
    """`token`: this server's own (see `tokens.Gate.of`; `trust` checks role tokens where it is
    not the job's secret). `signer`: the trainer's, which signs what this server lists.
    `arriving(kind, v, start)`: the `Served` for file `kind` ("delta" or "base") of version v
    while it is still arriving (a relay's mirror in flight; with `start`, a request that may
    start a base's fetch), else None: the store answers. `max_body`: the largest request body
    taken (413 beyond). `written_here`: the store is written by this process only (the trainer's,
    a relay's), which tells the server of each change; otherwise the server polls it."""
    app = web.Application(middlewares=[auth], client_max_size=max_body)
    app[ARRIVING] = arriving
    app[STORE], app[MANIFESTS], app[CACHE] = Path(store), {}, {}
    app[GATE], app[SIGNER] = Gate.of(token, trust), signer
    app[WATCH] = watch = Watch(Path(store), polled=not written_here)
    if written_here:
        undo = listen(store, watch.poke)

        async def tell_here(app: web.Application) -> None:
            watch.start(asyncio.get_running_loop())

        async def stop_telling(app: web.Application) -> None:
            undo()

        app.on_startup.append(tell_here)
        app.on_cleanup.append(stop_telling)
    app[STOPPING] = asyncio.Event()
    app[PIECES] = {}
    app[SENT] = {"delta": 0, "base": 0}

    async def stop_long_polls(app: web.Application) -> None:
        app[STOPPING].set()

    async def count(request: web.Request, response: web.StreamResponse) -> None:
        kind = request.path.rsplit("/", 1)[-1]
        if kind in app[SENT] and request.method == "GET" and response.status in (200, 206):
            app[SENT][kind] += response.content_length or 0

    app.on_shutdown.append(stop_long_polls)
    app.on_response_prepare.append(count)
    app.add_routes(
        [
            web.get("/v1/versions", versions),
            web.get("/v1/plan", plan),
            web.get(r"/v1/versions/{version:\d{1,12}}/manifest", manifest),
            web.get(r"/v1/versions/{version:\d{1,12}}/delta", delta),
            web.get(r"/v1/versions/{version:\d{1,12}}/pieces", pieces),
            web.get(r"/v1/versions/{version:\d{1,12}}/base/pieces", base_pieces),
            web.get(r"/v1/versions/{version:\d{1,12}}/base", base),
        ]
    )
    return app
