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


def eos_first(folder: Path, hidden: int = 32, heads: int = 2, template: str | None = None) -> dict:
    """A tiny Qwen3 whose every turn is its EOS at once (its first token is EOS, whatever came
    before), saved as a user's model folder (config, weights, tokenizer: with `template`, its chat
    template); returns its bf16 policy. An environment sets the pace of its episodes: the same on
    every engine."""
    import torch

    from sparrowrl.trainer import models

    tok = models.char_tokenizer()
    model = models.tiny_qwen3(len(tok), hidden, 1, heads, 0)
    eos = tok.eos_token_id
    with torch.no_grad():
        e = model.model.embed_tokens.weight  # tied: the head too
        e[:, 0] = 1.0  # every token writes +1 into dimension 0 ...
        e[eos, 0] = 50.0  # ... and EOS's row reads it 50 times stronger
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0  # the head sees dimension 0 only
        for layer in model.model.layers:  # which no layer writes into
            layer.self_attn.o_proj.weight[0].zero_()
            layer.mlp.down_proj.weight[0].zero_()
    model.save_pretrained(folder)
    tok.chat_template = template
    tok.save_pretrained(folder)
    return models.policy_state(model)
