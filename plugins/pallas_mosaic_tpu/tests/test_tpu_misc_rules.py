"""JAX's remaining Mosaic TPU rules for debugging, platforms and allocation, lowered as JAX
lowers them and run by the emulator against ``jax.numpy`` (or JAX's behaviour):

- ``lax.reduce_precision`` (``tpu.reduce_precision``, JAX 0.11 on; refused by name before,
  as JAX's lowering refuses it);
- ``pl.debug_check`` and ``checkify.debug_check`` (``cf.assert`` while
  ``pl.enable_debug_checks`` is on; the emulator raises the check's message);
- ``jax.debug.callback`` (nothing emitted, as in JAX's lowering; a warning says so);
- ``lax.platform_dependent`` (the ``mosaic`` branch, else the default);
- ``jax.empty_ref`` (a buffer of the kernel's own);
- ``custom_fusion`` (its Pallas form inlined).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import checkify
from jax.experimental import pallas as jax_pl

import pallas_core as pl
from pallas_core import backend as plb

pltpu = pytest.importorskip("pallas_mosaic_tpu")
from pallas_mosaic_tpu import inspection  # noqa: E402
from pallas_mosaic_tpu.emulator_compute import reduce_precision  # noqa: E402

NEW_IN_011 = pytest.mark.skipif(jax.__version_info__ < (0, 11),
                                reason="tpu.reduce_precision is new in JAX 0.11")


def _lower(f: Callable[..., Any], *args: Any) -> tuple[dict[str, Any], Any]:
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    (found,) = inspection.kernels(text)  # decoded and verified
    return found


def _theirs(f: Callable[..., Any], *args: Any) -> tuple[dict[str, Any], Any]:
    with plb.assume_device("TPU v5 lite", "tpu"):
        return _lower(f, *args)


def _ops(module: Any) -> set[str]:
    return {op.operation.name for op in plb_walk(module)}


def plb_walk(module: Any) -> Any:
    from pallas_core.mlir_lowering import walk
    return walk(module.operation)


def _x(shape: tuple[int, ...] = (8, 128), dtype: Any = jnp.float32, seed: int = 0) -> Any:
    return (jax.random.normal(jax.random.key(seed), shape) * 1e3).astype(dtype)


# --- reduce_precision ------------------------------------------------------------------------

def _rp_kernel(m: Any, x: Any, e: int, mant: int, **kw: Any) -> Any:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = lax.reduce_precision(x_ref[...], exponent_bits=e, mantissa_bits=mant)
    return m.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), **kw)


@NEW_IN_011
@pytest.mark.parametrize("dtype, e, mant", [(jnp.float32, 5, 10), (jnp.float32, 8, 7),
                                            (jnp.bfloat16, 4, 3), (jnp.float32, 4, 3)],
                         ids=["f32-to-f16", "f32-to-bf16", "bf16-to-e4m3", "f32-to-e4m3"])
def test_reduce_precision_lowers_like_jax_and_matches_lax(dtype: Any, e: int, mant: int) -> None:
    x = _x(dtype=dtype)
    want = np.asarray(lax.reduce_precision(x, exponent_bits=e, mantissa_bits=mant))
    np.testing.assert_array_equal(_rp_kernel(pl, x, e, mant, backend="interpret")(x), want)
    np.testing.assert_array_equal(pl.emulate(_rp_kernel(pl, x, e, mant),
                                             backend="mosaic_tpu")(x), want)
    _, ours = _lower(_rp_kernel(pl, x, e, mant), x)
    _, theirs = _theirs(_rp_kernel(jax_pl, x, e, mant), x)
    inspection.assert_same_kernel(ours, theirs)
    assert "tpu.reduce_precision" in _ops(ours) and "tpu.reduce_precision" in _ops(theirs)


def test_the_emulators_rounding_is_xlas_on_every_kind_of_value() -> None:
    """Specials, overflow to infinity, underflow to zero, ties: the emulator's rounding bit
    for bit against XLA's."""
    rng = np.random.default_rng(3)
    for dtype in (np.float32, jnp.bfloat16, np.float16):
        x = (rng.standard_normal(4096) * np.exp(rng.uniform(-30, 30, 4096))).astype(dtype)
        x[:6] = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 65504.0]).astype(dtype)
        for e, mant in [(5, 10), (8, 7), (4, 3), (5, 2), (3, 1), (8, 23)]:
            want = np.asarray(lax.reduce_precision(jnp.asarray(x), exponent_bits=e,
                                                   mantissa_bits=mant))
            got = reduce_precision(x, e, mant)
            np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
            np.testing.assert_array_equal(got[~np.isnan(want)], want[~np.isnan(want)])


@pytest.mark.skipif(jax.__version_info__ >= (0, 11), reason="lowers from JAX 0.11 on")
def test_reduce_precision_is_refused_by_name_before_jax_011() -> None:
    x = _x()
    with pytest.raises(pl.UnsupportedError, match=r"reduce_precision.*JAX 0\.11"):
        _lower(_rp_kernel(pl, x, 5, 10), x)


# --- checks ------------------------------------------------------------------------------------

CHECKS: dict[str, Callable[[Any], Callable[..., None]]] = {
    "pl": lambda m: m.debug_check,  # pl.debug_check (JAX's, or this project's)
    "checkify": lambda m: checkify.debug_check,
}


def _checked(check: str) -> Callable[[Any], Callable[..., None]]:
    """A kernel maker for module ``m``: ``x + 1`` after the ``check`` that ``x > -1e6``."""
    def make(m: Any) -> Callable[..., None]:
        def kernel(x_ref: Any, o_ref: Any) -> None:
            x = x_ref[...]
            CHECKS[check](m)(jnp.all(x > -1e6), "x too small")
            o_ref[...] = x + 1.0
        return kernel
    return make


@pytest.mark.parametrize("check", list(CHECKS))
def test_debug_checks_lower_to_cf_assert_and_the_emulator_checks_them(check: str) -> None:
    make = _checked(check)
    x = _x()
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    with pl.enable_debug_checks(True):
        _, ours = _lower(pl.pallas_call(make(pl), out), x)
        _, theirs = _theirs(jax_pl.pallas_call(make(jax_pl), out), x)
        inspection.assert_same_kernel(ours, theirs)
        assert "cf.assert" in _ops(ours) and "cf.assert" in _ops(theirs)
        emulated = pl.emulate(pl.pallas_call(make(pl), out), backend="mosaic_tpu")
        np.testing.assert_allclose(emulated(x), x + 1.0)
        with pytest.raises(pl.PallasError, match="x too small"):
            emulated(x.at[3, 7].set(-2e6))
    _, unchecked = _lower(pl.pallas_call(make(pl), out), x)
    assert "cf.assert" not in _ops(unchecked)


def test_a_functionalized_check_is_refused_by_name() -> None:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        checkify.check(jnp.all(x_ref[...] > 0), "positive")
        o_ref[...] = x_ref[...]

    x = _x()
    with pytest.raises(pl.PallasError, match=r"checkify\.check in a kernel"):
        _lower(pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype)), x)


# --- debug callbacks, platforms, empty_ref, custom_fusion --------------------------------------

def test_debug_callback_is_dropped_with_a_warning_as_jax_drops_it() -> None:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        jax.debug.callback(lambda v: None, x_ref[...])
        o_ref[...] = x_ref[...] * 3.0

    x = _x()
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    with pytest.warns(UserWarning, match=r"jax\.debug\.callback .* does nothing on a TPU"):
        _, ours = _lower(pl.pallas_call(kernel, out), x)
    _, theirs = _theirs(jax_pl.pallas_call(kernel, out), x)
    inspection.assert_same_kernel(ours, theirs)
    with pytest.warns(UserWarning):
        np.testing.assert_allclose(pl.emulate(pl.pallas_call(kernel, out),
                                              backend="mosaic_tpu")(x), x * 3.0)


@pytest.mark.parametrize("branches, want", [({"mosaic": 2.0, "default": 5.0}, 2.0),
                                            ({"cuda": 3.0, "default": 5.0}, 5.0)],
                         ids=["mosaic", "default"])
def test_platform_dependent_takes_the_mosaic_branch(branches: dict[str, float],
                                                    want: float) -> None:
    def times(c: float) -> Callable[[Any], Any]:
        return lambda v: v * c

    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = lax.platform_dependent(x_ref[...], **{k: times(c)
                                                            for k, c in branches.items()})

    x = _x()
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    np.testing.assert_allclose(pl.emulate(pl.pallas_call(kernel, out), backend="mosaic_tpu")(x),
                               x * want)
    _, ours = _lower(pl.pallas_call(kernel, out), x)
    _, theirs = _theirs(jax_pl.pallas_call(kernel, out), x)
    inspection.assert_same_kernel(ours, theirs)


def test_empty_ref_is_a_buffer_of_the_kernel() -> None:
    def kernel(x_ref: Any, o_ref: Any, *, m: Any) -> None:
        r = jax.empty_ref(jax.ShapeDtypeStruct((8, 128), jnp.float32), memory_space=m.VMEM)
        r[...] = x_ref[...] * 2.0
        o_ref[...] = r[...] + 1.0

    import functools

    from jax.experimental.pallas import tpu as jax_pltpu
    x = _x()
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    ours_k = functools.partial(kernel, m=pltpu)
    np.testing.assert_allclose(pl.emulate(pl.pallas_call(ours_k, out), backend="mosaic_tpu")(x),
                               x * 2.0 + 1.0)
    _, ours = _lower(pl.pallas_call(ours_k, out), x)
    _, theirs = _theirs(jax_pl.pallas_call(functools.partial(kernel, m=jax_pltpu), out), x)
    inspection.assert_same_kernel(ours, theirs)
    assert "memref.alloca" in _ops(ours) and "memref.alloca" in _ops(theirs)


def test_custom_fusion_inlines_its_pallas_form() -> None:
    from jax.experimental.pallas import fuser

    @fuser.custom_fusion
    def scale(v: Any) -> Any:
        return v * 2.0

    scale.def_eval_rule(lambda ctx, v: (v * 2.0,))
    scale.def_pull_block_spec(lambda transforms: transforms)
    scale.def_pallas_impl(lambda v: v + v)  # the same values, another form

    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = scale(x_ref[...]) + 1.0

    x = _x()
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    np.testing.assert_allclose(pl.emulate(pl.pallas_call(kernel, out), backend="mosaic_tpu")(x),
                               x * 2.0 + 1.0)
    np.testing.assert_allclose(pl.pallas_call(kernel, out, backend="interpret")(x),
                               x * 2.0 + 1.0)
    _, ours = _lower(pl.pallas_call(kernel, out), x)
    assert "arith.mulf" not in _ops(ours)  # the Pallas form (an add), not the ordinary one
    if jax.__version_info__ >= (0, 11):
        _, theirs = _theirs(jax_pl.pallas_call(kernel, out), x)
        inspection.assert_same_kernel(ours, theirs)
        assert "arith.mulf" not in _ops(theirs)


def test_the_state_primitive_broadcast_to_lowers() -> None:
    """``broadcast_to`` (a state primitive that JAX's Mosaic lowering refuses as
    Triton-specific) broadcasts as NumPy does, leading dimensions added."""
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = plb.broadcast_to_p.bind(x_ref[...], shape=(2, 8, 128))

    x = _x((1, 128))
    out = jax.ShapeDtypeStruct((2, 8, 128), x.dtype)
    np.testing.assert_array_equal(pl.emulate(pl.pallas_call(kernel, out),
                                             backend="mosaic_tpu")(x),
                                  np.broadcast_to(np.asarray(x), (2, 8, 128)))
    _, ours = _lower(pl.pallas_call(kernel, out), x)
    assert "vector.broadcast" in _ops(ours)
