"""Never silently wrong: finite checks over many tensors, and undo of factor updates.

A step skipped for a non-finite gradient, statistic or factor changes no state. The
checks raise flags on the device and the step reads them once, after the factor updates
(which run before any parameter is written); :class:`FactorUndo` keeps what those
overwrite so that they can be undone when a flag is raised. With ``nonfinite='device'``
the step reads nothing: the flags' maximum is the found_inf every write consumes,
:meth:`FactorUndo.restore_where` restores the factors by a predicated select, and
:class:`LateVerdict` brings the flags to the host for a warning without waiting.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Iterable
from functools import reduce
from operator import getitem
from typing import Any

import torch
from torch import Tensor

from ..structures.base import PLAIN, StructuredMatrix, parts_of
from . import warm_start
from .grouped import partition, stack_of_rows

# what tensors that one fused check takes share (all strided: a step refuses sparse
# gradients, and statistics and factors are dense)
_GROUP = operator.attrgetter("device", "dtype")


class FiniteCheck:
    """The non-finite verdict of a step, raised on the device and read once.

    ``check(tensors, reason)`` runs one fused pass per (device, dtype) that raises the flag
    ``reason`` (an index below ``reasons``) when a tensor holds an inf or a nan; it reads
    nothing back. ``verdict()`` reads every flag at once (one transfer per device, so one
    synchronisation on a single-device model): the lowest raised reason, or None.
    ``reset()`` lowers every flag (one op per device) for the next step.
    """

    def __init__(self, reasons: int) -> None:
        self._reasons = reasons
        # device -> (flags (reasons,), one (1,), views), float32 whatever the default dtype
        # (the fused op's contract); views[i] = flags[i : i + 1], the op's found_inf for
        # reason i (made once: a view is an op)
        self._buffers: dict[torch.device, tuple[Tensor, Tensor, list[Tensor]]] = {}

    def reset(self) -> None:
        for flags, _, _ in self._buffers.values():
            flags.zero_()

    def flag(self, device: torch.device, reason: int) -> Tensor:
        """The (1,) float32 flag of ``reason`` on ``device`` (> 0: raised)."""
        buffers = self._buffers.get(device)
        if buffers is None:
            flags = torch.zeros(self._reasons, dtype=torch.float32, device=device)
            views = [flags[i : i + 1] for i in range(self._reasons)]
            buffers = self._buffers[device] = (flags, flags.new_ones(1), views)
        return buffers[2][reason]

    def check(self, tensors: Iterable[Tensor], reason: int) -> None:
        tensors = list(filter(Tensor.numel, tensors))  # (empty ones hold nothing to check)
        if not tensors:
            return
        keys = list(map(_GROUP, tensors))
        if keys.count(keys[0]) == len(keys):  # the common case: one group, no loop
            groups = {keys[0]: tensors}
        else:
            groups = {}
            for key, t in zip(keys, tensors, strict=True):
                groups.setdefault(key, []).append(t)
        for (device, _), group in groups.items():
            found = self.flag(device, reason)
            # one fused pass, no temporaries: multiplies by exactly 1 and flags inf/nan
            torch._amp_foreach_non_finite_check_and_unscale_(group, found, self._buffers[device][1])

    def merged(self, device: torch.device) -> Tensor:
        """Every device's flags summed into a new (reasons,) float32 tensor on ``device``
        (for an all-reduce between ranks; no read)."""
        out = torch.zeros(self._reasons, dtype=torch.float32, device=device)
        for flags, _, _ in self._buffers.values():
            out.add_(flags.to(device))
        return out

    def raise_(self, flags: Tensor) -> None:
        """Raise the flags raised in ``flags`` ((reasons,), e.g. agreed between ranks)."""
        self.flag(flags.device, 0)  # the buffers of flags' device
        self._buffers[flags.device][0].add_(flags)

    def verdict(self) -> int | None:
        raised = [False] * self._reasons
        for flags, _, _ in self._buffers.values():
            for i, value in enumerate(flags.tolist()):  # the step's one device->host read
                raised[i] = raised[i] or value > 0
        return raised.index(True) if True in raised else None

    def device(self) -> torch.device | None:
        """The one device the flags live on (None: none yet, or several)."""
        return next(iter(self._buffers)) if len(self._buffers) == 1 else None

    def flags(self) -> Tensor:
        """The (reasons,) float32 flags on their one device (see :meth:`device`)."""
        return next(iter(self._buffers.values()))[0]


class LateVerdict:
    """The flags of steps decided on the device, copied to the host without waiting, and
    the reasons they hold once their copies have landed (a step or more later).

    On CUDA each copy goes to pinned memory behind an event; :meth:`landed` asks the events
    (no synchronisation) and reads only the copies that are complete, so a skip is
    reported at the first step that finds its copy landed. On the CPU a copy lands at
    once (the next step reports it).
    """

    def __init__(self) -> None:
        self._staged: list[tuple[Tensor, Any]] = []  # (host copy, CUDA event or None)

    def stage(self, flags: Tensor) -> None:
        host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=flags.is_cuda)
        host.copy_(flags, non_blocking=flags.is_cuda)
        event = None
        if flags.is_cuda:
            event = torch.cuda.Event()
            event.record()
        self._staged.append((host, event))

    def landed(self) -> list[int]:
        """The lowest raised reason of each staged copy that is on the host now, oldest
        first (copies with nothing raised left out); those copies are forgotten."""
        reasons = []
        while self._staged:
            host, event = self._staged[0]
            if event is not None and not event.query():
                break  # later copies land after this one
            self._staged.pop(0)
            # host memory, filled by the copy above: reading it waits for no device
            raised = [i for i, value in enumerate(host.numpy().tolist()) if value > 0]
            reasons += raised[:1]
        return reasons


def tensors_of(value: Any) -> list[Tensor]:
    """The floating-point tensors in a state or statistic (nested dicts, structures)."""
    found: list[Tensor] = []
    _collect(value, found)
    return found


def statistics_tensors(pending: dict[Any, dict]) -> list[Tensor]:
    """:func:`tensors_of` a step's {layer: statistics}, faster in the common case of
    plain tensors (a list per layer, no recursion)."""
    found = list(itertools.chain.from_iterable(map(dict.values, pending.values())))
    kinds = set(map(type, found))
    if kinds <= PLAIN:
        return list(filter(Tensor.is_floating_point, found))
    if kinds.isdisjoint(PLAIN) and all(issubclass(kind, StructuredMatrix) for kind in kinds):
        return list(filter(Tensor.is_floating_point, parts_of(found)))
    if all(issubclass(kind, StructuredMatrix) for kind in kinds - PLAIN):  # one call a type
        parts = [t.parts.values() if type(t) is not Tensor else (t,) for t in found]
        return list(filter(Tensor.is_floating_point, itertools.chain.from_iterable(parts)))
    return tensors_of(pending)


def _collect(value: Any, found: list[Tensor]) -> None:
    # dicts and tensors first: StructuredMatrix is an ABC, whose isinstance check is slow
    if isinstance(value, dict):
        for item in value.values():
            _collect(item, found)
    elif isinstance(value, Tensor):
        if value.is_floating_point():
            found.append(value)
    elif isinstance(value, StructuredMatrix):
        found.extend(value.parts.values())


class FactorUndo:
    """Saves layer states before their factor updates and restores them on demand.

    Vectors (the diagonal and AdaFisher states) are saved into buffers kept between
    steps, so those update steps allocate nothing; matrices are copied for the step only
    (one stack per run of equal shape, dtype and device), a transient copy as large as
    the factors being updated (their update allocates temporaries of that size anyway).
    Entries that are every row of one stack (:class:`~.grouped.ResidentStacks`) are
    saved and checked as that stack: one tensor for the group, not one per layer.
    ``skip`` names state entries no factor update writes (the parameter momenta);
    ``flags`` the host flags an update may set for good (SINGD's warm start), which no
    predicated select on the device can undo.

    Where the saved entries lie (a :class:`_Layout`) is found once and kept while the
    states hold the same objects, so that a steady-state save is a few identity checks,
    one multi-tensor copy and a copy per run of matrices.
    """

    def __init__(
        self,
        skip: tuple[str, ...] = ("momentum_buffer", "exp_avg", "exp_avg_sq"),
        flags: tuple[str, ...] = (warm_start.KEY,),
    ) -> None:
        self._skip = skip
        self._flags = flags
        self._vectors: dict[int, Tensor] = {}
        self._layout: _Layout | None = None  # of the last save
        self._layouts: dict[tuple[str, ...], _Layout] = {}  # per set of untouched keys
        # what save() saved, until restore or clear: (one copy per run of matrices, host
        # values); a copy's rows are viewed only to restore (a view is a tracked object)
        self._saved: tuple[list[Tensor], list[Any]] | None = None

    def save(self, states: list[dict], untouched: tuple[str, ...] = ()) -> None:
        """Save ``states`` (before any of them is updated; once a step): the vectors in
        one multi-tensor copy; ``untouched``: top-level keys this update leaves as they
        are (K-FAC's inverses between inversions), neither saved nor checked. No states
        (a step between factor updates) keep the layouts for the next update."""
        if not states:
            self._saved = None
            return
        layout = self._layouts.get(untouched)
        if layout is None or not layout.holds(states):
            last = self._layout
            if layout is not None or last is None or not last.holds(states):
                # other states (a load, new layers): let the old layouts and their save
                # buffers go (kept by the ids of entries that are gone, they would pile up)
                self._layouts.clear()
                self._vectors.clear()
            layout = _Layout(states, self._skip + untouched, self._flags)
            layout.buffers = list(map(self._buffer, layout.saved_vectors, layout.saved_firsts))
            self._layouts[untouched] = layout
        self._layout = layout
        if layout.saved_vectors:
            torch._foreach_copy_(layout.buffers, layout.saved_vectors)
        matrices = layout.matrices
        stacks = [
            torch.stack(matrices[a:b]) if stack is None else stack.clone()
            for a, b, stack in layout.runs
        ]
        self._saved = stacks, [container[key] for container, key in layout.values]

    def _buffer(self, value: Tensor, first: Tensor) -> Tensor:
        """The save buffer of ``value`` (a vector, or a stack whose first row is the
        entry ``first``), kept by that entry between layouts."""
        buffer = self._vectors.get(id(first))
        if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
            buffer = self._vectors[id(first)] = torch.empty_like(value)
        return buffer

    def updated(self) -> list[Tensor]:
        """The floating-point tensors of the saved states (as they are now; each stack
        of :meth:`save` as one tensor while the states still hold its rows)."""
        if self._saved is None:
            return []
        layout = self._layout
        if layout.same_objects():
            return layout.checked
        # the entry of states[i] at a key path, by C calls alone (no Python call a tensor)
        current = [reduce(getitem, path, layout.states[i]) for i, path in layout.vector_paths]
        current += [reduce(getitem, path, layout.states[i]) for i, path in layout.matrix_paths]
        if len(current) == len(layout.entries) and all(map(operator.is_, current, layout.entries)):
            return layout.checked
        return [t for t in current if t.is_floating_point()]

    def sets_flags(self) -> bool:
        """Whether an update since :meth:`save` changed one of the ``flags`` (then only
        :meth:`restore`, decided on the host, can undo the step)."""
        if self._saved is None:
            return False
        values = self._saved[1]
        return any(
            state.get(key, _MISSING) != (_MISSING if index is None else values[index])
            for state, key, index in self._layout.flags
        )

    def restore(self) -> None:
        self._restore(lambda saved, current: current.copy_(saved), host_values=True)

    def restore_where(self, found: Tensor) -> None:
        """Restore every saved tensor where ``found`` (a one-element tensor on their
        device) is > 0, decided elementwise on the device (no read): a predicated select
        per tensor. Saved host values (counters, flags) keep what the update made of them."""
        raised = found.reshape(()) > 0
        self._restore(
            lambda saved, current: torch.where(raised, saved, current, out=current),
            host_values=False,
        )

    def _restore(self, write: Callable[[Tensor, Tensor], Any], host_values: bool) -> None:
        """``write(saved, current)`` for every saved tensor: per saved stack while the
        states still hold the saved entries, else entry by entry (an update may have put
        new tensors in the states); with ``host_values`` the saved host values are set
        back too."""
        if self._saved is None:
            return
        layout, (stacks, values) = self._layout, self._saved
        if layout.same_objects():  # (saved, current) per saved stack or tensor
            pairs = list(zip(layout.buffers, layout.saved_vectors, strict=True))
            for (start, end, stack), copy in zip(layout.runs, stacks, strict=True):
                if stack is not None:
                    pairs.append((copy, stack))
                else:
                    pairs += zip(copy.unbind(0), layout.matrices[start:end], strict=True)
        else:  # per entry, where the states hold it now
            clones = [copy for stack in stacks for copy in stack.unbind(0)]
            vectors = [
                copy
                for buffer, stacked in zip(layout.buffers, layout.stacked, strict=True)
                for copy in (buffer.unbind(0) if stacked else (buffer,))
            ]
            currents = [
                reduce(getitem, path, layout.states[i])
                for i, path in layout.vector_paths + layout.matrix_paths
            ]
            pairs = zip(vectors + clones, currents, strict=True)
        for saved, current in pairs:
            write(saved, current)
        if host_values:
            for (i, path), value in zip(layout.value_paths, values, strict=True):
                reduce(getitem, path[:-1], layout.states[i])[path[-1]] = value
        self.clear()

    def clear(self) -> None:
        self._saved = None


_MISSING = object()


def _by_stack(tensors: list[Tensor]) -> list[tuple[list[int], Tensor | None]]:
    """``tensors``' indices in parts: those that are every row of one stack, with the
    stack (:func:`~.grouped.stack_of_rows`), and the others one by one (None)."""
    parts = partition(
        range(len(tensors)),
        lambda i: ("row", id(tensors[i]._base)) if tensors[i]._base is not None else i,
    )
    found: list[tuple[list[int], Tensor | None]] = []
    for part in parts:
        stack = stack_of_rows([tensors[i] for i in part]) if len(part) > 1 else None
        if stack is not None:
            found.append((part, stack))
        else:
            found += [([i], None) for i in part]
    return found


class _Layout:
    """Where the saved entries of some states lie: every nested dict and tensor as the
    (container, key) that holds it and the object it held (checked by :meth:`holds`),
    the vectors and matrices to save (with their key paths from their state, which
    :class:`FactorUndo` follows after the update), the host values and the flags.

    Vectors that are every row of one stack are saved as the stack (``saved_vectors``,
    one entry for them, flagged in ``stacked``), the others one by one; matrices in runs
    (``runs``: (start, end, the stack or None)), a stack's rows as one run, the others
    one run per (shape, dtype, device). ``entries`` are the saved tensors as the states
    held them, ``checked`` what :meth:`FactorUndo.updated` returns while they still do.
    """

    def __init__(self, states: list[dict], skip: tuple[str, ...], flags: tuple[str, ...]):
        self.states = list(states)
        self.containers: list[dict] = []
        # the (container, key) slots of dicts and tensors, as two lists, and what they held
        self.slot_containers: list[dict] = []
        self.slot_keys: list[Any] = []
        self.objects: list[Any] = []
        self.vectors: list[Tensor] = []
        self.buffers: list[Tensor] = []  # one per saved vector (FactorUndo.save)
        self.matrices: list[Tensor] = []
        self.vector_paths: list[tuple[int, tuple]] = []  # (state index, key path)
        self.matrix_paths: list[tuple[int, tuple]] = []
        self.values: list[tuple[dict, Any]] = []  # (container, key) of host values
        self.value_paths: list[tuple[int, tuple]] = []
        self.flags: list[tuple[dict, str, int | None]] = []  # (state, key, index in values)
        for index, state in enumerate(self.states):
            start = len(self.value_paths)
            self._walk(index, state, (), skip)
            for key in flags:
                paths = self.value_paths[start:]
                found = (index, (key,)) in paths
                position = start + paths.index((index, (key,))) if found else None
                self.flags.append((state, key, position))
        self.lengths = [len(container) for container in self.containers]
        self.saved_vectors: list[Tensor] = []
        self.saved_firsts: list[Tensor] = []  # the first entry each saved vector covers
        self.stacked: list[bool] = []  # per saved vector: whether it is a stack of entries
        order: list[int] = []
        for part, stack in _by_stack(self.vectors):
            order += part
            self.saved_vectors.append(self.vectors[part[0]] if stack is None else stack)
            self.saved_firsts.append(self.vectors[part[0]])
            self.stacked.append(stack is not None)
        self.vectors = [self.vectors[i] for i in order]
        self.vector_paths = [self.vector_paths[i] for i in order]
        # the other matrices in runs of one (shape, dtype, device), each saved by one stack
        rows, loose = [], {}
        for part, stack in _by_stack(self.matrices):
            if stack is not None:
                rows.append((part, stack))
            else:
                matrix = self.matrices[part[0]]
                loose.setdefault((matrix.shape, matrix.dtype, matrix.device), []).extend(part)
        runs = rows + [(part, None) for part in loose.values()]
        order = [i for part, _ in runs for i in part]
        self.matrices = [self.matrices[i] for i in order]
        self.matrix_paths = [self.matrix_paths[i] for i in order]
        ends = list(itertools.accumulate(len(part) for part, _ in runs))
        self.runs = [
            (start, end, stack)
            for start, end, (_, stack) in zip([0, *ends][:-1], ends, runs, strict=True)
        ]
        self.entries = self.vectors + self.matrices
        self.checked = [
            t
            for t in itertools.chain(
                self.saved_vectors,
                *(
                    [stack] if stack is not None else self.matrices[start:end]
                    for start, end, stack in self.runs
                ),
            )
            if t.is_floating_point()
        ]

    def _walk(self, index: int, container: dict, path: tuple, skip: tuple[str, ...]) -> None:
        self.containers.append(container)
        for key, value in container.items():
            if key in skip:
                continue
            if isinstance(value, dict | Tensor):
                self.slot_containers.append(container)
                self.slot_keys.append(key)
                self.objects.append(value)
            if isinstance(value, dict):
                self._walk(index, value, (*path, key), skip)
            elif isinstance(value, Tensor):
                matrix = value.dim() > 1
                (self.matrices if matrix else self.vectors).append(value)
                paths = self.matrix_paths if matrix else self.vector_paths
                paths.append((index, (*path, key)))
            else:
                self.values.append((container, key))
                self.value_paths.append((index, (*path, key)))

    def holds(self, states: list[dict]) -> bool:
        """Whether ``states`` are this layout's, every dict with the same number of
        entries and every slot with the same object."""
        return (
            len(states) == len(self.states)
            and all(map(operator.is_, states, self.states))
            and list(map(len, self.containers)) == self.lengths
            and self.same_objects()
        )

    def same_objects(self) -> bool:
        """Whether every slot still holds its object (so every entry at a key path from
        the states is the one found), by C calls alone (no Python call a slot)."""
        current = map(dict.get, self.slot_containers, self.slot_keys)
        return all(map(operator.is_, current, self.objects))


# The reasons of a skipped step, by priority (the flags of a step's FiniteCheck).
SCALER, GRADIENT, STATISTICS, FACTORS = range(4)


STATISTICS_OVERFLOW = "an overflow in the layer inputs or output gradients"


def skip_message(
    optimizer: str, reason: int, statistics_overflow: str = STATISTICS_OVERFLOW
) -> str:
    """The warning (or error) of a step of ``optimizer`` skipped for ``reason``; '' for
    the GradScaler's routine skip (it skips and backs off its scale itself).
    ``statistics_overflow``: what overflows when the statistics are non-finite (the
    optimizer's :attr:`~.base.KroneckerOptimizer.statistics_overflow`)."""
    if reason == SCALER:
        return ""
    if reason == GRADIENT:
        return (
            f"{optimizer}: non-finite gradient, step skipped and statistics dropped (use "
            "torch.amp.GradScaler for fp16; nonfinite='raise' to raise)"
        )
    if reason == STATISTICS:
        return (
            f"{optimizer}: non-finite curvature statistics ({statistics_overflow}), step "
            "skipped and no state changed; use a GradScaler or float32 statistics "
            "(nonfinite='raise' to raise)"
        )
    return (
        f"{optimizer}: a factor update produced non-finite values (or a warm start a "
        "scale outside the factor dtype), step skipped and every factor restored (use "
        "float32 factor_dtype or a larger damping; "
        "nonfinite='raise' to raise)"
    )
