"""Which of several equivalent servers to ask, and how often: a request is retried with backoff,
then sent to the next server (another relay, or the origin); a server that says it is busy is
waited for; one whose answer did not verify is refused and left alone for a while. The fetches
built on this (client.py) only say what to ask and what a good answer is."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import random
import secrets
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
import yarl
from pydantic import BaseModel, ValidationError

from sparrowrl.auth.credential import Credential
from sparrowrl.spec.limits import first_problem
from sparrowrl.transport.http import TrustedCA

log = logging.getLogger(__name__)

PREFERRED_AGAIN_S = 10.0  # after falling back, how long before the first server is tried again
REFUSED_S = 300.0  # how long a server whose answer did not verify is left alone
BUSY_WAIT_S = 60.0  # how long one request waits on a server that says when to ask again (a relay still
# syncing: its workers would otherwise pull a whole base each across the WAN from the origin)
PORT_WAIT_S = 60.0  # how long one request waits for its stream's fixed local port to be free (TIME_WAIT's length)
READ_BUFFER = 4 << 20  # bytes a response may buffer before its socket is paused (aiohttp's 64 KiB paused it
# after every read at LAN speed)

T = TypeVar("T")


class FetchError(Exception):
    """A version could not be fetched within the retry bounds; nothing was changed."""


class Transient(Exception):
    """A failed answer worth retrying (5xx, 404 from a lagging relay, an unreadable body)."""


class Refused(Exception):
    """An answer that does not verify or does not parse: that server is not to be asked again soon."""


class Busy(Exception):
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


async def check_status(r: aiohttp.ClientResponse, url: str) -> None:
    """Go on with a 200 or 206; raise what any other status means for the request."""
    if r.status == 401:  # why, as the server says: no token, another job's, expired, or replaced
        raise FetchError(f"{url}: 401 unauthorized: {(await r.text())[:200]} (SPARROWRL_TOKEN or its file)")
    if r.status in (200, 206):
        return
    text = (await r.text())[:200]
    if r.status == 503 and (after := _retry_after(r.headers.get("Retry-After"))) is not None:
        raise Busy(after, text)
    if r.status < 500 and r.status != 404:  # 404 is transient: a relay may lag behind
        raise FetchError(f"{url}: HTTP {r.status}: {text}")
    raise Transient(f"HTTP {r.status}: {text}")


def _reusable(addr_info) -> socket.socket:
    """A socket that may bind a fixed local port whose last connection is still in TIME_WAIT:
    otherwise one dropped connection makes its stream's port unusable for a minute."""
    family, type_, proto, _, _ = addr_info
    sock = socket.socket(family, type_, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return sock


@dataclass
class Stats:
    """What a client's requests and downloads did (a worker exports these as metrics)."""

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


class Servers:
    """Connection pools to an ordered list of equivalent servers (relays first, origin last),
    and which of them is asked: `server`, an index into `urls`."""

    def __init__(
        self,
        urls: list[str],
        credential: Credential,
        attempts: int,
        backoff: float,
        ssl_context: ssl.SSLContext | None,
        read_timeout: float,
        local_ports: list[int] | None,
        rate_mbit: float | None,
        port_wait: float,
    ):
        """See Client: `local_ports` binds stream i's connection to local_ports[i]; `rate_mbit`
        caps the download rate of all streams together."""
        self.urls, self.credential, self.attempts, self.backoff = urls, credential, attempts, backoff
        self._origins = {yarl.URL(u).origin() for u in urls}  # where the token may go
        self.ssl = ssl_context
        self.timeout = aiohttp.ClientTimeout(total=None, connect=10, sock_read=read_timeout)
        self.stats = Stats()
        self.local_ports, self.port_wait = local_ports, port_wait
        self.rate = rate_mbit * 1e6 / 8 if rate_mbit else None  # bytes per second
        self._bucket, self._filled = 0.0, time.perf_counter()
        self.session: aiohttp.ClientSession | None = None  # for any request, with the token
        self._stream_sessions: list[aiohttp.ClientSession] = []
        self.server = 0  # the server in use: the next request goes to it
        self._fell_back_at = 0.0
        self._refused: dict[int, float] = {}  # server → until when it is not asked (time.monotonic)

    async def _authorize(self, request: aiohttp.ClientRequest, handler: aiohttp.ClientHandlerType):
        """Each request to one of the servers with the token as it is now (refreshed in its file,
        the next one has it); none to anywhere else, such as where a redirect points."""
        if isinstance(self.ssl, TrustedCA):
            self.ssl.refresh()  # a CA rotated in its file: trusted from this connection on
        if request.url.origin() in self._origins and (token := self.credential.get()):
            request.headers[aiohttp.hdrs.AUTHORIZATION] = f"Bearer {token}"
        return await handler(request)

    def _new_session(self, **connector_kw: Any) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(
            middlewares=(self._authorize,),
            timeout=self.timeout,
            read_bufsize=READ_BUFFER,
            # aiohttp takes ssl=None as True, the default context; its types say so
            connector=aiohttp.TCPConnector(ssl=self.ssl if self.ssl is not None else True, **connector_kw),
        )

    def open(self) -> None:
        self.session = self._new_session(limit=0)
        self._stream_sessions = [
            self._new_session(limit=1, local_addr=("0.0.0.0", p), socket_factory=_reusable)
            for p in self.local_ports or []
        ]

    def _session(self) -> aiohttp.ClientSession:
        """The shared pool, which `open` makes."""
        if self.session is None:
            raise RuntimeError("the sessions are not open")
        return self.session

    async def close(self) -> None:
        for s in [self._session(), *self._stream_sessions]:
            await s.close()

    def stream(self, i: int) -> tuple[aiohttp.ClientSession, int | None]:
        """Download stream i's session and fixed local port (None: any port, the shared pool)."""
        if not self.local_ports:
            return self._session(), None
        return self._stream_sessions[i % len(self._stream_sessions)], self.local_ports[i % len(self.local_ports)]

    async def throttle(self, n: int) -> None:
        """Take n bytes from the bucket (refilled at `rate`, holding at most 0.1 s of it), waiting
        as long as the link would have taken: unread bytes back-pressure the sender via TCP."""
        if self.rate is None:
            return
        now = time.perf_counter()
        self._bucket = min(self.rate * 0.1, self._bucket + (now - self._filled) * self.rate) - n
        self._filled = now
        if self._bucket < 0:
            await asyncio.sleep(-self._bucket / self.rate)

    async def ask(self, path: str, request: Callable[[str], Awaitable[T]], port: int | None = None) -> T:
        """Run `request(url)` until it succeeds: backoff on the current server, every second
        failure the next one; FetchError after `attempts` failures or on a permanent answer. A
        request from fixed local `port` that finds it taken waits for it (`port_wait`), on the
        same server: the port is what failed, not the server."""
        last, busy, taken = "no attempt", 0.0, 0.0
        if self.server and time.monotonic() - self._fell_back_at > PREFERRED_AGAIN_S:
            self.server = self.after(-1)  # the preferred server (a region's relay) may be back: try it first again
        attempt = 0
        while attempt < self.attempts:
            server = self.server
            url = self.urls[server] + path
            try:
                self.stats.requests += 1
                return await request(url)
            except Refused as e:
                self.refuse(server, f"{url}: {e}")
                continue
            except Busy as e:  # asked to come back: waited for, BUSY_WAIT_S at most, then a failure
                last = f"HTTP 503: {e}"
                if busy < BUSY_WAIT_S:
                    busy += e.after
                    await asyncio.sleep(e.after)
                    continue
            except aiohttp.ClientConnectorCertificateError as e:  # not a server of this job: the next one, if any
                self.refuse(server, f"{url}: certificate not trusted ({e.certificate_error})")
                continue
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
                Transient,
            ) as e:
                last = f"{type(e).__name__}: {e}"
            self.stats.retries += 1
            if attempt % 2 == 1 and len(self.urls) > 1 and self.server == server:  # not if another request just did
                self.server = self.after(server)
                self._fell_back_at = time.monotonic()
            await asyncio.sleep(self.backoff * 2 ** min(attempt, 5) * (0.5 + random.random()))
            attempt += 1
        raise FetchError(f"{path}: gave up after {self.attempts} attempts (last: {last})")

    def after(self, server: int) -> int:
        """The first server after `server` (in turn) that is not refused; `server` if none is."""
        now = time.monotonic()
        for i in range(server + 1, server + 1 + len(self.urls)):
            if self._refused.get(i % len(self.urls), 0.0) <= now:
                return i % len(self.urls)
        return server % len(self.urls)

    def refuse(self, server: int, reason: str) -> None:
        """A server answered with what does not verify: report it, and go on without it for
        REFUSED_S; FetchError when no other server is left."""
        url = self.urls[server]
        self.stats.refused[url] = self.stats.refused.get(url, 0) + 1
        self._refused[server] = time.monotonic() + REFUSED_S
        if (nxt := self.after(server)) == server:
            raise FetchError(f"{reason}; no other server to try")
        log.warning(f"sparrowrl: refused {reason}; going on with {self.urls[nxt]}")
        if self.server == server:
            self.server, self._fell_back_at = nxt, time.monotonic()

    async def json(
        self,
        path: str,
        model: type[BaseModel] | None = None,
        check: Callable[[dict], Awaitable[None]] | None = None,
        **kw: Any,
    ) -> dict:
        """The JSON answer at `path` (an unreadable body is retried). With `model`, checked
        against it first: an answer with a field out of type or bounds refuses its server (see
        `refuse`). Then `await check(doc)`, which raises Refused for what does not verify."""

        async def request(url: str) -> dict:
            async with self._session().get(url, **kw) as r:
                await check_status(r, url)
                raw = await r.read()
            try:
                doc = json.loads(raw)
            except ValueError as e:
                raise Transient(f"unreadable response: {e}") from None
            if model is not None:
                try:
                    model.model_validate_json(raw)
                except ValidationError as e:
                    raise Refused(first_problem(e)) from None
            if check is not None:
                await check(doc)
            return doc

        return await self.ask(path, request)

    async def content(self, path: str, limit: int) -> bytes:
        """The body at `path`, at most `limit` bytes (FetchError beyond: the server is not trusted
        to end it)."""

        async def request(url: str) -> bytes:
            async with self._session().get(url) as r:
                await check_status(r, url)
                data = bytearray()
                while block := await r.content.read(1 << 16):
                    data += block
                    if len(data) > limit:
                        raise FetchError(f"{url}: more than {limit:,} bytes")
                return bytes(data)

        return await self.ask(path, request)

    async def post_json(self, path: str, body: dict) -> dict:
        """POST a JSON body, with the same retries and fallback as a GET. An answer lost on the way
        back means the body is sent again, with the same `Idempotency-Key`, so that the server can
        answer the retry with its first answer instead of acting twice."""
        headers = {"Idempotency-Key": secrets.token_hex(16)}

        async def request(url: str) -> dict:
            async with self._session().post(url, json=body, headers=headers) as r:
                await check_status(r, url)
                try:
                    return await r.json()
                except ValueError as e:
                    raise Transient(f"unreadable response: {e}") from None

        return await self.ask(path, request)
