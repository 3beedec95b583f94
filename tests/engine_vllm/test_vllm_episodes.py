"""Episodes on the vLLM engine (task.environment): every episode of a lease at once, turn by turn,
each later turn a request of its own from token ids, as on the hf engine. On a model whose every
turn is its EOS, both engines run the same episodes, token for token."""

import textwrap
from functools import partial

import pytest

pytest.importorskip("vllm", reason="vLLM lives in its own venv: make test-vllm")

from support.models import eos_first  # noqa: E402

import sparrowrl.worker.engines.vllm as vllm_engine  # noqa: E402
from sparrowrl.agents import environment  # noqa: E402
from sparrowrl.agents.turns import Turns  # noqa: E402
from sparrowrl.calls import Pool  # noqa: E402
from sparrowrl.spec.task import EnvironmentSpec  # noqa: E402
from sparrowrl.trainer import models  # noqa: E402
from sparrowrl.worker.engines import Prompt, Sampling  # noqa: E402
from sparrowrl.worker.engines.hf import HFEngine  # noqa: E402
from sparrowrl.worker.episodes import Episodes  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

ENV = """
    class Env:
        dataset = []
        def env_response(self, messages, state):
            return [] if state["turn"] >= 3 else [{"role": "user", "content": f"q{state['turn']}+{state['answer']}"}]
        def reward(self, prompt, completion, answer, **fields):
            return 0.0
    def load_environment():
        return Env()
"""


def test_the_vllm_engine_runs_a_lease_s_episodes_as_the_hf_engine_does(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    state = eos_first(folder, hidden=128, heads=4)  # vLLM's CPU attention takes a head of 32, not 16
    engines = [vllm_engine.VLLMEngine(str(folder)), HFEngine(str(folder))]
    f = tmp_path / "env.py"
    f.write_text(textwrap.dedent(ENV))
    spec = EnvironmentSpec(load=str(f), max_turns=3, max_episode_tokens=64)
    tok = models.char_tokenizer()
    prompts = [Prompt(models.prompt_ids(tok, f"{i}+1="), 7 + i) for i in range(3)]
    examples = [{"messages": [{"role": "user", "content": f"{i}+1="}], "answer": str(i + 1)} for i in range(3)]
    runs = []
    for engine in engines:
        for n, t in engine.tensors().items():
            t.copy_(state[n])
        engine.commit()
        pool = Pool(partial(environment.turn_caller, spec.load, {}), 2, spec.turn_seconds, "environment")
        try:
            runs.append(
                Episodes(engine, Turns(tok, False, {tok.eos_token_id}), spec, pool).run(
                    prompts, examples, Sampling(n=2, max_new_tokens=4, temperature=1.0)
                )
            )
        finally:
            pool.close()
    on_vllm, on_hf = runs
    for g, (a, b) in enumerate(zip(on_vllm, on_hf)):
        for x, y in zip(a, b):
            assert x["tokens"] == y["tokens"] and x["episode"]["turns"] == y["episode"]["turns"]
            assert x["episode"]["end"] == "done" and len(x["episode"]["turns"]) == 2  # three model turns
            q1 = tok(f"q1+{g + 1}", add_special_tokens=False).input_ids
            assert x["tokens"][: 2 + len(q1)] == [tok.eos_token_id, *q1, tok.eos_token_id]
            assert all(abs(p - q) < 0.05 for p, q in zip(x["logprobs"], y["logprobs"]))
