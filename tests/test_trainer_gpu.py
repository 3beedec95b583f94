"""One trainer rank on a GPU: bf16 compute with fp32 master weights and AdamW state, micro-batches
and a schedule; the policy it publishes is the same bits as the CPU's bf16 cast of its master
weights; its checkpoints load on the CPU; a restart between checkpoint and publish publishes
from device tensors. Run by hack/gpu-check.sh."""

from __future__ import annotations

import pytest
import torch
from support.tensors import bf16
from test_learner import _batch, _job

from sparrowrl.delta import state_hash
from sparrowrl.spec.job import parse
from sparrowrl.trainer import models, resume
from sparrowrl.trainer.learner import Learner

cupy = pytest.importorskip("cupy")
try:
    have_gpu = torch.cuda.is_available() and cupy.cuda.runtime.getDeviceCount() > 0
except Exception:
    have_gpu = False
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not have_gpu, reason="needs CUDA"), pytest.mark.timeout(300)]


def _spec(device: str):
    job = _job(learningRate=1e-3, lrSchedule="cosine", warmupSteps=1, microBatchTokens=16)
    job["spec"]["trainer"] = {"device": device}
    return parse(job).spec


def test_one_rank_trains_on_the_gpu(tmp_path):
    gpu, cpu = Learner(_spec("cuda"), tmp_path / "gpu"), Learner(_spec("cpu"), tmp_path / "cpu")
    assert gpu.device.type == "cuda" and cpu.device.type == "cpu"
    assert all(p.is_cuda and p.dtype == torch.float32 for p in gpu.model.parameters())
    assert all(p.is_cuda for p in gpu.ref.parameters())
    for b in range(3):
        row = gpu.train(_batch(gpu, b))
        if b == 0:  # bf16 compute: near the CPU's fp32 step from the same weights
            want = cpu.train(_batch(cpu, 0))
            assert row["reward_mean"] == want["reward_mean"] and row["lr"] == want["lr"]
            assert row["loss"] == pytest.approx(want["loss"], rel=0.05, abs=1e-3)
            assert row["grad_norm"] == pytest.approx(want["grad_norm"], rel=0.05)
        states = [t for st in gpu.opt.state.values() for t in st.values() if t.dim()]
        assert states and all(t.is_cuda and t.dtype == torch.float32 for t in states)  # AdamW's moments
        gpu.publish()
        gpu.checkpoint()()
        v = gpu.store.versions[b + 1]
        host = bf16(gpu.model)
        assert v.state_hash == state_hash(host) == state_hash(models.policy_state(gpu.model))
        published = gpu.store.materialize(b + 1)
        assert all(torch.equal(published[n].view(torch.int16), t.view(torch.int16)) for n, t in host.items())
    # the checkpoint, written from the GPU, loads into a model on the CPU
    t = gpu.spec.model.tiny
    model = models.tiny_qwen3(len(gpu.tok), t.hidden, t.layers, t.heads, 99)
    opt = torch.optim.AdamW(model.parameters())
    resume.Checkpoints(tmp_path / "gpu" / "trainer").load(3, model, opt)
    master = dict(gpu.model.named_parameters())
    assert all(torch.equal(p, master[n].detach().cpu()) for n, p in model.named_parameters())


def test_killed_after_publishing_it_trains_again_on_the_gpu_and_diffs_from_the_store(tmp_path):
    """Killed after it published v1, before its checkpoint: started again at v0's checkpoint, it
    trains step 1 again on the GPU, and diffs v2 from the store's v1 (what workers hold), so v2
    is the cast of its master weights whether or not the step came to the same bits."""
    first = Learner(_spec("cuda"), tmp_path)
    first.train(_batch(first, 0))
    first.publish()
    first.held.close()  # killed before its checkpoint
    again = Learner(_spec("cuda"), tmp_path)
    assert again.version == 0 and again.store.newest == 1
    v1 = again.store.materialize(1)
    assert all(torch.equal(again.publisher.policy[n][1].cpu(), t.reshape(-1)) for n, t in v1.items())
    again.train(_batch(again, 0))
    print(f"trained again on the GPU: {'the same bits' if again.holds(1) else 'other bits'} than v1")
    again.train(_batch(again, 1))
    again.publish()
    assert again.store.versions[2].state_hash == state_hash(bf16(again.model))
