"""Single-head flash attention with an online softmax.

The grid runs over blocks of queries. Each step keeps the whole of K and V as its block and
walks over them in blocks of ``block_k`` rows with ``jax.lax.fori_loop``, reading each with
``k_ref[pl.ds(start, block_k), :]``. A running row maximum ``m``, row sum ``l`` and output
accumulator are rescaled as each KV block arrives, so the full ``(seq_q, seq_k)`` score
matrix never exists. Run with ``python examples/flash_attention.py``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

import pallas_core as pl


def flash_attention_kernel(q_ref, k_ref, v_ref, o_ref, *, block_k: int, scale: float):
    """Attention of one block of queries over all keys, ``block_k`` keys at a time."""
    q = q_ref[...].astype(jnp.float32) * scale
    block_q, head_dim = q.shape
    num_kv_blocks = k_ref.shape[0] // block_k

    def body(kv_block, carry):
        m_prev, l_prev, acc_prev = carry
        start = pl.multiple_of(kv_block * block_k, block_k)
        k = k_ref[pl.ds(start, block_k), :].astype(jnp.float32)
        v = v_ref[pl.ds(start, block_k), :].astype(jnp.float32)
        s = jnp.dot(q, k.T, preferred_element_type=jnp.float32)  # (block_q, block_k)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
        alpha = jnp.exp(m_prev - m_new)  # rescales what was accumulated so far
        p = jnp.exp(s - m_new[:, None])
        l_new = alpha * l_prev + jnp.sum(p, axis=1)
        acc_new = acc_prev * alpha[:, None] + jnp.dot(p, v, preferred_element_type=jnp.float32)
        return m_new, l_new, acc_new

    init = (
        jnp.full((block_q,), -jnp.inf, jnp.float32),  # running max
        jnp.zeros((block_q,), jnp.float32),  # running sum of exp
        jnp.zeros((block_q, head_dim), jnp.float32),  # running output
    )
    _, row_sum, acc = jax.lax.fori_loop(0, num_kv_blocks, body, init)
    o_ref[...] = (acc / row_sum[:, None]).astype(o_ref.dtype)


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, block_q: int = 128,
                    block_k: int = 128, scale: float | None = None) -> jax.Array:
    """``softmax(q @ k.T * scale) @ v`` for one head: q ``(seq_q, d)``, k and v ``(seq_k, d)``.

    ``scale`` defaults to ``1 / sqrt(d)``; ``seq_q`` and ``seq_k`` must be multiples of
    ``block_q`` and ``block_k``.
    """
    (seq_q, head_dim), (seq_k, _) = q.shape, k.shape
    if seq_q % block_q or seq_k % block_k:
        raise ValueError(f"flash_attention: seq_q={seq_q} and seq_k={seq_k} must be multiples "
                         f"of block_q={block_q} and block_k={block_k}")
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    kv_spec = pl.BlockSpec((seq_k, head_dim), lambda i: (0, 0))  # all of K/V at every step
    return pl.pallas_call(
        functools.partial(flash_attention_kernel, block_k=block_k, scale=scale),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(seq_q // block_q,),
        in_specs=[pl.BlockSpec((block_q, head_dim), lambda i: (i, 0)), kv_spec, kv_spec],
        out_specs=pl.BlockSpec((block_q, head_dim), lambda i: (i, 0)),
    )(q, k, v)


def attention_reference(q: jax.Array, k: jax.Array, v: jax.Array,
                        scale: float | None = None) -> jax.Array:
    """Plain jax.numpy attention, ``jax.nn.softmax(q @ k.T * scale) @ v``, in float32."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    q, k, v = (a.astype(jnp.float32) for a in (q, k, v))
    s = jnp.einsum("...qd,...kd->...qk", q, k) * scale
    return jnp.einsum("...qk,...kd->...qd", jax.nn.softmax(s, axis=-1), v)


def main() -> None:
    """Checks ``flash_attention`` on random (1024, 64) q, k, v against the reference."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1024, 64)), jnp.float32) for _ in range(3))
    got, want = flash_attention(q, k, v), attention_reference(q, k, v)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    print(f"flash_attention: OK (max abs err {float(jnp.max(jnp.abs(got - want)))})")


if __name__ == "__main__":
    main()
