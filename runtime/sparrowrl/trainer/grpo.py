"""GRPO, as plain functions of tensors: group-normalized advantages, token log-probs, and the
clipped-ratio loss with an optional k3 KL to a reference, aggregated over tokens."""

from __future__ import annotations

import torch


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


def pad(rows: list[tuple[list[int], list[int], list[float]]], pad_id: int):
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
