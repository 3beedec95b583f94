"""The ranks' part of publishing: a policy's tensors as element ranges, one per rank, diffed and
encoded where they live, and gathered into one delta. FSDP2's dim-0 shards are element ranges of
the full tensors; a plain tensor is one range, held whole by its one process.

Each rank diffs and encodes its own shards, in parallel with the others; rank 0, the store's one
writer, gathers their records a group of tensors at a time and writes them into the version's one
delta, which is served as it grows (cut-through). A base snapshot gathers one full tensor at a
time. No rank ever holds the whole model.

Rank r of N holds rows [r·c, min((r+1)·c, D)) of a tensor of D rows, c = ceil(D/N) (torch.chunk,
FSDP2's layout, whose padding stays inside FSDP; late ranks may hold none). That is the element
range [row0·L, row1·L) of the flat tensor, L the elements of a row, so records address it, and a
worker applies them as any delta. Under HSDP (each node holds the whole model, sharded over its
own ranks) the ranks that hold the same shard split its range among them (`part`). Where the
weights are sharded, `state_hash`, `publish`, `stream`, `snapshot`, `init_store` and
`policy_from_rank0` are collective: every rank calls them, in the same order.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import nullcontext
from itertools import islice
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from sparrowrl.delta.bitview import dtype_name
from sparrowrl.delta.device import span_hash
from sparrowrl.delta.encoder import Encoded, Encoder
from sparrowrl.delta.statehash import format_hash
from sparrowrl.delta.tensors import TensorSpec
from sparrowrl.store.store import Store, Stream

Weights = torch.nn.Module | Mapping[str, torch.Tensor]  # a model's parameters, or named tensors (DTensors or plain)

Shards = dict[str, tuple[int, torch.Tensor]]  # tensor → (its first element here, this rank's flat elements)


def rows(d: int, rank: int, world: int) -> tuple[int, int]:
    """The rows [first, end) of a dim of `d` rows that rank `rank` of `world` holds."""
    c = -(-d // world)
    return min(rank * c, d), min((rank + 1) * c, d)


def span(name: str, p: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(first element, flat local elements) of a parameter sharded on dim 0 (a DTensor: FSDP2's
    one-dim mesh, or HSDP's two, replicated across nodes and sharded within one), or of a plain
    tensor (all of it, when the trainer is one rank)."""
    if not isinstance(p, DTensor):
        return 0, p.detach().reshape(-1)
    mesh, placements = p.device_mesh, tuple(p.placements)
    if placements not in ((Shard(0),), (Replicate(), Shard(0))):
        raise RuntimeError(f"parameter '{name}' is placed {p.placements}, not sharded on dim 0")
    dim = mesh.ndim - 1  # the mesh's sharding dim: its last
    first, end = rows(p.shape[0], mesh.get_local_rank(dim), mesh.size(dim))
    local = p.to_local()
    if tuple(local.shape) != (end - first, *p.shape[1:]):
        raise RuntimeError(
            f"parameter '{name}': this rank holds {list(local.shape)}, where rows {first}..{end} "
            f"of {list(p.shape)} were expected (FSDP's layout changed?)"
        )
    return first * math.prod(p.shape[1:]), local.detach().reshape(-1)


def part(name: str, p: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(first element, flat elements) of the part of a parameter this rank publishes: its span,
    split among the replicas that hold the same span (HSDP's nodes), so that every element is
    diffed and encoded once and every rank does its share."""
    first, flat = span(name, p)
    if not isinstance(p, DTensor) or p.device_mesh.ndim == 1:
        return first, flat
    mesh = p.device_mesh
    r, replicas, n = mesh.get_local_rank(0), mesh.size(0), flat.numel()
    a, b = n * r // replicas, n * (r + 1) // replicas
    return first + a, flat[a:b]


def named(weights: Weights) -> Iterator[tuple[str, torch.Tensor]]:
    """A model's parameters (tied ones once), or the tensors of a mapping, in order."""
    return weights.named_parameters() if isinstance(weights, torch.nn.Module) else iter(weights.items())


def sharded(weights: Weights) -> bool:
    """Whether the weights are DTensors: then every rank holds a part, and publishing is collective."""
    return any(isinstance(t, DTensor) for _, t in named(weights))


def specs(weights: Weights, dtype: str = "BF16") -> list[TensorSpec]:
    """The bf16 policy's tensor table (or in `dtype`): full shapes, one entry per tensor."""
    return [TensorSpec(n, dtype, tuple(p.shape)) for n, p in named(weights)]


def policy(weights: Weights) -> Shards:
    """This rank's part of the bf16 policy that rollout workers hold: a copy, also of weights that
    are bf16 already, which the next optimizer step changes in place."""
    out = {}
    for n, p in named(weights):
        first, flat = part(n, p)
        out[n] = first, flat.to(torch.bfloat16, copy=True).contiguous()
    return out


def rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _gather(obj: object, collective: bool = True) -> list[Any] | None:
    if not collective or not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def state_hash(table: list[TensorSpec], shards: Shards, collective: bool = True) -> str | None:
    """The additive state hash of the policy the ranks hold: each rank's partial sum, added on
    rank 0 (None elsewhere); without `collective`, of what this process holds (all of it)."""
    part = 0
    for t in table:
        first, flat = shards[t.name]
        part += span_hash(t.key(), first, flat)
    parts = _gather(part, collective)
    return format_hash(sum(parts) + sum(t.key().term for t in table)) if parts is not None else None


GATHER_ELEMENTS = 1 << 27  # tensors are gathered to rank 0 in groups of about this many elements: fewer calls


def publish(
    store: Store | None, table: list[TensorSpec], old: Shards, new: Shards, cut_through: bool = True
) -> dict[str, float]:
    """The next version's delta from every rank's shards, into `store` (rank 0's; None on the
    others). Each rank encodes its ranges of every tensor, ahead on its thread pool; rank 0
    gathers a group of tensors' records from all ranks at a time (one collective per group) and
    writes them, tensor by tensor in rank order, which is element order. Returns where this
    rank's time went (waiting on its own encoding, in gathers, writing) and the bytes it sent."""
    enc = Encoder(table)
    took = {"encode_s": 0.0, "gather_s": 0.0, "write_s": 0.0, "sent_bytes": 0}
    try:
        with store.publish(table, cut_through) if store is not None else nullcontext() as w:
            records = _records(enc, table, old, new)
            for group in _groups(table):
                t0 = time.perf_counter()
                mine = [next(records) for _ in group]
                t1 = time.perf_counter()
                parts = _gather(mine)
                t2 = time.perf_counter()
                took["encode_s"] += t1 - t0
                took["gather_s"] += t2 - t1
                took["sent_bytes"] += sum(len(e.data) for _, _, es in mine for e in es)
                if w is not None:
                    assert parts is not None  # rank 0, which writes, gathers every rank's part
                    for k, tid in enumerate(group):
                        ranks = sorted(
                            (p[k] for p in parts), key=lambda r: r[:2]
                        )  # element order (HSDP's isn't rank order)
                        w.add_encoded(
                            table[tid].name, [(first, n) for first, n, _ in ranks], (e for *_, es in ranks for e in es)
                        )
                    took["write_s"] += time.perf_counter() - t2
        return took
    finally:
        enc.close()


def _groups(table: list[TensorSpec]) -> Iterator[list[int]]:
    """Tensor ids in consecutive groups of about GATHER_ELEMENTS elements (at least one tensor)."""
    group, size = [], 0
    for tid, t in enumerate(table):
        group.append(tid)
        size += t.numel
        if size >= GATHER_ELEMENTS:
            yield group
            group, size = [], 0
    if group:
        yield group


def _records(
    enc: Encoder, table: list[TensorSpec], old: Shards, new: Shards
) -> Iterator[tuple[int, int, list[Encoded]]]:
    """For each tensor in order: (its first element here, the count, this rank's non-empty
    records), encoded on the pool as far ahead as it allows. A range of n elements makes
    ceil(n / segment) records, empty ones included, on the CPU and the GPU alike."""
    spans = []
    for tid, t in enumerate(table):
        (first, a), (_, b) = old[t.name], new[t.name]
        if dtype_name(a.dtype) != "BF16" or a.shape != b.shape:
            raise RuntimeError(
                f"tensor '{t.name}': the shards to diff are {a.dtype}{list(a.shape)} and {b.dtype}{list(b.shape)}"
            )
        spans.append((tid, first, a, b))
    encoded = enc.encode(spans)
    for _, first, a, _ in spans:
        yield first, a.numel(), [e for e in islice(encoded, -(-a.numel() // enc.segment)) if e.data]


def gathered(weights: Weights, dtype: torch.dtype = torch.bfloat16) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in full, one at a time (all ranks get each; only rank 0 needs them), in the
    order of `specs`, cast to `dtype`, on the host."""
    for n, p in named(weights):
        full = p.full_tensor() if isinstance(p, DTensor) else p
        yield n, full.detach().to(dtype).cpu()


def stream(weights: Weights, write: Callable[[Stream], object] | None, dtype: torch.dtype = torch.bfloat16) -> None:
    """All the weights, one gathered tensor at a time, into `write` on rank 0; the other ranks
    (`write` None) only take part in the gathers."""
    tensors = gathered(weights, dtype)
    if write is None:
        for _ in tensors:
            pass
    else:
        write(Stream(specs(weights, dtype_name(dtype)), tensors))


def snapshot(store: Store | None, version: int, weights: Weights) -> None:
    """A base snapshot of `version`, checked against its hash; written by rank 0."""
    stream(weights, None if store is None else lambda s: store.snapshot(version, s))


def init_store(path: str | Path, weights: Weights, base_every: int, writer: bool | None = None) -> Store | None:
    """A new store whose version 0 is the weights' bf16 policy, written by `writer` (by default
    rank 0; None elsewhere)."""
    writer = rank0() if writer is None else writer
    stream(weights, (lambda s: Store.init(path, s, base_every=base_every)) if writer else None)
    return Store(path) if writer else None


def policy_from_rank0(weights: Weights, full: dict[str, torch.Tensor] | None) -> Shards:
    """This rank's part of a bf16 policy that rank 0 holds whole (a version read from its store),
    each tensor broadcast in turn: the policy a restarted trainer diffs its next version against."""
    out = {}
    for n, p in named(weights):
        first, flat = part(n, p)
        buf = (
            full[n].to(flat.device).contiguous()
            if full is not None
            else torch.empty(p.shape, dtype=torch.bfloat16, device=flat.device)
        )
        dist.broadcast(buf, src=0)
        out[n] = first, buf.reshape(-1)[first : first + flat.numel()].clone()
    return out
