"""vLLM's parameters by the trainer's names: q, k and v are row blocks of `qkv_proj`, gate and up
of `gate_up_proj` (the model's `packed_modules_mapping`), the vocabulary is padded, and a tied head
shares the embedding. Shared by the in-process engine (`worker/engines/vllm.py`) and the `vllm
serve` backend (`vllm_backend.py`); pure torch, so that importing it loads no vLLM.

On GPU each trainer tensor is a view into vLLM's (fused) parameter. On CPU vLLM repacks every
linear weight into a kernel layout and leaves an empty parameter, so `readback` reads the weights
out of the kernels (linear(I) = Wᵀ) and maps them to the trainer's names."""

from __future__ import annotations

import torch


def hf_shapes(config) -> dict[str, torch.Size]:
    """The trainer's tensor names and shapes for a Hugging Face config (a model built on the meta
    device: no memory, no weights)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config)
    return {n: p.shape for n, p in hf.named_parameters()}


def packed(model: torch.nn.Module) -> dict[str, list[str]]:
    return dict(getattr(model, "packed_modules_mapping", {}))


def owners(model: torch.nn.Module) -> dict[int, str]:
    """A parameter → its name where first defined (tied ones are shared)."""
    out: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(param), name)
    return out


def tied_modules(model: torch.nn.Module, owner: dict[int, str]) -> list[torch.nn.Module]:
    """Modules with a quant method whose weight another module owns (a tied head): a reload
    repacks a weight for its owner only, so these must process their weights again."""
    return [
        m
        for name, m in model.named_modules()
        if isinstance(getattr(m, "weight", None), torch.Tensor)
        and hasattr(m, "quant_method")
        and owner[id(m.weight)] != f"{name}.weight"
    ]


def unpack(module: torch.nn.Module, k: int) -> torch.Tensor:
    """The weight a CPU kernel computes with: linear(I) = Wᵀ, exact in bf16 (one product per
    output, the rest zeros) except for the sign of zero. About one prefill of k tokens: cheap
    for tiny models, minutes for billions of parameters on CPU."""
    linear = getattr(module, "cpu_linear")  # vLLM's CPU layers' own
    return linear(torch.eye(k, dtype=torch.bfloat16), module.weight, None).t().contiguous()


class Layout:
    """The mapping between the trainer's tensors (`shapes`) and vLLM's parameters."""

    def __init__(self, shapes: dict[str, torch.Size], vocab: int, packing: dict[str, list[str]]):
        self.shapes, self.vocab, self.packed = shapes, vocab, packing

    def complete(self, found: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`found` in the policy's order, if it holds every tensor of the policy."""
        missing = sorted(set(self.shapes) - set(found))
        if missing:
            raise RuntimeError(f"vLLM holds no parameter for {missing[:3]}")
        return {n: found[n] for n in self.shapes}

    def parts(self, name: str, live: torch.Tensor) -> dict[str, torch.Tensor]:
        """A vLLM parameter as views of the trainer's tensors: fused rows split in the order vLLM
        stacked them, the vocabulary's padding rows cut."""
        module, _, leaf = name.rpartition(".")
        parent, _, last = module.rpartition(".")
        parts = [f"{parent}.{p}.{leaf}" for p in self.packed[last]] if last in self.packed else [name]
        if any(p not in self.shapes for p in parts):
            raise RuntimeError(f"vLLM parameter '{name}' maps to {parts}, which the policy lacks")
        rows = [self.shapes[p][0] for p in parts]
        padded = len(parts) == 1 and rows[0] == self.vocab and live.shape[0] >= self.vocab
        if live.shape[0] != sum(rows) and not padded or live[0].numel() != self.shapes[parts[0]][1:].numel():
            raise RuntimeError(f"vLLM parameter '{name}' is {list(live.shape)}, not the rows of {parts}")
        return {p: t.view(self.shapes[p]) for p, t in zip(parts, live[: sum(rows)].split(rows))}

    def live(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """On GPU: views of vLLM's parameters by the trainer's names."""
        out: dict[str, torch.Tensor] = {}
        for name, param in model.named_parameters():
            out.update(self.parts(name, param.data))
        return self.complete(out)

    @torch.inference_mode()
    def readback(
        self, model: torch.nn.Module, owner: dict[int, str], like: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """On CPU: the weights vLLM computes with, read out of its packed kernels, by the trainer's
        names. `like` (the policy as last loaded) gives the dtype, and the sign of a zero, which
        no matmul shows."""
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

        out: dict[str, torch.Tensor] = {}
        for name, param in model.named_parameters():  # each shared parameter once
            if param.numel():  # kept as a plain tensor: embeddings, norms
                out.update({n: t.to(like[n].dtype) for n, t in self.parts(name, param.detach()).items()})
        for name, module in model.named_modules():
            weight = getattr(module, "weight", None)
            if (
                not hasattr(module, "cpu_linear")
                or weight is None
                or isinstance(module, VocabParallelEmbedding)
                and not isinstance(module, ParallelLMHead)
            ):
                continue  # an embedding's kernel copy computes nothing
            k = weight.shape[1] if weight.numel() else module.input_size_per_partition
            for n, t in self.parts(owner[id(weight)], unpack(module, k)).items():
                mine = like[n]
                t = torch.where((t == 0) & (mine == 0), mine, t.to(mine.dtype))  # no matmul shows a zero's sign
                if not weight.numel():  # packed for the kernel, the parameter left empty
                    out[n] = t
                elif not torch.equal(t, out[n]):  # a kept weight's packed copy (a tied head) must agree
                    raise RuntimeError(f"vLLM's kernel for '{name}' computes with other weights than '{n}'")
        return self.complete(out)

    def gather(self, ranks: list[dict[str, torch.Tensor]], tp: int) -> dict[str, torch.Tensor]:
        """The ranks' shards of each parameter (vLLM's names) joined into the trainer's tensors:
        column-parallel rows (each fused part on its own, key/value heads that several ranks hold
        once), row-parallel columns, replicated ones checked equal on every rank."""
        out: dict[str, torch.Tensor] = {}
        for name in ranks[0]:
            shards = [r[name] for r in ranks]
            module, _, leaf = name.rpartition(".")
            parent, _, last = module.rpartition(".")
            parts = [f"{parent}.{p}.{leaf}" for p in self.packed[last]] if last in self.packed else [name]
            if any(p not in self.shapes for p in parts):
                raise RuntimeError(f"vLLM parameter '{name}' maps to {parts}, which the policy lacks")
            full = [self.shapes[p] for p in parts]
            if len(parts) == 1 and shards[0].shape == full[0]:  # replicated
                if any(not torch.equal(t, shards[0]) for t in shards[1:]):
                    raise RuntimeError(f"the ranks of vLLM hold different copies of '{name}'")
                out[name] = shards[0]
                continue
            if len(parts) == 1 and shards[0].dim() == 2 and shards[0].shape[1] * tp == full[0][1]:
                out[name] = torch.cat(shards, 1)  # row-parallel: split by input columns
                continue
            # column-parallel: each rank holds its rows of every part (q, k, v: k and v alike)
            q = full[0][0] // tp if len(parts) > 1 else shards[0].shape[0]
            local = [q] * len(parts) if len(parts) != 3 else [q, *[(shards[0].shape[0] - q) // 2] * 2]
            for p, rows, pieces in zip(parts, [s[0] for s in full], zip(*(t.split(local) for t in shards))):
                held = len(pieces) * pieces[0].shape[0] // rows if len(parts) > 1 else 1  # ranks per row
                if held > 1 and any(not torch.equal(t, pieces[i - i % held]) for i, t in enumerate(pieces)):
                    raise RuntimeError(f"the ranks of vLLM that share rows of '{p}' hold different ones")
                out[p] = torch.cat(pieces[::held])[:rows]  # the vocabulary's padding rows cut
        for n, t in out.items():
            if n in self.shapes and t.shape != self.shapes[n]:
                raise RuntimeError(f"vLLM's shards of '{n}' join to {list(t.shape)}, not {list(self.shapes[n])}")
        return self.complete(out)
