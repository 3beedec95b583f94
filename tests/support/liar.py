"""A worker that lies, made of an honest one: an HTTP proxy between a real `sparrowrl worker` and
the trainer, which forwards every request as it is, except that it rewrites the log-probs of every
other lease's results to −1e4 (within what the trainer's door takes). Workers are the untrusted
edge of a job: this is what a compromised or broken one could send."""

from __future__ import annotations

import asyncio
import json
import threading

import aiohttp
from aiohttp import web

from support.servers import listen

HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}
FALSE_LOGPROB = -1e4


class LyingProxy:
    def __init__(self, target: str):
        self.target = target.rstrip("/")
        self.url = ""
        self.results = 0  # results bodies forwarded
        self.falsified = 0  # groups whose log-probs it rewrote and the trainer admitted
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> LyingProxy:
        self._thread.start()
        assert self._ready.wait(30)
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    def _run(self) -> None:
        self._loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        runner, self.url = await listen(app)
        async with aiohttp.ClientSession(auto_decompress=False, timeout=aiohttp.ClientTimeout(total=None)) as s:
            self._session = s
            self._ready.set()
            await self._stop.wait()
        await runner.cleanup()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        lied = 0
        if request.method == "POST" and request.path == "/v1/results":
            self.results += 1
            if self.results % 2 == 0:
                doc = json.loads(body)
                for group in doc["results"].values():
                    for sample in group["samples"]:
                        sample["logprobs"] = [FALSE_LOGPROB] * len(sample["logprobs"])
                lied = len(doc["results"])
                body = json.dumps(doc).encode()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        async with self._session.request(
            request.method, self.target + request.path_qs, headers=headers, data=body
        ) as r:
            out = web.StreamResponse(
                status=r.status, headers={k: v for k, v in r.headers.items() if k.lower() not in HOP}
            )
            if lied and r.status == 200:
                answer = await r.read()
                self.falsified += min(lied, json.loads(answer).get("admitted", 0))
                await out.prepare(request)
                await out.write(answer)
            else:
                await out.prepare(request)
                async for chunk in r.content.iter_any():
                    await out.write(chunk)
            await out.write_eof()
            return out
