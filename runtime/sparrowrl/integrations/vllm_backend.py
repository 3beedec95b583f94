"""SparrowRL as a vLLM weight-transfer backend: `vllm serve MODEL --weight-transfer-config
'{"backend": "sparrowrl"}'` (registered by `vllm_plugin`). It lives in vLLM's worker process,
next to the model (`self.model`), and follows a SparrowRL origin (relays first):

    fetch thread ── long-poll /v1/versions ── Client.delta(v), signatures checked ──▶ staged
    /update_weights {"version": v} ── apply staged deltas up to v, verified by state hash before
        anything served changes ── load into vLLM ── read back, hash, compare ──▶ served v

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
import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.model_executor.model_loader.reload.inplace import reload_weights

from sparrowrl.auth.signing import KEY_ENV, trust
from sparrowrl.delta import DeltaError, apply_delta, state_hash
from sparrowrl.integrations.vllm_layout import Layout, hf_shapes, owners, packed, tied_modules
from sparrowrl.integrations.vllm_plugin import shield_llvmlite
from sparrowrl.transport.client import Client

shield_llvmlite()  # numba (the codec) is loaded now, before vLLM scans modules again

ORIGIN_ENV = "SPARROWRL_ORIGIN"
MAX_WAIT_S = 600.0
RETRY_S = 2.0  # after a fetch that failed (every server refused or unreachable)

_ACTIVE: list[SparrowRLWeightTransferEngine] = []  # this process's engine, for `status()`


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


class _Follower:
    """Fetches and stages new versions on a thread with its own event loop; `take` hands them to
    the engine's thread. Private: `sparrowrl.sync.Subscriber` replaces it."""

    def __init__(self, urls: list[str], token: str, trust_key, have: tuple[int | None, str]):
        self.urls, self.token, self.trust = urls, token, trust_key
        self.cond = threading.Condition()
        self.staged: dict[int, Any] = {}  # version → DeltaFile, or (state, hash) of a whole base
        self.at: int | None = have[0]  # the version the served weights are, once known
        self.start_hash = have[1]
        self.known = have[0]  # newest version held or staged
        self.failure = ""  # the last fetch's error, until a fetch succeeds
        self.refused: dict[str, int] = {}  # server → answers that did not verify
        self.loop = asyncio.new_event_loop()
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
        self.thread.join(timeout=30)

    async def _follow(self) -> None:
        async with Client(self.urls, token=self.token, trust=self.trust) as c:
            while True:
                try:
                    await self._fetch(c)
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # a fetch that gave up is retried; receive_weights reports it
                    with self.cond:
                        self.failure = f"from {c.server_url}: {type(e).__name__}: {e}"
                        self.refused = dict(c.stats.refused)
                        self.cond.notify_all()
                    print(f"sparrowrl: fetch refused or failed {self.failure}", flush=True)
                    await asyncio.sleep(RETRY_S)

    async def _fetch(self, c: Client) -> None:
        if self.known is None:  # which version the served weights are, by state hash; else a base
            listing = await c.versions()
            at = max((e["version"] for e in listing["versions"] if e["state_hash"] == self.start_hash), default=None)
            if at is None:
                state, h = await c.advance(listing["newest"])
                self._stage(listing["newest"], (state, h))
            else:
                with self.cond:
                    self.at = self.known = at
                    self.failure = ""
                    self.cond.notify_all()
        while True:
            listing = await c.versions(after=self.known, wait=30)
            newest = max([listing["newest"], *listing["producing"]])
            for v in range(self.known + 1, newest + 1):
                self._stage(v, await c.delta(v))  # cut-through while the trainer still writes it
                print(f"sparrowrl: v{v} staged from {c.server_url}", flush=True)
            with self.cond:
                self.refused = dict(c.stats.refused)

    def _stage(self, version: int, item: Any) -> None:
        with self.cond:
            self.staged[version] = item
            self.known = version
            self.failure = ""
            self.cond.notify_all()

    def _chain(self, have: int | None, target: int) -> list[int] | None:
        """The staged versions that lead from `have` to `target`: the newest whole base on the
        way, then deltas; None while one is missing."""
        bases = [v for v, x in self.staged.items() if isinstance(x, tuple) and (have is None or have < v <= target)]
        start = max(bases, default=have)
        if start is None or start > target:
            return None
        chain = ([start] if bases else []) + list(range(start + 1, target + 1))
        return chain if all(v in self.staged for v in chain) else None

    def take(self, have: int | None, target: int, wait_s: float) -> list[tuple[int, Any]]:
        """What leads from `have` (None: from the version the follower found the weights to be)
        to `target`, waiting up to `wait_s`; RuntimeError naming the fetch's error after a
        failed fetch or the deadline."""
        deadline = time.monotonic() + wait_s
        with self.cond:
            while True:
                start = self.at if have is None else have
                chain = self._chain(start, target)
                if chain is not None:
                    return [(v, self.staged[v]) for v in chain]
                if self.failure:
                    raise RuntimeError(f"v{target} is not fetched: {self.failure}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"v{target} was not fetched within {wait_s:g} s (newest staged: v{self.known})")
                self.cond.wait(left)

    def done(self, version: int) -> None:
        """Drop what is staged up to `version`, which is now held."""
        with self.cond:
            for v in [v for v in self.staged if v <= version]:
                del self.staged[v]


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
        self.held: tuple[int | None, str] = (None, h)  # version and hash of `state`
        self.served: tuple[int | None, str] = (None, h)  # of what vLLM computes with, read back
        self.counts = {"ok": 0, "failed": 0, "mismatch": 0}
        self.last_error = ""
        self.token = os.environ.get("SPARROWRL_TOKEN", "")
        self.trust = trust(self.token)
        if self.trust is None:
            raise ValueError(
                f"the sparrowrl backend checks the trainer's signatures: set {KEY_ENV} (or SPARROWRL_TOKEN to the "
                "job's secret)"
            )
        env = os.environ.get(ORIGIN_ENV, "")
        self.urls = _urls(env, ORIGIN_ENV) if env else []
        self.follower = _Follower(self.urls, self.token, self.trust, self.held) if self.urls else None
        _ACTIVE[:] = [self]
        print(f"sparrowrl: backend ready, weights hash to {h}, following {self.urls or 'nothing yet'}", flush=True)

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
        if self.follower is not None:
            self.follower.stop()
        self.urls = init_info.origin
        self.follower = _Follower(self.urls, self.token, self.trust, self.held)
        print(f"sparrowrl: following {self.urls}", flush=True)

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
        if self._version() == target and self.held[0] in (None, target):
            return
        if self.held[0] is not None and target < self.held[0]:
            raise ValueError(f"update_info.version: v{target} is older than the v{self.held[0]} held here")
        t0 = time.perf_counter()
        try:
            chain = self.follower.take(self.held[0], target, update_info.wait_s)
            t1 = time.perf_counter()
            for v, item in chain:  # each verified before it changes anything (apply_delta's contract)
                if isinstance(item, tuple):
                    for n, t in item[0].items():
                        self.state[n].copy_(t)
                    self.held = (v, item[1])
                else:
                    self.held = (v, apply_delta(item, self.state, base_hash=self.held[1]))
                self.follower.done(v)
        except (DeltaError, RuntimeError) as e:
            self.counts["failed"] += 1
            self.last_error = f"v{target}: {e}"
            if not self.on_cpu:  # the live weights: a chain that broke midway serves its last good version
                self.served = self.held
            print(f"sparrowrl: update to v{target} refused: {e}; serving v{self._version()}", flush=True)
            raise
        t2 = time.perf_counter()
        if self.on_cpu:
            reload_weights(
                self.vllm_config, self.model, iter(self.state.items()), weights_path=None, is_checkpoint_format=True
            )
            for module in tied_modules(self.model, owners(self.model)):  # a reload repacks its owner only
                module.quant_method.process_weights_after_loading(module)
        t3 = time.perf_counter()
        h = state_hash(self._readback())
        t4 = time.perf_counter()
        if h != self.held[1]:
            self.counts["mismatch"] += 1
            self.served = (None, h)
            self.last_error = f"v{target}: vLLM's weights hash to {h}, not the version's {self.held[1]}"
            print(f"sparrowrl: {self.last_error}", flush=True)
            raise RuntimeError(self.last_error)
        self.served = self.held
        self.counts["ok"] += 1
        print(
            f"sparrowrl: serving v{target} ({h}): waited {t1 - t0:.2f} s, applied {t2 - t1:.2f} s, "
            f"loaded {t3 - t2:.2f} s, read back and hashed {t4 - t3:.2f} s",
            flush=True,
        )

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
        return self.follower.at if self.served[1] == self.follower.start_hash else None

    def status(self) -> dict[str, Any]:
        f = self.follower
        return {
            "version": self._version(),
            "state_hash": self.served[1],
            "held_version": self.held[0],
            "updates": dict(self.counts),
            "last_error": self.last_error,
            "servers": self.urls,
            "staged": sorted(f.staged) if f else [],
            "fetch_error": f.failure if f else "",
            "refused": dict(f.refused) if f else {},
        }


def status() -> dict[str, Any]:
    """This process's backend's state (`SparrowRLWorkerExtension.sparrowrl_status`)."""
    if not _ACTIVE:
        raise RuntimeError("no sparrowrl weight-transfer engine in this worker: --weight-transfer-config?")
    return _ACTIVE[0].status()
