"""The hand-driven MXU of ``jax.experimental.pallas.tpu`` (``matmul_push_rhs``,
``matmul_acc_lhs``, ``matmul_pop``, ``matmul_lhs_fifo``, ``matmul_pop_fifo``), the ``ACC``
accumulator memory space, and ``conv``.

An MXU holds staging registers (an RHS pushed there waits to be loaded), a loaded RHS (the
weights every ``matmul_acc_lhs``/``matmul_lhs_fifo`` multiplies by), accumulators and, on
chips that have one, a result FIFO. Each operation is a primitive (``tpu_matmul_*``) that
Mosaic TPU lowers to JAX's ``tpu.matmul_*`` operation, with the attributes JAX's lowering gives
it; an ``ACC`` Ref becomes an address in its MXU's accumulator memory (the chip's
``num_accumulators`` entries), as in JAX. The emulator runs those operations with an MXU of
its own.

The interpreter cannot keep registers across the traced bodies of loops and branches, so the
MXU is followed while the kernel is traced: each operation passes the RHS it multiplies by
(and, for JAX 0.10's addressed accumulators and the FIFO, the products it returns) as operands
that only the interpreter reads. Where those come from another control-flow scope (pushed
outside the loop body that uses them, queued inside a branch and popped after it), the
interpreter raises an ``UnsupportedError``; ``ACC`` Refs carry accumulators anywhere, as they
are Refs.

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
from jaxlib.mlir import ir
from jaxlib.mosaic.python import tpu

from pallas_core import backend as plb
from pallas_core.backend import PallasError, PrimitiveSemantics, UnsupportedError
from pallas_mosaic_tpu import ir as mir
from pallas_mosaic_tpu.params import AccMemorySpace
from pallas_mosaic_tpu.registry import AccRef, Lowering, rule

ACC = AccMemorySpace


class MXUEffect(plb.Effect):
    """The MXU's registers, accumulators and result FIFO change: keeps the hand-driven MXU
    operations in the kernel, in program order."""


mxu_effect = MXUEffect()
plb.register_side_effect(MXUEffect)


def _no_results(*args: Any, **params: Any) -> tuple[list[Any], set[Any]]:
    return [], {mxu_effect}


def _array_result(*args: Any, shape: tuple[int, ...], dtype: Any, **params: Any) -> Any:
    return plb.ShapedArray(shape, dtype), {mxu_effect}


matmul_push_rhs_p = plb.Primitive("tpu_matmul_push_rhs")
"""Operand: the RHS. Params: ``staging_register``, ``mxu_index``, ``transpose``."""
matmul_push_rhs_p.multiple_results = True
matmul_push_rhs_p.def_effectful_abstract_eval(_no_results)

matmul_acc_lhs_p = plb.Primitive("tpu_matmul_acc_lhs")
"""Operands: the ``ACC`` Ref, the LHS, then the RHS the MXU holds where it is known while
tracing (``has_rhs``: the interpreter's operand, which the Mosaic lowering does not need).
Params: ``mxu_index``, ``load_staged_rhs``, ``has_rhs``."""
matmul_acc_lhs_p.multiple_results = True
matmul_acc_lhs_p.def_effectful_abstract_eval(
    lambda *args, **params: ([], {mxu_effect, plb.ReadEffect(0), plb.WriteEffect(0)}))

matmul_acc_lhs_at_p = plb.Primitive("tpu_matmul_acc_lhs_at")
"""JAX 0.10's form, an accumulator by address. Operands: the LHS, then the RHS where known
(``has_rhs``). Params: ``acc_addr``, ``mxu_index``, ``load_staged_rhs``, ``has_rhs``."""
matmul_acc_lhs_at_p.multiple_results = True
matmul_acc_lhs_at_p.def_effectful_abstract_eval(_no_results)

matmul_pop_p = plb.Primitive("tpu_matmul_pop")
"""Operand: the ``ACC`` Ref. Params: ``mxu_index``."""
matmul_pop_p.def_effectful_abstract_eval(
    lambda acc, **params: (plb.ShapedArray(acc.shape, acc.dtype),
                           {mxu_effect, plb.ReadEffect(0), plb.WriteEffect(0)}))

matmul_pop_at_p = plb.Primitive("tpu_matmul_pop_at")
"""JAX 0.10's form. Operands: the ``(lhs, rhs)`` pairs accumulated at the address while
tracing, where all are known (``known``). Params: ``acc_addr``, ``mxu_index``, ``shape``,
``dtype``, ``known``."""
matmul_pop_at_p.def_effectful_abstract_eval(_array_result)


matmul_lhs_fifo_p = plb.Primitive("tpu_matmul_lhs_fifo")
"""Operand: the LHS. Params: ``mxu_index``, ``load_staged_rhs``."""
matmul_lhs_fifo_p.multiple_results = True
matmul_lhs_fifo_p.def_effectful_abstract_eval(_no_results)

matmul_pop_fifo_p = plb.Primitive("tpu_matmul_pop_fifo")
"""Operands: the ``(lhs, rhs)`` of the product at the FIFO's head where it is known while
tracing (``known``). Params: ``mxu_index``, ``shape``, ``dtype``, ``known``."""
matmul_pop_fifo_p.def_effectful_abstract_eval(_array_result)


@dataclasses.dataclass
class _Held:
    """Something an MXU holds, and the control-flow scope (trace) that put it there."""

    value: Any
    scope: Any


@dataclasses.dataclass
class _Mxus:
    """What the MXUs hold while kernels are traced: the staged and loaded RHS, the ``(lhs,
    rhs)`` pairs accumulated at each address (JAX 0.10's form) and queued in each result FIFO.

    Only the interpreter needs it (the Mosaic lowering emits the MXU operations themselves):
    it passes the RHS and the pairs as operands, which the interpreter can use only where they
    come from the scope the operation runs in."""

    staged: dict[tuple[int, int], _Held] = dataclasses.field(default_factory=dict)
    loaded: dict[int, _Held] = dataclasses.field(default_factory=dict)
    accs: dict[tuple[int, int], list[_Held]] = dataclasses.field(default_factory=dict)
    fifo: dict[int, list[_Held]] = dataclasses.field(default_factory=dict)


_STATE = _Mxus()


def _scope() -> Any:
    return jex_core.get_opaque_trace_state()


def _index(x: Any, what: str, fn: str) -> int:
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 0:
        raise PallasError(f"pltpu.{fn}: {what} must be a non-negative Python int, found {x!r}.")
    return int(x)


def _array(x: Any, what: str, fn: str) -> jax.Array:
    x = jnp.asarray(x)
    if x.ndim != 2:
        raise PallasError(f"pltpu.{fn}: the {what} must be 2-D, found shape {x.shape}.")
    return x


def matmul_push_rhs(rhs: jax.Array, staging_register: int, mxu_index: int, *,
                    transpose: bool = False) -> None:
    """Stages ``rhs`` (transposed with ``transpose``) in staging register
    ``staging_register`` of MXU ``mxu_index``, for a later ``load_staged_rhs=``
    (``tpu.matmul_push_rhs``)."""
    rhs = _array(rhs, "RHS", "matmul_push_rhs")
    key = (_index(mxu_index, "mxu_index", "matmul_push_rhs"),
           _index(staging_register, "staging_register", "matmul_push_rhs"))
    held = _STATE.staged.get(key)
    if held is not None and held.scope == _scope():
        raise PallasError(f"pltpu.matmul_push_rhs: staging register {key[1]} of MXU {key[0]} "
                          "already holds an RHS that was never loaded. Fix: load it with "
                          "matmul_acc_lhs(..., load_staged_rhs=...) first.")
    _STATE.staged[key] = _Held(rhs.T if transpose else rhs, _scope())
    matmul_push_rhs_p.bind(rhs, staging_register=key[1], mxu_index=key[0],
                           transpose=bool(transpose))


def _rhs(lhs: jax.Array, mxu: int, load_staged_rhs: int | None, fn: str) -> Any:
    """The RHS MXU ``mxu`` multiplies by (loading it first from ``load_staged_rhs``), where
    the trace knows it, else ``None``."""
    if load_staged_rhs is not None:
        reg = _index(load_staged_rhs, "load_staged_rhs", fn)
        staged = _STATE.staged.pop((mxu, reg), None)
        here = staged is not None and staged.scope == _scope()
        _STATE.loaded[mxu] = _Held(staged.value if here else None, _scope())  # type: ignore
    held = _STATE.loaded.get(mxu)
    if held is None or held.scope != _scope() or held.value is None:
        return None
    rhs = held.value
    if lhs.shape[1] != rhs.shape[0]:
        raise PallasError(f"pltpu.{fn}: the LHS {lhs.shape} does not multiply the MXU's RHS "
                          f"{rhs.shape}.")
    return rhs


def _rhs_operand(rhs: Any) -> tuple[list[Any], bool]:
    return ([] if rhs is None else [rhs]), rhs is not None


def matmul_acc_lhs(acc: Any, lhs: jax.Array, *args: Any, **kwargs: Any) -> None:
    """Multiplies ``lhs`` by the MXU's RHS (loading it first from staging register
    ``load_staged_rhs`` when given) and adds the product into an accumulator
    (``tpu.matmul_acc_lhs``): ``matmul_acc_lhs(acc_ref, lhs, load_staged_rhs=None)`` (JAX
    0.11 and later: an ``ACC`` Ref, whose MXU it names), or ``matmul_acc_lhs(acc_addr, lhs,
    mxu_index, load_staged_rhs=None)`` (JAX 0.10: an accumulator address of MXU
    ``mxu_index``)."""
    if isinstance(acc, (int, np.integer)) and not isinstance(acc, bool):
        return _acc_by_address(int(acc), lhs, *args, **kwargs)
    return _acc_into_ref(acc, lhs, *args, **kwargs)


def _load_arg(load_staged_rhs: Any, fn: str) -> int | None:
    if isinstance(load_staged_rhs, bool):
        raise PallasError(f"pltpu.{fn}: load_staged_rhs must be a staging register (an int) "
                          f"or None, found {load_staged_rhs!r} (True would mean register 1).")
    return None if load_staged_rhs is None else _index(load_staged_rhs, "load_staged_rhs", fn)


def _acc_by_address(acc_addr: int, lhs: Any, mxu_index: int,
                    load_staged_rhs: int | None = None) -> None:
    fn = "matmul_acc_lhs"
    mxu = _index(mxu_index, "mxu_index", fn)
    addr = _index(acc_addr, "acc_addr", fn)
    load = _load_arg(load_staged_rhs, fn)
    lhs = _array(lhs, "LHS", fn)
    rhs = _rhs(lhs, mxu, load, fn)
    _STATE.accs.setdefault((mxu, addr), []).append(_Held((lhs, rhs), _scope()))
    more, has_rhs = _rhs_operand(rhs)
    matmul_acc_lhs_at_p.bind(lhs, *more, acc_addr=addr, mxu_index=mxu, load_staged_rhs=load,
                             has_rhs=has_rhs)


def _space_of(ref: Any) -> Any:
    return getattr(jax.typeof(getattr(ref, "ref", ref)), "memory_space", None)


def _acc_ref(acc: Any, fn: str) -> Any:
    space = _space_of(acc)
    if not isinstance(space, AccMemorySpace):
        raise PallasError(f"pltpu.{fn}: the accumulator must be a Ref in pltpu.ACC(mxu_id), "
                          f"found one in {space}. Fix: allocate it with pl.run_scoped(..., "
                          "pltpu.ACC(0)((m, n), jnp.float32)) or as such scratch.")
    if getattr(acc, "transforms", ()):
        raise PallasError(f"pltpu.{fn}: a view of an ACC Ref (acc.at[...]); the MXU addresses "
                          "whole accumulators (JAX refuses views too). Fix: allocate one ACC "
                          "Ref per accumulator.")
    if len(acc.shape) != 2:
        raise PallasError(f"pltpu.{fn}: the accumulator must be 2-D, found {tuple(acc.shape)}.")
    return getattr(acc, "ref", acc), space


def _acc_into_ref(acc: Any, lhs: Any, load_staged_rhs: int | None = None) -> None:
    fn = "matmul_acc_lhs"
    ref, space = _acc_ref(acc, fn)
    lhs = _array(lhs, "LHS", fn)
    if lhs.shape[0] != acc.shape[0]:
        raise PallasError(f"pltpu.{fn}: the LHS {lhs.shape} has {lhs.shape[0]} rows, the "
                          f"accumulator {tuple(acc.shape)} {acc.shape[0]}.")
    load = _load_arg(load_staged_rhs, fn)
    rhs = _rhs(lhs, space.mxu_id, load, fn)
    if rhs is not None and rhs.shape[1] != acc.shape[1]:
        raise PallasError(f"pltpu.{fn}: the product ({lhs.shape[0]}, {rhs.shape[1]}) does not "
                          f"fit the accumulator {tuple(acc.shape)}.")
    more, has_rhs = _rhs_operand(rhs)
    matmul_acc_lhs_p.bind(ref, lhs, *more, mxu_index=space.mxu_id, load_staged_rhs=load,
                          has_rhs=has_rhs)


def matmul_pop(acc: Any, *args: Any) -> jax.Array:
    """The accumulator's value, which is then zeroed (``tpu.matmul_pop``):
    ``matmul_pop(acc_ref)`` (JAX 0.11 and later), or ``matmul_pop(acc_addr, shape, dtype,
    mxu_index)`` (JAX 0.10)."""
    if isinstance(acc, (int, np.integer)) and not isinstance(acc, bool):
        return _pop_by_address(int(acc), *args)
    if args:
        raise PallasError("pltpu.matmul_pop(acc_ref) takes the accumulator Ref only.")
    ref, space = _acc_ref(acc, "matmul_pop")
    return matmul_pop_p.bind(ref, mxu_index=space.mxu_id)  # type: ignore[no-any-return]


def _shape_arg(shape: Any, fn: str) -> tuple[int, int]:
    dims = tuple(shape)
    if len(dims) != 2 or any(isinstance(d, bool) or not isinstance(d, (int, np.integer))
                             for d in dims):
        raise PallasError(f"pltpu.{fn}: shape must be two ints, found {shape!r}.")
    return int(dims[0]), int(dims[1])


def _pairs(held: list[_Held]) -> tuple[list[Any], bool]:
    """The operands of products the interpreter computes, and whether all are known."""
    known = bool(held) and all(h.scope == _scope() and h.value[1] is not None for h in held)
    return ([x for h in held for x in h.value] if known else []), known


def _pop_by_address(acc_addr: int, shape: tuple[int, int], dtype: Any,
                    mxu_index: int) -> jax.Array:
    fn = "matmul_pop"
    key = (_index(mxu_index, "mxu_index", fn), _index(acc_addr, "acc_addr", fn))
    operands, known = _pairs(_STATE.accs.pop(key, []))
    return matmul_pop_at_p.bind(  # type: ignore[no-any-return]
        *operands, acc_addr=key[1], mxu_index=key[0], shape=_shape_arg(shape, fn),
        dtype=np.dtype(dtype), known=known)


def matmul_lhs_fifo(lhs: jax.Array, mxu_index: int, *,
                    load_staged_rhs: int | None = None) -> None:
    """Multiplies ``lhs`` by MXU ``mxu_index``'s RHS (loaded first from ``load_staged_rhs``
    when given) and queues the product in the MXU's result FIFO (``tpu.matmul_lhs_fifo``)."""
    fn = "matmul_lhs_fifo"
    mxu = _index(mxu_index, "mxu_index", fn)
    load = _load_arg(load_staged_rhs, fn)
    lhs = _array(lhs, "LHS", fn)
    rhs = _rhs(lhs, mxu, load, fn)
    _STATE.fifo.setdefault(mxu, []).append(_Held((lhs, rhs), _scope()))
    matmul_lhs_fifo_p.bind(lhs, mxu_index=mxu, load_staged_rhs=load)


def matmul_pop_fifo(shape: tuple[int, int], dtype: Any, mxu_index: int) -> jax.Array:
    """The oldest product in MXU ``mxu_index``'s result FIFO, as ``dtype``
    (``tpu.matmul_pop_fifo``)."""
    fn = "matmul_pop_fifo"
    mxu = _index(mxu_index, "mxu_index", fn)
    queue = _STATE.fifo.get(mxu) or []
    operands, known = _pairs(queue[:1])
    del queue[:1]
    return matmul_pop_fifo_p.bind(  # type: ignore[no-any-return]
        *operands, mxu_index=mxu, shape=_shape_arg(shape, fn), dtype=np.dtype(dtype),
        known=known)


# --- the interpreter's semantics -------------------------------------------------------------


def _unknown(fn: str) -> UnsupportedError:
    return UnsupportedError(
        f"pltpu.{fn} in the interpreter: what the MXU holds here (its RHS, or the products "
        "accumulated or queued) was put there outside the loop body or branch this runs in, "
        "in another grid step, or never. The interpreter follows the MXU's registers while "
        "the kernel is traced, one control-flow scope at a time (Mosaic TPU lowers such a "
        "kernel as it is). Fix: push and load the RHS in the same body or branch as the "
        "matmuls that use it, accumulate across iterations in a pltpu.ACC Ref, and pop FIFO "
        "results in the scope that queued them.")


def _product(lhs: Any, rhs: Any) -> Any:
    acc = jnp.int32 if jnp.issubdtype(lhs.dtype, jnp.integer) else jnp.float32
    return jnp.dot(lhs, rhs, preferred_element_type=acc, precision=lax.Precision.HIGHEST)


def _nothing(ctx: Any, *args: Any, **params: Any) -> list[Any]:
    """The interpreter's meaning of an MXU operation whose effect is computed where its
    result is read (the pops have the products as operands)."""
    return []


def _acc_lhs_discharge(in_avals: Any, out_avals: Any, acc: Any, lhs: Any, *rhs: Any,
                       has_rhs: bool, **params: Any) -> Any:
    if not has_rhs:
        raise _unknown("matmul_acc_lhs")
    return (acc + _product(lhs, rhs[0]).astype(acc.dtype), None, None), []


def _pop_discharge(in_avals: Any, out_avals: Any, acc: Any, **params: Any) -> Any:
    return (jnp.zeros_like(acc),), acc


def _popped(fn: str, what: str) -> Any:
    """The interpreter's meaning of a pop (``fn``) whose operands are the ``(lhs, rhs)``
    pairs of the products it returns, summed (``what`` holds them)."""
    def reference(ctx: Any, *pairs: Any, shape: tuple[int, ...], dtype: Any, known: bool,
                  **params: Any) -> Any:
        if not known:
            raise _unknown(fn)
        total = sum(_product(pairs[i], pairs[i + 1]) for i in range(0, len(pairs), 2))
        if tuple(total.shape) != tuple(shape):
            raise PallasError(f"pltpu.{fn}: {what} holds {tuple(total.shape)}, "
                              f"{tuple(shape)} was asked for.")
        return total.astype(dtype)
    return reference


SEMANTICS = (
    PrimitiveSemantics(matmul_push_rhs_p, evaluate=_nothing),
    PrimitiveSemantics(matmul_acc_lhs_p, discharge=_acc_lhs_discharge),
    PrimitiveSemantics(matmul_acc_lhs_at_p, evaluate=_nothing),
    PrimitiveSemantics(matmul_pop_p, discharge=_pop_discharge),
    PrimitiveSemantics(matmul_pop_at_p, evaluate=_popped("matmul_pop", "the accumulator")),
    PrimitiveSemantics(matmul_lhs_fifo_p, evaluate=_nothing),
    PrimitiveSemantics(matmul_pop_fifo_p,
                       evaluate=_popped("matmul_pop_fifo", "the FIFO's head")),
)


# --- Mosaic lowering: JAX's tpu.matmul_* operations ------------------------------------------


def _acc_address(lowering: Lowering, eqn: Any, acc: Any) -> tuple[int, int]:
    if "acc_addr" in eqn.params:
        return eqn.params["acc_addr"], eqn.params["mxu_index"]
    if not isinstance(acc, AccRef):
        raise lowering.fail("a hand-driven MXU operation on an ACC Ref passed into a loop or "
                            "branch as a value", eqn)
    return acc.base_address, acc.mxu_id


@rule(matmul_push_rhs_p)
def _push_lowering(lowering: Lowering, eqn: Any, rhs: ir.Value) -> list[Any]:
    p = eqn.params
    tpu.MatmulPushRhsOp(rhs, p["mxu_index"], staging_register=p["staging_register"],
                        transpose=p["transpose"])
    return []


@rule(matmul_acc_lhs_p, matmul_acc_lhs_at_p)
def _acc_lhs_lowering(lowering: Lowering, eqn: Any, *args: Any) -> list[Any]:
    by_ref = eqn.primitive is matmul_acc_lhs_p
    addr, mxu = _acc_address(lowering, eqn, args[0] if by_ref else None)
    tpu.MatmulAccLhsOp(addr, args[1] if by_ref else args[0], mxu,
                       load_staged_rhs=eqn.params["load_staged_rhs"])
    return []


@rule(matmul_pop_p, matmul_pop_at_p)
def _pop_lowering(lowering: Lowering, eqn: Any, *args: Any) -> ir.Value:
    addr, mxu = _acc_address(lowering, eqn, args[0] if eqn.primitive is matmul_pop_p else None)
    out = eqn.outvars[0].aval
    return tpu.MatmulPopOp(mir.value_type(out.shape, out.dtype), addr, mxu).result


def _fifo_op(lowering: Lowering, eqn: Any, name: str) -> Any:
    op = getattr(tpu, name, None)
    if op is None:
        raise lowering.fail(f"pltpu.{eqn.primitive.name.removeprefix('tpu_')} with this "
                            "jaxlib (its Mosaic dialect has the MXU's result FIFO from JAX "
                            "0.11 on)", eqn)
    return op


@rule(matmul_lhs_fifo_p)
def _lhs_fifo_lowering(lowering: Lowering, eqn: Any, lhs: ir.Value) -> list[Any]:
    p = eqn.params
    _fifo_op(lowering, eqn, "MatmulLhsFifoOp")(lhs, p["mxu_index"],
                                               load_staged_rhs=p["load_staged_rhs"])
    return []


@rule(matmul_pop_fifo_p)
def _pop_fifo_lowering(lowering: Lowering, eqn: Any, *args: Any) -> ir.Value:
    p = eqn.params
    return _fifo_op(lowering, eqn, "MatmulPopFifoOp")(
        mir.value_type(p["shape"], p["dtype"]), p["mxu_index"]).result


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
