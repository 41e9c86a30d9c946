"""``docs/core_api.md`` lists every public name of ``jax.experimental.pallas`` with its status in
``pallas_core``; these tests keep the page complete and true, and check the names it lists
against JAX's (or jax.numpy where JAX's cannot run on CPU).

* the shared page checks (``pallas_core.testing.api_pages``): every JAX name has a row,
  version marks agree with the installed JAX, ``supported`` rows exist and every JAX name
  ``pl`` exports is marked ``supported``;
* every row that is not ``supported`` is a name whose lookup raises ``pl.UnsupportedNameError``
  naming it, with a fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as jax_pl

import pallas_core as pl
from pallas_core import extras
from pallas_core.testing.api_pages import ApiPage, ApiPageTests

PAGE = ApiPage(Path(__file__).resolve().parents[1] / "docs" / "core_api.md", jax_pl, pl)


class TestPage(ApiPageTests):
    page = PAGE


def _not_supported() -> list[str]:
    return sorted(r.name for r in PAGE.rows if r.status != "supported")


def test_names_not_provided_are_exactly_the_rows_not_supported() -> None:
    assert sorted(extras.NOT_PROVIDED) == _not_supported()


@pytest.mark.parametrize("name", _not_supported())
def test_looking_up_a_name_not_provided_raises_naming_it(name: str) -> None:
    with pytest.raises(pl.UnsupportedNameError, match=rf"pl\.{name} .*Fix: "):
        getattr(pl, name)
    assert not hasattr(pl, name)
    assert isinstance(extras.not_provided(name), pl.UnsupportedError)


def test_unknown_names_are_plain_attribute_errors() -> None:
    with pytest.raises(AttributeError) as info:
        pl.no_such_name  # noqa: B018
    assert not isinstance(info.value, pl.PallasError)


# --- sizes --------------------------------------------------------------------------------------


@pytest.mark.parametrize("x", [0, 1, 2, 3, 7, 8, 9, 1000, 1 << 20, (1 << 20) + 1])
def test_next_power_of_2_matches_jax(x: int) -> None:
    assert pl.next_power_of_2(x) == jax_pl.next_power_of_2(x)


def test_next_power_of_2_of_a_negative_number_is_an_error() -> None:
    with pytest.raises(pl.ArgumentError, match="non-negative"):
        pl.next_power_of_2(-1)


@pytest.mark.parametrize("shape", [(), (5,), (3, 4), (2, 3, 4, 5), (7, 1, 2)])
def test_strides_from_shape_match_jax_and_numpy(shape: tuple[int, ...]) -> None:
    ours = pl.strides_from_shape(shape)
    assert ours == jax_pl.strides_from_shape(shape)
    assert ours == tuple(s // 4 for s in np.zeros(shape, np.float32).strides)


# --- estimate_cost ------------------------------------------------------------------------------


def _mlp(x: Any, w: Any, *, scale: float) -> Any:
    h = jnp.tanh(x @ w) * scale
    return jax.nn.sigmoid(h) + jnp.exp(-h) ** 3


def _nested(xs: Any) -> Any:
    a, (b, c) = xs
    inner = jax.jit(lambda u, v: jnp.sqrt(u * v + 1.0))
    return {"s": inner(a, b) - c, "p": (a ** 5).sum(axis=0), "m": jnp.maximum(a, c) / 2}


@pytest.mark.parametrize(("fun", "args", "kwargs"), [
    (_mlp, (jax.ShapeDtypeStruct((32, 64), jnp.float32),
            jax.ShapeDtypeStruct((64, 16), jnp.float32)), {"scale": 0.5}),
    (_nested, ((jnp.ones((8, 8)), (jax.ShapeDtypeStruct((8, 8), jnp.float32),
                                   jax.ShapeDtypeStruct((8, 8), jnp.bfloat16))),), {}),
    (lambda a, b: jnp.einsum("bij,bjk->bik", a, b),
     (jax.ShapeDtypeStruct((4, 8, 16), jnp.float32),
      jax.ShapeDtypeStruct((4, 16, 32), jnp.float32)), {}),
    (lambda x: (jnp.floor(x) - jnp.round(-x)) * jnp.cos(x) + jnp.log(jnp.abs(x) + 1.0),
     (jax.ShapeDtypeStruct((128,), jnp.float16),), {}),
], ids=["mlp", "pytree_jit_pow", "batched_einsum", "unary"])
def test_estimate_cost_matches_jax(fun: Any, args: Any, kwargs: Any) -> None:
    ours = pl.estimate_cost(fun, *args, **kwargs)
    theirs = jax_pl.estimate_cost(fun, *args, **kwargs)
    assert isinstance(ours, pl.CostEstimate)
    assert (ours.flops, ours.transcendentals, ours.bytes_accessed) == (
        theirs.flops, theirs.transcendentals, theirs.bytes_accessed)
    assert ours.flops > 0 and ours.bytes_accessed > 0


def test_estimate_cost_of_a_matmul_by_hand() -> None:
    a, b = jax.ShapeDtypeStruct((32, 64), jnp.float32), jax.ShapeDtypeStruct((64, 16), jnp.float32)
    cost = pl.estimate_cost(lambda x, y: jnp.exp(x @ y), a, b)
    assert cost == pl.CostEstimate(flops=2 * 32 * 64 * 16, transcendentals=32 * 16,
                                   bytes_accessed=4 * (32 * 64 + 64 * 16 + 32 * 16))


def test_cost_estimate_takes_ints_only() -> None:
    with pytest.raises(pl.ArgumentError, match="flops"):
        pl.CostEstimate(flops=1.5, transcendentals=0, bytes_accessed=0)  # type: ignore[arg-type]
    est = pl.CostEstimate(flops=1, transcendentals=2, bytes_accessed=3)
    assert est.to_json() == jax_pl.CostEstimate(1, 2, 3).to_json()
