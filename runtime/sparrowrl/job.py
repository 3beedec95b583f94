"""The job spec: one pydantic model in the shape of a Kubernetes object, read by `sparrowrl run`
and by the operator alike. Field names are the YAML's (camelCase); unknown or invalid fields are
refused with the field's path and the reason."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

API_VERSION = "sparrowrl.dev/v1alpha1"


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True, frozen=True)


class TinyModel(_Spec):
    """A Qwen3 made from config, with the built-in character tokenizer."""
    hidden: int = Field(128, ge=16, le=4096)
    layers: int = Field(2, ge=1, le=64)
    heads: int = Field(4, ge=1, le=64)
    warmup_steps: int = Field(0, ge=0, description="Supervised steps on the task before RL, half of them with a "
                                                   "wrong answer: a model that knows the task but often samples "
                                                   "wrongly, where RL post-training starts.")

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyModel:
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})")
        return self


class ModelSpec(_Spec):
    path: str | None = Field(None, description="A local Hugging Face model folder.")
    tiny: TinyModel | None = None
    tokenizer: str | None = Field(None, description="A tokenizer folder; default: the model folder's.")

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if (self.path is None) == (self.tiny is None):
            raise ValueError("give exactly one of model.path (a Hugging Face folder) and model.tiny")
        if self.tiny is not None and self.tokenizer is not None:
            raise ValueError("model.tiny uses the built-in character tokenizer; drop model.tokenizer")
        return self


class TaskSpec(_Spec):
    builtin: Literal["add", "reverse"] | None = None
    jsonl: str | None = Field(None, description="A file of {\"prompt\", \"answer\"} lines.")
    reward: str | None = Field(None, description="exact | numeric | char_match | module:function; "
                                                 "default: the built-in task's own, exact for JSONL.")

    @model_validator(mode="after")
    def _one_source(self) -> TaskSpec:
        if (self.builtin is None) == (self.jsonl is None):
            raise ValueError("give exactly one of task.builtin and task.jsonl")
        return self


class GrpoSpec(_Spec):
    learning_rate: float = Field(1e-5, gt=0, le=1)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    group_size: int = Field(8, ge=2, le=256)
    prompts_per_step: int = Field(16, ge=1)
    clip: float = Field(0.2, gt=0, lt=1)
    kl_coef: float = Field(0.0, ge=0)
    temperature: float = Field(1.0, gt=0)
    max_new_tokens: int = Field(8, ge=1, le=4096)


class RolloutSpec(_Spec):
    engine: Literal["hf", "vllm"] = "hf"
    groups_per_lease: int = Field(2, ge=1, description="Prompt groups a worker takes at once.")
    lease_seconds: float = Field(120.0, gt=0, description="A lease not returned by then is handed to another worker.")


class SyncSpec(_Spec):
    mode: Literal["sparse", "full"] = "sparse"
    streams: int = Field(4, ge=1, le=64)
    staleness: int = Field(1, ge=0, le=8, description="Versions a rollout's policy may lag the trainer's.")
    base_every: int = Field(10, ge=1, description="A full snapshot every this many versions (sparse mode).")


class RegionSpec(_Spec):
    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]{0,30}[a-z0-9])?$")
    workers: int = Field(1, ge=0, le=64)
    relay: bool = True
    bandwidth_mbit: float | None = Field(None, gt=0, description="Cap on this region's link to the trainer.")


class TopologySpec(_Spec):
    regions: list[RegionSpec] = Field(default_factory=lambda: [RegionSpec(name="local")], min_length=1)

    @model_validator(mode="after")
    def _names_and_workers(self) -> TopologySpec:
        names = [r.name for r in self.regions]
        if len(set(names)) != len(names):
            raise ValueError(f"region names must be unique, got {names}")
        if not sum(r.workers for r in self.regions):
            raise ValueError("at least one region needs a worker")
        return self


class JobSpec(_Spec):
    steps: int = Field(50, ge=1)
    seed: int = 0
    model: ModelSpec
    task: TaskSpec
    grpo: GrpoSpec = GrpoSpec()
    rollout: RolloutSpec = RolloutSpec()
    sync: SyncSpec = SyncSpec()
    topology: TopologySpec = TopologySpec()


class Metadata(_Spec):
    model_config = ConfigDict(extra="allow", frozen=True)  # labels, annotations, namespace, ...
    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


class SparrowRLJob(_Spec):
    api_version: Literal["sparrowrl.dev/v1alpha1"] = Field(alias="apiVersion")
    kind: Literal["SparrowRLJob"]
    metadata: Metadata
    spec: JobSpec


class JobError(Exception):
    """A job spec that cannot run; the message names the field and the reason."""


def parse(data: object, source: str = "job") -> SparrowRLJob:
    try:
        return SparrowRLJob.model_validate(data)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            where = ".".join(str(p) for p in err["loc"]) or "(top level)"
            msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
            lines.append(f"{where}: {msg}")
        raise JobError(f"{source}: " + "; ".join(lines)) from None


def load(path: str | Path) -> SparrowRLJob:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise JobError(f"{path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise JobError(f"{path}: not valid YAML ({e})") from None
    job = parse(data, str(path))
    base = Path(path).resolve().parent  # relative paths in a job file are relative to the file
    spec = job.spec
    updates = {}
    if spec.task.jsonl and not Path(spec.task.jsonl).is_absolute():
        updates["task"] = spec.task.model_copy(update={"jsonl": str(base / spec.task.jsonl)})
    if spec.model.path and not Path(spec.model.path).is_absolute():
        updates["model"] = spec.model.model_copy(update={"path": str(base / spec.model.path)})
    return job.model_copy(update={"spec": spec.model_copy(update=updates)}) if updates else job
