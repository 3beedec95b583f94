"""What every role's HTTP server shares: who a bearer token names and what it may do, listening
with an error in one line, health probes, TLS, and what a long-lived server process needs of
its host (open files, a heap the collector leaves alone)."""

from __future__ import annotations

import gc
import ipaddress
import logging
import os
import resource
import ssl
from pathlib import Path
from typing import Callable

from aiohttp import web

from sparrowrl.auth.tokens import ADMIN, Gate, Principal, allowed
from sparrowrl.spec.limits import open_regular

log = logging.getLogger(__name__)

OPEN = frozenset({"/healthz", "/readyz"})  # probes (a kubelet's) carry no token, and these say nothing else
GATE = web.AppKey[Gate | None]("gate")  # None: no token, an open (loopback) server
PRINCIPAL = web.RequestKey("principal", Principal)  # who the request's token names


@web.middleware
async def auth(request: web.Request, handler):
    """Who the bearer token names (`request[PRINCIPAL]`), and whether that role may do this."""
    gate: Gate | None = request.app[GATE]
    if gate is None or request.path in OPEN:
        request[PRINCIPAL] = ADMIN
        return await handler(request)
    who = gate.check(request.headers.get("Authorization", ""))  # non-UTF-8 bytes arrive surrogate-escaped
    if isinstance(who, str):
        raise web.HTTPUnauthorized(text=who, headers={"WWW-Authenticate": 'Bearer realm="sparrowrl"'})
    if (why := allowed(who, request.method, request.path)) is not None:
        raise web.HTTPForbidden(text=why)
    request[PRINCIPAL] = who
    return await handler(request)


class ListenError(Exception):
    """The address cannot be bound (in use, not this host's, a privileged port)."""

    @classmethod
    def of(cls, host: str, port: int, e: OSError) -> "ListenError":
        # asyncio's message repeats the address; the errno says why
        why = os.strerror(e.errno) if e.errno is not None and e.errno > 0 else e.strerror
        return cls(f"cannot listen on {host}:{port}: {why}")


async def listen(runner: web.AppRunner, host: str, port: int, served: ServingTLS | None = None) -> None:
    """Start `runner` on host:port (HTTPS with `served`); ListenError in one line if that address
    cannot be had."""
    try:
        await web.TCPSite(runner, host, port, ssl_context=served.context if served else None).start()
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


class TrustedCA(ssl.SSLContext):
    """A client's TLS context that trusts the CA in a file alone (an intermediate is enough), and
    the CA the file holds later too: a CA rotated in a Secret's volume is trusted from the next
    connection on, with no restart (the one before stays trusted until the process ends, so the
    servers not yet renewed keep their clients). `refresh`, before each request, looks."""

    path: Path
    _seen: tuple[int, ...] | None
    _failed: bool

    @classmethod
    def of(cls, path: Path) -> TrustedCA:
        """OSError or ssl.SSLError: the file does not load."""
        ctx = cls(ssl.PROTOCOL_TLS_CLIENT)  # names checked, certificates required
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
        ctx.path, ctx._failed = Path(path), False
        ctx._seen = ctx._stat()
        ctx.load_verify_locations(cafile=str(path))
        return ctx

    def _stat(self) -> tuple[int, ...] | None:
        try:
            s = os.stat(self.path)
        except OSError:
            return None
        return (s.st_dev, s.st_ino, s.st_mtime_ns, s.st_ctime_ns, s.st_size)

    def refresh(self) -> None:
        seen = self._stat()
        if seen is None or seen == self._seen:
            return
        try:
            self.load_verify_locations(cafile=str(self.path))
            self._seen, self._failed = seen, False
            log.info(f"TLS: trusting the CA in {self.path} as it is now (it changed)")
        except (OSError, ssl.SSLError) as e:
            if not self._failed:
                log.error(f"TLS: {self.path} does not load ({e}); the CA loaded before stays trusted")
            self._failed = True


class ServingTLS:
    """A server's certificate and key, from PEM files that may be replaced while it runs (a
    Secret's volume, renewed): each TLS handshake looks at the files (a stat of each), and a
    changed pair serves the connections from then on, with no restart. A pair that does not load
    is logged, and the last good one goes on serving: a renewal half-written is never served, and
    nothing falls back to plain HTTP. ValueError at start names the flag and the file."""

    def __init__(self, cert: Path, key: Path):
        self.cert, self.key = cert, key
        self._stamp = self._stat()
        self.context = self._load()  # what the listener is given; its callback hands over to `_current`
        self._current = self.context
        self._failed = ""  # the last reload's error, said once

    def _stat(self) -> tuple[tuple[int, ...], ...]:
        out = []
        for flag, path in (("--tls-cert", self.cert), ("--tls-key", self.key)):
            try:
                st = os.stat(path)
            except OSError as e:
                raise ValueError(f"{flag} {path}: {e.strerror}") from None
            out.append((st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size))
        return tuple(out)

    def _load(self) -> ssl.SSLContext:
        for flag, path in (("--tls-cert", self.cert), ("--tls-key", self.key)):  # ssl's own error does not say which
            try:
                open_regular(path, "a PEM file").close()
            except ValueError as e:
                raise ValueError(f"{flag} {e}") from None
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_cert_chain(self.cert, self.key)
        except ssl.SSLError as e:
            raise ValueError(
                f"--tls-cert {self.cert} and --tls-key {self.key} are not a PEM certificate and its private key ({e})"
            ) from None
        ctx.sni_callback = self._handshake
        return ctx

    def _handshake(self, conn: ssl.SSLObject, _name: str | None, _ctx: ssl.SSLContext) -> None:
        try:
            stamp = self._stat()
            if stamp != self._stamp:  # a pair that does not load is tried again at each handshake, said once
                self._current = self._load()
                self._stamp = stamp
                log.info(f"TLS: serving the certificate in {self.cert} from now on (it changed)")
        except (ValueError, OSError) as e:
            if str(e) != self._failed:
                log.error(f"TLS: {e}; the certificate loaded before goes on serving")
            self._failed = str(e)
        else:
            self._failed = ""
        if conn.context is not self._current:
            conn.context = self._current


def tls(cert: Path | None, key: Path | None) -> ServingTLS | None:
    """--tls-cert and --tls-key, both or neither; ValueError names what is wrong."""
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise ValueError("TLS needs both --tls-cert and --tls-key")
    return ServingTLS(cert, key)


def more_open_files(who: str) -> tuple[int, int]:
    """Raise this process's soft limit of open files to its hard limit, and say so; (before,
    after). A relay holds a socket per worker's stream and, while a range is sent, the file:
    about 8 descriptors per worker at 4 streams (hack/scale_relay.py: 1,036 at 128 workers); a
    trainer holds a long poll per worker. A soft limit of 1024 (a common default, containerd 2's
    among them) then runs out: a relay near 120 workers answers 503 (its index unreadable) or
    404 (aiohttp's answer when an open fails), and its workers fall back to the origin across
    the WAN; a trainer refuses workers' connections."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):  # a hard limit above what the kernel allows: keep the soft one
            return soft, soft
        log.info(f"{who}: open files limit raised from {soft:,} to {hard:,}")
        return soft, hard
    return soft, soft


def freeze_heap() -> None:
    """Move every object allocated so far (the modules imported, a loaded model) out of the
    cyclic garbage collector's reach, before a server takes requests. A full collection walks
    every object it tracks, on the event loop's thread: in a trainer, 450,000 and more (torch,
    transformers, pydantic), 200-300 ms a pass, every few seconds at a thousand workers, each
    pass a stall of every request in flight. What is frozen is still freed by its reference
    count; only what it later drops in reference cycles is never collected (a few kB)."""
    gc.collect()
    gc.freeze()
