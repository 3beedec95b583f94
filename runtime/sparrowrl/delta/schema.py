"""The JSON parts of a delta file, validated strictly: a checksum proves the bytes are the ones
written, not that the writer was honest or correct, so every field is typed and bounded."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, model_validator

from sparrowrl.delta.bitview import DTYPES
from sparrowrl.spec.limits import first_problem

FORMAT_VERSION = 3  # written; 2 (JSON and record headers uncompressed) and 1 (no context records) are still read
READS = (1, 2, 3)
MAX_NUMEL = 1 << 48  # per tensor; far beyond any model, small enough that offsets stay exact
MAX_TENSORS = 1 << 20  # entries a header or manifest may list: far beyond any model, and each is parsed
MAX_CHUNKS = 1 << 24
Name = Annotated[str, StringConstraints(min_length=1, max_length=1024)]
Hash = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{16}$")]
Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
Count = Annotated[int, Field(ge=0, le=1 << 62)]
if TYPE_CHECKING:  # a Literal built at run time, which a type checker cannot read: any name to it
    Dtype = str
else:
    Dtype = Literal[tuple(DTYPES)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class Header(_Strict):
    format: int
    base_version: Count
    base_hash: Hash
    target_version: Count
    segment_elements: Annotated[int, Field(ge=1, le=1 << 24)]
    tensors: Annotated[
        list[tuple[Name, Dtype, Annotated[list[Annotated[int, Field(ge=0, le=MAX_NUMEL)]], Field(max_length=64)]]],
        Field(max_length=MAX_TENSORS),
    ]

    @model_validator(mode="after")
    def _table(self) -> "Header":
        seen: set[str] = set()
        for name, _, shape in self.tensors:
            if name in seen:  # both would address one receiver tensor, hashed twice: the writer refuses this too
                raise ValueError(f"tensor {name!r} is listed twice")
            seen.add(name)
            numel = 1
            for s in shape:
                numel *= s
            if numel > MAX_NUMEL:
                raise ValueError(f"tensor {name!r} has {numel} elements (limit {MAX_NUMEL})")
        return self


class TensorEntry(_Strict):
    changed: Count
    hash_delta: Hash
    chunks: Annotated[list[Count], Field(max_length=2)]


class ChunkEntry(_Strict):
    offset: Count
    length: Count
    sha256: Sha256
    records: Count


class Manifest(_Strict):
    format: int
    base_version: Count
    base_hash: Hash
    target_version: Count
    target_hash: Hash
    header_sha256: Sha256
    elements: Count
    changed: Count
    dense_bytes: Count
    tensors: Annotated[list[TensorEntry], Field(max_length=MAX_TENSORS)]
    chunks: Annotated[list[ChunkEntry], Field(max_length=MAX_CHUNKS)]


M = TypeVar("M", bound=_Strict)


def parse(model: type[M], raw: bytes) -> M:
    """Parse and validate; the one error type is ValueError with the first problem named."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise ValueError(first_problem(e)) from None
