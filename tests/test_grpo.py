"""GRPO's pieces, and the built-in tasks and rewards."""

import math

import pytest
import torch

from sparrowrl.trainer import grpo, models, tasks


def test_advantages_are_normalized_per_group():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
    a = grpo.advantages(r)
    assert torch.allclose(a[0], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-3)
    assert torch.equal(a[1], torch.zeros(4))  # all alike: nothing to learn from this group


def test_loss_clips_the_ratio_and_averages_over_tokens():
    behaviour = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # the third token is padding
    adv = torch.tensor([2.0])
    for scale, want in [(1.0, -2.0), (1.1, -2.2), (2.0, -2.4)]:  # ratio 2 is clipped to 1.2
        logp = behaviour + math.log(scale)
        loss, stats = grpo.loss(logp, behaviour, adv, mask, clip=0.2)
        assert loss.item() == pytest.approx(want, rel=1e-5)
    assert stats["clipped"] == 1.0
    # negative advantage: a ratio below 1 - clip stops pulling
    loss, _ = grpo.loss(behaviour + math.log(0.5), behaviour, torch.tensor([-1.0]), mask, clip=0.2)
    assert loss.item() == pytest.approx(0.8, rel=1e-5)


def test_k3_kl_is_zero_at_the_reference_and_positive_elsewhere():
    logp = torch.log(torch.tensor([[0.3, 0.6]]))
    mask = torch.ones(1, 2)
    zero = torch.zeros(1)
    _, same = grpo.loss(logp, logp, zero, mask, 0.2, logp_ref=logp, kl_coef=0.1)
    _, other = grpo.loss(logp, logp, zero, mask, 0.2, logp_ref=logp - 0.5, kl_coef=0.1)
    assert same["kl"] == 0.0 and other["kl"] > 0


def test_the_trainers_batch_scores_each_row_as_a_forward_of_that_row_alone():
    """Prompts of different lengths are left-padded and completions right-padded into one batch;
    each row's completion log-probs must be those of the row on its own (2 layers, so padding
    leaking into later layers would show)."""

    tok = models.char_tokenizer()
    m = models.tiny_qwen3(len(tok), 32, 2, 2, 0).eval()
    rows = [
        (models.prompt_ids(tok, "1+2="), [5, 6, 2], [0.0] * 3),
        (models.prompt_ids(tok, "11+12="), [7, 2], [0.0] * 2),
        (models.prompt_ids(tok, "3="), [8, 9, 10, 2], [0.0] * 4),
    ]
    ids, att, pos, mask, _ = grpo.pad(rows, tok.pad_token_id)
    n = max(len(p) for p, _, _ in rows)
    both = grpo.token_logprobs(m, ids, att, n, 0.7, pos)
    for i, (p, c, _) in enumerate(rows):
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
