"""What the trainer writes for its user besides its state: TensorBoard scalars per step, and
exports of the policy as a Hugging Face folder every `export.every` steps.

An export is the policy rollout workers ran at that version: the store's bf16 tensors, checked
against the version's state hash, with the model's config and tokenizer and a `sparrowrl.json`
naming the version and hash, so anyone can check it. It is written off the step's critical
path, in a thread, from a store object of its own (the trainer's keeps publishing meanwhile);
a failed export is said in the log and does not stop training. The store keeps the version
being exported until the export is done (`exporting`, retention.py)."""

from __future__ import annotations

import json
import logging
import shutil
import threading
from pathlib import Path

from safetensors.torch import save_file

from sparrowrl.spec.job import JobSpec
from sparrowrl.store.checkpoint_io import CheckpointError, atomic_path
from sparrowrl.store.store import Store, StoreError

log = logging.getLogger(__name__)

SCALARS = (  # metrics row key → TensorBoard tag
    ("reward_mean", "reward/mean"),
    ("reward_exact", "reward/exact"),
    ("loss", "train/loss"),
    ("kl", "train/kl"),
    ("grad_norm", "train/grad_norm"),
    ("lr", "train/lr"),
    ("entropy", "train/entropy"),
    ("clip_low", "train/clip_low"),
    ("clip_high", "train/clip_high"),
    ("clip_dual", "train/clip_dual"),
    ("is_weight_mean", "behaviour/weight_mean"),
    ("is_weight_min", "behaviour/weight_min"),
    ("is_weight_max", "behaviour/weight_max"),
    ("is_masked", "behaviour/masked"),
    ("is_ess", "behaviour/ess"),
    ("mismatch_mean", "behaviour/mismatch_mean"),
    ("mismatch_max", "behaviour/mismatch_max"),
    ("mismatch_kl", "behaviour/mismatch_kl"),
    ("zero_variance_groups", "rollout/zero_variance_groups"),
    ("refill_groups", "rollout/refill_groups"),
    ("truncated", "rollout/truncated"),
    ("completion_tokens_mean", "rollout/completion_tokens"),
    ("payload_bytes", "sync/payload_bytes"),
    ("changed_fraction", "sync/changed_fraction"),
    ("step_s", "time/step_s"),
    ("generate_s", "time/generate_s"),
    ("train_s", "time/train_s"),
    ("extract_s", "time/extract_s"),
    ("wait_s", "time/wait_s"),
)
EXPORT_FILES = frozenset({"model.safetensors", "sparrowrl.json"})  # besides the config and tokenizer files


class Outputs:
    def __init__(self, spec: JobSpec, state_dir: Path):
        e = spec.export
        self.state_dir, self.every = state_dir, e.every
        self.folder = Path(e.path) if e.path else state_dir / "exports"
        self.board = None
        if e.tensor_board:
            from torch.utils.tensorboard import SummaryWriter  # only where asked: it imports tensorboard

            self.board = SummaryWriter(str(state_dir / "tensorboard"))
        self._exporting: tuple[int, threading.Thread] | None = None  # the version being exported, and its thread

    def step(self, row: dict) -> None:
        """After version row["version"] is published."""
        v = row["version"]
        if self.board is not None:
            for key, tag in SCALARS:
                if isinstance(row.get(key), (int, float)):
                    self.board.add_scalar(tag, row[key], v)
            self.board.flush()
        if self.every and v % self.every == 0:
            self.wait()  # one export at a time: a slow disk holds the next step, not the memory of many
            self._exporting = v, threading.Thread(target=self._export, args=(v,), name=f"export-v{v}", daemon=True)
            self._exporting[1].start()

    def _export(self, version: int) -> None:
        out = self.folder / f"step-{version:08d}"
        try:
            export(self.state_dir, version, out)
            log.info(f"trainer: exported v{version} to {out}")
        except (OSError, StoreError, CheckpointError, ValueError) as e:
            log.error(f"trainer: export of v{version} to {out} failed: {e}")

    @property
    def exporting(self) -> int | None:
        """The version an export is being written of: the store must not prune it meanwhile."""
        return self._exporting[0] if self._exporting is not None and self._exporting[1].is_alive() else None

    def wait(self) -> None:
        if self._exporting is not None:
            self._exporting[1].join()
            self._exporting = None

    def close(self) -> None:
        self.wait()
        if self.board is not None:
            self.board.close()


def export(state_dir: Path, version: int, out: Path) -> None:
    """Version `version` of the store in `state_dir` as a Hugging Face folder at `out` (bf16,
    verified by its state hash on the way). An existing `out` is replaced only if it is an export
    of the same files (`atomic_path`)."""
    store = Store(state_dir / "store")
    state = store.materialize(version)  # every step hash-checked
    model = state_dir / "model"  # the config and tokenizer the trainer gives workers
    side = [f for f in sorted(model.iterdir()) if f.is_file()]
    with atomic_path(out, EXPORT_FILES | {f.name for f in side}) as tmp:
        save_file({n: t.contiguous() for n, t in state.items()}, str(tmp / "model.safetensors"))
        for f in side:
            shutil.copy2(f, tmp / f.name)
        config = tmp / "config.json"
        if config.exists():  # the tensors are bf16: say so to whoever loads them with dtype="auto"
            c = json.loads(config.read_text())
            c.update({k: "bfloat16" for k in ("dtype", "torch_dtype") if k in c} or {"dtype": "bfloat16"})
            config.write_text(json.dumps(c, indent=2))
        info = {"version": version, "state_hash": store.versions[version].state_hash}
        (tmp / "sparrowrl.json").write_text(json.dumps(info, indent=1) + "\n")
