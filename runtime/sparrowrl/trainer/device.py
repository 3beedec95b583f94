"""Where one of the trainer's ranks trains: apart from the learner, so that `sparrowrl check`
can refuse a device this machine lacks before a learner is built."""

from __future__ import annotations

import importlib.util

import torch

from sparrowrl.trainer import fsdp


def device(choice: str, world: int = 1) -> torch.device:
    """Where the trainer's rank trains, for `trainer.device` (auto, cpu or cuda); a choice this
    machine cannot meet is a ValueError naming the field, before anything is written. Sharded
    ranks take the GPUs whenever there are (fsdp.device)."""
    cuda = torch.cuda.is_available()
    if choice == "cuda" and not cuda:
        raise ValueError(f"trainer.device: cuda, but torch {torch.__version__} sees no CUDA device")
    if world > 1:
        if choice == "cpu" and cuda:
            raise ValueError(
                f"trainer.device: cpu with {world} ranks (trainer.nodes × ranks) on a machine with GPUs: sharded "
                f"ranks take a GPU each (train on the CPU with one rank)"
            )
        at = fsdp.device()
    else:
        at = torch.device("cuda", torch.cuda.current_device()) if choice != "cpu" and cuda else torch.device("cpu")
    if at.type == "cuda" and importlib.util.find_spec("cupy") is None:
        raise ValueError(
            f"trainer.device: {choice} trains on the GPU, whose policy is diffed there with CuPy, which is not "
            f"installed: install sparrowrl[gpu], or set trainer.device: cpu"
        )
    return at
