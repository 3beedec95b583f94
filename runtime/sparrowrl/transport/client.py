"""Pull versions from a server or relay: parallel Range streams, every piece verified, resumed.

A version is reached by the server's plan (replay deltas from what the caller holds, or fetch
the nearest base). Every download is a list of pieces with known sha256 (a delta's header,
chunks and tail; a base's parts). N workers take pieces from a shared queue, group neighbours
into one Range request, verify each piece as it lands and put failed ones back: a dropped
connection loses at most the request in flight, a corrupt piece is refetched, a dead server is
retried with backoff and then the next URL (another relay, or the origin) is tried. After
`attempts` failures of one request or one piece it gives up with FetchError; nothing the caller
holds has been touched.

A client that trusts the trainer's key (signing.py) checks every listed delta piece and every
listed base before it asks for a byte of it. A server whose answer does not verify (a forged
list, bytes that do not match their signed digest, a malformed answer) is refused: the client
says so (log, `Stats.refused`), leaves it for REFUSED_S and goes on with the next server, in
the end the origin.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import os
import random
import secrets
import socket
import ssl
import time
from dataclasses import dataclass, field
from typing import Annotated, Literal

import aiohttp
import torch
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, model_validator

from sparrowrl.auth.signing import Verifier, base_statement, piece_statement, table_statement
from sparrowrl.auth.signing import trust as trust_of
from sparrowrl.delta import DeltaError, DeltaFile, apply_delta, state_hash
from sparrowrl.spec.limits import first_problem, memory_available
from sparrowrl.store.checkpoint_io import CheckpointError, tensors_in
from sparrowrl.store.store import BASE_PART, MAX_BASE_EVERY, MIN_BASE_PART

PREFERRED_AGAIN_S = 10.0  # after falling back, how long before the first server is tried again
REFUSED_S = 300.0  # how long a server whose answer did not verify is left alone
BUSY_WAIT_S = 60.0  # how long one request waits on a server that says when to ask again (a relay still
# syncing: its workers would otherwise pull a whole base each across the WAN from the origin)
PORT_WAIT_S = 60.0  # how long one request waits for its stream's fixed local port to be free (TIME_WAIT's length)
READ_BUFFER = 4 << 20  # bytes a response may buffer before its socket is paused (aiohttp's 64 KiB paused it
# after every read at LAN speed)
MAX_BYTES = 1 << 40  # the largest file (base snapshot or delta) a server may list
MAX_ITEMS = 1 << 24  # versions, parts or pieces in one listing
Bytes = Annotated[int, Field(ge=0, le=MAX_BYTES)]
Index = Annotated[int, Field(ge=0, le=1 << 62)]
PieceBytes = Annotated[int, Field(ge=1, le=1 << 30)]  # a piece is held in memory whole
Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
Sig = Annotated[str, StringConstraints(pattern=r"^([A-Za-z0-9_-]{86})?$")]  # "": unsigned


class FetchError(Exception):
    """A version could not be fetched within the retry bounds; nothing was changed."""


class _Transient(Exception):
    """A failed answer worth retrying (5xx, 404 from a lagging relay, an unreadable body)."""


class _Refused(Exception):
    """An answer that does not verify or does not parse: that server is not to be asked again soon."""


class _Busy(Exception):
    """A 503 with Retry-After: the server is up and says when to ask again; not a failure."""

    def __init__(self, after: float, text: str):
        super().__init__(text)
        self.after = after


def _retry_after(value: str | None) -> float | None:
    """Retry-After in seconds (the HTTP-date form is not used here), held to 0.1..5 s."""
    try:
        return min(5.0, max(0.1, float(value))) if value is not None and value.isdigit() else None
    except ValueError:
        return None


class _Answer(BaseModel):
    """A server's listing, checked before its numbers size a buffer or a loop here."""

    model_config = ConfigDict(strict=True)


class _Base(_Answer):
    bytes: Bytes
    part_bytes: Annotated[int, Field(ge=MIN_BASE_PART, le=BASE_PART)]  # a relay indexes these parts as its own
    parts: Annotated[list[Sha256], Field(max_length=MAX_ITEMS)]
    sig: Sig = ""

    @model_validator(mode="after")
    def _cover(self) -> "_Base":
        if self.part_bytes & (self.part_bytes - 1):
            raise ValueError(f"part_bytes {self.part_bytes} is not a power of two")
        if len(self.parts) != -(-self.bytes // self.part_bytes):
            raise ValueError(f"{len(self.parts)} parts of {self.part_bytes} bytes do not make {self.bytes} bytes")
        return self


class _Delta(_Answer):
    bytes: Bytes
    sha256: Sha256


class _Entry(_Answer):
    version: Index
    state_hash: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{16}$")]
    changed: Index
    delta: _Delta | None
    base: _Base | None


class _Listing(_Answer):
    """GET /v1/versions"""

    newest: Index
    base_every: Annotated[int, Field(ge=1, le=MAX_BASE_EVERY)]
    producing: Annotated[list[Index], Field(max_length=MAX_ITEMS)]
    versions: Annotated[list[_Entry], Field(max_length=MAX_ITEMS)]


class _Plan(_Answer):
    """GET /v1/plan"""

    route: Literal["none", "chain", "base"]
    base: Index | None
    deltas: Annotated[list[Index], Field(max_length=MAX_ITEMS)]


class _Pieces(_Answer):
    """GET /v1/versions/V/pieces and /v1/versions/V/base/pieces"""

    pieces: Annotated[list[tuple[Bytes, PieceBytes, Sha256, bool, Sig]], Field(max_length=MAX_ITEMS)]
    complete: bool
    bytes: Bytes | None
    epoch: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    table_sig: Sig = ""  # with a complete list from its start: the trainer's signature of all of it

    @model_validator(mode="after")
    def _within(self) -> "_Pieces":
        if self.complete and self.bytes is None:
            raise ValueError("complete, but without its size")
        size = MAX_BYTES if self.bytes is None else self.bytes
        for i, (offset, length, *_) in enumerate(self.pieces):
            if offset + length > size:
                raise ValueError(f"pieces.{i}: bytes {offset}+{length} end past the file's {size}")
        return self


async def _leads(plan: dict, have: tuple | None, target: int) -> None:
    """A plan leads from what the caller holds to `target`, one delta after another: the signed
    versions it names then decide the result, and a server cannot pass off another version."""
    route, base, deltas = plan["route"], plan["base"], plan["deltas"]
    if route != "base" and have is None:
        raise _Refused(f"route {route!r} to v{target} for a client that holds nothing")
    start = {"none": target, "chain": have[0] if have else None, "base": base}[route]
    if start is None or start > target or len(deltas) != target - start or deltas != list(range(start + 1, target + 1)):
        raise _Refused(
            f"route {route!r} (base {base}, {len(deltas)} deltas) does not lead from "
            f"{'nothing' if have is None else f'v{have[0]}'} to v{target}"
        )


@dataclass(frozen=True)
class Piece:
    offset: int
    length: int
    sha256: str
    final: bool = False  # it ends the file
    sig: str = ""  # the trainer's signature of all the above, for this version

    def entry(self) -> list:
        return [self.offset, self.length, self.sha256, self.final, self.sig]


@dataclass
class Stats:
    bytes: int = 0  # verified bytes received
    kinds: dict[str, int] = field(default_factory=lambda: {"delta": 0, "base": 0})  # bytes by what they were
    sources: dict[tuple[str, str, int], int] = field(default_factory=dict)  # (kind, server URL, stream) → bytes
    requests: int = 0
    retries: int = 0
    refetched: int = 0  # pieces that failed their checksum
    refused: dict[str, int] = field(default_factory=dict)  # server URL → answers that did not verify
    port_waits: int = 0  # times a stream found its fixed local port taken, and waited
    seconds: float = 0.0

    def count(self, kind: str, server: str, stream: int, n: int) -> None:
        self.bytes += n
        self.kinds[kind] = self.kinds.get(kind, 0) + n
        self.sources[kind, server, stream] = self.sources.get((kind, server, stream), 0) + n


class _Queue:
    """The pieces a download still needs, in file order, shared by its streams: each takes a
    run of neighbouring pieces, about an equal share of what is known (at most `group_bytes`),
    for one Range request. Pieces are added as the server lists them (cut-through) and again
    when a stream fails them; `take` waits for more until the listing has ended."""

    def __init__(self, streams: int, group_bytes: int):
        self.streams, self.group_bytes = max(1, streams), group_bytes
        self.pieces: list[Piece] = []
        self.failures: dict[Piece, int] = {}
        self.more = asyncio.Condition()
        self.done = False  # the listing has ended

    async def add(self, pieces: list[Piece]) -> None:
        async with self.more:
            self.pieces = sorted(self.pieces + pieces, key=lambda x: x.offset)
            self.more.notify_all()

    async def listed(self) -> None:
        async with self.more:
            self.done = True
            self.more.notify_all()

    def failed(self, p: Piece) -> int:
        """Count a failed checksum of `p`; how many it has had."""
        self.failures[p] = self.failures.get(p, 0) + 1
        return self.failures[p]

    async def take(self) -> list[Piece] | None:
        """The next run of neighbouring pieces; None once the listing has ended and none are left."""
        async with self.more:
            await self.more.wait_for(lambda: self.pieces or self.done)
            if not self.pieces:
                return None
            share = max(1, min(self.group_bytes, -(-sum(p.length for p in self.pieces) // self.streams)))
            run = [self.pieces.pop(0)]
            while (
                self.pieces
                and self.pieces[0].offset == run[-1].offset + run[-1].length
                and sum(p.length for p in run) + self.pieces[0].length <= share
            ):
                run.append(self.pieces.pop(0))
            return run


async def _sha256(data) -> str:
    """A piece's digest, off the event loop: hashlib releases the GIL, so the streams' reads go
    on while pieces are hashed (on the loop, hashing took 42% of a 4-stream pull)."""
    return await asyncio.to_thread(lambda: hashlib.sha256(data).hexdigest())


async def _read_into(content: aiohttp.StreamReader, view: memoryview) -> None:
    """Fill `view` from a response body: each chunk as the socket delivered it, copied once into
    place (readexactly joined the chunks into a new bytes object, which was then copied again)."""
    got, n = 0, len(view)
    while got < n:
        chunk = await content.read(n - got)
        if not chunk:
            raise asyncio.IncompleteReadError(b"", n)
        view[got : got + len(chunk)] = chunk
        got += len(chunk)


async def _skip(content: aiohttp.StreamReader, n: int) -> None:
    while n > 0:
        chunk = await content.read(min(n, 1 << 20))
        if not chunk:
            raise asyncio.IncompleteReadError(b"", n)
        n -= len(chunk)


def _reusable(addr_info) -> socket.socket:
    """A socket that may bind a fixed local port whose last connection is still in TIME_WAIT:
    otherwise one dropped connection makes its stream's port unusable for a minute."""
    family, type_, proto, _, _ = addr_info
    sock = socket.socket(family, type_, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return sock


class Client:
    """A connection pool over an ordered list of equivalent servers (relays first, origin last)."""

    def __init__(
        self,
        urls: list[str] | str,
        token: str | None = None,
        streams: int = 4,
        attempts: int = 8,
        backoff: float = 0.2,
        group_bytes: int = 64 << 20,
        ssl_context: ssl.SSLContext | None = None,
        read_timeout: float = 30.0,
        local_ports: list[int] | None = None,
        rate_mbit: float | None = None,
        port_wait: float = PORT_WAIT_S,
        trust: Verifier | None | str = "env",
    ):
        """`local_ports`: bind download stream i to local port local_ports[i] (one connection each),
        for networks that shape per flow (hack/wan classifies flows by port). A stream whose port
        is taken (another process's connection, or its own not yet closed) waits for it, up to
        `port_wait` seconds per request, without counting that as failed attempts. `rate_mbit`:
        cap the download rate of all streams together (a token bucket), to emulate a slow link.
        `trust`: whose signatures versions must carry; by default `signing.trust` of the token
        (ValueError for a role token without SPARROWRL_TRAINER_KEY)."""
        self.urls = [u.rstrip("/") for u in ([urls] if isinstance(urls, str) else urls)]
        token = os.environ.get("SPARROWRL_TOKEN", "") if token is None else token
        self.trust = trust_of(token) if trust == "env" else trust
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.streams, self.attempts, self.backoff, self.group_bytes = streams, attempts, backoff, group_bytes
        self.ssl = ssl_context
        self.timeout = aiohttp.ClientTimeout(total=None, connect=10, sock_read=read_timeout)
        self.stats = Stats()
        self.local_ports, self.port_wait = local_ports, port_wait
        self.rate = rate_mbit * 1e6 / 8 if rate_mbit else None  # bytes per second
        self._bucket, self._filled = 0.0, time.perf_counter()
        self._session: aiohttp.ClientSession | None = None
        self._stream_sessions: list[aiohttp.ClientSession] = []
        self._server = 0  # index into urls of the server in use
        self._fell_back_at = 0.0
        self._refused: dict[int, float] = {}  # server → until when it is not asked (time.monotonic)

    def _new_session(self, **connector_kw) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(
            headers=self.headers,
            timeout=self.timeout,
            read_bufsize=READ_BUFFER,
            connector=aiohttp.TCPConnector(ssl=self.ssl, **connector_kw),
        )

    async def __aenter__(self) -> "Client":
        self._session = self._new_session(limit=0)
        self._stream_sessions = [
            self._new_session(limit=1, local_addr=("0.0.0.0", p), socket_factory=_reusable)
            for p in self.local_ports or []
        ]
        return self

    async def __aexit__(self, *exc) -> None:
        for s in [self._session, *self._stream_sessions]:
            await s.close()

    async def _throttle(self, n: int) -> None:
        """Take n bytes from the bucket (refilled at `rate`, holding at most 0.1 s of it), waiting
        as long as the link would have taken: unread bytes back-pressure the sender via TCP."""
        if self.rate is None:
            return
        now = time.perf_counter()
        self._bucket = min(self.rate * 0.1, self._bucket + (now - self._filled) * self.rate) - n
        self._filled = now
        if self._bucket < 0:
            await asyncio.sleep(-self._bucket / self.rate)

    async def _attempts(self, path: str, request, port: int | None = None):
        """Run `request(url)` until it succeeds: backoff on the current server, every second
        failure the next one; FetchError after `attempts` failures or on a permanent answer. A
        request from fixed local `port` that finds it taken waits for it (`port_wait`), on the
        same server: the port is what failed, not the server."""
        last, busy, taken = "no attempt", 0.0, 0.0
        if self._server and time.monotonic() - self._fell_back_at > PREFERRED_AGAIN_S:
            self._server = self._next(-1)  # the preferred server (a region's relay) may be back: try it first again
        attempt = 0
        while attempt < self.attempts:
            server = self._server
            url = self.urls[server] + path
            try:
                self.stats.requests += 1
                return await request(url)
            except _Refused as e:
                self._refuse(server, f"{url}: {e}")
                continue
            except _Busy as e:  # asked to come back: waited for, BUSY_WAIT_S at most, then a failure
                last = f"HTTP 503: {e}"
                if busy < BUSY_WAIT_S:
                    busy += e.after
                    await asyncio.sleep(e.after)
                    continue
            except aiohttp.ClientConnectorCertificateError as e:
                raise FetchError(f"{url}: certificate not trusted ({e.certificate_error})") from None
            except aiohttp.ClientConnectorError as e:
                if port is None or e.os_error.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
                    last = f"{type(e).__name__}: {e}"
                elif taken < self.port_wait:
                    self.stats.port_waits += 1
                    pause = min(1.0, max(0.05, taken), self.port_wait - taken)  # doubling, 1 s at most
                    taken += pause
                    await asyncio.sleep(pause)
                    continue
                else:
                    raise FetchError(
                        f"{path}: local port {port} stayed taken for {self.port_wait:.0f} s "
                        f"({e.os_error.strerror}): another process holds it; give the streams "
                        f"other --local-ports"
                    ) from None
            except (
                aiohttp.ClientError,
                asyncio.TimeoutError,
                asyncio.IncompleteReadError,
                ConnectionError,
                _Transient,
            ) as e:
                last = f"{type(e).__name__}: {e}"
            self.stats.retries += 1
            if attempt % 2 == 1 and len(self.urls) > 1 and self._server == server:  # not if another request just did
                self._server = self._next(server)
                self._fell_back_at = time.monotonic()
            await asyncio.sleep(self.backoff * 2 ** min(attempt, 5) * (0.5 + random.random()))
            attempt += 1
        raise FetchError(f"{path}: gave up after {self.attempts} attempts (last: {last})")

    def _next(self, server: int) -> int:
        """The first server after `server` (in turn) that is not refused; `server` if none is."""
        now = time.monotonic()
        for i in range(server + 1, server + 1 + len(self.urls)):
            if self._refused.get(i % len(self.urls), 0.0) <= now:
                return i % len(self.urls)
        return server % len(self.urls)

    def _refuse(self, server: int, reason: str) -> None:
        """A server answered with what does not verify: report it, and go on without it for
        REFUSED_S; FetchError when no other server is left."""
        url = self.urls[server]
        self.stats.refused[url] = self.stats.refused.get(url, 0) + 1
        self._refused[server] = time.monotonic() + REFUSED_S
        if (nxt := self._next(server)) == server:
            raise FetchError(f"{reason}; no other server to try")
        print(f"sparrowrl: refused {reason}; going on with {self.urls[nxt]}", flush=True)
        if self._server == server:
            self._server, self._fell_back_at = nxt, time.monotonic()

    @staticmethod
    async def _check(r: aiohttp.ClientResponse, url: str) -> None:
        if r.status == 401:
            raise FetchError(f"{url}: 401 unauthorized (is SPARROWRL_TOKEN set?)")
        if r.status in (200, 206):
            return
        text = (await r.text())[:200]
        if r.status == 503 and (after := _retry_after(r.headers.get("Retry-After"))) is not None:
            raise _Busy(after, text)
        if r.status < 500 and r.status != 404:  # 404 is transient: a relay may lag behind
            raise FetchError(f"{url}: HTTP {r.status}: {text}")
        raise _Transient(f"HTTP {r.status}: {text}")

    async def json(self, path: str, model: type[BaseModel] | None = None, check=None, **kw) -> dict:
        """The JSON answer at `path` (an unreadable body is retried). With `model`, checked
        against it first: an answer with a field out of type or bounds refuses its server (see
        `_refuse`). Then `await check(doc)`, which raises _Refused for what does not verify."""

        async def request(url: str):
            async with self._session.get(url, **kw) as r:
                await self._check(r, url)
                raw = await r.read()
            try:
                doc = json.loads(raw)
            except ValueError as e:
                raise _Transient(f"unreadable response: {e}") from None
            if model is not None:
                try:
                    model.model_validate_json(raw)
                except ValidationError as e:
                    raise _Refused(first_problem(e)) from None
            if check is not None:
                await check(doc)
            return doc

        return await self._attempts(path, request)

    async def content(self, path: str, limit: int) -> bytes:
        """The body at `path`, at most `limit` bytes (FetchError beyond: the server is not trusted
        to end it)."""

        async def request(url: str) -> bytes:
            async with self._session.get(url) as r:
                await self._check(r, url)
                data = bytearray()
                while block := await r.content.read(1 << 16):
                    data += block
                    if len(data) > limit:
                        raise FetchError(f"{url}: more than {limit:,} bytes")
                return bytes(data)

        return await self._attempts(path, request)

    async def post_json(self, path: str, body: dict) -> dict:
        """POST a JSON body, with the same retries and fallback as a GET. An answer lost on the way
        back means the body is sent again, with the same `Idempotency-Key`, so that the server can
        answer the retry with its first answer instead of acting twice."""
        headers = {"Idempotency-Key": secrets.token_hex(16)}

        async def request(url: str):
            async with self._session.post(url, json=body, headers=headers) as r:
                await self._check(r, url)
                try:
                    return await r.json()
                except ValueError as e:
                    raise _Transient(f"unreadable response: {e}") from None

        return await self._attempts(path, request)

    async def versions(
        self, after: int | None = None, wait: float = 0.0, base: int | None = None, delta: int | None = None
    ) -> dict:
        """The version list; with `after`, returns once a newer version exists or `wait` passes;
        with `base`, once that version's base snapshot is listed; with `delta`, once that version
        is stored (its delta hashed and indexed)."""
        params = {k: x for k, x in (("after", after), ("base", base), ("delta", delta)) if x is not None}
        if not params:
            return await self.json("/v1/versions", _Listing, check=self._bases_signed)
        # the server may hold the answer for `wait` seconds: that is not a stalled read
        timeout = aiohttp.ClientTimeout(total=None, connect=10, sock_read=self.timeout.sock_read + wait)
        return await self.json(
            "/v1/versions", _Listing, check=self._bases_signed, params={**params, "wait": wait}, timeout=timeout
        )

    async def _bases_signed(self, listing: dict) -> None:
        """Every base a listing offers carries the trainer's signature of its parts and state hash."""
        if self.trust is None:
            return
        bases = [(e["version"], e["state_hash"], e["base"]) for e in listing["versions"] if e["base"]]

        def bad() -> str | None:
            for v, h, b in bases:
                sig = b.get("sig", "")
                if not self.trust.ok(base_statement(v, h, b["bytes"], b["part_bytes"], b["parts"]), sig):
                    return f"base v{v}: " + ("unsigned" if not sig else "its signature is not the trainer's")
            return None

        if why := await asyncio.to_thread(bad):
            raise _Refused(why)

    async def download(self, path: str, size: int, pieces: list[Piece]) -> bytearray:
        """The file at `path` (`size` bytes), fetched as verified pieces over parallel streams."""
        buf = bytearray(size)
        view = memoryview(buf)

        async def source():
            yield pieces

        await self._pull(path, source(), lambda p: view[p.offset : p.offset + p.length], lambda p, data: None)
        return buf

    async def _pull(self, path: str, source, place, keep) -> None:
        """Fetch the pieces that `source` (an async iterator of lists) names, as they are named,
        over parallel streams (see `_Queue`). Each piece is read into `place(piece)`, a writable
        buffer of its length (its spot in the caller's file, so that it is copied only once), and
        once it has verified, `keep(piece, that buffer)` receives it."""
        queue, kind, t0 = _Queue(self.streams, self.group_bytes), path.rsplit("/", 1)[-1], time.perf_counter()

        async def lister() -> None:
            try:
                async for batch in source:
                    await queue.add(batch)
            finally:
                await queue.listed()

        tasks = [asyncio.create_task(lister())] + [
            asyncio.create_task(self._stream(i, path, kind, queue, place, keep)) for i in range(max(1, self.streams))
        ]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
        self.stats.seconds += time.perf_counter() - t0

    async def _stream(self, i: int, path: str, kind: str, queue: _Queue, place, keep) -> None:
        """Download stream i: takes runs of neighbouring pieces from `queue` and asks for each
        run in one Range request, verifying piece by piece as they arrive, so a dropped
        connection costs only the piece in flight; the rest go back to the queue. A piece that
        fails its checksum goes back too, `attempts` times at most."""
        session = self._stream_sessions[i % len(self._stream_sessions)] if self._stream_sessions else self._session
        port = self.local_ports[i % len(self.local_ports)] if self.local_ports else None
        while (run := await queue.take()) is not None:

            async def request(url: str) -> None:
                if not run:  # its last piece was refused, and went back to the queue
                    return
                start, end = run[0].offset, run[-1].offset + run[-1].length
                async with session.get(url, headers={"Range": f"bytes={start}-{end - 1}"}) as r:
                    await self._check(r, url)
                    if r.status == 200:  # a server that ignores Range sends the whole file
                        await _skip(r.content, start)
                    while run:
                        p = run[0]
                        data = place(p)
                        await _read_into(r.content, data)
                        await self._throttle(p.length)
                        run.pop(0)
                        if await _sha256(data) == p.sha256:
                            keep(p, data)
                            self.stats.count(kind, url[: len(url) - len(path)], i, p.length)
                            continue
                        self.stats.refetched += 1
                        if queue.failed(p) >= self.attempts:
                            raise FetchError(
                                f"{path}: bytes {p.offset}+{p.length} failed their checksum {self.attempts} times"
                            )
                        await queue.add([p])  # asked for again later, maybe from another server
                        at = self.urls.index(url[: len(url) - len(path)])
                        if self.trust is not None and at < len(self.urls) - 1 and self._next(at) != at:
                            # a relay's bytes that fail a digest the trainer signed: altered (or damaged),
                            # and another server has them right. The origin's (last) are fetched again
                            raise _Refused(f"bytes {p.offset}+{p.length} do not match the trainer's sha256")

            try:
                await self._attempts(path, request, port)
            except FetchError:
                await queue.add(run)
                raise

    async def _listed(self, path: str, done: dict, version: int | None = None, expect: dict[int, Piece] | None = None):
        """The pieces that `path` (a pieces endpoint) lists as ready, batch by batch, each once,
        until it says the file is complete; `done["bytes"]` is then the file's size. Long-polls
        while the file grows. A list in another order (another server, or a relay's list in
        arrival order giving way to file order) is read anew from its start. With `version`
        (a delta's) and `trust`, each piece must carry the trainer's signature, and a complete
        list must cover the file up to its signed end (`_signed`). With `expect` (a base's parts,
        as its signed listing gives them), the list may name those only, and all of them once
        complete."""
        after, epoch, listed = 0, None, set()
        covered: dict[int, tuple[int, bool]] = {}  # offset → (length, final) of the pieces listed so far

        async def check(t: dict) -> None:
            if expect is not None:
                if any(expect.get(p[0]) != Piece(p[0], p[1], p[2], p[3]) for p in t["pieces"]):
                    raise _Refused(f"{path}: parts that the version listing does not list")
                if (
                    t["complete"]
                    and (t["epoch"] == epoch or after == 0)
                    and len({*listed, *(p[0] for p in t["pieces"])}) != len(expect)
                ):  # (another order: read anew)
                    raise _Refused(f"{path}: complete without every part the version listing lists")
            if version is not None and self.trust is not None:  # a list in another order is read anew below
                whole = t["epoch"] == epoch or after == 0
                if len(t["pieces"]) > 2 and not t.get("table_sig"):  # a thread's hop costs about one check
                    await asyncio.to_thread(self._signed, version, t, covered, whole)
                else:
                    self._signed(version, t, covered, whole)

        while True:
            t = await self.json(path, _Pieces, check=check, params={"after": after, "wait": 10})
            if t["epoch"] != epoch:
                epoch, fresh = t["epoch"], after == 0
                after = 0
                if not fresh:
                    continue
            after += len(t["pieces"])
            covered.update((p[0], (p[1], p[3])) for p in t["pieces"])
            new = [Piece(*p) for p in t["pieces"] if p[0] not in listed]
            listed.update(p.offset for p in new)
            yield new
            if t["complete"]:
                done["bytes"] = t["bytes"]
                return

    def _signed(self, version: int, t: dict, covered: dict[int, tuple[int, bool]], whole: bool) -> None:
        """A delta's piece list verifies: each piece signed for this version (or a whole table at
        once), and once complete (`whole`: a list to be read on from `covered`), pieces from 0 to
        the signed final piece's end, which is the file's size."""
        if table := t.get("table_sig"):
            if not self.trust.ok(table_statement(version, t["pieces"]), table):
                raise _Refused(f"delta v{version}: its piece table's signature is not the trainer's for this version")
        for offset, length, sha256, final, sig in [] if table else t["pieces"]:
            if not self.trust.ok(piece_statement(version, offset, length, sha256, final), sig):
                raise _Refused(
                    f"delta v{version}: piece at {offset}: "
                    + ("unsigned" if not sig else "its signature is not the trainer's for this version")
                )
        if t["complete"] and whole:
            pieces = {**covered, **{p[0]: (p[1], p[3]) for p in t["pieces"]}}
            ends = [o + n for o, (n, final) in pieces.items() if final]
            pos = 0
            while pos in pieces:
                pos += pieces[pos][0]
            if ends != [t["bytes"]] or pos != t["bytes"]:
                raise _Refused(
                    f"delta v{version}: the list says complete at {t['bytes']} bytes, but its pieces "
                    f"reach {pos} and end {ends or 'nowhere'}"
                )

    async def table_sig(self, version: int) -> str:
        """The trainer's signature of stored delta `version`'s whole piece table, checked where
        this client holds the key ("" where the server sends none): a relay keeps it for its
        workers, who then check a stored delta's list with one signature."""
        t = await self.json(f"/v1/versions/{version}/pieces", _Pieces, params={"after": 0})
        sig = t.get("table_sig", "") if t["complete"] else ""
        return sig if self.trust is None or self.trust.ok(table_statement(version, t["pieces"]), sig) else ""

    async def delta(self, version: int, on_piece=None) -> DeltaFile:
        """One delta, staged in memory and fully verified; the caller applies it when it likes.

        Multi-stream cut-through: its pieces are fetched in parallel as soon as the server lists
        them, also while the delta is still being written; `on_piece(offset, bytes)` receives
        each piece as soon as it has verified, in whatever order they land. The whole file is
        then verified: a file of signed pieces that does not parse (pieces of two attempts at v,
        by a trainer restarted mid-write) refuses its server, and, without `on_piece`, is fetched
        again from the next."""
        got: dict[int, bytes] = {}
        info: dict = {}
        room = 0

        def keep(p: Piece, data: memoryview) -> None:
            nonlocal room
            room -= len(data)
            if room < 0:
                raise FetchError(f"delta v{version}: the server's pieces take more than the memory free here")
            got[p.offset] = data
            if on_piece is not None:
                on_piece(p, data)

        while True:
            got.clear()
            room = memory_available() // 2  # pieces, then joined: a server that lists pieces without end must
            # not grow us until we are killed
            await self._pull(
                f"/v1/versions/{version}/delta",
                self._listed(f"/v1/versions/{version}/pieces", info, version),
                lambda p: memoryview(bytearray(p.length)),
                keep,
            )
            data = b"".join(got[k] for k in sorted(got))
            if len(data) != info.get("bytes"):
                raise FetchError(
                    f"delta v{version}: pieces cover {len(data)} bytes, the server listed {info.get('bytes')}"
                )
            try:
                return DeltaFile(data, f"delta v{version}")
            except DeltaError as e:
                if on_piece is not None:  # its pieces are passed on already
                    raise FetchError(f"delta v{version}: {e}") from None
                self._refuse(self._server, f"delta v{version}: {e}")

    async def base_parts(self, version: int, entry: dict, keep, place=None) -> None:
        """A base snapshot's parts, each verified against the version listing `entry`, handed
        to `keep(piece, buffer)` as they land, each read into `place(piece)` (see `_pull`; by
        default a buffer of its own). Cut-through from a relay that is still fetching the base
        itself: parts are asked for only once the server lists them as ready."""
        size, step = entry["base"]["bytes"], entry["base"]["part_bytes"]
        n = len(entry["base"]["parts"])
        parts = {
            i * step: Piece(i * step, min(step, size - i * step), h, i == n - 1, "")
            for i, h in enumerate(entry["base"]["parts"])
        }
        place = place or (lambda p: memoryview(bytearray(p.length)))

        await self._pull(
            f"/v1/versions/{version}/base",
            self._listed(f"/v1/versions/{version}/base/pieces", {}, expect=parts),
            place,
            keep,
        )

    async def base(self, version: int, listing: dict) -> tuple[dict[str, torch.Tensor], str]:
        """A base snapshot, verified part by part and then by its full state hash."""
        entry = next((v for v in listing["versions"] if v["version"] == version and v["base"]), None)
        if entry is None:
            raise FetchError(f"the plan names base v{version}, which the version listing does not hold")
        size, free = entry["base"]["bytes"], memory_available()
        if size > free:
            raise FetchError(f"base v{version} is {size:,} bytes, more than the {free:,} bytes of memory free here")
        buf, got = bytearray(size), set()
        view = memoryview(buf)
        await self.base_parts(
            version, entry, lambda p, data: got.add(p.offset), lambda p: view[p.offset : p.offset + p.length]
        )
        if len(got) != len(entry["base"]["parts"]):
            raise FetchError(f"base v{version}: {len(got)} of {len(entry['base']['parts'])} parts arrived")
        try:
            state = tensors_in(buf)
        except CheckpointError as e:
            raise FetchError(f"base v{version}: {e}") from None
        h = await asyncio.to_thread(state_hash, state)
        if h != entry["state_hash"]:
            raise FetchError(f"base v{version} hashes to {h}, the listing says {entry['state_hash']}")
        return state, h

    async def advance(
        self, target: int, have: tuple[int, dict[str, torch.Tensor], str] | None = None
    ) -> tuple[dict[str, torch.Tensor], str]:
        """Reach `target` by the server's cheapest plan; returns (state, state hash).

        `have` is (version, state, state hash) of what the caller holds; on the chain route its
        state is updated in place, and only after each delta has fully verified."""
        params = {"to": target} if have is None else {"to": target, "from": have[0]}
        plan = await self.json("/v1/plan", _Plan, check=lambda p: _leads(p, have, target), params=params)
        listing = await self.versions()
        if plan["route"] == "none":
            return have[1], have[2]
        if plan["route"] == "base":
            state, h = await self.base(plan["base"], listing)
        else:
            state, h = have[1], have[2]
        for v in plan["deltas"]:
            h = apply_delta(await self.delta(v), state, base_hash=h)
        want = next((v["state_hash"] for v in listing["versions"] if v["version"] == target), None)
        if h != want and self.trust is None:  # with the key, the signed chain is what decides
            raise FetchError(f"v{target} hashes to {h}, the listing says {want}")
        return state, h
