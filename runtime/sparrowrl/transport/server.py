"""`sparrowrl serve`: publish a checkpoint store over HTTP.

    GET /v1/versions[?after=N&wait=S]   versions (JSON); with `after`, waits up to S seconds
                                        for a version newer than N (long-poll, no tight loops);
                                        with `base=V`, for V's base snapshot (full sync)
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

Every endpoint wants `Authorization: Bearer $SPARROWRL_TOKEN` when a token is set.
Files are immutable and content-hashed, so responses carry strong ETags.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import math
import os
import ssl
from pathlib import Path
from typing import Callable

from aiohttp import hdrs, web

from sparrowrl.delta.errors import DeltaError
from sparrowrl.delta.frame import CHUNK, CHUNK_MAGIC, END, HEAD, TRAILER
from sparrowrl.limits import open_regular
from sparrowrl.store import BASE_PART, Store, StoreError

MAX_WAIT = 60.0
OPEN = frozenset({"/healthz", "/readyz"})  # probes (a kubelet's) carry no token, and these say nothing else
MAX_INDEX = 1 << 62  # versions, piece indexes: far beyond any store, small enough to stay exact
STORE = web.AppKey("store", Path)
TOKEN = web.AppKey("token", str)
MANIFESTS = web.AppKey("manifests", dict)
CACHE = web.AppKey("cache", dict)
STOPPING = web.AppKey("stopping", asyncio.Event)
PIECES = web.AppKey("pieces", dict)
OVERRIDE = web.AppKey("pieces_override", object)
BASE_OVERRIDE = web.AppKey("base_override", object)
SERVED = web.AppKey("served", dict)


def _store(request: web.Request) -> Store:
    """The store's index, re-read only when store.json changes (long-polls stat it often)."""
    path = request.app[STORE]
    try:
        mtime = (path / "store.json").stat().st_mtime_ns
        cached = request.app[CACHE]
        if cached.get("mtime") != mtime:
            cached.update(mtime=mtime, store=Store(path))
        return cached["store"]
    except (StoreError, OSError) as e:
        raise web.HTTPServiceUnavailable(text=f"store unavailable: {e}") from None


def _version(request: web.Request, store: Store) -> int:
    v = int(request.match_info["version"])  # the route's pattern admits digits only
    if v not in store.versions:
        raise web.HTTPNotFound(text=f"version {v} is not in the store")
    return v


@web.middleware
async def auth(request: web.Request, handler):
    token = request.app[TOKEN]
    if token and request.path not in OPEN:
        given = request.headers.get("Authorization", "")  # bytes that are not UTF-8 arrive surrogate-escaped
        if not hmac.compare_digest(given.encode(errors="surrogateescape"), f"Bearer {token}".encode()):
            raise web.HTTPUnauthorized(text="missing or wrong bearer token",
                                       headers={"WWW-Authenticate": 'Bearer realm="sparrowrl"'})
    return await handler(request)


def _listing(store: Store) -> dict:
    return {"newest": store.newest, "base_every": store.base_every, "producing": store.producing(), "versions": [
        {"version": v.version, "state_hash": v.state_hash, "changed": v.changed,
         "delta": {"bytes": v.delta_bytes, "sha256": v.delta_sha256} if v.delta else None,
         "base": {"bytes": v.base_bytes, "part_bytes": BASE_PART, "parts": v.base_parts} if v.base else None}
        for v in (store.versions[k] for k in sorted(store.versions))]}


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


def _over(request: web.Request) -> bool:
    """Whether a long-poll should stop waiting: the server is stopping, or its client has gone
    (aiohttp does not cancel a handler when its client disconnects)."""
    transport = request.transport
    return request.app[STOPPING].is_set() or transport is None or transport.is_closing()


async def versions(request: web.Request) -> web.Response:
    after, base = _int_param(request, "after"), _int_param(request, "base")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _wait(request)

    def waiting(store: Store) -> bool:  # with both, for both
        gone = base is not None and base not in store.versions and base <= store.newest \
            and base not in store.producing()  # pruned: its snapshot will never come
        return (after is not None and max([store.newest, *store.producing()]) <= after) or \
            (base is not None and not gone and not getattr(store.versions.get(base), "base", None))
    store = _store(request)
    while waiting(store) and loop.time() < deadline and not _over(request):
        await asyncio.sleep(0.05)
        store = _store(request)
    return web.json_response(_listing(store))


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
        cache[info.delta_sha256] = {"version": v, "bytes": len(d.data), "sha256": info.delta_sha256,
                                    "header": d.header, "manifest": d.manifest}
    return web.json_response(cache[info.delta_sha256])


def _file(store: Store, sub: str, name: str, etag: str) -> web.FileResponse:
    resp = web.FileResponse(store.path / sub / name, headers={"Cache-Control": "public, max-age=31536000, immutable"})
    resp.etag = etag
    return resp


async def delta(request: web.Request) -> web.StreamResponse:
    v = int(request.match_info["version"])
    table = request.app[OVERRIDE](v)
    if table is not None:  # a relay's delta in flight, written in arrival order: verified pieces only
        resp = await _verified(request, table, v, None)
        if resp is not None:
            return resp
    store = _store(request)
    if v not in store.versions and store.partial_path(v).exists():  # growing (in order): ranges of what is written
        return web.FileResponse(store.partial_path(v))
    v = _version(request, store)
    info = store.versions[v]
    if not info.delta:
        raise web.HTTPNotFound(text=f"version {v} has no delta")
    return _file(store, "deltas", info.delta, info.delta_sha256)


def _complete(fd: int, size: int) -> bool:
    """Whether `size` bytes of a delta end in a consistent trailer (the writer has finished)."""
    if size < TRAILER.size:
        return False
    offset, length, _, end = TRAILER.unpack(os.pread(fd, TRAILER.size, size - TRAILER.size))
    return end == END and offset + length + TRAILER.size == size


def _open_delta(store: Store, v: int) -> tuple[object, bool]:
    """The delta file of v, growing (being written) or finished; None if neither."""
    try:
        return open(store.partial_path(v), "rb"), True
    except FileNotFoundError:
        info = store.versions.get(v)
        if info is None or not info.delta:
            return None, False
        return open(store.path / "deltas" / info.delta, "rb"), False


def _scan(fd: int, size: int, cache: dict, key: tuple) -> dict:
    """The pieces of a (possibly growing) delta file that are complete: the header, each whole
    chunk, and once the file is complete the tail (manifest and trailer), each with the sha256
    of its bytes. Parsed incrementally; what was hashed once is kept in `cache`."""
    st = cache.setdefault(key, {"pieces": [], "next": None, "complete": False})
    if st["next"] is None and size >= HEAD.size:
        _, _, n = HEAD.unpack(os.pread(fd, HEAD.size, 0))
        end = HEAD.size + n + 32
        if size >= end:
            st["pieces"].append([0, end, hashlib.sha256(os.pread(fd, end, 0)).hexdigest()])
            st["next"] = end
    while st["next"] is not None and not st["complete"]:
        pos = st["next"]
        head = os.pread(fd, CHUNK.size, pos)
        if len(head) == CHUNK.size and head[:4] == CHUNK_MAGIC:
            end = pos + CHUNK.size + CHUNK.unpack(head)[2]
            if end > size:
                break
            st["pieces"].append([pos, end - pos, hashlib.sha256(os.pread(fd, end - pos, pos)).hexdigest()])
            st["next"] = end
        elif _complete(fd, size):
            st["pieces"].append([pos, size - pos, hashlib.sha256(os.pread(fd, size - pos, pos)).hexdigest()])
            st["complete"], st["bytes"] = True, size
        else:
            break
    return st


async def _await_table(request: web.Request, table, after: int, deadline: float, live) -> None:
    """Wait until a relay's in-flight list has pieces beyond `after`, stops being `live()`, or
    `deadline` passes."""
    loop = asyncio.get_running_loop()
    while len(table.pieces) <= after and live() and loop.time() < deadline and not _over(request):
        try:
            await asyncio.wait_for(table.changed.wait(), min(1.0, deadline - loop.time()))  # 1 s: see _over
        except TimeoutError:
            pass


def _table_json(table, after: int) -> web.Response:
    return web.json_response({"pieces": table.pieces[after:], "complete": False, "bytes": None, "epoch": table.epoch})


async def pieces(request: web.Request) -> web.Response:
    """GET /v1/versions/V/pieces?after=I&wait=S: the complete pieces of a delta from the I-th on,
    waiting up to S seconds for more while it is being written (multi-stream cut-through)."""
    v = int(request.match_info["version"])
    after = _int_param(request, "after", 0)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _wait(request)
    table = request.app[OVERRIDE](v)
    if table is not None:  # a relay's delta in flight: its verified pieces, in arrival order
        await _await_table(request, table, after, deadline, lambda: request.app[OVERRIDE](v) is table)
        if len(table.pieces) > after or request.app[OVERRIDE](v) is not None:
            return _table_json(table, after)
    f, growing = _open_delta(_store(request), v)
    if f is None:
        raise web.HTTPNotFound(text=f"version {v} is neither stored nor being written")
    with f:
        key = (v, os.fstat(f.fileno()).st_ino)
        while True:
            st = _scan(f.fileno(), os.fstat(f.fileno()).st_size, request.app[PIECES], key)
            if len(st["pieces"]) > after or st["complete"] or loop.time() >= deadline or _over(request):
                break
            await asyncio.sleep(0.01)
    return web.json_response({"pieces": st["pieces"][after:], "complete": st["complete"],
                              "bytes": st.get("bytes"), "epoch": "file"})


def _base_info(request: web.Request):
    store = _store(request)
    v = _version(request, store)
    info = store.versions[v]
    if not info.base:
        raise web.HTTPNotFound(text=f"version {v} has no base snapshot")
    return store, v, info


def _failed(table, v: int) -> None:
    """A relay's base fetch that gave up: the client should try another server."""
    if table.error:
        raise web.HTTPServiceUnavailable(text=f"relay could not fetch base v{v}: {table.error}")


def _here(store: Store, v: int, info) -> None:
    """A base that a relay lists but neither holds nor is fetching (listing its parts starts
    the fetch): not a 404, which would say it does not exist."""
    if not (store.path / "bases" / info.base).exists():
        raise web.HTTPServiceUnavailable(headers={"Retry-After": "1"}, text=(
            f"base v{v} is not at this relay yet (/v1/versions/{v}/base/pieces fetches it)"))


async def base_pieces(request: web.Request) -> web.Response:
    """GET /v1/versions/V/base/pieces?after=I&wait=S: the base's parts that can be read, from the
    I-th on: all of them where the file is here (the origin); at a relay still fetching it, the
    parts that have verified so far, in arrival order, waiting up to S seconds for more."""
    store, v, info = _base_info(request)
    after = _int_param(request, "after", 0)
    wait = _wait(request)
    table = request.app[BASE_OVERRIDE](v, request.method == "GET")
    if table is not None:
        await _await_table(request, table, after, asyncio.get_running_loop().time() + wait, lambda: not table.closed)
        _failed(table, v)
        if len(table.pieces) > after or not table.closed:
            return _table_json(table, after)
    _here(store, v, info)
    return web.json_response({"pieces": [[i * BASE_PART, min(BASE_PART, info.base_bytes - i * BASE_PART), h]
                                         for i, h in enumerate(info.base_parts)][after:],
                              "complete": True, "bytes": info.base_bytes, "epoch": "file"})


def _covered(pieces: list[list], start: int, stop: int) -> bool:
    """Whether pieces ([offset, length, sha256], any order) cover bytes start..stop-1."""
    for offset, length, _ in sorted(pieces):
        if offset > start:
            return False
        start = max(start, offset + length)
        if start >= stop:
            return True
    return start >= stop


async def _verified(request: web.Request, table, v: int, size: int | None) -> web.StreamResponse | None:
    """Bytes of a file that a relay is still fetching (a base, or a delta of unknown `size`):
    only pieces that have verified, answered at once (503 for a range not yet in, never a wait
    past a client's read timeout), read from a descriptor opened here so that the fetch may
    finish meanwhile; ranges as the origin answers them. None once the fetch has finished: the
    stored file answers. A client that listed its pieces elsewhere (the origin, before falling
    back here) may ask for any range: it gets no byte that has not verified."""
    what, listing = ("delta", "pieces") if size is None else ("base", "base/pieces")
    total = "*" if size is None else size
    try:
        r = request.http_range
    except ValueError:
        raise web.HTTPRequestRangeNotSatisfiable(headers={"Content-Range": f"bytes */{total}"}) from None
    if size is None and (r.start is None or r.start < 0 or r.stop is None):
        raise web.HTTPServiceUnavailable(headers={"Retry-After": "1"}, text=(
            f"delta v{v} is still reaching this relay: its size is not known yet, so ask for a range "
            f"with both ends (/v1/versions/{v}/pieces lists those that are here)"))
    start = 0 if r.start is None else max(0, size + r.start) if r.start < 0 else r.start
    stop = r.stop if size is None else size if r.stop is None else min(r.stop, size)
    if start >= stop:
        raise web.HTTPRequestRangeNotSatisfiable(headers={"Content-Range": f"bytes */{total}"})
    if not _covered(table.pieces, start, stop):
        raise web.HTTPServiceUnavailable(headers={"Retry-After": "1"}, text=(
            f"{what} v{v}: bytes {start}-{stop - 1} have not reached this relay yet "
            f"(/v1/versions/{v}/{listing} lists the pieces that have)"))
    try:
        f = open(table.path, "rb")
    except FileNotFoundError:
        _failed(table, v)
        return None
    with f:
        ranged = hdrs.RANGE in request.headers
        resp = web.StreamResponse(status=206 if ranged else 200, headers={
            hdrs.ACCEPT_RANGES: "bytes", hdrs.CONTENT_TYPE: "application/octet-stream",
            **({hdrs.CONTENT_RANGE: f"bytes {start}-{stop - 1}/{total}"} if ranged else {})})
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


async def base(request: web.Request) -> web.StreamResponse:
    """The base snapshot. A relay that lists it but does not hold it fetches it once its parts
    are listed (`base_pieces`), and meanwhile sends only parts that have verified."""
    store, v, info = _base_info(request)
    table = request.app[BASE_OVERRIDE](v, False)
    if table is not None:
        _failed(table, v)
        resp = await _verified(request, table, v, info.base_bytes)
        if resp is not None:
            return resp
    _here(store, v, info)
    return _file(store, "bases", info.base, f"base-{info.state_hash}")


def make_app(store: str | Path, token: str = "", pieces_override=lambda v: None,
             base_override=lambda v, start: None, max_body: int = 1 << 20) -> web.Application:
    """`pieces_override(v)`: a relay's live piece table for a delta it is still mirroring;
    `base_override(v, start)`: a relay's piece table for a base snapshot it is fetching (with
    `start`, started by this call where it lists the base but does not hold it), None where
    the file is here. `max_body`: the largest request body taken (413 beyond)."""
    app = web.Application(middlewares=[auth], client_max_size=max_body)
    app[OVERRIDE], app[BASE_OVERRIDE] = pieces_override, base_override
    app[STORE], app[TOKEN], app[MANIFESTS], app[CACHE] = Path(store), token, {}, {}
    app[STOPPING] = asyncio.Event()
    app[PIECES] = {}
    app[SERVED] = {"delta": 0, "base": 0}

    async def stop_long_polls(app: web.Application) -> None:
        app[STOPPING].set()

    async def count(request: web.Request, response: web.StreamResponse) -> None:
        kind = request.path.rsplit("/", 1)[-1]
        if kind in app[SERVED] and request.method == "GET" and response.status in (200, 206):
            app[SERVED][kind] += response.content_length or 0

    app.on_shutdown.append(stop_long_polls)
    app.on_response_prepare.append(count)
    app.add_routes([
        web.get("/v1/versions", versions),
        web.get("/v1/plan", plan),
        web.get(r"/v1/versions/{version:\d{1,12}}/manifest", manifest),
        web.get(r"/v1/versions/{version:\d{1,12}}/delta", delta),
        web.get(r"/v1/versions/{version:\d{1,12}}/pieces", pieces),
        web.get(r"/v1/versions/{version:\d{1,12}}/base/pieces", base_pieces),
        web.get(r"/v1/versions/{version:\d{1,12}}/base", base),
    ])
    return app


class ListenError(Exception):
    """The address cannot be bound (in use, not this host's, a privileged port)."""

    @classmethod
    def of(cls, host: str, port: int, e: OSError) -> "ListenError":
        # asyncio's message repeats the address; the errno says why
        return cls(f"cannot listen on {host}:{port}: {os.strerror(e.errno) if (e.errno or 0) > 0 else e.strerror}")


async def listen(runner: web.AppRunner, host: str, port: int) -> None:
    """Start `runner` on host:port; ListenError in one line if that address cannot be had."""
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as e:
        raise ListenError.of(host, port, e) from None


def add_health(app: web.Application, ready: Callable[[], bool]) -> None:
    """/healthz: the process serves; /readyz: it does its job (`ready()`), 503 until then."""
    async def healthz(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def readyz(_request: web.Request) -> web.Response:
        return web.Response(text="ready") if ready() else web.Response(status=503, text="not ready")

    app.add_routes([web.get("/healthz", healthz), web.get("/readyz", readyz)])


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def tls_context(cert: Path | None, key: Path | None) -> ssl.SSLContext | None:
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise ValueError("TLS needs both --tls-cert and --tls-key")
    for flag, path in (("--tls-cert", cert), ("--tls-key", key)):  # ssl's own error does not say which
        try:
            open_regular(path, "a PEM file").close()
        except ValueError as e:
            raise ValueError(f"{flag} {e}") from None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(cert, key)
    except ssl.SSLError as e:
        raise ValueError(f"--tls-cert {cert} and --tls-key {key} are not a PEM certificate and its private key "
                         f"({e})") from None
    return ctx
