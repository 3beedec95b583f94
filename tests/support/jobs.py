"""The tiny job, as tests write it: a SparrowRLJob of a Qwen3 made from config (hidden 32, one
layer, so that a run trains in seconds on a CPU) on the built-in add task. A test names only what
it is about: `job(steps=2, grpo=...)`, `job(model=tiny(warmupSteps=60))`."""

from __future__ import annotations

import copy

TINY = {"hidden": 32, "layers": 1, "heads": 2}
GRPO = {"groupSize": 4, "promptsPerStep": 4, "maxNewTokens": 3}  # a step of four groups of four short samples
# a worker in each of two regions: a's behind its relay, b's straight from the trainer
TWO_REGIONS = {"regions": [{"name": "a", "workers": 1}, {"name": "b", "workers": 1, "relay": False}]}


def tiny(**fields) -> dict:
    """The `model` section: the tiny model with `fields` (as a job file names them) added or replaced."""
    return {"tiny": {**TINY, **fields}}


def job(name: str = "t", **spec) -> dict:
    """A job document of the tiny model and the add task, `spec`'s fields replacing the spec's; a
    copy of its own each call, for the test to edit."""
    return copy.deepcopy(
        {
            "apiVersion": "sparrowrl.dev/v1alpha1",
            "kind": "SparrowRLJob",
            "metadata": {"name": name},
            "spec": {"model": tiny(), "task": {"builtin": "add"}, **spec},
        }
    )
