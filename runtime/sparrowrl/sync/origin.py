"""A publisher's store served over HTTP from a thread of the training process: the origin that
subscribers and relays pull from, without a second process. It serves what `sparrowrl serve
STORE` serves, signed with the key the job's secret derives, and hears of each new version from
the store itself (no polling), so a delta is listed while it is still written."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web

from sparrowrl.auth.signing import Signer, public_text
from sparrowrl.transport.http import is_loopback, listen, tls
from sparrowrl.transport.server import make_app

T = TypeVar("T")


class Origin:
    """Serves `store` on host:port (0: a free port; `url` says which) until `close`.

    `secret`: the job's secret. It admits clients (the secret itself, or role tokens minted from
    it: `sparrowrl credentials`) and signs every version served; subscribers check with `trainer_key`.
    Without one, nothing is signed or checked, which is allowed on loopback only.

    `tls_cert` and `tls_key`: serve HTTPS with this PEM pair, read again when the files change
    (a renewal serves the next connections); subscribers trust its CA (`ssl_context`)."""

    def __init__(
        self,
        store: str | Path,
        secret: str = "",
        host: str = "127.0.0.1",
        port: int = 0,
        tls_cert: str | Path | None = None,
        tls_key: str | Path | None = None,
    ):
        if not secret and not is_loopback(host):
            raise ValueError(f"refusing to serve on non-loopback address {host} without a secret")
        self._tls = tls(Path(tls_cert) if tls_cert else None, Path(tls_key) if tls_key else None)
        self.trainer_key = public_text(Signer(secret).key) if secret else None
        self._app = make_app(store, secret, signer=Signer(secret) if secret else None, written_here=True)
        self._loop = asyncio.new_event_loop()
        self._runner = web.AppRunner(self._app, access_log=None)
        self._thread = threading.Thread(target=self._loop.run_forever, name="sparrowrl-origin", daemon=True)
        self._thread.start()
        try:
            self._run(self._start(host, port))
        except BaseException:
            self.close()
            raise

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _start(self, host: str, port: int) -> None:
        await self._runner.setup()
        await listen(self._runner, host, port, self._tls)
        bound = self._runner.addresses[0]
        scheme = "https" if self._tls else "http"
        self.url = f"{scheme}://{'[' + bound[0] + ']' if ':' in bound[0] else bound[0]}:{bound[1]}"

    def close(self) -> None:
        """Stop serving: long polls end, connections close, the thread exits."""
        if self._thread.is_alive():
            self._run(self._runner.cleanup())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
        self._loop.close()

    def __enter__(self) -> Origin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
