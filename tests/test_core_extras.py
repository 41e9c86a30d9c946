"""The kernel-side names of ``jax.experimental.pallas`` added to the core (``dot``,
``reciprocal``, ``delay``, ``debug_check``, ``enable_poison_buffers``, ``Buffered``, ``Blocked``,
``with_scoped``, ``lower_as_mlir``): run in the interpreter against jax.numpy and JAX's
interpreter, lowered on each installed hardware backend, and refused with an
``UnsupportedError`` naming them where a backend has no meaning for them.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pallas_interpret
import pytest
from jax.experimental import pallas as jax_pl
from jax.experimental.pallas import tpu as jax_pltpu

import pallas_core as pl
from pallas_core.plugins import manager

SHAPE, BLOCK = (16, 128), (8, 128)
HARDWARE = [("triton", "cuda"), ("mosaic_tpu", "tpu"), ("mosaic_gpu", "cuda")]


def _rand(shape: tuple[int, ...] = SHAPE, seed: int = 0, dtype: Any = jnp.float32) -> jax.Array:
    return jax.random.uniform(jax.random.key(seed), shape, jnp.float32, 0.5, 2.0).astype(dtype)


def _blocked(m: Any, kernel: Any, *, out_dtype: Any = jnp.float32, spec_kw: Any = None,
             **kw: Any) -> Any:
    spec = m.BlockSpec(BLOCK, lambda i: (i, 0), **(spec_kw or {}))
    return m.pallas_call(kernel, jax.ShapeDtypeStruct(SHAPE, out_dtype), grid=(2,),
                         in_specs=[spec], out_specs=spec, **kw)


def _lower(fn: Any, platform: str, *args: Any) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def _need(backend: str) -> None:
    if backend not in manager.backends():
        pytest.skip(f"the {backend} backend is not installed")


def _mosaic(text: str) -> str:
    from pallas_mosaic_tpu import inspection

    (_, module), = inspection.kernels(text)
    return str(module)


# --- dot ----------------------------------------------------------------------------------------


def _jax_dot() -> Any:
    """JAX's ``pl.dot`` (deprecated in 0.10, removed from 0.11's namespace): skip without it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            return jax_pl.dot
        except AttributeError:
            pytest.skip("this JAX has no pl.dot to compare with")


@pytest.mark.parametrize(("trans_a", "trans_b"), [(False, False), (True, False), (False, True),
                                                  (True, True)])
def test_dot_matches_jax_and_jnp(trans_a: bool, trans_b: bool) -> None:
    def build(m: Any, dot: Any, **kw: Any) -> Any:
        def kernel(a_ref, b_ref, o_ref):
            o_ref[...] = dot(a_ref[...], b_ref[...], trans_a=trans_a, trans_b=trans_b,
                             allow_tf32=False)
        return m.pallas_call(kernel, jax.ShapeDtypeStruct((32, 64), jnp.float32), **kw)

    a = _rand((48, 32) if trans_a else (32, 48))
    b = _rand((64, 48) if trans_b else (48, 64), seed=1)
    ours = build(pl, pl.dot)(a, b)
    theirs = build(jax_pl, _jax_dot(), interpret=True)(a, b)
    want = jnp.matmul(a.T if trans_a else a, b.T if trans_b else b,
                      precision=jax.lax.Precision.HIGHEST)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    np.testing.assert_allclose(ours, want, rtol=1e-5)


@pytest.mark.parametrize(("dtypes", "out"), [
    ((jnp.int8, jnp.int8), jnp.int32), ((jnp.bfloat16, jnp.bfloat16), jnp.float32),
    ((jnp.float16, jnp.float32), jnp.float32)])
def test_dot_result_types_match_jax(dtypes: Any, out: Any) -> None:
    a, b = jnp.ones((4, 8), dtypes[0]), jnp.ones((8, 2), dtypes[1])
    assert pl.dot(a, b).dtype == _jax_dot()(a, b).dtype == out


def test_dot_argument_errors() -> None:
    with pytest.raises(pl.ArgumentError, match="2-D"):
        pl.dot(jnp.ones((2, 3, 4)), jnp.ones((4, 5)))
    with pytest.raises(pl.ArgumentError, match="not both"):
        pl.dot(jnp.ones((2, 3)), jnp.ones((3, 5)), allow_tf32=True,
               precision=jax.lax.Precision.HIGH)


@pytest.mark.parametrize(("backend", "platform"), HARDWARE)
def test_dot_lowers(backend: str, platform: str) -> None:
    _need(backend)

    def kernel(a_ref, b_ref, o_ref):
        o_ref[...] = pl.dot(a_ref[...], b_ref[...], trans_b=True)

    a, b = _rand((64, 64), dtype=jnp.bfloat16), _rand((64, 64), 1, jnp.bfloat16)
    fn = pl.pallas_call(kernel, jax.ShapeDtypeStruct((64, 64), jnp.float32), backend=backend)
    assert "custom_call" in _lower(fn, platform, a, b)


# --- reciprocal ---------------------------------------------------------------------------------


def _reciprocal_kernel(m: Any, approx: bool) -> Any:
    def kernel(x_ref, o_ref):
        o_ref[...] = m.reciprocal(x_ref[...], approx=approx)
    return kernel


@pytest.mark.parametrize("approx", [False, True])
def test_reciprocal_in_the_interpreter(approx: bool) -> None:
    x = _rand()
    ours = _blocked(pl, _reciprocal_kernel(pl, approx))(x)
    theirs = _blocked(jax_pl, _reciprocal_kernel(jax_pl, approx), interpret=True)(x)
    np.testing.assert_allclose(ours, 1.0 / x, rtol=1e-6)
    np.testing.assert_allclose(ours, theirs, rtol=1e-2 if approx else 1e-6)


def test_reciprocal_of_integers_is_an_error() -> None:
    with pytest.raises(pl.ArgumentError, match="floating-point"):
        pl.reciprocal(jnp.arange(3))


@pytest.mark.parametrize(("backend", "platform"), HARDWARE)
def test_exact_reciprocal_lowers_everywhere(backend: str, platform: str) -> None:
    _need(backend)
    fn = _blocked(pl, _reciprocal_kernel(pl, False), backend=backend)
    assert "custom_call" in _lower(fn, platform, _rand())


@pytest.mark.parametrize(("backend", "platform"), HARDWARE)
def test_approximate_reciprocal(backend: str, platform: str) -> None:
    _need(backend)
    fn = _blocked(pl, _reciprocal_kernel(pl, True), backend=backend)
    if backend != "mosaic_tpu":
        with pytest.raises(pl.UnsupportedError, match=rf"'reciprocal'.*'{backend}'"):
            _lower(fn, platform, _rand())
        return
    ours = _mosaic(_lower(fn, platform, _rand()))
    theirs = _mosaic(_lower(_blocked(jax_pl, _reciprocal_kernel(jax_pl, True)), "tpu", _rand()))
    found = [re.findall(r"tpu\.reciprocal %\w+ \{[^}]*\}", t) for t in (ours, theirs)]
    assert found[0] == found[1] == ["tpu.reciprocal %0 {approx = true}"]


# --- delay --------------------------------------------------------------------------------------


def _delay_kernel(m: Any) -> Any:
    def kernel(x_ref, o_ref):
        m.delay(1000)
        o_ref[...] = x_ref[...] * 3.0
    return kernel


def test_delay_leaves_results_alone() -> None:
    x = _rand()  # (JAX's interpreter has no rule for delay)
    np.testing.assert_allclose(_blocked(pl, _delay_kernel(pl))(x), x * 3.0)


def _mosaic_gpu(text: str) -> str:
    from pallas_mosaic_gpu import inspection

    (_, module), = inspection.kernels(text)
    return str(module)


@pytest.mark.parametrize(("backend", "platform"), HARDWARE)
def test_delay_lowers_on_tpu_and_gpu_and_is_refused_by_triton(backend: str,
                                                               platform: str) -> None:
    """Mosaic GPU's nanosleep is compared with JAX's module in
    plugins/pallas_mosaic_gpu/tests/test_gpu_rule_gaps.py."""
    _need(backend)
    fn = _blocked(pl, _delay_kernel(pl), backend=backend)
    if backend == "triton":
        with pytest.raises(pl.UnsupportedError, match=rf"'delay'.*'{backend}'"):
            _lower(fn, platform, _rand())
        return
    if backend == "mosaic_gpu":
        assert _mosaic_gpu(_lower(fn, platform, _rand())).count("nanosleep.u32") == 1
        return
    theirs = _mosaic(_lower(_blocked(jax_pl, _delay_kernel(jax_pl)), "tpu", _rand()))
    ours = _mosaic(_lower(fn, platform, _rand()))
    assert ours.count("tpu.delay") == theirs.count("tpu.delay") == 1


# --- debug_check and poisoned buffers -----------------------------------------------------------


def _checked_call(on_data: bool = True, **kw: Any) -> Any:
    def kernel(x_ref, o_ref):
        ok = jnp.min(x_ref[...]) > 1.0 if on_data else pl.program_id(0) < 2
        pl.debug_check(ok, "every x must exceed one")
        o_ref[...] = x_ref[...] - 1.0
    return _blocked(pl, kernel, **kw)


def test_debug_check_is_nothing_while_checks_are_off() -> None:
    x = _rand()
    assert not pl.enable_debug_checks.value and not pl.debug_checks_enabled()
    np.testing.assert_allclose(_checked_call()(x), x - 1.0)


def test_debug_check_reports_a_false_condition_while_checks_are_on() -> None:
    x = _rand()
    with pl.enable_debug_checks(True):
        assert pl.debug_checks_enabled()
        np.testing.assert_allclose(_checked_call()(x + 1.0), x, rtol=1e-6)
        with pytest.raises(Exception, match=r"pl\.debug_check failed: every x must exceed one"):
            jax.block_until_ready(_checked_call()(x))


@pytest.mark.parametrize(("backend", "platform"),
                         [(b, p) for b, p in HARDWARE if b == "triton"])
def test_enabled_debug_check_is_refused_by_hardware_backends(backend: str,
                                                             platform: str) -> None:
    """Refused where the backend has no rule for it (Mosaic TPU and Mosaic GPU lower it to
    cf.assert, as JAX does: plugins/pallas_mosaic_tpu/tests/test_tpu_misc_rules.py,
    plugins/pallas_mosaic_gpu/tests/test_gpu_rule_gaps.py)."""
    _need(backend)
    with pl.enable_debug_checks(True), pytest.raises(pl.UnsupportedError,
                                                     match=rf"'debug_check'.*'{backend}'"):
        _lower(_checked_call(on_data=False, backend=backend), platform, _rand())


def test_enabled_debug_check_is_an_assert_on_mosaic_gpu() -> None:
    _need("mosaic_gpu")
    with pl.enable_debug_checks(True):
        text = _lower(_checked_call(on_data=False, backend="mosaic_gpu"), "cuda", _rand())
    assert _mosaic_gpu(text).count("cf.assert") == 1


def test_poisoned_buffers_start_as_nan() -> None:
    def kernel(x_ref, o_ref, s_ref):
        o_ref[...] = x_ref[...] + s_ref[...]

    def call(**kw: Any) -> Any:
        return pl.pallas_call(kernel, jax.ShapeDtypeStruct(BLOCK, jnp.float32),
                              scratch_shapes=[pl.ANY(BLOCK, jnp.float32)], **kw)(_rand(BLOCK))

    zero = pallas_interpret.InterpretParams(uninitialized_memory="zero")
    assert np.isfinite(call(interpret=zero)).all()
    assert np.isnan(call()).all()  # JAX's interpret mode fills fresh scratch with NaN too
    with pl.enable_poison_buffers(True):
        assert np.isnan(call(interpret=zero)).all()


# --- pipeline modes and block dimensions --------------------------------------------------------


def _copy(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0


def test_buffered_does_not_change_results() -> None:
    x = _rand()
    for m, kw in ((pl, {}), (jax_pl, {"interpret": True})):
        out = _blocked(m, _copy, spec_kw={"pipeline_mode": m.Buffered(1)}, **kw)(x)
        np.testing.assert_allclose(out, x + 1.0)


@pytest.mark.parametrize(("backend", "platform"), HARDWARE)
def test_buffered_on_hardware_backends(backend: str, platform: str) -> None:
    _need(backend)

    def build(m: Any, **kw: Any) -> Any:
        mode = m.Buffered(2, revisit=m.RevisitMode.IMMEDIATE)
        return _blocked(m, _copy, spec_kw={"pipeline_mode": mode}, **kw)

    if backend != "mosaic_tpu":
        with pytest.raises(pl.UnsupportedError, match=rf"pipeline_mode=.*'{backend}'.*Fix"):
            _lower(build(pl, backend=backend), platform, _rand())
        return
    attrs = [re.findall(r"(?:pipeline|revisit)_mode = [^,}]*", _mosaic(_lower(f, "tpu", _rand())))
             for f in (build(pl, backend=backend), build(jax_pl))]
    assert attrs[0] == attrs[1] and len(attrs[0]) == 4
    with pytest.raises(pl.UnsupportedError, match=r"1 or 2 buffers"):
        _lower(_blocked(pl, _copy, spec_kw={"pipeline_mode": pl.Buffered(3)}, backend=backend),
               platform, _rand())


def test_pipeline_mode_must_be_buffered() -> None:
    with pytest.raises(pl.BlockSpecError, match="memory_space is keyword-only"):
        pl.BlockSpec(BLOCK, lambda i: (i, 0), pl.ANY)  # type: ignore[arg-type]
    with pytest.raises(pl.BlockSpecError, match=r"pl\.Buffered"):
        pl.BlockSpec(BLOCK, lambda i: (i, 0), pipeline_mode=2)  # type: ignore[arg-type]
    with pytest.raises(pl.BlockSpecError, match="positive int"):
        pl.Buffered(0)
    assert [m.value for m in pl.RevisitMode] == [m.value for m in jax_pl.RevisitMode]


def test_blocked_block_dims_match_ints() -> None:
    def build(m: Any, **kw: Any) -> Any:
        spec = m.BlockSpec((m.Blocked(8), m.Blocked(64)), lambda i, j: (i, j))
        return m.pallas_call(_copy, jax.ShapeDtypeStruct(SHAPE, jnp.float32), grid=(2, 2),
                             in_specs=[spec], out_specs=spec, **kw)

    x = _rand()
    ours = build(pl)(x)
    np.testing.assert_allclose(ours, build(jax_pl, interpret=True)(x))
    np.testing.assert_allclose(ours, x + 1.0)


# --- scoped allocation, unsupported keywords, lowering ------------------------------------------


def test_with_scoped_matches_jax() -> None:
    def build(m: Any, scratch: Any, **kw: Any) -> Any:
        def kernel(x_ref, o_ref):
            @m.with_scoped(scratch, acc=scratch)
            def body(x_ref, tmp, *, acc):
                tmp[...] = x_ref[...] * 2.0
                acc[...] = tmp[...] * tmp[...]
                o_ref[...] = acc[...] - tmp[...]
            body(x_ref)
        return _blocked(m, kernel, **kw)

    x = _rand()
    ours = build(pl, pl.ANY(BLOCK, jnp.float32))(x)
    theirs = build(jax_pl, jax_pltpu.VMEM(BLOCK, jnp.float32), interpret=True)(x)
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)
    np.testing.assert_allclose(ours, (2 * x) ** 2 - 2 * x, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("body", "match"), [
    (lambda s: pl.run_scoped(lambda r: None, pl.ANY((8,), jnp.float32), collective_axes="x"),
     r"collective_axes"),
])
def test_jax_keywords_without_support_raise(body: Any, match: str) -> None:
    def kernel(x_ref, o_ref, sem):
        body(sem)
        o_ref[...] = x_ref[...]

    with pytest.raises(pl.UnsupportedError, match=match):
        pl.pallas_call(kernel, jax.ShapeDtypeStruct((8,), jnp.float32),
                       scratch_shapes=[pl.ANY((), jnp.int32)])(jnp.ones(8))


def test_empty_takes_out_sharding() -> None:
    assert pl.empty((2, 3), jnp.int8, out_sharding=None).shape == (2, 3)


def test_lower_as_mlir() -> None:
    x = _rand()
    cpu = pl.lower_as_mlir(_blocked(pl, _copy, interpret=True), x, platforms=["cpu"])
    assert "func.func public @main" in cpu and "custom_call" not in cpu
    if "mosaic_tpu" in manager.backends():
        assert "tpu_custom_call" in pl.lower_as_mlir(_blocked(pl, _copy), x)
    with pytest.raises(pl.UnsupportedError, match="dynamic_shapes"):
        pl.lower_as_mlir(_blocked(pl, _copy), x, dynamic_shapes=True)
