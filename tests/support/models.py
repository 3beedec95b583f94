"""A user's model folder as tests make one: a tiny Qwen3 from config with the built-in character
tokenizer, saved as Hugging Face saves it (config, safetensors, tokenizer), and a chat template
so that chat-format data renders. Nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

# a chat template short enough for the character tokenizer: `u:1+2=<a:`
TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}<{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


def chat_tokenizer():
    """The built-in character tokenizer with TEMPLATE."""
    from sparrowrl.trainer import models

    tok = models.char_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


def save_tiny(folder: Path, hidden: int = 32, seed: int = 0) -> Path:
    from sparrowrl.trainer import models

    tok = chat_tokenizer()
    models.tiny_qwen3(len(tok), hidden, 1, 2, seed).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def decisive_qwen3():
    """A tiny Qwen3 (hidden 128, 2 layers, 4 heads) with large weights, so that greedy choices are
    far from ties and depend on the context, and its tokenizer: what the vLLM tests compare."""
    import torch

    from sparrowrl.trainer import models

    tok = models.char_tokenizer()
    model = models.tiny_qwen3(len(tok), 128, 2, 4, seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 1.0 if "embed" in name else 0.2)
    return model, tok
