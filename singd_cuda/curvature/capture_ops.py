"""The capture's points in a model's graph, as opaque custom ops (so ``torch.compile``
traces a preconditioned model into one graph per forward and backward).

The capture's bookkeeping is Python state (what each backward pass staged, what it
committed, the loss terms of each layer call). Dynamo cannot trace that, so the hooks put
four ops into the graph, each running the capture's Python at run time, compiled or not:

* ``singd_capture::begin(counter, batch)``, at each call of the hooked model: notes the
  batch of its input. It declares ``counter`` mutated (its value is never read, so it
  is left as it is) and every later op of the forward reads it, so they stay after it.
* ``singd_capture::tell(counter, batch)``, at each call of a module that knows its batch
  (an RNN, attention: :data:`~.layers.BATCH_TELLING`): notes the model's batch.
* ``singd_capture::mark(counter, output) -> token``, at each call of a layer: whether the
  call takes statistics, its id and its w, as an int64 tensor (3,) on the CPU.
* ``singd_capture::stage(grad_output, layer_input, token) -> 0``, in the backward of the
  layer output (:class:`Stage`): computes and stages the call's statistics. It returns
  the gradient of the capture's *probe*, a scalar leaf tensor that every layer's
  :class:`Stage` takes as an input, which keeps the op in the backward graph.

A capture is found by an integer ``handle`` (ops take no Python objects); a collected
capture's ops do nothing. Eager code calls the same functions directly (:func:`_in_graph`):
an op's dispatch costs ~50 µs a call on a CPU, the direct call ~10; an eager layer call
asks the capture itself and keeps its token's fields in its gradient hook (no tensor).
"""

from __future__ import annotations

import itertools
import weakref

import torch
from torch import Tensor

TOKEN_FIELDS = 3  # (takes statistics, call, w)
_captures: dict[int, weakref.ref] = {}
_handles = itertools.count()


def register(capture) -> int:
    """A new handle by which the ops find ``capture`` (held weakly)."""
    handle = next(_handles)
    _captures[handle] = weakref.ref(capture, lambda _, handle=handle: _captures.pop(handle, None))
    return handle


def _lookup(handle: int):
    ref = _captures.get(handle)
    return None if ref is None else ref()


def new_probe() -> Tensor:
    """The probe of a capture: a float32 scalar leaf on the CPU whose gradient is zero."""
    return torch.zeros((), dtype=torch.float32, device="cpu", requires_grad=True)


def _in_graph(op, impl):
    """``op`` when Dynamo traces the caller, else ``impl`` (the op's own function)."""

    def call(*args):
        return op(*args) if torch.compiler.is_compiling() else impl(*args)

    return call


def _begin(counter: Tensor, handle: int, batch: int, grad_enabled: bool) -> None:
    capture = _lookup(handle)
    if capture is not None and grad_enabled:
        capture._on_model_forward(int(batch))


def _tell(counter: Tensor, handle: int, batch: int, grad_enabled: bool) -> None:
    capture = _lookup(handle)
    if capture is not None and grad_enabled:
        capture._on_call_batch(int(batch))


def _mark(counter: Tensor, output: Tensor, handle: int, index: int) -> Tensor:
    capture = _lookup(handle)
    fields = None if capture is None else capture._on_forward(index, output)
    token = (0, 0, 0) if fields is None else (1, *fields)
    return torch.tensor(token, dtype=torch.int64, device="cpu")


def _stage(
    grad_output: Tensor, layer_input: Tensor, token: Tensor, handle: int, index: int
) -> Tensor:
    takes, call, weight = token.tolist()
    capture = _lookup(handle) if takes else None
    if capture is not None:
        capture._on_grad(index, layer_input, grad_output, call, float(weight))
    return torch.zeros((), dtype=torch.float32, device="cpu")


# ``begin`` and ``tell`` declare ``counter`` mutated (it is not) so that the ``mark`` ops
# after them, which read the counter, stay after them in a compiled graph
_begin_op = torch.library.custom_op("singd_capture::begin", _begin, mutates_args=("counter",))
_tell_op = torch.library.custom_op("singd_capture::tell", _tell, mutates_args=("counter",))
_mark_op = torch.library.custom_op("singd_capture::mark", _mark, mutates_args=())
_stage_op = torch.library.custom_op("singd_capture::stage", _stage, mutates_args=())
begin = _in_graph(_begin_op, _begin)
begin_eager = _begin  # for a caller that knows it is not traced
tell = _in_graph(_tell_op, _tell)
stage = _in_graph(_stage_op, _stage)
mark = _mark_op  # traced code only: eager layer calls ask the capture, no tensor made


@_mark_op.register_fake
def _mark_fake(counter: Tensor, output: Tensor, handle: int, index: int) -> Tensor:
    return torch.empty(TOKEN_FIELDS, dtype=torch.int64, device="cpu")


@_stage_op.register_fake
def _stage_fake(grad_output, layer_input, token, handle, index) -> Tensor:
    return torch.empty((), dtype=torch.float32, device="cpu")


class Stage(torch.autograd.Function):
    """The traced path: a copy of a layer output whose backward stages the call's
    statistics and passes the output gradient on unchanged. A copy, not the output
    itself: a custom Function's output that is an input may not be modified in place
    (``ReLU(inplace=True)``).

    ``token``: the ``mark`` op's tensor, whose backward runs the ``stage`` op (and returns
    the probe's gradient).
    """

    # forward(ctx, ...) rather than a separate setup_context: with one, every apply binds
    # its arguments through inspect.signature (~20 µs a layer call)
    @staticmethod
    def forward(ctx, output, token, layer_input, probe, handle: int, index: int) -> Tensor:
        ctx.save_for_backward(layer_input, token)
        ctx.handle, ctx.index = handle, index
        return output.clone()

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        layer_input, token = ctx.saved_tensors
        probe_grad = stage(grad_output, layer_input, token, ctx.handle, ctx.index)
        return grad_output, None, None, probe_grad, None, None
