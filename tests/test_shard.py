"""A sharded trainer's version: 2 gloo ranks (real processes) train a tiny Qwen3 under FSDP2,
diff and encode their own shards, and rank 0 writes the one delta. The ranks gather the full
weights only here, to check what they published."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from support.servers import free_port

from sparrowrl.delta import state_hash
from sparrowrl.delta.encoder import Encoder
from sparrowrl.delta.errors import MismatchError
from sparrowrl.delta.frame import DeltaWriter
from sparrowrl.delta.tensors import TensorSpec
from sparrowrl.store.store import Store
from sparrowrl.sync import gather
from sparrowrl.trainer import fsdp, grpo, models, ranks

VOCAB = 53  # odd: FSDP gives the two ranks 27 and 26 rows of the embedding


def _rank(rank: int, world: int, port: int, out: str, device: str = "cpu") -> None:
    """A rank of the trainer: gloo on the CPU, or NCCL with its shards on GPU `rank` (`device`
    "cuda": tests/test_gpu.py), where CuPy diffs them."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        model = models.tiny_qwen3(VOCAB, 32, 2, 2, seed=0)
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp_policy)
        fully_shard(model, mp_policy=mp_policy)
        table = gather.specs(model)
        store = gather.init_store(Path(out) / "store", model, base_every=2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        old = gather.policy(model)
        for step in range(2):  # the second version is also a base snapshot
            ids = torch.randint(3, VOCAB, (4, 12), generator=torch.Generator().manual_seed(10 * step + rank)).to(device)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            new = gather.policy(model)
            gather.publish(store, table, old, new)
            if step == 1:
                gather.snapshot(store, 2, model)  # checked against v2's hash before it is kept
            held = gather.state_hash(table, new)
            full_old = dict(_full(table, old))
            full_new = dict(_full(table, new))
            if rank == 0:
                torch.save(
                    {
                        "held": held,
                        "old": full_old,
                        "new": full_new,
                        "ranges": {t.name: [(r, *_range(t, r, world)) for r in range(world)] for t in table},
                    },
                    Path(out) / f"step{step}.pt",
                )
            old = new
    finally:
        dist.destroy_process_group()
    ranks.leave()


def _range(t, r: int, world: int) -> tuple[int, int]:
    first, end = gather.rows(t.shape[0], r, world)
    row = t.numel // t.shape[0]
    return first * row, end * row


def _full(table, shards):
    """The full tensors, gathered from every rank's flat elements (in this test only)."""
    for t in table:
        first, flat = shards[t.name]
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, (first, flat.cpu()))
        yield t.name, torch.cat([f for _, f in sorted(parts, key=lambda p: p[0])]).view(t.shape)


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_two_ranks_publish_one_version(tmp_path):
    mp.spawn(_rank, args=(2, free_port(), str(tmp_path)), nprocs=2)
    check_published(tmp_path)


def check_published(out: Path) -> None:
    """What `_rank` published is what the ranks held, and what one process would write."""
    store = Store(out / "store")
    assert store.newest == 2 and store.versions[2].base  # v2: a base snapshot, gathered tensor by tensor
    for step in range(2):
        got = torch.load(out / f"step{step}.pt")
        v = step + 1
        # what the ranks hold hash-equals the published version, and the delta reproduces it
        assert got["held"] == state_hash(got["new"]) == store.versions[v].state_hash
        state = store.materialize(v)
        assert all(torch.equal(state[n].view(torch.int16), got["new"][n].view(torch.int16)) for n in state)
        # one process diffing the gathered weights over the same ranges writes the same bytes
        have = store.tensor_table()
        table = [have[n] for n in got["new"]]
        buf = io.BytesIO()
        w = DeltaWriter(buf, table, base_version=step, base_hash=store.versions[step].state_hash, target_version=v)
        enc = Encoder(table)
        for tid, t in enumerate(table):
            spans = [
                (tid, a, got["old"][t.name].reshape(-1)[a:b], got["new"][t.name].reshape(-1)[a:b])
                for _, a, b in got["ranges"][t.name]
            ]
            w.add_encoded(
                t.name, [(a, b - a) for _, a, b in got["ranges"][t.name]], (e for e in enc.encode(spans) if e.data)
            )
        enc.close()
        w.close()
        assert buf.getvalue() == (store.path / "deltas" / store.versions[v].delta).read_bytes()


def test_ranges_that_do_not_cover_a_tensor_are_refused():
    spec = TensorSpec("w", "BF16", (10, 4))
    w = DeltaWriter(io.BytesIO(), [spec], base_version=0, base_hash="0" * 16, target_version=1)
    with pytest.raises(MismatchError, match=r"tensor 'w': a range of 16 elements at 24, where it goes on at 20"):
        w.add_encoded("w", [(0, 20), (24, 16)], [])
    with pytest.raises(
        MismatchError, match=r"tensor 'w': its ranges cover 36 elements, the table's BF16\[10, 4\] has 40"
    ):
        w.add_encoded("w", [(0, 20), (20, 16)], [])
    w.encoder.close()


def _load(rank: int, world: int, port: int, folder: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from transformers import AutoConfig

        model = fsdp.build(AutoConfig.from_pretrained(folder), fsdp.from_files(folder))
        torch.save(dict(gather.gathered(model, torch.float32)), Path(folder) / f"gathered{rank}.pt")
    finally:
        dist.destroy_process_group()
    ranks.leave()


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_each_rank_reads_its_rows_of_a_hugging_face_folder(tmp_path):
    """model.path with 2 ranks: every rank reads only its rows, and together they hold the
    folder's weights exactly (the rotary tables, buffers, are made, not read)."""
    m = models.tiny_qwen3(VOCAB, 32, 2, 2, seed=3)
    m.save_pretrained(tmp_path)
    mp.spawn(_load, args=(2, free_port(), str(tmp_path)), nprocs=2)
    want = dict(m.named_parameters())
    for rank in range(2):
        got = torch.load(tmp_path / f"gathered{rank}.pt")
        assert got.keys() == want.keys()
        assert all(torch.equal(got[n], want[n].detach()) for n in want)


def _micro(rank: int, world: int, port: int, out: str) -> None:
    """A rank's gradient of its rows in one pass, then in micro-batches of 12 tokens: rank 0
    makes 5, rank 1 fewer, so rank 1 cuts its own and adds passes that contribute nothing."""
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        model = models.tiny_qwen3(VOCAB, 32, 2, 2, seed=0)  # fp32 compute: the sums compare tightly
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        g = torch.Generator().manual_seed(rank)
        shapes = [(4, 3), (2, 5), (3, 1), (5, 2), (1, 4)] if rank == 0 else [(3, 2), (2, 3)]
        rows = [
            (
                torch.randint(3, VOCAB, (p,), generator=g).tolist(),
                torch.randint(3, VOCAB, (c,), generator=g).tolist(),
                (-4.0 + torch.rand(c, generator=g)).tolist(),
                None,
            )
            for p, c in shapes
        ]
        adv = torch.randn(len(rows), generator=g)
        tokens = 16 + 5  # the batch's completion tokens over both ranks

        def grads(budget):
            model.zero_grad(set_to_none=True)
            batches = fsdp.micro_batches(rows, budget)
            grpo.accumulate(
                model,
                None,
                rows,
                adv,
                torch.full((len(rows),), world / tokens),
                batches,
                pad_id=0,
                objective=grpo.Objective(),
                device=torch.device("cpu"),
            )
            return batches, {n: p.grad.full_tensor() for n, p in model.named_parameters()}

        one, want = grads(None)
        micro, got = grads(12)
        torch.save({"one": one, "micro": micro, "want": want, "got": got}, Path(out) / f"micro{rank}.pt")
    finally:
        dist.destroy_process_group()
    ranks.leave()


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_ranks_micro_batch_to_the_one_pass_gradient(tmp_path):
    mp.spawn(_micro, args=(2, free_port(), str(tmp_path)), nprocs=2)
    r0, r1 = (torch.load(tmp_path / f"micro{r}.pt") for r in range(2))
    assert r0["one"] == [[0, 1, 2, 3, 4]] and r1["one"] == [[0, 1]]
    assert r0["micro"] == [[0], [1], [3], [4], [2]]  # no two of rank 0's rows fit 12 tokens
    assert r1["micro"] == [[0], [1], [], [], []]  # 2 x (3 + 3) would fit: cut, and passes that add nothing
    for n, want in r0["want"].items():
        assert torch.allclose(r0["got"][n], want, rtol=1e-4, atol=1e-7), n
