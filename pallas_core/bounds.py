"""Indices a kernel fixes when it is traced, checked against the Refs they index.

A constant index or a static slice that lies outside its Ref is a mistake the hardware would
not report (a TPU reads another block's data, a GPU faults or reads garbage) and the
interpreter would hide by clamping. The kernel's jaxpr says all there is to know: every read,
write and accumulation of a Ref carries its indexers, whose constant parts are literals. Each is
checked here, once per kernel, whatever the backend; indices known only when the kernel runs are
left to checked mode.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from pallas_core import _jax
from pallas_core.errors import OutOfBoundsError

_UNKNOWN = object()
"""A leaf of an indexer whose value is computed when the kernel runs."""


class _Leaf:
    """A leaf of an indexer that is a literal: an array constant (an int index, or a slice
    start passed as an array), as opposed to a Python int held in the indexer itself."""

    def __init__(self, value: Any) -> None:
        self.value = value


def _accesses() -> dict[Any, tuple[int, str, bool]]:
    """Ref-access primitive -> (operands before its indexers, what it does to the Ref, whether
    it is masked: masked lanes are never touched, so only a masked slice's start must lie
    inside the Ref)."""
    from pallas_core import primitives as prims

    return {_jax.get_p: (1, "reads", False), _jax.swap_p: (2, "writes", False),
            _jax.addupdate_p: (2, "adds into", False),
            prims.masked_load_p: (1, "reads", True), prims.masked_swap_p: (2, "writes", True)}


def check_constant_indices(jaxpr: Any, kernel_name: str) -> None:
    """Raises ``OutOfBoundsError`` at the first constant index or static slice of ``jaxpr``
    (nested jaxprs included) outside the Ref it indexes."""
    from pallas_core.reference import all_eqns

    accesses = _accesses()
    for eqn in all_eqns(jaxpr):
        found = accesses.get(eqn.primitive)
        tree = eqn.params.get("tree") if found is not None else None
        if found is None or tree is None:
            continue
        first, verb, masked = found
        leaves = eqn.invars[first:first + tree.num_leaves]
        values = [_Leaf(a.val) if isinstance(a, _jax.Literal) else _UNKNOWN for a in leaves]
        try:
            transforms = jax.tree_util.tree_unflatten(tree, values)
        except Exception:  # an indexer that cannot hold placeholders: nothing static to check
            continue
        for t in transforms:
            if isinstance(t, _jax.NDIndexer):
                _check(t, eqn, verb, masked, kernel_name)


def _static(value: Any) -> np.ndarray | None:
    """A static index as an array (a Python int, or a literal's value), else ``None``."""
    if value is _UNKNOWN:
        return None
    if isinstance(value, _Leaf):
        value = value.value
    try:
        return np.asarray(value)
    except Exception:  # a symbolic size, or anything else not known yet
        return None


def _check(indexer: Any, eqn: Any, verb: str, masked: bool, kernel_name: str) -> None:
    shape = tuple(indexer.shape)
    for d, (index, dim) in enumerate(zip(indexer.indices, shape, strict=True)):
        if not isinstance(dim, (int, np.integer)):
            continue
        if isinstance(index, _jax.Slice):
            if isinstance(index.start, _Leaf) or index.start is _UNKNOWN:
                # A start passed as an array is the kernel's to keep inside (JAX checks only
                # static ones too): it may lie in a TPU buffer's tile padding on purpose.
                continue
            start, size = _static(index.start), _static(index.size)
            if start is None or start.ndim:
                continue
            lo, n = int(start), (int(size) if size is not None and not size.ndim else 1)
            hi = lo + (max(n, 1) - 1) * int(index.stride)
            if lo < 0 or (n > 0 and (lo if masked else hi) >= dim):
                what = (f"the slice of {n} from {lo}" + (f" by {index.stride}"
                                                         if index.stride != 1 else ""))
                _refuse(eqn, verb, what, d, shape, kernel_name,
                        f"keep 0 <= start < {dim} (a masked access may run past the end)"
                        if masked else
                        f"keep 0 <= start and start + size <= {dim} (pl.ds(start, size))")
            continue
        value = _static(index)
        if value is None or value.dtype.kind not in "iu":
            continue
        bad = (value < -dim) | (value >= dim)
        if np.any(bad):
            first = value[bad].flat[0] if value.ndim else value
            _refuse(eqn, verb, f"index {int(first)}", d, shape, kernel_name,
                    f"use an index in -{dim}..{dim - 1} (negative ones count from the end)")


def _refuse(eqn: Any, verb: str, what: str, d: int, shape: tuple[int, ...], kernel_name: str,
            fix: str) -> None:
    raise OutOfBoundsError(
        f"kernel {kernel_name!r} ({_jax.source_line(eqn)}) {verb} {what} of dimension {d} of "
        f"a Ref of shape {shape}, which has {shape[d]} entries there: out of bounds (the "
        "hardware would touch memory outside the block, the interpreter would clamp it). "
        f"Fix: {fix}; to reach other rows, move the block with its index map.")


__all__ = ["check_constant_indices"]
