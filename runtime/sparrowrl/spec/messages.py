"""The bodies workers POST to the trainer, validated before any handler acts on them: workers
are not trusted, and one NaN log-prob would turn every weight of the next step into NaN."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from sparrowrl.spec.limits import first_problem

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


class Sample(Body):
    tokens: Annotated[list[StrictInt], Field(max_length=4096)]
    logprobs: Annotated[list[Annotated[float, Field(ge=-1e4, le=0)]], Field(max_length=4096)]


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


MAX_LEASE_TOKENS = 1 << 22  # a lease's results travel in one request
TOKEN_BYTES = 48  # a token id and its log-prob in JSON, with room to spare


def max_body(lease_tokens: int) -> int:
    """The largest request body the trainer takes: a lease's results with `lease_tokens` tokens."""
    return (1 << 20) + TOKEN_BYTES * lease_tokens


class LeaseOf(BaseModel):
    """The lease a results body names, when the rest of it is malformed: refused, and requeued."""

    lease: LeaseId
    worker: Name


def parse(model: type[Body], body: object) -> Body:
    """The body as `model`, or ValueError naming the first bad field."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise ValueError(first_problem(e)) from None
