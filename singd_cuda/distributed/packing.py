"""Packing many small tensors into few flat buffers, and the bucketed collectives.

Statistics travel in their compact form: a dense symmetric matrix (K-FAC's A and G,
SINGD's dense H_K) as its upper triangle, a block-diagonal one as the upper triangles
of its blocks, any other structure as its own storage tensors (``parts``). Segments are
laid out in a fixed order and cut into buckets of whole segments of at most
``cap_bytes`` each (a single larger segment gets a bucket of its own, as in DDP), so
one update step costs one collective per bucket, not one per layer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..structures.base import StructuredMatrix
from . import comm

# Parts that hold symmetric square matrices (or batches of them) in a statistic H = Π̂(YᵀY).
SYMMETRIC_PARTS = {"dense": ("mat",), "block_diagonal": ("blocks", "last")}


def statistic_tensors(value: Tensor | StructuredMatrix) -> list[tuple[Tensor, bool]]:
    """(storage tensor, is symmetric) pairs of one statistic.

    A plain 2-D square tensor is a symmetric Gram matrix by the LayerRule contract;
    for structures, only the parts listed in :data:`SYMMETRIC_PARTS` are.
    """
    if isinstance(value, StructuredMatrix):
        symmetric = SYMMETRIC_PARTS.get(type(value).name, ())
        return [(part, name in symmetric) for name, part in value.parts.items()]
    return [(value, value.dim() == 2 and value.shape[0] == value.shape[1])]


def packed_numel(tensor: Tensor, symmetric: bool) -> int:
    """Elements on the wire: n(n+1)/2 per symmetric n x n matrix, else all of them."""
    if not symmetric:
        return tensor.numel()
    n = tensor.shape[-1]
    return (tensor.numel() // max(n * n, 1)) * (n * (n + 1) // 2) if n else 0


def _upper(n: int, device) -> tuple[Tensor, Tensor]:
    rows, cols = torch.triu_indices(n, n, device=device)
    return rows, cols


def pack_tensor(tensor: Tensor, symmetric: bool, dtype: torch.dtype) -> Tensor:
    """``tensor`` as a flat vector in ``dtype`` (upper triangles when symmetric)."""
    if symmetric and tensor.numel():
        rows, cols = _upper(tensor.shape[-1], tensor.device)
        tensor = tensor[..., rows, cols]
    return tensor.reshape(-1).to(dtype)


def unpack_tensor_(tensor: Tensor, symmetric: bool, flat: Tensor) -> None:
    """Inverse of :func:`pack_tensor`, in place (a symmetric matrix gets both triangles)."""
    if not tensor.numel():
        return
    if not symmetric:
        tensor.copy_(flat.view(tensor.shape))
        return
    n = tensor.shape[-1]
    rows, cols = _upper(n, tensor.device)
    values = flat.view(*tensor.shape[:-2], -1).to(tensor.dtype)
    tensor[..., rows, cols] = values
    tensor[..., cols, rows] = values


@dataclass
class Segment:
    """One contiguous piece of a packed buffer: how to fill it and what to do with the sum."""

    numel: int
    pack: Callable[[torch.dtype], Tensor]
    unpack: Callable[[Tensor], None]


def buckets(sizes: Sequence[int], cap_elements: int) -> list[range]:
    """Consecutive index ranges of whole segments of at most ``cap_elements`` each."""
    out, start, filled = [], 0, 0
    for index, size in enumerate(sizes):
        if index > start and filled + size > cap_elements:
            out.append(range(start, index))
            start, filled = index, 0
        filled += size
    if start < len(sizes):
        out.append(range(start, len(sizes)))
    return out


def all_reduce_segments(
    segments: Sequence[Segment],
    *,
    dtype: torch.dtype,
    device: torch.device,
    cap_bytes: int,
    group=None,
) -> int:
    """Sum every segment over the ranks, bucket by bucket; returns the collectives issued.

    Buckets are reduced in order and each segment is unpacked as soon as its bucket
    is back, so a segment may read what an earlier segment unpacked (the flags).
    """
    element = torch.empty((), dtype=dtype).element_size()
    plan = buckets([s.numel for s in segments], max(1, cap_bytes // element))
    for bucket in plan:
        chosen = [segments[i] for i in bucket]
        buffer = torch.cat([s.pack(dtype).to(device) for s in chosen])
        comm.all_reduce_sum_(buffer, group)
        offset = 0
        for segment in chosen:
            segment.unpack(buffer[offset : offset + segment.numel])
            offset += segment.numel
    return len(plan)


_ALIGN = 8  # bytes; every tensor starts aligned so that a byte slice views as its dtype


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def gather_plan(sizes_by_rank: Sequence[Sequence[int]], cap_bytes: int) -> list[list[range]]:
    """Buckets for :func:`all_gather_tensors`: per bucket, each rank's range of tensors.

    Each rank's chunk in a bucket holds at most cap_bytes / world bytes (the gathered
    buffer at most ``cap_bytes``), but at least one tensor while it has any left.
    """
    world = len(sizes_by_rank)
    limit = max(_ALIGN, cap_bytes // max(world, 1))
    next_index = [0] * world
    plan = []
    while any(next_index[r] < len(sizes_by_rank[r]) for r in range(world)):
        bucket = []
        for r, sizes in enumerate(sizes_by_rank):
            start = stop = next_index[r]
            filled = 0
            while stop < len(sizes) and (stop == start or filled + _aligned(sizes[stop]) <= limit):
                filled += _aligned(sizes[stop])
                stop += 1
            bucket.append(range(start, stop))
            next_index[r] = stop
        plan.append(bucket)
    return plan


def all_gather_tensors(
    tensors_by_rank: Sequence[Sequence[Tensor]],
    rank: int,
    *,
    device: torch.device,
    cap_bytes: int,
    group=None,
) -> int:
    """Copy every rank's own tensors into the other ranks' replicas, exactly (as bytes).

    ``tensors_by_rank[r]`` are the tensors rank r holds the current values of, the same
    list (by shape, dtype and order) on every rank. Returns the collectives issued.
    """
    sizes = [[t.numel() * t.element_size() for t in ts] for ts in tensors_by_rank]
    world = len(tensors_by_rank)
    plan = gather_plan(sizes, cap_bytes)
    for bucket in plan:
        chunk_bytes = max(sum(_aligned(sizes[r][i]) for i in bucket[r]) for r in range(world))
        chunk = torch.zeros(chunk_bytes, dtype=torch.uint8, device=device)
        offset = 0
        for i in bucket[rank]:
            own = tensors_by_rank[rank][i].detach().contiguous().reshape(-1)
            chunk[offset : offset + sizes[rank][i]] = own.view(torch.uint8).to(device)
            offset += _aligned(sizes[rank][i])
        gathered = torch.empty(world * chunk_bytes, dtype=torch.uint8, device=device)
        comm.all_gather_(gathered, chunk, group)
        for r in range(world):
            if r == rank:
                continue
            offset = r * chunk_bytes
            for i in bucket[r]:
                target = tensors_by_rank[r][i]
                raw = gathered[offset : offset + sizes[r][i]]
                target.copy_(raw.view(target.dtype).view(target.shape))
                offset += _aligned(sizes[r][i])
    return len(plan)


def total_numel(segments: Iterable[Segment]) -> int:
    return sum(s.numel for s in segments)
