"""The piece table of a file a relay is still fetching: its workers list and fetch each piece as soon
as it has verified, in arrival order, so that one slow piece holds back only itself."""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path

from aiohttp import hdrs, web

from sparrowrl.transport.server import listing_json, over
from sparrowrl.transport.streams import Piece


class PieceTable:
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
        self.closed = False
        self.error: str | None = None

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
                async with asyncio.timeout(min(1.0, deadline - loop.time())):  # 1 s: see over
                    await self.changed.wait()
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
