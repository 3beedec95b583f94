"""A rollout worker: generates with version v while it fetches v+1 in the background, commits the
staged version only between leases (never mid-batch), and proves what it committed by hashing
its live weights in full and reporting the hash, which the trainer checks against its own. Its
weights follow the trainer's through the public sync API, as any engine's would.

    fetcher ── Subscriber.follow ── Subscriber.fetch(v) (cut-through) ──▶ staged
    main    ── Subscriber.apply staged ── POST /v1/work ── generate (thread) ── POST /v1/results ──▶ …
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import ssl
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Annotated

import torch
from aiohttp import web
from pydantic import BaseModel, Field
from transformers import AutoConfig, AutoTokenizer

from sparrowrl.agents import environment
from sparrowrl.agents.turns import Turns, end_tokens
from sparrowrl.auth.credential import Credential
from sparrowrl.auth.signing import trust
from sparrowrl.auth.tokens import Gate
from sparrowrl.calls import Pool
from sparrowrl.delta import state_hash
from sparrowrl.spec import messages
from sparrowrl.spec.messages import Job
from sparrowrl.spec.task import EnvironmentSpec
from sparrowrl.sync import Staged, Subscriber
from sparrowrl.transport.client import Client
from sparrowrl.transport.failover import FetchError
from sparrowrl.transport.http import GATE, ServingTLS, add_health, auth, listen
from sparrowrl.transport.metrics import add_metrics, family
from sparrowrl.worker.engines import Engine, Prompt, Sampling, make_engine
from sparrowrl.worker.episodes import Episodes

log = logging.getLogger(__name__)

MAX_MODEL_FILE = 64 << 20  # a config or tokenizer file; weights never travel this way
UPDATE_WAIT_S = 10.0  # how long a worker waits for a version it was told to reach before it asks again
ATTEMPTS = 40  # about four minutes of backoff per request: a trainer pod restarting, pulled, rescheduled


class Worker:
    """`sub` keeps the engine's tensors at the trainer's versions (relays first, the origin last);
    `control` talks to the trainer."""

    def __init__(
        self,
        name: str,
        sub: Subscriber,
        control: Client,
        engine: Engine,
        on_engine: ThreadPoolExecutor,
        region: str | None = None,
        pace: float | None = None,
        episodes: Episodes | None = None,
    ):
        self.name, self.sub, self.control, self.engine = name, sub, control, engine
        self.episodes = episodes  # task.environment's: a lease's groups are episodes
        self.region = region
        self.pace = pace  # tokens/s this worker's generation is held to (benchmarks: a dedicated accelerator)
        self.on_engine = on_engine  # one thread for all engine work: vLLM's CPU kernels check that
        # they run with the OpenMP thread count they were set up with, which is per thread
        self.version, self.hash = -1, ""
        self.verified = -1  # the newest version the trainer has confirmed this worker holds
        self.commits = {"ok": 0, "mismatch": 0}
        self.staged: dict[int, Staged] = {}
        self.known = -1  # newest version fetched or being fetched
        self.arrived = asyncio.Event()

    def metrics(self) -> list:
        """/metrics: this worker's commits and what it has fetched."""
        return [
            family(
                "counter",
                "commit_verifications",
                "This worker's commits, by whether the trainer confirmed them",
                by=("result", self.commits),
            ),
            family("gauge", "committed_version", "The version this worker generates with", self.version),
            family("gauge", "staleness", "Versions fetched but not yet committed", max(0, self.known - self.version)),
            family("counter", "received_bytes", "Verified bytes fetched, by kind", by=("kind", self.sub.stats.kinds)),
            family(
                "counter",
                "received_stream_bytes",
                "Verified bytes fetched, by kind, server (relay or origin) and download stream",
                by=(("kind", "server", "stream"), self.sub.stats.sources),
            ),
            family(
                "counter",
                "refused_answers",
                "Answers that did not verify (a forged or altered list or piece, a malformed answer), by server",
                by=("server", self.sub.stats.refused),
            ),
        ]

    async def start(self) -> None:
        """The newest version by the server's cheapest plan (nearest base, then deltas)."""
        newest = await self.sub.newest()
        staged = await self.sub.fetch(newest)
        await self._run(self._commit, staged)
        self.known = newest
        await self._commit_report(newest, staged.fetch_s)

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.on_engine, fn, *args)

    def _commit(self, staged: Staged) -> None:
        self.sub.apply(staged)  # verified before anything changes
        self.engine.commit()

    async def _commit_report(self, version: int, fetch_s: float | None) -> None:
        """Hash the weights the engine computes with, in full, and report them; a mismatch stops the worker."""
        h = await self._run(lambda: state_hash(self.engine.readback()))
        self.version, self.hash = version, h
        ok = (
            await self.control.post_json(
                "/v1/commit",
                {
                    "worker": self.name,
                    "version": version,
                    "state_hash": h,
                    "fetch_s": fetch_s,
                    "refused": sum(self.sub.stats.refused.values()),
                },
            )
        )["verified"]
        self.commits["ok" if ok else "mismatch"] += 1
        if ok:
            self.verified = version
        else:
            raise RuntimeError(f"{self.name}: weights after committing v{version} hash to {h}, not the trainer's")

    async def fetcher(self) -> None:
        """Stage every new version as soon as the trainer starts writing it."""
        async for v in self.sub.follow(after=self.known):
            self.staged[v] = await self.sub.fetch(v)
            log.info(f"{self.name}: v{v} staged from {self.sub.server_url} in {self.staged[v].fetch_s:.2f} s")
            self.known = v
            self.arrived.set()

    async def commit_staged(self, at_least: int = -1, within: float | None = None) -> None:
        """At a batch boundary: apply what is staged, in order, up to the newest, once `at_least`
        is staged; or, `within` seconds on, what is staged by then (the trainer may name a version
        it has not published yet: the worker asks again meanwhile, so the trainer hears from it)."""
        deadline = None if within is None else time.monotonic() + within
        while self.known < at_least or self.version + 1 not in self.staged and self.version < at_least:
            self.arrived.clear()
            arrived = asyncio.create_task(self.arrived.wait())
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, _ = await asyncio.wait({arrived, self.fetch}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            arrived.cancel()
            if not done:
                break
            if self.fetch.done():
                self.fetch.result()  # a fetch that gave up ends the worker with its error
                raise FetchError("the fetcher stopped")
        while self.version + 1 in self.staged:
            v = self.version + 1
            staged = self.staged.pop(v)
            await self._run(self._commit, staged)
            await self._commit_report(v, staged.fetch_s)

    async def run(self) -> None:
        job = await self.control.json("/v1/job", Job)
        await self.start()
        self.fetch = asyncio.create_task(self.fetcher())
        try:
            while True:
                if self.fetch.done():
                    self.fetch.result()  # a fetch that gave up ends the worker with its error
                await self.commit_staged()
                ans = await self.control.post_json(
                    "/v1/work", {"worker": self.name, "version": self.version, "region": self.region}
                )
                if "done" in ans:
                    if self.version >= ans["done"]:
                        return
                    await self.commit_staged(at_least=ans["done"])
                    continue  # once more at the final version: its held-out eval (task.eval) may be due
                if "update" in ans:
                    await self.commit_staged(at_least=ans["update"], within=UPDATE_WAIT_S)
                elif "lease" in ans:
                    await self.rollout(ans["lease"], job)

        finally:
            self.fetch.cancel()

    async def rollout(self, lease: dict, job: dict) -> None:
        """All of a lease's groups in one engine call (vLLM batches them), each seeded by its group."""
        t0 = time.perf_counter()
        sampling = Sampling(
            n=job["group_size"],
            max_new_tokens=job["max_new_tokens"],
            temperature=job["temperature"],
            top_p=job["top_p"],
            top_k=job["top_k"],
            stop=tuple(job["stop"]),
        )
        if "eval" in lease:  # held-out prompts (task.eval): scored, never trained
            e = messages.parse(messages.EvalSampling, lease["eval"])
            sampling = replace(sampling, n=e.samples)
            if e.greedy:
                sampling = replace(sampling, top_k=1, top_p=1.0)
        prompts = [Prompt(p["ids"], p["seed"]) for p in lease["prompts"]]
        if self.episodes is not None:  # an eval lease's too: its groups are episodes of the eval examples
            episodes = await self._run(self.episodes.run, prompts, [p["example"] for p in lease["prompts"]], sampling)
            results = {p["group"]: {"samples": e} for p, e in zip(lease["prompts"], episodes, strict=True)}
        else:
            groups = await self._run(self.engine.generate, prompts, sampling)
            results = {
                p["group"]: {
                    "samples": [{"tokens": s.tokens, "logprobs": s.logprobs, "finish": s.finish} for s in samples]
                }
                for p, samples in zip(lease["prompts"], groups, strict=True)
            }
        if self.pace:
            tokens = sum(len(s["tokens"]) for r in results.values() for s in r["samples"])
            left = tokens / self.pace - (time.perf_counter() - t0)
            if left < 0:
                log.warning(
                    f"{self.name}: pace missed: {tokens} tokens took {time.perf_counter() - t0:.2f} s, the pace "
                    f"allows {tokens / self.pace:.2f} s"
                )
            await asyncio.sleep(left)
        await self.control.post_json(
            "/v1/results",
            {
                "lease": lease["id"],
                "worker": self.name,
                "version": self.version,
                "state_hash": self.hash,
                "results": results,
                "generate_s": time.perf_counter() - t0,
            },
        )


class ModelFile(BaseModel):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][-A-Za-z0-9_.]{0,127}$")]  # a plain name: no path
    bytes: Annotated[int, Field(ge=0, le=MAX_MODEL_FILE)]
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class ModelFiles(BaseModel):
    files: Annotated[list[ModelFile], Field(max_length=64)]


@contextmanager
def episodes_of(job: dict, engine: Engine, model_dir: Path) -> Iterator[Episodes | None]:
    """task.environment's episodes, with the processes that run its turns (closed after); None
    for a job without one."""
    if job["environment"] is None:
        yield None
        return
    env = EnvironmentSpec.model_validate(job["environment"])
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    ends = end_tokens(tok, AutoConfig.from_pretrained(model_dir, local_files_only=True).eos_token_id)
    size = env.processes or min(4, os.cpu_count() or 1)
    with tempfile.TemporaryDirectory(prefix="sparrowrl-tools-") as root:  # tool calls' folders: gone with the worker
        tool = environment.ToolLimits.of(env, root)
        load = partial(environment.turn_caller, env.load, env.args, tool, env.trust_worker_rewards)
        pool = Pool(load, size, env.turn_seconds, "environment")
        try:
            yield Episodes(engine, Turns(tok, job["templated"], ends), env, pool)
        finally:
            pool.close()


async def fetch_model(control: Client, dest: Path) -> None:
    """The model's config and tokenizer from the trainer into `dest`, each file checked by its
    sha256 (the weights come from the store)."""
    for f in (await control.json("/v1/model", ModelFiles))["files"]:
        data = await control.content(f"/v1/model/{f['name']}", f["bytes"])
        if hashlib.sha256(data).hexdigest() != f["sha256"]:
            raise FetchError(f"model file {f['name']}: bytes do not hash to the listed sha256")
        (dest / f["name"]).write_bytes(data)


async def main(
    trainer: str,
    relay: str | None,
    name: str,
    host: str,
    port: int,
    rate_mbit: float | None = None,
    region: str | None = None,
    metrics_port: int | None = None,
    local_ports: list[int] | None = None,
    pace: float | None = None,
    ssl_context: ssl.SSLContext | None = None,
    served: ServingTLS | None = None,
) -> None:
    """A worker needs only the network: the job, the model's config and tokenizer, and the
    weights come from the trainer (versions from its region's relay first). /healthz and
    /readyz (once a verified version is committed) on host:port, from the start. `local_ports`
    and `pace` are for benchmarks: fixed source ports for the download streams (per-flow shaped
    links), and a generation rate to hold to. `ssl_context`: what HTTPS to the trainer and the
    relay trusts (the job's CA); `served`: its own ports (probes, metrics) over HTTPS."""
    torch.set_num_threads(1)  # workers share the machine's cores with the trainer
    worker: Worker | None = None
    app = web.Application(middlewares=[auth])  # /metrics wants a token (an admin's); the probes do not
    token = Credential.from_env().get()  # its kind, for the gate of its own port; the client reads it again
    app[GATE] = Gate.of(token, trust(token))
    add_health(app, lambda: worker is not None and worker.verified >= 0)
    add_metrics(
        app,
        lambda: [] if worker is None else worker.metrics(),
        None if metrics_port is None else (host, metrics_port),
        served,
    )
    probes = web.AppRunner(app)
    await probes.setup()
    await listen(probes, host, port, served)
    try:
        async with Client(trainer, attempts=ATTEMPTS, ssl_context=ssl_context) as control:
            job = await control.json("/v1/job", Job)
            with tempfile.TemporaryDirectory(prefix=f"sparrowrl-{name}-") as model_dir:
                await fetch_model(control, Path(model_dir))
                t0 = time.perf_counter()
                on_engine = ThreadPoolExecutor(
                    1, thread_name_prefix="engine", initializer=torch.set_num_threads, initargs=(1,)
                )
                built = await asyncio.get_running_loop().run_in_executor(
                    on_engine,
                    make_engine,
                    job["engine"],
                    model_dir,
                    job["max_model_len"],
                    job["tensor_parallel_size"],
                )
                log.info(f"{name}: {job['engine']} engine ready in {time.perf_counter() - t0:.1f} s")
                async with Subscriber(
                    [u for u in (relay, trainer) if u],
                    built.tensors(),
                    snapshots=job["mode"] == "full",
                    streams=job["streams"],
                    attempts=ATTEMPTS,
                    ssl_context=ssl_context,
                    rate_mbit=rate_mbit,
                    local_ports=local_ports,
                ) as sub:
                    with episodes_of(job, built, Path(model_dir)) as episodes:
                        worker = Worker(name, sub, control, built, on_engine, region, pace, episodes)
                        await worker.run()
    finally:
        await probes.cleanup()
