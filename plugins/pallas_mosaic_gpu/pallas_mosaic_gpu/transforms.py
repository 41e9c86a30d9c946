"""SMEM transforms and block specs as JAX's ``jax.experimental.pallas.mosaic_gpu`` spells them:
``TilingTransform``, ``SwizzleTransform``, ``find_swizzle``, ``BlockSpec`` (with
``transforms``, ``delay_release`` and ``collective_axes``).

This backend chooses SMEM layouts itself (docs/backends/mosaic_gpu.md, "Layouts are chosen
here"): a buffer whose two minor dimensions are multiples of 64 in a 16-bit dtype is tiled
(8, 64) and swizzled by 128 bytes, as ``wgmma`` reads it; other buffers stay plain. A
kernel may still name the transforms it expects, as JAX's kernels do: they are accepted where
they describe the layout chosen here, and refused with a :class:`PallasError` naming the
transform and the layout the backend would use where they do not (a kernel whose meaning
depended on a different layout would otherwise be silently re-laid out).

Buffers of 8-bit and 32-bit dtypes are plain unless the kernel asks for tiling: transforms
``TilingTransform((8, 128 // itemsize))`` and ``SwizzleTransform(128)`` (JAX's kernels spell
them ``(8, swizzle * 8 // bits)``) tile them the same way, 128 bytes of a row per tile
(:func:`asked_layout`); ``plgpu.SMEM`` then puts the buffer in
:data:`pallas_mosaic_gpu.params.TILED_SMEM`, which says so (in ``scratch_shapes`` and
``pl.run_scoped`` alike).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

import pallas_core as pl
from pallas_core.backend import PallasError

SWIZZLE = 128
"""Bytes of the swizzle of the SMEM buffers this backend tiles (see the module's docstring)."""


@dataclasses.dataclass(frozen=True)
class TilingTransform:
    """Tiles the trailing dimensions of an SMEM buffer by ``tiling`` (a buffer (M, N) tiled
    (X, Y) is held as (M // X, N // Y, X, Y))."""

    tiling: tuple[int, ...]

    def __post_init__(self) -> None:
        tiling = tuple(self.tiling)
        if not tiling or not all(isinstance(t, (int, np.integer)) and t > 0 for t in tiling):
            raise PallasError(f"plgpu.TilingTransform({self.tiling!r}): expected a tuple of "
                              "positive ints, e.g. TilingTransform((8, 64)).")
        object.__setattr__(self, "tiling", tuple(int(t) for t in tiling))


@dataclasses.dataclass(frozen=True)
class SwizzleTransform:
    """Swizzles an SMEM buffer's rows by ``swizzle`` bytes (32, 64 or 128)."""

    swizzle: int

    def __post_init__(self) -> None:
        if self.swizzle not in (32, 64, 128):
            raise PallasError(f"plgpu.SwizzleTransform({self.swizzle!r}): the swizzles are 32, "
                              "64 and 128 bytes.")


def find_swizzle(minor_dim_bits: int, what: str = "") -> int:
    """The widest swizzle (128, 64, 32 or 16 bytes) whose span divides ``minor_dim_bits``, the
    size in bits of a buffer's minor dimension (``n * dtype bits``); a PallasError if none."""
    for swizzle in (128, 64, 32, 16):
        if minor_dim_bits % (swizzle * 8) == 0:
            return swizzle
    raise PallasError(f"plgpu.find_swizzle: no swizzle fits{' ' + what if what else ''}: its "
                      f"minor dimension has {minor_dim_bits} bits, not a multiple of 128 "
                      "(16 bytes). Fix: pad the minor dimension to a multiple of 16 bytes.")


def chosen_layout(shape: Sequence[int], dtype: Any) -> tuple[tuple[int, int], int] | None:
    """``(tiling, swizzle bytes)`` this backend gives an SMEM buffer, ``None`` if it is plain."""
    dt = np.dtype(dtype)
    elems = SWIZZLE // dt.itemsize
    if len(shape) >= 2 and dt.itemsize == 2 and shape[-2] % 64 == 0 and shape[-1] % elems == 0:
        return (8, elems), SWIZZLE
    return None


def asked_layout(shape: Sequence[int], dtype: Any) -> tuple[tuple[int, int], int] | None:
    """``(tiling, swizzle bytes)`` an SMEM buffer of an 8-bit or 32-bit dtype gets when the
    kernel asks for a tiled layout (its transforms, or a wgmma reading it): rows of 8 by 128
    bytes, swizzled by 128 bytes; ``None`` where its shape has no such tiles."""
    dt = np.dtype(dtype)
    if dt.itemsize not in (1, 4) or len(shape) < 2:
        return None
    from pallas_mosaic_gpu.values import swizzle_elems

    elems = swizzle_elems(dt)
    if shape[-2] % 8 or shape[-1] % elems:
        return None
    return (8, elems), SWIZZLE


def check_transforms(transforms: Sequence[Any], shape: Sequence[int], dtype: Any,
                     what: str) -> bool:
    """Raises a PallasError unless ``transforms`` (``TilingTransform`` and ``SwizzleTransform``
    entries) describe the layout this backend gives an SMEM buffer of ``shape`` and ``dtype``
    (``what`` names the buffer in the message). Returns whether they ask for a tiled layout
    the backend would not choose by itself (an 8-bit or 32-bit buffer, see
    :func:`asked_layout`)."""
    tiling = swizzle = None
    for t in transforms:
        if isinstance(t, TilingTransform) and tiling is None:
            tiling = t.tiling
        elif isinstance(t, SwizzleTransform) and swizzle is None:
            swizzle = t.swizzle
        else:
            raise PallasError(f"{what}: the transform {t!r} is not supported by mosaic_gpu "
                              "(which takes at most one TilingTransform and one "
                              "SwizzleTransform, and checks them against the layout it "
                              "chooses). Fix: drop it.")
    if tiling is None and swizzle is None:
        return False
    chosen = chosen_layout(shape, dtype)
    asked = chosen is None
    if asked:
        chosen = asked_layout(shape, dtype)
    shape_s = f"{np.dtype(dtype).name}{list(shape)}"
    if chosen is None:
        raise PallasError(
            f"{what}: transforms {tuple(transforms)} ask for a tiled SMEM buffer, but "
            f"mosaic_gpu keeps a {shape_s} buffer plain (it tiles buffers whose two minor "
            "dimensions are multiples of 64 in a 16-bit dtype, or of 8 and 128 bytes in an "
            "8-bit or 32-bit dtype). Fix: drop the transforms.")
    want_tiling, want_swizzle = chosen
    if (tiling is not None and tuple(tiling) != want_tiling) or \
            (swizzle is not None and swizzle != want_swizzle):
        name = ("TilingTransform" if tiling is not None and tuple(tiling) != want_tiling
                else "SwizzleTransform")
        raise PallasError(
            f"{what}: {name} in transforms {tuple(transforms)} disagrees with the layout "
            f"mosaic_gpu gives a {shape_s} SMEM buffer: TilingTransform({want_tiling}) and "
            f"SwizzleTransform({want_swizzle}). Fix: use those, or drop the transforms (the "
            "backend chooses SMEM layouts itself).")
    return asked


@dataclasses.dataclass(frozen=True)
class BlockSpec(pl.BlockSpec):
    """A ``pl.BlockSpec`` with the Mosaic GPU fields of JAX's ``plgpu.BlockSpec``.

    * ``transforms``: the SMEM layout the kernel expects for the block (``TilingTransform``,
      ``SwizzleTransform``); checked against the layout the backend chooses (see
      :func:`check_transforms`), refused where they differ.
    * ``delay_release``: how many steps after its own a pipeline keeps the block's buffer
      (for a ``wgmma`` still reading it); ``plgpu.emit_pipeline`` honours it.
    * ``collective_axes``: blocks shared by a cluster (collective copies); only ``()``.
    """

    transforms: Sequence[Any] = dataclasses.field(default=(), kw_only=True)
    delay_release: int = dataclasses.field(default=0, kw_only=True)
    collective_axes: tuple[Hashable, ...] = dataclasses.field(default=(), kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "transforms", tuple(self.transforms))
        delay = self.delay_release
        if not isinstance(delay, (int, np.integer)) or isinstance(delay, bool) or delay < 0:
            raise PallasError(f"plgpu.BlockSpec(delay_release={delay!r}): expected an int >= "
                              "0 (steps to keep the block's buffer after its step).")
        axes = self.collective_axes
        if axes not in ((), None):
            raise PallasError(f"plgpu.BlockSpec(collective_axes={axes!r}): collective copies "
                              "(one block fetched for a whole cluster) are not supported by "
                              "mosaic_gpu. Fix: drop collective_axes; each block fetches its "
                              "own copy.")
        for t in self.transforms:
            if not isinstance(t, (TilingTransform, SwizzleTransform)):
                raise PallasError(f"plgpu.BlockSpec(transforms=...): {t!r} is not supported by "
                                  "mosaic_gpu (only TilingTransform and SwizzleTransform, "
                                  "checked against the layout it chooses). Fix: drop it.")


def transpose_ref(ref: Any, permutation: tuple[int, ...]) -> Any:
    """A view of the SMEM Ref ``ref`` with its dimensions permuted (``ref.transpose``)."""
    from pallas_mosaic_gpu.params import TensorMemorySpace

    if isinstance(getattr(getattr(ref, "aval", None), "memory_space", None), TensorMemorySpace):
        raise PallasError("plgpu.transpose_ref: a TMEM Ref cannot be transposed.")
    return ref.transpose(tuple(permutation))
