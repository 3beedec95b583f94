"""What a trainer needs to start again where it stopped, in its state dir (a volume in a pod):

    STATE/job.json                    the job this state belongs to: another job is refused
    STATE/trainer/v00000007.safetensors   fp32 weights and optimizer state after step 7 (the newest `keep`)
    STATE/trainer/ref.safetensors     the frozen reference policy, when the job has a KL term
    STATE/trainer/v00000007/          the same, sharded: one folder that every rank of a node
                                      writes its own file into (ShardedCheckpoints); each node of a
                                      multi-node trainer has its own state dir
    STATE/journal.jsonl               a snapshot of the coordinator's state once the newest
                                      checkpoint was whole, with the results of the steps since;
                                      then each request's changes and admitted results
    STATE/starts                      how many trainer processes have started on it
    STATE/.trainer.lock               held by the trainer running on it: there is one at a time
    STATE/store/                      the published versions (store.py)
    STATE/hub/                        the job's model and data set from the Hugging Face Hub (hub.py)

A step publishes its version, then checkpoints when one is due, so the checkpoint is never ahead
of the store. The store may be ahead of it: a trainer killed after the checkpoint trains those
steps again from the journal's results, without publishing them (trainer.py). Every admission
and every lease is in the journal before the worker hears of it. This survives the process dying
at any moment (kill -9, OOM, a pod evicted), not the machine losing power: nothing is fsynced.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import IO, Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sparrowrl.spec.statedir import PLANNED_RESUME, state_mismatch
from sparrowrl.store.checkpoint_io import atomic_path

# what a trainer writes in its state dir; a folder holding any of them without job.json is not ours
OWNED = (
    "job.json",
    ".trainer.lock",
    "starts",
    PLANNED_RESUME,
    "trainer",
    "journal.jsonl",
    "store",
    "model",
    "hub",
    "metrics.jsonl",
    "eval.jsonl",
    "summary.json",
    "final",
    "exports",
    "tensorboard",
)
# the folders `atomic_path` writes in before its rename, which a kill leaves behind: (where, whose name)
_TEMPORARY = (
    ("", r"job\.json|starts|journal\.jsonl|metrics\.jsonl"),
    ("trainer", r"v\d{8}\.safetensors|ref\.safetensors"),
    ("store", r"store\.json"),
    ("store/bases", r"v\d{8}\.safetensors"),
)


log = logging.getLogger(__name__)


class ResumeError(Exception):
    """The state dir cannot be resumed from: another job's, damaged, or not a trainer's."""


def claim(state_dir: Path, spec: dict) -> tuple[int, IO]:
    """How many trainer processes started on `state_dir` before this one (0: a new state dir,
    now marked as this job's), and the lock that keeps a second trainer off it while this one
    lives (keep it open). Refused: another job's state (`state_mismatch`), a trainer's names without
    the mark (not ours to touch), or a trainer still running on it. What a killed process was
    writing when it died is removed. The mark then holds `spec`: raised steps, a new export
    setting, other placements."""
    mark = state_dir / "job.json"
    if not mark.exists():
        if ours := [n for n in OWNED if (state_dir / n).exists()]:
            raise ResumeError(
                f"--state-dir {state_dir} holds '{ours[0]}' but no job.json: not a trainer's state; "
                f"give a new or empty folder"
            )
        state_dir.mkdir(parents=True, exist_ok=True)
        held = _hold(state_dir)
        _mark(mark, spec)
        _count(state_dir, 1)
        return 0, held
    try:
        saved = json.loads(mark.read_text())
    except (OSError, ValueError) as e:
        raise ResumeError(f"{mark}: unreadable ({e})") from None
    if (why := state_mismatch(saved, spec)) is not None:
        raise ResumeError(
            f"--state-dir {state_dir} holds the state of another job ({why}); give a new folder, or the job it "
            f"was made with (its steps may be raised)"
        )
    held = _hold(state_dir)
    _sweep(state_dir)
    if saved != spec:
        _mark(mark, spec)
    try:
        before = int((state_dir / "starts").read_text())
    except (OSError, ValueError):
        before = 1  # killed between its mark and its count
    _count(state_dir, before + 1)
    return before, held


def take_planned(state_dir: Path) -> bool:
    """Whether this start was planned (`PLANNED_RESUME`); taken at once, so that a trainer that
    dies after it is started again as a restart."""
    try:
        (state_dir / PLANNED_RESUME).unlink()
    except FileNotFoundError:
        return False
    return True


def _mark(mark: Path, spec: dict) -> None:
    with atomic_path(mark) as tmp:
        tmp.write_text(json.dumps(spec, indent=1))


def _hold(state_dir: Path) -> IO:
    """An exclusive lock on the state dir for this process's life (the kernel lets go when it dies)."""
    f = open(state_dir / ".trainer.lock", "w")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise ResumeError(f"--state-dir {state_dir}: another trainer is running on it") from None
    return f


def _count(state_dir: Path, starts: int) -> None:
    with atomic_path(state_dir / "starts") as tmp:
        tmp.write_text(f"{starts}\n")


def _sweep(state_dir: Path) -> None:
    """Remove the temporary folders of writes a kill cut short: only `atomic_path`'s, beside our
    own file names (a whole checkpoint each: repeated kills would fill the volume)."""
    for where, names in _TEMPORARY:
        folder = state_dir / where
        pattern = re.compile(rf"\.({names})\.[a-z0-9_]{{8}}")
        for p in folder.iterdir() if folder.is_dir() else []:
            if p.is_dir() and not p.is_symlink() and pattern.fullmatch(p.name):
                shutil.rmtree(p)


class Checkpoints:
    """The trainer's fp32 weights and optimizer state after a step, one safetensors file each;
    a new one counts only once it is whole, and the newest `keep` are kept."""

    def __init__(self, folder: Path, keep: int = 1):
        self.folder, self.keep = folder, keep

    def _path(self, version: int) -> Path:
        return self.folder / f"v{version:08d}.safetensors"

    def _versions(self) -> list[int]:
        names = [p.name for p in self.folder.glob("v*.safetensors")] if self.folder.is_dir() else []
        return sorted(int(n[1:9]) for n in names if len(n) == 21 and n[1:9].isdigit())

    def newest(self) -> int | None:
        return max(self._versions(), default=None)

    def prepare(self, version: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> Callable[[], None]:
        """A copy of the weights and optimizer state on the host, now (the next step changes
        them); the returned call writes it, and can run in another thread while training goes on."""
        tensors = {f"model.{n}": p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}
        osd = opt.state_dict()
        for i, st in osd["state"].items():
            for k, t in st.items():
                tensors[f"opt.{i}.{k}"] = t.detach().to("cpu", copy=True) if torch.is_tensor(t) else torch.tensor(t)
        meta = {"version": str(version), "param_groups": json.dumps(osd["param_groups"])}

        def write() -> None:
            with atomic_path(self._path(version)) as tmp:
                save_file(tensors, str(tmp), metadata=meta)
            for old in self._versions()[: -self.keep]:
                self._path(old).unlink(missing_ok=True)

        return write

    def load(self, version: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        """Put checkpoint `version` into `model` and `opt`."""
        path = self._path(version)
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                params = dict(model.named_parameters())
                keys = set(f.keys())
                if keys >= {f"model.{n}" for n in params} and int(meta.get("version", -1)) == version:
                    with torch.no_grad():
                        for n, p in params.items():
                            p.copy_(f.get_tensor(f"model.{n}"))
                    state: dict[int, dict] = {}
                    for k in keys - {f"model.{n}" for n in params}:
                        _, i, name = k.split(".", 2)
                        state.setdefault(int(i), {})[name] = f.get_tensor(k)
                    opt.load_state_dict({"state": state, "param_groups": json.loads(meta["param_groups"])})
                    return
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            raise ResumeError(f"{path}: cannot be resumed from ({e})") from None
        raise ResumeError(f"{path}: not this model's checkpoint v{version}")

    def save_ref(self, model: torch.nn.Module) -> None:
        with atomic_path(self.folder / "ref.safetensors") as tmp:
            save_file({n: p.detach().contiguous() for n, p in model.named_parameters()}, str(tmp))

    def load_ref(self, model: torch.nn.Module) -> None:
        path = self.folder / "ref.safetensors"
        try:
            with safe_open(str(path), framework="pt") as f, torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(f.get_tensor(n))
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            raise ResumeError(f"{path}: the reference policy cannot be read ({e})") from None


class ShardedCheckpoints:
    """A sharded trainer's checkpoints, in each node's own state dir (its own volume):

        STATE/trainer/v00000007/rank-00002.safetensors   a rank's shards of the fp32 weights and AdamW
                                                         state, as that rank holds them
        STATE/trainer/v00000007/node.json                written once every rank of every node has
                                                         written its file: the node's part is whole
        STATE/trainer/ref/                               the frozen reference policy (a KL term), alike

    A rank reads back exactly the file it wrote: the nodes, ranks and sharding a job's state was
    made with never change (statedir.BELONGS). A restart goes on from the newest version that is
    whole on every node, and says so when a node lacks a newer one (it died while writing). Old
    versions go only once a newer one is whole on every node, so a node that dies while writing
    always leaves one the others hold too. Every method is collective."""

    def __init__(self, folder: Path, rank: int, world: int, node: int, first: bool, keep: int = 1):
        """`first`: this rank writes its node's node.json and prunes its node's folder."""
        self.folder, self.rank, self.world, self.node, self.first, self.keep = folder, rank, world, node, first, keep

    def _path(self, version: int) -> Path:
        return self.folder / f"v{version:08d}"

    def _file(self, folder: Path) -> Path:
        return folder / f"rank-{self.rank:05d}.safetensors"

    def _whole(self) -> set[int]:
        """The versions whole in this node's folder, written by this node (not another's volume)."""
        found = set()
        for p in self.folder.glob("v*") if self.folder.is_dir() else []:
            if not re.fullmatch(r"v\d{8}", p.name):
                continue
            if (p / "row.json").is_file():  # torch.distributed.checkpoint's layout, before nodes
                raise ResumeError(
                    f"{p}: a checkpoint of an earlier SparrowRL (torch.distributed.checkpoint); resume it with that "
                    f"release, or start the job on a new state dir"
                )
            try:
                row = json.loads((p / "node.json").read_text())
            except FileNotFoundError:
                continue
            except (OSError, ValueError) as e:
                raise ResumeError(f"{p / 'node.json'}: unreadable ({e})") from None
            if not isinstance(row, dict) or (row.get("node"), row.get("world")) != (self.node, self.world):
                raise ResumeError(
                    f"{p}: written by node {row.get('node') if isinstance(row, dict) else '?'} of a trainer of "
                    f"{row.get('world') if isinstance(row, dict) else '?'} ranks, not by node {self.node} of "
                    f"{self.world}: each node's pod must mount its own volume"
                )
            found.add(int(p.name[1:]))
        return found

    def newest(self) -> int | None:
        """The newest version whole on this node: once `agree` has run, on every node."""
        return max(self._whole(), default=None)

    def agree(self, fresh: bool) -> int | None:
        """The newest version whole on every node (collective); `fresh`: node 0's state is new,
        so no node may hold any. A newer one on some node (another died while writing it) is
        removed there, saying so, and is written again. A node that lacks what the others hold
        beyond v0 (its volume lost, or another run's) is refused by name: nothing is removed."""
        import torch.distributed as dist

        mine = self._whole()
        every: list = [None] * self.world
        dist.all_gather_object(every, (self.node, sorted(mine)))
        held = {node: set(v) for node, v in every}
        if fresh and (stale := [n for n, v in sorted(held.items()) if v]):
            raise ResumeError(
                f"node {stale[0]}'s state dir holds checkpoints (up to v{max(held[stale[0]])}) while node 0's is new: "
                f"it is another run's; give node {stale[0]} an empty volume"
            )
        newest = max(set.intersection(*held.values()), default=None)
        if newest is None and (beyond := [n for n, v in sorted(held.items()) if v - {0}]):
            lacking = [n for n, v in sorted(held.items()) if not v & held[beyond[0]]]
            raise ResumeError(
                f"node {lacking[0]} holds none of the checkpoints node {beyond[0]} holds (up to "
                f"v{max(held[beyond[0]])}): its volume was lost or replaced; restore it, or start the job afresh"
            )
        if self.rank == 0:
            for node, versions in sorted(held.items()):
                if ahead := [v for v in versions if newest is None or v > newest]:
                    log.warning(
                        f"trainer: v{max(ahead)} is whole on node {node} but not on every node (one stopped while "
                        f"writing it); resuming from {'the start' if newest is None else f'v{newest}'}, the newest "
                        f"whole on all of them"
                    )
        dist.barrier()  # every node has read its folder
        if self.first:
            for v in mine:
                if newest is None or v > newest:
                    shutil.rmtree(self._path(v))
        return newest

    def clear_partial(self) -> None:
        """What a killed trainer was writing (this node's first rank, before any rank writes again)."""
        for p in self.folder.glob(".*.partial") if self.folder.is_dir() else []:
            shutil.rmtree(p)

    def _write(self, tensors: dict[str, torch.Tensor], meta: dict[str, str], out: Path) -> None:
        """Every rank writes its file into a partial folder; once all have, each node's first rank
        seals its node's folder (node.json) and renames it to `out`; once all nodes have, it prunes."""
        import torch.distributed as dist

        tmp = self.folder / f".{out.name}.partial"
        if self.first:
            tmp.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        save_file(tensors, str(self._file(tmp)), metadata={**meta, "rank": str(self.rank)})
        dist.barrier()
        if self.first:
            (tmp / "node.json").write_text(
                json.dumps({"node": self.node, "world": self.world, "version": meta["version"]})
            )
            if out.exists():  # a version another node never sealed, trained again since
                shutil.rmtree(out)
            os.replace(tmp, out)
        dist.barrier()

    def save(self, version: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        tensors = {f"model.{n}": _local(p) for n, p in model.named_parameters()}
        osd = opt.state_dict()
        for i, st in osd["state"].items():
            for k, t in st.items():
                tensors[f"opt.{i}.{k}"] = _local(t) if torch.is_tensor(t) else torch.tensor(t)
        self._write(
            tensors, {"version": str(version), "param_groups": json.dumps(osd["param_groups"])}, self._path(version)
        )
        if self.first:  # only those before it: this one, and the `keep` - 1 before, stay
            for old in sorted(v for v in self._whole() if v <= version)[: -self.keep]:
                shutil.rmtree(self._path(old))

    def load(self, version: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        """Checkpoint `version` into `model` and `opt`: each rank its own file."""
        from torch.distributed.tensor import DTensor

        path = self._file(self._path(version))
        params = [p for g in opt.param_groups for p in g["params"]]
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                if (meta.get("version"), meta.get("rank")) != (str(version), str(self.rank)):
                    raise ResumeError(f"{path}: not rank {self.rank}'s checkpoint v{version}")
                _fill(model, f)
                state: dict[int, dict] = {}
                for k in set(f.keys()) - {f"model.{n}" for n, _ in model.named_parameters()}:
                    _, i, name = k.split(".", 2)
                    t, p = f.get_tensor(k), params[int(i)]
                    if isinstance(p, DTensor) and t.dim():
                        t = DTensor.from_local(
                            t.to(p.device),
                            p.device_mesh,
                            p.placements,
                            run_check=False,
                            shape=p.shape,
                            stride=p.stride(),
                        )
                    state.setdefault(int(i), {})[name] = t
                opt.load_state_dict({"state": state, "param_groups": json.loads(meta["param_groups"])})
        except (OSError, ValueError, KeyError, IndexError, RuntimeError) as e:
            raise ResumeError(f"{path}: cannot be resumed from ({e})") from None

    def save_ref(self, model: torch.nn.Module) -> None:
        out = self.folder / "ref"
        self._write({f"model.{n}": _local(p) for n, p in model.named_parameters()}, {"version": "ref"}, out)

    def load_ref(self, model: torch.nn.Module) -> None:
        path = self._file(self.folder / "ref")
        try:
            with safe_open(str(path), framework="pt") as f:
                _fill(model, f)
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            raise ResumeError(f"{path}: the reference policy cannot be read ({e})") from None


def _local(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `t` (a DTensor's local shard), on the host."""
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    return local.detach().to("cpu", copy=True).contiguous()


def _fill(model: torch.nn.Module, f) -> None:
    """Each parameter's local shard from `f`'s `model.NAME`, shape checked."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for n, p in model.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            t = f.get_tensor(f"model.{n}")
            if t.shape != local.shape:
                raise ValueError(f"'{n}' is {list(t.shape)} there, {list(local.shape)} here")
            local.copy_(t)
