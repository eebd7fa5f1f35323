"""Curvature capture: statistics that follow the gradients ``step()`` uses.

The contract (README, "What counts as curvature"): a backward pass's statistics of a
layer count exactly when that pass accumulates into the ``.grad`` of the layer's weight.

How:

* A forward hook on each module of a layer (with grad enabled and the weight trainable)
  asks the capture whether the call takes statistics on this step, and if so keeps the
  input for the backward: eager calls register a hook on the output's gradient
  (:func:`_stage`); traced calls ask through the ``mark`` op and wrap the
  output in :class:`capture_ops.Stage`.
* In the backward, the hook (or ``Stage``) computes the call's statistics (through the
  owner) and *stages* them for this backward pass (the ``stage`` op when traced).
* The weight's post-accumulate-grad hook *commits* what was staged: it runs once per
  backward pass, after every use of the weight in that pass (autograd sums the uses
  before it accumulates), so shared weights and modules called twice commit once.
* A callback at the end of the backward pass drops whatever was staged and not
  committed: ``torch.autograd.grad``, a frozen weight, ``backward(inputs=...)`` without
  the weight leave nothing behind. A pass in which the capture itself raises ends
  there the same way (its callback would never run).
* A gradient reset discards the statistics committed before it, as it discards the
  gradient: when a pass begins for a layer, its weight's ``.grad`` is None (``zero_grad``,
  a new step) or, in one process, not the tensor the last committed pass left, or that
  tensor modified in place since (``model.zero_grad(set_to_none=False)``,
  ``p.grad.zero_()``; its ``_version`` moved). Under ``torch.distributed`` collectives
  write into ``.grad`` after the hooks, so only None counts there. The owner calls
  :meth:`discard` on its own ``zero_grad`` (which may keep zero-filled grads).

Counting (so that any split of one batch gives that batch's statistics): samples are
counted where a layer sees them. Every call of a layer that a committed backward pass
reaches has a number of loss terms w (the samples of its output along the batch
dimension, or samples x positions); the input side is weighted by w, the output side is
kept as raw sums, and the owner divides by / multiplies with the total of w over the
committed calls (see :class:`Committed`): the statistics of one call on the joined
inputs. A call reached by several backward passes (``retain_graph=True``) counts its
samples and its input side once and its output side in every pass. Empty batches have
w = 0 and count for nothing.

The hooks read and write no capture state themselves: the ops of :mod:`.capture_ops` do,
at run time, so ``torch.compile`` traces a hooked model without a graph break, on steps
with and without statistics (eager calls the ops' functions directly).

Nothing runs under ``torch.func`` transforms, in ``no_grad``, or for frozen weights;
``module.training`` does not matter (models train with frozen BatchNorm or dropout).
Hooks hold the capture weakly and drop out of copies and pickles of the model, so
``copy.deepcopy(model)`` and ``torch.save(model)`` work and a collected optimizer leaves
no working hook behind.
"""

from __future__ import annotations

import itertools
import sys
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from . import capture_ops
from .layers import BATCH_TELLING, Layer, call_batch

Statistics = dict  # "in" / "out" -> statistic (a tensor or structured matrix, add_/mul_)


class CaptureOwner(Protocol):
    """What the capture asks of the optimizer that owns it."""

    def _before_forward(self) -> None:
        """Called at each grad-enabled forward of the model, before any layer's."""

    def _layer_call(self, layer: Layer, output: Tensor) -> int:
        """w of a grad-enabled call of ``layer``: the loss terms its output covers (it may
        read and update the capture's ``model_batch``), or -1 when the layer takes no
        statistics on the current step."""

    def _call_batch(self, batch: int) -> None:
        """A module that knows its batch (an RNN, attention) was called on ``batch``
        samples (it may read and update the capture's ``model_batch``)."""

    def _accumulate_statistics(
        self,
        layer: Layer,
        layer_input: Tensor,
        grad_output: Tensor,
        weight: float,
        into: Statistics,
        with_input: bool,
    ) -> bool:
        """Add one call's statistics to ``into``: the input side (unless ``with_input`` is
        False: the call's input side is in already) weighted by ``weight`` (w of the call),
        the output side as the raw gradient's. False when it added nothing (the call
        then does not count)."""

    def _merge_statistics(self, layer: Layer, into: Statistics, new: Statistics) -> None:
        """into += new: a later backward pass's committed statistics of ``layer`` added to
        the earlier passes' (:func:`merge_statistics`, after whatever the owner's
        statistics need first)."""


@dataclass
class Committed:
    """Statistics of one layer committed since the last step, and their total w."""

    statistics: Statistics = field(default_factory=dict)
    terms: float = 0.0
    calls: set[int] = field(default_factory=set)  # layer calls counted in ``terms``
    direct: bool = False  # committed without a gradient (:meth:`CurvatureCapture.direct`)


class _LayerSlot:
    """One layer's capture state, made once: what the running backward pass staged
    (``statistics`` None: nothing) and the gradient the last pass that reached the
    layer left, against which the next pass tells a reset."""

    __slots__ = (
        "after_reset",
        "calls",
        "entry",
        "generation",
        "grad",
        "grad_version",
        "layer",
        "statistics",
    )

    def __init__(self, layer: Layer) -> None:
        self.layer = layer
        self.statistics: Statistics | None = None
        self.calls: dict[int, float] = {}  # staged call -> w
        self.after_reset = False  # the weight's .grad was None when the pass began
        self.grad: weakref.ref | None = None  # weakly, with its _version, in ``generation``
        self.grad_version = 0
        self.generation = -1
        self.entry = Committed()  # the layer's entry in ``committed``, reused every step


def merge_statistics(into: Statistics, new: Statistics) -> None:
    """into += new, key by key (keys only in ``new`` are moved over)."""
    for key, value in new.items():
        if key in into:
            into[key].add_(value)
        else:
            into[key] = value


class CurvatureCapture:
    """The hooks of one optimizer on one model (see the module docstring).

    ``committed`` maps layers to :class:`Committed`, and ``saw_samples`` says whether a
    grad-enabled call of a layer held any data since the last :meth:`reset`.
    """

    def __init__(self, model: nn.Module, layers: list[Layer], owner: CaptureOwner) -> None:
        self._owner = weakref.proxy(owner)
        self.committed: dict[Layer, Committed] = {}
        self.taken_over = False  # another optimizer's capture hooks these modules now
        self.saw_samples = False  # a grad-enabled layer call held data since the last step
        self._slots = [_LayerSlot(layer) for layer in layers]
        self._staging: list[_LayerSlot] = []  # slots the running backward pass staged into
        # model forwards so far, in a tensor that ``begin`` writes and ``mark`` reads, so
        # that a compiled graph keeps the ops in order
        self._forward = torch.zeros((), dtype=torch.int64, device="cpu")
        self._calls = itertools.count()  # ids of layer calls that take statistics
        # the batch of the running model forward: its input's dimension 0, or what a
        # module that knows its batch dimension said since (None outside a model forward)
        self.model_batch: int | None = None
        self.batch_from_input = False  # model_batch is the input's dimension 0
        self.counted_on_input = False  # a layer counted dimension 0 while it was
        self._callback_queued = False
        self._end_deferred = False  # _on_backward_end queued itself once more
        self._distributed = False  # torch.distributed is initialised (read once a pass)
        self._direct = False
        self._grad_hooks: dict[int, object] = {}
        # the gradient marks of the slots count in this generation only (reset: a new one)
        self._generation = 0
        self._layers = list(layers)
        handle = capture_ops.register(self)
        ref = self._ref = weakref.ref(self)
        probe = capture_ops.new_probe()
        self._handles = [
            module.register_forward_hook(
                _LayerHook(ref, handle, index, layer.weight, self._forward, probe),
                with_kwargs=True,
            )
            for index, layer in enumerate(layers)
            for module in layer.modules
        ]
        self._handles.append(
            model.register_forward_pre_hook(_ModelHook(handle, self._forward), with_kwargs=True)
        )
        self._handles += [
            module.register_forward_pre_hook(_BatchHook(handle, self._forward), with_kwargs=True)
            for module in model.modules()
            if isinstance(module, BATCH_TELLING)
        ]
        for slot in self._slots:
            self._hook_weight(slot)
        _forget_compiled_code()
        # a collected capture (its optimizer dropped) takes its hooks with it
        weakref.finalize(self, _remove_handles, self._handles, self._grad_hooks)

    # ------------------------------------------------------------- forward
    # At run time, inside the graph ops of capture_ops (compiled or not).
    def _on_model_forward(self, batch: int) -> None:
        self.model_batch = batch if batch >= 0 else None
        self.batch_from_input, self.counted_on_input = self.model_batch is not None, False
        self._owner._before_forward()

    def _on_call_batch(self, batch: int) -> None:
        self._owner._call_batch(batch)

    def _hook_weight(self, slot: _LayerSlot) -> None:
        """The post-accumulate-grad hook of the layer's weight (once it can take one)."""
        weight = slot.layer.weight
        if id(weight) in self._grad_hooks or not weight.requires_grad:
            return
        hook = _AccumulatedHook(weakref.ref(self), slot)
        self._grad_hooks[id(weight)] = weight.register_post_accumulate_grad_hook(hook)

    def _saw(self, output: Tensor) -> None:
        """Note a grad-enabled call of a layer."""
        self.saw_samples = self.saw_samples or output.numel() > 0

    def _on_forward(self, index: int, output: Tensor) -> tuple[int, int] | None:
        """(call, w) of a grad-enabled call of a layer whose weight is trainable, None when
        it takes no statistics (the traced path; :class:`_LayerHook` does the same inline)."""
        if not self.saw_samples:
            self.saw_samples = output.numel() > 0
        layer = self._layers[index]
        terms = self._owner._layer_call(layer, output)
        if terms < 0:
            return None
        if id(layer.weight) not in self._grad_hooks:
            self._hook_weight(self._slots[index])  # a weight unfrozen after construction
        return next(self._calls), terms

    # ------------------------------------------------------------ backward
    def _on_grad(
        self, index: int, layer_input: Tensor, grad_output: Tensor, call: int, weight: float
    ) -> None:
        """Stage one call's statistics (the traced path; eager calls run :func:`_stage`)."""
        _stage(self._ref, index, layer_input, call, weight, grad_output)

    def _accumulate(self, layer, layer_input, grad_output, weight, into, with_input) -> bool:
        accumulate = self._owner._accumulate_statistics
        device_type = grad_output.device.type
        if not torch.is_autocast_enabled(device_type):  # no context to leave (it costs µs)
            return accumulate(layer, layer_input, grad_output, weight, into, with_input)
        with torch.autocast(device_type, enabled=False):
            return accumulate(layer, layer_input, grad_output, weight, into, with_input)

    def _queue_backward_end(self) -> None:
        ref = self._ref
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: _call(ref, "_on_backward_end")
        )

    def _on_backward_end(self) -> None:
        """Drop what this backward pass staged but did not accumulate into a ``.grad``;
        later layer calls belong to no model forward until the next one begins.

        It first queues itself once more, so that it runs after the callbacks queued
        later in the pass: FSDP2's final callback reduce-scatters the gradients of the
        root's unit (whose inputs need no gradient: an LM head, a head tied to the
        embedding) and runs their post-accumulate-grad hooks, which commit."""
        if not self._end_deferred:
            self._end_deferred = True
            self._queue_backward_end()
            return
        self._end_pass()

    def _end_pass(self) -> None:
        """The end of a backward pass (its callback, or a capture that raised in it)."""
        self._end_deferred = False
        for slot in self._staging:
            slot.statistics = None
            slot.calls.clear()
        self._staging.clear()
        self._callback_queued = False
        self.model_batch = None
        self.batch_from_input = self.counted_on_input = False

    # ------------------------------------------------------------- control
    def direct(self) -> _DirectCommit:
        """A context in which statistics commit at once, without a ``.grad`` (the extra
        backward passes of a GGN capture, which accumulate no gradient by design)."""
        return _DirectCommit(self)

    def discard(self) -> None:
        """Forget what the passes since the last step left (``zero_grad``): a thrown-away
        batch counts for nothing."""
        self.reset()

    def reset(self) -> None:
        """After a step (taken or skipped): forget statistics, counts and gradient marks."""
        self.committed.clear()
        self._generation += 1
        self.saw_samples = False

    def remove(self) -> None:
        """Remove every hook."""
        _remove_handles(self._handles, self._grad_hooks)
        _forget_compiled_code()

    def modules(self) -> set[int]:
        """ids of the modules this capture hooks (while it has hooks)."""
        if not self._handles:
            return set()
        return {id(module) for layer in self._layers for module in layer.modules}


def _forget_compiled_code() -> None:
    """Make torch.compile trace hooked modules again. Dynamo does not guard on module
    hooks (``torch._dynamo.config.skip_nnmodule_hook_guards``): code it compiled before
    hooks were added or removed would run without them, or with stale ones."""
    dynamo = sys.modules.get("torch._dynamo")  # not imported: nothing was compiled
    if dynamo is not None:
        dynamo.reset()


def _remove_handles(handles: list, grad_hooks: dict) -> None:
    for handle in [*handles, *grad_hooks.values()]:
        handle.remove()
    handles.clear()
    grad_hooks.clear()


_captures: weakref.WeakKeyDictionary[nn.Module, list] = weakref.WeakKeyDictionary()


def take_over(model: nn.Module, capture: CurvatureCapture) -> None:
    """Register ``capture`` as hooking ``model``. An earlier capture (of another optimizer)
    that hooks some of the same modules stops: its hooks are removed and it is marked
    ``taken_over``, so hooks never pile up and the earlier optimizer can say so."""
    mine = capture.modules()
    alive = []
    for ref in _captures.get(model, []):
        other = ref()
        if other is None:
            continue
        if other.modules() & mine:
            other.remove()
            other.taken_over = True
        else:
            alive.append(ref)
    _captures[model] = [*alive, weakref.ref(capture)]


class _DirectCommit:
    def __init__(self, capture: CurvatureCapture) -> None:
        self._capture = capture

    def __enter__(self) -> None:
        self._capture._direct = True

    def __exit__(self, *exc) -> None:
        self._capture._direct = False


def _call(ref: Callable[[], CurvatureCapture | None], method: str, *args):
    capture = ref()
    if capture is not None:
        return getattr(capture, method)(*args)
    return None


class _InertCopies:
    """Copies and pickles of a hooked model carry a hook that does nothing (a copy of a
    model is not what the optimizer trains)."""

    def __deepcopy__(self, memo) -> _InertHook:
        return _InertHook()

    def __reduce__(self):
        return (_InertHook, ())


class _ModelHook(_InertCopies):
    """The forward pre-hook of the model: the ``begin`` op (traced by ``torch.compile``)."""

    def __init__(self, handle: int, forward: Tensor) -> None:
        self._handle, self._forward = handle, forward

    def __call__(self, module: nn.Module, args, kwargs) -> None:
        compiling = torch.compiler.is_compiling()
        if not compiling and torch._C._are_functorch_transforms_active():
            return  # torch.func: a forward that takes no statistics
        batch = -1  # the first tensor argument's dimension 0 (a loop: no generator frames)
        for x in (*args, *kwargs.values()):
            if isinstance(x, Tensor) and x.dim():
                batch = x.shape[0]
                break
        begin = capture_ops.begin if compiling else capture_ops.begin_eager
        begin(self._forward, self._handle, batch, torch.is_grad_enabled())


class _BatchHook(_InertCopies):
    """The forward pre-hook of a module that knows its batch (:data:`.layers.BATCH_TELLING`):
    the ``tell`` op, with the call's batch."""

    def __init__(self, handle: int, forward: Tensor) -> None:
        self._handle, self._forward = handle, forward

    def __call__(self, module: nn.Module, args, kwargs) -> None:
        if not torch.compiler.is_compiling() and torch._C._are_functorch_transforms_active():
            return
        batch = call_batch(module, args, kwargs)
        if batch is not None:
            capture_ops.tell(self._forward, self._handle, batch, torch.is_grad_enabled())


class _LayerHook(_InertCopies):
    """The forward hook of a layer's modules. Traced by ``torch.compile``, it reads no
    capture state (the ``mark`` op does, at run time) and wraps the output in
    :class:`capture_ops.Stage`. Eager calls keep the output and, when they take
    statistics, hook its gradient (:func:`_stage`)."""

    def __init__(self, ref, handle: int, index: int, weight, forward: Tensor, probe) -> None:
        self._ref, self._handle, self._index = ref, handle, index
        self._weight, self._forward, self._probe = weight, forward, probe

    def __call__(self, module: nn.Module, args, kwargs, output):
        if not (torch.is_grad_enabled() and isinstance(output, Tensor) and output.requires_grad):
            return None
        weight = self._weight
        if not weight.requires_grad:
            return None
        # torch.compiler.is_compiling() less its torch.jit.is_scripting() call (hooks are
        # never scripted); Dynamo folds is_dynamo_compiling() to True, so it never reads
        # the flag (which torch.export sets)
        if torch.compiler.is_dynamo_compiling() or torch.compiler._is_compiling_flag:
            token = capture_ops.mark(self._forward, output, self._handle, self._index)
            layer_input = _input(args, kwargs)
            return capture_ops.Stage.apply(
                output, token, layer_input, self._probe, self._handle, self._index
            )
        capture = self._ref()
        if capture is None:
            return None
        if torch._C._are_functorch_transforms_active():
            capture._saw(output)  # torch.func: note the samples, capture nothing
            return None
        # CurvatureCapture._on_forward, inline (a Python call less per layer call)
        if not capture.saw_samples:
            capture.saw_samples = output.numel() > 0
        index = self._index
        terms = capture._owner._layer_call(capture._layers[index], output)
        if terms < 0:
            return None
        if id(weight) not in capture._grad_hooks:
            capture._hook_weight(capture._slots[index])  # a weight unfrozen after construction
        # a hook on the output's gradient, no copy of the output
        layer_input = (args[0] if args else next(iter(kwargs.values()))).detach()
        stage = partial(_stage, self._ref, index, layer_input, next(capture._calls), terms)
        _hook_gradient(output, stage)
        return None


def _hook_gradient(output: Tensor, hook: Callable) -> None:
    """``output.register_hook(hook)`` without the handle (the hook is never removed: it goes
    with the graph), so a layer call creates no Python object for it: the same steps as
    ``Tensor.register_hook`` (the tensor's hook dict, registered on its ``grad_fn`` when
    first made), its hook under a fresh id of ``RemovableHandle``'s counter (which a
    handle of the same dict would otherwise draw). A tensor subclass or an active torch
    function mode takes ``register_hook`` itself (it may override it)."""
    if torch._C._has_torch_function_unary(output):
        output.register_hook(hook)
        return
    hooks = output._backward_hooks
    if hooks is None:
        hooks = output._backward_hooks = OrderedDict()
        if output.grad_fn is not None:
            output.grad_fn._register_hook_dict(output)
    key = RemovableHandle.next_id
    RemovableHandle.next_id = key + 1
    hooks[key] = hook


def _stage(ref, index: int, layer_input: Tensor, call: int, weight: int, grad_output: Tensor):
    """Stage the statistics of one layer call for the running backward pass: the hook on
    the output's gradient of an eager layer call that takes statistics (through
    :meth:`CurvatureCapture._on_grad` on the traced path).

    A tensor hook sees the gradient of the value the layer returned even when later code
    modifies the output in place (``ReLU(inplace=True)``), so the output is neither copied
    nor wrapped; the hook (a ``functools.partial``: no Python object of ours per call) and
    the input it keeps live as long as the autograd graph. One function, not a method
    called from one, for one Python call per layer call."""
    capture = ref()
    if capture is None:
        return
    weight = float(weight)
    slot = capture._slots[index]
    layer = slot.layer
    if capture._direct:
        committed = capture.committed.setdefault(layer, Committed(direct=True))
        new = call not in committed.calls
        into = committed.statistics
        if capture._accumulate(layer, layer_input, grad_output, weight, into, new) and new:
            committed.calls.add(call)
            committed.terms += weight
        return
    statistics = slot.statistics
    if statistics is None:
        if not capture._callback_queued:
            capture._callback_queued = True
            capture._distributed = dist.is_available() and dist.is_initialized()
            capture._queue_backward_end()
        # whether the weight's gradient was reset since the last pass that reached it
        # (the module docstring); none reached it since the last step: not reset, nor
        # under torch.distributed (collectives write .grad after the hooks)
        grad = layer.weight.grad
        slot.after_reset = grad is None or (
            slot.generation == capture._generation
            and not capture._distributed
            and (slot.grad() is not grad or slot.grad_version != grad._version)
        )
        statistics = slot.statistics = {}
        capture._staging.append(slot)
    calls = slot.calls
    previous = capture.committed.get(layer)
    kept = previous is not None and (previous.direct or not slot.after_reset)
    new = call not in calls and not (kept and call in previous.calls)
    try:
        if torch.is_autocast_enabled(grad_output.device.type):
            counts = capture._accumulate(layer, layer_input, grad_output, weight, statistics, new)
        else:  # as _accumulate, one call less
            accumulate = capture._owner._accumulate_statistics
            counts = accumulate(layer, layer_input, grad_output, weight, statistics, new)
    except BaseException:
        # the pass fails (its end callback will not run): it stages nothing more, and
        # what it staged must not wait for a later pass's commit
        capture._end_pass()
        raise
    if counts and new:
        calls[call] = weight


def _input(args: tuple, kwargs: dict) -> Tensor:
    """The layer call's input (its first argument), detached."""
    return (args[0] if args else next(iter(kwargs.values()))).detach()


class _AccumulatedHook(_InertCopies):
    """The post-accumulate-grad hook of a layer's weight: commits what the pass staged
    into the capture's ``committed``. It holds the capture weakly and does nothing once
    it is gone (nor in a copy of the model)."""

    def __init__(self, ref, slot: _LayerSlot) -> None:
        self._ref, self._slot = ref, slot

    def __call__(self, weight: Tensor) -> None:
        capture = self._ref()
        if capture is None:
            return
        # the gradient this pass leaves (also one without statistics of the layer: a
        # weight in an L2 term), against which the next pass tells a reset
        slot, grad = self._slot, weight.grad
        slot.grad, slot.grad_version = weakref.ref(grad), grad._version
        slot.generation = capture._generation
        statistics = slot.statistics
        if statistics is None:
            return
        slot.statistics = None
        layer = slot.layer
        committed = capture.committed
        previous = committed.get(layer)
        if previous is not None and slot.after_reset and not previous.direct:
            del committed[layer]  # the statistics before the reset go with the gradient
            previous = None
        if previous is None:
            previous = committed[layer] = slot.entry
            previous.statistics, previous.terms, previous.direct = statistics, 0.0, False
            previous.calls.clear()
        else:
            capture._owner._merge_statistics(layer, previous.statistics, statistics)
        counted = previous.calls
        for call, w in slot.calls.items():
            if call not in counted:
                counted.add(call)
                previous.terms += w
        slot.calls.clear()


class _InertHook:
    """What a copy of a hooked model holds in place of a capture's hook: nothing runs."""

    def __call__(self, *args) -> None:
        return None
