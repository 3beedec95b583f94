"""The job spec: one pydantic model in the shape of a Kubernetes object, read by `sparrowrl run`
and by the operator alike. Field names are the YAML's (camelCase); unknown or invalid fields are
refused with the field's path and the reason. Every number is finite and bounded, and the file
itself is bounded in size and in what its YAML aliases expand to (docs/limits.md). The sections of
`spec` are each in a module of their own (model, task, grpo, workers, export; kubespec: what only a
cluster reads)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import ConfigDict, Field, ValidationError, model_validator

from sparrowrl.spec.export import ExportSpec
from sparrowrl.spec.grpo import GrpoSpec
from sparrowrl.spec.kubespec import (
    MANAGED_BY,
    MAX_WORLD,
    Health,
    ManagedBy,
    NetworkPolicySpec,
    Placement,
    RelaySpec,
    RunPolicy,
    TlsSpec,
    TrainerSpec,
)
from sparrowrl.spec.limits import MAX_JOB_BYTES, MAX_YAML_NODES, read_bounded
from sparrowrl.spec.messages import MAX_LEASE_TOKENS
from sparrowrl.spec.metadata import Metadata
from sparrowrl.spec.model import ModelSpec
from sparrowrl.spec.section import Section
from sparrowrl.spec.task import TaskSpec
from sparrowrl.spec.workers import RegionSpec, RolloutSpec, SyncSpec, TopologySpec

API_VERSION = "sparrowrl.dev/v1alpha1"


class JobSpec(Section):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.topology) || !has(self.placements)",
                    "message": "give topology (regions for sparrowrl run) or placements (regions in clusters), "
                    "not both",
                },
                {
                    "rule": "has(self.managedBy) == has(oldSelf.managedBy) && (!has(self.managedBy) || "
                    "self.managedBy == oldSelf.managedBy)",
                    "message": "managedBy is immutable",
                },
                {
                    "rule": (
                        "self.seed == oldSelf.seed && self.model == oldSelf.model && "
                        "self.task == oldSelf.task && has(self.grpo) == has(oldSelf.grpo) && (!has(self.grpo) || "
                        "self.grpo == oldSelf.grpo) && has(self.sync) == has(oldSelf.sync) && (!has(self.sync) || "
                        "self.sync == oldSelf.sync) && "
                        "(has(self.trainer) && has(self.trainer.ranks) ? self.trainer.ranks : 1) == "
                        "(has(oldSelf.trainer) && has(oldSelf.trainer.ranks) ? oldSelf.trainer.ranks : 1) && "
                        "(has(self.trainer) && has(self.trainer.nodes) ? self.trainer.nodes : 1) == "
                        "(has(oldSelf.trainer) && has(oldSelf.trainer.nodes) ? oldSelf.trainer.nodes : 1) && "
                        "(has(self.trainer) && has(self.trainer.sharding) ? self.trainer.sharding : 'full') == "
                        "(has(oldSelf.trainer) && has(oldSelf.trainer.sharding) ? oldSelf.trainer.sharding : 'full')"
                    ),
                    "message": "seed, model, task, grpo, sync and trainer.ranks, nodes and sharding are immutable: "
                    "the trainer's state belongs to them",
                },
                {
                    "rule": "has(self.tls) == has(oldSelf.tls) && (!has(self.tls) || self.tls == oldSelf.tls)",
                    "message": "tls is immutable: the job's pods trust the CA they started with",
                },
                {
                    "rule": (
                        "!has(self.placements) || !self.placements.exists(p, has(p.cluster)) || (has(self.trainer) && "
                        "has(self.trainer.service) && (has(self.trainer.service.url) || "
                        "(has(self.trainer.service.type) && self.trainer.service.type != 'ClusterIP')))"
                    ),
                    "message": "workers in a member cluster cannot reach a ClusterIP trainer; set "
                    "trainer.service.type to LoadBalancer or NodePort, or trainer.service.url",
                },
                {
                    "rule": (
                        "!has(self.trainer) || !has(self.trainer.service) || !has(self.trainer.service.url) || "
                        "self.trainer.service.url.startsWith('https://') || "
                        "(has(self.tls) && has(self.tls.mode) && self.tls.mode == 'Disabled')"
                    ),
                    "message": "trainer.service.url: the trainer serves HTTPS (tls.mode Enabled); give an "
                    "https:// URL, or set tls.mode: Disabled",
                },
            ]
        }
    )
    steps: int = Field(
        50,
        ge=1,
        le=10_000_000,  # version numbers are 8 digits in file names
        description="Optimizer steps to train. May be raised on a running or finished job, which trains on.",
        json_schema_extra={  # state_mismatch's rule: the trainer's state may have trained past a lower value
            "x-kubernetes-validations": [
                {
                    "rule": "self >= oldSelf",
                    "message": "steps may be raised, not lowered: the trainer may have trained past the lower value",
                }
            ]
        },
    )
    seed: int = Field(0, ge=0, le=2**63 - 1)
    model: ModelSpec
    task: TaskSpec
    grpo: GrpoSpec = GrpoSpec()
    rollout: RolloutSpec = RolloutSpec()
    relays: RelaySpec = Field(
        RelaySpec(),
        description="Every relay's pod in a cluster: its own resources, scheduling and template, not the workers'.",
    )
    sync: SyncSpec = SyncSpec()
    export: ExportSpec = ExportSpec()
    topology: TopologySpec = TopologySpec()
    image: Annotated[str, Field(min_length=1, max_length=1024, pattern=r"^\S+$")] | None = Field(
        None, description=("The runtime image of the job's pods; default: the operator's.")
    )
    trainer: TrainerSpec = TrainerSpec()
    placements: (
        Annotated[
            list[Placement],
            Field(
                min_length=1,
                max_length=64,
                json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["region"]},
            ),
        ]
        | None
    ) = None
    run_policy: RunPolicy = RunPolicy()
    health: Health = Health()
    tls: TlsSpec = TlsSpec()
    network_policy: NetworkPolicySpec = NetworkPolicySpec()
    managed_by: ManagedBy | None = None

    @property
    def regions(self) -> list[RegionSpec]:
        """Where the workers run: the placements in a cluster, else the topology."""
        if self.placements is None:
            return self.topology.regions
        return [RegionSpec(name=p.region, workers=p.replicas, relay=p.relay) for p in self.placements]

    @property
    def quorum(self) -> int:
        """Workers that must call in before rollouts start: every worker, or each placement's minReplicas."""
        if self.placements is None:
            return sum(r.workers for r in self.topology.regions)
        return sum(p.min_replicas for p in self.placements)

    @property
    def manager(self) -> str:
        return self.managed_by or MANAGED_BY

    @property
    def lease_tokens(self) -> int:
        """The most tokens one lease's results carry."""
        env = self.task.environment
        per_sample = env.max_episode_tokens if env else self.grpo.max_new_tokens
        return self.grpo.group_size * self.rollout.groups_per_lease * per_sample

    @model_validator(mode="after")
    def _placements(self) -> JobSpec:
        if self.placements is None:
            return self
        if self.topology != TopologySpec():  # not by fields_set: a spec dumped and read back sets every field
            raise ValueError("give topology (regions for sparrowrl run) or placements (regions in clusters), not both")
        regions = [p.region for p in self.placements]
        if len(set(regions)) != len(regions):
            raise ValueError(f"placements: region names must be unique, got {regions}")
        if not sum(p.replicas for p in self.placements):
            raise ValueError("placements: at least one needs replicas")
        remote = [p for p in self.placements if p.cluster]
        if remote and self.trainer.service.type == "ClusterIP" and not self.trainer.service.url:
            raise ValueError(
                f"placements: region {remote[0].region} runs in cluster {remote[0].cluster}, which cannot "
                f"reach a ClusterIP trainer; set trainer.service.type to LoadBalancer or NodePort, or "
                f"trainer.service.url"
            )
        return self

    @model_validator(mode="after")
    def _ranks_have_work(self) -> JobSpec:
        t = self.trainer
        if t.ranks * t.nodes > self.grpo.prompts_per_step:
            ranks = f"trainer.ranks ({t.ranks})" if t.nodes == 1 else f"trainer.nodes × ranks ({t.nodes} × {t.ranks})"
            raise ValueError(
                f"{ranks} must not exceed grpo.promptsPerStep ({self.grpo.prompts_per_step}): each rank trains on "
                f"its share of a step's groups"
            )
        if t.ranks * t.nodes > MAX_WORLD:
            raise ValueError(
                f"trainer.nodes × ranks ({t.nodes} × {t.ranks}) is more than {MAX_WORLD} ranks: a step's "
                f"collectives and the gather of every rank's records to node 0 are bounded there"
            )
        gpus = self.trainer.resources.limits.get("nvidia.com/gpu")
        if gpus is not None and (not gpus.isdigit() or int(gpus) < self.trainer.ranks):
            raise ValueError(
                f"trainer.resources.limits: nvidia.com/gpu is {gpus}, fewer than trainer.ranks "
                f"({self.trainer.ranks}): each rank takes a GPU of its own"
            )
        return self

    @model_validator(mode="after")
    def _lease_fits_a_request(self) -> JobSpec:
        if self.lease_tokens > MAX_LEASE_TOKENS:
            raise ValueError(
                f"grpo.groupSize x rollout.groupsPerLease x "
                f"{'task.environment.maxEpisodeTokens' if self.task.environment else 'grpo.maxNewTokens'} is "
                f"{self.lease_tokens:,} "
                f"tokens per lease (limit {MAX_LEASE_TOKENS:,}): a lease's results travel in one request"
            )
        return self

    @model_validator(mode="after")
    def _turns_end_at_their_token(self) -> JobSpec:
        if self.task.environment and self.grpo.stop:
            raise ValueError(
                "grpo.stop: an environment's model turns end at the model's end-of-turn token, where the "
                "environment's turn is appended; stop strings are not taken with task.environment"
            )
        return self


class SparrowRLJob(Section):
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
            msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
            lines.append(f"{where}: {msg}")
        raise JobError(f"{source}: " + "; ".join(lines)) from None


def _expanded_size(data: object, limit: int) -> int:
    """Values in `data` counted as if every alias were a copy, up to `limit`: a few aliased
    lists expand exponentially ("billion laughs"), and consumers of the job do expand them."""
    n, todo = 0, [data]
    while todo:
        x = todo.pop()
        n += 1
        if n > limit:
            break
        if isinstance(x, dict):
            todo.extend(x.keys())
            todo.extend(x.values())
        elif isinstance(x, list):
            todo.extend(x)
    return n


def _yaml_error(path: str | Path, e: yaml.YAMLError) -> JobError:
    """pyyaml's message on one line, where it is in the file 1-based (pyyaml's marks count from 0)."""

    def one(text: object) -> str:
        return " ".join(str(text).split())

    if isinstance(e, yaml.reader.ReaderError):  # a byte that is not UTF-8, or a control character
        return JobError(f"{path}: not valid YAML at offset {e.position}: {str(e).splitlines()[0]}")
    mark = (e.problem_mark or e.context_mark) if isinstance(e, yaml.MarkedYAMLError) else None
    if not isinstance(e, yaml.MarkedYAMLError) or mark is None:
        return JobError(f"{path}: not valid YAML ({one(e)})")
    why = one(e.problem or e.context)
    if e.context and e.problem and e.context_mark is not None:  # where the construct the problem breaks began
        why += f" ({one(e.context)} at line {e.context_mark.line + 1}, column {e.context_mark.column + 1})"
    return JobError(f"{path}: not valid YAML at line {mark.line + 1}, column {mark.column + 1}: {why}")


def _the_job(path: str | Path, docs: list[Any]) -> object:
    """The one SparrowRLJob of a file of several YAML documents (a job beside the claims and
    ConfigMaps it mounts, as `kubectl apply -f` takes it); the others are ignored."""
    if len(docs) <= 1:  # a file of one document is the job: its fields are checked and named
        return docs[0] if docs else None
    jobs = [d for d in docs if isinstance(d, dict) and d.get("kind") == "SparrowRLJob"]
    if len(jobs) != 1:
        kinds = ", ".join(
            " ".join(str(d.get("kind") if isinstance(d, dict) else type(d).__name__).split())[:64] for d in docs[:8]
        )
        raise JobError(
            f"{path}: {len(jobs)} of its {len(docs)} YAML documents ({kinds}{', ...' if len(docs) > 8 else ''}) "
            f"are a SparrowRLJob; a job file holds exactly one"
        )
    return jobs[0]


def load(path: str | Path) -> SparrowRLJob:
    """A job file: one YAML document, or several of which one is a SparrowRLJob (`_the_job`)."""
    try:
        raw = read_bounded(path, MAX_JOB_BYTES, "a job file")
    except ValueError as e:
        raise JobError(str(e)) from None
    try:
        docs = [d for d in yaml.safe_load_all(raw) if d is not None]  # `---` at the end is an empty document
    except yaml.YAMLError as e:
        raise _yaml_error(path, e) from None
    except RecursionError:
        raise JobError(f"{path}: YAML nested too deeply") from None
    values = 0  # over every document: the ones not read are expanded by whoever reads them
    for d in docs:
        values += _expanded_size(d, MAX_YAML_NODES - values)
        if values > MAX_YAML_NODES:
            raise JobError(f"{path}: more than {MAX_YAML_NODES:,} YAML values once its aliases are expanded")
    job = parse(_the_job(path, docs), str(path))
    base = Path(path).resolve().parent  # relative paths in a job file are relative to the file
    spec = job.spec
    updates: dict[str, Any] = {}
    task: dict[str, Any] = {}
    if spec.task.jsonl and not Path(spec.task.jsonl).is_absolute():
        task["jsonl"] = str(base / spec.task.jsonl)
    data = spec.task.dataset
    if data and not Path(data.path).is_absolute() and (base / data.path).exists():  # else a name on the hub
        task["dataset"] = data.model_copy(update={"path": str(base / data.path)})
    env = spec.task.environment
    if env and env.load.endswith(".py") and not Path(env.load).is_absolute():  # else an installed module
        task["environment"] = env.model_copy(update={"load": str(base / env.load)})
    if spec.task.reward and ":" in spec.task.reward:  # user code: a file beside the job, never a module on the path
        module, fn = spec.task.reward.rsplit(":", 1)
        task["reward"] = f"{base / (module if module.endswith('.py') else module + '.py')}:{fn}"
    ev = spec.task.eval
    if ev and ev.jsonl and not Path(ev.jsonl).is_absolute():
        task["eval"] = ev = ev.model_copy(update={"jsonl": str(base / ev.jsonl)})
    if ev and ev.dataset and not Path(ev.dataset.path).is_absolute() and (base / ev.dataset.path).exists():
        task["eval"] = ev.model_copy(
            update={"dataset": ev.dataset.model_copy(update={"path": str(base / ev.dataset.path)})}
        )
    if task:
        updates["task"] = spec.task.model_copy(update=task)
    if spec.model.path and not Path(spec.model.path).is_absolute():
        updates["model"] = spec.model.model_copy(update={"path": str(base / spec.model.path)})
    return job.model_copy(update={"spec": spec.model_copy(update=updates)}) if updates else job
