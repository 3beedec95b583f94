"""What a trainer needs to start again where it stopped, in its state dir (a volume in a pod):

    STATE/job.json                    the job this state belongs to: another job is refused
    STATE/trainer/v00000007.safetensors   fp32 weights and optimizer state after step 7 (the newest `keep`)
    STATE/trainer/ref.safetensors     the frozen reference policy, when the job has a KL term
    STATE/trainer/v00000007/          the same, sharded: one folder that every rank of a sharded
                                      trainer writes its own files into (ShardedCheckpoints)
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
    """A sharded trainer's checkpoints (torch.distributed.checkpoint): STATE/trainer/v00000007/
    is one folder, into which every rank writes its shards of the fp32 weights and of the
    optimizer state. Rank 0 writes row.json, then renames the folder into place: a folder with
    row.json is whole. The newest `keep` are kept. STATE/trainer/ref/ holds the frozen reference
    policy, when the job has a KL term. Every method is collective."""

    def __init__(self, folder: Path, rank: int, keep: int = 1):
        self.folder, self.rank, self.keep = folder, rank, keep

    def _path(self, version: int) -> Path:
        return self.folder / f"v{version:08d}"

    def newest(self) -> int | None:
        found = (
            [
                int(p.name[1:])
                for p in self.folder.glob("v*")
                if re.fullmatch(r"v\d{8}", p.name) and (p / "row.json").is_file()
            ]
            if self.folder.is_dir()
            else []
        )
        return max(found, default=None)

    def clear_partial(self) -> None:
        """What a killed trainer was writing (rank 0, before any rank writes again)."""
        for p in self.folder.glob(".*.partial") if self.folder.is_dir() else []:
            shutil.rmtree(p)

    @staticmethod
    def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(model, opt)
        return {"model": msd, "optim": osd}

    def _write(self, state: dict, out: Path, seal: Callable[[Path], object] = lambda tmp: None) -> None:
        """Every rank writes its part of `state` into a partial folder; then rank 0 seals it
        (`seal`, with the folder still partial) and renames it to `out`, for all to see."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        tmp = self.folder / f".{out.name}.partial"
        dcp.save(state, checkpoint_id=tmp)
        dist.barrier()
        if self.rank == 0:
            seal(tmp)
            os.replace(tmp, out)
        dist.barrier()

    def save(self, version: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        self._write(
            self._state(model, opt),
            self._path(version),
            lambda tmp: (tmp / "row.json").write_text(json.dumps({"version": version})),
        )
        if self.rank == 0:
            whole = sorted(int(p.name[1:]) for p in self.folder.glob("v*") if re.fullmatch(r"v\d{8}", p.name))
            for old in whole[: -self.keep]:
                shutil.rmtree(self._path(old))

    def load(self, version: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        """Checkpoint `version` into `model` and `opt`."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        path = self._path(version)
        try:
            state = self._state(model, opt)
            dcp.load(state, checkpoint_id=path)
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
            saved = json.loads((path / "row.json").read_text())
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            raise ResumeError(f"{path}: cannot be resumed from ({e})") from None
        if saved.get("version") != version:
            raise ResumeError(f"{path}: not this model's checkpoint v{version}")

    def save_ref(self, model: torch.nn.Module) -> None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        self._write(get_model_state_dict(model), self.folder / "ref")

    def load_ref(self, model: torch.nn.Module) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

        try:
            state = get_model_state_dict(model)
            dcp.load(state, checkpoint_id=self.folder / "ref")
            set_model_state_dict(model, state)
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            raise ResumeError(f"{self.folder / 'ref'}: the reference policy cannot be read ({e})") from None
