"""GRPO, as plain functions of tensors: advantages, token log-probs, and the loss, in the decoupled
form of asynchronous PPO (docs/rl.md, "The objective"); and a step's forward and backward in
micro-batches of a token budget, whose gradients add up to one pass's.

Three policies meet in the loss. μ sampled the tokens: a worker's engine, up to `sync.staleness`
versions old, whose log-probs the worker reports and the trainer does not trust. π_prox is the
trainer's own policy at the start of the step, computed here, without gradient. π_θ is the one
being trained. The behaviour weight w = π_prox/μ corrects for whatever sampled (staleness, the
engine's kernels), truncated or masked so that no worker's numbers can blow it up; the PPO ratio
r = π_θ/π_prox is the trust region, against the trainer's own numbers only. With one update per
batch π_prox is π_θ's value, so r = 1 and the step is w-weighted policy gradient."""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import cast

import torch

from sparrowrl.spec.grpo import GrpoSpec

# prompt ids, completion ids, the completion's behaviour log-probs, and which of its tokens were
# sampled (None: all; an episode's environment turns are not: they are context, never trained)
Row = tuple[list[int], list[int], list[float], list[bool] | None]

LOG_W_SHOWN = 20.0  # the weight's metrics clamp log w to ±this: a false log-prob must not make a metric infinite


@dataclass(frozen=True)
class Objective:
    """The loss's settings: the job's `grpo` fields (GrpoSpec says what each means)."""

    temperature: float = 1.0
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = 3.0
    ratio_level: str = "token"  # or "sequence": GSPO
    correction: str = "truncate"  # of the behaviour weight: "off", "truncate" or "mask"
    correction_level: str = "token"  # or "sequence": the geometric mean of the tokens' weights
    cap: float = 2.0
    floor: float = 0.0
    refuse_gap: float = 1.0  # nats per token, mean |log π_prox − log μ| of a sample
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0

    @classmethod
    def of(cls, g: GrpoSpec) -> Objective:
        b = g.behaviour
        return cls(
            temperature=g.temperature,
            clip_low=g.clip,
            clip_high=g.clip if g.clip_high is None else g.clip_high,
            dual_clip=g.dual_clip,
            ratio_level=g.ratio_level,
            correction=b.correction,
            correction_level=b.level,
            cap=b.cap,
            floor=b.floor,
            refuse_gap=b.refuse_gap,
            kl_coef=g.kl_coef,
            kl_estimator=g.kl_estimator,
            entropy_coef=g.entropy_coef,
        )


@dataclass
class Stats:
    """What a loss saw, in a form that adds up over micro-batches and ranks: `sums` over completion
    tokens (`tokens` counts them), `highs` maxima (a minimum is the maximum of its negative), and
    per row (tokens, Σ|Δ|, max |Δ|, refused) where Δ = log π_prox − log μ."""

    sums: dict[str, float] = field(default_factory=dict)
    highs: dict[str, float] = field(default_factory=dict)
    rows: list[tuple[int, float, float, bool]] = field(default_factory=list)

    def add(self, other: Stats) -> None:
        for k, v in other.sums.items():
            self.sums[k] = self.sums.get(k, 0.0) + v
        for k, v in other.highs.items():
            self.highs[k] = max(self.highs.get(k, -math.inf), v)
        self.rows += other.rows


def advantages(rewards: torch.Tensor, scale: str = "group", eps: float = 1e-4) -> torch.Tensor:
    """rewards [groups, group_size] → r − the group's mean, over the group's std (`group`), the
    whole batch's (`batch`) or 1 (`none`), plus eps. A group whose samples all scored alike gets
    zeros."""
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if scale == "none":
        return centred
    std = rewards.std(dim=1, keepdim=True, unbiased=False) if scale == "group" else rewards.std(unbiased=False)
    return centred / (std + eps)


def row_weight(length: int, samples: int, tokens: int, how: str, max_new_tokens: int) -> float:
    """A trained row's share of the loss, by `grpo.lossAggregation`: 1/tokens of the batch
    (token), 1/(samples · its length) (sequence), or 1/(samples · maxNewTokens) (constant);
    `samples` and `tokens` count the batch's trained rows."""
    per = tokens if how == "token" else samples * (length if how == "sequence" else max_new_tokens)
    return 1.0 / max(per, 1)


def _log_softmax(
    model: torch.nn.Module,
    ids: torch.Tensor,
    attention: torch.Tensor,
    n_prompt: int,
    temperature: float,
    positions: torch.Tensor | None,
) -> torch.Tensor:
    """The log-distribution over the vocabulary at each completion position: [batch, len, vocab]."""
    out = model(input_ids=ids, attention_mask=attention, position_ids=positions)
    return torch.log_softmax(out.logits[:, n_prompt - 1 : -1].float() / temperature, dim=-1)


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
    full = _log_softmax(model, ids, attention, n_prompt, temperature, positions)
    return full.gather(-1, ids[:, n_prompt:, None]).squeeze(-1)


def token_logprobs_and_entropy(
    model: torch.nn.Module,
    ids: torch.Tensor,
    attention: torch.Tensor,
    n_prompt: int,
    temperature: float,
    positions: torch.Tensor | None,
    grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs`, and each position's entropy: with its gradient when it is in the loss."""
    full = _log_softmax(model, ids, attention, n_prompt, temperature, positions)
    logp = full.gather(-1, ids[:, n_prompt:, None]).squeeze(-1)
    with nullcontext() if grad else torch.no_grad():
        h = -(full.exp() * full).sum(-1)
    return logp, h


def behaviour_weight(
    prox: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor, obj: Objective
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w [rows, tokens] as applied, log w before truncation or masking, refused [rows]): the
    behaviour weight π_prox/μ, per token or per sequence (a geometric mean), truncated at `cap`
    (and `floor`) or masked to 0 outside them, and 0 for a refused sample: one whose reported
    log-probs are further from the trainer's, on average, than `refuse_gap` nats. No gradient."""
    n = mask.sum(1).clamp(min=1)
    delta = (prox - behaviour) * mask
    refused = delta.abs().sum(1) / n > obj.refuse_gap
    log_w = delta if obj.correction_level == "token" else (delta.sum(1) / n)[:, None].expand_as(delta)
    hi, lo = math.log(obj.cap), math.log(obj.floor) if obj.floor > 0 else -math.inf
    if obj.correction == "off":
        w = torch.ones_like(log_w)
    elif obj.correction == "truncate":
        w = log_w.clamp(min=lo, max=hi).exp()
    else:
        w = torch.where((log_w >= lo) & (log_w <= hi), log_w.clamp(max=hi).exp(), 0.0)
    w = torch.where(refused[:, None], 0.0, w)
    return w, log_w, refused


def kl(logp: torch.Tensor, logp_ref: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per token, KL(π_θ ‖ π_ref) estimated from π_θ's samples (verl's names: k1 "kl", k2 "mse",
    k3, and k3 with its log-ratio and value clamped, "low_var_kl")."""
    d = logp_ref - logp
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.exp(d) - d - 1
    d = d.clamp(-20, 20)
    return (torch.exp(d) - d - 1).clamp(-10, 10)


def loss(
    logp: torch.Tensor,
    prox: torch.Tensor,
    behaviour: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    scale: torch.Tensor,
    obj: Objective,
    logp_ref: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Stats]:
    """Σ over rows i and their tokens t of scale_i · L_it, with

        L_it = −w_it · clip(r_it, A_i) + klCoef · KL_it − entropyCoef · H_it,

    where clip(r, A) is PPO's min(r·A, clamp(r, 1 − clip, 1 + clipHigh)·A), bounded below by
    dualClip·A when A < 0. `scale` [rows] carries the loss aggregation (1/tokens of the batch,
    1/(samples·len_i) or 1/(samples·maxNewTokens)) and 0 for a row not trained. `logp` [rows,
    tokens]: π_θ's, with gradient; `prox`: π_prox's, without; `behaviour`: what the worker
    reported (μ)."""
    w, log_w, refused = behaviour_weight(prox, behaviour, mask, obj)
    n = mask.sum(1).clamp(min=1)
    log_r = logp - prox
    if obj.ratio_level == "sequence":
        log_r = ((log_r * mask).sum(1) / n)[:, None].expand_as(log_r)
    r = torch.exp(log_r)
    a = adv[:, None]
    unclipped = -a * r
    pg = torch.maximum(unclipped, -a * r.clamp(1 - obj.clip_low, 1 + obj.clip_high))
    if obj.dual_clip is not None:
        pg = torch.where(a < 0, torch.minimum(pg, -a * obj.dual_clip), pg)
    per_token = w * pg
    stats = Stats()
    s = stats.sums
    if logp_ref is not None and obj.kl_coef > 0:
        # off the mask (padding, an environment's tokens) the estimate is 0: no overflow there to turn into NaN
        k = kl(logp, torch.where(mask > 0, logp_ref, logp.detach()), obj.kl_estimator)
        per_token = per_token + obj.kl_coef * k
        s["kl"] = float((k.detach() * mask).sum())
    if entropy is not None:
        if obj.entropy_coef > 0:
            per_token = per_token - obj.entropy_coef * entropy
        s["entropy"] = float((entropy.detach() * mask).sum())
    value = (per_token * mask * scale[:, None]).sum()

    with torch.no_grad():
        r, on = r.detach(), mask > 0
        delta = ((prox - behaviour) * mask).clamp(-LOG_W_SHOWN, LOG_W_SHOWN)
        shown = log_w.clamp(-LOG_W_SHOWN, LOG_W_SHOWN)
        s["tokens"] = float(mask.sum())
        s["clip_low"] = float(((a < 0) & (r < 1 - obj.clip_low) & on).sum())
        s["clip_high"] = float(((a > 0) & (r > 1 + obj.clip_high) & on).sum())
        if obj.dual_clip is not None:
            s["clip_dual"] = float(((a < 0) & (r > obj.dual_clip) & on).sum())
        s["weight"] = float((shown.exp() * mask).sum())
        s["weight_applied"] = float((w * mask).sum())
        s["weight_applied_sq"] = float((w * w * mask).sum())
        s["masked"] = float(((w == 0) & on).sum())
        if obj.correction == "truncate":
            out = shown > math.log(obj.cap)
            if obj.floor > 0:
                out |= shown < math.log(obj.floor)
            s["truncated"] = float((out & on).sum())
        s["gap"] = float((delta.abs() * mask).sum())
        s["mismatch_kl"] = float(((delta.exp() - delta - 1) * mask).sum())  # k3 of KL(μ ‖ π_prox), μ's samples
        if on.any():
            stats.highs["weight"] = float(shown[on].exp().max())
            stats.highs["weight_neg"] = float(-shown[on].exp().min())
            stats.highs["gap"] = float(delta.abs()[on].max())
        gap = delta.abs() * mask
        stats.rows = [
            (int(t), float(g), float(m), bool(x))
            for t, g, m, x in zip(
                mask.sum(1).tolist(), gap.sum(1).tolist(), gap.max(1).values.tolist(), refused.tolist()
            )
        ]
    return value, stats


def pad(rows: list[Row], pad_id: int):
    """Left-pad prompts, right-pad completions: prompts end at one column, so completion token j
    sits at the same position in every row. The mask is 1 on the tokens sampled."""
    n_prompt = max(len(p) for p, *_ in rows)
    n_comp = max(len(c) for _, c, *_ in rows)
    ids = torch.full((len(rows), n_prompt + n_comp), pad_id, dtype=torch.long)
    attention = torch.zeros_like(ids)
    mask = torch.zeros(len(rows), n_comp)
    behaviour = torch.zeros(len(rows), n_comp)
    for i, (p, c, lp, sampled) in enumerate(rows):
        ids[i, n_prompt - len(p) : n_prompt] = torch.tensor(p)
        ids[i, n_prompt : n_prompt + len(c)] = torch.tensor(c, dtype=torch.long)
        attention[i, n_prompt - len(p) : n_prompt + len(c)] = 1
        mask[i, : len(c)] = 1 if sampled is None else torch.tensor(sampled, dtype=torch.float32)
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


def _compute(device: torch.device, bf16: bool):
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()


def proximal(
    model: torch.nn.Module,
    rows: list[Row],
    batches: list[list[int]],
    *,
    pad_id: int,
    temperature: float,
    device: torch.device,
    bf16: bool = False,
) -> list[torch.Tensor]:
    """π_prox's log-probs of each row's completion, without gradient: the policy before a step's
    first update, which its later updates (`grpo.updatesPerBatch`) are clipped against. The same
    passes as `accumulate` makes (a sharded trainer's ranks keep step)."""
    out: list[torch.Tensor | None] = [None] * len(rows)
    with torch.no_grad():
        for idx in batches:
            part = [rows[i] for i in idx or [0]]
            ids, attention, positions, mask, _ = (t.to(device) for t in pad(part, pad_id))
            with _compute(device, bf16):
                logp = token_logprobs(model, ids, attention, max(len(p) for p, *_ in part), temperature, positions)
            for j, i in enumerate(idx):
                out[i] = logp[j, : len(rows[i][1])].float()
    return cast(list[torch.Tensor], out)  # batches hold every row


def accumulate(
    model: torch.nn.Module,
    ref: torch.nn.Module | None,
    rows: list[Row],
    adv: torch.Tensor,
    scale: torch.Tensor,
    batches: list[list[int]],
    *,
    pad_id: int,
    objective: Objective,
    device: torch.device,
    bf16: bool = False,
    prox: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, Stats]:
    """Forward and backward of `rows` (advantages `adv` and loss weights `scale`, one per row, on
    `device`), one micro-batch of `batches` at a time, gradients accumulating in the parameters:
    they add up to the one-pass gradient, since each row's weight is the whole batch's. An empty
    micro-batch is a pass that adds nothing (it takes a row and weighs it 0). `bf16`: compute in
    bfloat16 under autocast (master weights stay as they are). `prox`: π_prox's log-probs per row
    (`proximal`); None: this pass's own, detached. Returns the summed loss (detached) and the
    stats of every row, in the order of `rows`."""
    losses, stats = [], Stats()
    per_row: list[tuple[int, float, float, bool] | None] = [None] * len(rows)
    obj = objective
    for idx in batches:
        part = [rows[i] for i in idx or [0]]
        ids, attention, positions, mask, behaviour = (t.to(device) for t in pad(part, pad_id))
        n_prompt = max(len(p) for p, *_ in part)
        with _compute(device, bf16):
            logp, h = token_logprobs_and_entropy(
                model, ids, attention, n_prompt, obj.temperature, positions, grad=obj.entropy_coef > 0
            )
            logp_ref = None
            if ref is not None:
                with torch.no_grad():
                    logp_ref = token_logprobs(ref, ids, attention, n_prompt, obj.temperature, positions)
        if prox is None:
            p = logp.detach()
        else:
            p = torch.zeros_like(mask)
            for j, i in enumerate(idx or [0]):
                p[j, : len(rows[i][1])] = prox[i]
        weights = scale[idx or [0]] * (1.0 if idx else 0.0)
        value, st = loss(logp, p, behaviour, adv[idx or [0]], mask, weights, obj, logp_ref, h)
        value.backward()
        losses.append(value.detach())
        if idx:
            rows_st, st.rows = st.rows, []
            stats.add(st)
            for j, i in enumerate(idx):
                per_row[i] = rows_st[j]
    stats.rows = cast(list[tuple[int, float, float, bool]], per_row)  # batches hold every row
    return cast(torch.Tensor, sum(losses)), stats  # a micro-batch at least (an empty one is a pass)
