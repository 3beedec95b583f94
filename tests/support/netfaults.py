"""A TCP proxy that misbehaves on purpose: the network is the one thing tests may fake.

It forwards bytes between a client and a real server and, per configuration, cuts a
connection after some bytes, flips a byte of a response, or slows the stream down.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass


@dataclass
class Faults:
    cut_after: int | None = None  # close the connection after this many response bytes...
    cuts: int = 0  # ...this many times
    corrupt_at: int | None = None  # flip a byte this far into a ranged (206) response body...
    corruptions: int = 0  # ...this many times
    rate: float | None = None  # bytes per second per connection


class FaultyProxy:
    def __init__(self, target_port: int, faults: Faults):
        self.target_port, self.faults = target_port, faults
        self.port = 0
        self.connections = 0
        self.bytes_down = 0  # response bytes forwarded to clients
        self.peer_ports: set[int] = set()
        self._server: asyncio.AbstractServer | None = None

    async def __aenter__(self) -> "FaultyProxy":
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        self._server.close()
        await self._server.wait_closed()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.peer_ports.add(writer.get_extra_info("peername")[1])
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return

        async def upstream() -> None:
            try:
                while data := await reader.read(65536):
                    up_w.write(data)
                    await up_w.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                up_w.close()

        async def downstream() -> None:
            f = self.faults
            sent = 0
            head, body_left, ranged, body_pos = b"", 0, False, 0  # HTTP response framing
            try:
                while data := await up_r.read(16384):
                    out = bytearray(data)
                    i = 0
                    while i < len(out):  # walk responses: headers, then Content-Length body bytes
                        if body_left == 0:
                            j = (head + bytes(out[i:])).find(b"\r\n\r\n")
                            if j < 0:
                                head += bytes(out[i:])
                                break
                            consumed = j + 4 - len(head)
                            block = (head + bytes(out[i : i + consumed])).decode("latin-1").lower()
                            head, i = b"", i + consumed
                            body_left = (
                                int(block.split("content-length:")[1].split("\r\n")[0])
                                if "content-length:" in block
                                else 0
                            )
                            ranged, body_pos = "content-range:" in block and " 206 " in block.split("\r\n")[0], 0
                            continue
                        take = min(body_left, len(out) - i)
                        if (
                            ranged
                            and f.corruptions
                            and f.corrupt_at is not None
                            and body_pos <= f.corrupt_at < body_pos + take
                        ):
                            out[i + f.corrupt_at - body_pos] ^= 0xFF
                            f.corruptions -= 1
                        body_pos += take
                        body_left -= take
                        i += take
                    data = bytes(out)
                    if f.cuts and f.cut_after is not None and sent + len(data) > f.cut_after:
                        writer.write(data[: max(0, f.cut_after - sent)])
                        f.cuts -= 1
                        writer.transport.abort()
                        return
                    writer.write(data)
                    await writer.drain()
                    sent += len(data)
                    self.bytes_down += len(data)
                    if f.rate:
                        await asyncio.sleep(len(data) / f.rate)
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                writer.close()

        await asyncio.gather(upstream(), downstream())
