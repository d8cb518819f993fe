"""Trainer side: where each rank's local tensors land in the checkpoint.

See :mod:`dcr.trainer.layouts`.
"""

from __future__ import annotations

from dcr.trainer import layouts
from dcr.trainer.layouts import (
    CanonicalTensor,
    LocalPlacement,
    Piece,
    Placements,
    column_parallel,
    dtensor_placement,
    fused_qkv,
    gated_fc1,
    identity,
    module_placements,
    project,
    replicated,
    row_parallel,
    stacked_experts,
    transformers_placements,
    vocab_padded_size,
    vocab_parallel,
)
from dcr.trainer.publisher import PublishReport, ShardedPublisher, cast_export

__all__ = [*layouts.__all__, "PublishReport", "ShardedPublisher", "cast_export"]
