"""The learner's step: micro-batches of a token budget add up to the one-pass gradient and
metrics, the learning-rate schedule is a function of the step that the optimizer follows across
a restart, and the device a job asks for."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from support.jobs import job, tiny

from sparrowrl.rollout.coordinator import REFILL, Batch
from sparrowrl.spec.grpo import GrpoSpec
from sparrowrl.spec.job import JobError, parse
from sparrowrl.trainer import grpo, lr, models
from sparrowrl.trainer.device import device
from sparrowrl.trainer.learner import Learner

pytestmark = pytest.mark.timeout(300)


def _rows(tok, model) -> list[grpo.Row]:
    """Prompts and completions of different lengths; behaviour log-probs near the model's, so
    that some tokens' ratios clip and others do not."""
    g = torch.Generator().manual_seed(1)
    out = []
    for prompt, n in [("1+2=", 3), ("11+12=", 2), ("3=", 5), ("45+6=", 1), ("7+8=", 3), ("99+99=", 4)]:
        p, c = models.prompt_ids(tok, prompt), torch.randint(3, len(tok), (n,), generator=g).tolist()
        with torch.no_grad():
            logp = grpo.token_logprobs(model, torch.tensor([p + c]), torch.ones(1, len(p) + n), len(p), 0.7)[0]
        out.append((p, c, (logp + 0.6 * torch.rand(n, generator=g) - 0.3).tolist(), None))
    return out


OBJ = grpo.Objective(temperature=0.7, kl_coef=0.1, cap=1.1)  # a low cap: some tokens' weights are truncated


def _grads(model, ref, rows, adv, batches, tokens):
    model.zero_grad(set_to_none=True)
    scale = torch.full((len(rows),), 1.0 / tokens)
    loss, stats = grpo.accumulate(
        model, ref, rows, adv, scale, batches, pad_id=0, objective=OBJ, device=torch.device("cpu")
    )
    return (
        float(loss),
        {k: s / tokens for k, s in stats.sums.items()},
        {n: p.grad.clone() for n, p in model.named_parameters()},
    )


@pytest.mark.parametrize("episodes", [False, True], ids=["completions", "episodes"])
def test_micro_batches_add_up_to_the_one_pass_gradient_and_metrics(episodes):
    """And so an episode (its environment's tokens masked out) fits the trainer's memory by
    grpo.microBatchTokens as a long completion does."""
    tok = models.char_tokenizer()
    model = models.tiny_qwen3(len(tok), 32, 2, 2, seed=0)
    ref = models.tiny_qwen3(len(tok), 32, 2, 2, seed=1).requires_grad_(False)  # another policy: the KL is not 0
    rows = _rows(tok, model)
    if episodes:  # every other row an episode: its middle tokens an environment's turn
        rows = [(p, c, lp, [k in (0, len(c) - 1) for k in range(len(c))] if i % 2 else None)
                for i, (p, c, lp, _) in enumerate(rows)]  # fmt: skip
    adv = torch.tensor([1.0, -0.5, 0.7, -1.2, 0.3, 2.0])
    tokens = float(sum(len(c) if m is None else sum(m) for _, c, _, m in rows))
    loss, stats, want = _grads(model, ref, rows, adv, grpo.micro_batches(rows, None), tokens)
    assert stats["kl"] > 0 and stats["gap"] > 0 and 0 < stats["truncated"] < 1
    for budget in (1, 16, 25, 40, 10_000):
        batches = grpo.micro_batches(rows, budget)
        got_loss, got_stats, got = _grads(model, ref, rows, adv, batches, tokens)
        assert got_loss == pytest.approx(loss, rel=1e-5)
        assert got_stats.keys() == stats.keys()
        assert all(got_stats[k] == pytest.approx(stats[k], rel=1e-5, abs=1e-7) for k in stats)
        for n, g in want.items():
            assert torch.allclose(got[n], g, rtol=1e-4, atol=1e-7), (budget, n, (got[n] - g).abs().max())
    # passes a sharded trainer's rank adds to keep step with the others change nothing
    batches = grpo.spread(grpo.micro_batches(rows, 25), len(rows) + 2)
    assert batches[-2:] == [[], []]
    got_loss, got_stats, got = _grads(model, ref, rows, adv, batches, tokens)
    assert got_loss == pytest.approx(loss, rel=1e-5)
    assert all(torch.allclose(got[n], g, rtol=1e-4, atol=1e-7) for n, g in want.items())


def test_the_number_of_micro_batches_follows_the_budget():
    rows = [([1] * p, [3] * c, [0.0] * c, None) for p, c in [(4, 3), (6, 2), (3, 5), (5, 1), (4, 3)]]
    # longest first: rows 1, 2 (8 tokens each), 0, 4 (7), 3 (6)
    assert grpo.micro_batches(rows, None) == [[0, 1, 2, 3, 4]]
    assert grpo.micro_batches(rows, 1) == [[1], [2], [0], [4], [3]]  # every row over the budget goes alone
    assert grpo.micro_batches(rows, 20) == [[1], [2, 0], [4, 3]]  # [1, 2] would pad to 2 x (6 + 5) = 22
    assert grpo.micro_batches(rows, 55) == [[1, 2, 0, 4, 3]]  # 5 x (6 + 5)
    assert len(grpo.micro_batches(rows, 54)) == 2
    for budget in range(1, 60):
        batches = grpo.micro_batches(rows, budget)
        assert sorted(i for b in batches for i in b) == list(range(5))
        for b in batches:
            size = len(b) * (max(len(rows[i][0]) for i in b) + max(len(rows[i][1]) for i in b))
            assert size <= budget or len(b) == 1
    assert grpo.spread([[0, 1, 2], [3]], 4) == [[0], [1], [2], [3]]
    assert grpo.spread([[0], [1]], 4) == [[0], [1], [], []]


def test_the_schedule_is_a_function_of_the_step():
    base = 1e-4
    const = GrpoSpec(learning_rate=base)
    assert [lr.rate(s, const, 10) for s in range(10)] == [base] * 10  # unchanged: every step at learningRate
    warm = GrpoSpec(learning_rate=base, warmup_steps=4)
    assert [lr.rate(s, warm, 10) for s in range(6)] == pytest.approx(
        [base / 4, base / 2, 3 * base / 4, base, base, base]
    )
    cos = GrpoSpec(learning_rate=base, lr_schedule="cosine", warmup_steps=2, min_lr_ratio=0.1)
    assert lr.rate(1, cos, 12) == pytest.approx(base)  # the warm-up's top
    assert lr.rate(2, cos, 12) == pytest.approx(base)  # the decay starts there
    assert lr.rate(2 + 9 / 2, cos, 12) == pytest.approx(base * (0.1 + 0.9 * 0.5))  # halfway
    assert lr.rate(11, cos, 12) == pytest.approx(base * 0.1)  # the floor at the last step
    assert all(lr.rate(s, cos, 12) > lr.rate(s + 1, cos, 12) for s in range(2, 11))
    lin = GrpoSpec(learning_rate=base, lr_schedule="linear")
    assert [lr.rate(s, lin, 5) for s in range(5)] == pytest.approx([base, 0.75 * base, 0.5 * base, 0.25 * base, 0.0])
    assert lr.rate(0, lin, 1) == 0.0 and lr.rate(0, GrpoSpec(lr_schedule="cosine", warmup_steps=1), 1) == 1e-5
    assert math.isclose(lr.rate(7, GrpoSpec(learning_rate=base, lr_schedule="cosine"), 8), 0.0, abs_tol=1e-20)


def _job(**grpo_fields) -> dict:
    return job(
        "learner",
        steps=4,
        model=tiny(layers=2),
        grpo={"groupSize": 3, "promptsPerStep": 2, "maxNewTokens": 4, "klCoef": 0.05, **grpo_fields},
        topology={"regions": [{"name": "a", "workers": 1}]},
    )


def _near(learner: Learner, group: int, ids: list[int], g: torch.Generator) -> list[float]:
    """Behaviour log-probs as a worker's engine reports them: the policy's, a little apart."""
    p = learner.prompt_ids(group)
    with torch.no_grad():
        lp = grpo.token_logprobs(learner.model, torch.tensor([p + ids]), torch.ones(1, len(p) + len(ids)), len(p), 1.0)
    return (lp[0] + 0.4 * torch.rand(len(ids), generator=g) - 0.2).clamp(max=0).tolist()


def _batch(learner: Learner, index: int) -> Batch:
    """Batch `index`: completions of 1 to 4 tokens, some right."""
    tok, g = learner.tok, torch.Generator().manual_seed(index)
    results = {}
    for group in range(2 * index, 2 * index + 2):
        answer = learner.prompt(group).answer
        samples = []
        for j in range(3):
            text = answer if j == 0 else answer[: 1 + j % len(answer)] + "1" * j
            ids = tok(text[:3], add_special_tokens=False).input_ids + [tok.eos_token_id]
            samples.append({"tokens": ids, "logprobs": _near(learner, group, ids, g)})
        results[group] = {"version": index, "samples": samples}
    groups = sorted(results)
    return Batch(index=index, groups=groups, pending=[], results=results)


def _weights(learner: Learner) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in learner.model.named_parameters()}


def test_the_learner_micro_batches_as_one_pass_and_follows_the_schedule_across_a_restart(tmp_path):
    """Two learners from the same weights, one pass and micro-batches of single rows: the same
    step and metrics. The learning rate of each step is the schedule's, also in a learner
    started again on the state dir, and AdamW steps by it."""
    whole = Learner(parse(_job(learningRate=1e-3, lrSchedule="cosine", warmupSteps=2)).spec, tmp_path / "one")
    parts = Learner(
        parse(_job(learningRate=1e-3, lrSchedule="cosine", warmupSteps=2, microBatchTokens=1)).spec, tmp_path / "mb"
    )
    before = _weights(whole)
    assert all(torch.equal(before[n], w) for n, w in _weights(parts).items())
    a, b = whole.train(_batch(whole, 0)), parts.train(_batch(parts, 0))
    for k in ("loss", "kl", "entropy", "mismatch_mean", "is_weight_mean", "grad_norm", "reward_mean", "tokens"):
        assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-7), k
    assert a["lr"] == b["lr"] == lr.rate(0, whole.spec.grpo, 4) == 5e-4  # half of the warm-up's 2 steps
    after = _weights(whole)
    # within 1% of the learning rate: AdamW's step lr·g/(|g| + 1e-8) tells apart the last bits of a
    # gradient near its eps, which the order of the micro-batches' sums moves
    assert all(torch.allclose(w, after[n], rtol=0, atol=0.01 * a["lr"]) for n, w in _weights(parts).items())
    # AdamW's first step moves each weight by about lr (m / sqrt(v) is the gradient's sign)
    moved = max(float((after[n] - before[n]).abs().max()) for n in before)
    assert moved == pytest.approx(a["lr"], rel=1e-3)
    whole.publish()
    whole.checkpoint()()
    whole.held.close()  # as the process's death would
    again = Learner(whole.spec, tmp_path / "one")
    assert again.version == 1
    row = again.train(_batch(again, 1))
    assert row["lr"] == again.opt.param_groups[0]["lr"] == lr.rate(1, again.spec.grpo, 4) == 1e-3
    assert lr.rate(3, again.spec.grpo, 4) == 0.0  # the cosine's floor (minLrRatio 0) at the last step


def test_the_device_a_job_asks_for():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: tests/test_trainer_gpu.py checks the GPU route")
    assert device("auto") == device("cpu") == device("auto", 2) == torch.device("cpu")
    with pytest.raises(ValueError, match=r"^trainer.device: cuda, but torch .* sees no CUDA device$"):
        device("cuda")
    with pytest.raises(JobError, match=r"spec.trainer.device: Input should be 'auto', 'cpu' or 'cuda'"):
        parse({**_job(), "spec": {**_job()["spec"], "trainer": {"device": "gpu"}}})
    for field, value in [("microBatchTokens", 0), ("lrSchedule", "step"), ("minLrRatio", 1.5), ("warmupSteps", -1)]:
        with pytest.raises(JobError, match=rf"spec.grpo.{field}: "):
            parse(_job(**{field: value}))


def test_a_warm_up_of_no_steps_leaves_the_model_as_made_and_one_of_two_moves_it():
    """warmupSteps may be 0 (a job that wants the model as made); the decaying rate must not
    divide by it."""
    from sparrowrl.trainer import tasks

    tok = models.char_tokenizer()
    prompts = models.Prompts(tok)
    model = models.tiny_qwen3(len(tok), 16, 1, 2, 0)
    made = {n: p.detach().clone() for n, p in model.named_parameters()}
    models.warm_up(model, prompts, tasks.Add(0, prompts), 0)
    assert all(torch.equal(p, made[n]) for n, p in model.named_parameters())
    models.warm_up(model, prompts, tasks.Add(0, prompts), 2, batch=4)
    assert not all(torch.equal(p, made[n]) for n, p in model.named_parameters())


def _worker(batch: Batch, name: str, groups=None) -> Batch:
    """`batch` with its groups (or `groups` of them) admitted from worker `name`, as the coordinator keeps them."""
    for g in groups or batch.groups:
        batch.results[g] = {**batch.results[g], "worker": name, "lease": 7}
    return batch


def test_a_workers_false_log_probs_are_refused_and_counted_under_its_name(tmp_path):
    """One group from worker "liar", whose log-probs are −1e4 (within what the door takes): its
    samples are not trained and counted under its name; the honest worker's are trained, the
    weights stay finite, and the gap shows by worker and by the age of the sampling version."""
    learner = Learner(parse(_job(learningRate=1e-3)).spec, tmp_path / "s")
    batch = _worker(_batch(learner, 0), "honest")
    liar = batch.groups[1]
    batch = _worker(batch, "liar", [liar])
    batch.results[liar]["samples"] = [
        {**s, "logprobs": [-1e4] * len(s["tokens"])} for s in batch.results[liar]["samples"]
    ]
    batch.results[liar]["version"] = -1  # one version older: age 1
    before = _weights(learner)
    m = learner.train(batch)
    assert m["skipped"] is None and m["refused_samples"] == {"liar": {"logprob_gap": 3}}
    assert m["by_worker"]["liar"]["refused"] == 3 and m["by_worker"]["honest"]["refused"] == 0
    assert m["by_worker"]["liar"]["mismatch_mean"] == pytest.approx(20.0)  # clamped at ±20 nats
    assert m["by_worker"]["honest"]["mismatch_mean"] < 0.2 and m["by_age"].keys() == {"0", "1"}
    assert m["by_age"]["1"]["samples"] == 3 and m["is_masked"] > 0.3
    after = _weights(learner)
    assert all(torch.isfinite(w).all() for w in after.values())
    assert any(not torch.equal(before[n], w) for n, w in after.items())  # the honest group trained
    assert all(math.isfinite(v) for k, v in m.items() if isinstance(v, float))


def test_a_step_with_nothing_to_train_or_not_finite_changes_no_weight(tmp_path):
    learner = Learner(parse(_job(learningRate=1e-3)).spec, tmp_path / "s")
    opt = learner.opt.state_dict()
    before = _weights(learner)
    # every group's samples scored alike: nothing to learn, and AdamW's step is not taken
    batch = _batch(learner, 0)
    for g in batch.groups:
        batch.results[g]["samples"] = [batch.results[g]["samples"][1]] * 3
    m = learner.train(batch)
    assert m["skipped"] == "nothing_to_train" and m["zero_variance_groups"] == 1.0 and learner.version == 1
    assert all(torch.equal(before[n], w) for n, w in _weights(learner).items())
    # a weight that is not finite makes the loss NaN: skipped, nothing else moves, AdamW's state as it was
    with torch.no_grad():
        learner.model.model.norm.weight[0] = float("nan")
    m = learner.train(_batch(learner, 1))
    assert m["skipped"] == "nonfinite" and m["loss"] is None and learner.version == 2
    assert all(torch.equal(before[n], w) for n, w in _weights(learner).items() if n != "model.norm.weight")
    assert learner.opt.state_dict()["state"] == opt["state"] == {}


def test_updates_per_batch_clip_against_the_policy_before_the_first(tmp_path):
    """Two updates on one batch: the second's ratio is against π_prox, the policy before the
    first, so it can clip; one update of the same batch is the first of the two."""
    one = Learner(parse(_job(learningRate=1e-2)).spec, tmp_path / "one")
    two = Learner(parse(_job(learningRate=1e-2, updatesPerBatch=2, clip=0.01)).spec, tmp_path / "two")
    a, b = one.train(_batch(one, 0)), two.train(_batch(two, 0))
    assert a["clip_low"] == a["clip_high"] == 0.0  # one update: r = 1
    assert b["clip_low"] + b["clip_high"] > 0  # the second update's r moved past 1 ± 0.01
    assert b["mismatch_mean"] == pytest.approx(a["mismatch_mean"], rel=1e-6)  # π_prox: the same policy
    assert any(not torch.equal(w, _weights(one)[n]) for n, w in _weights(two).items())


def test_accumulate_with_the_proximal_policy_given_is_the_one_pass_step():
    tok = models.char_tokenizer()
    model = models.tiny_qwen3(len(tok), 32, 2, 2, seed=0)
    rows = _rows(tok, model)
    adv = torch.tensor([1.0, -0.5, 0.7, -1.2, 0.3, 2.0])
    tokens = float(sum(len(c) for _, c, *_ in rows))
    _, _, want = _grads(model, None, rows, adv, grpo.micro_batches(rows, None), tokens)
    prox = grpo.proximal(
        model, rows, grpo.micro_batches(rows, 16), pad_id=0, temperature=0.7, device=torch.device("cpu")
    )
    model.zero_grad(set_to_none=True)
    scale = torch.full((len(rows),), 1.0 / tokens)
    grpo.accumulate(
        model,
        None,
        rows,
        adv,
        scale,
        [list(range(len(rows)))],
        pad_id=0,
        objective=OBJ,
        device=torch.device("cpu"),
        prox=prox,
    )
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, want[n], rtol=1e-4, atol=1e-7), n


def test_truncated_samples_are_read_from_their_tokens_masked_and_shaped(tmp_path):
    """The trainer reads why a completion ended from its tokens, not from the worker's word: a
    sample without EOS at maxNewTokens is truncated (masked with maskTruncated), and a worker
    that says otherwise has that sample refused; overlong shaping takes reward by length."""
    spec = parse(_job(learningRate=1e-3, maskTruncated=True, overlongBuffer=2, overlongPenalty=0.5)).spec
    learner, twin = Learner(spec, tmp_path / "s"), Learner(spec, tmp_path / "twin")
    assert [learner._overlong(k) for k in (1, 2, 3, 4)] == [0.0, 0.0, -0.25, -0.5]  # maxNewTokens 4
    batch = _worker(_batch(learner, 0), "w")
    eos = learner.tok.eos_token_id
    for g in batch.groups:
        for s in batch.results[g]["samples"]:
            s["finish"] = "eos"
    cut = batch.results[batch.groups[0]]["samples"][0]
    cut["tokens"], cut["logprobs"], cut["finish"] = cut["tokens"][:3] + [7], cut["logprobs"][:3] + [-1.0], "length"
    liar = batch.results[batch.groups[1]]["samples"][2]
    assert liar["tokens"][-1] == eos
    liar["finish"] = "length"  # its tokens end with EOS
    assert [learner._finish(s["tokens"]) for s in (cut, liar)] == ["length", "eos"]
    other = copy.deepcopy(batch)  # the same, but for the behaviour log-probs of those two samples
    for g, j in ((0, 0), (1, 2)):
        s = other.results[other.groups[g]]["samples"][j]
        s["logprobs"] = [x - 0.3 for x in s["logprobs"]]
    m = learner.train(batch)
    assert m["truncated"] == pytest.approx(1 / 6)
    assert m["refused_samples"] == {"w": {"finish_claim": 1}} and m["by_worker"]["w"]["refused"] == 1
    assert m["skipped"] is None
    # the truncated sample and the liar's weigh nothing: what their log-probs say changes no weight
    m2 = twin.train(other)
    assert m2["loss"] == m["loss"]
    assert all(torch.equal(w, _weights(learner)[n]) for n, w in _weights(twin).items())


def test_stop_strings_are_read_from_the_text(tmp_path):
    learner = Learner(parse(_job(stop=["9"])).spec, tmp_path / "s")
    tok = learner.tok
    assert learner._finish(tok("12", add_special_tokens=False).input_ids) == "length"
    assert learner._finish(tok("19", add_special_tokens=False).input_ids) == "stop"
    assert learner._finish(tok("1", add_special_tokens=False).input_ids + [tok.eos_token_id]) == "eos"


def test_groups_scored_as_admitted_keep_those_rewards_and_refills_train_in_their_place(tmp_path):
    """With refills on the trainer scores each group as it is admitted: a group whose samples
    all scored alike is said not to vary, and the step takes the rewards scored then (a reward
    need not give the same twice) and trains the groups that vary, the refill among them."""
    spec = parse(_job(learningRate=1e-3, zeroVarianceGroups="refill", maxGenBatches=2)).spec
    assert spec.grpo.refill_groups == 2
    learner = Learner(spec, tmp_path / "s")
    batch = _batch(learner, 0)
    flat = batch.groups[0]
    batch.results[flat]["samples"] = [batch.results[flat]["samples"][1]] * 3  # all alike
    refill = REFILL  # batch 0's first refill group: its prompt is a new one
    assert learner.prompt(refill).prompt not in {learner.prompt(g).prompt for g in batch.groups}
    answer = learner.prompt(refill).answer
    tok = learner.tok
    ids = [tok(t, add_special_tokens=False).input_ids + [tok.eos_token_id] for t in (answer, "x", answer)]
    gen = torch.Generator().manual_seed(3)
    batch.results[refill] = {
        "version": 0,
        "samples": [{"tokens": x, "logprobs": _near(learner, refill, x, gen)} for x in ids],
    }
    batch.groups.append(refill)
    scored = learner.score(batch.results)
    assert [scored[g][2] for g in batch.groups] == [False, True, True]
    assert scored[refill][0] == [1.0, 0.0, 1.0] and scored[refill][1] == dict.fromkeys(scored[refill][1], 0)
    batch.scores = {**scored, batch.groups[1]: ([1.0, 0.0, 0.0], {"raised": 1}, True)}  # as scored at admission
    m = learner.train(batch)
    assert (m["groups_varied"], m["refill_groups"], m["zero_variance_groups"]) == (2, 1, pytest.approx(1 / 3))
    assert m["reward_mean"] == pytest.approx(sum(sum(s[0]) for s in batch.scores.values()) / 9)
    assert m["reward_failed"]["raised"] == 1 and m["skipped"] is None
