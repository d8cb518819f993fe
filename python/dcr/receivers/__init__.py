"""Receivers: apply dcr deltas to a serving runtime in place, with placement
learned from the runtime's own loader (see docs/receivers.md).

* :mod:`dcr.receivers.placement` - probing, index maps, :class:`Receiver`;
* :mod:`dcr.receivers.torch_module` - plain ``nn.Module``/state dicts;
* :mod:`dcr.receivers.transformers` - Hugging Face transformers models;
* :mod:`dcr.receivers.vllm` - a live vLLM engine.
"""

from dcr.receivers.placement import Adapter, Placement, Receiver, RunTable, TensorPlacement, learn_placement

__all__ = ["Adapter", "Placement", "Receiver", "RunTable", "TensorPlacement", "learn_placement"]
