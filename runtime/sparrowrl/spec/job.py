"""The job spec: one pydantic model in the shape of a Kubernetes object, read by `sparrowrl run`
and by the operator alike. Field names are the YAML's (camelCase); unknown or invalid fields are
refused with the field's path and the reason. Every number is finite and bounded, and the file
itself is bounded in size and in what its YAML aliases expand to (docs/limits.md)."""

from __future__ import annotations

import datetime
import re
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from sparrowrl.spec.kubespec import (
    MANAGED_BY,
    Health,
    ManagedBy,
    Placement,
    RelaySpec,
    RunPolicy,
    Scheduling,
    TrainerSpec,
)
from sparrowrl.spec.limits import MAX_JOB_BYTES, MAX_YAML_NODES, read_bounded
from sparrowrl.spec.messages import (
    MAX_LEASE_TOKENS,
    MAX_MODEL_LEN,
    MAX_STOP_CHARS,
    MAX_STOPS,
    MAX_TENSOR_PARALLEL,
    MAX_TOP_K,
)

API_VERSION = "sparrowrl.dev/v1alpha1"
Text = Annotated[str, Field(max_length=4096)]


REWARD = re.compile(r"exact|numeric|char_match|[A-Za-z_][A-Za-z0-9_]*:[A-Za-z_][A-Za-z0-9_]*|[^:]+\.py:[A-Za-z_]\w*")


def _reward(name: str) -> str:
    if not REWARD.fullmatch(name):
        raise ValueError(
            f"{name!r} is not exact, numeric, char_match, module:function (module.py beside the "
            f"job file) or FILE.py:function"
        )
    return name


class _Spec(BaseModel):
    model_config = ConfigDict(
        extra="forbid", alias_generator=to_camel, populate_by_name=True, frozen=True, allow_inf_nan=False
    )


class TinyModel(_Spec):
    """A Qwen3 made from config, with the built-in character tokenizer."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.hidden) || !has(self.heads) || self.hidden % self.heads == 0",
                    "message": "hidden must be a multiple of heads",
                }
            ]
        }
    )
    hidden: int = Field(128, ge=16, le=4096)
    layers: int = Field(2, ge=1, le=64)
    heads: int = Field(4, ge=1, le=64)
    warmup_steps: int = Field(
        0,
        ge=0,
        le=100_000,
        description=(
            "Supervised steps on the task before RL, half of them with a wrong answer: a model that knows the task "
            "but often samples wrongly, where RL post-training starts."
        ),
    )

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyModel:
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})")
        return self


# a repo id on the Hugging Face Hub (huggingface_hub's rules: no "--" or ".." either), and a branch, tag or commit
HUB_REPO = r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,94}[A-Za-z0-9])?/[A-Za-z0-9]([A-Za-z0-9._-]{0,94}[A-Za-z0-9])?$"
HUB_REVISION = r"^[A-Za-z0-9_]([A-Za-z0-9._/-]{0,253}[A-Za-z0-9_])?$"


def _hub(pattern: str, what: str, never: tuple[str, ...]):
    def check(name: str) -> str:
        if not re.fullmatch(pattern, name) or any(x in name for x in never):
            raise ValueError(f"{name!r} is not {what}")
        return name

    return AfterValidator(check)


class HubModel(_Spec):
    """A model on the Hugging Face Hub (or the HF_ENDPOINT's), downloaded by the trainer into its state dir."""

    repo: Annotated[
        str,
        Field(max_length=193, json_schema_extra={"pattern": HUB_REPO}),
        _hub(HUB_REPO, "a repo id, owner/name (letters, digits, '-', '_', '.'; no '--' or '..')", ("--", "..")),
    ] = Field(description="The model's repo id, owner/name.")
    revision: Annotated[
        str,
        Field(max_length=255, json_schema_extra={"pattern": HUB_REVISION}),
        _hub(HUB_REVISION, "a branch, tag or commit (letters, digits, '-', '_', '.', '/'; no '..')", ("..", "//")),
    ] = Field("main", description="A branch, tag or commit of the repo.")


class ModelSpec(_Spec):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "(has(self.path) ? 1 : 0) + (has(self.tiny) ? 1 : 0) + (has(self.hub) ? 1 : 0) == 1",
                    "message": "give exactly one of model.path, model.tiny and model.hub",
                },
                {
                    "rule": "!has(self.tiny) || !has(self.tokenizer)",
                    "message": "model.tiny uses the built-in character tokenizer; drop model.tokenizer",
                },
            ]
        }
    )
    path: Text | None = Field(None, description="A local Hugging Face model folder.")
    tiny: TinyModel | None = None
    hub: HubModel | None = Field(
        None,
        description=(
            "A model on the Hugging Face Hub: its config, tokenizer and safetensors weights, downloaded once into "
            "the trainer's state dir (hub/); HF_TOKEN and HF_ENDPOINT are honoured."
        ),
    )
    tokenizer: Text | None = Field(None, description="A tokenizer folder; default: the model's.")

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if sum(x is not None for x in (self.path, self.tiny, self.hub)) != 1:
            raise ValueError(
                "give exactly one of model.path (a Hugging Face folder), model.tiny and model.hub (a model on the hub)"
            )
        if self.tiny is not None and self.tokenizer is not None:
            raise ValueError("model.tiny uses the built-in character tokenizer; drop model.tokenizer")
        return self


FieldName = Annotated[str, Field(min_length=1, max_length=256)]


class DatasetSpec(_Spec):
    """A `datasets` data set: a local file or folder, or a name on the Hugging Face Hub."""

    path: Text = Field(
        description=(
            "A local file (.parquet, .json, .jsonl, .csv or .arrow), a folder of such files, a folder written by "
            "save_to_disk (relative to the job file), or a data set's name on the Hugging Face Hub (HF_ENDPOINT "
            "and HF_TOKEN are honoured)."
        )
    )
    name: Text | None = Field(None, description="The data set's configuration, if it has several.")
    split: Text = Field("train", description='The split, with datasets\' slicing if wanted: "train[:1000]".')
    prompt_field: FieldName = Field("prompt", description="The column that holds the prompt text.")
    answer_field: FieldName = Field("answer", description="The column that holds the answer.")
    messages_field: FieldName | None = Field(
        None,
        description="The column that holds chat messages ([{role, content}]): the prompt comes from it instead.",
    )


class EvalSpec(_Spec):
    """Held-out prompts that workers generate at a version and the trainer scores, never trains on."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.jsonl) || !has(self.dataset)",
                    "message": "give eval.jsonl or eval.dataset, not both",
                }
            ]
        }
    )
    jsonl: Text | None = Field(None, description="A file of held-out examples, as task.jsonl's.")
    dataset: DatasetSpec | None = Field(None, description="A data set of held-out examples, as task.dataset's.")
    prompts: int = Field(
        64,
        ge=1,
        le=65_536,
        description=(
            "How many: the first of the file or data set, or, for a built-in task without either, examples "
            "training never draws."
        ),
    )
    every: int = Field(10, ge=1, le=10_000_000, description="Every this many versions (and at v0 and the last).")
    samples: int = Field(
        1, ge=1, le=256, description="Samples per prompt: pass@1 over them, and pass@k for k = samples."
    )
    decoding: Literal["greedy", "sampled"] = Field(
        "greedy", description="greedy: the most likely token each time; sampled: as rollouts sample (grpo's settings)."
    )

    @model_validator(mode="after")
    def _one_source(self) -> EvalSpec:
        if self.jsonl is not None and self.dataset is not None:
            raise ValueError("give eval.jsonl or eval.dataset, not both")
        return self


class TaskSpec(_Spec):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "(has(self.builtin) ? 1 : 0) + (has(self.jsonl) ? 1 : 0) + (has(self.dataset) ? 1 : 0) "
                    "== 1",
                    "message": "give exactly one of task.builtin, task.jsonl and task.dataset",
                },
                {
                    "rule": "!has(self.eval) || has(self.eval.jsonl) || has(self.eval.dataset) || has(self.builtin)",
                    "message": "eval: give eval.jsonl or eval.dataset (held-out examples are drawn only for a "
                    "built-in task)",
                },
            ]
        }
    )
    builtin: Literal["add", "reverse"] | None = None
    jsonl: Text | None = Field(
        None, description='A file of {"prompt", "answer", ...} or {"messages", "answer", ...} lines.'
    )
    dataset: DatasetSpec | None = None
    reward: Annotated[Text, AfterValidator(_reward)] | None = Field(
        None,
        description=(
            "exact | numeric | char_match | module:function, where module.py is a file beside the job file "
            "(or FILE.py:function, relative to it): code the trainer runs, called as fn(prompt, completion, "
            "answer, **fields) with the example's other fields. Default: the built-in task's own, exact for "
            "JSONL and data sets."
        ),
    )
    chat_template: bool | None = Field(
        None,
        description=(
            "Render prompts with the tokenizer's chat template. Unset: when the tokenizer has one; true: "
            "required; false: never."
        ),
    )
    system_prompt: Annotated[str, Field(max_length=65536)] | None = Field(
        None,
        description=(
            "Prepended to each prompt: as a system message under a chat template (unless the example has its "
            "own), else as text and a newline."
        ),
    )
    max_prompt_tokens: int = Field(
        2048, ge=1, le=131072, description="An example whose rendered prompt is longer is a bad row."
    )
    on_bad_row: Literal["refuse", "skip"] = Field(
        "refuse",
        description="A bad example (unreadable, incomplete, too long) stops the job at start, or is counted and "
        "skipped.",
    )
    reward_workers: int | None = Field(
        None, ge=1, le=64, description="Processes that run a user's reward in parallel; default: min(4, CPUs)."
    )
    reward_timeout_seconds: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="A user's reward call that takes longer is stopped; its sample scores 0 and is counted.",
    )

    eval: EvalSpec | None = Field(
        None, description="Held-out evaluation: pass@1 (and pass@k) per version, in metrics, status and plots."
    )

    @model_validator(mode="after")
    def _one_source(self) -> TaskSpec:
        if sum(x is not None for x in (self.builtin, self.jsonl, self.dataset)) != 1:
            raise ValueError("give exactly one of task.builtin, task.jsonl and task.dataset")
        e = self.eval
        if e is not None and e.jsonl is None and e.dataset is None and self.builtin is None:
            raise ValueError(
                "eval: give eval.jsonl or eval.dataset (held-out examples are drawn only for a built-in task)"
            )
        return self


class BehaviourSpec(_Spec):
    """The behaviour weight w = π_prox/μ: the trainer's policy before the step over the policy
    the worker sampled with (stale, another engine's kernels, or a worker's false numbers)."""

    correction: Literal["off", "truncate", "mask"] = Field(
        "truncate",
        description=(
            "truncate: w clamped to [floor, cap] (TIS; TRL's *_truncate, verl's rollout_is); mask: w outside "
            "[floor, cap] weighs 0 (MIS; TRL's *_mask, verl's rejection sampling); off: w = 1, the samples taken as "
            "the trainer's own (TRL's vllm_importance_sampling_correction: false)."
        ),
    )
    level: Literal["token", "sequence"] = Field(
        "token", description="w per token, or per sample as the geometric mean of its tokens' weights."
    )
    cap: float = Field(2.0, gt=1, le=1e4, description="The upper bound of w (TRL: vllm_importance_sampling_clip_max).")
    floor: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="The lower bound of w, below 1 as cap is above (TRL: vllm_importance_sampling_clip_min).",
    )
    refuse_gap: float = Field(
        1.0,
        gt=0,
        le=1e4,
        description=(
            "A sample whose reported log-probs differ from the trainer's by more than this many nats per token on "
            "average is not trained, and is counted against its worker: more than staleness and engine noise explain."
        ),
    )


class GrpoSpec(_Spec):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.overlongBuffer) || self.overlongBuffer <= "
                    "(has(self.maxNewTokens) ? self.maxNewTokens : 8)",
                    "message": "overlongBuffer must not exceed maxNewTokens",
                }
            ]
        }
    )
    learning_rate: float = Field(1e-5, gt=0, le=1)
    weight_decay: float = Field(0.0, ge=0, le=1)
    max_grad_norm: float = Field(1.0, gt=0, le=1e6)
    group_size: int = Field(8, ge=2, le=256)
    prompts_per_step: int = Field(16, ge=1, le=4096)
    clip: float = Field(
        0.2, gt=0, lt=1, description="PPO's clip: r = π_θ/π_prox below 1 − clip stops pulling (TRL: epsilon)."
    )
    clip_high: float | None = Field(
        None,
        gt=0,
        le=10,
        description="r above 1 + clipHigh stops pushing (DAPO's clip-higher; TRL: epsilon_high); default: clip.",
    )
    dual_clip: float | None = Field(
        3.0,
        gt=1,
        le=1e4,
        description=(
            "With a negative advantage, r counts at most this much (dual clip; TRL: delta, verl: clip_ratio_c); "
            "null: no bound."
        ),
    )
    ratio_level: Literal["token", "sequence"] = Field(
        "token",
        description="sequence: one ratio per sample, the geometric mean of its tokens' (GSPO; TRL: "
        "importance_sampling_level).",
    )
    loss_aggregation: Literal["token", "sequence", "constant"] = Field(
        "token",
        description=(
            "token: the mean over the batch's tokens (TRL's dapo, verl's token-mean); sequence: each sample's mean, "
            "then their mean (TRL's grpo, verl's seq-mean-token-mean); constant: the sum over samples x "
            "maxNewTokens (Dr. GRPO; TRL's dr_grpo, verl's seq-mean-token-sum-norm)."
        ),
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group",
        description="Advantages are rewards less their group's mean, divided by the group's std, the batch's, or 1 "
        "(TRL: scale_rewards).",
    )
    zero_variance_groups: Literal["skip", "train", "refill"] = Field(
        "skip",
        description=(
            "A group whose samples all scored alike teaches nothing: skip leaves it out of the step (and its "
            "tokens out of the loss's divisor), counted; train keeps it, as TRL does; refill skips it and has "
            "the step wait for a new group in its place, from new prompts, scored as they are admitted, up to "
            "maxGenBatches (DAPO's dynamic sampling; verl: filter_groups)."
        ),
    )
    max_gen_batches: int = Field(
        3,
        ge=1,
        le=64,
        description=(
            "With zeroVarianceGroups: refill, a step generates at most this many times promptsPerStep groups: "
            "its own and up to (maxGenBatches - 1) x promptsPerStep in place of zero-variance ones; beyond, it "
            "trains on the groups that vary (verl: max_num_gen_batches)."
        ),
    )
    mask_truncated: bool = Field(
        False,
        description=(
            "A completion cut at maxNewTokens (the trainer's reading of its tokens, not the worker's word) is not "
            "trained; its reward still counts in its group's advantages (TRL: mask_truncated_completions)."
        ),
    )
    overlong_buffer: int = Field(
        0,
        ge=0,
        le=4096,
        description=(
            "DAPO's overlong shaping: a completion longer than maxNewTokens − overlongBuffer tokens loses "
            "overlongPenalty × (its excess / overlongBuffer) of reward, before advantages (verl: "
            "overlong_buffer.len); 0: none."
        ),
    )
    overlong_penalty: float = Field(
        1.0, gt=0, le=1e6, description="The most reward overlong shaping takes (verl: overlong_buffer.penalty_factor)."
    )
    updates_per_batch: int = Field(
        1,
        ge=1,
        le=64,
        description="Optimizer updates on each batch, clipped against the policy before the first (TRL: "
        "num_iterations, verl: ppo_epochs).",
    )
    behaviour: BehaviourSpec = BehaviourSpec()
    entropy_coef: float = Field(0.0, ge=0, le=10, description="An entropy bonus (verl: entropy_coeff).")
    kl_coef: float = Field(0.0, ge=0, le=100, description="KL to the initial model (TRL: beta).")
    kl_estimator: Literal["k1", "k2", "k3", "low-var-kl"] = Field(
        "k3", description="How the KL is estimated from samples (verl: kl_loss_type kl, mse, k3, low_var_kl)."
    )

    @model_validator(mode="after")
    def _buffer_fits(self) -> GrpoSpec:
        if self.overlong_buffer > self.max_new_tokens:
            raise ValueError(
                f"overlongBuffer ({self.overlong_buffer}) must not exceed maxNewTokens ({self.max_new_tokens})"
            )
        return self

    @property
    def refill_groups(self) -> int:
        """The most groups a step adds in place of zero-variance ones (0: refills off)."""
        return (self.max_gen_batches - 1) * self.prompts_per_step if self.zero_variance_groups == "refill" else 0

    temperature: float = Field(1.0, ge=0.01, le=100)
    top_p: float = Field(
        1.0, gt=0, le=1, description="Nucleus sampling: the smallest set of tokens whose probability reaches topP."
    )
    top_k: int = Field(0, ge=0, le=MAX_TOP_K, description="Sample among the k most likely tokens; 0: all of them.")
    stop: Annotated[
        list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]], Field(max_length=MAX_STOPS)
    ] = Field(
        [],
        description=(
            "A completion ends at the token that completes one of these strings in its text; that token is kept."
        ),
    )
    max_new_tokens: int = Field(8, ge=1, le=4096)
    micro_batch_tokens: int | None = Field(
        None,
        ge=1,
        le=1 << 30,
        description=(
            "Token budget of one forward and backward: a rank's rows go in micro-batches of at most this many "
            "padded tokens (rows x (longest prompt + longest completion)), a longer row alone, and their gradients "
            "add up to the one-pass gradient. Default: one pass over the rank's rows."
        ),
    )
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="After the warm-up: constant, or a linear or cosine decay to minLrRatio over the steps."
    )
    warmup_steps: int = Field(
        0, ge=0, le=10_000_000, description="Steps over which the learning rate rises linearly to learningRate."
    )
    min_lr_ratio: float = Field(
        0.0,
        ge=0,
        le=1,
        description="The learning rate at the last step of a linear or cosine decay, over learningRate.",
    )


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


class SyncSpec(_Spec):
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


class ExportSpec(_Spec):
    """What the trainer writes for its user besides its state (which `final/` ends)."""

    every: int = Field(
        0,
        ge=0,
        le=10_000_000,
        description=(
            "Every this many steps, the policy rollouts ran at that version as a Hugging Face folder (bf16, "
            "verified by its state hash), in path/step-NNNNNNNN; 0: none."
        ),
    )
    path: Text | None = Field(None, description="Where exports go; default: the state dir's exports/.")
    tensor_board: bool = Field(
        False, description="Each step's metrics as TensorBoard scalars in the state dir's tensorboard/."
    )


class RegionSpec(_Spec):
    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]{0,30}[a-z0-9])?$", max_length=32)
    workers: int = Field(1, ge=0, le=64)
    relay: bool = True
    bandwidth_mbit: float | None = Field(None, gt=0, le=1e6, description="Cap on this region's link to the trainer.")


class TopologySpec(_Spec):
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


# what a trainer's state belongs to: another value is another job's state (steps may only grow)
BELONGS = ("seed", "model", "task", "grpo", "sync", "trainer.ranks")


def _at(spec: dict, dotted: str):
    for key in dotted.split("."):
        spec = spec.get(key) if isinstance(spec, dict) else None
    return spec


# In a trainer's state dir: its next start is a planned resume (`sparrowrl run --resume`), which
# counts in trainer_resumes and not as a restart. The trainer takes it (removes it) as it starts.
PLANNED_RESUME = "planned-resume"


def state_mismatch(saved: dict, spec: dict) -> str | None:
    """Why a state made for the job `saved` cannot go on under `spec` (both job specs as JSON),
    or None. More steps is the same job trained on; anything else it belongs to is not."""
    if not isinstance(saved, dict):
        return "job.json holds no job spec"
    try:  # a state written before a field was added holds no value for it: the default's
        saved = {**saved, **JobSpec.model_validate(saved).model_dump(mode="json")}
    except ValidationError:
        pass
    for field in BELONGS:
        if _at(saved, field) != _at(spec, field):
            return f"spec.{field} differs"
    if not isinstance(saved.get("steps"), int) or spec["steps"] < saved["steps"]:
        return f"spec.steps is {spec['steps']}, below the {saved.get('steps')} it was made for"
    return None


class JobSpec(_Spec):
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
                        "(has(oldSelf.trainer) && has(oldSelf.trainer.ranks) ? oldSelf.trainer.ranks : 1)"
                    ),
                    "message": "seed, model, task, grpo, sync and trainer.ranks are immutable: the trainer's state "
                    "belongs to them",
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
        return self.grpo.group_size * self.rollout.groups_per_lease * self.grpo.max_new_tokens

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
        if self.trainer.ranks > self.grpo.prompts_per_step:
            raise ValueError(
                f"trainer.ranks ({self.trainer.ranks}) must not exceed grpo.promptsPerStep "
                f"({self.grpo.prompts_per_step}): each rank trains on its share of a step's groups"
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
                f"grpo.groupSize x rollout.groupsPerLease x grpo.maxNewTokens is {self.lease_tokens:,} "
                f"tokens per lease (limit {MAX_LEASE_TOKENS:,}): a lease's results travel in one request"
            )
        return self


_LABEL_NAME = r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)"
_KEY = re.compile(rf"^([a-z0-9]([-a-z0-9.]{{0,251}}[a-z0-9])?/)?{_LABEL_NAME}$")
_LABEL_VALUE = re.compile(rf"^{_LABEL_NAME}?$")
MAX_ANNOTATION_BYTES = 256 << 10


def _labels(labels: dict[str, str]) -> dict[str, str]:
    for k, v in labels.items():
        if not _KEY.match(k):
            raise ValueError(f"label key {k!r} is not [prefix/]name (name: 63 characters at most)")
        if not _LABEL_VALUE.match(v):
            raise ValueError(f"label {k!r}: value {v!r} is not 63 characters at most of [-A-Za-z0-9_.]")
    return labels


def _annotations(annotations: dict[str, str]) -> dict[str, str]:
    for k in annotations:
        if not _KEY.match(k):
            raise ValueError(f"annotation key {k!r} is not [prefix/]name (name: 63 characters at most)")
    size = sum(len(k.encode()) + len(v.encode()) for k, v in annotations.items())
    if size > MAX_ANNOTATION_BYTES:
        raise ValueError(f"annotations take {size:,} bytes (Kubernetes allows {MAX_ANNOTATION_BYTES:,})")
    return annotations


Short = Annotated[str, Field(max_length=253)]
DnsLabel = Annotated[str, Field(pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")]
Timestamp = Annotated[str, Field(max_length=64)] | datetime.datetime  # YAML reads an unquoted one as a datetime


class OwnerReference(_Spec):
    model_config = ConfigDict(extra="forbid", frozen=True)
    api_version: Short = Field(alias="apiVersion")
    kind: Short
    name: Short
    uid: Short
    controller: bool | None = None
    block_owner_deletion: bool | None = Field(None, alias="blockOwnerDeletion")


class Metadata(_Spec):
    """Kubernetes' ObjectMeta, with Kubernetes' own limits: what a job file or an object read
    back from a cluster (`kubectl get -o yaml`) carries. The server-set fields are accepted and
    not used; `managedFields` is opaque, bounded by the job file's own limits."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)
    name: DnsLabel
    namespace: DnsLabel | None = None
    labels: Annotated[dict[str, str], AfterValidator(_labels)] = {}
    annotations: Annotated[dict[str, str], AfterValidator(_annotations)] = {}
    generate_name: Short | None = Field(None, alias="generateName")
    uid: Short | None = None
    resource_version: Short | None = Field(None, alias="resourceVersion")
    generation: int | None = Field(None, ge=0, lt=2**63)
    creation_timestamp: Timestamp | None = Field(None, alias="creationTimestamp")
    deletion_timestamp: Timestamp | None = Field(None, alias="deletionTimestamp")
    deletion_grace_period_seconds: int | None = Field(None, ge=0, lt=2**63, alias="deletionGracePeriodSeconds")
    finalizers: Annotated[list[Short], Field(max_length=64)] = []
    owner_references: Annotated[list[OwnerReference], Field(max_length=64)] = Field([], alias="ownerReferences")
    managed_fields: Annotated[list[dict], Field(max_length=64)] = Field([], alias="managedFields")


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
    if not isinstance(e, yaml.MarkedYAMLError) or (e.problem_mark or e.context_mark) is None:
        return JobError(f"{path}: not valid YAML ({one(e)})")
    mark = e.problem_mark or e.context_mark
    why = one(e.problem or e.context)
    if e.context and e.problem and e.context_mark is not None:  # where the construct the problem breaks began
        why += f" ({one(e.context)} at line {e.context_mark.line + 1}, column {e.context_mark.column + 1})"
    return JobError(f"{path}: not valid YAML at line {mark.line + 1}, column {mark.column + 1}: {why}")


def _the_job(path: str | Path, docs: list) -> object:
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
    updates = {}
    task = {}
    if spec.task.jsonl and not Path(spec.task.jsonl).is_absolute():
        task["jsonl"] = str(base / spec.task.jsonl)
    data = spec.task.dataset
    if data and not Path(data.path).is_absolute() and (base / data.path).exists():  # else a name on the hub
        task["dataset"] = data.model_copy(update={"path": str(base / data.path)})
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
