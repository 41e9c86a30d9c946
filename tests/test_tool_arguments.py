"""``pl.stages`` and ``pl.emulate`` check their arguments the same way (issue 34): the
function, the target's type, ``checked`` and ``seed``, each refusal an ``ArgumentError`` with
what was expected; a target the backend does not know is refused by both, with the list of
valid ones (``pl.emulate`` ran any target before)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import pytest

import pallas_core as pl


def copy(x_ref: Any, o_ref: Any) -> None:
    o_ref[...] = x_ref[...] * 2


X = np.arange(8 * 128, dtype=np.float32).reshape(8, 128)
FN = pl.pallas_call(copy, out_shape=jax.ShapeDtypeStruct(X.shape, X.dtype))


def _stages(fn: Any = FN, **kw: Any) -> Any:
    return pl.stages(fn, X, backend="mosaic_tpu", **kw)[0]["mosaic"]


def _emulate(fn: Any = FN, **kw: Any) -> Any:
    return pl.emulate(fn, backend="mosaic_tpu", **kw)(X)


@pytest.mark.parametrize("api", [_stages, _emulate], ids=["stages", "emulate"])
@pytest.mark.parametrize(("kw", "phrases"), [
    ({"fn": 42}, ["(fn, ...): expected a function", "found int 42"]),
    ({"target": 5}, ["(target=5): expected a target name", "found int"]),
])
def test_both_refuse_the_same_bad_arguments(api: Any, kw: dict[str, Any],
                                            phrases: list[str]) -> None:
    pytest.importorskip("pallas_mosaic_tpu")
    with pytest.raises(pl.ArgumentError) as info:
        api(**kw)
    name = "pl.stages" if api is _stages else "pl.emulate"
    for phrase in [name, *phrases, "Fix:"]:
        assert phrase in str(info.value)


@pytest.mark.parametrize(("kw", "phrase"), [
    ({"seed": "abc"}, "pl.emulate(seed='abc'): expected an int or None, found str"),
    ({"seed": True}, "pl.emulate(seed=True): expected an int or None, found bool"),
    ({"checked": "yes"}, "pl.emulate(checked='yes'): expected True or False, found str"),
])
def test_emulate_checks_its_flags(kw: dict[str, Any], phrase: str) -> None:
    pytest.importorskip("pallas_mosaic_tpu")
    with pytest.raises(pl.ArgumentError, match=None) as info:
        _emulate(**kw)
    assert phrase in str(info.value)


@pytest.mark.parametrize("target", ["sm_7", "v5e"])
def test_emulate_refuses_a_triton_target_as_stages_does(target: str) -> None:
    pytest.importorskip("pallas_triton")
    fn = pl.pallas_call(copy, out_shape=jax.ShapeDtypeStruct(X.shape, X.dtype),
                        backend="triton")
    with pytest.raises(pl.PallasError) as emulated:
        pl.emulate(fn, backend="triton", target=target)(X)
    assert f"Triton target {target!r} is not one this plugin compiles for" in str(
        emulated.value)
    assert "known targets: sm_80, sm_90" in str(emulated.value)
    # and a known one still runs
    np.testing.assert_array_equal(np.asarray(pl.emulate(fn, backend="triton",
                                                        target="sm_80")(X)), X * 2)


@pytest.mark.parametrize(("backend", "params", "owner"), [
    ("mosaic_tpu", "triton", "triton"),
    ("triton", "mosaic_tpu", "mosaic_tpu"),
    ("mosaic_tpu", "jax_triton", "triton"),
])
def test_params_of_a_backend_for_another_platform_are_refused(backend: str, params: str,
                                                             owner: str) -> None:
    """JAX refuses them; the backend would have dropped them without a word before."""
    pltpu = pytest.importorskip("pallas_mosaic_tpu")
    plgpu = pytest.importorskip("pallas_triton")
    made = {"triton": lambda: plgpu.CompilerParams(num_warps=8),
            "mosaic_tpu": lambda: pltpu.CompilerParams(dimension_semantics=("parallel",)),
            "jax_triton": lambda: __import__(
                "jax.experimental.pallas.triton", fromlist=["CompilerParams"]
            ).CompilerParams(num_warps=8)}[params]()
    fn = pl.pallas_call(copy, out_shape=jax.ShapeDtypeStruct(X.shape, X.dtype), grid=(1,),
                        backend=backend, compiler_params=made)
    target = {"mosaic_tpu": "v5e", "triton": "sm_90"}[backend]
    with pytest.raises(pl.UnsupportedError) as info:
        pl.stages(fn, X, backend=backend, target=target)
    text = str(info.value)
    assert f"compiler_params of the {owner!r} backend" in text
    assert f"compiled by {backend!r}, which would ignore them" in text and "Fix:" in text


def test_jax_s_own_tpu_params_lower_as_ours_do() -> None:
    """``jax.experimental.pallas.tpu.CompilerParams`` on our mosaic_tpu: the same module as
    with ours (it failed with "'str' object has no attribute 'value'")."""
    pltpu = pytest.importorskip("pallas_mosaic_tpu")
    from jax.experimental.pallas import tpu as jax_pltpu

    def module(params: Any) -> str:
        fn = pl.pallas_call(copy, out_shape=jax.ShapeDtypeStruct(X.shape, X.dtype),
                            grid=(1,), backend="mosaic_tpu", compiler_params=params)
        return str(pl.stages(fn, X, backend="mosaic_tpu", target="v5e")[0]["mosaic"])

    ours = module(pltpu.CompilerParams(dimension_semantics=("parallel",)))
    theirs = module(jax_pltpu.CompilerParams(dimension_semantics=("parallel",)))
    assert "#tpu.dimension_semantics<parallel>" in theirs
    assert theirs == ours
    # Without backend=, JAX's params choose the backend they belong to, as ours do.
    fn = pl.pallas_call(copy, out_shape=jax.ShapeDtypeStruct(X.shape, X.dtype), grid=(1,),
                        compiler_params=jax_pltpu.CompilerParams())
    assert pl.stages(fn, X, target="v5e")[0].backend == "mosaic_tpu"
