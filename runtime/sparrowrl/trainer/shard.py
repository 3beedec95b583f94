"""A sharded trainer's ranks: FSDP2's dim-0 shards as element ranges of the full tensors, and
the collective parts of a version. Each rank diffs and encodes its own shards, in parallel with
the others; rank 0, the store's one writer, gathers their records a group of tensors at a time
and writes them into the version's one delta, which is served as it grows (cut-through). A base
snapshot gathers one full tensor at a time. No rank ever holds the whole model.

Rank r of N holds rows [r·c, min((r+1)·c, D)) of a tensor of D rows, c = ceil(D/N) (torch.chunk,
FSDP2's layout, whose padding stays inside FSDP; late ranks may hold none). That is the element
range [row0·L, row1·L) of the flat tensor, L the elements of a row, so records address it, and a
worker applies them as any delta. `state_hash`, `publish`, `stream` and what calls it, `micro_batches`,
and `build` with `from_rank0` are collective: every rank calls them, in the same order.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from itertools import islice

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from sparrowrl.delta.bitview import bits, dtype_name
from sparrowrl.delta.encoder import Encoder
from sparrowrl.delta.statehash import format_hash, span_hash
from sparrowrl.delta.tensors import TensorSpec
from sparrowrl.store.store import Store, Stream
from sparrowrl.trainer import grpo

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
        raise RuntimeError(
            f"parameter '{name}': this rank holds {list(local.shape)}, where rows {first}..{end} "
            f"of {list(p.shape)} were expected (FSDP's layout changed?)"
        )
    return first * math.prod(p.shape[1:]), local.detach().reshape(-1)


def specs(model: torch.nn.Module, dtype: str = "BF16") -> list[TensorSpec]:
    """The bf16 policy's tensor table (or in `dtype`): full shapes, one entry per parameter (tied
    ones once)."""
    return [TensorSpec(n, dtype, tuple(p.shape)) for n, p in model.named_parameters()]


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


def state_hash(table: list[TensorSpec], shards: Shards) -> str | None:
    """The additive state hash of the policy the ranks hold: each rank's partial sum, added on
    rank 0 (None elsewhere)."""
    part = 0
    for t in table:
        first, flat = shards[t.name]
        if flat.is_cuda:
            from sparrowrl.delta import gpu

            part += gpu.span_hash(t.key(), first, gpu.device_bits(flat))
        else:
            part += span_hash(t.key(), first, bits(flat))
    parts = _gather(part)
    return format_hash(sum(parts) + sum(t.key().term for t in table)) if parts is not None else None


GATHER_ELEMENTS = 1 << 27  # tensors are gathered to rank 0 in groups of about this many elements: fewer calls


def publish(store: Store | None, table: list[TensorSpec], old: Shards, new: Shards, cut_through: bool = True) -> dict:
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
                    for k, tid in enumerate(group):
                        ranks = [p[k] for p in parts]
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


def _records(enc: Encoder, table: list[TensorSpec], old: Shards, new: Shards) -> Iterator[tuple[int, int, list]]:
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


def gathered(model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter in full, one at a time (all ranks get each; only rank 0 needs them), in
    the order of `specs`, cast to `dtype`, on the host."""
    for n, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        yield n, full.detach().to(dtype).cpu()


def stream(model: torch.nn.Module, write: Callable[[Stream], None] | None, dtype: torch.dtype = torch.bfloat16) -> None:
    """The whole model, one gathered tensor at a time, into `write` on rank 0; the other ranks
    (`write` None) only take part in the gathers."""
    tensors = gathered(model, dtype)
    if write is None:
        for _ in tensors:
            pass
    else:
        write(Stream(specs(model, dtype_name(dtype)), tensors))


def snapshot(store: Store | None, version: int, model: torch.nn.Module) -> None:
    """A base snapshot of `version`, checked against its hash; written by rank 0."""
    stream(model, None if store is None else lambda s: store.snapshot(version, s))


def init_store(path, model: torch.nn.Module, base_every: int) -> Store | None:
    """A new store whose version 0 is the model's bf16 policy (rank 0's; None elsewhere)."""
    stream(model, (lambda s: Store.init(path, s, base_every=base_every)) if _rank0() else None)
    return Store(path) if _rank0() else None


def micro_batches(rows: list[grpo.Row], budget: int | None) -> list[list[int]]:
    """This rank's micro-batches (grpo.micro_batches), as many as the rank with the most has:
    each pass's forward and backward are collective under FSDP, so every rank makes the same
    number (collective)."""
    batches = grpo.micro_batches(rows, budget)
    if budget is None:  # one pass on every rank
        return batches
    most = torch.tensor(len(batches), device=device())
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return grpo.spread(batches, int(most))


def device() -> torch.device:
    """This rank's device: its GPU (NCCL) when there are GPUs, else the CPU (gloo)."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", dist.get_rank() if dist.is_initialized() else 0)))
    return torch.device("cpu")


def build(config, fill) -> torch.nn.Module:
    """A causal LM from `config`, sharded with FSDP2 (each decoder layer, then the root; bf16
    compute, fp32 master weights and gradient reduction), whose parameters exist only as this
    rank's shards: made on the meta device, then allocated and filled by `fill(model)`."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    with _params_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no model.layers to shard (a decoder-only LM is expected)")
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}  # rotary tables: real, not meta
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    model.to_empty(device=device())
    with torch.no_grad():
        for n, b in model.named_buffers():
            b.copy_(buffers[n])
        fill(model)
    return model


@contextmanager
def _params_on_meta() -> Iterator[None]:
    """Parameters made inside go to the meta device as they are registered (each allocated only
    for that moment, never initialized); buffers stay real."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:  # one already made here is registered again when tied
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def from_rank0(full: torch.nn.Module | None):
    """Fill from a whole model that rank 0 holds (a tiny model made from config): each tensor is
    broadcast, and each rank keeps its rows."""

    def fill(model: torch.nn.Module) -> None:
        for n, p in model.named_parameters():
            first, flat = span(n, p)
            buf = (
                full.get_parameter(n).detach().to(flat.device)
                if full is not None
                else torch.empty(p.shape, dtype=flat.dtype, device=flat.device)
            )
            dist.broadcast(buf, src=0)
            flat.copy_(buf.reshape(-1)[first : first + flat.numel()])

    return fill


def policy_from_rank0(model: torch.nn.Module, full: dict[str, torch.Tensor] | None) -> Shards:
    """This rank's part of a bf16 policy that rank 0 holds whole (a version read from its store),
    each tensor broadcast in turn: the policy a restarted trainer diffs its next version against."""
    out = {}
    for n, p in model.named_parameters():
        first, flat = span(n, p)
        buf = (
            full[n].to(flat.device).contiguous()
            if full is not None
            else torch.empty(p.shape, dtype=torch.bfloat16, device=flat.device)
        )
        dist.broadcast(buf, src=0)
        out[n] = first, buf.reshape(-1)[first : first + flat.numel()].clone()
    return out


def from_files(path) -> Callable[[torch.nn.Module], None]:
    """Fill from a Hugging Face folder's safetensors: each rank reads only its rows."""
    from sparrowrl.store.checkpoint_io import Checkpoint, CheckpointError

    def fill(model: torch.nn.Module) -> None:
        with Checkpoint(path) as ck:
            for n, p in model.named_parameters():
                if n not in ck.where:
                    raise CheckpointError(f"{path}: no tensor '{n}', which the model's config has")
                first, flat = span(n, p)
                row = math.prod(p.shape[1:])
                part = ck.where[n].get_slice(n)[first // row : (first + flat.numel()) // row]
                flat.copy_(part.reshape(-1))

    return fill


def from_model(other: torch.nn.Module) -> Callable[[torch.nn.Module], None]:
    """Fill from another model sharded the same way (the frozen reference, a copy of the policy)."""

    def fill(model: torch.nn.Module) -> None:
        for (n, p), (_, q) in zip(model.named_parameters(), other.named_parameters(), strict=True):
            span(n, p)[1].copy_(span(n, q)[1])

    return fill
