"""Interpreter speed: the same four kernels three ways, timed side by side in one run.

1. ``pallas_core`` on the ``interpret`` backend (this project),
2. ``jax.experimental.pallas`` with ``interpret=True`` (the anchor),
3. the same computation in plain ``jax.numpy`` under ``jax.jit``.

Each kernel is written once, as a function of the Pallas module it uses (``pallas_core`` or
``jax.experimental.pallas``: only the import differs). The first call (trace + compile + run)
is timed on its own; then after warm-up, the median of repeated calls. Ratios are printed and,
with ``--json PATH``, written out. Run: ``python benchmarks/interpret_speed.py``.
"""

from __future__ import annotations

import functools
import json
import math
import platform
import statistics
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as jax_pl
from timing import call_seconds, command_line, median_seconds

import pallas_core as our_pl

# --- the kernels, parameterised by the Pallas module -------------------------------------


def blocked_add(pl: Any, x: jax.Array, y: jax.Array, **kw: Any) -> jax.Array:
    """1024x1024 float32 add in (128, 128) blocks: an 8x8 grid."""
    def kernel(x_ref, y_ref, o_ref):
        o_ref[...] = x_ref[...] + y_ref[...]
    spec = pl.BlockSpec((128, 128), lambda i, j: (i, j))
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          grid=(x.shape[0] // 128, x.shape[1] // 128),
                          in_specs=[spec, spec], out_specs=spec, **kw)(x, y)


def matmul_3d(pl: Any, x: jax.Array, y: jax.Array, **kw: Any) -> jax.Array:
    """1024^3 float32 matmul on a (4, 4, 8) grid: 128 blocks, accumulating over k."""
    bm, bn, bk = 256, 256, 128

    def kernel(x_ref, y_ref, o_ref):
        @pl.when(pl.program_id(2) == 0)
        def _():
            o_ref[...] = jnp.zeros_like(o_ref)
        o_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

    m, k = x.shape
    n = y.shape[1]
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
        grid=(m // bm, n // bn, k // bk),
        in_specs=[pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
                  pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)), **kw)(x, y)


def row_softmax(pl: Any, x: jax.Array, **kw: Any) -> jax.Array:
    """Softmax over the rows of a 1024x1024 float32 array, 128 rows per grid step."""
    def kernel(x_ref, o_ref):
        v = x_ref[...]
        e = jnp.exp(v - jnp.max(v, axis=1, keepdims=True))
        o_ref[...] = e / jnp.sum(e, axis=1, keepdims=True)
    spec = pl.BlockSpec((128, x.shape[1]), lambda i: (i, 0))
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          grid=(x.shape[0] // 128,), in_specs=[spec], out_specs=spec, **kw)(x)


def flash_attention(pl: Any, q: jax.Array, k: jax.Array, v: jax.Array, **kw: Any) -> jax.Array:
    """Single-head flash attention, 1024x64, online softmax over blocks of 128 keys."""
    block_q = block_k = 128
    scale = 1.0 / math.sqrt(q.shape[1])

    def kernel(q_ref, k_ref, v_ref, o_ref):
        qb = q_ref[...] * scale

        def body(t, carry):
            m, row_sum, acc = carry
            kb = k_ref[pl.ds(t * block_k, block_k), :]
            vb = v_ref[pl.ds(t * block_k, block_k), :]
            s = qb @ kb.T
            m_new = jnp.maximum(m, s.max(axis=1))
            p = jnp.exp(s - m_new[:, None])
            alpha = jnp.exp(m - m_new)
            return m_new, alpha * row_sum + p.sum(axis=1), acc * alpha[:, None] + p @ vb

        init = (jnp.full((block_q,), -jnp.inf), jnp.zeros((block_q,)),
                jnp.zeros((block_q, q.shape[1])))
        _, row_sum, acc = jax.lax.fori_loop(0, k.shape[0] // block_k, body, init)
        o_ref[...] = acc / row_sum[:, None]

    kv = pl.BlockSpec(k.shape, lambda i: (0, 0))
    qs = pl.BlockSpec((block_q, q.shape[1]), lambda i: (i, 0))
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
                          grid=(q.shape[0] // block_q,), in_specs=[qs, kv, kv],
                          out_specs=qs, **kw)(q, k, v)


def _attention_ref(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    return jax.nn.softmax(q @ k.T / math.sqrt(q.shape[1]), axis=1) @ v


CASES: dict[str, tuple[Callable[..., Any], Callable[..., Any], list[tuple[int, ...]]]] = {
    "blocked_add": (blocked_add, jnp.add, [(1024, 1024), (1024, 1024)]),
    "matmul_3d": (matmul_3d, jnp.dot, [(1024, 1024), (1024, 1024)]),
    "row_softmax": (row_softmax, functools.partial(jax.nn.softmax, axis=1), [(1024, 1024)]),
    "flash_attention": (flash_attention, _attention_ref, [(1024, 64)] * 3),
}

# --- timing ---------------------------------------------------------------------------------


def _time_first(make: Callable[[], Callable[..., Any]], args: list[jax.Array],
                repeats: int) -> float:
    """Median over fresh functions of the first call: trace, compile and run."""
    return statistics.median(call_seconds(make(), args) for _ in range(repeats))


def run(warmup: int, repeats: int, anchor_repeats: int, first_repeats: int) -> dict[str, Any]:
    """Times every case three ways; returns the figures."""
    rng = np.random.default_rng(0)
    results: dict[str, Any] = {}
    for name, (kernel, reference, shapes) in CASES.items():
        args = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes]
        makers: dict[str, Callable[[], Callable[..., Any]]] = {
            "pallas_core": lambda k=kernel: jax.jit(
                functools.partial(k, our_pl, backend="interpret")),
            "jax_pallas_interpret": lambda k=kernel: jax.jit(
                functools.partial(k, jax_pl, interpret=True)),
            "jnp": lambda r=reference: jax.jit(lambda *a: r(*a)),
        }
        row: dict[str, Any] = {}
        want = np.asarray(makers["jnp"]()(*args))
        for way, make in makers.items():
            first = _time_first(make, args, first_repeats)
            fn = make()
            got = np.asarray(fn(*args))
            np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3, err_msg=f"{name}/{way}")
            reps = anchor_repeats if way == "jax_pallas_interpret" else repeats
            row[way] = {"first_call_s": first, "median_s": median_seconds(fn, args, warmup, reps)}
        row["ours_over_jnp"] = row["pallas_core"]["median_s"] / row["jnp"]["median_s"]
        row["anchor_over_ours"] = (row["jax_pallas_interpret"]["median_s"]
                                   / row["pallas_core"]["median_s"])
        results[name] = row
        print(f"{name:<16} ours {row['pallas_core']['median_s'] * 1e3:9.2f} ms   "
              f"anchor {row['jax_pallas_interpret']['median_s'] * 1e3:9.2f} ms   "
              f"jnp {row['jnp']['median_s'] * 1e3:8.2f} ms   "
              f"ours/jnp {row['ours_over_jnp']:6.2f}   anchor/ours {row['anchor_over_ours']:6.2f}"
              f"   first call: ours {row['pallas_core']['first_call_s']:.2f} s, anchor "
              f"{row['jax_pallas_interpret']['first_call_s']:.2f} s", flush=True)
    gm = {
        key: math.exp(statistics.mean(math.log(r[key]) for r in results.values()))
        for key in ("ours_over_jnp", "anchor_over_ours")
    }
    print(f"geometric mean: ours/jnp {gm['ours_over_jnp']:.2f} (goal <= 1.5), "
          f"anchor/ours {gm['anchor_over_ours']:.2f} (goal >= 5)")
    firsts = {way: sum(r[way]["first_call_s"] for r in results.values())
              for way in ("pallas_core", "jax_pallas_interpret")}
    print(f"first calls, all four kernels: ours {firsts['pallas_core']:.2f} s, anchor "
          f"{firsts['jax_pallas_interpret']:.2f} s")
    gm["first_call_total_s"] = firsts
    return {"cases": results, "geomean": gm}


def main() -> None:
    """Command line: ``--repeats``, ``--warmup``, ``--json``."""
    parser = command_line(__doc__, warmup=2, repeats=20)
    parser.add_argument("--anchor-repeats", type=int, default=5,
                        help="repeats for jax.experimental.pallas interpret (slow)")
    parser.add_argument("--first-repeats", type=int, default=3,
                        help="fresh first calls (trace + compile + run) per way; median")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {platform.machine()}, {platform.processor() or ''} "
          f"{jax.device_count()} CPU device(s)")
    figures = run(args.warmup, args.repeats, args.anchor_repeats, args.first_repeats)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
