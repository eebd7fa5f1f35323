"""Layers of equal shapes, structures and dtypes handled as one stack.

A transformer repeats identical blocks, so its layers fall into a few groups of equal
(d_C, d_K, structures, dtypes, device). Per group the optimizers stack the cached K Kᵀ
and C Cᵀ into stacked forms and precondition into one (L, d_C, d_K) tensor, the step's
one gradient-sized allocation: dense and arrow products run batched and in place on a
stacked copy of the gradients, block-diagonal ones read the gradients where they lie (a
few strided batched products per layer). The state stays per parameter (the checkpoint
layout does not change); SINGD's and K-FAC's factors are rows of kept stacks
(:class:`ResidentStacks`), other stacking copies are made on the fly.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Hashable, Iterable, Sequence
from itertools import chain, repeat
from operator import is_

import torch
from torch import Tensor

from ..curvature.layers import Layer, LayerKind, gradient_matrix, split_matrix
from ..structures.block_diagonal import BlockDiagonal
from ..structures.dense import Dense
from ..structures.hierarchical import SymmetricArrow


def partition(items: Sequence, key: Callable[[object], Hashable]) -> list[list]:
    """``items`` split by ``key``, each part in the original order, parts in order of
    first appearance."""
    parts: dict[Hashable, list] = {}
    for item in items:
        parts.setdefault(key(item), []).append(item)
    return list(parts.values())


def interleaved(first: Iterable, second: Iterable) -> list:
    """[first[0], second[0], first[1], second[1], ...] (equal lengths) by C calls alone."""
    return list(chain.from_iterable(zip(first, second, strict=True)))


def count_up(states: Sequence[dict], key: str) -> list[int]:
    """``state[key] += 1`` for every state, by C calls alone; the counts before."""
    counts = list(map(operator.itemgetter(key), states))
    list(map(operator.setitem, states, repeat(key), map((1).__add__, counts)))
    return counts


def positions_by(keys: Sequence[Hashable]) -> list[list[int]]:
    """The positions of ``keys`` split by value, each part in order, parts in order of
    first appearance; one part, without a loop, when every key is equal (the common
    case: one parameter group, one shape)."""
    if keys and keys.count(keys[0]) == len(keys):
        return [list(range(len(keys)))]
    return partition(range(len(keys)), keys.__getitem__)


def stack_parts(layers: Sequence, keys: Sequence[Hashable | None]) -> list[list[int]]:
    """The positions of ``layers`` split by their group ``keys`` (a rule's
    ``group_keys``), a layer whose key is None alone."""
    pairs = zip(layers, keys, strict=True)
    return positions_by([id(layer) if key is None else key for layer, key in pairs])


def update_in_stacks(
    parts: list[list[int]],
    layers: Sequence,
    states: Sequence[dict],
    pendings: Sequence[dict],
    stacked: Callable[[list, list, list], bool],
    each: Callable[[list, list], None],
) -> None:
    """A factor update of ``layers`` split in ``parts`` (positions): ``stacked(layers,
    states, pendings)`` of each part of two or more layers (False: it did nothing, the
    part is left), then one ``each(states, pendings)`` of every layer left."""
    rest: list[int] = []
    for part in parts:
        if len(part) == 1 or not stacked(
            [layers[i] for i in part], [states[i] for i in part], [pendings[i] for i in part]
        ):
            rest += part
    if rest:
        each([states[i] for i in rest], [pendings[i] for i in rest])


_SHAPE_DTYPE = operator.attrgetter("shape", "dtype")
_SHAPE_DTYPE_DEVICE = operator.attrgetter("shape", "dtype", "device")
_DTYPE = operator.attrgetter("dtype")


class GatheredRows:
    """Tensors copied into the rows of stacks, one stack per (shape, dtype, device) of
    the tensors, by one ``torch.stack(..., out=)`` each (values bitwise the tensors').
    The stacks and their rows are kept per name for the next call with tensors of the
    same dtypes, devices and sizes (checked by C calls; a set's shapes by its first
    tensor, ``torch.stack`` refusing unequal others), so that a warm call allocates
    nothing."""

    def __init__(self) -> None:
        # name -> (the tensors' (dtype, device index, numel) lists, sets: (positions,
        # stack, rows))
        self._kept: dict[str, tuple[tuple[list, ...], list[tuple]]] = {}

    def __call__(
        self, name: str, tensors: Sequence[Tensor]
    ) -> list[tuple[list[int], Tensor, list[Tensor]]]:
        """Per set of ``tensors`` of one (shape, dtype, device): (their positions, the
        (n, *shape) stack now holding them, its n rows)."""
        layout = (
            list(map(_DTYPE, tensors)),
            list(map(Tensor.get_device, tensors)),
            list(map(Tensor.numel, tensors)),
        )
        kept = self._kept.get(name)
        if (
            kept is None
            or kept[0] != layout
            or any(
                stack.shape[1:] != tensors[positions[0]].shape for positions, stack, _ in kept[1]
            )
        ):
            sets = []
            for positions in positions_by(list(map(_SHAPE_DTYPE_DEVICE, tensors))):
                first = tensors[positions[0]]
                stack = first.new_empty((len(positions), *first.shape))
                sets.append((positions, stack, list(stack.unbind())))
            kept = self._kept[name] = (layout, sets)
        for positions, stack, rows in kept[1]:
            members = tensors if len(positions) == len(tensors) else [tensors[i] for i in positions]
            if not all(map(is_, members, rows)):  # (already the rows: nothing to copy)
                torch.stack(members, out=stack)
        return kept[1]


class StackedSums:
    """outs[i] <- the sum of vectors[i] in outs[i]'s dtype, bitwise ``torch.sum(vectors[i],
    0, keepdim=True, dtype=outs[i].dtype, out=outs[i])`` (outs (1,)), for many vectors.

    On the CPU, where a row of a stack reduces as a vector does (checked for lengths
    1..4097 and every float dtype), the vectors of equal length and dtypes are copied
    into the rows of a stack and summed by one row sum per set. The stacks of each list
    of outputs (by its first output) are kept for the next call with the same outputs and
    vector shapes, so a warm call allocates nothing. Elsewhere one sum per vector.
    """

    def __init__(self) -> None:
        # id of the first output -> (outputs, vector shapes, sets); per set: (indices,
        # stack (n, d), its rows, sums (n, 1), their rows, outputs)
        self._kept: dict[int, tuple[list[Tensor], list[tuple], list[tuple]]] = {}

    def __call__(self, vectors: Sequence[Tensor], outs: Sequence[Tensor]) -> None:
        if not vectors:
            return
        if vectors[0].device.type != "cpu":
            for vector, out in zip(vectors, outs, strict=True):
                torch.sum(vector, 0, keepdim=True, dtype=out.dtype, out=out)
            return
        shapes = list(map(_SHAPE_DTYPE, vectors))
        kept = self._kept.get(id(outs[0]))
        if (
            kept is None
            or shapes != kept[1]
            or len(outs) != len(kept[0])
            or not all(map(is_, outs, kept[0]))
        ):
            if len(self._kept) >= 64:  # many lists of outputs: start over
                self._kept.clear()
            kept = self._kept[id(outs[0])] = (list(outs), shapes, _stacks(vectors, outs))
        for indices, stack, rows, sums, sum_rows, set_outs in kept[2]:
            members = vectors if len(indices) == len(vectors) else [vectors[i] for i in indices]
            torch._foreach_copy_(rows, members)
            torch.sum(stack, 1, keepdim=True, dtype=sums.dtype, out=sums)
            torch._foreach_copy_(set_outs, sum_rows)


def _stacks(vectors: Sequence[Tensor], outs: Sequence[Tensor]) -> list[tuple]:
    """The sets of :class:`StackedSums` (vectors of equal length and dtypes) with new
    stacks."""
    key = lambda i: (vectors[i].numel(), vectors[i].dtype, outs[i].dtype)  # noqa: E731
    sets = []
    for indices in partition(range(len(vectors)), key):
        first = vectors[indices[0]]
        stack = first.new_empty((len(indices), first.numel()))
        sums = outs[indices[0]].new_empty((len(indices), 1))
        set_outs = [outs[i] for i in indices]
        sets.append((indices, stack, list(stack.unbind()), sums, list(sums.unbind()), set_outs))
    return sets


# bytes: where the allocators start a tensor. A stack's rows start on such a boundary, as
# tensors of their own would: some CPU GEMM kernels round differently at other alignments
# (float64 products of a row view at an odd offset were seen to)
_ROW_ALIGNMENT = 64


class ResidentStacks:
    """State entries of a group of layers as the rows of one stack per entry, so that the
    group's update reads and writes them a few calls for all, with no Python object per
    row and step.

    Made for the entries under ``keys`` of each state: tensors, or with ``named`` dicts of
    named tensors (a structured factor's parts). :meth:`of` returns, for the states of
    ``layers`` (equal shapes, dtypes and device from state to state), the stacks {key: (L,
    *shape)} (with ``named``: {key: {name: (L, *shape)}}) whose rows are the states'
    entries. The first call, and a call after an entry was replaced (``load_state_dict``
    puts new tensors in the state), copies the entries into new stacks and puts the
    stacks' rows into the states in their place: the same values, shapes and dtypes, each
    row aligned as a tensor of its own (:data:`_ROW_ALIGNMENT`; a stack whose rows are
    padded for it is not contiguous), now views of the stacks (a saved state dict or DCP
    checkpoint holds only the rows). A state dict taken before that call still refers to
    the replaced tensors. A layer belongs to the stacks of its last call only: the stacks
    kept for other calls with one of its layers are let go then (after a load, the
    replaced stacks are held until the next call for their layers).

    Within one optimizer step (between :meth:`open_step` and :meth:`close_step`) a layout
    found whole is trusted for the rest of the step: only the optimizer's own code runs
    there, and it replaces the entries under ``keys`` by :meth:`of` alone, so a later
    call for the same layers and state dicts skips the walk over the entries.
    """

    def __init__(self, keys: tuple[str, ...], named: bool) -> None:
        self._keys, self._named = keys, named
        # id of the first layer -> (layers, where the rows are, stacks); where the rows
        # are: (key, name or None, the rows put into the states under them)
        self._kept: dict[int, tuple[list, list[tuple], dict]] = {}
        # id of a kept stack -> (the stack, the buffer of gathered())
        self._scratch: dict[int, tuple[Tensor, Tensor]] = {}
        self._known_rows = KnownStacks()  # gathered(): tensors that are a stack's rows
        # in a step: id of the first layer -> (the states found to hold the rows, stacks)
        self._trusted: dict[int, tuple[list, dict]] | None = None

    def open_step(self) -> None:
        """A step starts: layouts found whole from here on are trusted until
        :meth:`close_step`."""
        self._trusted = {}

    def close_step(self) -> None:
        """The step ended (or raised): every call checks the entries again."""
        self._trusted = None

    def kept(self, layers: Sequence, states: Sequence[dict]) -> dict | None:
        """The stacks of :meth:`of` when they are kept for exactly ``layers`` and the
        states still hold their rows (and, with ``named``, no other parts), else None
        (nothing changes). The states are read by C calls alone (no Python call a row)."""
        kept = self._kept.get(id(layers[0]))
        if kept is None or len(kept[0]) != len(layers) or not all(map(is_, layers, kept[0])):
            return None
        trusted = None if self._trusted is None else self._trusted.get(id(layers[0]))
        if (
            trusted is not None
            and trusted[1] is kept[2]
            and len(trusted[0]) == len(states)
            and all(map(is_, states, trusted[0]))
        ):
            return kept[2]
        for key, name, rows in kept[1]:
            entries = map(operator.itemgetter(key), states)
            if name is not None:
                parts = list(entries)
                if any(map(operator.ne, map(len, parts), repeat(len(kept[2][key])))):
                    return None
                entries = map(dict.get, parts, repeat(name))
            if not all(map(is_, entries, rows)):
                return None
        if self._trusted is not None:
            self._trusted[id(layers[0])] = (list(states), kept[2])
        return kept[2]

    def holds(self, stacks: dict) -> bool:
        """Whether ``stacks`` (a return of :meth:`of`) are kept still."""
        return any(entry[2] is stacks for entry in self._kept.values())

    def kept_alike(self, layers: Sequence[Layer], states: Sequence[dict]) -> dict | None:
        """:meth:`kept`, when the layers' weights also still share one dtype and device (a
        group key may hold them beside the entries' own, which kept stacks share)."""
        if len(set(map(_WEIGHT_DTYPE_DEVICE, layers))) != 1:
            return None
        return self.kept(layers, states)

    def gathered(self, stack: Tensor, tensors: Sequence[Tensor]) -> Tensor:
        """A tensor of ``stack``'s shape and dtype (one of :meth:`of`'s stacks) whose rows
        are ``tensors``, for elementwise ops (one op on it is the same op on each row):
        the stack ``tensors`` are the rows of, when they are (the statistics the step
        gathered, found by :class:`KnownStacks`), else ``torch.stack(tensors)`` into a
        buffer kept with ``stack``. A warm call allocates nothing."""
        known = self._known_rows(tensors)
        if known is not None and _SHAPE_DTYPE_DEVICE(known) == _SHAPE_DTYPE_DEVICE(stack):
            return known
        entry = self._scratch.get(id(stack))
        if entry is None or entry[0] is not stack:
            buffer = torch.empty(stack.shape, dtype=stack.dtype, device=stack.device)
            entry = self._scratch[id(stack)] = (stack, buffer)
        return torch.stack(tensors, out=entry[1])

    def of(self, layers: Sequence, states: Sequence[dict]) -> dict:
        kept = self.kept(layers, states)
        if kept is not None:
            return kept
        placed = []  # (key, name or None, rows)
        if self._named:
            stacks = {
                key: {
                    name: _aligned_stack([s[key][name] for s in states]) for name in states[0][key]
                }
                for key in self._keys
            }
            for key, parts in stacks.items():
                for name, stack in parts.items():
                    rows = stack.unbind(0)
                    for state, row in zip(states, rows, strict=True):
                        state[key][name] = row
                    placed.append((key, name, rows))
        else:
            stacks = {key: _aligned_stack([s[key] for s in states]) for key in self._keys}
            for key, stack in stacks.items():
                rows = stack.unbind(0)
                for state, row in zip(states, rows, strict=True):
                    state[key] = row
                placed.append((key, None, rows))
        members = set(map(id, layers))
        self._kept = {
            first: entry
            for first, entry in self._kept.items()
            if members.isdisjoint(map(id, entry[0]))
        }
        self._kept[id(layers[0])] = (list(layers), placed, stacks)
        live = {id(stack) for entry in self._kept.values() for stack in _stacks_in(entry[2])}
        self._scratch = {i: entry for i, entry in self._scratch.items() if i in live}
        return stacks


def _stacks_in(stacks: dict) -> list[Tensor]:
    """The tensors of :meth:`ResidentStacks.of`'s {key: stack} or {key: {name: stack}}."""
    values = stacks.values()
    return [t for v in values for t in (v.values() if isinstance(v, dict) else (v,))]


def _aligned_stack(tensors: Sequence[Tensor]) -> Tensor:
    """Copies of ``tensors`` (equal shapes, dtypes and device) as the rows of a new (L,
    *shape) stack, each row starting on a :data:`_ROW_ALIGNMENT` boundary."""
    first = tensors[0]
    size = first.element_size()
    row = -(-first.numel() * size // _ROW_ALIGNMENT) * _ROW_ALIGNMENT // size  # padded
    buffer = first.new_empty((len(tensors), row))
    stack = buffer[:, : first.numel()].unflatten(1, first.shape)
    torch._foreach_copy_(list(stack.unbind(0)), list(tensors))
    return stack


_BASE = operator.attrgetter("_base")
_WEIGHT_DTYPE_DEVICE = operator.attrgetter("weight.dtype", "weight.device")


def stack_of_rows(rows: Sequence[Tensor]) -> Tensor | None:
    """The (L, *shape) view whose rows are exactly ``rows``, in order, when they lie as the
    rows of a stack do (two or more views of one base with equal shapes, strides and
    dtypes, row i at the first's offset + i x a pitch no smaller than a row: what
    :class:`ResidentStacks` puts into the states); else None. The view covers the rows'
    elements only, not a padding between them, so one op on it is the same op on each
    row."""
    first = rows[0]
    base = first._base
    if base is None or len(rows) < 2 or first.numel() == 0:
        return None
    offsets = list(map(Tensor.storage_offset, rows))
    start, pitch = offsets[0], offsets[1] - offsets[0]
    spans = zip(first.shape, first.stride(), strict=True)
    extent = sum((size - 1) * stride for size, stride in spans) + 1  # elements a row spans
    if (
        extent > pitch
        or offsets != list(range(start, start + pitch * len(rows), pitch))
        or not all(map(is_, map(_BASE, rows), [base] * len(rows)))
        or len(set(map(_SHAPE_DTYPE, rows))) != 1
        or len(set(map(Tensor.stride, rows))) != 1
    ):
        return None
    return base.as_strided((len(rows), *first.shape), (pitch, *first.stride()), start)


class KnownStacks:
    """:func:`stack_of_rows`, answering a call with the same row tensors (the same
    objects, in order) as one of its last calls by identity: one C-level comparison
    instead of the layout checks (about 1 against 22 µs for 64 rows). The library never
    changes a row's metadata in place, so the same objects lie where they lay. Keeps at
    most ``size`` answers (their rows, so that an id is not reused while kept)."""

    def __init__(self, size: int = 16) -> None:
        self._size = size
        self._known: dict[int, tuple[list[Tensor], Tensor | None]] = {}

    def __call__(self, rows: Sequence[Tensor]) -> Tensor | None:
        known = self._known.get(id(rows[0]))
        if known is not None and len(known[0]) == len(rows) and all(map(is_, rows, known[0])):
            return known[1]
        stack = stack_of_rows(rows)
        if len(self._known) >= self._size:  # (rows of many groups: start over)
            self._known.clear()
        self._known[id(rows[0])] = (list(rows), stack)
        return stack


def stacked_gradients(
    layers: Sequence[Layer], dtype: torch.dtype, start: int = 0, inv_scale: Tensor | None = None
) -> Tensor:
    """Columns ``start``.. of G (:func:`~singd_cuda.curvature.layers.gradient_matrix`) of
    every layer, stacked: (L, d_C, d_K - start) in ``dtype``, the bias gradient as the last
    column; zeros for a parameter without a gradient; times ``inv_scale`` (a scalar
    tensor) when given. ``start`` must not pass the weight's columns. Layers of one
    layout (:func:`_one_layout`) with every gradient present: a stack of their weight
    gradients and one of their bias gradients, copied in; else one foreach copy of
    per-layer views."""
    first = layers[0]
    out = torch.empty(
        len(layers), first.dim_out, first.dim_in - start, dtype=dtype, device=first.weight.device
    )
    if _one_layout(layers):
        weights = [layer.weight.grad for layer in layers]
        biases = [layer.bias.grad for layer in layers] if first.bias is not None else []
        # (by type: `None in` a list of tensors compares each with ==, a Python call)
        if type(None) not in set(map(type, weights + biases)):
            stacked = torch.stack(weights).reshape(len(layers), first.dim_out, -1)
            if biases:
                out[:, :, :-1].copy_(stacked[:, :, start:])
                out[:, :, -1].copy_(torch.stack(biases))
            else:
                out.copy_(stacked[:, :, start:])
            if inv_scale is not None:
                out.mul_(inv_scale.to(dtype))
            return out
    targets, sources = [], []
    for i, layer in enumerate(layers):
        weight_cols = out[i, :, :-1] if layer.bias is not None else out[i]
        for param, target in ((layer.weight, weight_cols), (layer.bias, out[i, :, -1])):
            if param is None:
                continue
            if param.grad is None:
                target.zero_()
                continue
            grad = param.grad.detach()
            targets.append(target)
            is_weight = param is layer.weight
            sources.append(layer.kind.weight_matrix(grad)[:, start:] if is_weight else grad)
    if targets:
        torch._foreach_copy_(targets, sources)
    if inv_scale is not None:
        out.mul_(inv_scale.to(dtype))
    return out


def split_matrices(layers: Sequence[Layer], matrices: Tensor | Sequence[Tensor]) -> list[Tensor]:
    """:func:`~singd_cuda.curvature.layers.split_matrix` of every layer's (d_C, d_K)
    matrix, concatenated in parameter order (weight, bias of the first layer, ...).
    ``matrices``: one per layer, or their stack (L, d_C, d_K); a stack of layers of one
    layout (:func:`_one_layout`) is split by a few views for all."""
    if isinstance(matrices, Tensor) and _one_layout(layers):
        first, count = layers[0], len(layers)
        if first.bias is None:
            return list(matrices.reshape(count, *first.weight.shape).unbind(0))
        weights = matrices[:, :, :-1].reshape(count, *first.weight.shape).unbind(0)
        biases = matrices[:, :, -1].reshape(count, *first.bias.shape).unbind(0)
        return list(chain.from_iterable(zip(weights, biases, strict=True)))
    return list(chain.from_iterable(map(split_matrix, layers, matrices)))


_LAYOUT = operator.attrgetter("kind", "weight.shape", "dim_in")


def _one_layout(layers: Sequence[Layer]) -> bool:
    """Whether ``layers`` share their kind, weight shape and d_K (so their bias presence
    too), with the kind's weight matrix its weight reshaped (LayerKind's own): their
    weight matrices are then one reshape of their stacked weights (and back)."""
    kind = layers[0].kind
    return (
        type(kind).weight_matrix is LayerKind.weight_matrix
        and type(kind).weight_from_matrix is LayerKind.weight_from_matrix
        and len(set(map(_LAYOUT, layers))) == 1
    )


class StackedProduct:
    """L matrices P_l (the cached K Kᵀ or C Cᵀ of L layers) in one stacked form:
    :meth:`matmul_` computes P_l X_l in place, :meth:`gradients_times_transpose` G_l P_lᵀ
    from the layers' gradients.

    Built by :meth:`stack` from the per-layer forms that ``times_transpose`` returns:
    :class:`Dense` (stacked (L, d, d)), :class:`BlockDiagonal` (blocks
    (L, n, b, b) and trailing blocks (L, r, r); batched products over strided views, a few
    per layer, since one call over every block of every layer would need copies of X)
    and :class:`SymmetricArrow` (border rows (L, k, d) and middle diagonals (L, m)).
    """

    KINDS = (Dense, BlockDiagonal, SymmetricArrow)

    def __init__(self, kind: type, parts: dict[str, Tensor], k1: int = 0) -> None:
        self.kind, self.parts, self.k1 = kind, parts, k1

    @classmethod
    def stackable(cls, product: object) -> bool:
        return isinstance(product, cls.KINDS)

    @classmethod
    def stack(cls, products: Sequence[object]) -> StackedProduct:
        parts = {name: torch.stack([p.parts[name] for p in products]) for name in products[0].parts}
        return cls.like(products[0], parts)

    @classmethod
    def like(cls, product: object, parts: dict[str, Tensor]) -> StackedProduct:
        """The stacked form, over ``parts`` (a leading layer dimension), of products of
        ``product``'s kind and shape."""
        kind = next(k for k in cls.KINDS if isinstance(product, k))
        return cls(kind, parts, product.k1 if kind is SymmetricArrow else 0)

    def _parts(self, dtype: torch.dtype) -> tuple[torch.dtype, dict[str, Tensor]]:
        dtype = torch.promote_types(next(iter(self.parts.values())).dtype, dtype)
        return dtype, {name: part.to(dtype) for name, part in self.parts.items()}

    def matmul_(self, X: Tensor) -> Tensor:
        """X_l <- P_l X_l for X of shape (L, d, n), in place when X has the dtype
        promote(P, X) (else in a converted copy); returns the result. Temporaries: a few
        columns (dense, :data:`_CHUNK_ELEMENTS`), a few blocks' rows (block-diagonal, up
        to :data:`_BLOCK_ROWS_FRACTION` of X), the border rows (arrow)."""
        dtype, parts = self._parts(X.dtype)
        X = X.to(dtype)
        if self.kind is Dense:
            return _dense_matmul_(parts["mat"], X)
        if self.kind is BlockDiagonal:
            return _block_diagonal_matmul_(parts["blocks"], parts["last"], X)
        return _arrow_matmul_(self.k1, parts["border"], parts["middle"], X)

    def gradients_times_transpose(
        self, layers: Sequence[Layer], dtype: torch.dtype, inv_scale: Tensor | None
    ) -> Tensor:
        """G_l P_lᵀ · inv_scale for the gradients G_l of ``layers`` (as
        :func:`stacked_gradients`; ``inv_scale`` a scalar tensor or None for 1): (L, d_C,
        d_K) in promote(P, dtype), row-major like the gradients. One gradient-sized
        allocation: block-diagonal P reads the weight gradients where they lie, the other
        kinds multiply a stacked copy of G."""
        dtype, parts = self._parts(dtype)
        if self.kind is BlockDiagonal:
            if inv_scale is not None:  # scaling the b x b blocks is cheaper than scaling G
                parts = {name: part * inv_scale.to(dtype) for name, part in parts.items()}
            return _block_diagonal_gradients_times_transpose(
                layers, parts["blocks"], parts["last"], dtype
            )
        G = stacked_gradients(layers, dtype, inv_scale=inv_scale)
        if self.kind is Dense:
            return _dense_matmul_(parts["mat"], G, transposed=True)
        return _arrow_matmul_transposed_(self.k1, parts["border"], parts["middle"], G)


# Stacks of at most this many values take one batched product for all their layers; above
# it, the in-place products run through temporaries of this many values (a small fraction
# of a gradient, so that a step allocates about one gradient)...
_CHUNK_ELEMENTS = 1 << 16
# ...or, for the block-diagonal rows, up to this fraction of the stack when that is more:
# 256 KiB of rows took about 200 calls per GPT-2 MLP layer, a host-bound GPU step; a few
# calls per layer now (each block's product is the same, so the results are too)
_BLOCK_ROWS_FRACTION = 1 / 16


def _dense_matmul_(mats: Tensor, X: Tensor, transposed: bool = False) -> Tensor:
    """X_l <- P_l X_l for P (L, d, d), X (L, d, m), a few columns at a time; with
    ``transposed``, X_l <- X_l P_lᵀ for X (L, m, d), a few rows at a time. Returns X."""
    if X.numel() <= _CHUNK_ELEMENTS:  # small layers: one batched product for all
        return X.copy_(torch.matmul(X, mats.mT) if transposed else torch.matmul(mats, X))
    d = X.shape[2] if transposed else X.shape[1]
    m = X.shape[1] if transposed else X.shape[2]
    step = max(1, min(m, _CHUNK_ELEMENTS // max(d, 1)))
    buffer = X.new_empty((step, d) if transposed else (d, step))
    for layer, P in enumerate(mats):
        for j in range(0, m, step):
            if transposed:
                chunk = X[layer, j : j + step]
                out = torch.mm(chunk, P.mT, out=buffer[: chunk.shape[0]])
            else:
                chunk = X[layer, :, j : j + step]
                out = torch.mm(P, chunk, out=buffer[:, : chunk.shape[1]])
            chunk.copy_(out)
    return X


def _block_diagonal_matmul_(blocks: Tensor, last: Tensor, X: Tensor) -> Tensor:
    """X_l <- blockdiag(blocks_l, last_l) X_l for blocks (L, n, b, b), last (L, r, r), X
    (L, d, m), through one temporary of a few blocks' rows; returns X."""
    L, n, b, _ = blocks.shape
    m = X.shape[2]
    if L * n * b * m <= _CHUNK_ELEMENTS:  # small layers: one batched product for all
        head = X[:, : n * b].unflatten(1, (n, b))  # (L, n, b, m)
        head.copy_(torch.matmul(blocks, head))
    else:
        elements = max(_CHUNK_ELEMENTS, int(X.numel() * _BLOCK_ROWS_FRACTION))
        step = max(1, min(n, elements // max(b * m, 1)))
        rows = X.new_empty(step, b, m)
        for x, layer_blocks in zip(X, blocks, strict=True):
            for i in range(0, n, step):
                k = min(step, n - i)
                chunk = x[i * b : (i + k) * b].view(k, b, m)
                chunk.copy_(torch.bmm(layer_blocks[i : i + k], chunk, out=rows[:k]))
    if last.shape[1]:
        tail = X[:, n * b :]
        tail.copy_(torch.bmm(last, tail))
    return X


def _block_diagonal_gradients_times_transpose(
    layers: Sequence[Layer], blocks: Tensor, last: Tensor, dtype: torch.dtype
) -> Tensor:
    """G_l blockdiag(blocks_l, last_l)ᵀ for the gradients G_l of ``layers``: (L, d_C, d_K)
    in ``dtype``. Column block j of the result is G_l[:, block j] blocks_l[j]ᵀ: one batched
    product per layer over strided views of the weight gradient (no copy of G), written
    into the result in place; the trailing r columns (weight and bias) are gathered."""
    L, n, b, _ = blocks.shape
    first = layers[0]
    head_width = n * b
    if L * first.dim_out * first.dim_in <= _CHUNK_ELEMENTS:  # small layers: a stacked copy
        G = stacked_gradients(layers, dtype)  # of G and one batched product for all
        head = G[:, :, :head_width].unflatten(2, (n, b)).transpose(1, 2)  # (L, n, d_C, b)
        G[:, :, :head_width] = torch.matmul(head, blocks.mT).transpose(1, 2).flatten(2)
        if last.shape[1]:
            G[:, :, head_width:] = torch.bmm(G[:, :, head_width:], last.mT)
        return G
    out = torch.empty(L, first.dim_out, first.dim_in, dtype=dtype, device=blocks.device)
    for index, layer in enumerate(layers):
        target = out[index, :, :head_width].unflatten(1, (n, b)).transpose(0, 1)  # (n, d_C, b)
        grad = layer.weight.grad
        if layer.dim_in - (layer.bias is not None) < head_width:  # a block holds the bias
            W = gradient_matrix(layer, dtype)
        elif grad is None:
            target.zero_()
            continue
        else:
            W = layer.kind.weight_matrix(grad.detach()).to(dtype)
        head = W[:, :head_width].unflatten(1, (n, b)).transpose(0, 1)
        torch.bmm(head, blocks[index].mT, out=target)
    if last.shape[1]:
        tails = stacked_gradients(layers, dtype, start=head_width)
        torch.bmm(tails, last.mT, out=out[:, :, head_width:])
    return out


def _arrow_matmul_(k1: int, border: Tensor, middle: Tensor, X: Tensor) -> Tensor:
    """X_l <- P_l X_l for the symmetric arrows P_l of :class:`SymmetricArrow`: border (L,
    k1 + k2, d), middle (L, m), X (L, d, n); temporaries of the border rows only; returns X."""
    s = k1 + middle.shape[1]
    rows = torch.bmm(border, X)
    X_border = torch.cat([X[:, :k1], X[:, s:]], dim=1)
    X[:, k1:s].mul_(middle[:, :, None]).baddbmm_(border[:, :, k1:s].mT, X_border)
    X[:, :k1], X[:, s:] = rows[:, :k1], rows[:, k1:]
    return X


def _arrow_matmul_transposed_(k1: int, border: Tensor, middle: Tensor, X: Tensor) -> Tensor:
    """X_l <- X_l P_lᵀ = X_l P_l (P symmetric) for X (L, n, d): the products of
    :func:`_arrow_matmul_` on X.mT, on row-major X; returns X."""
    s = k1 + middle.shape[1]
    cols = torch.bmm(X, border.mT)  # the border columns
    X_border = torch.cat([X[:, :, :k1], X[:, :, s:]], dim=2)
    X[:, :, k1:s].mul_(middle[:, None, :]).baddbmm_(X_border, border[:, :, k1:s])
    X[:, :, :k1], X[:, :, s:] = cols[:, :, :k1], cols[:, :, k1:]
    return X
