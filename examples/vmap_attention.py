"""Multi-head, batched and multi-query attention by ``jax.vmap`` of the single-head kernel.

``jax.vmap`` of a ``pallas_call`` adds a leading grid axis, so the flash-attention kernel of
``flash_attention.py`` runs unchanged on every head (and every batch element). For
multi-query attention, K and V are shared by all query heads: ``in_axes=(0, None, None)``
leaves them unbatched, so every head reads the same K/V blocks.
Run with ``python examples/vmap_attention.py`` (or ``python -m examples.vmap_attention``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

try:
    from examples.flash_attention import attention_reference, flash_attention
except ModuleNotFoundError:  # run as a script from inside examples/
    from flash_attention import attention_reference, flash_attention  # type: ignore[no-redef]


def multi_head_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Attention per head: q, k, v of shape ``(heads, seq, d)``."""
    return jax.vmap(flash_attention)(q, k, v)


def batched_multi_head_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Attention per batch element and head: q, k, v of shape ``(batch, heads, seq, d)``."""
    return jax.vmap(jax.vmap(flash_attention))(q, k, v)


def multi_query_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Attention of ``(heads, seq_q, d)`` queries over one shared ``(seq_k, d)`` K and V."""
    return jax.vmap(flash_attention, in_axes=(0, None, None))(q, k, v)


def main() -> None:
    """Checks the three variants against plain jax.numpy attention on random inputs."""
    rng = np.random.default_rng(0)

    def normal(*shape: int) -> jax.Array:
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    batch, heads, seq, d = 2, 4, 256, 64
    checks = []
    q, k, v = normal(heads, seq, d), normal(heads, seq, d), normal(heads, seq, d)
    checks.append((multi_head_attention(q, k, v), attention_reference(q, k, v)))
    q, k, v = (normal(batch, heads, seq, d) for _ in range(3))
    checks.append((batched_multi_head_attention(q, k, v), attention_reference(q, k, v)))
    q, k, v = normal(heads, seq, d), normal(seq, d), normal(seq, d)
    want = attention_reference(q, jnp.broadcast_to(k, q.shape), jnp.broadcast_to(v, q.shape))
    checks.append((multi_query_attention(q, k, v), want))
    err = 0.0
    for got, want in checks:
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        err = max(err, float(jnp.max(jnp.abs(got - want))))
    print(f"vmap_attention: OK (max abs err {err})")


if __name__ == "__main__":
    main()
