"""A trainer of several nodes on one machine: `sparrowrl run` starts each node as its own process
group on its own state dir (as each pod has its own volume), and they meet at node 0's TCP store
(gloo). Each node keeps its own ranks' checkpoint shards, and a restart goes on from the newest
version whole on every node.
A node that never joins, or runs another job, keeps the gang from starting and is named."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml
from support import jobs
from support.servers import EXE, free_port

from sparrowrl.store.store import Store
from sparrowrl.trainer import rendezvous

pytestmark = pytest.mark.e2e


def job(steps: int, **trainer) -> dict:
    return jobs.job(
        "nodes",
        steps=steps,
        seed=3,
        model=jobs.tiny(warmupSteps=60),
        grpo={"learningRate": 1e-3, **jobs.GRPO},
        rollout={"groupsPerLease": 1},
        sync={"mode": "sparse", "staleness": 0, "baseEvery": 10},  # no version pruned
        topology={"regions": [{"name": "a", "workers": 1}]},
        trainer=trainer,
    )


def run(tmp_path, name: str, spec: dict, *args: str) -> subprocess.CompletedProcess:
    f = tmp_path / f"{name}.yaml"
    f.write_text(yaml.safe_dump(spec))
    return subprocess.run(
        [EXE, "run", str(f), "--run-dir", str(tmp_path / name), *args], capture_output=True, text=True, timeout=600
    )


def published(run_dir) -> dict[int, str]:
    return {v: x.state_hash for v, x in Store(run_dir / "store").versions.items()}


@pytest.mark.timeout(900)
def test_two_nodes_keep_their_own_shards_and_resume_from_the_newest_whole_on_both(tmp_path):
    """2 nodes × 1 rank, every commit verified; each node's volume holds only its own ranks'
    shards. (That they publish what 1 node × 2 ranks does, hash for hash, tests/test_operator_nodes.py
    shows in a cluster, and hack/bench_shard.py's byte-equal deltas here.) Then node 1 loses its
    newest checkpoint (as if it died while writing it): the resumed run says so, goes on from the
    newest version whole on both nodes, trains the steps since again, and finishes with every
    commit verified and no published version rewritten."""
    checkpoints = {"every": 2, "keep": 2}
    two = run(tmp_path, "two", job(4, nodes=2, ranks=1, checkpoint=checkpoints))
    assert two.returncode == 0, two.stderr[-3000:]
    out = tmp_path / "two"
    first = published(out)
    assert len(first) == 5
    s = json.loads((out / "summary.json").read_text())
    assert s["weights_mismatch"] == 0 and s["weights_verified"] >= 5

    for node, folder in ((0, out / "trainer"), (1, out / "nodes" / "1" / "trainer")):
        assert sorted(p.name for p in folder.glob("v*")) == ["v00000002", "v00000004"]  # keep 2, on each node
        assert sorted(p.name for p in (folder / "v00000004").iterdir()) == ["node.json", f"rank-0000{node}.safetensors"]

    (out / "nodes" / "1" / "trainer" / "v00000004" / "node.json").unlink()  # node 1 never sealed v4
    again = run(tmp_path, "two", job(6, nodes=2, ranks=1, checkpoint=checkpoints), "--resume")
    assert again.returncode == 0, again.stderr[-3000:]
    log = " ".join((out / "logs" / "trainer.log").read_text().split())
    assert "v4 is whole on node 0 but not on every node (one stopped while writing it); resuming from v2" in log
    # the journal was compacted at v4, whole on node 0: steps 3..4 train on new rollouts, and v5 moves the
    # workers to what they make (a node that really died while writing v4 would have stopped node 0 before that)
    assert "trained again to v4: " in log
    s = json.loads((out / "summary.json").read_text())
    assert s["final_version"] == 6 and s["weights_mismatch"] == 0 and s["steps_redone"] == 2
    versions = published(out)
    assert sorted(versions)[-1] == 6 and all(versions[v] == h for v, h in first.items())


@pytest.mark.timeout(600)
def test_hybrid_sharding_publishes_every_element_once(tmp_path):
    """HSDP over 2 nodes of 1 rank: each node holds the whole model, and the two split each
    tensor's range to diff and encode it (gather.part); the workers' weights verify at every
    version."""
    r = run(tmp_path, "hsdp", job(3, nodes=2, ranks=1, sharding="hybrid"))
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((tmp_path / "hsdp" / "summary.json").read_text())
    assert s["final_version"] == 3 and s["weights_mismatch"] == 0 and s["weights_verified"] >= 4


def trainer(tmp_path, spec: dict, node: int, port: int) -> subprocess.Popen:
    """`sparrowrl trainer` as node `node` of the job, on a state dir of its own."""
    f = tmp_path / f"node{node}.yaml"
    f.write_text(yaml.safe_dump(spec))
    args = ["--node", str(node), "--rendezvous", f"127.0.0.1:{port}", "--port", str(free_port())]
    return subprocess.Popen(
        [EXE, "trainer", str(f), "--state-dir", str(tmp_path / f"state{node}"), *args],
        env={**os.environ, "SPARROWRL_TOKEN": "s3cret-for-tests"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.timeout(120)
def test_a_node_that_never_joins_is_named(tmp_path):
    """Node 0 waits trainer.joinTimeoutSeconds for node 1, which never starts, then stops with
    one line that names it; nothing trained, nothing published."""
    p = trainer(tmp_path, job(2, nodes=2, joinTimeoutSeconds=10), 0, free_port())
    _, err = p.communicate(timeout=90)
    assert p.returncode == 1, err[-3000:]
    assert "trainer.nodes: node 1 of 2 did not join in 10 s (trainer.joinTimeoutSeconds)" in " ".join(err.split())
    assert not (tmp_path / "state0" / "store").exists()


@pytest.mark.timeout(120)
def test_a_node_started_with_another_job_is_refused(tmp_path):
    """Node 1 started with another seed would train another model: node 0 refuses the gang at
    rendezvous, before any collective, and both stop naming node 1."""
    port = free_port()
    zero = trainer(tmp_path, job(2, nodes=2), 0, port)
    other = job(2, nodes=2)
    other["spec"]["seed"] = 4
    one = trainer(tmp_path, other, 1, port)
    why = "node 1 differs from node 0 in the job spec"
    for p in (zero, one):
        _, err = p.communicate(timeout=90)
        assert p.returncode == 1 and why in " ".join(err.split()), err[-3000:]


def test_a_node_with_other_gpus_is_named():
    """The rendezvous's comparison: the first node that differs, and in what."""
    h100 = {"accelerators": ["NVIDIA H100 80GB HBM3"], "gpus": 8, "memory_gib": [79], "torch": "2.13.0", "job": "a"}
    a100 = {**h100, "accelerators": ["NVIDIA A100-SXM4-40GB"], "memory_gib": [40]}
    assert rendezvous.differs({0: h100, 1: h100, 2: h100}) is None
    why = rendezvous.differs({0: h100, 1: h100, 2: a100, 3: {**h100, "gpus": 4}})
    assert why is not None and why.startswith("node 2 differs from node 0 in accelerators: ['NVIDIA A100-SXM4-40GB']")
    assert rendezvous.differs({0: h100, 1: {**h100, "gpus": 4}}) == (
        "node 1 differs from node 0 in gpus: 4 where node 0 has 8 (every node of a trainer needs the same GPUs, "
        "torch and job)"
    )


def _agree(rank: int, port: int, folders: list[str], fresh: bool, out: str) -> None:
    """Node `rank` of 2 (one rank each, gloo) agrees on the checkpoint to resume from."""
    import torch.distributed as dist

    from sparrowrl.trainer import ranks, resume

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        try:
            said = resume.ShardedCheckpoints(Path(folders[rank]), rank, 2, rank, True).agree(fresh)
        except resume.ResumeError as e:
            said = str(e)
        Path(out, f"{rank}.json").write_text(json.dumps(said))
    finally:
        dist.destroy_process_group()
    ranks.leave()


def sealed(folder, node: int, *versions: int) -> None:
    for v in versions:
        (folder / f"v{v:08d}").mkdir(parents=True)
        (folder / f"v{v:08d}" / "node.json").write_text(json.dumps({"node": node, "world": 2, "version": str(v)}))


@pytest.mark.parametrize(
    "zero,one,fresh,said,left",
    [
        # node 1's volume lost: nothing removed, and the node named
        (
            (2, 4),
            (),
            False,
            "node 1 holds none of the checkpoints node 0 holds (up to v4): its volume was lost",
            (2, 4),
        ),
        # node 1's volume another run's, beside node 0's new one
        ((), (7,), True, "node 1's state dir holds checkpoints (up to v7) while node 0's is new", ()),
        # killed before v0 was whole on both: started afresh
        ((0,), (), False, None, ()),
        ((2, 4), (2,), False, 2, (2,)),  # v4 never sealed on node 1: from v2, and node 0's v4 goes
    ],
)
@pytest.mark.timeout(120)
def test_nodes_agree_on_a_checkpoint_or_name_the_one_that_lacks_it(tmp_path, zero, one, fresh, said, left):
    import torch.multiprocessing as mp

    folders = [tmp_path / "n0", tmp_path / "n1"]
    for f in folders:
        f.mkdir()
    sealed(folders[0], 0, *zero)
    sealed(folders[1], 1, *one)
    mp.spawn(_agree, args=(free_port(), [str(f) for f in folders], fresh, str(tmp_path)), nprocs=2)
    got = [json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)]
    assert got[0] == got[1]
    assert got[0] == said if not isinstance(said, str) else said in got[0], got
    assert sorted(int(p.name[1:]) for p in folders[0].glob("v*")) == list(left)
