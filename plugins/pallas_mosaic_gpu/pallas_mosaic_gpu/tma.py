"""TMA copies of boxes larger than one TMA copy moves.

One TMA copy (``cp.async.bulk.tensor``) moves a box of at most :data:`MAX_BOX` elements per
dimension, and the SMEM side of the box must be contiguous. Larger untiled blocks are copied
here as follows:

* a minor dimension above :data:`MAX_BOX` is cut into rows of ``t`` elements (``t`` divides
  the block's and the GMEM array's minor dimension, at most :data:`MAX_BOX`, ``t`` elements a
  multiple of 16 bytes): the GMEM array is viewed as ``(..., n // t, t)`` (a 1-D
  ``TileTransform``) and the SMEM buffer as ``(..., m // t, t)``, which is the same memory in
  the same order, so one box of one more dimension moves it;
* a leading dimension above :data:`MAX_BOX` is split into several copies of at most
  :data:`MAX_BOX` along it, each into a contiguous part of the SMEM buffer (the dimensions in
  front of it are copied one index at a time).

The copies of one split load complete one barrier phase together: its transaction bytes are
announced once, for the whole block, before the first copy starts. The copies of one split
store form one bulk group, as an unsplit store does, so ``wait_smem_to_gmem(n)`` counts them
as one copy. Tiled (swizzled) buffers have boxes of (8, 64)-element tiles and are never split.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.experimental.mosaic import gpu as mgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith

from pallas_core.backend import UnsupportedError
from pallas_mosaic_gpu import values

MAX_BOX = 256
"""The largest extent of one dimension of a TMA copy's box."""


def minor_tile(minor: int, gmem_minor: int, itemsize: int) -> int | None:
    """The length ``t`` that a copy's minor dimension of ``minor`` elements is cut into (the
    dimension itself when it fits one box), for a GMEM array whose minor dimension is
    ``gmem_minor``; ``None`` when no length fits (``t`` divides both, ``t`` and ``minor // t``
    are at most ``MAX_BOX`` and ``t * itemsize`` is a multiple of 16 bytes)."""
    if minor <= MAX_BOX:
        return minor
    common = math.gcd(minor, gmem_minor)
    for t in range(min(common, MAX_BOX), 0, -1):
        if common % t == 0 and t * itemsize % 16 == 0 and minor // t <= MAX_BOX:
            return t
    return None


def split_problem(block: Sequence[int], gmem_minor: int, itemsize: int) -> str | None:
    """Why an untiled block of shape ``block`` cannot be copied by TMA (``None`` when it can):
    what fails and its fix, for an error message."""
    if not block:
        return None
    if minor_tile(block[-1], gmem_minor, itemsize) is None:
        return (f"its minor dimension of {block[-1]} elements is above {MAX_BOX}, the most one "
                f"TMA copy moves, and no row length of at most {MAX_BOX} elements (a multiple "
                f"of 16 bytes, at most {MAX_BOX} rows) divides both it and the array's minor "
                f"dimension ({gmem_minor}). "
                f"Fix: use a minor block dimension of at most {MAX_BOX}, or one dividing the "
                "array's minor dimension")
    big = [d for d, n in enumerate(block[:-1]) if n > MAX_BOX]
    if len(big) > 1:
        return (f"dimensions {big} are above {MAX_BOX}; a block is split along one of them "
                f"only. Fix: use blocks of at most {MAX_BOX} in all but one leading dimension")
    return None


def _index(v: Any) -> ir.Value:
    if isinstance(v, (int, np.integer)):
        return arith.constant(ir.IndexType.get(), int(v))
    return v if isinstance(v.type, ir.IndexType) else arith.index_cast(ir.IndexType.get(), v)


def _static(v: Any) -> int | None:
    """The value of ``v`` when it is a constant."""
    if isinstance(v, (int, np.integer)):
        return int(v)
    owner = getattr(v, "owner", None)
    op = getattr(owner, "opview", None)
    if isinstance(op, arith.ConstantOp) and isinstance(op.value, ir.IntegerAttr):
        return int(ir.IntegerAttr(op.value).value)
    return None


def _chunks(shape: Sequence[int], big: int | None) -> list[tuple[tuple[int, int], ...]]:
    """(start, size) per dimension of every copy: dimensions before ``big`` one index at a time,
    ``big`` in pieces of at most MAX_BOX, the rest whole."""
    if big is None:
        return [tuple((0, n) for n in shape)]
    per_dim: list[list[tuple[int, int]]] = []
    for d, n in enumerate(shape):
        if d < big:
            per_dim.append([(i, 1) for i in range(n)])
        elif d == big:
            per_dim.append([(s, min(MAX_BOX, n - s)) for s in range(0, n, MAX_BOX)])
        else:
            per_dim.append([(0, n)])
    return list(itertools.product(*per_dim))


def copy(launch: Any, *, gmem: ir.Value, smem: ir.Value, window: Sequence[Any], to_smem: bool,
         barrier: Any = None, tiling: Any = None, swizzle: int | None = None,
         aligned: bool, kernel: str, commit: bool = True, predicate: Any = None,
         peer: Any = None, collective: Sequence[Any] = (), leader_tracked: Any = None) -> None:
    """A TMA copy between the GMEM ``window`` (``mgpu.ds`` slices and squeezed indices, one
    per GMEM dimension) and the whole SMEM ``smem``, in the direction ``to_smem`` says, split
    as the module docstring describes. ``tiling``/``swizzle``: the GMEM transform and swizzle of
    a tiled buffer (copied in one piece). ``aligned``: the window's minor start is known to be
    a multiple of its length (a pipeline's blocks); otherwise it must be a constant for a split
    minor dimension. ``commit``: a store closes its bulk group (otherwise
    ``commit_smem_to_gmem_group`` does later). ``predicate``: the thread that issues the copy
    (one of the warpgroup when ``None``). ``collective``, ``leader_tracked``: a copy into
    SMEM shared by the blocks of a cluster (:mod:`pallas_mosaic_gpu.cluster`), made in one
    piece. A copy that cannot be made raises ``UnsupportedError`` naming ``kernel``."""
    peer_arg = {} if peer is None else {"gmem_peer_id": peer}  # another device's GMEM
    def fail(what: str) -> UnsupportedError:
        return UnsupportedError(f"kernel {kernel!r}: {what}.")

    pair = dict(src_ref=gmem, dst_ref=smem) if to_smem else dict(src_ref=smem, dst_ref=gmem)
    if predicate is not None:
        pair["predicate"] = predicate
    if to_smem:
        pair["barrier"] = barrier
    smem_shape = list(ir.MemRefType(smem.type).shape)
    if collective:
        pair.update(collective=tuple(collective), leader_tracked=leader_tracked)
        if tiling is None and any(n > MAX_BOX for n in smem_shape):
            raise fail(f"a TMA copy of a {tuple(smem_shape)} block shared by the blocks of a "
                       f"cluster has a dimension above {MAX_BOX}, and shared copies are not "
                       f"split here. Fix: copy blocks of at most {MAX_BOX} per dimension")
    if tiling is not None or all(n <= MAX_BOX for n in smem_shape):
        launch.async_copy(**pair, gmem_slice=tuple(window), **peer_arg,
                          gmem_transform=(tiling,) if tiling is not None else (),
                          swizzle=swizzle, arrive=True if to_smem else commit)
        return
    gmem_ty = ir.MemRefType(gmem.type)
    itemsize = mgpu.utils.bitwidth(gmem_ty.element_type) // 8
    if not window:  # the whole GMEM array
        window = [mgpu.ds(0, n) for n in gmem_ty.shape]
    sliced = [d for d, w in enumerate(window) if isinstance(w, mgpu.DynamicSlice)]
    transform: tuple[Any, ...] = ()
    last = window[-1] if window else None
    if isinstance(last, mgpu.DynamicSlice) and last.length > MAX_BOX:
        problem = split_problem(smem_shape, gmem_ty.shape[-1], itemsize)
        if problem:
            raise fail(f"a TMA copy of a {tuple(smem_shape)} block: {problem}")
        t = minor_tile(last.length, gmem_ty.shape[-1], itemsize)
        assert t is not None  # split_problem said so
        start = _static(last.base)
        if not aligned and (start is None or start % t):
            raise fail(f"a TMA copy of a {tuple(smem_shape)} block whose minor window of "
                       f"{last.length} elements starts at a position not known to be a "
                       f"multiple of {t}; a minor dimension above {MAX_BOX} is copied in rows "
                       f"of {t}. Fix: start it at a constant multiple of {t}, or copy at most "
                       f"{MAX_BOX} elements of the minor dimension per copy")
        transform = (mgpu.TileTransform((t,)),)
        smem = mgpu.memref_unfold(smem, len(smem_shape) - 1, (None, t))
        smem_shape[-1:] = [last.length // t, t]
    elif smem_shape[-1] > MAX_BOX:
        raise fail(f"a TMA copy of a {tuple(smem_shape)} block whose minor dimension is above "
                   f"{MAX_BOX} and not the GMEM window's minor dimension. Fix: copy at most "
                   f"{MAX_BOX} elements of it per copy")
    n_lead = len(smem_shape) - (2 if transform else 1)  # SMEM dims the window slices
    big = [d for d, n in enumerate(smem_shape[:n_lead]) if n > MAX_BOX]
    if len(big) > 1:
        raise fail(f"a TMA copy of a {tuple(smem_shape)} block: dimensions {big} are above "
                   f"{MAX_BOX}. Fix: use blocks of at most {MAX_BOX} in all but one leading "
                   "dimension")
    chunks = _chunks(smem_shape, big[0] if big else None)
    if to_smem and len(chunks) > 1:
        nbytes = math.prod(smem_shape) * itemsize
        one = predicate if predicate is not None else \
            values.one_thread(mgpu.ThreadSubset.WARPGROUP)
        barrier.arrive_expect_tx(nbytes, predicate=one)
    for k, chunk in enumerate(chunks):
        sub_window = list(window)
        for d, (start, size) in zip(sliced[:n_lead], chunk[:n_lead]):
            w = window[d]
            sub_window[d] = mgpu.ds(arith.addi(_index(w.base), _index(start)), size)
        part = mgpu.memref_slice(smem, tuple(mgpu.ds(s, n) for s, n in chunk))
        pair["src_ref" if not to_smem else "dst_ref"] = part
        launch.async_copy(**pair, gmem_slice=tuple(sub_window), gmem_transform=transform,
                          **peer_arg,
                          arrive=(to_smem and len(chunks) == 1)
                          or (not to_smem and commit and k == len(chunks) - 1))
