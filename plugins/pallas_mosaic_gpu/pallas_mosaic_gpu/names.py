"""Data classes, enums and small operations of ``jax.experimental.pallas.mosaic_gpu`` that
ported code names in signatures or passes around, with JAX's fields and members:
``OOBFillMode``, ``Replicated`` and ``Tiling`` (JAX's own Mosaic GPU library objects),
``TraceScope``, ``PipelinePipeline``, ``RefType``, ``Transform``, ``TMEMLayout``,
``WGMMAAccumulatorRef``, ``PeerMemRef``, ``RefUnion``, ``REGS``; and ``print_layout``,
``transform_ref`` (removed from JAX in 0.11, deprecated here) and ``alloc_semaphore``.
"""

from __future__ import annotations

import dataclasses
import enum
import warnings
from collections.abc import Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.mosaic.gpu import OOBFillMode
from jax.experimental.mosaic.gpu.fragmented_array import Replicated, Tiling

from pallas_core import backend as plb
from pallas_core.backend import PallasError, UnsupportedError
from pallas_mosaic_gpu.params import ACC, ACC_SPACE, SMEM, TMEM, MemoryRef, TraceScope

__all__ = ["OOBFillMode", "PeerMemRef", "PipelinePipeline", "REGS", "RefType", "RefUnion",
           "Replicated", "TMEMLayout", "Tiling", "TraceScope", "Transform",
           "WGMMAAccumulatorRef", "print_layout", "transform_ref"]


class PipelinePipeline(enum.IntEnum):
    """The stage of a warp-specialised pipeline a step is in: filling, steady, draining."""

    START = 0
    STEADY = 1
    STOP = 2


class Transform(Protocol):
    """The interface of a Ref transform (``TilingTransform``, ``SwizzleTransform``, views):
    the Ref type it makes, its effect on a value, and the transform that undoes it."""

    def transform_type(self, x: Any) -> Any:
        """The aval of the Ref after the transform, given the aval ``x`` before it."""
        raise NotImplementedError(type(self))

    def transform_array(self, x: Any) -> Any:
        """The transform applied to the array ``x``."""
        raise NotImplementedError(type(self))

    def undo(self, x: Any) -> Any:
        """The transform that undoes this one on a Ref of aval ``x``."""
        raise NotImplementedError(type(self))

    def pretty_print(self, context: Any) -> Any:
        """How a jaxpr prints the transform."""
        return f"{{{self}}}"


@dataclasses.dataclass(frozen=True)
class RefType:
    """An argument of an ``inline_mgpu`` function that is a Ref, seen through
    ``transforms``."""

    transforms: tuple[Any, ...] = ()


class TMEMLayout(enum.Enum):
    """Named layouts of TMEM buffers: block-scaling factors, sparsity metadata and the
    collective M=64 layouts. Calling a member (``TMEMLayout.SCALES_LAYOUT(...)``) gives it
    parameters, as in JAX."""

    SCALES_LAYOUT = 1
    SPARSE_METADATA_LAYOUT = 2
    M64_COLLECTIVE_LAYOUT = 3
    SCALES_M64_COLLECTIVE_LAYOUT = 4

    def __call__(self, *args: Any, **kwargs: Any) -> ParameterizedTMEMLayout:
        return ParameterizedTMEMLayout(self, args, kwargs)


@dataclasses.dataclass(frozen=True)
class ParameterizedTMEMLayout:
    """A :class:`TMEMLayout` with its arguments."""

    layout: TMEMLayout
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class _Uninitialized:
    def __repr__(self) -> str:
        return "uninitialized"


_UNINITIALIZED = _Uninitialized()


@dataclasses.dataclass(frozen=True)
class WGMMAAccumulatorRef:
    """JAX's accumulator class: ``WGMMAAccumulatorRef((M, N), dtype)`` in ``scratch_shapes``
    or ``pl.run_scoped`` allocates a zeroed ``wgmma`` accumulator (as ``plgpu.ACC((M, N),
    dtype)``); ``WGMMAAccumulatorRef.init(value)`` one starting at ``value``, for
    ``pl.run_state``."""

    shape: tuple[int, int]
    dtype: Any = jnp.float32
    _init: Any = _UNINITIALIZED

    def memory_ref(self) -> MemoryRef:
        """The scratch description (``scratch_shapes`` and ``pl.run_scoped`` take it)."""
        if self._init is not _UNINITIALIZED:
            raise PallasError("plgpu.WGMMAAccumulatorRef.init(value) starts an accumulator for "
                              "pl.run_state only. Fix: pass plgpu.WGMMAAccumulatorRef(shape, "
                              "dtype) as scratch, or use pl.run_state.")
        return ACC(self.shape, self.dtype)

    @staticmethod
    def init(array: Any) -> WGMMAAccumulatorRef:
        """An accumulator starting at ``array`` (an (M, N) array), for ``pl.run_state``."""
        array = jnp.asarray(array)
        ACC.init(array)  # checks shape and dtype
        return WGMMAAccumulatorRef(tuple(array.shape), array.dtype, _init=array)


def _wgmma_ref_aval(ref: WGMMAAccumulatorRef) -> tuple[Any, Any]:
    value = (jnp.zeros(ref.shape, ref.dtype) if ref._init is _UNINITIALIZED else ref._init)
    ACC.init(value)
    return plb.make_ref_aval(tuple(ref.shape), np.dtype(ref.dtype), ACC_SPACE), value


plb.register_initial_ref(WGMMAAccumulatorRef, _wgmma_ref_aval)


@dataclasses.dataclass
class PeerMemRef:
    """JAX's transform of ``remote_ref``: the same buffer on device ``device_id`` (of
    ``device_id_type``). ``transform_ref(ref, PeerMemRef(d, t))`` is ``remote_ref(ref, d,
    t)``."""

    device_id: Any
    device_id_type: Any


jax.tree_util.register_dataclass(PeerMemRef, data_fields=["device_id"],
                                 meta_fields=["device_id_type"])


class _RegisterSpace:
    """``plgpu.REGS``: the register memory space. ``REGS((M, N), dtype)`` allocates a wgmma
    accumulator, the one kind of register buffer a kernel allocates (as ``plgpu.ACC``)."""

    name = "REGS"

    def __call__(self, shape: Sequence[int], dtype: Any = jnp.float32) -> MemoryRef:
        return ACC(shape, dtype)

    def __repr__(self) -> str:
        return "plgpu.REGS"


REGS = _RegisterSpace()


class RefUnion:
    """Scratch buffers (trees of ``plgpu.SMEM`` or of ``plgpu.TMEM`` ones, one tree per
    group) that may share memory, so that only groups whose lifetimes are disjoint may be
    used. The kernel receives the tuple of the groups' Refs (``a, (b, c) = union``). This
    backend gives each buffer its own memory, one of the placements the union allows."""

    refs: tuple[Any, ...]

    def __init__(self, *refs: Any) -> None:
        leaves = jax.tree_util.tree_leaves(refs)
        spaces = {getattr(getattr(r, "memory_space", None), "name", None) for r in leaves}
        if not leaves or len(spaces) != 1 or spaces - {"SMEM", "TMEM"}:
            raise PallasError(f"plgpu.RefUnion: expected plgpu.SMEM buffers or plgpu.TMEM "
                              f"buffers (all in one memory space), found {refs!r}.")
        self.refs = refs

    @property
    def memory_space(self) -> Any:
        """``plgpu.SMEM`` or ``plgpu.TMEM``, the memory space of every buffer."""
        leaf = jax.tree_util.tree_leaves(self.refs)[0]
        return SMEM if leaf.memory_space.name == "SMEM" else TMEM

    @property
    def transforms(self) -> tuple[Any, ...]:
        """No transforms (those of the buffers apply to each)."""
        return ()

    def __repr__(self) -> str:
        return f"plgpu.RefUnion{self.refs!r}"


def _union_groups(_: None, groups: Any) -> Any:
    # A kernel's scratch Refs are unflattened through this: the union becomes its groups.
    return tuple(groups)


jax.tree_util.register_pytree_node(
    RefUnion, lambda u: (list(u.refs), None), _union_groups)


def print_layout(fmt: str, x: Any) -> None:
    """Prints ``fmt.format(layout)``, the layout this backend chooses for ``x`` (an array, or
    an SMEM or TMEM Ref), once, when the kernel is traced; results do not depend on it."""
    if not isinstance(fmt, str):
        raise PallasError(f"plgpu.print_layout(fmt={fmt!r}): expected a format string.")
    print(fmt.format(describe_layout(x)))


def describe_layout(x: Any) -> str:
    """The layout of ``x`` as :func:`print_layout` prints it."""
    from pallas_mosaic_gpu.transforms import asked_layout, chosen_layout

    aval = plb.typeof(x)
    if isinstance(aval, plb.AbstractRef):
        ref, transforms = plb.ref_and_transforms(x, None, "print_layout")
        shape_aval = plb.shape_after_transforms(plb.ref_type_of(ref), transforms)
        space = getattr(getattr(plb.ref_type_of(ref), "memory_space", None), "name", None)
        shape, dtype = tuple(shape_aval.shape), np.dtype(shape_aval.dtype)
        what = f"{dtype.name}{list(shape)}"
        if space == "SMEM":
            tiled = chosen_layout(shape, dtype) or (
                asked_layout(shape, dtype) if getattr(plb.ref_type_of(ref).memory_space,
                                                      "tiled", False) else None)
            if tiled is None:
                return f"SMEM {what}: row-major, not tiled or swizzled"
            (t0, t1), swizzle = tiled
            return f"SMEM {what}: TilingTransform(({t0}, {t1})), SwizzleTransform({swizzle})"
        if space == "TMEM":
            mspace = plb.ref_type_of(ref).memory_space
            if mspace.layout is not None:
                return f"TMEM {what}: TMEMLayout.{mspace.layout}"
            if mspace.packing > 1:
                return f"TMEM {what}: {mspace.packing} elements per lane and 32-bit column " \
                    "(packed)"
            return f"TMEM {what}: one element per lane and 32-bit column (the default layout)"
        if space == "ACC":
            return f"ACC {what}: WGMMA (the wgmma accumulator layout)"
        raise PallasError(f"plgpu.print_layout: expected an array or an SMEM or TMEM Ref, found "
                          f"a Ref in {space}.")
    shape, dtype = tuple(np.shape(x)), np.dtype(getattr(x, "dtype", np.float32))
    wgmma = len(shape) == 2 and shape[0] % 64 == 0 and shape[1] % 8 == 0
    return (f"{dtype.name}{list(shape)}: "
            + ("WGMMA (the wgmma register layout)" if wgmma else "WG_STRIDED (strided)"))


def transform_ref(ref: Any, transform: Any) -> Any:
    """``ref`` seen through ``transform`` (deprecated; JAX removed it in 0.11): a
    ``PeerMemRef`` is ``remote_ref``, an object with a ``permutation`` (a transposition)
    ``ref.transpose`` and a ``SwizzleTransform`` the same Ref (a swizzle moves bytes, not
    elements). A ``TilingTransform`` view is refused: this backend tiles SMEM itself and
    addresses every Ref untiled."""
    from pallas_mosaic_gpu.multidevice import remote_ref
    from pallas_mosaic_gpu.transforms import SwizzleTransform, TilingTransform

    warnings.warn("plgpu.transform_ref is deprecated (removed from JAX in 0.11): use "
                  "plgpu.remote_ref or ref.transpose.", DeprecationWarning, stacklevel=2)
    if not isinstance(plb.typeof(ref), plb.AbstractRef):
        raise PallasError(f"plgpu.transform_ref: expected a Ref, found {ref!r}.")
    if isinstance(transform, PeerMemRef):
        return remote_ref(ref, transform.device_id, transform.device_id_type)
    if isinstance(transform, SwizzleTransform):
        return ref
    if hasattr(transform, "permutation") and not isinstance(transform, TilingTransform):
        return ref.transpose(tuple(transform.permutation))
    raise UnsupportedError(f"plgpu.transform_ref: the transform {transform!r} is not supported "
                           "by mosaic_gpu (it takes PeerMemRef, SwizzleTransform and "
                           "transpositions; SMEM is tiled by the backend and addressed untiled)."
                           " Fix: index the Ref untiled, or use ref.transpose or "
                           "plgpu.remote_ref.")
