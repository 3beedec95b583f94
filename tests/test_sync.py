"""The public sync API (`sparrowrl.sync`): the docs' example as it stands, and what a trainer and a
rollout server of one's own rely on: bit-exact versions by state hash, restarts, whole versions,
following, and updates refused with the tensors left as they were."""

from __future__ import annotations

import asyncio
import contextlib
import io
import re
import threading
from pathlib import Path

import pytest
import torch

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


def _bf16(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().to(torch.bfloat16).clone() for n, p in model.named_parameters()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n].view(torch.int16), b[n].view(torch.int16)) for n in a)


def test_versions_reach_a_state_dict_bit_exact_and_a_restarted_publisher_goes_on(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    held = _bf16(model)  # the rollout side starts from the same checkpoint: it holds v0
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
        assert _same(held, _bf16(model))

        # a restarted trainer, from a checkpoint one step behind what it published: the next delta
        # must apply to what subscribers hold (v2), not to the checkpoint's weights
        behind = _model()
        behind.load_state_dict(model.state_dict())
        _step(model, opt, 3)  # v2's weights move on unpublished: the checkpoint is not v2
        again = Publisher(model, tmp_path / "store")
        assert again.version == 2 and again.weights_hash() != again.state_hash
        assert again.publish() == 3 and again.store.versions[3].base  # base_every=3
        asyncio.run(follow(2, 3, again.state_hash))
        assert _same(held, _bf16(model))


def test_whole_versions_and_following(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rollout = _model().to(torch.bfloat16)
    pub = Publisher(model, tmp_path / "store", base_every=1)
    steps = threading.Event()

    def train() -> None:
        steps.wait(60)
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
                steps.set()
                async for v in sub.follow():
                    staged = await sub.fetch(v)
                    assert staged.delta is None and staged.state is not None  # a full snapshot
                    await asyncio.to_thread(sub.apply, staged)
                    seen.append(v)
                    if v == 2:
                        return seen

        assert asyncio.run(main()) == [1, 2]
        trainer.join()
    assert _same(_bf16(rollout), _bf16(model))


def test_refused_updates_leave_the_tensors_as_they_were(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pub = Publisher(model, tmp_path / "store")
    for v in (1, 2):
        _step(model, opt, v)
        pub.publish()
    with pub.serve(SECRET) as origin:

        async def main() -> None:
            tensors = _bf16(_model())
            before = {n: t.clone() for n, t in tensors.items()}
            forger = public_text(Signer("another job's secret").key)  # a key that did not sign these versions
            async with Subscriber(origin.url, tensors, held=0, token=SECRET, trainer_key=forger, attempts=1) as sub:
                with pytest.raises(FetchError, match="signature"):
                    await sub.pull(1)
                assert _same(tensors, before) and sub.version == 0
            async with Subscriber(origin.url, tensors, held=0, token=SECRET) as sub:
                staged = await sub.fetch(2)  # v2's delta applies to v1, not to what is held
                with pytest.raises(MismatchError, match="v1, not v0"):
                    sub.apply(staged)
                staged.version = 1  # a delta passed off as another version's: its base hash says no
                with pytest.raises(MismatchError, match="base hash"):
                    sub.apply(staged)
                assert _same(tensors, before) and sub.version == 0
                await sub.pull(1)
                with pytest.raises(ValueError, match="only go forward"):
                    await sub.pull(0)
            tensors["model.norm.weight"][0] += 1  # not v0 after all
            async with Subscriber(origin.url, tensors, held=0, token=SECRET) as sub:
                changed = {n: t.clone() for n, t in tensors.items()}
                with pytest.raises(MismatchError, match="base hash"):
                    await sub.pull(1)
                assert _same(tensors, changed)

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

        assert asyncio.run(find(_bf16(model))) == (1, 1)
        other = _bf16(model)
        other["model.norm.weight"][0] += 1
        assert asyncio.run(find(other)) == (None, -1)  # no version: the first fetch is then the whole state
