"""What a kernel must satisfy before it is lowered for Triton, with the fix in each message."""

from __future__ import annotations

import functools
import math

import numpy as np

from pallas_core import BlockSpecError
from pallas_core import backend as plb
from pallas_core.backend import KernelCall, UnsupportedError, refuse_empty_operands

MAX_PROGRAMS = 2**31 - 1


def check(call: KernelCall) -> None:
    """Raises a ``PallasError`` for what the Triton backend cannot lower."""
    gm = call.grid_mapping
    where = f"kernel {call.name!r} ({call.source})"
    if gm.scratch_avals:
        raise UnsupportedError(
            f"scratch_shapes ({where}) are not supported by the 'triton' backend: Triton has "
            "no scratch memory. Fix: keep temporaries in values (loop carries) and, across "
            "grid steps, in the output block the grid revisits (the README's 'Scratch memory "
            "that works on every backend'), or pass backend='interpret'.")
    if gm.num_scalar_prefetch:
        raise UnsupportedError(
            f"scalar prefetch ({where}) is not supported by the 'triton' backend. Fix: pass "
            "the indices as an ordinary input and load them in the kernel.")
    refuse_empty_operands(where, gm, "triton")
    if gm.num_steps > MAX_PROGRAMS:
        raise UnsupportedError(f"{where} has {gm.num_steps} grid steps, more than Triton's "
                               f"{MAX_PROGRAMS}. Fix: use bigger blocks.")
    for bm in gm.block_mappings:
        if math.prod(bm.array_shape) >= 2**31:
            raise UnsupportedError(
                f"{where}: {bm.origin} has {math.prod(bm.array_shape)} elements; the 'triton' "
                "backend addresses arrays with 32-bit offsets (fewer than 2**31 elements). "
                "Fix: split the array.")
        if bm.is_whole_array:
            continue  # accessed through pl.ds slices, each checked when it is lowered
        # A block dimension spanning its whole array dimension may have any size: kernels
        # (JAX's layer_norm, softmax) read it through power-of-two index vectors and masks;
        # what they read is checked when it is lowered (`check_access_shape`).
        tiled = [b for b, a in zip(bm.block_shape, bm.array_shape) if b is not None and b != a]
        if any(size & (size - 1) for size in tiled):
            raise BlockSpecError(_power_of_two_message(where, bm.origin, bm.ref_shape))
    _check_atomics(call, where)
    _check_values(call, where)
    unknown = plb.registered_primitives() - _lowered()
    eqn = plb.find_eqn(call.jaxpr.jaxpr, unknown)
    if eqn is not None:
        raise UnsupportedError(
            f"the primitive {eqn.primitive.name!r} ({where}) is not supported by the 'triton' "
            "backend. Fix: rewrite that part of the kernel, or pass backend='interpret'.")


_ATOMICS = ("atomic_rmw", "atomic_cas", "addupdate")


def _check_atomics(call: KernelCall, where: str) -> None:
    """Refuses atomics (and ``ref[...] +=``, an atomic add here) on bool and 8- or 16-bit
    integers: Triton's atomics take 32- and 64-bit values, and narrower ones fail deep in its
    compiler (MLIR verification, ptxas, an LLVM "UNREACHABLE")."""
    for eqn in plb.all_eqns(call.jaxpr.jaxpr):
        name = eqn.primitive.name
        if name not in _ATOMICS:
            continue
        dtype = np.dtype(eqn.invars[1].aval.dtype)  # the value (compared value of a CAS)
        if dtype.kind not in "biu" or dtype.itemsize >= 4:
            continue
        what = {"atomic_rmw": f"atomic_{getattr(eqn.params.get('op'), 'value', 'rmw')}",
                "atomic_cas": "atomic_cas",
                "addupdate": "`ref[...] +=` (an atomic add on Triton)"}[name]
        raise UnsupportedError(
            f"{what} on {dtype.name} ({where}, at {plb.source_line(eqn)}) is not "
            "supported by the 'triton' backend: Triton's atomics act on 32- and 64-bit values "
            f"only, and on {dtype.name} they fail inside the Triton compiler. Fix: widen the "
            "Ref to int32 (e.g. an int32 out_shape, converted back after the call), or pass "
            "backend='interpret', which runs them.")


MAX_TENSOR_ELEMENTS = 2**20
"""Triton's largest tensor (its ``TRITON_MAX_TENSOR_NUMEL``): its verifier refuses more (a
``tt.make_range`` or a load of more elements)."""


def _check_values(call: KernelCall, where: str) -> None:
    """Refuses complex dtypes (Triton has none) and values of more than
    :data:`MAX_TENSOR_ELEMENTS` elements, before Triton's verifier meets them."""
    for bm in call.grid_mapping.block_mappings:
        if np.dtype(bm.dtype).kind == "c":
            raise UnsupportedError(_complex_message(np.dtype(bm.dtype), f"{where}: {bm.origin}"))
    for eqn in plb.all_eqns(call.jaxpr.jaxpr):
        for v in eqn.outvars:
            aval = v.aval
            if hasattr(aval, "inner_aval") or getattr(aval, "dtype", None) is None:
                continue  # a Ref, or a token
            at = f"{where}, at {plb.source_line(eqn)}"
            if np.dtype(aval.dtype).kind == "c":
                raise UnsupportedError(_complex_message(np.dtype(aval.dtype), at))
            size = math.prod(aval.shape)
            if size == 0:
                raise BlockSpecError(
                    f"{at}: a value of shape {tuple(aval.shape)} has no elements (from "
                    f"`{eqn.primitive.name}`); a Triton tensor cannot be empty (its verifier "
                    "refuses the empty range that would index it). Fix: skip the call when an "
                    "array is empty (its result is empty too), or give the block at least one "
                    "element.")
            if size > MAX_TENSOR_ELEMENTS:
                raise BlockSpecError(
                    f"{at}: a value of shape {tuple(aval.shape)} ({size} elements, from "
                    f"`{eqn.primitive.name}`), more than the {MAX_TENSOR_ELEMENTS} (2**20) a "
                    "Triton tensor may hold; Triton's verifier refuses it (JAX's Triton lowering "
                    "emits it and fails there). Fix: use smaller blocks (at most 2**20 "
                    "elements each, e.g. a grid over the array), or loop over the block in "
                    "chunks with pl.ds.")


def _complex_message(dtype: np.dtype, at: str) -> str:
    return (f"{dtype.name} ({at}) is not supported by the 'triton' backend: Triton has no "
            "complex types (JAX's Triton lowering has none either). Fix: pass the real and "
            "imaginary parts as two float arrays (jnp.real, jnp.imag) and combine them after "
            "the call, or pass backend='interpret'.")


def _power_of_two_message(where: str, origin: str, shape: tuple[int, ...]) -> str:
    padded = tuple(1 << (s - 1).bit_length() for s in shape)
    return (f"{where}: {origin} has block shape {shape}, but Triton blocks must have "
            f"power-of-two sizes. Fix: use block_shape {padded} (edge blocks are masked, so "
            "the array need not be padded), or a power-of-two divisor.")


def check_access_shape(where: str, origin: str, block_shape: tuple[int, ...],
                       shape: tuple[int, ...]) -> None:
    """Raises a ``BlockSpecError`` when a read or write of a Ref has a tensor ``shape`` that
    Triton cannot hold (a size that is not a power of two); ``block_shape`` is the Ref's."""
    if any(size & (size - 1) for size in shape):
        raise BlockSpecError(_power_of_two_message(where, origin, block_shape) + (
            f" (A read or write of shape {shape} is lowered; with a block dimension spanning "
            "its whole array, read it through a power-of-two index vector and a mask.)"))


@functools.cache
def _lowered() -> frozenset[object]:
    from pallas_triton.lowering import lowering_rules  # lowering imports this module

    return frozenset(lowering_rules())
