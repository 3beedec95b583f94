"""The job's sections about its workers: how they generate (`rollout`), how new weights reach them
(`sync`), and where they run for `sparrowrl run` (`topology`)."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from sparrowrl.spec.kubespec import Scheduling
from sparrowrl.spec.messages import MAX_MODEL_LEN, MAX_TENSOR_PARALLEL
from sparrowrl.spec.section import Section


class RolloutSpec(Scheduling):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.tensorParallelSize) || self.tensorParallelSize == 1 || "
                    "(has(self.engine) && self.engine == 'vllm')",
                    "message": "tensorParallelSize above 1 needs engine: vllm",
                }
            ]
        }
    )
    engine: Literal["hf", "vllm"] = "hf"
    groups_per_lease: int = Field(2, ge=1, le=4096, description="The most prompt groups a worker takes at once.")
    split: Literal["balanced", "pull", "even"] = Field(
        "balanced",
        description=(
            "How a batch is shared: balanced sizes each lease by the worker's measured generation rate and link, so "
            "that all finish together; pull gives groupsPerLease to whoever asks; even gives each worker an equal "
            "quota."
        ),
    )
    lease_seconds: float = Field(
        120.0, ge=1, le=86_400, description="A lease not returned by then is handed to another worker."
    )
    max_model_len: int | None = Field(
        None,
        ge=16,
        le=MAX_MODEL_LEN,
        description=(
            "The longest prompt plus completion a worker's engine holds; default: 2048 or the model's context if "
            "shorter with vllm, the model's own with hf."
        ),
    )
    tensor_parallel_size: int = Field(
        1, ge=1, le=MAX_TENSOR_PARALLEL, description="GPUs each vllm worker shards its model over (vllm only)."
    )

    @model_validator(mode="after")
    def _tensor_parallel(self) -> RolloutSpec:
        if self.tensor_parallel_size > 1 and self.engine != "vllm":
            raise ValueError(
                f"tensorParallelSize {self.tensor_parallel_size} needs engine: vllm; the {self.engine} engine "
                f"runs on one device"
            )
        gpus = self.resources.limits.get("nvidia.com/gpu")
        if gpus is not None and (not gpus.isdigit() or int(gpus) < self.tensor_parallel_size):
            raise ValueError(
                f"resources.limits: nvidia.com/gpu is {gpus}, fewer than tensorParallelSize "
                f"({self.tensor_parallel_size}): each shard takes a GPU of its own"
            )
        return self


class SyncSpec(Section):
    mode: Literal["sparse", "full"] = "sparse"
    streams: int = Field(4, ge=1, le=64)
    staleness: int = Field(1, ge=0, le=8, description="Versions a rollout's policy may lag the trainer's.")
    base_every: int = Field(
        10, ge=1, le=1_000_000, description="A full snapshot every this many versions (sparse mode)."
    )
    cut_through: bool = Field(
        True,
        description=(
            "Serve each delta while it is being written; false: only once it is sealed (store-and-forward, "
            "for comparison)."
        ),
    )


class RegionSpec(Section):
    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]{0,30}[a-z0-9])?$", max_length=32)
    workers: int = Field(1, ge=0, le=64)
    relay: bool = True
    bandwidth_mbit: float | None = Field(None, gt=0, le=1e6, description="Cap on this region's link to the trainer.")


class TopologySpec(Section):
    """Regions for `sparrowrl run`; in a cluster, `placements` say where each region runs."""

    regions: list[RegionSpec] = Field(default_factory=lambda: [RegionSpec(name="local")], min_length=1, max_length=64)

    @model_validator(mode="after")
    def _names_and_workers(self) -> TopologySpec:
        names = [r.name for r in self.regions]
        if len(set(names)) != len(names):
            raise ValueError(f"region names must be unique, got {names}")
        if not sum(r.workers for r in self.regions):
            raise ValueError("at least one region needs a worker")
        return self
