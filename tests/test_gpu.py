"""GPU path: CUDA tensors give byte-identical deltas and equal hashes, and the sharded trainer
publishes from CUDA shards over NCCL. Run by hack/gpu-check.sh."""

import io

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from support.servers import free_port
from support.tensors import adam_step_pair, mutated, random_tensor, same
from test_shard import _rank, check_published

from sparrowrl.delta import DeltaFile, apply_delta, state_hash, write_delta
from sparrowrl.delta.bitview import bits
from sparrowrl.delta.statehash import tensor_hash, tensor_key

cupy = pytest.importorskip("cupy")
try:
    have_gpu = torch.cuda.is_available() and cupy.cuda.runtime.getDeviceCount() > 0
except Exception:
    have_gpu = False
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not have_gpu, reason="needs CUDA")]


def encode(old: dict, new: dict) -> bytes:
    buf = io.BytesIO()
    base = state_hash({k: v.cpu() for k, v in old.items()})
    write_delta(buf, old, new, base_version=0, base_hash=base, target_version=1, segment=1 << 16, chunk_bytes=1 << 16)
    return buf.getvalue()


@pytest.mark.parametrize("dtype", ["BF16", "F16", "F32", "U8", "F64"])
@pytest.mark.parametrize("density", [0.0, 0.001, 0.01, 0.3, 1.0])
def test_gpu_bytes_identical_random(rng, dtype, density):
    old = {"a": random_tensor(rng, dtype, (300, 701)), "b": random_tensor(rng, dtype, (13,))}
    new = mutated(rng, old, density)
    cpu = encode(old, new)
    gpu = encode({k: v.cuda() for k, v in old.items()}, {k: v.cuda() for k, v in new.items()})
    assert gpu == cpu
    state = {k: v.clone() for k, v in old.items()}
    apply_delta(DeltaFile(gpu), state, verify_full=True)
    assert same(state, new)


def test_gpu_bytes_identical_realistic(rng):
    old, new = adam_step_pair(rng, 1 << 22)
    assert encode({"w": old.cuda()}, {"w": new.cuda()}) == encode({"w": old}, {"w": new})


@pytest.mark.parametrize("dtype", ["BF16", "F32", "F64"])
def test_gpu_hash_equals_cpu(rng, dtype):
    from sparrowrl.delta import gpu

    t = random_tensor(rng, dtype, (1000, 33))
    key = tensor_key("w", t)
    assert gpu.tensor_hash(key, gpu.device_bits(t.cuda())) == tensor_hash(key, bits(t))


def test_gpu_apply_in_place_into_fused_views(rng):
    """A delta in the trainer's layout applies straight into views of a fused CUDA parameter
    (vLLM's qkv_proj on GPU), and the state hash is computed where the tensors live."""
    q, k, v = (random_tensor(rng, "BF16", (n, 256)) for n in (512, 128, 128))
    old = {"q_proj.weight": q, "k_proj.weight": k, "v_proj.weight": v}
    new = mutated(rng, old, 0.01)
    qkv = torch.cat([q, k, v]).cuda()
    views = dict(zip(old, qkv.split([512, 128, 128])))
    assert state_hash(views) == state_hash(old)
    h = apply_delta(DeltaFile(encode(old, new)), views, base_hash=state_hash(old), verify_full=True)
    assert h == state_hash(new) == state_hash(views)
    assert np.array_equal(bits(qkv.cpu()), bits(torch.cat(list(new.values()))))


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_sharded_trainer_publishes_from_cuda_shards(tmp_path):
    """tests/test_shard.py's ranks on GPUs: FSDP2 shards on CUDA, NCCL, the shards diffed by CuPy
    and hashed on the device. What they publish is what they held, bit for bit, and the bytes one
    process writes from the same weights on the host (two ranks where there are two GPUs)."""
    world = min(2, torch.cuda.device_count())
    mp.spawn(_rank, args=(world, free_port(), str(tmp_path), "cuda"), nprocs=world)
    check_published(tmp_path)


def test_the_sync_api_between_cuda_models(tmp_path):
    """The public API on GPUs: a Publisher diffs a CUDA model's bf16 cast on the device (CuPy), and
    a Subscriber applies each version in place into a CUDA model's parameters, bit-exact to the
    trainer's cast by state hash, as docs/api.md's example does on the CPU."""
    import asyncio

    from sparrowrl.sync import Publisher, Subscriber
    from sparrowrl.trainer import models

    trainer = models.tiny_qwen3(64, 64, 2, 2, seed=0).cuda()
    rollout = models.tiny_qwen3(64, 64, 2, 2, seed=1).to(torch.bfloat16).cuda()
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-3)
    publisher = Publisher(trainer, tmp_path / "store")
    with publisher.serve("a secret") as origin:

        async def main() -> None:
            tensors = dict(rollout.named_parameters())
            async with Subscriber(origin.url, tensors, token="a secret") as sub:
                await sub.pull()
                for step in range(3):
                    ids = torch.randint(3, 64, (4, 12), generator=torch.Generator().manual_seed(step)).cuda()
                    trainer(input_ids=ids, labels=ids).loss.backward()
                    opt.step()
                    opt.zero_grad()
                    await sub.pull(publisher.publish())
                    assert sub.state_hash == publisher.state_hash == state_hash(tensors)

        asyncio.run(main())
    assert all(p.is_cuda for p in rollout.parameters())
    assert all(
        torch.equal(p.detach().to(torch.bfloat16).view(torch.int16), q.detach().view(torch.int16))
        for p, q in zip(trainer.parameters(), rollout.parameters(), strict=True)
    )
