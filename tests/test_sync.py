"""The public sync API (`sparrowrl.sync`): the docs' example as it stands, and what a trainer and a
rollout server of one's own rely on: bit-exact versions by state hash, restarts, whole versions,
following, and updates refused with the tensors left as they were."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import os
import re
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from support.servers import free_port
from support.tensors import bf16, same

from sparrowrl.auth.signing import Signer, public_text
from sparrowrl.delta import state_hash
from sparrowrl.sync import FetchError, MismatchError, Publisher, Subscriber
from sparrowrl.trainer import models

pytestmark = pytest.mark.timeout(300)
SECRET = "test secret"
VOCAB = 64


def test_the_docs_example_runs(tmp_path, monkeypatch):
    """docs/api.md's example, exactly as written: it asserts bit-exactness itself."""
    text = (Path(__file__).parent.parent / "docs" / "api.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "docs/api.md", "exec"), {"__name__": "__main__"})
    assert [line.split(":")[0] for line in out.getvalue().splitlines()] == ["v1", "v2", "v3"]


def _model() -> torch.nn.Module:
    return models.tiny_qwen3(VOCAB, 32, 2, 2, seed=0)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    ids = torch.randint(3, VOCAB, (4, 12), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def test_versions_reach_a_state_dict_bit_exact_and_a_restarted_publisher_goes_on(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    held = bf16(model)  # the rollout side starts from the same checkpoint: it holds v0
    pub = Publisher(dict(model.named_parameters()), tmp_path / "store", base_every=3)
    with pub.serve(SECRET) as origin:

        async def follow(have: int, upto: int, want: str) -> None:
            async with Subscriber(origin.url, held, held=have, token=SECRET, trainer_key=origin.trainer_key) as sub:
                await sub.pull(upto)
                assert sub.state_hash == state_hash(held) == want

        for v in (1, 2):
            _step(model, opt, v)
            assert pub.publish() == v
        asyncio.run(follow(0, 2, pub.state_hash))
        assert same(held, bf16(model))

        # a restarted trainer, from a checkpoint one step behind what it published: the next delta
        # must apply to what subscribers hold (v2), not to the checkpoint's weights
        behind = _model()
        behind.load_state_dict(model.state_dict())
        _step(model, opt, 3)  # v2's weights move on unpublished: the checkpoint is not v2
        again = Publisher(model, tmp_path / "store")
        assert again.version == 2 and again.weights_hash() != again.state_hash
        assert again.publish() == 3 and again.store.versions[3].base  # base_every=3
        asyncio.run(follow(2, 3, again.state_hash))
        assert same(held, bf16(model))


def test_whole_versions_and_following(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rollout = _model().to(torch.bfloat16)
    pub = Publisher(model, tmp_path / "store", base_every=1)

    def train() -> None:
        for v in (1, 2):
            _step(model, opt, v)
            pub.publish()

    trainer = threading.Thread(target=train)
    with pub.serve(SECRET) as origin:

        async def main() -> list[int]:
            tensors = dict(rollout.named_parameters())
            seen = []
            async with Subscriber(origin.url, tensors, token=SECRET, snapshots=True) as sub:
                await sub.pull(0)
                trainer.start()
                async for v in sub.follow():
                    staged = await sub.fetch(v)
                    assert staged.delta is None and staged.state is not None  # a full snapshot
                    await asyncio.to_thread(sub.apply, staged)
                    seen.append(v)
                    if v == 2:
                        return seen

        assert asyncio.run(main()) == [1, 2]
        trainer.join()
    assert same(bf16(rollout), bf16(model))


def test_refused_updates_leave_the_tensors_as_they_were(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pub = Publisher(model, tmp_path / "store")
    for v in (1, 2):
        _step(model, opt, v)
        pub.publish()
    with pub.serve(SECRET) as origin:

        async def main() -> None:
            tensors = bf16(_model())
            before = {n: t.clone() for n, t in tensors.items()}
            forger = public_text(Signer("another job's secret").key)  # a key that did not sign these versions
            async with Subscriber(origin.url, tensors, held=0, token=SECRET, trainer_key=forger, attempts=1) as sub:
                with pytest.raises(FetchError, match="signature"):
                    await sub.pull(1)
                assert same(tensors, before) and sub.version == 0
            async with Subscriber(origin.url, tensors, held=0, token=SECRET) as sub:
                staged = await sub.fetch(2)  # v2's delta applies to v1, not to what is held
                with pytest.raises(MismatchError, match="v1, not v0"):
                    sub.apply(staged)
                passed_off = dataclasses.replace(staged, version=1)  # another version's delta: its base hash says no
                with pytest.raises(MismatchError, match="base hash"):
                    sub.apply(passed_off)
                assert same(tensors, before) and sub.version == 0
                await sub.pull(1)
                with pytest.raises(ValueError, match="only go forward"):
                    await sub.pull(0)
            tensors["model.norm.weight"][0] += 1  # not v0 after all
            async with Subscriber(origin.url, tensors, held=0, token=SECRET) as sub:
                changed = {n: t.clone() for n, t in tensors.items()}
                with pytest.raises(MismatchError, match="base hash"):
                    await sub.pull(1)
                assert same(tensors, changed)

        asyncio.run(main())


def test_a_subscriber_finds_the_version_its_tensors_hold(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pub = Publisher(model, tmp_path / "store")
    _step(model, opt, 1)
    pub.publish()
    with pub.serve() as origin:  # no secret: loopback, nothing signed

        async def find(tensors: dict[str, torch.Tensor]) -> tuple[int | None, int]:
            async with Subscriber(origin.url, tensors, token="") as sub:
                return await sub.find(), sub.version

        assert asyncio.run(find(bf16(model))) == (1, 1)
        other = bf16(model)
        other["model.norm.weight"][0] += 1
        assert asyncio.run(find(other)) == (None, -1)  # no version: the first fetch is then the whole state


def test_bf16_weights_publish_what_changed(tmp_path):
    """Weights that are bf16 already (a state dict, pure-bf16 training): the version held is a
    copy, not the live tensors, so each step's delta holds its changes, and the weights' hash is
    the published one after every publish."""
    model = _model().to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    pub = Publisher(dict(model.named_parameters()), tmp_path / "store")
    held = bf16(model)
    with pub.serve(SECRET) as origin:

        async def main() -> None:
            async with Subscriber(origin.url, held, held=0, token=SECRET) as sub:
                for v in (1, 2):
                    _step(model, opt, v)
                    assert pub.publish() == v and pub.store.versions[v].changed > 0
                    assert pub.weights_hash() == pub.state_hash != pub.store.versions[v - 1].state_hash
                    await sub.pull(v)
                    assert sub.state_hash == pub.state_hash

        asyncio.run(main())
    assert same(held, bf16(model))


def test_a_lagging_subscriber_takes_a_base_past_pruned_deltas(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    held = bf16(model)
    pub = Publisher(model, tmp_path / "store", base_every=2)
    for v in range(1, 6):
        _step(model, opt, v)
        pub.publish()
    assert pub.store.prune(2) and 1 not in pub.store.versions  # v1's delta is gone; v4 is a base
    with pub.serve(SECRET) as origin:

        async def main() -> None:
            async with Subscriber(origin.url, held, held=0, token=SECRET) as sub:
                assert await sub.pull() == 5 and sub.state_hash == pub.state_hash
                assert sub.stats.kinds.get("base", 0) > 0  # the base v4, then v5's delta

        asyncio.run(main())
    assert same(held, bf16(model))


def test_bad_arguments_are_refused_naming_them(tmp_path):
    model = _model()
    pub = Publisher(model, tmp_path / "store", base_every=3)
    with pytest.raises(ValueError, match="base_every: 2, where the store"):
        Publisher(model, tmp_path / "store", base_every=2)
    with pytest.raises(ValueError, match="base_every: 0"):
        Publisher(model, tmp_path / "other", base_every=0)
    tensors = bf16(model)
    with pytest.raises(ValueError, match="no signature would be checked"):
        Subscriber("http://relay.example:8471", tensors, token="")
    with pytest.raises(ValueError, match="held: -1"):
        Subscriber("http://127.0.0.1:1", tensors, held=-1, token="")
    with pub.serve() as origin:

        async def main() -> None:
            async with Subscriber(origin.url, tensors, held=0, token="", snapshots=True) as sub:
                with pytest.raises(ValueError, match="version: -1"):
                    await sub.pull(-1)
                _step(model, torch.optim.SGD(model.parameters(), lr=0.1), 1)
                pub.publish()
                with pytest.raises(ValueError, match="base_every=1; this one has 3"):
                    await sub.fetch(1)
                with pytest.raises(ValueError, match="wait"):
                    await anext(sub.follow(wait=float("inf")))

        asyncio.run(main())
    pub.close()
    with pytest.raises(RuntimeError, match="closed"):
        pub.publish()


def _ddp_rank(rank: int, port: int, out: str) -> None:
    """Under DDP every rank holds all the weights: the Publisher lives on rank 0 alone, and makes
    no collective call that the other rank would have to answer (it waits at a barrier)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))  # a hang fails
    try:
        if rank == 0:
            model = _model()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            pub = Publisher(model, Path(out) / "store")
            _step(model, opt, 1)
            pub.publish()
            again = Publisher(model, Path(out) / "store")  # a restart: resumes by the weights' hash
            assert again.version == 1 and again.weights_hash() == again.state_hash
            _step(model, opt, 2)
            assert again.publish() == 2 and again.weights_hash() == again.state_hash
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.e2e
def test_a_ddp_trainer_publishes_from_rank_0_alone(tmp_path):
    mp.spawn(_ddp_rank, args=(free_port(), str(tmp_path)), nprocs=2)
