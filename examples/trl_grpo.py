"""TRL's GRPOTrainer with its weights synced to `vllm serve` through SparrowRL.

Each step's weights go out as a signed, lossless sparse delta from the trainer's origin (through
relays, if any) to the servers' sparrowrl backend, instead of over NCCL: the servers can be on
other machines, in other regions, and on CPU.

1. The secret and the keys (the servers get a token of their own and the trainer's public key):

    export SPARROWRL_TOKEN=$(python -c 'import secrets; print(secrets.token_hex(16))')
    sparrowrl credentials worker vllm-a    # the server's SPARROWRL_TOKEN
    sparrowrl credentials relay eu         # a relay's SPARROWRL_TOKEN
    sparrowrl credentials key              # SPARROWRL_TRAINER_KEY=ed25519:...

2. Optionally a relay per region, in front of the trainer's origin (port 8470 here):

    SPARROWRL_TOKEN=<relay token> sparrowrl relay --upstream http://TRAINER:8470 --host 0.0.0.0

3. The vLLM server (sparrowrl installed in its environment: docs/vllm.md), from the same
   checkpoint the trainer starts from, in bf16:

    SPARROWRL_ORIGIN=http://RELAY:8471,http://TRAINER:8470 SPARROWRL_TOKEN=<worker token> \\
    SPARROWRL_TRAINER_KEY=ed25519:... VLLM_SERVER_DEV_MODE=1 \\
    vllm serve Qwen/Qwen3-0.6B --dtype bfloat16 --port 8000 \\
      --logprobs-mode processed_logprobs --weight-transfer-config '{"backend": "sparrowrl"}'

4. The trainer (SPARROWRL_TOKEN set to the secret):

    python examples/trl_grpo.py --server http://VLLM:8000 --host 0.0.0.0 --port 8470

Needs the hub (model and dataset); the test suite runs the same path with a tiny local model
(tests/engine_vllm/test_trl.py).
"""

import argparse

import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig

from sparrowrl.integrations.trl import SparrowRLConfig, SparrowRLGRPOTrainer


def reward_len(completions, **_) -> list[float]:
    """Completions near 20 characters are best: TRL's quick-start reward."""
    return [-abs(20 - len(c)) for c in completions]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="Qwen/Qwen3-0.6B")
    p.add_argument("--dataset", default="trl-lib/tldr")
    p.add_argument("--server", default="http://127.0.0.1:8000", help="the vLLM server TRL generates with")
    p.add_argument("--more-servers", nargs="*", default=[], help="other servers to keep in sync")
    p.add_argument("--store", default="sparrowrl-store", help="the versions' folder")
    p.add_argument("--host", default="127.0.0.1", help="the origin's address (0.0.0.0: all)")
    p.add_argument("--port", type=int, default=8470, help="the origin's port")
    p.add_argument("--steps", type=int, default=100)
    a = p.parse_args()

    # fp32 master weights: their bf16 cast is the checkpoint the server loaded, version 0
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    args = GRPOConfig(
        output_dir="trl-grpo-sparrowrl",
        max_steps=a.steps,
        per_device_train_batch_size=8,
        num_generations=8,
        max_completion_length=64,
        logging_steps=1,
        report_to=[],
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=a.server,
    )
    trainer = SparrowRLGRPOTrainer(
        model=model,
        reward_funcs=reward_len,
        args=args,
        train_dataset=load_dataset(a.dataset, split="train"),
        processing_class=AutoTokenizer.from_pretrained(a.model),
        sparrowrl=SparrowRLConfig(store=a.store, host=a.host, port=a.port, servers=a.more_servers),
    )
    trainer.train()
    trainer.vllm_generation.close()


if __name__ == "__main__":
    main()
