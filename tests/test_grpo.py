"""GRPO's pieces, and the built-in tasks and rewards."""

import math

import pytest
import torch

from sparrowrl.trainer import grpo, models, tasks


def test_advantages_are_centred_per_group_and_scaled_as_asked():
    r = torch.tensor([[1.0, 0.0], [3.0, 3.0], [0.0, 2.0]])
    group = grpo.advantages(r)
    assert torch.allclose(group, torch.tensor([[1.0, -1.0], [0.0, 0.0], [-1.0, 1.0]]), atol=1e-3)
    assert torch.equal(group[1], torch.zeros(2))  # all alike: nothing to learn from this group
    # batch: the whole batch's std, sqrt(9.5 / 6) (mean 1.5)
    want = torch.tensor([[0.5, -0.5], [0.0, 0.0], [-1.0, 1.0]])
    assert torch.allclose(grpo.advantages(r, "batch"), want / (math.sqrt(9.5 / 6) + 1e-4))
    assert torch.equal(grpo.advantages(r, "none"), want)


def _weight(prox, mu, obj, mask=None):
    prox, mu = torch.log(torch.tensor([prox])), torch.log(torch.tensor([mu]))
    return grpo.behaviour_weight(prox, mu, torch.ones_like(prox) if mask is None else mask, obj)


def test_the_behaviour_weight_is_truncated_or_masked_per_token_or_per_sequence():
    # π_prox/μ = 4 and 0.5; a mean |Δ| of 1.04 nats per token: refuseGap 2 lets it through
    on = dict(refuse_gap=2.0)
    cases = [
        (dict(correction="off"), [1.0, 1.0]),
        (dict(correction="truncate", cap=2.0), [2.0, 0.5]),
        (dict(correction="truncate", cap=2.0, floor=0.6), [2.0, 0.6]),
        (dict(correction="mask", cap=2.0), [0.0, 0.5]),
        (dict(correction="mask", cap=5.0, floor=0.6), [4.0, 0.0]),
        (dict(correction="truncate", correction_level="sequence", cap=2.0), [2**0.5, 2**0.5]),  # geometric mean
        (dict(correction="mask", correction_level="sequence", cap=1.2), [0.0, 0.0]),
        (dict(correction="mask", correction_level="sequence", cap=1.5), [2**0.5, 2**0.5]),
    ]
    for fields, want in cases:
        w, log_w, refused = _weight([0.5, 0.25], [0.125, 0.5], grpo.Objective(**fields, **on))
        assert w[0].tolist() == pytest.approx(want, rel=1e-6), fields
        assert not refused[0]
    # refused: further from the trainer's log-probs than refuseGap (1.04 > 1), whatever the correction
    for correction in ("off", "truncate", "mask"):
        w, _, refused = _weight([0.5, 0.25], [0.125, 0.5], grpo.Objective(correction=correction, refuse_gap=1.0))
        assert refused.tolist() == [True] and w.tolist() == [[0.0, 0.0]]
    # padding counts in nothing: the same sample with a padded third token
    w, _, refused = _weight([0.5, 0.25, 0.9], [0.125, 0.5, 1e-30], grpo.Objective(**on), torch.tensor([[1.0, 1, 0]]))
    assert w[0, :2].tolist() == pytest.approx([2.0, 0.5]) and not refused[0]


def _loss(logp, prox, mu, adv, obj, scale=1.0, **kw):
    t = lambda x: torch.tensor([x], dtype=torch.float32)  # noqa: E731
    logp = t(logp).requires_grad_()
    value, stats = grpo.loss(
        logp, t(prox), t(mu), torch.tensor([adv]), torch.ones(1, logp.shape[1]), torch.tensor([scale]), obj, **kw
    )
    value.backward()
    return value.item(), logp.grad[0].tolist(), stats


def test_one_update_is_the_weighted_policy_gradient():
    """π_θ = π_prox (one update per batch): r = 1, and the gradient of each token's log-prob is
    −w·A·scale."""
    lp = [math.log(0.5), math.log(0.25)]
    mu = [math.log(0.125), math.log(0.5)]  # w = 4 → 2 (cap), 0.5
    value, grad, stats = _loss(lp, lp, mu, 2.0, grpo.Objective(refuse_gap=2.0), scale=0.5)
    assert value == pytest.approx(-(2 * 2 + 0.5 * 2) * 0.5)
    assert grad == pytest.approx([-2.0, -0.5])
    s = stats.sums
    assert s["tokens"] == 2 and s["truncated"] == 1 and s["masked"] == 0
    assert s["weight"] == pytest.approx(4.5) and s["weight_applied"] == pytest.approx(2.5)
    assert s["weight_applied_sq"] == pytest.approx(4.25)
    assert s["gap"] == pytest.approx(3 * math.log(2))
    assert s["mismatch_kl"] == pytest.approx((4 - math.log(4) - 1) + (0.5 - math.log(0.5) - 1))
    assert stats.highs["weight"] == pytest.approx(4) and stats.highs["weight_neg"] == pytest.approx(-0.5)
    assert stats.rows == [(2, pytest.approx(3 * math.log(2)), pytest.approx(math.log(4)), False)]
    assert s["clip_low"] == s["clip_high"] == s["clip_dual"] == 0


def test_the_ppo_ratio_clips_low_high_and_dual():
    off = dict(correction="off")
    lp = math.log(0.5)
    for ratio, adv, obj, want, clipped in [
        (1.5, 1.0, grpo.Objective(**off), -1.2, "clip_high"),  # clip at 1 + 0.2
        (1.5, 1.0, grpo.Objective(clip_high=0.28, **off), -1.28, "clip_high"),  # clip-higher
        (1.1, 1.0, grpo.Objective(**off), -1.1, None),
        (0.5, -1.0, grpo.Objective(**off), 0.8, "clip_low"),  # below 1 − clip stops pulling
        (5.0, -1.0, grpo.Objective(**off), 3.0, "clip_dual"),  # the dual clip bounds a negative advantage's
        (5.0, -1.0, grpo.Objective(dual_clip=None, **off), 5.0, None),
        (5.0, 1.0, grpo.Objective(**off), -1.2, "clip_high"),  # the dual clip is for negative advantages only
    ]:
        value, grad, stats = _loss([lp + math.log(ratio)], [lp], [lp], adv, obj)
        assert value == pytest.approx(want, rel=1e-5), (ratio, adv, obj)
        for k in ("clip_low", "clip_high", "clip_dual"):
            assert stats.sums.get(k, 0.0) == (k == clipped), (ratio, adv, k)
        # a clipped token has no gradient; an unclipped one −A·r
        assert grad == pytest.approx([0.0 if clipped else -adv * ratio], rel=1e-5)


def test_a_sequence_level_ratio_is_gspo():
    lp = [math.log(0.5), math.log(0.25)]
    obj = grpo.Objective(correction="off", ratio_level="sequence")
    # log-ratios log 2 and log 0.5: their mean is 0, so r = 1 on both tokens; each of the n
    # tokens' terms gives each token's log-prob −A·r/n, so each token's gradient is −A·r
    value, grad, _ = _loss([lp[0] + math.log(2), lp[1] + math.log(0.5)], lp, lp, 1.0, obj, scale=0.5)
    assert value == pytest.approx(-1.0) and grad == pytest.approx([-0.5, -0.5])
    value, grad, stats = _loss([x + math.log(2) for x in lp], lp, lp, 1.0, obj)  # r = 2 on both: clipped
    assert value == pytest.approx(-2.4) and grad == [0.0, 0.0] and stats.sums["clip_high"] == 2


def test_kl_estimators_and_the_entropy_bonus():
    logp, ref = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
    d = -math.log(2)
    want = {"k1": -d, "k2": d * d / 2, "k3": math.exp(d) - d - 1, "low-var-kl": math.exp(d) - d - 1}
    for est, k in want.items():
        assert grpo.kl(logp, ref, est).item() == pytest.approx(k, rel=1e-6), est
    far = torch.tensor([[-31.0]])  # log π_ref/π_θ = −31
    assert grpo.kl(torch.zeros(1, 1), far, "k3").item() == pytest.approx(30.0 + math.exp(-31), rel=1e-6)
    assert grpo.kl(torch.zeros(1, 1), far, "low-var-kl").item() == 10.0  # clamped
    lp = [math.log(0.5)]
    obj = grpo.Objective(kl_coef=0.5, kl_estimator="k1", entropy_coef=0.1)
    value, _, stats = _loss(lp, lp, lp, 0.0, obj, logp_ref=ref, entropy=torch.tensor([[1.5]]))
    assert value == pytest.approx(0.5 * -d - 0.1 * 1.5)
    assert stats.sums["kl"] == pytest.approx(-d) and stats.sums["entropy"] == 1.5


def test_a_workers_false_log_probs_cannot_make_the_loss_infinite():
    """A worker that reports −1e4 where the trainer says −1 (within the accepted bounds): the
    ratio against its numbers would be e^9999. The behaviour weight is truncated or masked, the
    sample refused, and the loss, its gradient and every metric stay finite."""
    for correction in ("off", "truncate", "mask"):
        for adv in (-1.0, 1.0):
            value, grad, stats = _loss(
                [-1.0, -2.0], [-1.0, -2.0], [-1e4, -1e4], adv, grpo.Objective(correction=correction)
            )
            assert value == 0.0 and grad == [0.0, 0.0]  # refused: weight 0
            assert stats.rows[0][3] and stats.sums["masked"] == 2
            for v in (*stats.sums.values(), *stats.highs.values()):
                assert math.isfinite(v)
    # under refuseGap's reach (one token of many) the weight is bounded by the cap
    value, grad, _ = _loss([-1.0] * 20, [-1.0] * 20, [-1.0] * 19 + [-15.0], 1.0, grpo.Objective(), scale=1.0)
    assert grad[-1] == pytest.approx(-2.0) and math.isfinite(value)


def test_each_row_weighs_by_the_loss_aggregation():
    # two trained samples of 2 and 4 tokens, maxNewTokens 8
    assert [grpo.row_weight(k, 2, 6, "token", 8) for k in (2, 4)] == [1 / 6, 1 / 6]
    assert [grpo.row_weight(k, 2, 6, "sequence", 8) for k in (2, 4)] == [1 / 4, 1 / 8]
    assert [grpo.row_weight(k, 2, 6, "constant", 8) for k in (2, 4)] == [1 / 16, 1 / 16]


def test_the_trainers_batch_scores_each_row_as_a_forward_of_that_row_alone():
    """Prompts of different lengths are left-padded and completions right-padded into one batch;
    each row's completion log-probs must be those of the row on its own (2 layers, so padding
    leaking into later layers would show)."""

    tok = models.char_tokenizer()
    m = models.tiny_qwen3(len(tok), 32, 2, 2, 0).eval()
    rows = [
        (models.prompt_ids(tok, "1+2="), [5, 6, 2], [0.0] * 3, None),
        (models.prompt_ids(tok, "11+12="), [7, 2], [0.0] * 2, None),
        (models.prompt_ids(tok, "3="), [8, 9, 10, 2], [0.0] * 4, None),
    ]
    ids, att, pos, mask, _ = grpo.pad(rows, tok.pad_token_id)
    n = max(len(p) for p, *_ in rows)
    both = grpo.token_logprobs(m, ids, att, n, 0.7, pos)
    for i, (p, c, *_) in enumerate(rows):
        alone = grpo.token_logprobs(
            m, torch.tensor([p + c]), torch.ones(1, len(p) + len(c), dtype=torch.long), len(p), 0.7
        )
        assert torch.allclose(both[i, : len(c)], alone[0], atol=1e-5)
        assert mask[i].tolist() == [1.0] * len(c) + [0.0] * (4 - len(c))


def test_rewards():
    assert tasks.char_match("", "12", "12") == 1.0
    assert tasks.char_match("", "13", "12") == 0.5
    assert tasks.char_match("", "123", "12") == pytest.approx(2 / 3)
    assert tasks.numeric("", " 3.0", "3") == 1.0 and tasks.numeric("", "x", "3") == 0.0
    assert tasks.exact("", "ab", "ab") == 1.0 and tasks.exact("", "ab", "ba") == 0.0
    with pytest.raises(ValueError, match="not one of"):
        tasks.reward_function("close_enough")
    with pytest.raises(ValueError, match="no file .*no_such_module_x.py"):
        tasks.reward_function("no_such_module_x:f")
    with pytest.raises(ValueError, match="no file .*math.py"):  # an installed module is not a reward file
        tasks.reward_function("math:isclose")


def test_tasks_are_the_same_in_every_process_and_fit_the_tokenizer():
    tok = models.char_tokenizer()
    prompts = models.Prompts(tok)
    for cls in tasks.BUILTIN.values():
        t1, t2 = cls(3, prompts), cls(3, prompts)
        exs = [t1.example(i) for i in range(50)]
        assert exs == [t2.example(i) for i in range(50)] and len(set(exs)) > 10
        for e in exs:
            assert tok.decode(tok(e.prompt + e.answer).input_ids) == e.prompt + e.answer
