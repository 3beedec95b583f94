"""TRL's `GRPOTrainer` (TRL 1.16, `use_vllm=True, vllm_mode="server"`) syncing weights to `vllm
serve` servers through SparrowRL instead of NCCL:

    every rank ── Publisher.publish() (the bf16 delta, signed) ──▶ Origin (rank 0) ─▶ relays
    main process ── /pause ─ /start_weight_update ─ /update_weights {"version": v} ─
        /finish_weight_update ─ /resume ──▶ each server, whose sparrowrl backend applies v

TRL has no hook for its weight sync: `GRPOTrainer.__init__` builds `VLLMGeneration` by its name in
`trl.trainer.grpo_trainer`, so `SparrowRLGRPOTrainer` rebinds that name to the subclass below
for the length of its own `__init__` (under a lock) and restores it. The subclass keeps TRL's
`VLLMClient` for generation and skips its NCCL communicator (which needs CUDA and the servers'
NCCL backend). TRL is imported on first use of these names, not with this module."""

from __future__ import annotations

import functools
import os
import threading
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sparrowrl.integrations.vllm_client import MAX_WAIT_S, update_server
from sparrowrl.sync import Origin, Publisher

TOKEN_ENV = "SPARROWRL_TOKEN"
_SWAP = threading.Lock()  # one trainer at a time rebinds TRL's module global


class SparrowRLConfig(BaseModel):
    """Where the versions go and how the servers are reached."""

    model_config = ConfigDict(extra="forbid")

    store: Path = Field(description="the Publisher's store folder (rank 0's disk); an existing one is taken up again")
    host: str = Field("127.0.0.1", description="the origin's address on rank 0; the servers' SPARROWRL_ORIGIN")
    port: int = Field(8470, ge=1, le=65535, description="the origin's port, known to the servers up front")
    base_every: int = Field(10, ge=1, le=1_000_000, description="a full snapshot every K versions")
    servers: list[str] = Field(
        default_factory=list, description="more vLLM servers to update, besides the one TRL generates with"
    )
    wait_s: float = Field(60.0, gt=0, le=MAX_WAIT_S, description="how long a server may wait for a version to arrive")
    tls_cert: Path | None = Field(
        None, description="serve the origin over HTTPS with this PEM certificate (the servers: SPARROWRL_CA_CERT)"
    )
    tls_key: Path | None = Field(None, description="tls_cert's PEM private key")

    @model_validator(mode="after")
    def _both(self) -> SparrowRLConfig:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key: give both, or neither")
        return self


@functools.cache
def _classes() -> tuple[type, type]:
    """The TRL subclasses, made on first use (TRL imports vLLM and much else)."""
    import trl.trainer.grpo_trainer as grpo
    from accelerate.utils import broadcast_object_list
    from trl.generation.vllm_client import VLLMClient
    from trl.generation.vllm_generation import VLLMGeneration

    class SparrowRLVLLMGeneration(VLLMGeneration):
        """TRL's server-mode generation, with weights synced by a SparrowRL Publisher."""

        def __init__(self, *args, sparrowrl: SparrowRLConfig, **kwargs):
            self.sparrowrl, self.started = sparrowrl, False
            self.publisher: Publisher | None = None
            self.origin: Origin | None = None
            self.sync_seconds: list[float] = []  # per sync, from publish to the last server resumed
            super().__init__(*args, **kwargs)

        def _init_vllm(self) -> None:
            """TRL's client for generation, without `init_communicator` (NCCL)."""
            if self.mode != "server":
                raise ValueError(f"vllm_mode: SparrowRL updates vLLM servers, so 'server', not {self.mode!r}")
            if self.accelerator.is_main_process:
                url = self.server_base_url or f"http://{self.server_host}:{self.server_port}"
                self.vllm_client = VLLMClient(
                    base_url=url, group_port=self.group_port, connection_timeout=self.server_timeout
                )

        def _start(self) -> bool:
            """The Publisher over the policy as it is now (FSDP2 has wrapped it by then), and the
            origin on the main process. Returns whether the store was taken up again."""
            model = self.accelerator.unwrap_model(self.model)
            if hasattr(model, "peft_config"):
                raise NotImplementedError(
                    "PEFT: the servers hold the merged model, and the Publisher the adapter's base; "
                    "merge the adapter into the model, or train without PEFT"
                )
            if self._dist.is_zero3 or self._dist.fsdp_version == 1:
                raise NotImplementedError(
                    "DeepSpeed ZeRO-3 and FSDP1 hold flattened shards the Publisher cannot diff by name; "
                    "use FSDP2 (DTensors), DDP or a single process"
                )
            cfg = self.sparrowrl
            resumed = broadcast_object_list([(cfg.store / "store.json").exists()])[0]
            if self._dist.fsdp_version == 2 or self.accelerator.is_main_process:
                self.publisher = Publisher(model, cfg.store, base_every=cfg.base_every)
            if self.accelerator.is_main_process:
                assert self.publisher is not None  # made above, on the main process
                self.origin = self.publisher.serve(
                    os.environ.get(TOKEN_ENV, ""), cfg.host, cfg.port, cfg.tls_cert, cfg.tls_key
                )
            return resumed

        def sync_weights(self) -> None:
            """Publish the policy (every rank, together under FSDP2), then bring each server to it.
            The first sync of a new store publishes nothing: version 0 is the checkpoint the
            servers started from, which their backends find by its state hash."""
            t0 = time.perf_counter()
            if not self.started:
                self.started = True
                if not self._start():
                    return
            version = self.publisher.publish() if self.publisher is not None else None
            if self.accelerator.is_main_process:
                assert version is not None  # the main process publishes
                for url in [self.vllm_client.base_url, *self.sparrowrl.servers]:
                    update_server(url.rstrip("/"), version, self.sparrowrl.wait_s)
                self.sync_seconds.append(time.perf_counter() - t0)

        def close(self) -> None:
            """Stop the origin (the store stays for `sparrowrl serve`)."""
            if self.origin is not None:
                self.origin.close()
                self.origin = None

    class SparrowRLGRPOTrainer(grpo.GRPOTrainer):
        """`GRPOTrainer` whose weight sync is SparrowRL's: `sparrowrl=SparrowRLConfig(store=...)`
        besides GRPOTrainer's own arguments; `args` must say `use_vllm=True, vllm_mode="server"`."""

        def __init__(self, *args: Any, sparrowrl: SparrowRLConfig, **kwargs: Any):
            def make(**kw: Any) -> SparrowRLVLLMGeneration:
                return SparrowRLVLLMGeneration(sparrowrl=sparrowrl, **kw)

            with _SWAP:
                grpo.VLLMGeneration = make
                try:
                    super().__init__(*args, **kwargs)
                finally:
                    grpo.VLLMGeneration = VLLMGeneration
            if not (self.use_vllm and self.vllm_mode == "server"):
                raise ValueError('args: SparrowRL needs use_vllm=True and vllm_mode="server"')

        @property
        def publisher(self) -> Publisher | None:
            """The Publisher once the first sync made it (rank 0 and FSDP2 ranks)."""
            return self.vllm_generation.publisher

    return SparrowRLVLLMGeneration, SparrowRLGRPOTrainer


def __getattr__(name: str) -> Any:
    if name in ("SparrowRLVLLMGeneration", "SparrowRLGRPOTrainer"):
        return _classes()[name == "SparrowRLGRPOTrainer"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
