"""A sharded trainer's ranks: FSDP2's dim-0 shards as element ranges of the full tensors, and
the collective parts of a version. Each rank diffs and encodes its own shards, in parallel with
the others; rank 0, the store's one writer, puts their records into the version's one delta,
tensor by tensor, as they arrive (cut-through). A base snapshot gathers one full tensor at a
time. No rank ever holds the whole model.

Rank r of N holds rows [r·c, min((r+1)·c, D)) of a tensor of D rows, c = ceil(D/N) (torch.chunk,
FSDP2's layout, whose padding stays inside FSDP; late ranks may hold none). That is the element
range [row0·L, row1·L) of the flat tensor, L the elements of a row, so records address it, and a
worker applies them as any delta. Every function here is collective: all ranks call it, in the
same order.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from sparrowrl.delta.bitview import bits, dtype_name
from sparrowrl.delta.frame import Encoder, TensorSpec
from sparrowrl.delta.statehash import format_hash, span_hash
from sparrowrl.store import Store, Stream

Shards = dict[str, tuple[int, torch.Tensor]]  # tensor → (its first element here, this rank's flat elements)


def rows(d: int, rank: int, world: int) -> tuple[int, int]:
    """The rows [first, end) of a dim of `d` rows that rank `rank` of `world` holds."""
    c = -(-d // world)
    return min(rank * c, d), min((rank + 1) * c, d)


def span(name: str, p: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(first element, flat local elements) of a parameter sharded on dim 0 (a DTensor), or of a
    plain tensor (all of it, when the trainer is one rank)."""
    if not isinstance(p, DTensor):
        return 0, p.detach().reshape(-1)
    if tuple(p.placements) != (Shard(0),):
        raise RuntimeError(f"parameter '{name}' is placed {p.placements}, not sharded on dim 0")
    mesh = p.device_mesh
    first, end = rows(p.shape[0], mesh.get_local_rank(), mesh.size())
    local = p.to_local()
    if tuple(local.shape) != (end - first, *p.shape[1:]):
        raise RuntimeError(f"parameter '{name}': this rank holds {list(local.shape)}, where rows {first}..{end} "
                           f"of {list(p.shape)} were expected (FSDP's layout changed?)")
    return first * math.prod(p.shape[1:]), local.detach().reshape(-1)


def specs(model: torch.nn.Module) -> list[TensorSpec]:
    """The bf16 policy's tensor table: full shapes, one entry per parameter (tied ones once)."""
    return [TensorSpec(n, "BF16", tuple(p.shape)) for n, p in model.named_parameters()]


def policy(model: torch.nn.Module) -> Shards:
    """This rank's part of the bf16 policy that rollout workers hold."""
    out = {}
    for n, p in model.named_parameters():
        first, flat = span(n, p)
        out[n] = first, flat.to(torch.bfloat16).contiguous()
    return out


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _gather(obj: object) -> list | None:
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def state_hash(table: list[TensorSpec], shards: Shards) -> str:
    """The additive state hash of the policy the ranks hold: each rank's partial sum, added on
    rank 0 (None elsewhere)."""
    pool = None
    part = 0
    for t in table:
        first, flat = shards[t.name]
        if flat.is_cuda:
            from sparrowrl.delta import gpu
            part += gpu.span_hash(t.key(), first, gpu.device_bits(flat))
        else:
            part += span_hash(t.key(), first, bits(flat), pool)
    parts = _gather(part)
    return format_hash(sum(parts) + sum(t.key().term for t in table)) if parts is not None else None


def publish(store: Store | None, table: list[TensorSpec], old: Shards, new: Shards, cut_through: bool = True) -> None:
    """The next version's delta from every rank's shards, into `store` (rank 0's; None on the
    others). Each rank encodes its range of a tensor; rank 0 gathers the records of that tensor
    and writes them, in rank order, which is element order."""
    enc = Encoder(table)
    try:
        if store is None:
            for tid, t in enumerate(table):
                _gather(_encode(enc, tid, t.name, old, new))
            return
        with store.publish(table, cut_through) as w:
            for tid, t in enumerate(table):
                parts = _gather(_encode(enc, tid, t.name, old, new))
                w.add_encoded(t.name, [(first, n) for first, n, _ in parts], (e for *_, es in parts for e in es))
    finally:
        enc.close()


def _encode(enc: Encoder, tid: int, name: str, old: Shards, new: Shards) -> tuple[int, int, list]:
    (first, a), (_, b) = old[name], new[name]
    if dtype_name(a.dtype) != "BF16" or a.shape != b.shape:
        raise RuntimeError(f"tensor '{name}': the shards to diff are {a.dtype}{list(a.shape)} and {b.dtype}"
                           f"{list(b.shape)}")
    return first, a.numel(), [e for e in enc.encode([(tid, first, a, b)]) if e.data]


def gathered(model: torch.nn.Module, dtype: torch.dtype | None = torch.bfloat16) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter in full, one at a time (all ranks get each; only rank 0 needs them), in
    the order of `specs`; cast to `dtype` (None: as trained)."""
    for n, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        yield n, (full.detach() if dtype is None else full.detach().to(dtype)).cpu()


def snapshot(store: Store | None, version: int, model: torch.nn.Module) -> None:
    """A base snapshot of `version`, gathered one tensor at a time; written by rank 0."""
    tensors = gathered(model)
    if store is None:
        for _ in tensors:
            pass
    else:
        store.snapshot(version, Stream(specs(model), tensors))


def init_store(path, model: torch.nn.Module, base_every: int) -> Store | None:
    """A new store whose version 0 is the model's bf16 policy (rank 0's; None elsewhere)."""
    tensors = gathered(model)
    if not _rank0():
        for _ in tensors:
            pass
        return None
    return Store.init(path, Stream(specs(model), tensors), base_every=base_every)


def device() -> torch.device:
    """This rank's device: its GPU (NCCL) when there are GPUs, else the CPU (gloo)."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", dist.get_rank() if dist.is_initialized() else 0)))
    return torch.device("cpu")
