"""``plgpu.im2col_ref`` (JAX 0.12): the im2col view of a channels-last GMEM Ref, read by
``copy_gmem_to_smem``.

For ``ref`` of shape ``(N, *spatial, C)`` (1 to 3 spatial dimensions) with windows
``window_shape`` and zero padding ``padding`` (``(lo, hi)`` per spatial dimension), the view
has one row per window position, ``N * prod(out)`` rows where ``out[i] = spatial[i] + lo + hi -
window_shape[i] + 1``, then one dimension per window dimension, then ``C``. Row ``r`` is the
window at ``(n, *p) = unravel(r, (N, *out))`` of the padded input, so that
``view[r, *d, c] == padded[n, *(p + d), c]``. A copy reads ``view.at[rows, *d, channels]``
(``rows`` and ``channels`` unit-stride slices, ``d`` one scalar per window dimension) into a
2-D SMEM Ref ``(rows, channels)``; rows and channels past the view's end read as zeros.

The interpreter gathers the rows with ``jax.numpy``; the Mosaic GPU lowering (TMA's im2col
mode) is not written here, and a kernel copying through the view is refused when lowered.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from pallas_core import backend as plb
from pallas_core.backend import PallasError, RefViews, bind_views
from pallas_mosaic_gpu import primitives as gp
from pallas_mosaic_gpu import registry

im2col_copy_p = gp._primitive("gpu_im2col_copy")


@dataclasses.dataclass(frozen=True)
class Im2colRef:
    """The view ``im2col_ref`` returns: index it with ``.at[rows, *offsets, channels]``."""

    ref: Any
    window_shape: tuple[int, ...]
    padding: tuple[tuple[int, int], ...]

    @property
    def out(self) -> tuple[int, ...]:
        """Window positions along each spatial dimension."""
        spatial = tuple(self.ref.shape[1:-1])
        return tuple(s + lo + hi - k + 1
                     for s, (lo, hi), k in zip(spatial, self.padding, self.window_shape))

    @property
    def shape(self) -> tuple[int, ...]:
        """``(N * prod(out), *window_shape, C)``."""
        return (self.ref.shape[0] * math.prod(self.out), *self.window_shape, self.ref.shape[-1])

    @property
    def dtype(self) -> Any:
        """The dtype of the Ref viewed."""
        return self.ref.dtype

    @property
    def at(self) -> _At:
        """``view.at[rows, *window_offsets, channels]``: what a copy reads."""
        return _At(self)


@dataclasses.dataclass(frozen=True)
class _At:
    view: Im2colRef

    def __getitem__(self, idx: Any) -> Im2colWindow:
        view = self.view
        idx = idx if isinstance(idx, tuple) else (idx,)
        k = len(view.window_shape)
        if len(idx) != k + 2:
            raise PallasError(f"plgpu.im2col_ref(...).at[...]: expected {k + 2} indices (rows, "
                              f"{k} window offsets, channels), found {len(idx)}.")
        rows = _slice(idx[0], view.shape[0], "rows", 1024)
        chans = _slice(idx[-1], view.shape[-1], "channels", 256)
        offsets = tuple(idx[1:-1])
        for d in offsets:
            if isinstance(d, slice) or (hasattr(d, "size") and not hasattr(d, "dtype")) or \
                    getattr(d, "shape", ()) != ():
                raise PallasError("plgpu.im2col_ref(...).at[...]: each window offset must be a "
                                  f"scalar, found {d!r}.")
        return Im2colWindow(view, rows, offsets, chans)


def _slice(s: Any, dim: int, what: str, most: int) -> tuple[Any, int]:
    if isinstance(s, slice):
        if s.step not in (None, 1):
            raise PallasError(f"plgpu.im2col_ref: {what} must be a unit-stride slice.")
        start = 0 if s.start is None else s.start
        stop = dim if s.stop is None else s.stop
        start_v, size = start, int(stop) - int(start)
    elif hasattr(s, "size") and hasattr(s, "start"):  # pl.ds(start, size)
        if getattr(s, "stride", 1) != 1:
            raise PallasError(f"plgpu.im2col_ref: {what} must be a unit-stride slice.")
        start_v, size = s.start, int(s.size)
    else:
        raise PallasError(f"plgpu.im2col_ref(...).at[...]: {what} must be a slice, found {s!r}.")
    if not 0 < size <= most:
        raise PallasError(f"plgpu.im2col_ref: a copy reads 1 to {most} {what}, found {size}.")
    return start_v, size


@dataclasses.dataclass(frozen=True)
class Im2colWindow:
    """What ``copy_gmem_to_smem`` reads from an :class:`Im2colRef`."""

    view: Im2colRef
    rows: tuple[Any, int]
    offsets: tuple[Any, ...]
    channels: tuple[Any, int]


def im2col_ref(ref: Any, *, window_shape: Sequence[int],
               padding: Sequence[tuple[int, int]] | None = None) -> Im2colRef:
    """The im2col view of ``ref`` (channels-last GMEM ``(N, *spatial, C)``, 1 to 3 spatial
    dimensions) for ``copy_gmem_to_smem``; see :mod:`pallas_mosaic_gpu.im2col`."""
    window = tuple(int(k) for k in window_shape)
    pads = ((0, 0),) * len(window) if padding is None else tuple(
        (int(lo), int(hi)) for lo, hi in padding)
    if not isinstance(plb.typeof(ref), plb.AbstractRef) or \
            plb.ref_and_transforms(ref, None, "im2col_ref")[1] or gp._space_name(ref) not in (
                "GMEM", "any", "None"):
        raise PallasError(f"plgpu.im2col_ref: expected a whole GMEM Ref (no view of one), "
                          f"found {ref!r}.")
    spatial = tuple(ref.shape[1:-1])
    if not 1 <= len(spatial) <= 3 or len(window) != len(spatial) or len(pads) != len(spatial):
        raise PallasError(f"plgpu.im2col_ref: a Ref of shape {tuple(ref.shape)} with "
                          f"window_shape={window} and padding={pads}: expected (N, *spatial, C)"
                          " with 1 to 3 spatial dimensions, one window size and one (lo, hi) "
                          "padding each.")
    if any(lo < 0 or hi < 0 for lo, hi in pads) or any(k < 1 for k in window):
        raise PallasError(f"plgpu.im2col_ref: padding {pads} must be >= 0 and window_shape "
                          f"{window} >= 1.")
    view = Im2colRef(ref, window, pads)
    if any(o < 1 for o in view.out):
        raise PallasError(f"plgpu.im2col_ref: windows {window} do not fit the padded spatial "
                          f"dimensions {spatial} + {pads}.")
    return view


def copy_im2col(src: Im2colWindow, dst: Any, barrier: Any) -> None:
    """``copy_gmem_to_smem`` from an im2col view (see :mod:`pallas_mosaic_gpu.im2col`)."""
    fn = "copy_gmem_to_smem"
    d, d_ref = gp._aval(dst, fn)
    rows, chans = src.rows[1], src.channels[1]
    if gp._space_name(d_ref) != "SMEM" or tuple(d.shape) != (rows, chans) or \
            d.dtype != src.view.dtype:
        raise PallasError(f"plgpu.{fn}: an im2col window of {rows} rows and {chans} channels "
                          f"of {src.view.dtype} goes into a 2-D SMEM Ref of that shape and "
                          f"dtype, found a Ref {d.dtype}{list(d.shape)} in "
                          f"{gp._space_name(d_ref)}.")
    gp._check_barrier(barrier, fn)
    scalars = [jnp.asarray(src.rows[0], jnp.int32), jnp.asarray(src.channels[0], jnp.int32),
               *(jnp.asarray(o, jnp.int32) for o in src.offsets)]
    bind_views(im2col_copy_p, [src.view.ref, dst, barrier], scalars, fn,
               window_shape=src.view.window_shape, padding=src.view.padding, rows=rows,
               chans=chans)


def gather(x: jax.Array, row0: Any, chan0: Any, offsets: Sequence[Any],
           window_shape: tuple[int, ...], padding: tuple[tuple[int, int], ...], rows: int,
           chans: int) -> jax.Array:
    """Rows ``row0 ...`` of the im2col view of the array ``x`` at ``offsets`` within each
    window, channels ``chan0 ...``: an array ``(rows, chans)``, zeros past the ends."""
    padded = jnp.pad(x, ((0, 0), *padding, (0, 0)))
    n_img = x.shape[0]
    out = [s + lo + hi - k + 1 for s, (lo, hi), k in zip(x.shape[1:-1], padding, window_shape)]
    total = n_img * math.prod(out)
    r = row0 + jnp.arange(rows, dtype=jnp.int32)
    inside = r < total
    rest = jnp.where(inside, r, 0)
    pos = []
    for size in reversed(out):
        pos.append(rest % size)
        rest = rest // size
    pos.reverse()
    at = tuple(p + o for p, o in zip(pos, offsets))
    picked = padded[(rest, *at)]  # (rows, C)
    c = x.shape[-1]
    widened = jnp.pad(picked, ((0, 0), (0, chans)))
    taken = lax.dynamic_slice_in_dim(widened, jnp.clip(chan0, 0, c), chans, axis=1)
    cols = chan0 + jnp.arange(chans)
    keep = inside[:, None] & (cols < c)[None, :]
    return jnp.where(keep, taken, jnp.zeros((), x.dtype))


def _copy(in_avals: Any, out_avals: Any, *args: Any, tree: Any, roles: Any,
          window_shape: Any, padding: Any, rows: int, chans: int) -> Any:
    state = RefViews(args, tree, roles)
    row0, chan0, *offsets = state.rest
    value = gather(state.read(0), row0, chan0, offsets, window_shape, padding, rows, chans)
    state.write(1, value)
    state.write(2, state.read(2) + 1)
    return state.new_values(), []


@registry.rule(im2col_copy_p, lazy=True)
def _copy_rule(state: Any, eqn: Any, *args: Any, **_: Any) -> Any:
    raise state.fail("plgpu.copy_gmem_to_smem from a plgpu.im2col_ref view (TMA's im2col "
                     "mode is not lowered by this backend; run the kernel in the interpreter, "
                     "or copy windows of the plain Ref)")


SEMANTICS: tuple[plb.PrimitiveSemantics, ...] = (
    plb.PrimitiveSemantics(im2col_copy_p, discharge=_copy),
)
