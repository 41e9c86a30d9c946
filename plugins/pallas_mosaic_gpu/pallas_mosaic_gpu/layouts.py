"""Register layouts a kernel asks for, and the primitives that name them.

This backend picks the register layout of most arrays itself (docs/backends/mosaic_gpu.md,
"Layouts are chosen here"). A kernel written for ``jax.experimental.pallas.mosaic_gpu`` may
also name one, as JAX's attention kernel does for its running maxima
(``plgpu.layout_cast(jnp.full((64,), -inf), plgpu.Layout.WGMMA.reduce(1))``):

* :class:`Layout` names the layouts of Mosaic GPU's register arrays (``FragmentedArray``);
  ``Layout.WGMMA.reduce(1)`` is the layout of a row reduction of a wgmma-layout array (one
  value per row), ``.reduce(0)`` of a column reduction. Hopper's layouts map to the Mosaic
  GPU library's; Blackwell's (``TCGEN05*``) and the layouts of TMA gathers are refused when
  used, naming the member.
* ``layout_cast(x, layout)``: ``x`` in ``layout``; the value is unchanged (the interpreter
  returns ``x``).
* ``load(ref, idx, layout=)``: ``ref[idx]`` read straight into ``layout``.
* ``broadcasted_iota(dtype, shape, dimension, layout=)``: ``lax.broadcasted_iota`` built in
  ``layout``.
* ``commit_smem_to_gmem_group()``: closes a bulk group of the SMEM -> GMEM copies issued
  with ``copy_smem_to_gmem(..., commit_group=False)`` since the last group.

The lowering rules are in :mod:`pallas_mosaic_gpu.layout_rules`.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.experimental.mosaic import gpu as mgpu

from pallas_core import backend as plb
from pallas_core.backend import PallasError, UnsupportedError
from pallas_mosaic_gpu.primitives import GPU_SYNC


class SomeLayout:
    """A register layout: a :class:`Layout` member, one with arguments, or a reduction."""

    def reduce(self, axes: int | Sequence[int]) -> ReducedLayout:
        """The layout of a reduction over ``axes`` of an array in this layout
        (``Layout.WGMMA.reduce(1)``: one value per row of a wgmma-layout array)."""
        return ReducedLayout(self, (axes,) if isinstance(axes, int) else tuple(axes))

    def to_mgpu(self) -> Any:
        """The Mosaic GPU library's layout (``UnsupportedError`` for a refused one)."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class ParameterizedLayout(SomeLayout):
    """A :class:`Layout` member called with arguments (``Layout.WG_STRIDED((128,), 2)``)."""

    layout_cls: Layout
    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...]

    def to_mgpu(self) -> Any:
        return self.layout_cls.to_mgpu(*self.args, **dict(self.kwargs))


@dataclasses.dataclass(frozen=True)
class ReducedLayout(SomeLayout):
    """``layout.reduce(axes)``: the layout of a reduction over ``axes``."""

    layout: SomeLayout
    axes: tuple[int, ...]

    def to_mgpu(self) -> Any:
        inner = self.layout.to_mgpu()
        if not isinstance(inner, mgpu.TiledLayout):
            raise UnsupportedError(
                f"{self}: only tiled layouts (such as plgpu.Layout.WGMMA) can be reduced, "
                f"found {inner}. Fix: reduce Layout.WGMMA (or another tiled layout).")
        return inner.reduce(self.axes)

    def __str__(self) -> str:
        return f"{self.layout}.reduce({', '.join(map(str, self.axes))})"


_BLACKWELL = ("a register layout of Blackwell's tcgen05 matmul and TMEM (sm_100); this "
              "backend targets Hopper (sm_90a)", "use Layout.WGMMA (the layout of wgmma "
              "accumulators)")
_GATHER = ("the layout of the row indices of a TMA gather, which this backend does not have",
           "gather with a loop of copies")
_COPY = ("a layout for copying registers between SMEM and GMEM, which this backend does "
         "not do", "copy with plgpu.copy_gmem_to_smem / copy_smem_to_gmem")


class Layout(SomeLayout, enum.Enum):
    """The register layouts of ``jax.experimental.pallas.mosaic_gpu``.

    Hopper's are supported: ``WGMMA`` (an (m, n) array, m % 64 == 0 == n % 8, as wgmma
    accumulates it), ``WGMMA_TRANSPOSED``, ``WGMMA_8BIT``, ``WGMMA_UPCAST_2X``,
    ``WGMMA_UPCAST_4X``, ``WG_SPLAT(shape)``, ``WG_STRIDED(shape, vec_size)``,
    ``TILED(tiling, ...)`` (Mosaic GPU's ``TiledLayout``), and reductions of the tiled ones
    (``WGMMA.reduce(1)``). Blackwell's ``TCGEN05*``, ``SMEM_GMEM_COPY`` and the TMA gather
    layouts ``TMA_INDICES*`` exist so that code naming them imports; using them raises
    ``UnsupportedError`` naming the member.
    """

    WGMMA = enum.auto()
    WGMMA_8BIT = enum.auto()
    WGMMA_UPCAST_2X = enum.auto()
    WGMMA_UPCAST_4X = enum.auto()
    WGMMA_TRANSPOSED = enum.auto()
    WG_SPLAT = enum.auto()
    WG_STRIDED = enum.auto()
    TILED = enum.auto()
    TCGEN05 = enum.auto()
    TCGEN05_TRANSPOSED = enum.auto()
    TCGEN05_M64_COLLECTIVE = enum.auto()
    TCGEN05_TMEM_NATIVE = enum.auto()
    TCGEN05_M64_COLLECTIVE_NATIVE = enum.auto()
    SMEM_GMEM_COPY = enum.auto()
    TMA_INDICES = enum.auto()
    TMA_INDICES_4 = enum.auto()

    def __call__(self, *args: Any, **kwargs: Any) -> ParameterizedLayout:
        """This layout with arguments (``WG_SPLAT(shape)``, ``WG_STRIDED(shape, vec_size)``)."""
        return ParameterizedLayout(self, tuple(args), tuple(sorted(kwargs.items())))

    def __str__(self) -> str:
        return f"plgpu.Layout.{self.name}"

    def to_mgpu(self, *args: Any, **kwargs: Any) -> Any:
        fixed = _FIXED.get(self.name)
        if fixed is not None:
            if args or kwargs:
                raise PallasError(f"{self} takes no arguments, found {args or kwargs}. Fix: "
                                  f"write {self} without calling it.")
            return getattr(mgpu, fixed)
        builder = _BUILT.get(self.name)
        if builder is not None:
            try:
                return builder(*args, **kwargs)
            except (TypeError, ValueError) as e:
                raise PallasError(f"{self}{args}: {e}. Fix: see the Mosaic GPU library's "
                                  f"{builder.__name__} for its arguments.") from None
        why, fix = _REFUSED[self.name]
        raise UnsupportedError(f"{self} ({why}) is not supported by the mosaic_gpu backend. "
                               f"Fix: {fix}.")


_FIXED = {"WGMMA": "WGMMA_LAYOUT", "WGMMA_8BIT": "WGMMA_LAYOUT_8BIT",
          "WGMMA_UPCAST_2X": "WGMMA_LAYOUT_UPCAST_2X",
          "WGMMA_UPCAST_4X": "WGMMA_LAYOUT_UPCAST_4X",
          "WGMMA_TRANSPOSED": "WGMMA_TRANSPOSED_LAYOUT"}
_BUILT = {"WG_SPLAT": mgpu.WGSplatFragLayout, "WG_STRIDED": mgpu.WGStridedFragLayout,
          "TILED": mgpu.TiledLayout}
_REFUSED = {"TCGEN05": _BLACKWELL, "TCGEN05_TRANSPOSED": _BLACKWELL,
            "TCGEN05_M64_COLLECTIVE": _BLACKWELL, "TCGEN05_TMEM_NATIVE": _BLACKWELL,
            "TCGEN05_M64_COLLECTIVE_NATIVE": _BLACKWELL, "SMEM_GMEM_COPY": _COPY,
            "TMA_INDICES": _GATHER, "TMA_INDICES_4": _GATHER}


def _check_layout(layout: Any, fn: str) -> SomeLayout:
    if not isinstance(layout, SomeLayout):
        raise PallasError(f"plgpu.{fn}: expected a plgpu.Layout (e.g. plgpu.Layout.WGMMA or "
                          f"plgpu.Layout.WGMMA.reduce(1)), found {layout!r}.")
    layout.to_mgpu()  # refused layouts fail here, where the kernel names them
    return layout


# --- primitives ------------------------------------------------------------------------------

layout_cast_p = plb.Primitive("gpu_layout_cast")
layout_cast_p.def_abstract_eval(lambda x, **_: x)

iota_p = plb.Primitive("gpu_broadcasted_iota")
iota_p.def_abstract_eval(lambda *, dtype, shape, dimension, layout: plb.ShapedArray(shape,
                                                                                    dtype))


commit_group_p = plb.effect_primitive("gpu_commit_smem_to_gmem_group", GPU_SYNC)


def layout_cast(x: Any, new_layout: SomeLayout) -> jax.Array:
    """``x`` held in the register layout ``new_layout`` (its value is unchanged)."""
    _check_layout(new_layout, "layout_cast")
    return layout_cast_p.bind(jax.numpy.asarray(x), new_layout=new_layout, optimized=False)


def load(src: Any, idx: Any = None, *, layout: SomeLayout | None = None,
         optimized: bool = True) -> jax.Array:
    """``src[idx]`` (an SMEM or GMEM Ref; the whole Ref without ``idx``, as JAX 0.12 spells
    it: ``plgpu.load(src.at[idx], layout=...)``), read into the register layout ``layout``
    (the backend's choice when ``None``). ``optimized``: the read must use vectorised accesses
    (the lowering fails otherwise); ``False`` allows any."""
    from pallas_core import load as core_load

    value = core_load(src, ... if idx is None else idx)
    if layout is None:
        return value  # type: ignore[no-any-return]
    _check_layout(layout, "load")
    return layout_cast_p.bind(value, new_layout=layout, optimized=bool(optimized))


def broadcasted_iota(dtype: Any, shape: Sequence[int], dimension: int, *,
                     layout: SomeLayout | None = None) -> jax.Array:
    """``jax.lax.broadcasted_iota(dtype, shape, dimension)`` built in the register layout
    ``layout`` (the backend's choice when ``None``)."""
    shape = tuple(int(d) for d in shape)
    if not 0 <= dimension < len(shape):
        raise PallasError(f"plgpu.broadcasted_iota: dimension {dimension} is not one of "
                          f"shape {shape}.")
    if layout is None:
        return lax.broadcasted_iota(dtype, shape, dimension)
    _check_layout(layout, "broadcasted_iota")
    return iota_p.bind(dtype=np.dtype(dtype), shape=shape, dimension=int(dimension),
                       layout=layout)


def commit_smem_to_gmem_group() -> None:
    """Closes a bulk group of the SMEM -> GMEM copies issued since the last one (those of
    ``copy_smem_to_gmem(..., commit_group=False)``); ``wait_smem_to_gmem(n)`` counts groups."""
    commit_group_p.bind()


# --- reference semantics -----------------------------------------------------------------------


def _same(ctx: Any, x: Any, **_: Any) -> Any:
    return x


def _iota(ctx: Any, *, dtype: Any, shape: Any, dimension: int, layout: Any) -> Any:
    return lax.broadcasted_iota(dtype, shape, dimension)


def _nothing(ctx: Any, **_: Any) -> Any:
    return []


SEMANTICS: tuple[plb.PrimitiveSemantics, ...] = (
    plb.PrimitiveSemantics(layout_cast_p, evaluate=_same),
    plb.PrimitiveSemantics(iota_p, evaluate=_iota),
    plb.PrimitiveSemantics(commit_group_p, evaluate=_nothing),
)
