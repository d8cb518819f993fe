"""Receivers for plain torch modules (``load_state_dict``) and state dicts."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from dcr.receivers.placement import Receiver

__all__ = ["ModuleAdapter", "StateDictAdapter", "module_receiver", "state_dict_receiver", "module_storage"]


def module_storage(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (persistent or not) by qualified name, tied ones once."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False)):
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        out[name] = t.detach()
    return out


def owning_module(module: torch.nn.Module, key: str) -> str:
    """The longest module path that prefixes ``key`` ('' for the root)."""
    parts = key.split(".")
    names = dict(module.named_modules())
    for k in range(len(parts) - 1, 0, -1):
        p = ".".join(parts[:k])
        if p in names:
            return p
    return ""


def module_edges(module: torch.nn.Module, names: list[str], rename=lambda k: k) -> dict[str, set[str]]:
    """Canonical name -> the direct parameters and buffers of the module that owns it."""
    mods = dict(module.named_modules())
    out: dict[str, set[str]] = {}
    for n in names:
        m = owning_module(module, rename(n))
        sub = mods[m]
        prefix = m + "." if m else ""
        out[n] = {prefix + k for k, v in list(sub.named_parameters(recurse=False)) + list(sub.named_buffers(recurse=False)) if v is not None}
    return out


class ModuleAdapter:
    """``nn.Module.load_state_dict(strict=False)`` as the loader: module hooks
    (``_load_from_state_dict``, state-dict pre-hooks) run as in a dense refit,
    so quantizing or repacking modules are handled by their own code."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def storage(self) -> dict[str, torch.Tensor]:
        return module_storage(self.module)

    @torch.no_grad()
    def load(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.module.load_state_dict(dict(items), strict=False)

    def restore(self, base: Mapping[str, torch.Tensor]) -> None:
        self.load(base.items())

    def edges(self, names: list[str]) -> dict[str, set[str]]:
        return module_edges(self.module, names)

    def hidden(self) -> set[str]:
        return set()


class StateDictAdapter:
    """A plain name -> tensor mapping that is its own storage (identity loader)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def storage(self) -> dict[str, torch.Tensor]:
        return dict(self.tensors)

    @torch.no_grad()
    def load(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        for k, v in items:
            self.tensors[k].copy_(v)

    def restore(self, base: Mapping[str, torch.Tensor]) -> None:
        self.load(base.items())

    def edges(self, names: list[str]) -> dict[str, set[str]]:
        return {n: {n} for n in names}

    def hidden(self) -> set[str]:
        return set()


def _snapshot(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in sd.items()}


def module_receiver(module: torch.nn.Module, base: Mapping[str, torch.Tensor] | None = None, **kw) -> Receiver:
    """A :class:`Receiver` for ``module``. ``base`` is the canonical
    checkpoint it holds now; by default its own ``state_dict()`` (right for
    modules whose state dict *is* the checkpoint; pass the checkpoint for
    modules that transform on load, e.g. quantize)."""
    base = _snapshot(module.state_dict() if base is None else base)
    return Receiver(ModuleAdapter(module), base, **kw)


def state_dict_receiver(tensors: Mapping[str, torch.Tensor], **kw) -> Receiver:
    return Receiver(StateDictAdapter(tensors), _snapshot(tensors), **kw)
