"""The hf engine samples a lease as the job says: one seeded generate per group, top-k and top-p,
stop strings cut at the token that completes them, maxModelLen; its behaviour log-probs are the
full distribution's at the temperature. The vLLM engine's tests (tests/engine_vllm) check the same
rules there."""

import pytest
import torch

from sparrowrl.spec.job import JobError, parse
from sparrowrl.trainer.models import char_tokenizer, policy_state, tiny_qwen3
from sparrowrl.worker.engines import Prompt, Sampling, make_engine
from sparrowrl.worker.engines.hf import HFEngine

PROMPTS = [Prompt([1, 5, 6, 7, 8, 9], 11), Prompt([1, 20, 21, 22], 12), Prompt([1, 3, 3, 3, 40], 13)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A worker's model folder (config and tokenizer) and the policy, with large weights so that
    samples vary and greedy choices are far from ties."""
    tok = char_tokenizer()
    model = tiny_qwen3(len(tok), 64, 2, 4, seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 1.0 if "embed" in name else 0.2)
    path = tmp_path_factory.mktemp("model")
    model.config.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path), policy_state(model)


def engine(folder, **kw) -> HFEngine:
    e = make_engine("hf", folder[0], **kw)
    for n, t in e.tensors().items():
        t.copy_(folder[1][n])
    return e


def text(tokens: list[int]) -> str:
    return char_tokenizer().decode(tokens, skip_special_tokens=True)


@torch.inference_mode()
def full_logprobs(e: HFEngine, prompt: list[int], tokens: list[int], temperature: float) -> list[float]:
    logits = e.model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def test_defaults_sample_as_one_plain_seeded_generate_per_group(folder):
    """The demo's figures depend on it: the same calls, seeds and numbers as before sampling settings."""
    e = engine(folder)
    got = e.generate(PROMPTS, Sampling(n=4, max_new_tokens=10, temperature=1.5))
    for p, samples in zip(PROMPTS, got):
        ids = torch.tensor([p.ids] * 4)
        torch.manual_seed(p.seed)
        with torch.inference_mode():
            out = e.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                temperature=1.5,
                top_k=0,
                top_p=1.0,
                max_new_tokens=10,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=e.pad,
                eos_token_id=sorted(e.eos),
            )
        seq = out.sequences[:, len(p.ids) :]
        logp = torch.log_softmax(torch.stack(out.logits, 1).float() / 1.5, -1).gather(-1, seq[..., None])[..., 0]
        for s, row, lp in zip(samples, seq.tolist(), logp.tolist()):
            k = next((i + 1 for i, t in enumerate(row) if t in e.eos), len(row))
            assert (s.tokens, s.logprobs) == (row[:k], lp[:k])
            assert s.finish == ("eos" if s.tokens[-1] in e.eos else "length")


def test_each_sample_says_why_it_ended(folder):
    e = engine(folder)
    got = [x for g in e.generate(PROMPTS, Sampling(n=8, max_new_tokens=60, temperature=1.0)) for x in g]
    assert {x.finish for x in got} == {"eos", "length"}  # both kinds of end are among these
    for x in got:
        assert x.finish == ("eos" if x.tokens[-1] in e.eos else "length")
        assert x.finish == "eos" or len(x.tokens) == 60


def test_a_group_samples_alike_alone_or_in_a_lease(folder):
    e = engine(folder)
    s = Sampling(n=6, max_new_tokens=8, temperature=2.0, top_k=20, top_p=0.9)
    lease = e.generate(PROMPTS, s)
    assert [len(g) for g in lease] == [6, 6, 6]
    assert lease[1] == e.generate([PROMPTS[1]], s)[0]
    assert len({tuple(x.tokens) for x in lease[0]}) > 1  # sampled, not all alike


def test_a_tiny_top_p_samples_the_argmax_with_the_full_distributions_logprobs(folder):
    e = engine(folder)
    for s in [Sampling(n=3, max_new_tokens=8, temperature=2.0, top_p=1e-6), Sampling(3, 8, 2.0, top_k=1)]:
        (samples,) = e.generate([PROMPTS[0]], s)
        ids = torch.tensor([PROMPTS[0].ids])
        greedy = e.model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8, pad_token_id=e.pad
        )[0, len(PROMPTS[0].ids) :].tolist()
        greedy = greedy[: next((i + 1 for i, t in enumerate(greedy) if t in e.eos), len(greedy))]
        for x in samples:
            assert x.tokens == greedy
            # the truncated distribution would give each token log-prob 0
            assert x.logprobs == pytest.approx(full_logprobs(e, PROMPTS[0].ids, x.tokens, 2.0), abs=0.05)
            assert sum(x.logprobs) < -0.1


def test_a_stop_string_ends_a_completion_at_the_token_that_completes_it(folder):
    e = engine(folder)
    free = Sampling(n=8, max_new_tokens=16, temperature=1.0)
    (plain,) = e.generate([PROMPTS[0]], free)
    # a two-character string from the middle of a sample, so that it spans two tokens
    stop = next(text(x.tokens)[3:5] for x in plain if len(text(x.tokens)) >= 5)
    (cut,) = e.generate([PROMPTS[0]], Sampling(8, 16, 1.0, stop=(stop, "never")))
    stopped = 0
    for before, after in zip(plain, cut):  # the same draws up to the cut
        k = next((i for i in range(1, len(before.tokens) + 1) if stop in text(before.tokens[:i])), None)
        if k is None:
            assert after == before
        else:
            stopped += 1
            assert (after.tokens, after.logprobs) == (before.tokens[:k], before.logprobs[:k])
            assert stop in text(after.tokens) and stop not in text(after.tokens[:-1])
            assert after.finish == "stop" and before.finish != "stop"
    assert stopped


def test_a_stop_string_is_looked_for_in_the_completion_only(folder):
    e = engine(folder)
    s = Sampling(n=4, max_new_tokens=6, temperature=1.0)
    (plain,) = e.generate([PROMPTS[0]], s)
    # the prompt's last character and a completion's first: found only across the prompt's end
    texts = [text(x.tokens) for x in plain]
    stop = {text(PROMPTS[0].ids)[-1] + t[0] for t in texts if t}
    stop = tuple(x for x in stop if not any(x in t for t in texts))
    assert stop
    (got,) = e.generate([PROMPTS[0]], Sampling(4, 6, 1.0, stop=stop))
    assert got == plain


def test_max_model_len_bounds_prompt_and_completion(folder):
    e = engine(folder, max_model_len=9)
    (samples,) = e.generate([PROMPTS[0]], Sampling(n=4, max_new_tokens=8, temperature=1.0))
    assert max(len(x.tokens) for x in samples) <= 9 - len(PROMPTS[0].ids)
    assert all(x.finish == ("eos" if x.tokens[-1] in e.eos else "length") for x in samples)
    with pytest.raises(ValueError, match="maxModelLen"):
        engine(folder, max_model_len=6).generate([PROMPTS[0]], Sampling(n=2, max_new_tokens=8, temperature=1.0))


def test_tensor_parallelism_is_refused_for_hf(folder):
    with pytest.raises(ValueError, match="rollout.tensorParallelSize: 2.*hf engine runs on one device"):
        make_engine("hf", folder[0], tensor_parallel_size=2)
    job = {
        "apiVersion": "sparrowrl.dev/v1alpha1",
        "kind": "SparrowRLJob",
        "metadata": {"name": "j"},
        "spec": {"model": {"tiny": {}}, "task": {"builtin": "add"}, "rollout": {"tensorParallelSize": 2}},
    }
    with pytest.raises(JobError, match="spec.rollout: tensorParallelSize 2 needs engine: vllm"):
        parse(job)
    job["spec"]["rollout"]["engine"] = "vllm"
    assert parse(job).spec.rollout.tensor_parallel_size == 2


@pytest.mark.parametrize(
    "grpo, field",
    [
        ({"topP": 0}, "spec.grpo.topP"),
        ({"topP": 1.5}, "spec.grpo.topP"),
        ({"topK": -1}, "spec.grpo.topK"),
        ({"stop": [""]}, "spec.grpo.stop.0"),
        ({"stop": ["x" * 257]}, "spec.grpo.stop.0"),
        ({"stop": ["a"] * 17}, "spec.grpo.stop"),
    ],
)
def test_sampling_fields_are_bounded(grpo, field):
    job = {
        "apiVersion": "sparrowrl.dev/v1alpha1",
        "kind": "SparrowRLJob",
        "metadata": {"name": "j"},
        "spec": {"model": {"tiny": {}}, "task": {"builtin": "add"}, "grpo": grpo},
    }
    with pytest.raises(JobError, match=field.replace(".", r"\.") + ":"):
        parse(job)
