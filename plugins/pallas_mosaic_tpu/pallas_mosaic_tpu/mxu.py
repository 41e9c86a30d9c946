"""The hand-driven MXU of ``jax.experimental.pallas.tpu`` (``matmul_push_rhs``,
``matmul_acc_lhs``, ``matmul_pop``, ``matmul_lhs_fifo``, ``matmul_pop_fifo``), the ``ACC``
accumulator memory space, and ``conv``.

An MXU holds staging registers (an RHS pushed there waits to be loaded), a loaded RHS (the
weights every ``matmul_acc_lhs``/``matmul_lhs_fifo`` multiplies by), accumulators and, on
chips that have one, a result FIFO. Here that state lives while the kernel is traced: each
operation becomes the ``jnp`` operations it means (``jnp.dot`` with float32, or int32,
accumulation, and the reads and writes of the ``ACC`` Ref), so every backend that runs or
lowers those runs or lowers it, with the MXU's meaning (Mosaic TPU lowers the products as
ordinary matmuls rather than JAX's ``tpu.matmul_*`` ops). The state belongs to one
control-flow scope: what is pushed, loaded or accumulated outside a loop body or branch cannot
be used inside it (or after it), and that raises an ``UnsupportedError``; ``ACC`` Refs carry
accumulators anywhere, as they are ordinary Refs.

Both JAX versions' forms are taken: JAX 0.11 and later address an accumulator by an ``ACC``
Ref (``matmul_acc_lhs(acc_ref, lhs, load_staged_rhs=None)``, ``matmul_pop(acc_ref)``), JAX
0.10 by an address and MXU index (``matmul_acc_lhs(acc_addr, lhs, mxu_index,
load_staged_rhs=None)``, ``matmul_pop(acc_addr, shape, dtype, mxu_index)``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_core.errors import PallasError, UnsupportedError
from pallas_core.spec import MemoryRef
from pallas_core.spec import MemorySpace as CoreMemorySpace
from pallas_mosaic_tpu.params import NAME


class AccMemorySpace(CoreMemorySpace):
    """The accumulators of MXU ``mxu_id`` (``pltpu.ACC(mxu_id)``): call it with a shape and a
    dtype (float32 or int32, rank >= 2) for an accumulator Ref, e.g. as scratch. Here such a
    Ref is an ordinary buffer (VMEM when lowered) that ``matmul_acc_lhs`` adds into."""

    mxu_id: int

    def __init__(self, mxu_id: int) -> None:
        if isinstance(mxu_id, bool) or not isinstance(mxu_id, (int, np.integer)) or mxu_id < 0:
            raise PallasError(f"pltpu.ACC(mxu_id={mxu_id!r}): expected a non-negative int.")
        super().__init__(f"ACC{int(mxu_id)}", backend=NAME)
        object.__setattr__(self, "mxu_id", int(mxu_id))

    def __call__(self, shape: Sequence[int], dtype: Any) -> MemoryRef:
        shape = tuple(int(d) for d in shape)
        if len(shape) < 2 or jnp.dtype(dtype) not in (jnp.float32, jnp.int32):
            raise PallasError(f"pltpu.ACC({self.mxu_id})({shape}, {jnp.dtype(dtype)}): an "
                              "accumulator is float32 or int32 of rank >= 2.")
        return super().__call__(shape, dtype)

    def __str__(self) -> str:
        return f"ACC(mxu_id={self.mxu_id})"


ACC = AccMemorySpace


@dataclasses.dataclass
class _Mxus:
    """The MXUs' state in one control-flow scope of a kernel being traced."""

    trace: Any
    staged: dict[tuple[int, int], Any] = dataclasses.field(default_factory=dict)
    loaded: dict[int, Any] = dataclasses.field(default_factory=dict)
    accs: dict[tuple[int, int], Any] = dataclasses.field(default_factory=dict)
    fifo: dict[int, list[Any]] = dataclasses.field(default_factory=dict)


_SCOPES: list[_Mxus] = []


def _mxus() -> _Mxus:
    trace = jex_core.get_opaque_trace_state()
    for scope in _SCOPES:
        if scope.trace == trace:
            return scope
    scope = _Mxus(trace)
    _SCOPES.append(scope)
    del _SCOPES[:-16]  # scopes of kernels traced long ago
    return scope


def _missing(what: str, fn: str) -> UnsupportedError:
    return UnsupportedError(
        f"pltpu.{fn}: {what} in this control-flow scope. Either it was never done, or it was "
        "done outside the loop body or branch this runs in (or inside one that has ended): "
        "the MXU's registers are followed while the kernel is traced, one scope at a time. "
        "Fix: push and load the RHS in the same body or branch as the matmuls that use it, "
        "and accumulate across iterations in a pltpu.ACC Ref.")


def _index(x: Any, what: str, fn: str) -> int:
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 0:
        raise PallasError(f"pltpu.{fn}: {what} must be a non-negative Python int, found {x!r}.")
    return int(x)


def matmul_push_rhs(rhs: jax.Array, staging_register: int, mxu_index: int, *,
                    transpose: bool = False) -> None:
    """Stages ``rhs`` (transposed with ``transpose``) in staging register
    ``staging_register`` of MXU ``mxu_index``, for a later ``load_staged_rhs=``."""
    rhs = jnp.asarray(rhs)
    if rhs.ndim != 2:
        raise PallasError(f"pltpu.matmul_push_rhs: the RHS must be 2-D, found {rhs.shape}.")
    key = (_index(mxu_index, "mxu_index", "matmul_push_rhs"),
           _index(staging_register, "staging_register", "matmul_push_rhs"))
    state = _mxus()
    if key in state.staged:
        raise PallasError(f"pltpu.matmul_push_rhs: staging register {key[1]} of MXU {key[0]} "
                          "already holds an RHS that was never loaded. Fix: load it with "
                          "matmul_acc_lhs(..., load_staged_rhs=...) first.")
    state.staged[key] = rhs.T if transpose else rhs


def _product(lhs: Any, mxu: int, load_staged_rhs: int | None, fn: str) -> Any:
    state = _mxus()
    if load_staged_rhs is not None:
        key = (mxu, _index(load_staged_rhs, "load_staged_rhs", fn))
        if key not in state.staged:
            raise _missing(f"staging register {key[1]} of MXU {mxu} holds no RHS", fn)
        state.loaded[mxu] = state.staged.pop(key)
    if mxu not in state.loaded:
        raise _missing(f"MXU {mxu} has no loaded RHS (pass load_staged_rhs=)", fn)
    lhs = jnp.asarray(lhs)
    rhs = state.loaded[mxu]
    if lhs.ndim != 2 or lhs.shape[1] != rhs.shape[0]:
        raise PallasError(f"pltpu.{fn}: the LHS {lhs.shape} does not multiply the MXU's RHS "
                          f"{rhs.shape}.")
    acc = jnp.int32 if jnp.issubdtype(lhs.dtype, jnp.integer) else jnp.float32
    return jnp.dot(lhs, rhs, preferred_element_type=acc)


def matmul_acc_lhs(acc: Any, lhs: jax.Array, *args: Any, **kwargs: Any) -> None:
    """Multiplies ``lhs`` by the MXU's RHS (loading it first from staging register
    ``load_staged_rhs`` when given) and adds the product into an accumulator:
    ``matmul_acc_lhs(acc_ref, lhs, load_staged_rhs=None)`` (JAX 0.11 and later: an ``ACC``
    Ref, whose MXU it names), or ``matmul_acc_lhs(acc_addr, lhs, mxu_index,
    load_staged_rhs=None)`` (JAX 0.10: an accumulator address of MXU ``mxu_index``)."""
    if isinstance(acc, (int, np.integer)):
        return _acc_by_address(int(acc), lhs, *args, **kwargs)
    return _acc_into_ref(acc, lhs, *args, **kwargs)


def _acc_by_address(acc_addr: int, lhs: Any, mxu_index: int,
                    load_staged_rhs: int | None = None) -> None:
    mxu = _index(mxu_index, "mxu_index", "matmul_acc_lhs")
    product = _product(lhs, mxu, load_staged_rhs, "matmul_acc_lhs")
    key = (mxu, _index(acc_addr, "acc_addr", "matmul_acc_lhs"))
    state = _mxus()
    state.accs[key] = product if key not in state.accs else state.accs[key] + product


def _space_of(ref: Any) -> Any:
    return getattr(jax.typeof(getattr(ref, "ref", ref)), "memory_space", None)


def _acc_into_ref(acc: Any, lhs: Any, load_staged_rhs: int | None = None) -> None:
    space = _space_of(acc)
    if not isinstance(space, AccMemorySpace):
        raise PallasError(f"pltpu.matmul_acc_lhs: the accumulator must be a Ref in pltpu.ACC("
                          f"mxu_id), found one in {space}. Fix: allocate it as scratch "
                          "pltpu.ACC(0)((m, n), jnp.float32).")
    product = _product(lhs, space.mxu_id, load_staged_rhs, "matmul_acc_lhs")
    if tuple(acc.shape) != product.shape:
        raise PallasError(f"pltpu.matmul_acc_lhs: the product {product.shape} does not fit the "
                          f"accumulator {tuple(acc.shape)}.")
    acc[...] = acc[...] + product.astype(acc.dtype)


def matmul_pop(acc: Any, *args: Any) -> jax.Array:
    """The accumulator's value, which is then zeroed: ``matmul_pop(acc_ref)`` (JAX 0.11 and
    later), or ``matmul_pop(acc_addr, shape, dtype, mxu_index)`` (JAX 0.10)."""
    if isinstance(acc, (int, np.integer)):
        return _pop_by_address(int(acc), *args)
    if args:
        raise PallasError("pltpu.matmul_pop(acc_ref) takes the accumulator Ref only.")
    if not isinstance(_space_of(acc), AccMemorySpace):
        raise PallasError("pltpu.matmul_pop: expected a Ref in pltpu.ACC(mxu_id), found one in "
                          f"{_space_of(acc)}.")
    value = acc[...]
    acc[...] = jnp.zeros_like(value)
    return value  # type: ignore[no-any-return]


def _pop_by_address(acc_addr: int, shape: tuple[int, int], dtype: Any,
                    mxu_index: int) -> jax.Array:
    key = (_index(mxu_index, "mxu_index", "matmul_pop"),
           _index(acc_addr, "acc_addr", "matmul_pop"))
    state = _mxus()
    if key not in state.accs:
        raise _missing(f"accumulator {key[1]} of MXU {key[0]} holds nothing", "matmul_pop")
    value = state.accs.pop(key)
    if value.shape != tuple(shape):
        raise PallasError(f"pltpu.matmul_pop: the accumulator holds {value.shape}, "
                          f"{tuple(shape)} was asked for.")
    return value.astype(dtype)  # type: ignore[no-any-return]


def matmul_lhs_fifo(lhs: jax.Array, mxu_index: int, *,
                    load_staged_rhs: int | None = None) -> None:
    """Multiplies ``lhs`` by MXU ``mxu_index``'s RHS (loaded first from ``load_staged_rhs``
    when given) and queues the product in the MXU's result FIFO."""
    mxu = _index(mxu_index, "mxu_index", "matmul_lhs_fifo")
    product = _product(lhs, mxu, load_staged_rhs, "matmul_lhs_fifo")
    _mxus().fifo.setdefault(mxu, []).append(product)


def matmul_pop_fifo(shape: tuple[int, int], dtype: Any, mxu_index: int) -> jax.Array:
    """The oldest product in MXU ``mxu_index``'s result FIFO, as ``dtype``."""
    mxu = _index(mxu_index, "mxu_index", "matmul_pop_fifo")
    queue = _mxus().fifo.get(mxu)
    if not queue:
        raise _missing(f"the result FIFO of MXU {mxu} is empty", "matmul_pop_fifo")
    value = queue.pop(0)
    if value.shape != tuple(shape):
        raise PallasError(f"pltpu.matmul_pop_fifo: the FIFO's result is {value.shape}, "
                          f"{tuple(shape)} was asked for.")
    return value.astype(dtype)  # type: ignore[no-any-return]


def conv(lhs: jax.Array, rhs: jax.Array, acc: jax.Array | None = None, *,
         dimension_numbers: Any, window_strides: Sequence[int] | None = None,
         padding: Any = None, lhs_dilation: Sequence[int] | None = None,
         rhs_dilation: Sequence[int] | None = None,
         window_reversal: Sequence[bool] | None = None, feature_group_count: int = 1,
         batch_group_count: int = 1, precision: Any = None,
         preferred_element_type: Any = None) -> jax.Array:
    """``lax.conv_general_dilated`` inside a kernel, plus ``acc`` when given (whose shape and
    dtype the result then has). ``window_reversal`` flips the kernel along the spatial
    dimensions where it is True. Runs on the interpreter; Mosaic TPU lowers the convolution
    to ``tpu.conv`` from JAX 0.11 on (``lax.conv_general_dilated``'s rule) and adds ``acc``
    to it."""
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    dn = lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
    spatial = len(dn.rhs_spec) - 2
    if window_reversal is not None:
        flips = [d for d, r in zip(dn.rhs_spec[2:], window_reversal) if r]
        if len(tuple(window_reversal)) != spatial:
            raise PallasError(f"pltpu.conv: window_reversal needs {spatial} entries, found "
                              f"{tuple(window_reversal)}.")
        if flips:
            rhs = lax.rev(rhs, flips)
    out_type = preferred_element_type if acc is None else (
        preferred_element_type or jnp.asarray(acc).dtype)
    out = lax.conv_general_dilated(
        lhs, rhs, window_strides=tuple(window_strides or (1,) * spatial),
        padding=padding if padding is not None else ((0, 0),) * spatial,
        lhs_dilation=lhs_dilation, rhs_dilation=rhs_dilation, dimension_numbers=dn,
        feature_group_count=feature_group_count, batch_group_count=batch_group_count,
        precision=precision, preferred_element_type=out_type)
    if acc is None:
        return out
    acc = jnp.asarray(acc)
    if acc.shape != out.shape:
        raise PallasError(f"pltpu.conv: acc {acc.shape} must have the result's shape "
                          f"{out.shape}.")
    return (acc + out.astype(acc.dtype)).astype(acc.dtype)
