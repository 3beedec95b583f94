"""TRL's GRPOTrainer in server mode, its weights synced to `vllm serve` through SparrowRL (the
`make test-vllm` venv, on CPU).

A tiny Qwen3 saved in bf16 is what the server starts from and what the trainer loads in fp32;
`SparrowRLGRPOTrainer` trains it for three steps, generating through the server: the first sync
starts the store (v0: the checkpoint) and the origin, each later one publishes a version and
drives the server's sparrowrl backend to it. The server must then name the last version, and the
weights its backend reads back out of vLLM must hash to the Publisher's state hash."""

import time

import pytest
import requests
import torch

pytest.importorskip("vllm", reason="vLLM lives in its own venv: make test-vllm")
pytest.importorskip("trl", reason="TRL lives in the vLLM venv: make test-vllm")

from datasets import Dataset  # noqa: E402
from support.servers import TOKEN, free_port  # noqa: E402
from support.vllm_serve import vllm_serve  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from sparrowrl.auth import pki  # noqa: E402
from sparrowrl.delta import state_hash  # noqa: E402
from sparrowrl.integrations.trl import SparrowRLConfig, SparrowRLGRPOTrainer  # noqa: E402
from sparrowrl.trainer.models import char_tokenizer, policy_state, tiny_qwen3  # noqa: E402

pytestmark = pytest.mark.e2e

STEPS = 3


def distinct(completions, **_) -> list[float]:
    """A reward that differs between samples, so that advantages (and the updates) are not zero."""
    return [float(len(set(c))) for c in completions]


@pytest.mark.timeout(900)
def test_grpo_trainer_syncs_vllm_serve_through_sparrowrl(tmp_path, monkeypatch):
    tok = char_tokenizer()
    folder = tmp_path / "model"
    tiny_qwen3(len(tok), 128, 2, 4, seed=0).to(torch.bfloat16).save_pretrained(folder)
    tok.save_pretrained(folder)
    origin_port = free_port()
    monkeypatch.setenv("SPARROWRL_TOKEN", TOKEN)  # the origin's secret, in the trainer
    log = tmp_path / "vllm.log"
    flags = ("--max-model-len", "128", "--logprobs-mode", "processed_logprobs")
    ca = pki.authority("trl job")  # the origin over HTTPS; the server trusts this CA alone
    served = pki.serving(ca, ["127.0.0.1"])
    for name, data in (("ca.crt", ca.cert), ("tls.crt", served.cert), ("tls.key", served.key)):
        (tmp_path / name).write_bytes(data)
    origin = f"https://127.0.0.1:{origin_port}"
    with vllm_serve(folder, log, origin, *flags, SPARROWRL_CA_CERT=str(tmp_path / "ca.crt")) as base:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        v0 = policy_state(model)
        args = GRPOConfig(
            output_dir=str(tmp_path / "out"),
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            max_steps=STEPS,
            learning_rate=1e-2,
            per_device_train_batch_size=4,
            num_generations=4,
            max_completion_length=8,
            temperature=1.0,
            logging_steps=1,
            use_vllm=True,
            vllm_mode="server",
            vllm_server_base_url=base,
            vllm_server_timeout=30,
        )
        data = Dataset.from_dict({"prompt": ["1+2=", "3*4=", "abc", "(5-1)="] * 4})
        sparrowrl = SparrowRLConfig(
            store=tmp_path / "store",
            port=origin_port,
            base_every=2,
            tls_cert=tmp_path / "tls.crt",
            tls_key=tmp_path / "tls.key",
        )
        trainer = SparrowRLGRPOTrainer(
            model=model, reward_funcs=distinct, args=args, train_dataset=data, processing_class=tok, sparrowrl=sparrowrl
        )
        t = time.monotonic()
        trainer.train()
        print(f"{STEPS} GRPO steps in {time.monotonic() - t:.1f} s")
        gen = trainer.vllm_generation
        print("sync (publish to resume):", ", ".join(f"{s:.2f} s" for s in gen.sync_seconds))
        publisher = trainer.publisher
        # step 0's sync made the store (v0: the checkpoint); steps 1 and 2 published v1 and v2
        assert publisher.version == STEPS - 1
        assert publisher.store.versions[0].state_hash != publisher.state_hash  # the training changed weights
        assert publisher.store.versions[0].state_hash == state_hash(v0)
        assert requests.get(f"{base}/weight_info", timeout=30).json()["weight_version"] == str(STEPS - 1)
        r = requests.post(f"{base}/collective_rpc", json={"method": "sparrowrl_status"}, timeout=60)
        (status,) = r.json()["results"]
        assert (status["version"], status["state_hash"]) == (STEPS - 1, publisher.state_hash), status
        assert status["updates"] == {"ok": STEPS - 1, "failed": 0, "mismatch": 0}, status
        # every step's completions came from the server
        assert log.read_text().count("POST /v1/completions") >= STEPS
        gen.close()


@pytest.mark.timeout(300)
def test_refuses_what_it_cannot_sync(tmp_path):
    """Colocated vLLM (no server to update) fails at construction, naming the field; so do bad options."""
    tok = char_tokenizer()
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        report_to=[],
        per_device_train_batch_size=2,
        num_generations=2,
        use_vllm=True,
        vllm_mode="colocate",
    )
    with pytest.raises(ValueError, match="vllm_mode: SparrowRL updates vLLM servers"):
        SparrowRLGRPOTrainer(
            model=tiny_qwen3(len(tok), 32, 1, 2, seed=0),
            reward_funcs=distinct,
            args=args,
            train_dataset=Dataset.from_dict({"prompt": ["1+2="] * 2}),
            processing_class=tok,
            sparrowrl=SparrowRLConfig(store=tmp_path / "store"),
        )
    import trl.trainer.grpo_trainer as grpo
    from trl.generation.vllm_generation import VLLMGeneration

    assert grpo.VLLMGeneration is VLLMGeneration  # TRL's own again, after the failed construction
    with pytest.raises(ValueError, match="port"):
        SparrowRLConfig(store=tmp_path / "store", port=70000)
    with pytest.raises(ValueError, match="wait_s"):
        SparrowRLConfig(store=tmp_path / "store", wait_s=float("inf"))
