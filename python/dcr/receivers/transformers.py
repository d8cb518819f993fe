"""Receiver for Hugging Face transformers models.

The loader is transformers' own checkpoint conversion
(``convert_and_load_state_dict_in_model`` with the model's weight mapping:
renames, MoE expert fusion via MergeModulelist/Concatenate, ...), so a model
whose in-memory layout differs from the checkpoint (transformers 5 keeps MoE
experts fused) is placed by the same code that loads it. The canonical
checkpoint defaults to ``revert_weight_conversion(model, state_dict)``, which
gives checkpoint names bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from dcr.receivers.placement import Receiver
from dcr.receivers.torch_module import module_edges, module_storage

__all__ = ["TransformersAdapter", "canonical_state_dict", "transformers_receiver"]


def _mapping(model: Any) -> list[Any] | None:
    wm = getattr(model, "_weight_conversions", None)
    if wm is None:
        from transformers.conversion_mapping import get_model_conversion_mapping

        wm = get_model_conversion_mapping(model)
    return list(wm) if wm else None


def canonical_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The model's weights under checkpoint names (copies, CPU)."""
    from transformers.core_model_loading import revert_weight_conversion

    sd = revert_weight_conversion(model, dict(model.state_dict()))
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in sd.items()}


class TransformersAdapter:
    def __init__(self, model: Any) -> None:
        self.model = model
        self.weight_mapping = _mapping(model)

    def storage(self) -> dict[str, torch.Tensor]:
        return module_storage(self.model)

    @torch.no_grad()
    def load(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig

        cfg = LoadStateDictConfig(weight_mapping=self.weight_mapping)
        convert_and_load_state_dict_in_model(self.model, dict(items), cfg)

    def restore(self, base: Mapping[str, torch.Tensor]) -> None:
        self.load(base.items())

    def edges(self, names: list[str]) -> dict[str, set[str]]:
        return module_edges(self.model, names)

    def hidden(self) -> set[str]:
        return set()


def transformers_receiver(model: Any, base: Mapping[str, torch.Tensor] | None = None, **kw: Any) -> Receiver:
    """A :class:`Receiver` for a transformers ``PreTrainedModel``; ``base``
    defaults to the model's own weights under checkpoint names."""
    return Receiver(TransformersAdapter(model), canonical_state_dict(model) if base is None else base, **kw)
