"""What a trainer needs to start again where it stopped, in its state dir (a volume in a pod):

    STATE/job.json                    the job this state belongs to: another job is refused
    STATE/trainer/v00000007.safetensors   fp32 weights and optimizer state after step 7 (the newest only)
    STATE/trainer/ref.safetensors     the frozen reference policy, when the job has a KL term
    STATE/journal.jsonl               admitted results and the coordinator's state since then
    STATE/store/                      the published versions (store.py)

A step writes its checkpoint before it publishes the version, so the store is never ahead of the
checkpoint: a trainer killed in between publishes the same bytes again from the checkpoint. Every
admission is in the journal before the worker hears it was admitted. This survives the process
dying at any moment (kill -9, OOM, a pod evicted), not the machine losing power: nothing is
fsynced.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sparrowrl.checkpoint_io import atomic_path

# what a trainer writes in its state dir; a folder holding any of them without job.json is not ours
OWNED = ("job.json", "trainer", "journal.jsonl", "store", "model", "metrics.jsonl", "summary.json", "final")


class ResumeError(Exception):
    """The state dir cannot be resumed from: another job's, damaged, or not a trainer's."""


def claim(state_dir: Path, spec: dict) -> bool:
    """Whether `state_dir` holds this job's state (True: resume); a new state dir is marked as this
    job's. Refused: another job's state, or a trainer's names without the mark (not ours to touch)."""
    mark = state_dir / "job.json"
    if not mark.exists():
        if ours := [n for n in OWNED if (state_dir / n).exists()]:
            raise ResumeError(f"--state-dir {state_dir} holds '{ours[0]}' but no job.json: not a trainer's state; "
                              f"give a new or empty folder")
        state_dir.mkdir(parents=True, exist_ok=True)
        with atomic_path(mark) as tmp:
            tmp.write_text(json.dumps(spec, indent=1))
        return False
    try:
        saved = json.loads(mark.read_text())
    except (OSError, ValueError) as e:
        raise ResumeError(f"{mark}: unreadable ({e})") from None
    if saved != spec:
        field = next((k for k in sorted(set(saved) | set(spec)) if saved.get(k) != spec.get(k)), "?") \
            if isinstance(saved, dict) else "?"
        raise ResumeError(f"--state-dir {state_dir} holds the state of another job (spec.{field} differs); "
                          f"give a new folder, or the job it was made with")
    return True


class Checkpoints:
    """The trainer's fp32 weights and optimizer state after a step, one safetensors file; a new
    one replaces the previous only once it is whole."""

    def __init__(self, folder: Path):
        self.folder = folder

    def _path(self, version: int) -> Path:
        return self.folder / f"v{version:08d}.safetensors"

    def newest(self) -> int | None:
        names = [p.name for p in self.folder.glob("v*.safetensors")] if self.folder.is_dir() else []
        versions = [int(n[1:9]) for n in names if len(n) == 21 and n[1:9].isdigit()]
        return max(versions, default=None)

    def save(self, version: int, model: torch.nn.Module, opt: torch.optim.Optimizer, row: dict | None) -> None:
        """`row`: the step's metrics so far (a restart completes them when it publishes)."""
        tensors = {f"model.{n}": p.detach().contiguous() for n, p in model.named_parameters()}
        osd = opt.state_dict()
        for i, st in osd["state"].items():
            for k, t in st.items():
                tensors[f"opt.{i}.{k}"] = t.detach().contiguous() if torch.is_tensor(t) else torch.tensor(t)
        meta = {"version": str(version), "param_groups": json.dumps(osd["param_groups"]), "row": json.dumps(row)}
        with atomic_path(self._path(version)) as tmp:
            save_file(tensors, str(tmp), metadata=meta)
        for p in self.folder.glob("v*.safetensors"):
            if p.name != self._path(version).name:
                p.unlink()

    def load(self, version: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict | None:
        """Put checkpoint `version` into `model` and `opt`; returns its metrics row."""
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
                    return json.loads(meta["row"])
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


Results = dict[int, dict[int, dict]]  # batch → prompt group → admitted result


class Journal:
    """Append-only JSON lines: each holds the admitted results it adds and the state after it.
    Written (to the OS) before the request that caused it is answered."""

    def __init__(self, path: Path):
        self.path = path
        self._f = open(path, "a")

    @staticmethod
    def read(path: Path) -> tuple[dict | None, Results]:
        """The last state and every admitted result; a last line cut short by a crash is ignored."""
        if not path.exists():
            return None, {}
        state, results = None, {}
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            try:
                entry = json.loads(line)
                for b, groups in entry.get("results", {}).items():
                    results.setdefault(int(b), {}).update({int(g): r for g, r in groups.items()})
                state = entry["state"]
            except (ValueError, KeyError, AttributeError, TypeError) as e:
                if i == len(lines) - 1:
                    break  # the write the crash interrupted: its request was never answered
                raise ResumeError(f"{path}: line {i + 1} is damaged ({e})") from None
        return state, results

    def append(self, state: dict, results: Results | None = None) -> None:
        self._f.write(json.dumps({"results": results or {}, "state": state}) + "\n")
        self._f.flush()

    def compact(self, state: dict, results: Results) -> None:
        """Rewrite with only `results` (those of batches not yet trained): the file stays small."""
        with atomic_path(self.path) as tmp:
            tmp.write_text(json.dumps({"results": results, "state": state}) + "\n")
        self._f.close()
        self._f = open(self.path, "a")

    def close(self) -> None:
        self._f.close()
