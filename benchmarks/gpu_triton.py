"""Triton backend on an NVIDIA GPU: this project vs ``jax.experimental.pallas`` vs ``jax.numpy``.

Kernels (each written once, against the Pallas module it is run with): bf16 matmul 4096^3, row
softmax 8192x8192 float32, flash attention (batch 4, 16 heads, 4096 tokens, head dim 64, bf16),
fused add+ReLU on 2^28 float32. Also measured: device-to-device copy bandwidth, the yardstick of
the two memory-bound kernels. Each way is first checked against ``jax.numpy``, then warmed up
and timed as the median of repeated calls, in one run; ratios > 1 mean this project is faster.

Run on a GPU machine: ``python benchmarks/gpu_triton.py [--quick] [--json PATH]``. ``--quick``:
small sizes (matmul 1024^3, softmax 2048x2048, attention 1x4x1024x64, add+ReLU on 2^24) and
few repetitions, a smoke test of a minute or less (scripts/gpu_check.sh runs it).
``--dry-run``: no GPU needed; every way of every case is built for ``cuda`` without running
(this project's and ``jax.numpy``'s lowered, ``jax.experimental.pallas``'s traced: its Triton
lowering asks for an attached GPU).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import platform
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
Case = tuple[Callable[..., Any], Callable[..., Any], list[tuple[tuple[int, ...], Any]], float]
"""(kernel, jnp reference, input shapes and dtypes, tolerance)."""


def cases(quick: bool = False) -> dict[str, Case]:
    """The cases by name, at full size or (``quick``) small."""
    mm, sm, attn, ew = (1024, 2048, (1, 4, 1024, 64), 1 << 24) if quick else \
        (4096, 8192, (4, 16, 4096, 64), 1 << 28)
    ew_name = f"2^{ew.bit_length() - 1}"
    return {
        f"matmul_bf16_{mm}": (matmul, lambda x, y: jnp.dot(x, y), [((mm, mm), BF16)] * 2, 0.1),
        f"softmax_{sm}": (softmax, functools.partial(jax.nn.softmax, axis=1),
                          [((sm, sm), F32)], 1e-5),
        "flash_attention": (attention, _attention_ref, [(attn, BF16)] * 3, 0.05),
        f"add_relu_{ew_name}": (add_relu, lambda x, y: jnp.maximum(x + y, 0.0),
                                [((ew,), F32)] * 2, 1e-6),
    }


CASES = cases()
"""The full-size cases."""


def ways(kernel: Callable[..., Any], reference: Callable[..., Any]
         ) -> dict[str, Callable[..., Any]]:
    """The three ways of a case: this project, ``jax.experimental.pallas``, ``jax.numpy``."""
    return {"pallas_core_triton": jax.jit(functools.partial(kernel, our_pl)),
            "jax_pallas_triton": jax.jit(functools.partial(kernel, jax_pl)),
            "jnp": jax.jit(reference)}


def dry_run(quick: bool) -> None:
    """Builds every way of every case for ``cuda`` without a GPU and without running it."""
    for name, (kernel, reference, shapes, _) in cases(quick).items():
        structs = [jax.ShapeDtypeStruct(s, dt) for s, dt in shapes]
        for way, fn in ways(kernel, reference).items():
            if way == "jax_pallas_triton":  # JAX's Triton lowering needs an attached GPU
                jax.make_jaxpr(fn)(*structs)
                done = "traced"
            else:
                text = fn.trace(*structs).lower(lowering_platforms=("cuda",)).as_text()
                if way == "pallas_core_triton" and "__gpu$xla.gpu.triton" not in text:
                    raise SystemExit(f"{name}/{way}: no Triton kernel in the lowered program")
                done = "lowered for cuda"
            print(f"{name:<18} {way:<20} {done}", flush=True)


def copy_bandwidth(warmup: int, repeats: int, size: int = 1 << 28) -> float:
    """Device-to-device bandwidth in bytes/s: read and write ``size`` float32 (a negation)."""
    x = jnp.ones((size,), F32)
    t = median_seconds(jax.jit(lambda a: -a), [x], warmup, repeats)
    return 2 * x.size * 4 / t


def environment(device: Any) -> dict[str, Any]:
    """The device and the versions the figures were measured with."""
    import jaxlib

    return {"device": device.device_kind,
            "compute_capability": getattr(device, "compute_capability", "?"),
            "python": platform.python_version(), "jax": jax.__version__,
            "jaxlib": jaxlib.__version__}


def run(warmup: int, repeats: int, quick: bool = False) -> dict[str, Any]:
    """Times every case three ways on the GPU; returns the figures."""
    device = jax.devices("gpu")[0]  # the first call that needs a GPU
    rng = np.random.default_rng(0)
    bandwidth = copy_bandwidth(warmup, repeats, 1 << 24 if quick else 1 << 28)
    print(f"{device.device_kind}: copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    results: dict[str, Any] = {"environment": environment(device), "quick": quick,
                               "warmup": warmup, "repeats": repeats,
                               "copy_bandwidth_bytes_per_s": bandwidth}
    for name, (kernel, reference, shapes, tol) in cases(quick).items():
        args = [jnp.asarray(rng.standard_normal(s), dt) for s, dt in shapes]
        three = ways(kernel, reference)
        want = np.asarray(three["jnp"](*args), np.float32)
        row: dict[str, Any] = {}
        for way, fn in three.items():
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
    """Command line: ``--quick``, ``--dry-run``, ``--warmup``, ``--repeats``, ``--json``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="small sizes and (unless given) --warmup 1 --repeats 5: a smoke "
                             "test, not figures to record")
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: build every way of every case for cuda, run nothing")
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    if args.dry_run:
        dry_run(args.quick)
        return
    try:
        jax.devices("gpu")
    except RuntimeError as e:
        raise SystemExit(f"benchmarks/gpu_triton.py needs a GPU: JAX sees none ({e})") from None
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    repeats = args.repeats if args.repeats is not None else (5 if args.quick else 20)
    figures = run(warmup, repeats, args.quick)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
