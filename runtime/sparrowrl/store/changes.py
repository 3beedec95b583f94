"""Who in this process hears of a store's changes: a server beside the trainer that writes the store
learns of each new version, and of each chunk of a delta being written, without polling."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

_listeners: dict[Path, list[Callable[[], None]]] = {}  # store folder → who this process tells of its changes


def listen(path: str | Path, tell: Callable[[], None]) -> Callable[[], None]:
    """Call `tell()` after every change that a `Store` of this process makes to the store at
    `path` (its index, a delta growing): how a server in the writer's own process learns of a
    new version without polling. `tell` may be called from any thread. Returns the undo."""
    key = Path(path).resolve()
    _listeners.setdefault(key, []).append(tell)
    return lambda: _listeners[key].remove(tell)


def tell(path: Path) -> None:
    """Call every listener of the store at `path`."""
    for listener in list(_listeners.get(path.resolve(), ())):
        listener()


class Telling:
    """A delta file being written: each flush (a whole chunk, the tail) is a change to tell of."""

    def __init__(self, f: BinaryIO, tell: Callable[[], None]):
        self.f, self.tell = f, tell

    def write(self, data: bytes) -> int:
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()
        self.tell()
