"""What the server offers of a delta file that may still be growing (cut-through): its pieces,
each checkable on its own."""

from __future__ import annotations

import hashlib
import os

from sparrowrl.delta.frame import CHUNK, CHUNK_MAGIC, END, HEAD, TRAILER


class Pieces:
    """The pieces of a delta file that a reader can fetch and check on their own, also while it
    is being written: the header, each whole chunk, and once the file ends in its trailer, the
    tail (manifest and trailer), each with the sha256 of its bytes. `scan` reads what the file
    has grown by since the last call; what was hashed once is not read again."""

    def __init__(self) -> None:
        self.pieces: list[list] = []  # [offset, length, sha256, whether it ends the file]
        self.next: int | None = None  # where the next chunk starts, once the header is in
        self.complete = False
        self.bytes: int | None = None  # the file's, once complete

    def scan(self, fd: int, size: int) -> None:
        if self.next is None and size >= HEAD.size:
            _, _, n = HEAD.unpack(os.pread(fd, HEAD.size, 0))
            end = HEAD.size + n + 32
            if size >= end:
                self._add(fd, 0, end)
        while self.next is not None and not self.complete:
            pos = self.next
            head = os.pread(fd, CHUNK.size, pos)
            if len(head) == CHUNK.size and head[:4] == CHUNK_MAGIC:
                end = pos + CHUNK.size + CHUNK.unpack(head)[2]
                if end > size:
                    return
                self._add(fd, pos, end)
            elif _ends(fd, size):
                self._add(fd, pos, size, final=True)
                self.complete, self.bytes = True, size
            else:
                return

    def _add(self, fd: int, start: int, end: int, final: bool = False) -> None:
        self.pieces.append([start, end - start, hashlib.sha256(os.pread(fd, end - start, start)).hexdigest(), final])
        self.next = end


def _ends(fd: int, size: int) -> bool:
    """Whether `size` bytes of a delta end in a consistent trailer (the writer has finished)."""
    if size < TRAILER.size:
        return False
    offset, length, _, end = TRAILER.unpack(os.pread(fd, TRAILER.size, size - TRAILER.size))
    return end == END and offset + length + TRAILER.size == size
