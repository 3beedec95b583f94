"""A sharded trainer's model: FSDP2 over the trainer's ranks (dim-0 shards, each rank's an element
range of the full tensors: sync/gather.py), filled from a tiny model, a Hugging Face folder or
another sharded model, and the micro-batches each rank makes. `micro_batches` and `build` with
`from_rank0` are collective: every rank calls them, in the same order.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from sparrowrl.sync.gather import span
from sparrowrl.trainer import grpo


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


def mesh(nodes: int, sharding: str):
    """The ranks' device mesh: one dim over every rank (full), or HSDP's two (hybrid, several
    nodes): replicated across the nodes, sharded within each."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if sharding == "hybrid" and nodes > 1:
        return init_device_mesh(device().type, (nodes, world // nodes), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device().type, (world,), mesh_dim_names=("shard",))


def build(config, fill, mesh=None) -> torch.nn.Module:
    """A causal LM from `config`, sharded with FSDP2 over `mesh` (every rank's, by default; each
    decoder layer, then the root; bf16 compute, fp32 master weights and gradient reduction), whose
    parameters exist only as this rank's shards: made on the meta device, then allocated and
    filled by `fill(model)`."""
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
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
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

    setattr(torch.nn.Module, "register_parameter", on_meta)  # setattr: a type checker refuses assigning a method
    try:
        yield
    finally:
        setattr(torch.nn.Module, "register_parameter", register)


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
