"""GRPO, as plain functions of tensors: group-normalized advantages, token log-probs, and the
clipped-ratio loss with an optional k3 KL to a reference, aggregated over tokens; and a step's
forward and backward in micro-batches of a token budget, whose gradients add up to one pass's."""

from __future__ import annotations

from contextlib import nullcontext

import torch

Row = tuple[list[int], list[int], list[float]]  # prompt ids, completion ids, the completion's behaviour log-probs


def advantages(rewards: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """rewards [groups, group_size] → (r - group mean) / (group std + eps). A group whose
    samples all scored alike teaches nothing and gets zeros."""
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, unbiased=False)
    return (rewards - mean) / (std + eps)


def token_logprobs(
    model: torch.nn.Module,
    ids: torch.Tensor,
    attention: torch.Tensor,
    n_prompt: int,
    temperature: float,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-probs of ids[:, n_prompt:] under `model` at `temperature`: [batch, completion_len].
    With left padding, `positions` must count from each row's first real token, as in generation."""
    out = model(input_ids=ids, attention_mask=attention, position_ids=positions)
    logits = out.logits[:, n_prompt - 1 : -1].float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, n_prompt:, None]).squeeze(-1)


def loss(
    logp: torch.Tensor,
    logp_behaviour: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
    logp_ref: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    tokens: float | None = None,
) -> tuple[torch.Tensor, dict]:
    """Clipped-ratio policy loss per token (against the policy that generated the samples, which
    may be one version stale), plus kl_coef · k3(ref ‖ policy); the mean over all completion
    tokens of the batch, so long and short completions weigh per token. `tokens`: what to divide
    the sum by instead of this batch's tokens (a rank's share of a sharded trainer's batch)."""
    ratio = torch.exp(logp - logp_behaviour)
    a = adv[:, None]
    per_token = -torch.minimum(ratio * a, ratio.clamp(1 - clip, 1 + clip) * a)
    stats = {}
    if logp_ref is not None and kl_coef > 0:
        d = logp_ref - logp
        kl = torch.exp(d) - d - 1
        per_token = per_token + kl_coef * kl
        stats["kl"] = float((kl.detach() * mask).sum() / mask.sum())
    n = mask.sum().clamp(min=1)
    stats["clipped"] = float((((ratio - 1).abs() > clip).float() * mask).sum() / n)
    return (per_token * mask).sum() / (n if tokens is None else max(tokens, 1.0)), stats


def pad(rows: list[Row], pad_id: int):
    """Left-pad prompts, right-pad completions: prompts end at one column, so completion token j
    sits at the same position in every row."""
    n_prompt = max(len(p) for p, _, _ in rows)
    n_comp = max(len(c) for _, c, _ in rows)
    ids = torch.full((len(rows), n_prompt + n_comp), pad_id, dtype=torch.long)
    attention = torch.zeros_like(ids)
    mask = torch.zeros(len(rows), n_comp)
    behaviour = torch.zeros(len(rows), n_comp)
    for i, (p, c, lp) in enumerate(rows):
        ids[i, n_prompt - len(p) : n_prompt] = torch.tensor(p)
        ids[i, n_prompt : n_prompt + len(c)] = torch.tensor(c, dtype=torch.long)
        attention[i, n_prompt - len(p) : n_prompt + len(c)] = 1
        mask[i, : len(c)] = 1
        behaviour[i, : len(c)] = torch.tensor(lp)
    positions = (attention.cumsum(1) - 1).clamp(min=0)
    return ids, attention, positions, mask, behaviour


def micro_batches(rows: list[Row], budget: int | None) -> list[list[int]]:
    """Row indices in micro-batches whose padded size, rows x (longest prompt + longest
    completion), stays within `budget` tokens; a row over it goes alone. Rows are taken longest
    first, so alike lengths share a micro-batch and padding stays small. None: one micro-batch
    of every row, in order (one pass)."""
    if budget is None:
        return [list(range(len(rows)))]
    out: list[list[int]] = []
    n_prompt = n_comp = 0
    for i in sorted(range(len(rows)), key=lambda i: len(rows[i][0]) + len(rows[i][1]), reverse=True):
        p, c = len(rows[i][0]), len(rows[i][1])
        if out and (len(out[-1]) + 1) * (max(n_prompt, p) + max(n_comp, c)) <= budget:
            out[-1].append(i)
            n_prompt, n_comp = max(n_prompt, p), max(n_comp, c)
        else:
            out.append([i])
            n_prompt, n_comp = p, c
    return out


def spread(batches: list[list[int]], k: int) -> list[list[int]]:
    """`batches` cut into exactly `k` (at least as many as there are): the one of most rows is
    halved while one has two, then empty ones follow. A sharded trainer's ranks must make as many
    passes as each other (every forward and backward is collective under FSDP)."""
    out = [list(b) for b in batches]
    while len(out) < k:
        big = max(range(len(out)), key=lambda i: len(out[i]))
        if len(out[big]) < 2:
            out += [[] for _ in range(k - len(out))]
            break
        half = len(out[big]) // 2
        out[big : big + 1] = [out[big][:half], out[big][half:]]
    return out


def accumulate(
    model: torch.nn.Module,
    ref: torch.nn.Module | None,
    rows: list[Row],
    adv: torch.Tensor,
    batches: list[list[int]],
    *,
    pad_id: int,
    temperature: float,
    clip: float,
    kl_coef: float,
    tokens: float,
    device: torch.device,
    bf16: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Forward and backward of `rows` (advantages `adv`, one per row, on `device`), one
    micro-batch of `batches` at a time, gradients accumulating in the parameters. Each
    micro-batch's loss is divided by `tokens` (the whole batch's completion tokens, or a rank's
    share of them), so the gradients add up to the one-pass gradient. An empty micro-batch is a
    pass that adds nothing (it takes a row and weighs it 0). `bf16`: compute in bfloat16 under
    autocast (master weights stay as they are). Returns the summed loss (detached) and each
    stat of `loss` summed over the micro-batches times their completion tokens."""
    losses, sums = [], {}
    compute = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
    for idx in batches:
        part = [rows[i] for i in idx or [0]]
        ids, attention, positions, mask, behaviour = (t.to(device) for t in pad(part, pad_id))
        n_prompt = max(len(p) for p, _, _ in part)
        with compute:
            logp = token_logprobs(model, ids, attention, n_prompt, temperature, positions)
            logp_ref = None
            if ref is not None:
                with torch.no_grad():
                    logp_ref = token_logprobs(ref, ids, attention, n_prompt, temperature, positions)
        value, stats = loss(logp, behaviour, adv[idx or [0]], mask, clip, logp_ref, kl_coef, tokens)
        if not idx:
            value = value * 0.0
        value.backward()
        losses.append(value.detach())
        if idx:
            m = float(mask.sum())
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + v * m
    return sum(losses), sums
