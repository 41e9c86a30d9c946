"""The names of ``jax.experimental.pallas.mosaic_gpu`` that this backend refuses, from one table.

``plgpu.<name>`` exists for each of them (the package's module ``__getattr__`` hands out
:class:`Refused` objects), so that ported code imports and fails where it uses the name:
calling it (a function), constructing it (a class) or reading one of its attributes (an enum
member such as ``plgpu.LoweringSemantics.Warpgroup``) raises
:class:`pallas_core.errors.UnsupportedError` naming ``plgpu.<name>``, why it is refused and the
fix. docs/backends/mosaic_gpu_api.md lists the same names as ``refused``.
"""

from __future__ import annotations

from typing import Any, NoReturn

from pallas_core.errors import UnsupportedError, UnsupportedNameError

# Why a group of names is refused, and the usual fix: (why, fix).
_BLACKWELL = ("the Blackwell (sm_100a) path here covers TMEM scratch, tcgen05_mma of SMEM "
              "operands, tcgen05_commit_arrive and TMEM loads and stores; SMEM-to-TMEM copies, "
              "block scaling, sparsity and explicit TMEM layouts are not supported",
              "keep operands in SMEM and accumulate in a float32 plgpu.TMEM buffer")
_DEVICES = ("this backend's multi-GPU support is multimem stores and reductions, "
            "plgpu.SemaphoreType.REGULAR semaphores (pl.semaphore_signal, pl.semaphore_wait, "
            "pl.get_global), semaphore_signal_multicast and plgpu.remote_ref; multicast Refs "
            "and parallel signals are not part of it",
            "use plgpu.remote_ref, plgpu.multimem_store / multimem_load_reduce and "
            "pl.semaphore_signal / pl.semaphore_wait, or communicate outside the kernel with "
            "collectives (jax.lax.all_gather, jax.lax.psum_scatter under shard_map)")
_LAYOUTS = ("the backend chooses register layouts itself (2-D arrays whose shape is a multiple "
            "of (64, 8) use the wgmma layout, other arrays a strided one)", "drop it")
_TRANSFORMS = ("the backend chooses SMEM tiling and swizzles itself (buffers whose two minor "
               "dimensions are multiples of 64 in a 16-bit dtype are tiled (8, 64) with a "
               "128-byte swizzle, 8-bit and 32-bit ones (8, 128 // itemsize) where "
               "plgpu.SMEM's TilingTransform and SwizzleTransform ask, others left plain)",
               "drop the transforms, or give plgpu.SMEM TilingTransform and SwizzleTransform")
_CLUSTER = ("blocks of a cluster cannot reach each other's shared memory or barriers here",
            "exchange data through GMEM and synchronise with separate kernels")
_WARPS = ("this backend runs code per warpgroup (lane semantics); warpgroups specialise "
          "(plgpu.emit_pipeline_warp_specialized), and warps only inside "
          "pl.core_map(plgpu.WarpMesh(axis_name=...))",
          "branch on lax.axis_index of the thread axis for per-warpgroup work, use "
          "plgpu.emit_pipeline_warp_specialized, or pl.core_map over plgpu.WarpMesh for "
          "per-warp work")

# name: (what it is in JAX, (why, fix)): the "refused" rows of docs/backends/mosaic_gpu_api.md,
# and its "core" and "not applicable" rows, whose fix names the equivalent.
REFUSED: dict[str, tuple[str, tuple[str, str]]] = {
    # New in JAX 0.12.
    "alloc_semaphore": ("makes a GMEM semaphore Ref outside a kernel, outliving one call",
                        ("semaphores here live for one kernel call",
                         "allocate them in scratch_shapes with plgpu.SemaphoreType.REGULAR")),
    "im2col_ref": ("an im2col view of a GMEM Ref for TMA copies",
                   ("TMA im2col copies are not lowered here",
                    "copy the convolution windows with ordinary slices")),
    "as_torch_kernel": ("makes a kernel callable on PyTorch tensors",
                        ("kernels here take and return JAX arrays",
                         "exchange tensors with PyTorch through jax.dlpack")),
    "async_copy_scales_to_tmem": ("copies block-scaling factors from SMEM to TMEM", _BLACKWELL),
    "async_copy_smem_to_tmem": ("copies an SMEM buffer into TMEM", _BLACKWELL),
    "async_copy_sparse_metadata_to_tmem": ("copies sparsity metadata to TMEM", _BLACKWELL),
    "async_store_smem": ("stores into the SMEM of another block of the cluster", _CLUSTER),
    "barrier_test": ("tests a barrier's phase without blocking",
                     ("barriers here are only waited for", "use plgpu.barrier_wait")),
    "cluster_ref": ("a view of an SMEM buffer in another block of the cluster", _CLUSTER),
    "format_tcgen05_sparse_metadata": ("orders sparsity metadata for tcgen05_mma", _BLACKWELL),
    "inline_mgpu": ("inlines code written against the Mosaic GPU library",
                    ("kernels cannot hold code written for jax.experimental.mosaic.gpu",
                     "write the operation with plgpu and jax.numpy")),
    "multicast_ref": ("a Ref whose writes reach every device along mesh axes", _DEVICES),
    "OOBFillMode": ("what out-of-bounds elements of a TMA load become",
                    ("out-of-bounds elements of a TMA load are zeros here; no mode can be "
                     "chosen", "drop oob_mode=")),
    "PeerMemRef": ("JAX's class of the transform remote_ref applies",
                   ("plgpu.remote_ref makes the core's peer view here "
                    "(pallas_core.backend.PeerRefTransform)", "call plgpu.remote_ref")),
    "PipelinePipeline": ("the stage of a warp-specialised pipeline", _WARPS),
    "print_layout": ("prints the layout chosen for an array or Ref",
                     (_LAYOUTS[0], "drop it; the rules are on docs/backends/mosaic_gpu_api.md")),
    "RefType": ("marks an inline_mgpu argument as a Ref",
                ("kernels cannot hold code written for jax.experimental.mosaic.gpu",
                 "write the operation with plgpu and jax.numpy")),
    "RefUnion": ("scratch buffers sharing one SMEM region",
                 ("scratch buffers here do not share memory",
                  "allocate them separately, or reuse one buffer")),
    "REGS": ("the register memory space",
             ("arrays are plain values here and accumulators are allocated with plgpu.ACC",
              "use plgpu.ACC((M, N), dtype) for a wgmma accumulator")),
    "Replicated": ("a replicated dimension of a register layout", _LAYOUTS),
    "Tiling": ("a tiling expression of a register layout", _LAYOUTS),
    "TMEMLayout": ("layouts of TMEM buffers", _BLACKWELL),
    "TraceScope": ("what the in-kernel profiler records",
                   ("there is no in-kernel profiler here",
                    "profile the whole kernel with jax.profiler")),
    "Transform": ("the base class of Ref transforms", _TRANSFORMS),
    "transform_ref": ("applies a Ref transform", _TRANSFORMS),
    "WGMMAAccumulatorRef": ("JAX's accumulator class",
                            ("plgpu.ACC((M, N)) returns a scratch description here, not an "
                             "instance of a class",
                             "allocate accumulators with plgpu.ACC((M, N), dtype), or start "
                             "one at a value with pl.run_state(f)(plgpu.ACC.init(value))")),
}


def message(name: str) -> str:
    """The refusal of ``plgpu.<name>``: what it is, why it is refused and the fix."""
    what, (why, fix) = REFUSED[name]
    return (f"plgpu.{name} ({what} in jax.experimental.pallas.mosaic_gpu) is not supported by "
            f"the mosaic_gpu backend: {why}. Fix: {fix}.")


class Refused:
    """``plgpu.<name>`` for a refused name: using it raises ``UnsupportedError``."""

    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "_name", name)

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise UnsupportedError(message(self._name))

    def __getattr__(self, attr: str) -> NoReturn:
        if attr.startswith("__"):
            raise AttributeError(attr)  # protocols (copy, pickle, inspect) see a plain object
        raise UnsupportedNameError(f"{message(self._name)} (reading .{attr})")

    def __getitem__(self, key: Any) -> NoReturn:
        raise UnsupportedError(message(self._name))

    def __repr__(self) -> str:
        return f"<plgpu.{self._name}: refused>"


_OBJECTS = {name: Refused(name) for name in REFUSED}


def module_getattr(name: str) -> Refused:
    """The ``__getattr__`` of ``pallas_mosaic_gpu``: a :class:`Refused` for refused names."""
    try:
        return _OBJECTS[name]
    except KeyError:
        raise AttributeError(f"module 'pallas_mosaic_gpu' has no attribute {name!r}") from None
