"""The Hugging Face transformers engine: `generate` with sampling, in bf16, one call per group."""

from __future__ import annotations

from functools import cached_property

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, StoppingCriteriaList

from sparrowrl.worker.engines.base import Prompt, Sample, Sampling


class HFEngine:
    def __init__(self, model_dir: str, max_model_len: int | None = None, tensor_parallel_size: int = 1):
        if tensor_parallel_size != 1:
            raise ValueError(
                f"rollout.tensorParallelSize: {tensor_parallel_size}, but the hf engine runs on one device; "
                f"use engine: vllm to shard a model"
            )
        self.model_dir, self.max_model_len = model_dir, max_model_len  # None: the model's own context
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        self.model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
        eos = config.eos_token_id
        self.eos = set(eos) if isinstance(eos, list) else {eos}  # some configs list several
        self.pad = config.pad_token_id if config.pad_token_id is not None else min(self.eos)

    @cached_property
    def tok(self):
        """For stop strings only: a job without them needs no tokenizer here."""
        return AutoTokenizer.from_pretrained(self.model_dir, local_files_only=True)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {n: p.data for n, p in self.model.named_parameters()}  # the model's own: writes are live

    def commit(self) -> None:
        pass

    def readback(self) -> dict[str, torch.Tensor]:
        return self.tensors()

    def generate(self, prompts: list[Prompt], sampling: Sampling) -> list[list[Sample]]:
        return [self._group(p, sampling) for p in prompts]

    @torch.inference_mode()
    def _group(self, prompt: Prompt, s: Sampling) -> list[Sample]:
        max_new = s.max_new_tokens
        if self.max_model_len is not None:  # as vLLM: the sequence ends at maxModelLen
            max_new = min(max_new, self.max_model_len - len(prompt.ids))
            if max_new < 1:
                raise ValueError(
                    f"a prompt of {len(prompt.ids)} tokens leaves no room under rollout.maxModelLen "
                    f"({self.max_model_len})"
                )
        ids = torch.tensor([prompt.ids] * s.n)
        stops = _StopStrings(self.tok, s.stop, len(prompt.ids)) if s.stop else None
        torch.manual_seed(prompt.seed)  # one group, one seed: the same weights give the same samples
        out = self.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=s.temperature,
            top_k=s.top_k,
            top_p=s.top_p,
            max_new_tokens=max_new,
            output_logits=True,  # unprocessed: the full distribution, before top-k and top-p
            return_dict_in_generate=True,
            pad_token_id=self.pad,
            eos_token_id=sorted(self.eos),
            **({"stopping_criteria": StoppingCriteriaList([stops])} if stops else {}),
        )
        seq = out.sequences[:, len(prompt.ids) :]
        logp = torch.log_softmax(torch.stack(out.logits, 1).float() / s.temperature, -1)
        logp = logp.gather(-1, seq[..., None]).squeeze(-1)
        samples = []
        for i, (row, lp) in enumerate(zip(seq.tolist(), logp.tolist())):
            eos = next((j + 1 for j, t in enumerate(row) if t in self.eos), None)
            stop = stops.ends.get(i) if stops is not None else None
            if eos is not None and (stop is None or eos <= stop):
                samples.append(Sample(row[:eos], lp[:eos], "eos"))
            elif stop is not None:
                samples.append(Sample(row[:stop], lp[:stop], "stop"))
            else:  # generate pads rows that ended before the longest: none here ended
                samples.append(Sample(row, lp, "length"))
        return samples


class _StopStrings(StoppingCriteria):
    """Ends a row once its completion's text (decoded as vLLM's detokenizer does: special tokens
    skipped) contains a stop string, and records at which length, where the row is cut. Not
    transformers' `stop_strings`: those also match across the prompt's end, and vLLM's do not."""

    def __init__(self, tok, stop: tuple[str, ...], prompt_len: int):
        self.tok, self.stop, self.prompt_len = tok, stop, prompt_len
        self.ends: dict[int, int] = {}  # row → completion length at its first stop string

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        done = torch.zeros(len(input_ids), dtype=torch.bool)
        length = input_ids.shape[1] - self.prompt_len
        for i, row in enumerate(input_ids[:, self.prompt_len :].tolist()):
            if i in self.ends:
                done[i] = True
            elif any(s in self.tok.decode(row, skip_special_tokens=True) for s in self.stop):
                self.ends[i] = length
                done[i] = True
        return done
