"""How a server learns that its store changed, without a tight loop."""

from __future__ import annotations

import asyncio
from pathlib import Path

TICK = 0.01  # how often a store written by another process is looked at, while someone waits for a change


class Watch:
    """The one way a server waits for its store to change (a new version in the index, a delta
    growing). A store written in this process (the trainer's, a relay's) tells it (`poke`, from
    `store.listen`); one written by another process (`sparrowrl store add` beside `sparrowrl
    serve`) is polled, by one poller per store that runs only while a request waits."""

    def __init__(self, path: Path, polled: bool):
        self.path, self.polled = path, polled
        self._seen = self._look() if polled else None
        self._event = asyncio.Event()
        self._waiters = 0
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def poke(self) -> None:
        """The store changed (any thread may say so)."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:  # on the loop: the event of whoever waits now
        self._event.set()

    def _look(self) -> tuple:
        try:
            st = (self.path / "store.json").stat()
            index = st.st_ino, st.st_mtime_ns
            growing = sorted((f.name, f.stat().st_size) for f in (self.path / "deltas").glob(".v*.partial"))
        except OSError:  # a file went while we looked: that is a change too
            return (None,)
        return index, growing

    async def _poll(self) -> None:
        while self._waiters:
            if (now := self._look()) != self._seen:
                self._seen = now
                self._event.set()
            await asyncio.sleep(TICK)
        self._task = None

    async def changed(self, seconds: float) -> None:
        """Until the store changes, or `seconds` pass. A change since the last waiter left wakes
        the next at once (a spurious wake at most: callers look again)."""
        event = self._event
        if not event.is_set():
            self._waiters += 1
            if self.polled and self._task is None:
                self._task = asyncio.create_task(self._poll())
            try:
                async with asyncio.timeout(max(0.0, seconds)):  # not wait_for: on 3.11 it can lose a cancel
                    await event.wait()
            except TimeoutError:
                return
            finally:
                self._waiters -= 1
        if event is self._event:  # the first to wake takes the change; the others woke with it
            self._event = asyncio.Event()
