"""The shapes of a server's answers, as the client accepts them: every number bounded before it
sizes a buffer or a loop, so that a server (or a relay) cannot make a client allocate or spin
without end by what it lists."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from sparrowrl.store.index import BASE_PART, MAX_BASE_EVERY, MIN_BASE_PART

MAX_BYTES = 1 << 40  # the largest file (base snapshot or delta) a server may list
MAX_ITEMS = 1 << 24  # versions, parts or pieces in one listing
Bytes = Annotated[int, Field(ge=0, le=MAX_BYTES)]
Index = Annotated[int, Field(ge=0, le=1 << 62)]
PieceBytes = Annotated[int, Field(ge=1, le=1 << 30)]  # a piece is held in memory whole
Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
Sig = Annotated[str, StringConstraints(pattern=r"^([A-Za-z0-9_-]{86})?$")]  # "": unsigned


class _Answer(BaseModel):
    """A server's listing, checked before its numbers size a buffer or a loop here."""

    model_config = ConfigDict(strict=True)


class _Base(_Answer):
    bytes: Bytes
    part_bytes: Annotated[int, Field(ge=MIN_BASE_PART, le=BASE_PART)]  # a relay indexes these parts as its own
    parts: Annotated[list[Sha256], Field(max_length=MAX_ITEMS)]
    sig: Sig = ""

    @model_validator(mode="after")
    def _cover(self) -> "_Base":
        if self.part_bytes & (self.part_bytes - 1):
            raise ValueError(f"part_bytes {self.part_bytes} is not a power of two")
        if len(self.parts) != -(-self.bytes // self.part_bytes):
            raise ValueError(f"{len(self.parts)} parts of {self.part_bytes} bytes do not make {self.bytes} bytes")
        return self


class _Delta(_Answer):
    bytes: Bytes
    sha256: Sha256


class _Entry(_Answer):
    version: Index
    state_hash: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{16}$")]
    changed: Index
    delta: _Delta | None
    base: _Base | None


class Listing(_Answer):
    """GET /v1/versions"""

    newest: Index
    base_every: Annotated[int, Field(ge=1, le=MAX_BASE_EVERY)]
    producing: Annotated[list[Index], Field(max_length=MAX_ITEMS)]
    versions: Annotated[list[_Entry], Field(max_length=MAX_ITEMS)]


class Plan(_Answer):
    """GET /v1/plan"""

    route: Literal["none", "chain", "base"]
    base: Index | None
    deltas: Annotated[list[Index], Field(max_length=MAX_ITEMS)]


class PieceList(_Answer):
    """GET /v1/versions/V/pieces and /v1/versions/V/base/pieces"""

    pieces: Annotated[list[tuple[Bytes, PieceBytes, Sha256, bool, Sig]], Field(max_length=MAX_ITEMS)]
    complete: bool
    bytes: Bytes | None
    epoch: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    table_sig: Sig = ""  # with a complete list from its start: the trainer's signature of all of it

    @model_validator(mode="after")
    def _within(self) -> "PieceList":
        if self.complete and self.bytes is None:
            raise ValueError("complete, but without its size")
        size = MAX_BYTES if self.bytes is None else self.bytes
        for i, (offset, length, *_) in enumerate(self.pieces):
            if offset + length > size:
                raise ValueError(f"pieces.{i}: bytes {offset}+{length} end past the file's {size}")
        return self
