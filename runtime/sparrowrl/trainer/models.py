"""Policy models: a local Hugging Face folder (a model from the hub is one, once hub.py has
downloaded it), or a tiny Qwen3 built from config with a character-level tokenizer made offline
(nothing is downloaded here, ever); and what the policy sees of an example (`Prompts`): its
prompt rendered, with the tokenizer's chat template or as text."""

from __future__ import annotations

import math
import string
from pathlib import Path
from typing import TYPE_CHECKING

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

from sparrowrl.trainer.tasks import Example, Source, Task

if TYPE_CHECKING:
    from sparrowrl.spec.job import JobSpec

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


WEIGHTS = ("*.safetensors", "pytorch_model*.bin")  # what a model folder's weights are named (docs/limits.md)


def check(path: str | Path, tokenizer: str | Path | None = None, field: str = "model.path") -> None:
    """A model folder the trainer could not load, named before any process starts (ValueError,
    naming `field`: model.hub for a download): its config and tokenizer are read, and it must hold weights."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"{field}: {folder} is not a folder")
    if not any(f for pattern in WEIGHTS for f in folder.glob(pattern)):
        raise ValueError(f"{field}: {folder} holds no weights ({' or '.join(WEIGHTS)})")
    try:
        AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{field}: {folder}: {str(e).strip().splitlines()[0]}") from None
    try:
        load_tokenizer(tokenizer or folder)
    except (OSError, ValueError, KeyError, TypeError) as e:
        where = "model.tokenizer" if tokenizer else field
        raise ValueError(f"{where}: {tokenizer or folder}: no tokenizer ({str(e).strip().splitlines()[0]})") from None


def tokenizer(spec: JobSpec):
    """The job's tokenizer: the built-in one of a tiny model, or the model's (or model.tokenizer's)."""
    if spec.model.tiny:
        return char_tokenizer()
    source = spec.model.tokenizer or spec.model.path
    if source is None:  # model.hub, not localized (hub.localize)
        raise ValueError("model.hub: not downloaded yet: no tokenizer to load")
    return load_tokenizer(source)


def load_tokenizer(path: str | Path):
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def policy_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The bf16 policy that rollout workers hold, one entry per parameter (tied ones once)."""
    return {n: p.detach().to(torch.bfloat16).contiguous() for n, p in model.named_parameters()}


def prompt_ids(tok, text: str) -> list[int]:
    """A prompt's token ids without a chat template: the tokenizer's special tokens, and BOS first."""
    ids = tok(text, add_special_tokens=True).input_ids
    if tok.bos_token_id is not None and (not ids or ids[0] != tok.bos_token_id):
        ids = [tok.bos_token_id, *ids]
    return ids


class Prompts:
    """What the policy sees of an example: its prompt's text and token ids. The lease's ids
    (control.py), the learner's rows and the warm-up all come from here, so they always agree.

    With a chat template (the tokenizer's own; by default whenever it has one) a plain prompt is
    one user message, and task.systemPrompt is a system message before an example's messages
    unless it has one of its own; the text ends with the template's generation prompt and is
    tokenized as it is (the template places any special tokens). Without one, the text is the
    system prompt, if any, and the messages' contents, joined by newlines: a plain prompt alone
    is itself, as before chat templates were known here."""

    def __init__(
        self, tok, chat_template: bool | None = None, system_prompt: str | None = None, tools: list | None = None
    ):
        has = bool(getattr(tok, "chat_template", None))
        if chat_template and not has:
            raise ValueError("chatTemplate: true, but the tokenizer has no chat template")
        self.tok, self.system = tok, system_prompt
        self.templated = has if chat_template is None else chat_template
        self.tools = tools  # an environment's tools' JSON schemas: the template shows them to the model

    def with_tools(self, tools: list) -> Prompts:
        return Prompts(self.tok, self.templated, self.system, tools or None)

    @classmethod
    def for_job(cls, spec: JobSpec, tok) -> Prompts:
        return cls(tok, spec.task.chat_template, spec.task.system_prompt)

    def render(self, src: Source) -> Example:
        """ValueError: the chat template refused the example (its reason)."""
        if src.messages is not None:
            messages = list(src.messages)
        else:
            assert src.prompt is not None  # a Source holds a prompt or messages
            messages = [("user", src.prompt)]
        if self.system is not None and all(role != "system" for role, _ in messages):
            messages.insert(0, ("system", self.system))
        if not self.templated:
            return Example("\n".join(content for _, content in messages), src.answer, src.fields, tuple(messages))
        try:
            text = self.tok.apply_chat_template(
                [{"role": r, "content": c} for r, c in messages],
                tools=self.tools,
                tokenize=False,
                add_generation_prompt=True,
            )
        except Exception as e:  # jinja's errors, and what a template's own raise_exception raises
            raise ValueError(f"the chat template refused it ({type(e).__name__}: {e})") from None
        return Example(text, src.answer, src.fields, tuple(messages))

    def ids(self, text: str) -> list[int]:
        """A rendered prompt's token ids, as both the worker (to generate) and the trainer (to score) see them."""
        return self.tok(text, add_special_tokens=False).input_ids if self.templated else prompt_ids(self.tok, text)


def completion_text(tok, ids: list[int]) -> str:
    """The text of a completion up to (not including) its end-of-sequence token."""
    if tok.eos_token_id in ids:
        ids = ids[: ids.index(tok.eos_token_id)]
    return tok.decode(ids, skip_special_tokens=True)


def warm_up(
    model: torch.nn.Module, prompts: Prompts, task: Task, steps: int, batch: int = 64, lr: float = 3e-3
) -> None:
    """Stand in for pretraining: teach a model made from scratch the task's answers, but let half
    of them run on (`7` as `7=7`), so that it knows the answers and often fails to stop, the kind
    of habit RL post-training removes.

    The rate decays to 0 (cosine): where a constant rate stops, the model is still moving fast,
    and that point depends on the last bits of the CPU's sums as much as on the seed (AVX2 and
    AVX-512 kernels started RL from models 0.03 apart in reward, and ended it 0.10 apart); one
    that has settled does not (docs/rl.md, the tiny model's warm-up)."""
    tok = prompts.tok
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / max(steps, 1))))
    for s in range(steps):
        exs = [task.example(10**9 + s * batch + i) for i in range(batch)]  # far beyond any RL prompt
        answers = [e.answer if i % 2 else f"{e.answer}={e.answer}" for i, e in enumerate(exs)]
        ids = [
            prompts.ids(e.prompt) + tok(a, add_special_tokens=False).input_ids + [tok.eos_token_id]
            for e, a in zip(exs, answers)
        ]
        n = max(map(len, ids))
        x = torch.tensor([i + [tok.pad_token_id] * (n - len(i)) for i in ids])
        labels = torch.tensor([i + [-100] * (n - len(i)) for i in ids])
        loss = model(input_ids=x, attention_mask=(labels != -100).long(), labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
