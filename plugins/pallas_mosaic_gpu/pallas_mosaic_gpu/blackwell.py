"""Blackwell (sm_100a): tensor memory (TMEM) and the fifth-generation tensor cores (tcgen05).

* ``plgpu.TMEM((M, N), jnp.float32)`` scratch: a TMEM buffer (M rows of lanes, N 32-bit
  columns, or ``packed=True``: ``32 // bits`` narrower elements per column) the kernel
  allocates at its start and frees at its end.
* ``tcgen05_mma(acc, a, b, barrier=None, *, accumulate=True)``: ``acc (+)= a @ b`` with ``acc``
  in TMEM, ``a`` a tiled SMEM buffer or a packed TMEM buffer and ``b`` a tiled SMEM buffer,
  issued by one thread of the warpgroup and asynchronous; with ``barrier`` (a
  ``plgpu.Barrier(orders_tensor_core=True)``) that barrier completes a phase once the matmul
  is done.
* ``tcgen05_commit_arrive(barrier)``: ``barrier`` completes a phase once every tcgen05 matmul
  issued before is done.
* ``async_load_tmem(ref)``: starts reading a TMEM buffer into registers; ``wait_load_tmem()``
  waits for the reads (before the TMEM may be overwritten).
* ``async_store_tmem(ref, value)``: writes registers into TMEM; ``commit_tmem()`` makes the
  writes visible to tcgen05 matmuls.
* ``async_copy_smem_to_tmem(smem, tmem)`` (:mod:`pallas_mosaic_gpu.more_ops`): copies an SMEM
  buffer into TMEM (``tcgen05.cp``), ordered before later tcgen05 work and tracked by
  ``tcgen05_commit_arrive``.

Reference semantics (the interpreter): matmuls and TMEM reads and writes happen at once; a
matmul with a barrier, and ``tcgen05_commit_arrive``, complete the barrier's phase; the waits do
nothing. Lowering uses JAX's Mosaic GPU library (``tcgen05.mma``, ``tcgen05.commit_arrive``,
``TMEMRef.load``/``store``); a kernel using any of this is built for sm_100a
(:mod:`pallas_mosaic_gpu.targets`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import tcgen05
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith

from pallas_core import backend as plb
from pallas_core.backend import PallasError, RefViews, UnsupportedError, bind_views
from pallas_mosaic_gpu import cluster, registry, values
from pallas_mosaic_gpu import primitives as gp
from pallas_mosaic_gpu.params import TensorMemorySpace

tcgen05_mma_p = gp._primitive("gpu_tcgen05_mma")
tcgen05_commit_arrive_p = gp._primitive("gpu_tcgen05_commit_arrive")
async_store_tmem_p = gp._primitive("gpu_async_store_tmem")
wait_load_tmem_p = gp._primitive("gpu_wait_load_tmem")
commit_tmem_p = gp._primitive("gpu_commit_tmem")
copy_scales_p = gp._primitive("gpu_async_copy_scales_to_tmem")
copy_sparse_metadata_p = gp._primitive("gpu_async_copy_sparse_metadata_to_tmem")
copy_smem_to_tmem_p = gp._primitive("gpu_async_copy_smem_to_tmem")
async_load_tmem_p = plb.Primitive("gpu_async_load_tmem")
async_load_tmem_p.multiple_results = True


@async_load_tmem_p.def_effectful_abstract_eval
def _load_abstract(*avals: Any, shape: tuple[int, ...], dtype: Any, **_: Any) -> Any:
    return [plb.ShapedArray(shape, dtype)], {plb.ReadEffect(0)}


PRIMITIVES = (tcgen05_mma_p, tcgen05_commit_arrive_p, async_load_tmem_p, async_store_tmem_p,
              wait_load_tmem_p, commit_tmem_p, copy_scales_p, copy_sparse_metadata_p,
              copy_smem_to_tmem_p)


# --- the user's functions ----------------------------------------------------------------------


def _tmem_aval(ref: Any, fn: str) -> Any:
    aval, base = gp._aval(ref, fn)
    if gp._space_name(base) != "TMEM":
        raise PallasError(f"plgpu.{fn}: expected a TMEM Ref (plgpu.TMEM scratch), found a Ref "
                          f"in {gp._space_name(base)}. Fix: allocate it with "
                          "plgpu.TMEM((M, N), jnp.float32).")
    return aval


def _space(ref: Any, fn: str) -> Any:
    """The memory space of the Ref behind ``ref`` (a Ref or a view of one)."""
    return plb.ref_type_of(plb.ref_and_transforms(ref, None, fn)[0]).memory_space


def smem_to_tmem_avals(smem_ref: Any, tmem_ref: Any, collective_axis: Any, fn: str,
                       purpose: str = "") -> tuple[Any, Any]:
    """The avals of a copy from the SMEM Ref ``smem_ref`` into the TMEM Ref ``tmem_ref``
    (``plgpu.<fn>``), refusing ``collective_axis`` (a copy into the TMEM of both blocks of a
    cluster; ``purpose`` says what such a copy would be for)."""
    if collective_axis is not None:
        raise UnsupportedError(f"plgpu.{fn}(collective_axis={collective_axis!r}): a copy into "
                               f"the TMEM of both blocks of a cluster{purpose} is not supported "
                               "by mosaic_gpu. Fix: copy in each block, without collective_axis.")
    src, base = gp._aval(smem_ref, fn)
    if gp._space_name(base) != "SMEM":
        raise PallasError(f"plgpu.{fn}: the source must be an SMEM Ref, found a Ref in "
                          f"{gp._space_name(base)}.")
    return src, _tmem_aval(tmem_ref, fn)


def _check_tc_barrier(barrier: Any, fn: str) -> None:
    gp._check_barrier(barrier, fn)
    space = _space(barrier, fn)
    if not getattr(space, "orders_tensor_core", False):
        raise PallasError(f"plgpu.{fn}: the barrier must order the tensor core. Fix: allocate "
                          "it with plgpu.Barrier(..., orders_tensor_core=True).")


def tcgen05_mma(acc: Any, a: Any, b: Any, barrier: Any = None, *, a_scale: Any = None,
                b_scale: Any = None, a_sparse_metadata: Any = None,
                accumulate: Any = True, collective_axis: Any = None) -> None:
    """``acc = a @ b + (acc if accumulate else 0)`` on Blackwell's tensor cores, asynchronous.

    ``acc`` is a TMEM Ref (M, N) of float32; ``a`` (M, K) and ``b`` (K, N) are SMEM Refs of
    one dtype (``plgpu.transpose_ref`` views allowed), tiled as the backend tiles such
    buffers; ``a`` may instead be a TMEM Ref (128 rows) holding ``32 // bits`` elements per
    column (``plgpu.TMEM(..., packed=True)`` for 16-bit and 8-bit dtypes), filled by
    ``async_copy_smem_to_tmem`` or ``async_store_tmem``. ``barrier`` (ordering the tensor
    core) completes a phase when the matmul is done; ``accumulate`` may be traced.

    ``a_scale`` and ``b_scale`` (together; TMEM Refs of ``plgpu.TMEMLayout.SCALES_LAYOUT``,
    (M, K // B) and (N, K // B)): a block-scaled matmul, each run of ``B`` elements along K of
    a row of ``a`` (of a column of ``b``) multiplied by its scale; ``a`` and ``b`` are then
    8-bit or 4-bit floats, of one dtype or two. ``a_sparse_metadata`` (a TMEM Ref of
    ``SPARSE_METADATA_LAYOUT``, (M, K // 2) uint2): ``a`` is (M, K // 2), the two kept
    elements of each group of four along K, and the metadata their positions in the group
    (2:4 structured sparsity). Both are filled by ``async_copy_scales_to_tmem`` and
    ``async_copy_sparse_metadata_to_tmem``.

    ``collective_axis`` (a cluster axis of 2 blocks, the first one): one matmul of both
    blocks (``cta_group::2``), issued by the first. Each block holds its half of the rows of
    ``a`` (M, K) and of ``acc``, and its half of the columns of ``b`` (K, N), so ``acc`` is
    (M, 2N); ``acc`` is a ``plgpu.TMEM(..., collective=True)`` buffer and ``barrier`` completes
    a phase in both blocks."""
    fn = "tcgen05_mma"
    scaled, sparse = a_scale is not None, a_sparse_metadata is not None
    if scaled != (b_scale is not None):
        raise PallasError("plgpu.tcgen05_mma: a_scale and b_scale go together (a block-scaled "
                          "matmul scales both operands). Fix: pass both, or neither.")
    if (scaled or sparse) and collective_axis is not None:
        raise UnsupportedError(
            f"plgpu.tcgen05_mma(collective_axis={collective_axis!r}) with "
            f"{'a_scale/b_scale' if scaled else 'a_sparse_metadata'} (a block-scaled or sparse "
            "matmul of both blocks of a cluster, whose scales take the M=64 collective TMEM "
            "layouts) is not supported by the mosaic_gpu backend. Fix: issue one in each "
            "block, without collective_axis.")
    acc_aval = _tmem_aval(acc, fn)
    a_aval, b_aval = gp._aval(a, fn)[0], gp._aval(b, fn)[0]
    if isinstance(_space(a, fn), TensorMemorySpace):
        _check_tmem_lhs(a, a_aval, collective_axis, scaled and sparse)
    (m, k), (k2, n) = a_aval.shape, b_aval.shape
    n_acc = n if collective_axis is None else 2 * n
    one_dtype = a_aval.dtype == b_aval.dtype or (scaled and _narrow_float(a_aval.dtype)
                                                 and _narrow_float(b_aval.dtype))
    if k * (1 + sparse) != k2 or acc_aval.shape != (m, n_acc) or not one_dtype:
        expected = "acc (M, N)" if collective_axis is None else \
            "acc (M, 2 N) (collective: b holds this block's half of the columns)"
        a_shape = "a (M, K // 2) (sparse: the kept half of each row)" if sparse else "a (M, K)"
        dtypes = "8-bit or 4-bit floats" if scaled else "a and b of one dtype"
        raise PallasError(f"plgpu.tcgen05_mma: acc {list(acc_aval.shape)} += a {a_aval.dtype}"
                          f"{list(a_aval.shape)} @ b {b_aval.dtype}{list(b_aval.shape)} does "
                          f"not fit: expected {expected}, {a_shape}, b (K, N), {dtypes}.")
    if np.dtype(acc_aval.dtype) != np.float32:
        raise UnsupportedError(f"plgpu.tcgen05_mma into a {np.dtype(acc_aval.dtype)} "
                               "accumulator is not supported here. Fix: accumulate in float32.")
    views = [acc, a, b] + ([barrier] if barrier is not None else [])
    if barrier is not None:
        _check_tc_barrier(barrier, fn)
    if scaled:
        if not (_narrow_float(a_aval.dtype) and _narrow_float(b_aval.dtype)):
            raise PallasError(f"plgpu.tcgen05_mma: a block-scaled matmul of {a_aval.dtype} and "
                              f"{b_aval.dtype}; it takes float8_e5m2, float8_e4m3fn or "
                              "float4_e2m1fn operands. Fix: cast them.")
        _check_layout_ref(a_scale, "SCALES_LAYOUT", (m, None), k2, "a_scale")
        _check_layout_ref(b_scale, "SCALES_LAYOUT", (n, None), k2, "b_scale")
        if gp._aval(a_scale, fn)[0].shape[1] != gp._aval(b_scale, fn)[0].shape[1]:
            raise PallasError("plgpu.tcgen05_mma: a_scale and b_scale have different numbers "
                              "of columns (one scale per block of K for each). Fix: use one "
                              "block size for both.")
        views += [a_scale, b_scale]
    if sparse:
        _check_layout_ref(a_sparse_metadata, "SPARSE_METADATA_LAYOUT", (m, k2 // 2), k2,
                          "a_sparse_metadata")
        views.append(a_sparse_metadata)
    static = isinstance(accumulate, (bool, np.bool_))
    extra = [] if static else [jnp.asarray(accumulate, jnp.bool_)]
    bind_views(tcgen05_mma_p, views, extra, fn, arrive=barrier is not None,
               accumulate=bool(accumulate) if static else None, collective_axis=collective_axis,
               scaled=scaled, sparse=sparse)


def _check_tmem_lhs(a: Any, aval: Any, collective_axis: Any, scaled_sparse: bool) -> None:
    """``a`` in TMEM: packed as the tensor core reads it (``32 // bits`` elements per column,
    so a 16-bit or 8-bit ``a`` is a ``packed=True`` buffer), collective for a collective
    matmul, not transposed."""
    fn = "tcgen05_mma"
    space = _space(a, fn)
    want = 32 // values.bits(aval.dtype)
    if space.packing != want or space.layout is not None:
        raise PallasError(f"plgpu.tcgen05_mma: a in TMEM ({np.dtype(aval.dtype).name}"
                          f"{list(aval.shape)}) must hold {want} element(s) per column, found "
                          f"{space.packing}{' (' + space.layout + ')' if space.layout else ''}."
                          f" Fix: allocate it with plgpu.TMEM(..., "
                          f"packed={want > 1}).")
    if collective_axis is not None and not space.collective:
        raise PallasError("plgpu.tcgen05_mma: a in TMEM of a collective matmul must be "
                          "allocated with plgpu.TMEM(..., collective=True).")
    transforms = plb.ref_and_transforms(a, None, fn)[1]
    if any(type(t).__name__ == "TransposeTransform" for t in transforms or ()):
        raise PallasError("plgpu.tcgen05_mma: a in TMEM cannot be transposed. Fix: store it "
                          "transposed instead.")
    if scaled_sparse:
        raise UnsupportedError("plgpu.tcgen05_mma with a in TMEM, scales and sparsity metadata "
                               "together is not supported (nor by the Mosaic GPU library). "
                               "Fix: keep a in SMEM.")


_NARROW_FLOATS = ("float8_e5m2", "float8_e4m3fn", "float4_e2m1fn")
"""The operand dtypes of a block-scaled ``tcgen05_mma``."""


def _narrow_float(dtype: Any) -> bool:
    return np.dtype(dtype).name in _NARROW_FLOATS


def _check_layout_ref(ref: Any, layout: str, shape: tuple[Any, Any], k: int, what: str) -> None:
    """``ref`` is a TMEM Ref of ``layout`` whose rows cover ``shape[0]``, whose columns are
    ``shape[1]`` (when given) or divide ``k`` (block scales)."""
    fn = "tcgen05_mma"
    aval = _tmem_aval(ref, fn)
    found = getattr(_space(ref, fn), "layout", None)
    if found != layout:
        raise PallasError(f"plgpu.tcgen05_mma: {what} is a TMEM Ref of "
                          f"{'the default layout' if found is None else found}, expected one "
                          f"of {layout}. Fix: allocate it with plgpu.TMEM(..., "
                          f"layout=plgpu.TMEMLayout.{layout}).")
    rows, cols = aval.shape
    if layout == "SCALES_LAYOUT":
        ok = rows >= shape[0] and cols and k % cols == 0
        want = f"({shape[0]} or more rows, K // B columns for a block size B dividing K={k})"
    else:
        ok = (rows, cols) == shape
        want = f"{shape} (M, K // 2: two positions per group of four along K={k})"
    if not ok:
        raise PallasError(f"plgpu.tcgen05_mma: {what} has shape {tuple(aval.shape)}, expected "
                          f"{want}. Fix: allocate it with that shape.")


def tcgen05_commit_arrive(barrier: Any, collective_axis: Any = None) -> None:
    """``barrier`` completes a phase once the tcgen05 work issued before is done;
    ``collective_axis``: the work of a collective ``tcgen05_mma``, issued by the first block
    of the cluster, completing ``barrier`` in both blocks."""
    _check_tc_barrier(barrier, "tcgen05_commit_arrive")
    bind_views(tcgen05_commit_arrive_p, [barrier], [], "tcgen05_commit_arrive",
               collective_axis=collective_axis)


def _copy_to_layout(smem_ref: Any, tmem_ref: Any, collective_axis: Any, fn: str,
                    layout: str, prim: Any, smem_shape: Any) -> None:
    """``smem_ref`` (an SMEM Ref in the layout the tensor core reads) into ``tmem_ref`` (a
    TMEM Ref of ``layout``), asynchronously; ``smem_shape(tmem_shape)`` is the SMEM shape."""
    src, dst = smem_to_tmem_avals(smem_ref, tmem_ref, collective_axis, fn,
                                  " (for a collective block-scaled or sparse matmul)")
    if getattr(_space(tmem_ref, fn), "layout", None) != layout:
        raise PallasError(f"plgpu.{fn}: the destination must be a TMEM Ref of {layout}. Fix: "
                          f"allocate it with plgpu.TMEM(..., layout=plgpu.TMEMLayout.{layout}).")
    want = smem_shape(tuple(dst.shape))
    if tuple(src.shape) != want or src.dtype != dst.dtype:
        raise PallasError(f"plgpu.{fn}: source {src.dtype}{list(src.shape)} for a TMEM Ref "
                          f"{dst.dtype}{list(dst.shape)}: expected an SMEM Ref "
                          f"{dst.dtype}{list(want)}. Fix: lay the data out as the docstring "
                          "says, in a buffer of that shape.")
    bind_views(prim, [smem_ref, tmem_ref], [], fn)


def async_copy_scales_to_tmem(smem_ref: Any, tmem_ref: Any, collective_axis: Any = None
                              ) -> None:
    """Copies block-scaling factors from SMEM into a TMEM Ref of
    ``plgpu.TMEMLayout.SCALES_LAYOUT``, for a later scaled ``tcgen05_mma`` (which needs no
    wait for it when issued by the same thread; ``tcgen05_commit_arrive`` orders it otherwise).

    For a TMEM Ref (MN, C) the SMEM Ref is (MN // 128, C // 4, 32, 16), the layout PTX's
    ``tcgen05.cp`` reads: element ``[i, j, r, 4 q + s]`` is the scale of row
    ``128 i + 32 q + r`` and column ``4 j + s``. From scales ``x`` (MN, C)::

        x.reshape(MN // 128, 4, 32, C // 4, 4).transpose(0, 3, 2, 1, 4)
         .reshape(MN // 128, C // 4, 32, 16)
    """
    _copy_to_layout(smem_ref, tmem_ref, collective_axis, "async_copy_scales_to_tmem",
                    "SCALES_LAYOUT", copy_scales_p,
                    lambda t: (t[0] // 128, t[1] // 4, 32, 16))


def async_copy_sparse_metadata_to_tmem(smem_ref: Any, tmem_ref: Any,
                                       collective_axis: Any = None) -> None:
    """Copies 2:4 sparsity metadata from SMEM into a TMEM Ref of
    ``plgpu.TMEMLayout.SPARSE_METADATA_LAYOUT`` (M, K // 2), for a later sparse
    ``tcgen05_mma``. The SMEM Ref is (M // 128, K // 128, 128, 64) uint2, as
    ``plgpu.format_tcgen05_sparse_metadata`` lays the metadata out for the operand's dtype."""
    _copy_to_layout(smem_ref, tmem_ref, collective_axis, "async_copy_sparse_metadata_to_tmem",
                    "SPARSE_METADATA_LAYOUT", copy_sparse_metadata_p,
                    lambda t: (t[0] // 128, t[1] // 64, 128, 64))


_LOAD_LAYOUTS = {"TCGEN05": "LAYOUT", "TCGEN05_TMEM_NATIVE": "TMEM_NATIVE_LAYOUT"}
"""The register layouts a TMEM read may be given (``plgpu.Layout`` member: the name of the
Mosaic GPU library's ``tcgen05`` layout)."""


def async_load_tmem(src: Any, *, layout: Any = None) -> jax.Array:
    """Starts reading the TMEM Ref ``src`` into registers; the array is usable at once, and
    ``wait_load_tmem()`` must follow before ``src`` is written again. ``layout``:
    ``plgpu.Layout.TCGEN05`` (one row per thread, the default) or ``TCGEN05_TMEM_NATIVE``."""
    name = getattr(layout, "name", None)
    if layout is not None and name not in _LOAD_LAYOUTS:
        raise UnsupportedError(f"plgpu.async_load_tmem(layout={layout!r}): TMEM is read here "
                               f"in the layouts {['plgpu.Layout.' + n for n in _LOAD_LAYOUTS]}"
                               " only. Fix: drop layout= (the first is the default).")
    aval = _tmem_aval(src, "async_load_tmem")
    (out,) = bind_views(async_load_tmem_p, [src], [], "async_load_tmem",
                        shape=tuple(aval.shape), dtype=np.dtype(aval.dtype), layout=name)
    return out  # type: ignore[no-any-return]


def async_store_tmem(ref: Any, value: Any) -> None:
    """Writes ``value`` into the TMEM Ref ``ref``; ``commit_tmem()`` makes it visible to
    tcgen05 matmuls."""
    aval = _tmem_aval(ref, "async_store_tmem")
    value = jnp.asarray(value, aval.dtype)
    if value.shape != tuple(aval.shape):
        raise PallasError(f"plgpu.async_store_tmem: a value of shape {value.shape} into a TMEM "
                          f"Ref of shape {tuple(aval.shape)}. Fix: store a whole block.")
    bind_views(async_store_tmem_p, [ref], [value], "async_store_tmem")


def wait_load_tmem() -> None:
    """Waits for the earlier ``async_load_tmem`` reads of this warpgroup."""
    wait_load_tmem_p.bind(tree=jax.tree_util.tree_structure(()), roles=())


def commit_tmem() -> None:
    """Makes this warpgroup's ``async_store_tmem`` writes visible to tcgen05 matmuls."""
    commit_tmem_p.bind(tree=jax.tree_util.tree_structure(()), roles=())


# --- reference semantics -----------------------------------------------------------------------


def _mma(in_avals: Any, out_avals: Any, *args: Any, tree: Any, roles: Any, arrive: bool,
         accumulate: bool | None, collective_axis: Any = None, scaled: bool = False,
         sparse: bool = False) -> Any:
    if collective_axis is not None:
        raise cluster.refused_in_interpreter(
            f"plgpu.tcgen05_mma(collective_axis={collective_axis!r})")
    state = RefViews(args, tree, roles)
    acc = state.read(0)
    a, b = gp._read_operand(state, 1), gp._read_operand(state, 2)
    if scaled or sparse:
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        more = 3 + arrive
        if sparse:
            a = _densify(a, state.read(more + 2 * scaled), in_avals[roles[1]].dtype)
        if scaled:
            a = a * _expand_scales(state.read(more), a.shape)
            b = b * _expand_scales(state.read(more + 1), b.T.shape).T
    prod = lax.dot(a, b, preferred_element_type=acc.dtype, precision=lax.Precision.HIGHEST)
    keep = jnp.asarray(accumulate) if accumulate is not None else state.rest[0]
    state.write(0, jnp.where(keep, acc, jnp.zeros_like(acc)) + prod)
    if arrive:
        state.write(3, state.read(3) + 1)
    return state.new_values(), []


def _expand_scales(scales: Any, shape: tuple[int, int]) -> Any:
    """Scales (rows >= R, K // B) as a multiplier of shape (R, K): each scale repeated over its
    block of ``B`` elements along K."""
    rows, k = shape
    scales = scales[:rows].astype(jnp.float32)
    return jnp.repeat(scales, k // scales.shape[1], axis=1)


def _sparse_tiles_16bit(meta: Any) -> Any:
    """The exchange of halves that PTX's layout of sparsity metadata makes for 16-bit operands,
    within each tile of 128 rows by 64 positions of (M, K // 2) metadata (its own inverse)."""
    m, c = meta.shape
    tiles = meta.reshape(m // 128, 8, 2, 8, c // 64, 4, 2, 8)
    return jnp.swapaxes(tiles, 2, 6).reshape(m, c)


def _densify(a: Any, meta: Any, dtype: Any) -> Any:
    """The dense (M, K) operand of a 2:4 sparse matmul: ``a`` (M, K // 2) holds the two kept
    elements of each group of four, ``meta`` (M, K // 2, as copied to TMEM) their positions."""
    if np.dtype(dtype).itemsize == 2:
        meta = _sparse_tiles_16bit(meta)
    m, half = a.shape
    pos = meta.astype(jnp.int32).reshape(m, half // 2, 2, 1)
    kept = a.reshape(m, half // 2, 2, 1)
    dense = jnp.sum(jnp.where(pos == jnp.arange(4), kept, 0.0), axis=2)
    return dense.reshape(m, 2 * half)


def _copy_scales(in_avals: Any, out_avals: Any, *args: Any, tree: Any, roles: Any) -> Any:
    """Scales laid out for ``tcgen05.cp`` (MN // 128, C // 4, 32, 16) into TMEM (MN, C)."""
    state = RefViews(args, tree, roles)
    x = state.read(0)
    tiles, groups = x.shape[:2]
    state.write(1, x.reshape(tiles, groups, 32, 4, 4).transpose(0, 3, 2, 1, 4)
                .reshape(tiles * 128, groups * 4))
    return state.new_values(), []


def _copy_sparse_metadata(in_avals: Any, out_avals: Any, *args: Any, tree: Any, roles: Any
                          ) -> Any:
    """Metadata tiles (M // 128, C // 64, 128, 64) into TMEM (M, C), tile by tile; the
    matmul undoes the exchange made for 16-bit operands."""
    state = RefViews(args, tree, roles)
    x = state.read(0)
    rows, cols = x.shape[0] * 128, x.shape[1] * 64
    state.write(1, jnp.swapaxes(x, 1, 2).reshape(rows, cols))
    return state.new_values(), []


def _copy_smem(in_avals: Any, out_avals: Any, *args: Any, tree: Any, roles: Any) -> Any:
    """An SMEM buffer into a TMEM buffer of its shape, at once."""
    state = RefViews(args, tree, roles)
    state.write(1, state.read(0))
    return state.new_values(), []


def _commit_arrive(in_avals: Any, out_avals: Any, *args: Any, tree: Any, roles: Any,
                   collective_axis: Any = None) -> Any:
    if collective_axis is not None:
        raise cluster.refused_in_interpreter(
            f"plgpu.tcgen05_commit_arrive(collective_axis={collective_axis!r})")
    state = RefViews(args, tree, roles)
    state.write(0, state.read(0) + 1)
    return state.new_values(), []


def _collective_axes(in_avals: Any, *, collective_axis: Any = None, **_: Any
                     ) -> tuple[str, ...]:
    """A collective matmul or commit reaches both blocks of the cluster."""
    return cluster.axes_tuple(collective_axis) if collective_axis is not None else ()


def _mma_cross(in_avals: Any, out_avals: Any, *args: Any, stacked: Any, marks: Any,
               block: Any, tree: Any, roles: Any, arrive: bool, accumulate: bool | None,
               collective_axis: Any = None, scaled: bool = False, sparse: bool = False) -> Any:
    """A collective matmul (``cta_group::2``), issued by the first block: ``a`` is every
    block's ``a`` stacked by rows, ``b`` every block's ``b`` side by side; block ``c``'s
    accumulator takes rows ``[c*M, (c+1)*M)`` of the product, and its barrier an arrival. An
    issue by another block has no effect here."""
    state = RefViews(args, tree, roles)
    views = cluster.block_views(state, stacked)
    first = block == 0
    a = jnp.concatenate([gp._read_operand(v, 1) for v in views], axis=0)
    b = jnp.concatenate([gp._read_operand(v, 2) for v in views], axis=1)
    prod = lax.dot(a, b, preferred_element_type=views[0].read(0).dtype,
                   precision=lax.Precision.HIGHEST)
    keep = jnp.asarray(accumulate) if accumulate is not None else state.rest[0]
    m = prod.shape[0] // len(views)
    for c, v in enumerate(views):
        acc = v.read(0)
        new = jnp.where(keep, acc, jnp.zeros_like(acc)) + prod[c * m:(c + 1) * m]
        v.write(0, jnp.where(first, new, acc))
        if arrive:
            v.write(3, v.read(3) + jnp.where(first, 1, 0))
    return cluster.restack(state, stacked, views), [None] * len(marks), []


def _commit_arrive_cross(in_avals: Any, out_avals: Any, *args: Any, stacked: Any,
                         marks: Any, block: Any, tree: Any, roles: Any,
                         collective_axis: Any = None) -> Any:
    """A collective commit by the first block: an arrival on the barrier of both blocks."""
    state = RefViews(args, tree, roles)
    views = cluster.block_views(state, stacked)
    for v in views:
        v.write(0, v.read(0) + jnp.where(block == 0, 1, 0))
    return cluster.restack(state, stacked, views), [None] * len(marks), []


def _load(in_avals: Any, out_avals: Any, *args: Any, tree: Any, roles: Any, **_: Any) -> Any:
    state = RefViews(args, tree, roles)
    return state.new_values(), [state.read(0)]


def _store(in_avals: Any, out_avals: Any, *args: Any, tree: Any, roles: Any) -> Any:
    state = RefViews(args, tree, roles)
    state.write(0, state.rest[0])
    return state.new_values(), []


SEMANTICS: tuple[plb.PrimitiveSemantics, ...] = (
    plb.PrimitiveSemantics(tcgen05_mma_p, discharge=_mma, cluster=_collective_axes,
                                 cross=_mma_cross),
    plb.PrimitiveSemantics(tcgen05_commit_arrive_p, discharge=_commit_arrive,
                                 cluster=_collective_axes, cross=_commit_arrive_cross),
    plb.PrimitiveSemantics(async_load_tmem_p, discharge=_load),
    plb.PrimitiveSemantics(async_store_tmem_p, discharge=_store),
    plb.PrimitiveSemantics(wait_load_tmem_p, evaluate=gp._no_op),
    plb.PrimitiveSemantics(commit_tmem_p, evaluate=gp._no_op),
    plb.PrimitiveSemantics(copy_scales_p, discharge=_copy_scales),
    plb.PrimitiveSemantics(copy_sparse_metadata_p, discharge=_copy_sparse_metadata),
    plb.PrimitiveSemantics(copy_smem_to_tmem_p, discharge=_copy_smem),
)


def uses_blackwell(call: Any) -> bool:
    """Whether a kernel allocates TMEM, applies a tcgen05/TMEM primitive, claims work with
    cluster launch control or makes a leader-tracked copy."""
    if any(isinstance(a.memory_space, TensorMemorySpace) for a in call.grid_mapping.scratch_avals):
        return True
    from pallas_mosaic_gpu import dynamic_scheduling  # cluster launch control is Blackwell's too
    if plb.find_eqn(call.jaxpr.jaxpr,
                          PRIMITIVES + dynamic_scheduling.CLUSTER_LAUNCH_CONTROL) is not None:
        return True
    # So are leader-tracked copies (cta_group::2).
    return any(e.primitive is gp.copy_gmem_to_smem_p and e.params.get("leader_tracked")
               is not None for e in plb.all_eqns(call.jaxpr.jaxpr))


# --- lowering ----------------------------------------------------------------------------------


def _tmem_view(state: Any, ref: Any, transforms: Any) -> Any:
    """A TMEM Ref after column slices (``acc.at[:, pl.ds(c, n)]``); rows cannot be sliced."""
    tmem = ref.memref
    shape = ref.shape
    for t in transforms:
        indices = getattr(t, "indices", None)
        if indices is None or len(indices) != 2 or not all(isinstance(i, plb.Slice)
                                                            for i in indices):
            raise state.fail("this view of a TMEM Ref (only column slices acc.at[:, pl.ds()])")
        rows, cols = indices
        if not values._full(rows, shape[0]):
            raise state.fail("slicing the rows of a TMEM Ref")
        start = cols.start if isinstance(cols.start, (int, np.integer)) else \
            values.index(state.value(cols.start))
        tmem = tmem.slice(slice(None), mgpu.ds(start, int(cols.size))
                          if not isinstance(start, (int, np.integer)) else
                          slice(int(start), int(start) + int(cols.size)))
        shape = (shape[0], int(cols.size))
    return dataclasses.replace(ref, memref=tmem, shape=shape)


def _role_views(state: Any, eqn: Any, args: Any) -> list[Any]:
    roles, tree = eqn.params["roles"], eqn.params["tree"]
    n_refs = max(roles) + 1 if roles else 0
    transforms = jax.tree_util.tree_unflatten(tree, list(args[n_refs:n_refs + tree.num_leaves]))
    views = []
    for r, t in zip(roles, transforms):
        ref = args[r]
        if ref.kind == "tmem":
            views.append(_tmem_view(state, ref, t))
        else:
            view = values._view(state, ref, t)
            if view.kind == "barrier" and view.shape == (1,):
                view = dataclasses.replace(view, barrier=view.barrier[0], shape=())
            views.append(view)
    return views


def _one_thread(state: Any) -> Any:
    from pallas_mosaic_gpu import dynamic_scheduling
    return dynamic_scheduling.issuing_thread(state)


def _smem_operand(state: Any, view: Any, what: str) -> Any:
    ref, transposed = values._untransposed(view)
    if ref.kind != "smem" or not ref.tiled:
        raise state.fail(f"plgpu.tcgen05_mma with a {what} operand that is not a tiled SMEM "
                         "buffer (16-bit dtype, both dimensions multiples of 64)")
    return values._transposed(ref) if transposed else ref.memref


def _issuer(state: Any, eqn: Any, collective_axis: Any, fn: str) -> Any:
    """The thread issuing tcgen05 work: one of the warpgroup (or warp), and with
    ``collective_axis`` only in the first block of the cluster along it."""
    one = _one_thread(state)
    if collective_axis is None:
        return one
    what = f"plgpu.{fn}(collective_axis={collective_axis!r})"
    mesh = getattr(state.call.compiler_params, "mesh", None)
    (dim,) = cluster.cluster_dims(mesh, (collective_axis,), what, state.fail)
    if dim != cluster.DIMS[0] or cluster.cluster_size(mesh, (dim,)) != 2:
        raise state.fail(f"{what} along other than the first cluster axis, of 2 blocks")
    return arith.andi(one, cluster.is_first_block(dim))


@registry.rule(tcgen05_mma_p, lazy=True)
def _mma_rule(state: Any, eqn: Any, *args: Any, arrive: bool, accumulate: bool | None,
              collective_axis: Any = None, scaled: bool = False, sparse: bool = False,
              **_: Any) -> Any:
    views = _role_views(state, eqn, args)
    if views[0].kind != "tmem":
        raise state.fail("plgpu.tcgen05_mma into something other than TMEM")
    collective = collective_axis is not None
    if collective and not getattr(eqn.invars[0].aval.memory_space, "collective", False):
        raise state.fail("a collective plgpu.tcgen05_mma into a TMEM buffer allocated without "
                         "collective=True")
    a = views[1].memref if views[1].kind == "tmem" else _smem_operand(state, views[1], "left")
    b = _smem_operand(state, views[2], "right")
    i1 = ir.IntegerType.get_signless(1)
    acc_flag = arith.constant(i1, int(accumulate)) if accumulate is not None else \
        state.value(args[-1])
    more = views[3 + arrive:]
    extra: dict[str, Any] = {}
    if scaled:
        extra.update(a_scale=more[0].memref, b_scale=more[1].memref)
    if sparse:
        extra["a_sparse_metadata"] = more[-1].memref
    with mgpu.when(_issuer(state, eqn, collective_axis, "tcgen05_mma")):
        try:
            tcgen05.mma(views[0].memref, a, b, a_swizzle=values.SWIZZLE,
                        b_swizzle=values.SWIZZLE, accumulate=acc_flag, collective=collective,
                        **extra)
        except (NotImplementedError, ValueError) as e:
            raise state.fail(f"this tcgen05_mma ({e})") from None
        if arrive:
            tcgen05.commit_arrive(views[3].barrier, collective=collective, ctx=state.launch)
    return []


def _copy_rule(impl: Any, fn: str) -> Any:
    """Lowers an SMEM-to-TMEM copy of scales or metadata: the library's ``tcgen05.cp``s from
    a contiguous SMEM buffer, issued by one thread."""
    def rule(state: Any, eqn: Any, *args: Any, **_: Any) -> Any:
        src, dst = _role_views(state, eqn, args)
        if src.kind != "smem" or src.tiled:
            raise state.fail(f"plgpu.{fn} from other than an untiled SMEM buffer")
        with mgpu.when(_one_thread(state)):
            try:
                impl(src.memref, dst.memref)
            except (NotImplementedError, ValueError) as e:
                raise state.fail(f"this plgpu.{fn} ({e})") from None
        return []
    return rule


registry.rule(copy_scales_p, lazy=True)(
    _copy_rule(tcgen05.async_copy_scales_smem_to_tmem, "async_copy_scales_to_tmem"))
registry.rule(copy_sparse_metadata_p, lazy=True)(
    _copy_rule(tcgen05.async_copy_sparse_metadata_smem_to_tmem,
               "async_copy_sparse_metadata_to_tmem"))


@registry.rule(copy_smem_to_tmem_p, lazy=True)
def _copy_smem_rule(state: Any, eqn: Any, *args: Any, **_: Any) -> Any:
    """A tiled SMEM buffer is copied as JAX's lowering copies it: ``tcgen05.cp`` issued by one
    thread, asynchronous until ``tcgen05_commit_arrive``. An untiled one (which JAX's lowering
    refuses: ``tcgen05.cp`` reads whole tiles) goes through the warpgroup's registers
    (``tcgen05.st``, then ``commit_tmem``), complete on return."""
    src, dst = _role_views(state, eqn, args)
    fn = "plgpu.async_copy_smem_to_tmem"
    if src.kind != "smem" or src.transposed:
        raise state.fail(f"{fn} from other than an SMEM buffer")
    try:
        if src.tiled:
            with mgpu.when(_one_thread(state)):
                tcgen05.async_copy_smem_to_tmem(src.memref, dst.memref, values.SWIZZLE)
            return []
        value = values.FA.load_untiled(src.memref, layout=tcgen05.LAYOUT, optimized=False,
                                       is_signed=values.signed(src.dtype))
        dst.memref.store(value)
        tcgen05.commit_tmem()
    except (NotImplementedError, ValueError) as e:
        raise state.fail(f"this {fn} of {np.dtype(src.dtype).name}{list(src.shape)} "
                         f"({e})") from None
    return []


@registry.rule(tcgen05_commit_arrive_p, lazy=True)
def _commit_arrive_rule(state: Any, eqn: Any, *args: Any, collective_axis: Any = None,
                        **_: Any) -> Any:
    (bar,) = _role_views(state, eqn, args)
    with mgpu.when(_issuer(state, eqn, collective_axis, "tcgen05_commit_arrive")):
        tcgen05.commit_arrive(bar.barrier, collective=collective_axis is not None,
                              ctx=state.launch)
    return []


@registry.rule(async_load_tmem_p, lazy=True)
def _load_rule(state: Any, eqn: Any, *args: Any, dtype: Any, layout: str | None = None,
               **_: Any) -> Any:
    (view,) = _role_views(state, eqn, args)
    regs = None if layout is None else getattr(tcgen05, _LOAD_LAYOUTS[layout])
    try:
        return [view.memref.load(layout=regs, is_signed=values.signed(dtype))]
    except (NotImplementedError, ValueError) as e:
        raise state.fail(f"this TMEM read ({e})") from None


@registry.rule(async_store_tmem_p, lazy=True)
def _store_rule(state: Any, eqn: Any, *args: Any, **_: Any) -> Any:
    (view,) = _role_views(state, eqn, args)
    value = args[-1]
    try:
        if isinstance(value, values.Loaded) and not value.transposed:
            # Read straight from SMEM in the layout TMEM stores take (one row per thread).
            ref, signed = value.ref, values.signed(value.ref.dtype)
            value = values.FA.load_tiled(ref.memref, swizzle=values.SWIZZLE,
                                           is_signed=signed, layout=tcgen05.LAYOUT) \
                if ref.tiled else values.FA.load_untiled(
                    ref.memref, layout=tcgen05.LAYOUT, is_signed=signed, optimized=False)
        value = state.value(value)
        if not isinstance(value, values.FA):
            value = values.splat(value, view.shape, view.dtype)
        view.memref.store(values.relayout(value, tcgen05.LAYOUT))
    except (NotImplementedError, ValueError) as e:
        raise state.fail(f"this TMEM write ({e})") from None
    return []


@registry.rule(wait_load_tmem_p)
def _wait_load_rule(state: Any, eqn: Any, **_: Any) -> Any:
    tcgen05.wait_load_tmem()
    return []


@registry.rule(commit_tmem_p)
def _commit_tmem_rule(state: Any, eqn: Any, **_: Any) -> Any:
    tcgen05.commit_tmem()
    return []
