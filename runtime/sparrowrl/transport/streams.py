"""Fetch a file's pieces of known sha256 over parallel Range streams, each piece verified as it
lands: a dropped connection loses at most the request in flight, and a corrupt piece is fetched
again. Which pieces make a version, and whether their digests are signed, is client.py's part."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import aiohttp

from sparrowrl.transport.failover import FetchError, Refused, Servers, check_status


@dataclass(frozen=True)
class Piece:
    offset: int
    length: int
    sha256: str
    final: bool = False  # it ends the file
    sig: str = ""  # the trainer's signature of all the above, for this version

    def entry(self) -> list:
        return [self.offset, self.length, self.sha256, self.final, self.sig]


Place = Callable[[Piece], memoryview]  # a writable buffer of the piece's length, where it is read into
Keep = Callable[[Piece, memoryview], None]  # receives each piece once it has verified


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


async def _sha256(data: memoryview) -> str:
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


async def pull(
    servers: Servers,
    path: str,
    source: AsyncIterator[list[Piece]],
    place: Place,
    keep: Keep,
    streams: int,
    group_bytes: int,
    signed: bool,
) -> None:
    """Fetch the pieces that `source` names, as they are named, over `streams` parallel streams
    (see `_Queue`). Each piece is read into `place(piece)` (its spot in the caller's file, so that
    it is copied only once), and once it has verified, `keep(piece, that buffer)` receives it.
    `signed`: the pieces' digests are the trainer's, so a relay whose bytes fail one is refused."""
    queue, kind, t0 = _Queue(streams, group_bytes), path.rsplit("/", 1)[-1], time.perf_counter()

    async def lister() -> None:
        try:
            async for batch in source:
                await queue.add(batch)
        finally:
            await queue.listed()

    tasks = [asyncio.create_task(lister())] + [
        asyncio.create_task(_stream(servers, i, path, kind, queue, place, keep, signed)) for i in range(max(1, streams))
    ]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
    servers.stats.seconds += time.perf_counter() - t0


async def _stream(
    servers: Servers, i: int, path: str, kind: str, queue: _Queue, place: Place, keep: Keep, signed: bool
) -> None:
    """Download stream i: takes runs of neighbouring pieces from `queue` and asks for each
    run in one Range request, verifying piece by piece as they arrive, so a dropped
    connection costs only the piece in flight; the rest go back to the queue. A piece that
    fails its checksum goes back too, `attempts` times at most."""
    session, port = servers.stream(i)
    while (run := await queue.take()) is not None:

        async def request(url: str) -> None:
            if not run:  # its last piece was refused, and went back to the queue
                return
            start, end = run[0].offset, run[-1].offset + run[-1].length
            async with session.get(url, headers={"Range": f"bytes={start}-{end - 1}"}) as r:
                await check_status(r, url)
                if r.status == 200:  # a server that ignores Range sends the whole file
                    await _skip(r.content, start)
                while run:
                    p = run[0]
                    data = place(p)
                    await _read_into(r.content, data)
                    await servers.throttle(p.length)
                    run.pop(0)
                    if await _sha256(data) == p.sha256:
                        keep(p, data)
                        servers.stats.count(kind, url[: len(url) - len(path)], i, p.length)
                        continue
                    servers.stats.refetched += 1
                    if queue.failed(p) >= servers.attempts:
                        raise FetchError(
                            f"{path}: bytes {p.offset}+{p.length} failed their checksum {servers.attempts} times"
                        )
                    await queue.add([p])  # asked for again later, maybe from another server
                    at = servers.urls.index(url[: len(url) - len(path)])
                    if signed and at < len(servers.urls) - 1 and servers.after(at) != at:
                        # a relay's bytes that fail a digest the trainer signed: altered (or damaged),
                        # and another server has them right. The origin's (last) are fetched again
                        raise Refused(f"bytes {p.offset}+{p.length} do not match the trainer's sha256")

        try:
            await servers.ask(path, request, port)
        except FetchError:
            await queue.add(run)
            raise
