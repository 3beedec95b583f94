"""Diff and entropy-code element ranges of tensors, in parallel: what a delta's records are
made of, before a writer frames them (frame.py). A sharded trainer's ranks each encode their own
ranges and hand the records to the one writer."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from sparrowrl.delta import context, device
from sparrowrl.delta.records import MAX_SEGMENT, SEGMENT, Changes, encode_changes
from sparrowrl.delta.schema import FORMAT_VERSION, READS
from sparrowrl.delta.tensors import TensorSpec


@dataclass(frozen=True)
class Encoded:
    """One segment's record as it goes into a delta: its bytes (b"" when nothing changed), its
    changed count, and what it moves the state hash by. A sharded trainer's ranks make these
    for their own element ranges and hand them to the one writer."""

    tensor_id: int
    data: bytes
    changed: int
    hash_delta: int
    version: int  # the format its record is in: a writer takes only its own


class Encoder:
    """Diff and entropy-code element ranges of tensors on a thread pool (the numba kernels
    release the GIL), at most 2 segments per core in flight, results in order. Records never
    cross a range's ends: a range that starts mid-segment is cut on the segment grid from there."""

    def __init__(self, tensors: list[TensorSpec], segment: int = SEGMENT, version: int = FORMAT_VERSION):
        if not 1 <= segment <= MAX_SEGMENT:
            raise ValueError(f"segment must be 1..{MAX_SEGMENT} elements, got {segment}")
        if version not in READS:
            raise ValueError(f"format version must be one of {READS}, got {version}")
        self.tensors, self.segment, self.version = tensors, segment, version
        self.keys = [t.key() for t in tensors]
        self.fields = [context.field(t.dtype) for t in tensors]
        self.pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1)

    def encode(self, spans: Iterable[tuple[int, int, torch.Tensor, torch.Tensor]]) -> Iterator[Encoded]:
        """(tensor id, first element, old, new): `old` and `new` hold that many elements of the
        tensor's flat form from there. CUDA ranges are diffed on the GPU (the whole range at
        once), then entropy-coded here; the bytes are the same as from the CPU path."""
        pending: deque[Future[Encoded]] = deque()
        limit = 2 * (os.cpu_count() or 1)
        for tid, start, old, new in spans:
            for changes in device.segments(old, new, self.segment, self.fields[tid], start):
                pending.append(self.pool.submit(self._encode, tid, changes))
                while len(pending) > limit:
                    yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()

    def _encode(self, tid: int, changes: Callable[[], Changes]) -> Encoded:
        ch = changes()
        data = encode_changes(tid, ch, self.version)
        if not data:
            return Encoded(tid, data, 0, 0, self.version)
        return Encoded(
            tid, data, len(ch.positions), self.keys[tid].change(ch.positions + ch.start, ch.old, ch.new), self.version
        )

    def close(self) -> None:
        self.pool.shutdown()
