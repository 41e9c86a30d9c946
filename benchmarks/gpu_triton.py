"""Triton backend on an NVIDIA GPU: this project vs ``jax.experimental.pallas`` vs ``jax.numpy``.

Kernels (each written once, against the Pallas module it is run with): bf16 matmul 4096^3, row
softmax 8192x8192 float32, flash attention (batch 4, 16 heads, 4096 tokens, head dim 64, bf16),
fused add+ReLU on 2^28 float32. Also measured: device-to-device copy bandwidth, the yardstick of
the two memory-bound kernels. Each way is warmed up, then timed as the median of repeated calls,
in one run. Run on a GPU machine: ``python benchmarks/gpu_triton.py [--json PATH]``.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as jax_pl
from timing import median_seconds

import pallas_core as our_pl


def _triton_params(pl: Any, num_warps: int, num_stages: int) -> dict[str, Any]:
    """``pallas_call`` keyword arguments selecting each module's Triton backend."""
    if pl is our_pl:
        import pallas_triton

        return {"compiler_params": pallas_triton.CompilerParams(num_warps=num_warps,
                                                                num_stages=num_stages)}
    from jax.experimental.pallas import triton as jax_pl_triton

    return {"compiler_params": jax_pl_triton.CompilerParams(num_warps=num_warps,
                                                            num_stages=num_stages)}


def matmul(pl: Any, x: jax.Array, y: jax.Array, bm: int = 128, bn: int = 128,
           bk: int = 64) -> jax.Array:
    """``x @ y``: one program per output block, looping over K inside the kernel."""
    m, k = x.shape
    n = y.shape[1]

    def kernel(x_ref: Any, y_ref: Any, o_ref: Any) -> None:
        def body(t: Any, acc: Any) -> Any:
            a = x_ref[:, pl.ds(t * bk, bk)]
            b = y_ref[pl.ds(t * bk, bk), :]
            return acc + jnp.dot(a, b, preferred_element_type=jnp.float32)

        acc = jax.lax.fori_loop(0, k // bk, body, jnp.zeros((bm, bn), jnp.float32))
        o_ref[...] = acc.astype(o_ref.dtype)

    return pl.pallas_call(
        kernel, jax.ShapeDtypeStruct((m, n), x.dtype), grid=(m // bm, n // bn),
        in_specs=[pl.BlockSpec((bm, k), lambda i, j: (i, 0)),
                  pl.BlockSpec((k, bn), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        **_triton_params(pl, 8, 3))(x, y)


def softmax(pl: Any, x: jax.Array) -> jax.Array:
    """Softmax of each row; one row per program."""
    def kernel(x_ref: Any, o_ref: Any) -> None:
        v = x_ref[...]
        e = jnp.exp(v - jnp.max(v, axis=1, keepdims=True))
        o_ref[...] = e / jnp.sum(e, axis=1, keepdims=True)

    spec = pl.BlockSpec((1, x.shape[1]), lambda i: (i, 0))
    return pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(x.shape[0],),
                          in_specs=[spec], out_specs=spec, **_triton_params(pl, 16, 1))(x)


def attention(pl: Any, q: jax.Array, k: jax.Array, v: jax.Array, block: int = 128) -> jax.Array:
    """Flash attention of (batch, heads, seq, d) inputs: a single-head kernel, vmapped twice."""
    seq, d = q.shape[-2:]
    scale = 1.0 / math.sqrt(d)

    def single_head(qh: jax.Array, kh: jax.Array, vh: jax.Array) -> jax.Array:
        def kernel(q_ref: Any, k_ref: Any, v_ref: Any, o_ref: Any) -> None:
            qb = q_ref[...]

            def body(t: Any, carry: Any) -> Any:
                m, s, acc = carry
                kb = k_ref[pl.ds(t * block, block), :]
                vb = v_ref[pl.ds(t * block, block), :]
                logits = jnp.dot(qb, kb.T, preferred_element_type=jnp.float32) * scale
                m_new = jnp.maximum(m, logits.max(axis=1))
                p = jnp.exp(logits - m_new[:, None])
                alpha = jnp.exp(m - m_new)
                acc = acc * alpha[:, None] + jnp.dot(p.astype(vb.dtype), vb,
                                                     preferred_element_type=jnp.float32)
                return m_new, s * alpha + p.sum(axis=1), acc

            init = (jnp.full((block,), -jnp.inf, jnp.float32), jnp.zeros((block,), jnp.float32),
                    jnp.zeros((block, d), jnp.float32))
            _, s, acc = jax.lax.fori_loop(0, seq // block, body, init)
            o_ref[...] = (acc / s[:, None]).astype(o_ref.dtype)

        kv = pl.BlockSpec((seq, d), lambda i: (0, 0))
        qs = pl.BlockSpec((block, d), lambda i: (i, 0))
        return pl.pallas_call(kernel, jax.ShapeDtypeStruct(qh.shape, qh.dtype),
                              grid=(seq // block,), in_specs=[qs, kv, kv], out_specs=qs,
                              **_triton_params(pl, 4, 2))(qh, kh, vh)

    return jax.vmap(jax.vmap(single_head))(q, k, v)


def add_relu(pl: Any, x: jax.Array, y: jax.Array, block: int = 4096) -> jax.Array:
    """``max(x + y, 0)`` in blocks of ``block``."""
    def kernel(x_ref: Any, y_ref: Any, o_ref: Any) -> None:
        o_ref[...] = jnp.maximum(x_ref[...] + y_ref[...], 0.0)

    spec = pl.BlockSpec((block,), lambda i: (i,))
    return pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                          grid=(x.shape[0] // block,), in_specs=[spec, spec], out_specs=spec,
                          **_triton_params(pl, 8, 1))(x, y)


def _attention_ref(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    logits = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32)
    p = jax.nn.softmax(logits / math.sqrt(q.shape[-1]), axis=-1)
    return jnp.einsum("bhqk,bhkd->bhqd", p.astype(v.dtype), v)


BF16, F32 = jnp.bfloat16, jnp.float32
CASES: dict[str, tuple[Callable[..., Any], Callable[..., Any], list[tuple[tuple[int, ...], Any]],
                       float]] = {
    # name: (kernel, jnp reference, input shapes and dtypes, tolerance)
    "matmul_bf16_4096": (matmul, lambda x, y: jnp.dot(x, y), [((4096, 4096), BF16)] * 2, 0.1),
    "softmax_8192": (softmax, functools.partial(jax.nn.softmax, axis=1),
                     [((8192, 8192), F32)], 1e-5),
    "flash_attention": (attention, _attention_ref, [((4, 16, 4096, 64), BF16)] * 3, 0.05),
    "add_relu_2^28": (add_relu, lambda x, y: jnp.maximum(x + y, 0.0),
                      [((1 << 28,), F32)] * 2, 1e-6),
}



def copy_bandwidth(warmup: int, repeats: int) -> float:
    """Device-to-device bandwidth in bytes/s: read and write 2^28 float32 (a negation)."""
    x = jnp.ones((1 << 28,), F32)
    t = median_seconds(jax.jit(lambda a: -a), [x], warmup, repeats)
    return 2 * x.size * 4 / t


def run(warmup: int, repeats: int) -> dict[str, Any]:
    """Times every case three ways on the default device; returns the figures."""
    rng = np.random.default_rng(0)
    bandwidth = copy_bandwidth(warmup, repeats)
    print(f"{jax.devices()[0].device_kind}: copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    results: dict[str, Any] = {"copy_bandwidth_bytes_per_s": bandwidth}
    for name, (kernel, reference, shapes, tol) in CASES.items():
        args = [jnp.asarray(rng.standard_normal(s), dt) for s, dt in shapes]
        ways = {"pallas_core_triton": jax.jit(functools.partial(kernel, our_pl)),
                "jax_pallas_triton": jax.jit(functools.partial(kernel, jax_pl)),
                "jnp": jax.jit(reference)}
        want = np.asarray(ways["jnp"](*args), np.float32)
        row: dict[str, Any] = {}
        for way, fn in ways.items():
            got = np.asarray(fn(*args), np.float32)
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=f"{name}/{way}")
            row[way] = median_seconds(fn, args, warmup, repeats)
        row["ours_over_jax_pallas"] = row["jax_pallas_triton"] / row["pallas_core_triton"]
        row["ours_over_jnp"] = row["jnp"] / row["pallas_core_triton"]
        moved = sum(a.size * a.dtype.itemsize for a in args) * (1 + 1 / len(args))
        row["fraction_of_copy_bandwidth"] = moved / row["pallas_core_triton"] / bandwidth
        results[name] = row
        print(f"{name:<18} ours {row['pallas_core_triton'] * 1e3:8.3f} ms  jax.pallas "
              f"{row['jax_pallas_triton'] * 1e3:8.3f} ms  jnp {row['jnp'] * 1e3:8.3f} ms  "
              f"speed vs jax.pallas {row['ours_over_jax_pallas']:.2f}x, vs jnp "
              f"{row['ours_over_jnp']:.2f}x, {row['fraction_of_copy_bandwidth']:.0%} of copy "
              "bandwidth", flush=True)
    return results


def main() -> None:
    """Command line: ``--warmup``, ``--repeats``, ``--json``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    if jax.default_backend() != "gpu":
        raise SystemExit("benchmarks/gpu_triton.py needs a GPU (jax.default_backend() is "
                         f"{jax.default_backend()!r}).")
    figures = run(args.warmup, args.repeats)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
