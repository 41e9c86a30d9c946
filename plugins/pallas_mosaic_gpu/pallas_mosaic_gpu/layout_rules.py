"""Lowering rules of :mod:`pallas_mosaic_gpu.layouts` and of the accumulators of
``pl.run_state`` (``plgpu.ACC.init``), registered into :data:`pallas_mosaic_gpu.registry.RULES`.

* ``layout_cast``: the array moved into the layout (a splat is built in it, an SMEM read is
  read straight into it, other arrays are converted by the library, which refuses the
  conversions it has no code for); JAX's ``relayout`` (``jax.experimental.layout.
  explicit_layout`` in a kernel) the same, into the Mosaic GPU register layout it names;
* ``broadcasted_iota``: built in the layout;
* ``commit_smem_to_gmem_group``: closes a bulk group;
* ``pl.run_state`` over ``plgpu.ACC.init(value)`` Refs: accumulators started from ``value``,
  and their values once every wgmma the body issued has finished;
* ``lax.optimization_barrier``: register arrays pass the library's barrier (values computed
  before the side effects after it), others pass unchanged.
"""

from __future__ import annotations

from typing import Any

from jax import lax
from jax.experimental.mosaic import gpu as mgpu
from jaxlib.mlir.dialects import nvvm

from pallas_core import backend as plb
from pallas_core.backend import UnsupportedError, mlir_element_type
from pallas_mosaic_gpu import layouts
from pallas_mosaic_gpu.params import ACC_SPACE
from pallas_mosaic_gpu.registry import lower_jaxpr, rule
from pallas_mosaic_gpu.values import (
    FA,
    SWIZZLE,
    WGMMA,
    Expanded,
    GPULowering,
    Loaded,
    Ref,
    load,
    relayout,
    signed,
)


def _read_in(state: GPULowering, ref: Ref, layout: Any, optimized: bool) -> Any:
    """An SMEM Ref read into ``layout`` (a tiled buffer, such as an int8 block read for a
    wgmma, straight into a tiled register layout such as ``WGMMA_8BIT``)."""
    if isinstance(layout, mgpu.WGStridedFragLayout) and not ref.tiled and \
            tuple(layout.shape) == tuple(ref.shape):
        try:  # read straight in the asked vector width
            return FA.load_strided(ref.memref, is_signed=signed(ref.dtype),
                                   vec_size=layout.vec_size)
        except (NotImplementedError, ValueError) as e:
            raise state.fail(f"plgpu.load of {ref.dtype}{list(ref.shape)} into {layout}: "
                             f"{e}") from None
    if not isinstance(layout, mgpu.TiledLayout):
        return relayout(load(ref), layout)
    try:
        if ref.tiled:
            return FA.load_tiled(ref.memref, swizzle=SWIZZLE, is_signed=signed(ref.dtype),
                                 layout=layout, optimized=optimized)
        return FA.load_untiled(ref.memref, layout=layout, is_signed=signed(ref.dtype),
                               optimized=optimized)
    except (NotImplementedError, ValueError) as e:
        raise state.fail(f"plgpu.load of {ref.dtype}{list(ref.shape)} into {layout} "
                         f"(optimized={optimized}): {e}") from None


@rule(layouts.layout_cast_p, lazy=True)
def _layout_cast(state: GPULowering, eqn: Any, x: Any, *, new_layout: Any,
                 optimized: bool) -> Any:
    return _cast(state, eqn, x, new_layout.to_mgpu(), optimized,
                 f"plgpu.layout_cast into {new_layout}")


def _cast(state: GPULowering, eqn: Any, x: Any, layout: Any, optimized: bool,
          what: str) -> Any:
    if isinstance(x, Loaded) and not x.transposed and (
            x.ref.kind != "gmem" or isinstance(layout, mgpu.WGStridedFragLayout)):
        return _read_in(state, x.ref, layout, optimized)  # GMEM: only the strided read
    if type(x).__name__ == "PendingReduce":  # plgpu.multimem_load_reduce, issued in layout
        return x.into(state, layout)
    x = state.value(x)
    if isinstance(x, Expanded):
        raise state.fail(f"{what} of an array with unit dimensions {x.shape}")
    if not isinstance(x, FA):
        if isinstance(layout, mgpu.WGSplatFragLayout) or not eqn.invars[0].aval.shape:
            return x  # a scalar is the same on every thread
        raise state.fail(f"{what} of a scalar into {layout}")
    try:
        return relayout(x, layout)
    except UnsupportedError as e:
        raise state.fail(f"{what}: {e}") from None


if plb.relayout_p is not None:
    @rule(plb.relayout_p, lazy=True)
    def _relayout(state: GPULowering, eqn: Any, x: Any, *, dst_layout: Any) -> Any:
        """``jax.experimental.layout.explicit_layout`` in a kernel, as JAX's warpgroup
        lowering takes it: a Mosaic GPU register layout is a cast into it (``layout_cast``),
        ``AutoLayout`` hands the value back unchanged."""
        if dst_layout is plb.auto_layout:
            return x
        parts = plb.mosaic_gpu_tiled_layout(dst_layout)
        if parts is None:
            raise state.fail(f"relayout (explicit_layout) to {dst_layout!r} (a kernel's "
                             "arrays take Mosaic GPU register layouts)")
        return _cast(state, eqn, x, mgpu.TiledLayout(*parts), False,
                     f"relayout (explicit_layout) into {dst_layout}")


@rule(layouts.iota_p)
def _iota(state: GPULowering, eqn: Any, *, dtype: Any, shape: Any, dimension: int,
          layout: Any) -> Any:
    try:
        return FA.broadcasted_iota(mlir_element_type(dtype), tuple(shape), dimension,
                                   layout.to_mgpu(), is_signed=signed(dtype))
    except (NotImplementedError, ValueError) as e:
        raise state.fail(f"plgpu.broadcasted_iota of {tuple(shape)} in {layout}: {e}") from None


@rule(layouts.commit_group_p)
def _commit_group(state: GPULowering, eqn: Any) -> Any:
    nvvm.cp_async_bulk_commit_group()
    return []


@rule(plb.run_state_p, lazy=True)
def _run_state(state: GPULowering, eqn: Any, *args: Any, jaxpr: Any, is_initialized: Any,
               **_: Any) -> Any:
    refs: list[Ref] = []
    n_consts = len(args) - sum(getattr(v.aval, "memory_space", None) is ACC_SPACE
                               for v in jaxpr.invars)
    for n, (arg, var) in enumerate(zip(args, jaxpr.invars)):
        aval = var.aval
        if getattr(aval, "memory_space", None) is not ACC_SPACE:
            if n < n_consts and isinstance(arg, Ref):
                refs.append(arg)  # a Ref the body closes over
            elif n < n_consts:  # a value the body closes over, held in a Ref it reads once
                refs.append(Ref("value", tuple(aval.shape), aval.dtype,
                                memref=state.value(arg)))
            else:
                raise state.fail("pl.run_state over a Ref other than an accumulator (give "
                                 "it plgpu.ACC.init(value))")
            continue
        if not is_initialized[n]:
            raise state.fail("pl.run_state over an uninitialised accumulator")
        value = state.value(arg)
        shape, dtype = tuple(aval.shape), aval.dtype
        if not isinstance(value, FA):
            value = FA.splat(value, shape, WGMMA, is_signed=signed(dtype))
        key = id(eqn) * 100 + n
        state.accs[key] = mgpu.WGMMAAccumulator.from_registers(relayout(value, WGMMA))
        refs.append(Ref("acc", shape, dtype, acc_key=key))
    lower_jaxpr(state, jaxpr, (), refs)
    nvvm.wgmma_wait_group_sync_aligned(0)
    # Closed-over Refs and values come back as they are (the caller drops them).
    return [state.accs.pop(r.acc_key).value if r.kind == "acc" else
            (r.memref if r.kind == "value" else r) for r in refs]


@rule(lax.optimization_barrier_p)
def _optimization_barrier(state: GPULowering, eqn: Any, *args: Any) -> Any:
    arrays = [i for i, a in enumerate(args) if isinstance(a, FA)
              and not isinstance(a.layout, mgpu.WGSplatFragLayout)]
    out = list(args)
    if arrays:
        done = mgpu.optimization_barrier(*(args[i] for i in arrays))
        done = [done] if len(arrays) == 1 else list(done)
        for i, d in zip(arrays, done):
            out[i] = d
    return out

