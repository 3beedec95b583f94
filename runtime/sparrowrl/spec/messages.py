"""The bodies workers POST to the trainer, validated before any handler acts on them: workers
are not trusted, and one NaN log-prob would turn every weight of the next step into NaN. And
the job a worker reads from the trainer (`Job`), bounded the same way."""

from __future__ import annotations

from typing import Annotated, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from sparrowrl.spec.limits import first_problem
from sparrowrl.spec.task import MAX_EPISODE_TOKENS, EnvironmentSpec

Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9][-A-Za-z0-9_.]{0,252}$")]
Version = Annotated[int, Field(ge=-1, lt=10**8)]  # -1: a worker that holds no version yet
Hash = Annotated[str, Field(pattern=r"^([0-9a-f]{16})?$")]
Seconds = Annotated[float, Field(ge=0, le=1e7)]
LeaseId = Annotated[int, Field(ge=0, lt=1 << 62)]
Region = Annotated[str, Field(pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")]  # a DNS label


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Work(Body):
    worker: Name
    version: Version
    region: Region | None = None


MAX_MESSAGE_CHARS = 1 << 18
MAX_TURN_MESSAGES = 64
MAX_REASON_CHARS = 1000
End = Literal["done", "max_turns", "max_tokens", "length", "timeout", "error"]  # why an episode ended
Count = Annotated[int, Field(ge=0, le=MAX_EPISODE_TOKENS)]


class Message(Body):
    """An environment's message: a user played by code, or a tool's output."""

    role: Literal["user", "tool"]
    content: Annotated[str, Field(max_length=MAX_MESSAGE_CHARS)]


class EnvTurn(Body):
    """The environment's turn of an episode: its messages, and where their tokens sit in the
    sample's (the trainer renders them itself and checks)."""

    at: Count
    tokens: Count
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_TURN_MESSAGES)]


class Episode(Body):
    turns: Annotated[list[EnvTurn], Field(max_length=256)]
    end: End
    reason: Annotated[str, Field(max_length=MAX_REASON_CHARS)] | None = None
    seconds: Seconds
    tool_calls: Count = 0
    tool_errors: Count = 0
    reward: Annotated[float, Field(ge=-1e6, le=1e6)] | None = Field(None, exclude_if=lambda r: r is None)  # trusted


class Sample(Body):
    tokens: Annotated[list[StrictInt], Field(max_length=MAX_EPISODE_TOKENS)]
    logprobs: Annotated[list[Annotated[float, Field(ge=-1e4, le=0)]], Field(max_length=MAX_EPISODE_TOKENS)]
    finish: Literal["eos", "stop", "length"] | None = (
        None  # why it ended, as its engine says; None: a worker before it said
    )
    episode: Episode | None = Field(None, exclude_if=lambda e: e is None)  # task.environment's: its turns, how it ended


class Group(Body):
    samples: Annotated[list[Sample], Field(max_length=256)]


class Results(Body):
    lease: LeaseId
    worker: Name
    version: Version
    state_hash: Hash
    generate_s: Seconds
    results: Annotated[dict[LeaseId, Group], Field(max_length=4096)]  # prompt group → its samples


class Commit(Body):
    worker: Name
    version: Version
    state_hash: Hash
    fetch_s: Seconds | None = None
    refused: Annotated[int, Field(ge=0, lt=1 << 62)] = 0  # answers its servers sent that did not verify, so far


MAX_TOP_K = 1 << 20  # beyond any vocabulary
MAX_STOPS, MAX_STOP_CHARS = 16, 256
MAX_MODEL_LEN = 1 << 20  # tokens of prompt plus completion
MAX_TENSOR_PARALLEL = 8  # GPUs of one machine


class Job(BaseModel):
    """GET /v1/job: what a worker builds its engine from and samples with (the job spec's
    grpo and rollout fields, snake_case). Read by workers, which check it."""

    model_config = ConfigDict(frozen=True, allow_inf_nan=False)
    group_size: Annotated[int, Field(ge=1, le=256)]
    temperature: Annotated[float, Field(gt=0, le=100)]
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=0, le=MAX_TOP_K)] = 0
    stop: Annotated[
        list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]], Field(max_length=MAX_STOPS)
    ] = []
    max_new_tokens: Annotated[int, Field(ge=1, le=4096)]
    max_model_len: Annotated[int, Field(ge=16, le=MAX_MODEL_LEN)] | None = None
    tensor_parallel_size: Annotated[int, Field(ge=1, le=MAX_TENSOR_PARALLEL)] = 1
    mode: Literal["sparse", "full"]
    engine: Literal["hf", "vllm"]
    streams: Annotated[int, Field(ge=1, le=64)]
    environment: EnvironmentSpec | None = None  # task.environment, its file's path as the trainer has it
    templated: bool = False  # prompts are rendered with the chat template: so are an environment's turns


class EvalSampling(BaseModel):
    """An eval lease's sampling (task.eval), read by workers, which check it: `samples` per prompt,
    greedy or as the job samples."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    samples: Annotated[int, Field(ge=1, le=256)]
    greedy: bool


MAX_LEASE_TOKENS = 1 << 22  # a lease's results travel in one request
TOKEN_BYTES = 48  # a token id and its log-prob in JSON, with room to spare


def max_body(lease_tokens: int) -> int:
    """The largest request body the trainer takes: a lease's results with `lease_tokens` tokens."""
    return (1 << 20) + TOKEN_BYTES * lease_tokens


class LeaseOf(BaseModel):
    """The lease a results body names, when the rest of it is malformed: refused, and requeued."""

    lease: LeaseId
    worker: Name


M = TypeVar("M", bound=BaseModel)


def parse(model: type[M], body: object) -> M:
    """The body as `model`, or ValueError naming the first bad field."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise ValueError(first_problem(e)) from None
