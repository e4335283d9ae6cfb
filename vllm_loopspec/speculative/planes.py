"""Every loop plane of a layer as one KV view, so that a pipelined pass runs
the attention of all its loop groups in one call (issue 12, RFC §7).

A pipelined pass holds tokens at several loops; each loop has its own KV
plane (its own vLLM ``Attention`` layer), so the pass would make one
attention call per loop group and layer, and on this CPU a call through
vLLM's ``Attention`` costs ~70 µs, of which ~20 µs are the kernels. vLLM
0.32 allocates every layer's cache in one backing buffer, and each layer's
view is ``[blocks, ...]`` with the same strides. Where the ``R`` planes of a
physical layer lie at whole-block distances from each other, one view over
that range addresses all of them: plane ``u``'s block ``b`` is block
``offset[u] + b`` of it. Nothing is reallocated or rebound (KV connectors,
prefix caching and the scheduler see the same caches); where the layout
does not allow it, :func:`stack_loop_planes` returns ``None`` and passes
keep one call per group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StackedPlanes:
    caches: tuple[torch.Tensor, ...]  # per physical layer: one view over every loop plane's blocks
    block_offset: tuple[int, ...]  # per loop: where its plane's block 0 is in those views
    block_size: int


def plane_offsets(planes: list[torch.Tensor]) -> list[int] | None:
    """Block offsets of each plane from the first one, or None unless every
    plane has the first one's shape and strides, shares its storage and
    starts a whole number of blocks away from it."""
    first = planes[0]
    block = first.stride(0)
    offsets = []
    for plane in planes:
        if (plane.shape != first.shape or plane.stride() != first.stride() or plane.dtype != first.dtype
                or plane.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()):
            return None
        distance = plane.storage_offset() - first.storage_offset()
        if distance % block:
            return None
        offsets.append(distance // block)
    return offsets


def stack_loop_planes(kv_caches: dict[str, torch.Tensor], layer_name, num_layers: int, num_loops: int,
                      block_size: int) -> StackedPlanes | None:
    """One view per physical layer over its ``num_loops`` planes
    (``layer_name(loop, layer)`` names them in ``kv_caches``), or None where
    the layout does not allow it or differs between layers."""
    views, common = [], None
    for layer in range(num_layers):
        planes = [kv_caches.get(layer_name(u, layer)) for u in range(num_loops)]
        if any(not isinstance(p, torch.Tensor) or p.dim() < 2 for p in planes):
            return None
        offsets = plane_offsets(planes)
        if offsets is None or (common is not None and offsets != common):
            return None
        common = offsets
        views.append((planes[0], min(offsets), max(offsets)))
    low = min(common)
    caches = tuple(torch.as_strided(first, (top - low + first.shape[0], *first.shape[1:]), first.stride(),
                                    first.storage_offset() + low * first.stride(0))
                   for first, low, top in views)
    return StackedPlanes(caches=caches, block_offset=tuple(o - low for o in common), block_size=block_size)
