"""Policy models: a local Hugging Face folder, or a tiny Qwen3 built from config with a
character-level tokenizer made offline (nothing is downloaded, ever)."""

from __future__ import annotations

import string
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from sparrowrl.trainer.tasks import Task

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
CHARS = string.digits + string.ascii_lowercase + " +-*=?:<>,.()"


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character of CHARS; prompts and answers of the built-in tasks use no others."""
    vocab = {t: i for i, t in enumerate([PAD, BOS, EOS, *CHARS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # characters join without spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS)


def tiny_config(vocab_size: int, hidden: int, layers: int, heads: int) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=hidden // heads,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def tiny_qwen3(vocab_size: int, hidden: int, layers: int, heads: int, seed: int) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(tiny_config(vocab_size, hidden, layers, heads))


def load(path: str | Path, tokenizer: str | Path | None = None, dtype: torch.dtype = torch.float32):
    """A local Hugging Face folder: (model, tokenizer), the tokenizer from its own folder if given."""
    return (
        AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True),
        load_tokenizer(tokenizer or path),
    )


def check(path: str | Path, tokenizer: str | Path | None = None) -> None:
    """A model folder the trainer could not load, named before any process starts (ValueError):
    its config and tokenizer are read, and it must hold weights."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"model.path: {folder} is not a folder")
    if not [*folder.glob("*.safetensors"), *folder.glob("pytorch_model*.bin")]:
        raise ValueError(f"model.path: {folder} holds no weights (*.safetensors or pytorch_model*.bin)")
    try:
        AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"model.path: {folder}: {str(e).strip().splitlines()[0]}") from None
    try:
        load_tokenizer(tokenizer or folder)
    except (OSError, ValueError, KeyError, TypeError) as e:
        field = "model.tokenizer" if tokenizer else "model.path"
        raise ValueError(f"{field}: {tokenizer or folder}: no tokenizer ({str(e).strip().splitlines()[0]})") from None


def load_tokenizer(path: str | Path):
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def policy_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The bf16 policy that rollout workers hold, one entry per parameter (tied ones once)."""
    return {n: p.detach().to(torch.bfloat16).contiguous() for n, p in model.named_parameters()}


def prompt_ids(tok, text: str) -> list[int]:
    """A prompt's token ids, as both the worker (to generate) and the trainer (to score) see them."""
    ids = tok(text, add_special_tokens=True).input_ids
    if tok.bos_token_id is not None and (not ids or ids[0] != tok.bos_token_id):
        ids = [tok.bos_token_id, *ids]
    return ids


def completion_text(tok, ids: list[int]) -> str:
    """The text of a completion up to (not including) its end-of-sequence token."""
    if tok.eos_token_id in ids:
        ids = ids[: ids.index(tok.eos_token_id)]
    return tok.decode(ids, skip_special_tokens=True)


def warm_up(model: torch.nn.Module, tok, task: Task, steps: int, batch: int = 64, lr: float = 3e-3) -> None:
    """Stand in for pretraining: teach a model made from scratch the task's answers, but let half
    of them run on (`7` as `7=7`), so that it knows the answers and often fails to stop, the kind
    of habit RL post-training removes."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    for s in range(steps):
        exs = [task.example(10**9 + s * batch + i) for i in range(batch)]  # far beyond any RL prompt
        answers = [e.answer if i % 2 else f"{e.answer}={e.answer}" for i, e in enumerate(exs)]
        ids = [
            prompt_ids(tok, e.prompt) + tok(a, add_special_tokens=False).input_ids + [tok.eos_token_id]
            for e, a in zip(exs, answers)
        ]
        n = max(map(len, ids))
        x = torch.tensor([i + [tok.pad_token_id] * (n - len(i)) for i in ids])
        labels = torch.tensor([i + [-100] * (n - len(i)) for i in ids])
        loss = model(input_ids=x, attention_mask=(labels != -100).long(), labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
