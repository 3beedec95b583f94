"""SparrowRL as a vLLM weight-transfer backend: `vllm serve MODEL --weight-transfer-config
'{"backend": "sparrowrl"}'` (registered by `vllm_plugin`). It lives in vLLM's worker process,
next to the model (`self.model`), and follows a SparrowRL origin (relays first):

    fetch thread ── Subscriber.follow ── Subscriber.fetch(v), signatures checked ──▶ staged
    /update_weights {"version": v} ── Subscriber.apply staged deltas up to v, verified by state
        hash before anything served changes ── load into vLLM ── read back, hash, compare ──▶ served v

Fetching never runs inside vLLM's engine loop: `receive_weights` only waits, bounded, for what
the thread has staged. On GPU a delta applies in place into views of vLLM's parameters. On CPU
vLLM repacks linear weights into kernels and leaves empty parameters, so the backend keeps the
policy by the trainer's names, applies into that copy, and reloads it through vLLM's layerwise
reload (what `LLM.collective_rpc("reload_weights")` does); the hash is then of the weights read
back out of the kernels, not of the copy.

Configuration: `SPARROWRL_ORIGIN` (comma-separated URLs, relays first, the origin last),
`SPARROWRL_TOKEN` and `SPARROWRL_TRAINER_KEY` from the environment, which vLLM's processes
inherit; `POST /init_weight_transfer_engine {"init_info": {"origin": [...]}}` may replace the
URLs (never secrets: dev-mode bodies are logged and unauthenticated)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import ssl
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from prometheus_client import Counter, Gauge
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.model_executor.model_loader.reload.inplace import reload_weights

from sparrowrl.auth.credential import Credential
from sparrowrl.auth.signing import KEY_ENV, trust
from sparrowrl.delta import DeltaError, state_hash
from sparrowrl.integrations.vllm_client import MAX_WAIT_S
from sparrowrl.integrations.vllm_cpu import shield_llvmlite
from sparrowrl.integrations.vllm_layout import Layout, hf_shapes, owners, packed, tied_modules
from sparrowrl.sync import Staged, Subscriber
from sparrowrl.transport.http import TrustedCA

log = logging.getLogger(__name__)

shield_llvmlite()  # numba (the codec) is loaded now, before vLLM scans modules again

ORIGIN_ENV = "SPARROWRL_ORIGIN"
CA_ENV = "SPARROWRL_CA_CERT"  # the CA an HTTPS origin's and relays' certificates must come from
RETRY_S = 2.0  # after a fetch that failed (every server refused or unreachable)
MAX_STAGED = 8  # versions fetched ahead of the one served; past that the fetch loop waits
STOP_S = 30.0  # for the fetch thread to end

_ACTIVE: list[SparrowRLWeightTransferEngine] = []  # this process's engine, for `status()`

# In vLLM's worker process: they reach the API server's /metrics where PROMETHEUS_MULTIPROC_DIR is set
UPDATES = Counter("sparrowrl_weight_updates", "Weight updates asked of the sparrowrl backend, by result", ["result"])
REFUSED = Counter(
    "sparrowrl_refused_answers", "Answers that did not verify (forged, altered, malformed), by server", ["server"]
)
SERVED = Gauge(
    "sparrowrl_served_version", "The version vLLM computes with, verified by state hash", multiprocess_mode="livemax"
)


def _urls(value: Any, field_name: str) -> list[str]:
    urls = [u.strip() for u in value.split(",")] if isinstance(value, str) else value
    if not isinstance(urls, list) or not urls or not all(isinstance(u, str) and u for u in urls):
        raise ValueError(f"{field_name}: a non-empty list of URLs (relays first, the origin last), got {value!r}")
    bad = [u for u in urls if not u.startswith(("http://", "https://"))]
    if bad:
        raise ValueError(f"{field_name}: {bad[0]!r} is not an http(s) URL")
    return urls


@dataclass
class SparrowRLInitInfo(WeightTransferInitInfo):
    """Where versions come from: relays first, the origin last (replaces `SPARROWRL_ORIGIN`)."""

    origin: list[str] | str = field(default_factory=list)

    def __post_init__(self) -> None:
        self.origin = _urls(self.origin, "init_info.origin")


@dataclass
class SparrowRLUpdateInfo(WeightTransferUpdateInfo):
    """Serve version `version`; wait up to `wait_s` for its fetch to be staged."""

    version: int
    wait_s: float = 60.0

    def __post_init__(self) -> None:
        if isinstance(self.version, bool) or not isinstance(self.version, int) or self.version < 0:
            raise ValueError(f"update_info.version: a version number >= 0, got {self.version!r}")
        if (
            not isinstance(self.wait_s, int | float)
            or not math.isfinite(self.wait_s)
            or not 0 < self.wait_s <= MAX_WAIT_S
        ):
            raise ValueError(f"update_info.wait_s: seconds in (0, {MAX_WAIT_S:g}], got {self.wait_s!r}")


def trusting_env() -> ssl.SSLContext | None:
    """What HTTPS to the origin and relays trusts: the CA in SPARROWRL_CA_CERT alone (a job's own),
    else the system's. ValueError: that file does not load."""
    ca = os.environ.get(CA_ENV)
    try:
        return TrustedCA.of(Path(ca)) if ca else None
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"{CA_ENV} {ca}: {getattr(e, 'strerror', None) or e}") from None


class _Follower:
    """Stages new versions on a thread with its own event loop (`Subscriber.follow` and `fetch`:
    network and signature checks); `take` hands them to the engine's thread, which applies them
    (`Subscriber.apply`: compute, verified before anything changes).

    At most MAX_STAGED versions wait staged: past that the fetch loop waits until the engine
    applies some (`done`). An update further ahead takes what is staged, applies it, and takes
    the rest as it is fetched (`take` hands out a part of the way while there is no room)."""

    def __init__(self, sub: Subscriber):
        self.sub = sub
        self.cond = threading.Condition()
        self.staged: dict[int, Staged] = {}
        self.known: int | None = sub.version if sub.version >= 0 else None  # newest version held or staged
        self.failures = 0  # fetches that failed so far: `take` fails on those after it began only
        self.failure = ""  # the last failed fetch's error, until a fetch succeeds
        self.found: int | None = None  # the version the loaded weights were found to be, by state hash
        self.refused: dict[str, int] = {}  # server → answers that did not verify
        self.loop = asyncio.new_event_loop()
        self.room = asyncio.Event()  # set (on the loop) when `done` drops staged versions
        self.task = self.loop.create_task(self._follow())
        self.thread = threading.Thread(target=self._run, name="sparrowrl-fetch", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self.task)
        except asyncio.CancelledError:
            pass
        finally:
            self.loop.close()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.task.cancel)
        self.thread.join(timeout=STOP_S)
        if self.thread.is_alive():
            log.warning(f"sparrowrl: the fetch thread did not stop within {STOP_S:g} s; left running")

    async def _follow(self) -> None:
        again = False
        async with self.sub:
            while True:
                try:
                    await self._fetch(again)
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # a fetch that gave up is retried; receive_weights reports it
                    again = True
                    with self.cond:
                        self.failures += 1
                        self.failure = f"from {self.sub.server_url}: {type(e).__name__}: {e}"
                        self._refused()
                        self.cond.notify_all()
                    log.warning(f"sparrowrl: fetch refused or failed {self.failure}")
                    await asyncio.sleep(RETRY_S)

    async def _fetch(self, again: bool) -> None:
        """Stage each new version as it appears. `again`: after a failed fetch, when the deltas
        from `known` may be gone (pruned) or cost more than a base: then the newest whole."""
        if self.known is None:  # which version the loaded weights are, by state hash; else the newest whole
            at = await self.sub.find()
            if at is None:
                self._stage(await self.sub.fetch(await self.sub.newest(), full=True))
            else:  # what vLLM loaded, read back at start, is version `at`
                SERVED.set(at)
                with self.cond:
                    self.known, self.found, self.failure = at, at, ""
                    self.cond.notify_all()
        elif again:
            newest = await self.sub.newest()
            if newest > self.known and (await self.sub.client.plan(newest, self.known))["route"] == "base":
                await self._room()
                self._stage(await self.sub.fetch(newest, full=True))
                log.info(f"sparrowrl: v{newest} staged whole from {self.sub.server_url}")
        async for v in self.sub.follow(after=self.known):
            await self._room()
            self._stage(await self.sub.fetch(v, full=False))  # cut-through while the trainer still writes it
            log.info(f"sparrowrl: v{v} staged from {self.sub.server_url}")
            with self.cond:
                self._refused()

    async def _room(self) -> None:
        """Wait while MAX_STAGED versions are staged (`done` makes room)."""
        while True:
            self.room.clear()  # before the check: a `done` after it sets it again
            with self.cond:
                if len(self.staged) < MAX_STAGED:
                    return
            await self.room.wait()

    def _refused(self) -> None:
        """Take up the subscriber's count of refused answers per server (under `cond`)."""
        for server, n in self.sub.stats.refused.items():
            if n > self.refused.get(server, 0):
                REFUSED.labels(server).inc(n - self.refused.get(server, 0))
        self.refused = dict(self.sub.stats.refused)

    def _stage(self, staged: Staged) -> None:
        with self.cond:
            self.staged[staged.version] = staged
            self.known = staged.version
            self.failure = ""
            self.cond.notify_all()

    def _chain(self, have: int, target: int) -> list[int]:
        """The staged versions that lead from `have` (-1: nothing) toward `target`, as far as
        they are staged: the newest whole state on the way, then deltas."""
        wholes = [v for v, x in self.staged.items() if x.state is not None and have < v <= target]
        at = max(wholes, default=have)
        chain = [at] if wholes else []
        while at >= 0 and at < target and at + 1 in self.staged:
            at += 1
            chain.append(at)
        return chain

    def take(self, target: int, deadline: float, since: int) -> tuple[list[Staged], bool]:
        """What leads from the version held to `target` and whether it gets there: all of it, or,
        while no room is left to stage more, the part staged (apply it, `done`, and take again).
        Waits until `deadline` (time.monotonic()); RuntimeError naming the fetch's error after a
        fetch failed later than the `since`-th failure, or at the deadline."""
        with self.cond:
            while True:
                have = self.sub.version
                chain = self._chain(have, target)
                if (chain[-1] if chain else have) == target or (chain and len(self.staged) >= MAX_STAGED):
                    return [self.staged[v] for v in chain], (chain[-1] if chain else have) == target
                if self.failures > since:
                    raise RuntimeError(f"v{target} is not fetched: {self.failure}")
                left = deadline - time.monotonic()
                if left <= 0:
                    last = f"; the last failed fetch: {self.failure}" if self.failure else ""
                    raise RuntimeError(f"v{target} was not fetched in time (newest staged: v{self.known}){last}")
                self.cond.wait(left)

    def done(self, version: int) -> None:
        """Drop what is staged up to `version`, which is now held: room for the fetch loop."""
        with self.cond:
            for v in [v for v in self.staged if v <= version]:
                del self.staged[v]
        self.loop.call_soon_threadsafe(self.room.set)


class SparrowRLWeightTransferEngine(WeightTransferEngine[SparrowRLInitInfo, SparrowRLUpdateInfo]):
    init_info_cls = SparrowRLInitInfo
    update_info_cls = SparrowRLUpdateInfo
    supports_draft_weight_update = False  # one policy, one layout

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module):
        super().__init__(config, vllm_config, device, model)
        hf = self.model_config.hf_config
        self.layout = Layout(hf_shapes(hf), hf.vocab_size, packed(model))
        self.on_cpu = device.type == "cpu"
        if self.on_cpu:  # the policy by the trainer's names, as vLLM loaded it
            self.state = {n: t.clone() for n, t in self._readback(zeros=True).items()}
        else:  # views into vLLM's parameters: deltas apply into the live weights
            self.state = self.layout.live(model)
        h = state_hash(self.state)
        self.start_hash = h  # of the weights vLLM loaded
        self.served: tuple[int | None, str] = (None, h)  # version and hash of what vLLM computes with, read back
        self.counts = {"ok": 0, "failed": 0, "mismatch": 0}
        self.last_error = ""
        self.token = Credential.from_env()  # SPARROWRL_TOKEN, or its file's: read again when refreshed
        self._ssl = trusting_env()
        self._key = os.environ.get(KEY_ENV) or None
        if trust(self.token.get(), self._key) is None:
            raise ValueError(
                f"the sparrowrl backend checks the trainer's signatures: set {KEY_ENV} (or SPARROWRL_TOKEN to the "
                "job's secret)"
            )
        env = os.environ.get(ORIGIN_ENV, "")
        self.urls = _urls(env, ORIGIN_ENV) if env else []
        self.follower = self._follow(self.urls, None) if self.urls else None
        _ACTIVE[:] = [self]
        log.info(f"sparrowrl: backend ready, weights hash to {h}, following {self.urls or 'nothing yet'}")

    def _follow(self, urls: list[str], held: int | None) -> _Follower:
        """Keep `state` at the versions `urls` serve (`held`: the version it holds, if known)."""
        sub = Subscriber(urls, self.state, held=held, token=self.token, trainer_key=self._key, ssl_context=self._ssl)
        return _Follower(sub)

    @property
    def _held(self) -> int | None:
        """The version `state` holds, once known."""
        v = self.follower.sub.version if self.follower is not None else -1
        return v if v >= 0 else None

    def _readback(self, zeros: bool = False) -> dict[str, torch.Tensor]:
        if not self.on_cpu:
            live = self.layout.live(self.model)  # the parameters vLLM holds now: deltas must go into these
            moved = [n for n, t in live.items() if t.data_ptr() != self.state[n].data_ptr()]
            if moved:
                raise RuntimeError(f"vLLM replaced the storage of {moved[:3]}: updates would miss the live weights")
            return live
        like = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in self.layout.shapes.items()} if zeros else self.state
        return self.layout.readback(self.model, owners(self.model), like)

    def init_transfer_engine(self, init_info: SparrowRLInitInfo) -> None:
        """Follow other servers from now on (what is staged from the old ones is dropped)."""
        held, served = self._held, self._version()
        if self.follower is not None:
            self.follower.stop()
        self.served = (served, self.served[1])  # the version found at start was the old follower's to know
        self.urls = _urls(init_info.origin, "init_info.origin")  # a list by now (__post_init__); typed as given
        self.follower = self._follow(self.urls, held)
        log.info(f"sparrowrl: following {self.urls}")

    def start_weight_update(self) -> None:
        pass  # nothing to prepare: a version is staged before the update asks for it

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """The base class's, without its device sync on CPU, where it raises (no accelerator)."""
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: SparrowRLUpdateInfo) -> None:
        target = update_info.version
        if self.follower is None:
            raise RuntimeError(
                f"no server to fetch from: set {ORIGIN_ENV} or POST /init_weight_transfer_engine "
                '{"init_info": {"origin": [...]}}'
            )
        f, sub = self.follower, self.follower.sub
        held = self._held  # read once: the fetch thread's find() may set it now (its hash first)
        if self._version() == target and held in (None, target):
            return
        if held is not None and target < held:
            raise ValueError(f"update_info.version: v{target} is older than the v{held} held here")
        t0 = time.perf_counter()
        deadline, since = time.monotonic() + update_info.wait_s, f.failures
        applied = None  # the last version applied here, if any
        try:
            whole = False
            while not whole:  # more than one take when more is on the way than MAX_STAGED
                chain, whole = f.take(target, deadline, since)
                for staged in chain:  # each verified before it changes anything (Subscriber.apply's contract)
                    sub.apply(staged)
                    f.done(staged.version)
                    applied = staged.version
            t1 = time.perf_counter()
        except (DeltaError, RuntimeError) as e:
            self._count("failed")
            self.last_error = f"v{target}: {e}"
            if not self.on_cpu and applied is not None:  # the live weights: a chain that broke midway
                self.served = (applied, sub.state_hash)  # serves its last good version
            log.error(f"sparrowrl: update to v{target} refused: {e}; serving v{self._version()}")
            raise
        t2 = time.perf_counter()
        if self.on_cpu:
            try:
                reload_weights(
                    self.vllm_config, self.model, iter(self.state.items()), weights_path=None, is_checkpoint_format=True
                )
                for module in tied_modules(self.model, owners(self.model)):  # a reload repacks its owner only
                    getattr(module, "quant_method").process_weights_after_loading(module)  # vLLM's, on its layers
            except Exception as e:  # vLLM's weights may be partly reloaded: which version they are is unknown
                self._count("failed")
                self.served = (None, "")
                self.last_error = f"v{target}: vLLM's reload failed: {type(e).__name__}: {e}"
                log.error(f"sparrowrl: {self.last_error}; the served weights are unknown")
                raise
        t3 = time.perf_counter()
        h = state_hash(self._readback())
        t4 = time.perf_counter()
        if h != sub.state_hash:
            self._count("mismatch")
            self.served = (None, h)
            self.last_error = f"v{target}: vLLM's weights hash to {h}, not the version's {sub.state_hash}"
            log.error(f"sparrowrl: {self.last_error}")
            raise RuntimeError(self.last_error)
        self.served = (target, h)
        SERVED.set(target)
        self._count("ok")
        log.info(
            f"sparrowrl: serving v{target} ({h}): waited and applied {t1 - t0:.2f} s, "
            f"loaded {t3 - t2:.2f} s, read back and hashed {t4 - t3:.2f} s"
        )

    def _count(self, result: str) -> None:
        self.counts[result] += 1
        UPDATES.labels(result).inc()

    def finish_weight_update(self) -> None:
        pass  # loaded and verified in receive_weights; the version is vLLM's to record

    def shutdown(self) -> None:
        if self.follower is not None:
            self.follower.stop()
            self.follower = None

    def _version(self) -> int | None:
        """The version vLLM serves: the last one verified here, or at start the one the follower
        found the loaded weights to be."""
        if self.served[0] is not None or self.follower is None:
            return self.served[0]
        return self.follower.found if self.served[1] == self.start_hash else None

    def status(self) -> dict[str, Any]:
        f, held = self.follower, self._held
        with f.cond if f else contextlib.nullcontext():  # the fetch thread stages meanwhile
            fetch = {
                "staged": sorted(f.staged) if f else [],
                "fetch_error": f.failure if f else "",
                "refused": dict(f.refused) if f else {},
            }
        return {
            "version": self._version(),
            "state_hash": self.served[1],
            "held_version": held,
            "updates": dict(self.counts),
            "last_error": self.last_error,
            "servers": self.urls,
            **fetch,
        }


def status() -> dict[str, Any]:
    """This process's backend's state (`SparrowRLWorkerExtension.sparrowrl_status`)."""
    if not _ACTIVE:
        raise RuntimeError("no sparrowrl weight-transfer engine in this worker: --weight-transfer-config?")
    return _ACTIVE[0].status()
