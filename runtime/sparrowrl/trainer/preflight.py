"""A job checked as its trainer will load it, before anything runs: `sparrowrl check` (a trainer
pod's init container), `sparrowrl run` before it starts a process, and the trainer at its start.
Each problem is a JobError naming its field. The runtime's modules are imported in the checks
that need them: `sparrowrl run` checks its run dir first, without waiting seconds for torch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from sparrowrl.spec.job import JobError, JobSpec
from sparrowrl.spec.statedir import state_mismatch

if TYPE_CHECKING:
    from sparrowrl.trainer.tasks import Task


def check(spec: JobSpec, job: str, state_dir: Path | None = None, ask_hub: bool = True) -> Task | None:
    """The job's model, task, reward and trainer's device; returns the task (None until the
    hub's download, see `_task`)."""
    task = _task(spec, job, state_dir, ask_hub)
    _device(spec, job)
    return task


def _task(spec: JobSpec, job: str, state_dir: Path | None, ask_hub: bool) -> Task | None:
    """The job's model folder, task and reward, loaded and checked as its trainer will load
    them. What the job takes from the Hugging Face Hub is checked there (it exists, can be read,
    holds what is needed: a request each) unless `state_dir` holds its download, or `ask_hub` is
    False. Until the download, which the trainer makes into its state dir once it has claimed
    it, the data is read and the reward loaded without the model's tokenizer, and None is
    returned for the task."""
    from sparrowrl.trainer import hub, models, tasks

    try:
        if ask_hub:
            hub.check(spec, state_dir)
    except hub.HubError as e:
        raise JobError(f"{job}: spec.{e}") from None
    from_hub = hub.sources(spec)
    waits = from_hub and (state_dir is None or not all(hub.fetched(s, state_dir) for s in from_hub))
    field = "model.hub" if spec.model.hub else "model.path"
    spec = hub.localize(spec, state_dir) if from_hub and not waits and state_dir is not None else spec
    try:
        if spec.model.path:
            models.check(spec.model.path, spec.model.tokenizer, field)
    except ValueError as e:
        raise JobError(f"{job}: spec.{e}") from None
    if waits:
        try:
            tasks.check_unrendered(spec)
        except (ValueError, OSError) as e:
            raise JobError(f"{job}: spec.task: {e}") from None
        return None
    try:
        prompts = models.Prompts.for_job(spec, models.tokenizer(spec))
    except ValueError as e:
        raise JobError(f"{job}: spec.task.{e}") from None
    try:
        return tasks.for_job(spec, prompts)[0]
    except (ValueError, OSError) as e:
        raise JobError(f"{job}: spec.task: {e}") from None


def _device(spec: JobSpec, job: str) -> None:
    """The trainer's device, checked where the trainer will run: this machine cannot give it."""
    from sparrowrl.trainer.device import device

    try:
        device(spec.trainer.device, spec.trainer.ranks * spec.trainer.nodes)
    except ValueError as e:
        raise JobError(f"{job}: spec.{e}") from None


def state_is_this_jobs(spec: JobSpec, state_dir: Path | None) -> None:
    """A state dir of another job (a claim kept from an earlier job of this name) is refused as
    the trainer would refuse it, but here, before it starts, so the job fails saying why."""
    mark = state_dir / "job.json" if state_dir is not None else None
    if mark is None or not mark.is_file():
        return
    try:
        saved = json.loads(mark.read_text())
    except (OSError, ValueError) as e:
        raise JobError(f"{mark}: unreadable ({e})") from None
    if (why := state_mismatch(saved, spec.model_dump(mode="json"))) is not None:
        raise JobError(
            f"{state_dir} holds the state of another job ({why}): delete its volume claim to start afresh, or "
            "give the job it was made with (its steps may be raised)"
        )
