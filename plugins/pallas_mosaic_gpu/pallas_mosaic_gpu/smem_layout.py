"""Which SMEM buffers of a kernel stay plain (untiled) although their shape could be tiled.

The backend tiles an SMEM buffer (8, 64) with a 128-byte swizzle when its two minor
dimensions are multiples of 64 in a 16-bit dtype (``values.is_tileable``), as wgmma reads
it. A kernel that views such a buffer through a slice or an index of one of those two
dimensions (JAX's ragged_dot stores a dynamic number of rows, ``o_smem.at[pl.ds(start, n)]``,
with TMA) cannot be served by that layout: a window of rows that is not a whole number of
(8, 64) tiles has no tiled address. Such buffers are left plain, which every TMA copy and
register load or store accepts (only wgmma needs the tiled layout, and refuses plain buffers
with an error naming it).

A buffer that ``plgpu.wgmma`` reads stays tiled even so: its minor slices must then fall on
whole tiles (``b_smem.at[:, pl.ds(wg * 128, 128)]``, see :mod:`tiled_slices`).

The analysis follows a ``pl.run_scoped`` Ref into the jaxprs it is passed to (``cond``
branches, loop bodies, nested calls and scopes) and looks at the indexers of every access.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from pallas_core import backend as plb
from pallas_core.backend import sub_jaxprs


def _static(v: Any) -> Any:
    """The Python value of a literal or constant leaf, else ``None`` (a traced value)."""
    if isinstance(v, plb.Literal):
        return v.val
    if isinstance(v, (int, np.integer)):
        return int(v)
    return None


def _slices_minor(transforms: Any, shape: tuple[int, ...]) -> bool:
    """Whether the indexers ``transforms`` cut one of the two minor dimensions of a buffer of
    ``shape``."""
    dims = list(range(len(shape)))  # which original dimensions are still present
    for t in transforms:
        indices = getattr(t, "indices", None)
        if type(t).__name__ == "TransposeTransform":  # the dimensions stay whole
            dims = [dims[p] for p in t.permutation]
            continue
        if indices is None:
            return True  # a transform other than indexing: keep the buffer plain
        left = []
        for k, i in zip(dims, indices):
            minor = k >= len(shape) - 2
            if isinstance(i, plb.Slice):
                start, size = _static(i.start), i.size
                if minor and not (start == 0 and size == shape[k]):
                    return True
                left.append(k)
            elif minor:
                return True
        dims = left + dims[len(indices):]
    return False


def minor_sliced(jaxpr: Any, var: Any, shape: tuple[int, ...]) -> bool:
    """Whether ``jaxpr`` (or a jaxpr it passes ``var`` to) views the Ref ``var`` through a
    slice or index of one of its two minor dimensions."""
    for eqn in jaxpr.eqns:
        positions = [k for k, v in enumerate(eqn.invars) if v is var]
        if not positions:
            continue
        tree = eqn.params.get("tree")
        if tree is not None and not sub_jaxprs(eqn.params):
            if _access_slices(eqn, positions, tree, shape):
                return True
            continue
        for sub, offset in _passed_to(eqn):
            for k in positions:
                j = k - offset
                if 0 <= j < len(sub.invars) and minor_sliced(sub, sub.invars[j], shape):
                    return True
    return False


_MMA_OPERANDS = {"gpu_wgmma": slice(1, None), "gpu_tcgen05_mma": slice(1, 3)}
"""The roles of a matmul's equation that are its SMEM operands (the accumulator is role 0)."""


def read_by_wgmma(jaxpr: Any, var: Any) -> bool:
    """Whether ``jaxpr`` (or a jaxpr it passes ``var`` to) gives the Ref ``var`` (a view of
    it) to ``plgpu.wgmma`` or ``plgpu.tcgen05_mma`` as an operand."""
    for eqn in jaxpr.eqns:
        positions = [k for k, v in enumerate(eqn.invars) if v is var]
        if not positions:
            continue
        operands = _MMA_OPERANDS.get(eqn.primitive.name)
        if operands is not None:
            if any(r in positions for r in eqn.params["roles"][operands]):
                return True
            continue
        for sub, offset in _passed_to(eqn):
            for k in positions:
                j = k - offset
                if 0 <= j < len(sub.invars) and read_by_wgmma(sub, sub.invars[j]):
                    return True
    return False


def _access_slices(eqn: Any, positions: list[int], tree: Any, shape: tuple[int, ...]) -> bool:
    """An access (``get``/``swap`` or one of this backend's primitives, whose transforms
    follow their Refs and values in ``eqn.invars``) that cuts a minor dimension of the Ref at
    ``positions``."""
    roles = eqn.params.get("roles")
    if roles is not None:  # this backend's primitives: a flat tree of per-role transforms
        n_refs = max(roles) + 1 if roles else 0
        leaves = eqn.invars[n_refs:n_refs + tree.num_leaves]
        per_role = jax.tree_util.tree_unflatten(tree, list(leaves))
        return any(r in positions and _slices_minor(ts, shape)
                   for r, ts in zip(roles, per_role))
    n_before = len(eqn.invars) - tree.num_leaves  # get: the Ref; swap: the Ref and the value
    if 0 not in positions:
        return False
    transforms = jax.tree_util.tree_unflatten(tree, list(eqn.invars[n_before:]))
    return _slices_minor(transforms, shape)


def _passed_to(eqn: Any) -> list[tuple[Any, int]]:
    """The jaxprs ``eqn`` runs, each with the offset of its inputs in ``eqn.invars``
    (``eqn.invars[k]`` is the sub-jaxpr's input ``k - offset``)."""
    found = []
    params = eqn.params
    name = eqn.primitive.name
    for sub in sub_jaxprs(params):
        n_sub, n_eqn = len(sub.invars), len(eqn.invars)
        if name == "cond":
            offset = 1  # the branch index comes first
        elif name == "while":
            offset = params["cond_nconsts"] if sub is _inner(params["body_jaxpr"]) else 0
        else:  # calls, scans: operand for operand; run_scoped: its consts first
            offset = 0 if n_sub >= n_eqn else n_eqn - n_sub
        found.append((sub, offset))
    return found


def _inner(j: Any) -> Any:
    return getattr(j, "jaxpr", j)
