"""The job's `export` section."""

from __future__ import annotations

from pydantic import Field

from sparrowrl.spec.section import Section, Text


class ExportSpec(Section):
    """What the trainer writes for its user besides its state (which `final/` ends)."""

    every: int = Field(
        0,
        ge=0,
        le=10_000_000,
        description=(
            "Every this many steps, the policy rollouts ran at that version as a Hugging Face folder (bf16, "
            "verified by its state hash), in path/step-NNNNNNNN; 0: none."
        ),
    )
    path: Text | None = Field(None, description="Where exports go; default: the state dir's exports/.")
    tensor_board: bool = Field(
        False, description="Each step's metrics as TensorBoard scalars in the state dir's tensorboard/."
    )
