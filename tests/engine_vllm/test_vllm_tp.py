"""The vLLM engine with tensor parallelism: two GPUs or more (hack/gpu-check.sh's vllm-gpu part,
where the machine has vLLM). Each rank holds a shard of every weight; after a commit the shards,
gathered and joined, must hash to the trainer's version, and greedy decoding must not change."""

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM lives in its own venv: make test-vllm")

from support.models import decisive_qwen3  # noqa: E402

import sparrowrl.worker.engines.vllm as vllm_engine  # noqa: E402
from sparrowrl.delta import state_hash  # noqa: E402
from sparrowrl.trainer.models import policy_state  # noqa: E402
from sparrowrl.worker.engines import Prompt, Sampling  # noqa: E402

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism needs two GPUs"),
]


def test_tensor_parallel_shards_join_to_the_trainers_version(tmp_path):
    model, tok = decisive_qwen3()  # 2 key/value heads: each rank holds one
    model.config.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    state = policy_state(model)
    engine = vllm_engine.VLLMEngine(str(tmp_path), tensor_parallel_size=2)
    for n, t in engine.tensors().items():
        t.copy_(state[n])
    engine.commit()
    assert state_hash(engine.readback()) == state_hash(state)
    greedy = Sampling(n=2, max_new_tokens=8, temperature=1.0, top_k=1)
    (a,) = engine.generate([Prompt([1, 5, 6, 7], 0)], greedy)
    assert a[0].tokens == a[1].tokens and sum(a[0].logprobs) < 0
