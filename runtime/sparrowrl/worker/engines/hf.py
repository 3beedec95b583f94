"""The Hugging Face transformers engine: `generate` with sampling, in bf16."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from sparrowrl.worker.engines import Sample


class HFEngine:
    def __init__(self, model_dir: str):
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        self.model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
        eos = config.eos_token_id
        self.eos = set(eos) if isinstance(eos, list) else {eos}  # some configs list several
        self.pad = config.pad_token_id if config.pad_token_id is not None else min(self.eos)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {n: p.data for n, p in self.model.named_parameters()}  # the model's own: writes are live

    def commit(self) -> None:
        pass

    def readback(self) -> dict[str, torch.Tensor]:
        return self.tensors()

    @torch.inference_mode()
    def generate(self, prompt: list[int], n: int, seed: int, max_new_tokens: int, temperature: float) -> list[Sample]:
        ids = torch.tensor([prompt] * n)
        torch.manual_seed(seed)  # one group, one seed: the same weights give the same samples
        out = self.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new_tokens,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=self.pad,
            eos_token_id=sorted(self.eos),
        )
        seq = out.sequences[:, len(prompt) :]
        logp = torch.log_softmax(torch.stack(out.logits, 1).float() / temperature, -1)
        logp = logp.gather(-1, seq[..., None]).squeeze(-1)
        samples = []
        for row, lp in zip(seq.tolist(), logp.tolist()):
            k = next((i + 1 for i, t in enumerate(row) if t in self.eos), len(row))
            samples.append(Sample(row[:k], lp[:k]))
        return samples
