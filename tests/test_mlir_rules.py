"""Constants of the shared lowering rules (``pallas_core.mlir_rules``) checked on their own:
what the emitted IR computes, written out in numpy, against JAX's reference functions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_core import mlir_rules


def _horner(coeffs: tuple[float, ...], w: np.ndarray) -> np.ndarray:
    p = np.full_like(w, coeffs[0])
    for k in coeffs[1:]:
        p = np.float32(k) + p * w
    return p


def test_erf_inv_polynomial_matches_jax() -> None:
    """The two-range polynomial the ``erf_inv`` rule emits, in float32, is within 1e-5
    (relative) of ``jax.scipy.special.erfinv`` on random points of (-1, 1)."""
    x = np.asarray(jax.random.uniform(jax.random.key(0), (100_000,), jnp.float32,
                                      -0.999999, 0.999999))
    w = -np.log((np.float32(1) - x) * (np.float32(1) + x))
    central = _horner(mlir_rules._ERF_INV_CENTRAL, w - np.float32(2.5))
    tail = _horner(mlir_rules._ERF_INV_TAIL, np.sqrt(w) - np.float32(3))
    ours = np.where(w < 5, central, tail) * x
    want = np.asarray(jax.scipy.special.erfinv(jnp.asarray(x)))
    np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-7)
