"""The hf engine samples a lease as the job says: the engine contract that the vLLM engine keeps
too (tests/support/engine_contract.py: seeded groups, top-k and top-p, stop strings, behaviour
log-probs of the full distribution at the temperature), and what only the hf engine does: one
plain seeded generate per group, maxModelLen, no tensor parallelism."""

import pytest
import torch
from support import engine_contract as contract
from support.jobs import job

from sparrowrl.spec.job import JobError, parse
from sparrowrl.trainer.models import policy_state
from sparrowrl.worker.engines import Prompt, Sampling, make_engine
from sparrowrl.worker.engines.hf import HFEngine


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A worker's model folder (config and tokenizer) and the policy."""
    path = tmp_path_factory.mktemp("model")
    return str(path), policy_state(contract.policy(path))


def engine(folder, **kw) -> HFEngine:
    e = make_engine("hf", folder[0], **kw)
    contract.load(e, folder[1])
    return e


@pytest.mark.parametrize("check", contract.CHECKS, ids=lambda c: c.__name__)
def test_the_engine_contract(folder, check):
    e = engine(folder)
    check(contract.Subject(e, e, lambda p, n: contract.reference_greedy(e, p, n), exact=True, logprob_abs=0.05))


def test_defaults_sample_as_one_plain_seeded_generate_per_group(folder):
    """The demo's figures depend on it: the same calls, seeds and numbers as before sampling settings."""
    e = engine(folder)
    prompts = [Prompt(p, 11 + i) for i, p in enumerate(contract.PROMPTS)]
    got = e.generate(prompts, Sampling(n=4, max_new_tokens=10, temperature=1.5))
    for p, samples in zip(prompts, got):
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


def test_max_model_len_bounds_prompt_and_completion(folder):
    prompt = Prompt(contract.PROMPTS[0], 11)
    e = engine(folder, max_model_len=9)
    (samples,) = e.generate([prompt], Sampling(n=4, max_new_tokens=8, temperature=1.0))
    assert max(len(x.tokens) for x in samples) <= 9 - len(prompt.ids)
    assert all(x.finish == ("eos" if x.tokens[-1] in e.eos else "length") for x in samples)
    with pytest.raises(ValueError, match="maxModelLen"):
        engine(folder, max_model_len=6).generate([prompt], Sampling(n=2, max_new_tokens=8, temperature=1.0))


def test_tensor_parallelism_is_refused_for_hf(folder):
    with pytest.raises(ValueError, match="rollout.tensorParallelSize: 2.*hf engine runs on one device"):
        make_engine("hf", folder[0], tensor_parallel_size=2)
    j = job(rollout={"tensorParallelSize": 2})
    with pytest.raises(JobError, match="spec.rollout: tensorParallelSize 2 needs engine: vllm"):
        parse(j)
    j["spec"]["rollout"]["engine"] = "vllm"
    assert parse(j).spec.rollout.tensor_parallel_size == 2


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
    with pytest.raises(JobError, match=field.replace(".", r"\.") + ":"):
        parse(job(grpo=grpo))
