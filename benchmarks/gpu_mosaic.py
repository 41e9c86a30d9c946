"""Mosaic GPU backend on a Hopper GPU: this project vs ``jax.experimental.pallas`` vs ``jax.numpy``.

Kernels: bf16 matmul 4096^3 and 8192^3 (bf16 out, float32 accumulation), flash attention
(batch 4, 16 heads, 4096 tokens, head dim 128, bf16), and two memory-bound kernels, a bf16 row
softmax (8192x1024) and a bf16 add (8192x8192), measured against the device's copy bandwidth.
Up to three ways each, timed in one run:

1. this project: ``pallas_mosaic_gpu.hopper_kernels.matmul`` / ``hopper_kernels.attention``
   (``pallas_core`` on the ``mosaic_gpu`` backend); for the matmul, several tile
   configurations, the best reported;
2. the same algorithm written here against JAX's own Mosaic GPU Pallas
   (``jax.experimental.pallas.mosaic_gpu``: ``plgpu.kernel`` + ``plgpu.emit_pipeline``, TMA
   into swizzled SMEM, ``plgpu.wgmma`` into a ``plgpu.ACC``), also over a few configurations;
   for attention also JAX's shipped, tuned ``jax.experimental.pallas.ops.gpu.attention_mgpu``
   where it imports (float16: its SMEM buffers are float16);
   (JAX ships no Mosaic GPU softmax or add, and its ``pallas_call`` has no Mosaic GPU lowering
   at 0.11: the memory-bound kernels have no such way);
3. plain ``jax.numpy`` under ``jax.jit``: ``jnp.dot`` (XLA: cuBLAS), softmax(QK^T/sqrt(d))V,
   ``jax.nn.softmax``, ``x + y``.

Every way's output is first checked against a float32 ``jax.numpy`` reference (max error
printed); a way that fails to build or is wrong is reported and not timed. Each way is then
warmed up and timed as the median of repeated samples (``timing.median_seconds``), a sample
being ``--inner`` calls issued back to back (JAX dispatches asynchronously), divided by
``--inner``: a single call of a 0.2 ms kernel would carry tens of microseconds of launch and
synchronisation, flattening the ratios (``--inner 1`` times single calls, as
``gpu_triton.py`` does). Targets:
matmul >= 90% of ``jnp.dot``'s throughput; attention >= the ``jax.experimental.pallas`` kernel
written here. A markdown snippet for ``benchmarks/RESULTS.md`` is printed at the end.

Run on a Hopper GPU machine: ``python benchmarks/gpu_mosaic.py [--quick] [--json PATH]
[--markdown PATH]`` (scripts/gpu_check.sh runs ``--quick``). ``--dry-run`` needs no GPU: every
configuration of every way is built for ``cuda`` and not run (lowered, or where JAX's own
lowering asks for an attached GPU, traced). JAX's Mosaic GPU kernels below are written for JAX
0.11.2, where ``pl.pallas_call`` has no Mosaic GPU lowering (only ``plgpu.kernel`` does).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
import platform
import sys
import traceback
from collections.abc import Callable
from importlib import metadata
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as jax_pl
from jax.experimental.pallas import mosaic_gpu as jax_plgpu
from pallas_mosaic_gpu import hopper_kernels as ours
from timing import median_seconds

BF16, F32 = jnp.bfloat16, jnp.float32

# --- JAX's own Mosaic GPU Pallas: the reference kernels ------------------------------------


def _swizzled(minor: int, dtype: Any) -> tuple[Any, ...]:
    """SMEM transforms for a block whose last dimension has ``minor`` elements: (8, w) tiles,
    swizzled by the widest swizzle that divides a row (as wgmma and TMA want)."""
    swizzle = jax_plgpu.find_swizzle(minor * jnp.dtype(dtype).itemsize * 8)
    return (jax_plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
            jax_plgpu.SwizzleTransform(swizzle))


def jax_matmul(a: jax.Array, b: jax.Array, *, tile_m: int = 128, tile_n: int = 128,
               tile_k: int = 64, max_concurrent_steps: int = 3,
               delay_release: int = 1) -> jax.Array:
    """``a @ b`` (16-bit in and out, float32 accumulation) with JAX's Mosaic GPU Pallas.

    One thread block (one warpgroup) per (tile_m, tile_n) output tile. The K loop is an
    ``emit_pipeline`` keeping ``max_concurrent_steps`` A and B blocks in flight by TMA; each
    step issues a ``wgmma`` into the register accumulator and waits until at most
    ``delay_release`` of them are pending (the pipeline holds a buffer that long before
    refilling it). The tile goes out through swizzled SMEM with one TMA store.
    """
    m, k = a.shape
    n = b.shape[1]
    dtype = a.dtype
    if m % tile_m or n % tile_n or k % tile_k:
        raise ValueError(f"jax_matmul: ({m}, {k}) @ ({k}, {n}) is not a multiple of the tiles "
                         f"({tile_m}, {tile_n}, {tile_k})")

    def body(a_gmem: Any, b_gmem: Any, o_gmem: Any) -> None:
        rows = jax_pl.ds(lax.axis_index("m") * tile_m, tile_m)
        cols = jax_pl.ds(lax.axis_index("n") * tile_n, tile_n)

        def scoped(o_smem: Any, acc: Any) -> None:
            def k_step(_: Any, a_smem: Any, b_smem: Any) -> None:
                jax_plgpu.wgmma(acc, a_smem, b_smem)
                jax_plgpu.wgmma_wait(delay_release)

            jax_plgpu.emit_pipeline(
                k_step, grid=(k // tile_k,),
                in_specs=[
                    jax_plgpu.BlockSpec((tile_m, tile_k), lambda kk: (0, kk),
                                        transforms=_swizzled(tile_k, dtype),
                                        delay_release=delay_release),
                    jax_plgpu.BlockSpec((tile_k, tile_n), lambda kk: (kk, 0),
                                        transforms=_swizzled(tile_n, dtype),
                                        delay_release=delay_release),
                ],
                max_concurrent_steps=max_concurrent_steps,
            )(a_gmem.at[rows, :], b_gmem.at[:, cols])
            o_smem[...] = jax_plgpu.wgmma_accumulator_load(acc, wait_n=0).astype(dtype)
            jax_plgpu.commit_smem()
            jax_plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[rows, cols])
            jax_plgpu.wait_smem_to_gmem(0)

        # Registers (the accumulator) and SMEM are allocated in separate scopes.
        jax_pl.run_scoped(
            lambda o_smem: jax_pl.run_scoped(functools.partial(scoped, o_smem),
                                             jax_plgpu.ACC((tile_m, tile_n), F32)),
            jax_plgpu.SMEM((tile_m, tile_n), dtype, transforms=_swizzled(tile_n, dtype)))

    return jax_plgpu.kernel(  # type: ignore[no-any-return]
        body, out_type=jax.ShapeDtypeStruct((m, n), dtype),
        grid=(m // tile_m, n // tile_n), grid_names=("m", "n"))(a, b)


def jax_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, block_q: int = 64,
                  block_kv: int = 64, max_concurrent_steps: int = 2) -> jax.Array:
    """Flash attention over ``(batch * heads, tokens, head_dim)`` with JAX's Mosaic GPU Pallas:
    the algorithm of this project's ``kernels.attention``, one warpgroup per ``block_q``
    queries. The query block is loaded once into SMEM; keys and values stream through an
    ``emit_pipeline`` (``max_concurrent_steps`` buffers each) whose carry is the online
    softmax's running max, sum and float32 output; QK^T and PV are ``wgmma`` (P from
    registers)."""
    bh, seq, d = q.shape
    dtype = q.dtype
    if seq % block_q or seq % block_kv or d % 64:
        raise ValueError(f"jax_attention: tokens {seq} must be a multiple of block_q={block_q} "
                         f"and block_kv={block_kv}, head_dim {d} of 64")
    log2_scale = math.log2(math.e) / math.sqrt(d)  # softmax in base 2: exp(x) = exp2(x log2 e)
    qkv_t = _swizzled(d, dtype)
    row = jax_plgpu.Layout.WGMMA.reduce(1)

    def body(q_gmem: Any, k_gmem: Any, v_gmem: Any, o_gmem: Any) -> None:
        head = lax.axis_index("bh")
        rows = jax_pl.ds(lax.axis_index("q") * block_q, block_q)

        def scoped(q_smem: Any, q_ready: Any) -> None:
            jax_plgpu.copy_gmem_to_smem(q_gmem.at[head, rows], q_smem, q_ready.at[0])
            jax_plgpu.barrier_wait(q_ready.at[0])

            def kv_step(_: Any, k_smem: Any, v_smem: Any, carry: Any) -> Any:
                m_i, l_i, acc = carry

                def qk(s_acc: Any) -> Any:
                    jax_plgpu.wgmma(s_acc, q_smem, k_smem.T)
                    return jax_plgpu.wgmma_accumulator_load(s_acc, wait_n=0)

                s = jax_pl.run_scoped(qk, jax_plgpu.ACC((block_q, block_kv), F32)) * log2_scale
                m_new = jnp.maximum(m_i, s.max(axis=1))
                p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
                alpha = jnp.exp2(m_i - m_new)
                l_new = l_i * alpha + p.sum(axis=1)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

                def pv(o_acc: Any) -> None:
                    jax_plgpu.wgmma(o_acc, p.astype(dtype), v_smem)

                acc = jax_pl.run_state(pv)(jax_plgpu.ACC.init(acc))
                jax_plgpu.wgmma_wait(0)  # V's buffer is refilled right after this step
                return m_new, l_new, acc

            init = (jax_plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, F32), row),
                    jax_plgpu.layout_cast(jnp.zeros((block_q,), F32), row),
                    jax_plgpu.layout_cast(jnp.zeros((block_q, d), F32), jax_plgpu.Layout.WGMMA))
            kv_spec = jax_plgpu.BlockSpec((block_kv, d), lambda j: (j, 0), transforms=qkv_t)
            _, l_i, acc = jax_plgpu.emit_pipeline(
                kv_step, grid=(seq // block_kv,), in_specs=[kv_spec, kv_spec],
                max_concurrent_steps=max_concurrent_steps, init_carry=init,
            )(k_gmem.at[head], v_gmem.at[head])
            q_smem[...] = (acc / lax.broadcast_in_dim(l_i, acc.shape, [0])).astype(dtype)
            jax_plgpu.commit_smem()
            jax_plgpu.copy_smem_to_gmem(q_smem, o_gmem.at[head, rows])
            jax_plgpu.wait_smem_to_gmem(0)

        jax_pl.run_scoped(scoped, jax_plgpu.SMEM((block_q, d), dtype, transforms=qkv_t),
                          jax_plgpu.Barrier(num_barriers=1))

    return jax_plgpu.kernel(  # type: ignore[no-any-return]
        body, out_type=jax.ShapeDtypeStruct(q.shape, dtype),
        grid=(bh, seq // block_q), grid_names=("bh", "q"))(q, k, v)


def shipped_attention(batch: int) -> Callable[..., jax.Array] | None:
    """JAX's shipped Hopper attention (``attention_mgpu``) on our ``(batch * heads, tokens, d)``
    layout, in float16, with q scaled by 1/sqrt(d) beforehand; None when this JAX has none."""
    try:
        from jax.experimental.pallas.ops.gpu import attention_mgpu
    except ImportError:
        return None
    config = attention_mgpu.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2)

    def to_bshd(x: jax.Array) -> jax.Array:  # (b*h, s, d) -> (b, s, h, d), float16
        bh, s, d = x.shape
        return x.reshape(batch, bh // batch, s, d).transpose(0, 2, 1, 3).astype(jnp.float16)

    def run(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        out = attention_mgpu.attention(q, k, v, config)
        b, s, h, d = out.shape
        return out.transpose(0, 2, 1, 3).reshape(b * h, s, d)

    def prepare(q: jax.Array, k: jax.Array, v: jax.Array) -> list[jax.Array]:
        # attention_mgpu applies no 1/sqrt(d) to the logits (its attention_reference has none
        # either): q comes scaled, outside the timed call, so that it computes what the others
        # do. Unscaled, its answer was off by 4.18 against the reference on the H100.
        return [to_bshd(q / math.sqrt(q.shape[-1])), to_bshd(k), to_bshd(v)]

    run.prepare = prepare  # type: ignore[attr-defined]
    run.config = config  # type: ignore[attr-defined]
    return run


# --- jax.numpy -------------------------------------------------------------------------------


def jnp_matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    """``jnp.dot``: bf16 out, float32 accumulation inside the GEMM XLA picks (cuBLAS(Lt), or
    its own Triton GEMM where its autotuner finds that faster)."""
    return jnp.dot(a, b)


def jnp_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """softmax(QK^T / sqrt(d)) V in plain jax.numpy: float32 logits and softmax, bf16 matmuls."""
    logits = jnp.einsum("bqd,bkd->bqk", q, k, preferred_element_type=F32)
    p = jax.nn.softmax(logits / math.sqrt(q.shape[-1]), axis=-1)
    return jnp.einsum("bqk,bkd->bqd", p.astype(v.dtype), v, preferred_element_type=F32
                      ).astype(q.dtype)


def _matmul_f32(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.dot(a.astype(F32), b.astype(F32), precision=lax.Precision.HIGHEST)


def _attention_f32(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    hi = lax.Precision.HIGHEST
    q, k, v = (x.astype(F32) for x in (q, k, v))
    logits = jnp.einsum("bqd,bkd->bqk", q, k, precision=hi) / math.sqrt(q.shape[-1])
    return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(logits, axis=-1), v, precision=hi)


# --- the cases -------------------------------------------------------------------------------


@dataclasses.dataclass
class Way:
    """One way of computing a case: a family of configurations, the best of which is kept."""

    label: str
    configs: list[tuple[str, Callable[..., jax.Array]]]
    prepare: Callable[..., list[jax.Array]] | None = None
    note: str = ""


@dataclasses.dataclass
class Case:
    name: str
    title: str
    shapes: list[tuple[int, ...]]
    flops: float
    reference: Callable[..., jax.Array]
    tolerance: float  # on max |got - want| / max |want|
    ways: dict[str, Way]
    target: str  # "jnp90": ours >= 90% of jnp; "jax_pallas": ours >= jax_pallas
    bytes: float = 0.0  # bytes a memory-bound kernel reads and writes (0: compute-bound)


def _cfg_name(**kw: Any) -> str:
    return ",".join(f"{k}={v}" for k, v in kw.items())


def _matmul_configs(fn: Callable[..., jax.Array], grid: list[dict[str, int]]
                    ) -> list[tuple[str, Callable[..., jax.Array]]]:
    return [(_cfg_name(**kw), jax.jit(functools.partial(fn, **kw))) for kw in grid]


def cases(quick: bool) -> list[Case]:
    """The cases, at full size or (``quick``) small."""
    tiles = [(128, 128), (128, 256)]
    steps = [(2, 0), (2, 1), (3, 1), (4, 1)] if not quick else [(2, 0), (3, 1)]
    # (128, 256) tiles with 4 steps would need 256 KiB of SMEM (the project refuses: > 227 KiB).
    ours_grid = [dict(tile_m=tm, tile_n=tn, tile_k=64, max_concurrent_steps=s, delay_release=d)
                 for tm, tn in tiles for s, d in steps if tm * tn * s <= 128 * 256 * 3]
    # One warpgroup holds the accumulator in registers: 128x256 float32 would be 256 per
    # thread, so the JAX kernel's wide tile is 64x256.
    jax_grid = [dict(tile_m=tm, tile_n=tn, tile_k=64, max_concurrent_steps=s, delay_release=d)
                for tm, tn in [(128, 128), (64, 256)] for s, d in steps]
    out = []
    for size in ((2048,) if quick else (4096, 8192)):  # quick: one size, a smoke test's time
        out.append(Case(
            name=f"matmul_bf16_{size}", title=f"bf16 matmul {size}³", shapes=[(size, size)] * 2,
            flops=2.0 * size ** 3, reference=_matmul_f32, tolerance=1e-2,
            ways={"pallas_core_mosaic_gpu": Way("this project", _matmul_configs(ours.matmul,
                                                                                ours_grid)),
                  "jax_pallas_mosaic_gpu": Way("jax.experimental.pallas",
                                               _matmul_configs(jax_matmul, jax_grid)),
                  "jnp": Way("jnp.dot", [("XLA (cuBLAS)", jax.jit(jnp_matmul))])},
            target="jnp90"))
    batch, heads, tokens, d = (1, 2, 1024, 128) if quick else (4, 16, 4096, 128)
    attn_ours = [(_cfg_name(block_q=bq, block_k=bk),
                  jax.jit(functools.partial(ours.attention, block_q=bq, block_k=bk)))
                 for bq, bk in [(64, 64), (64, 128)]]
    attn_jax = [(_cfg_name(block_q=bq, block_kv=bk, max_concurrent_steps=s),
                 jax.jit(functools.partial(jax_attention, block_q=bq, block_kv=bk,
                                           max_concurrent_steps=s)))
                for bq, bk, s in [(64, 64, 2), (64, 128, 2), (64, 64, 3)]]
    ways = {"pallas_core_mosaic_gpu": Way("this project", attn_ours),
            "jax_pallas_mosaic_gpu": Way("jax.experimental.pallas", attn_jax)}
    shipped = shipped_attention(batch)
    if shipped is not None:
        ways["jax_attention_mgpu"] = Way(
            "jax attention_mgpu (shipped, f16)",
            [(_cfg_name(block_q=64, block_kv=128, max_concurrent_steps=2), jax.jit(shipped))],
            prepare=shipped.prepare,  # type: ignore[attr-defined]
            note="JAX's tuned kernel (2 compute warpgroups + 1 TMA warpgroup), float16 inputs")
    ways["jnp"] = Way("jax.numpy", [("softmax(QK^T/sqrt(d))V", jax.jit(jnp_attention))])
    out.append(Case(
        name="flash_attention", title=f"flash attention {batch}x{heads}x{tokens}x{d}",
        shapes=[(batch * heads, tokens, d)] * 3, flops=4.0 * batch * heads * tokens ** 2 * d,
        reference=_attention_f32, tolerance=2e-2, ways=ways, target="jax_pallas"))
    out += memory_bound_cases(quick)
    return out


def memory_bound_cases(quick: bool) -> list[Case]:
    """A bf16 row softmax and a bf16 add: this project's ``kernels.softmax`` and
    ``kernels.blocked_add`` against ``jax.numpy``, with the bytes they move."""
    rows, (m, n) = (2048, (2048, 2048)) if quick else (8192, (8192, 8192))
    softmax_ways = {
        "pallas_core_mosaic_gpu": Way("this project", [
            (_cfg_name(block_rows=r), jax.jit(functools.partial(ours.softmax, block_rows=r)))
            for r in (64,)]),  # 32 rows: no layout for the row reductions
        "jnp": Way("jax.numpy", [("jax.nn.softmax", jax.jit(jnp_softmax))])}
    add_ways = {
        "pallas_core_mosaic_gpu": Way("this project", [
            (_cfg_name(block=b), jax.jit(functools.partial(ours.blocked_add, block=b)))
            for b in ((64, 128), (128, 128))]),
        "jnp": Way("jax.numpy", [("x + y", jax.jit(jnp.add))])}
    return [
        Case(name=f"softmax_bf16_{rows}", title=f"bf16 row softmax {rows}x1024",
             shapes=[(rows, 1024)], flops=5.0 * rows * 1024, reference=_softmax_f32,
             tolerance=2e-2, ways=softmax_ways, target="jnp90", bytes=2.0 * rows * 1024 * 2),
        Case(name=f"add_bf16_{m}", title=f"bf16 add {m}x{n}", shapes=[(m, n)] * 2,
             flops=1.0 * m * n, reference=_add_f32, tolerance=1e-2, ways=add_ways,
             target="jnp90", bytes=3.0 * m * n * 2)]


def jnp_softmax(x: jax.Array) -> jax.Array:
    """``jax.nn.softmax`` over rows (float32 inside, bf16 out)."""
    return jax.nn.softmax(x.astype(F32), axis=-1).astype(x.dtype)


def _softmax_f32(x: jax.Array) -> jax.Array:
    return jax.nn.softmax(x.astype(F32), axis=-1)


def _add_f32(x: jax.Array, y: jax.Array) -> jax.Array:
    return x.astype(F32) + y.astype(F32)


def copy_bandwidth(quick: bool, warmup: int, repeats: int, inner: int) -> float:
    """Device-to-device bandwidth in bytes/s: a bf16 negation reading and writing 2^26
    elements (2^24 with ``quick``)."""
    x = jnp.ones((1 << (24 if quick else 26),), BF16)
    return 2.0 * x.size * 2 / per_call_seconds(jax.jit(lambda a: -a), [x], warmup, repeats,
                                               inner)


# --- running ---------------------------------------------------------------------------------


def _first_line(e: BaseException) -> str:
    """``Type: first line of the message`` (or, for a bare assert, where it was raised)."""
    text = str(e).strip().splitlines()
    if text:
        return f"{type(e).__name__}: {text[0][:200]}"
    frames = traceback.extract_tb(e.__traceback__)
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    return f"{type(e).__name__}{where}"


def per_call_seconds(fn: Callable[..., Any], args: list[jax.Array], warmup: int, repeats: int,
                     inner: int) -> float:
    """Median seconds per call: ``timing.median_seconds`` of ``inner`` back-to-back calls (one
    wait, for the last; they run in order on the device), divided by ``inner``."""
    def calls(*a: Any) -> Any:
        out = None
        for _ in range(inner):
            out = fn(*a)
        return out

    return median_seconds(calls, args, warmup, repeats) / inner


def run_case(case: Case, warmup: int, repeats: int, inner: int,
             rng: np.random.Generator) -> dict[str, Any]:
    """Checks, then times, every configuration of every way of ``case``; returns its figures."""
    args = [jnp.asarray(rng.standard_normal(s), BF16) for s in case.shapes]
    want = np.asarray(jax.jit(case.reference)(*args), np.float32)
    scale = float(np.max(np.abs(want)))
    row: dict[str, Any] = {"title": case.title, "flops": case.flops, "ways": {}}
    outputs: dict[str, np.ndarray] = {}
    for key, way in case.ways.items():
        way_args = way.prepare(*args) if way.prepare else args
        tried: list[dict[str, Any]] = []
        for cfg, fn in way.configs:
            entry: dict[str, Any] = {"config": cfg}
            tried.append(entry)
            try:  # a config that does not build, run or check out is reported, not fatal
                got = np.asarray(jax.block_until_ready(fn(*way_args)), np.float32)
                err = float(np.max(np.abs(got - want)))
                entry["max_abs_error"] = err
                entry["max_rel_error"] = err / scale
                if not np.isfinite(err) or err > case.tolerance * scale:
                    entry["error"] = (f"wrong: max |error| {err:.3g} > {case.tolerance} x max "
                                      f"|reference| {scale:.3g}")
                else:
                    seconds = per_call_seconds(fn, way_args, warmup, repeats, inner)
                    if all(seconds < t["seconds"] for t in tried if "seconds" in t):
                        outputs[key] = got  # the best configuration's output so far
                    entry["seconds"] = seconds
                    entry["tflops"] = case.flops / seconds / 1e12
                    if case.bytes:
                        entry["gbps"] = case.bytes / seconds / 1e9
            except Exception as e:
                entry["error"] = _first_line(e)
            error = (f"max err {entry['max_abs_error']:9.3g}  " if "max_abs_error" in entry
                     else "")
            result = (f"{entry['seconds'] * 1e3:9.3f} ms {_rate(entry)}"
                      if "seconds" in entry else f"FAILED {entry['error']}")
            print(f"  {case.name:<20} {key:<24} {cfg:<70} {error}{result}", flush=True)
        timed = [t for t in tried if "seconds" in t]
        best = min(timed, key=lambda t: t["seconds"]) if timed else None
        row["ways"][key] = {"label": way.label, "note": way.note, "tried": tried, "best": best}
    if {"pallas_core_mosaic_gpu", "jax_pallas_mosaic_gpu"} <= outputs.keys():
        row["max_abs_diff_ours_vs_jax_pallas"] = float(np.max(np.abs(
            outputs["pallas_core_mosaic_gpu"] - outputs["jax_pallas_mosaic_gpu"])))
    _ratios(case, row)
    return row


def _rate(entry: dict[str, Any]) -> str:
    """Throughput: GB/s for a memory-bound case, else TFLOP/s."""
    if "gbps" in entry:
        return f"{entry['gbps']:.0f} GB/s"
    return f"{entry['tflops']:.1f} TFLOP/s"


def _seconds(row: dict[str, Any], key: str) -> float | None:
    way = row["ways"].get(key)
    return way["best"]["seconds"] if way and way["best"] else None


def _ratios(case: Case, row: dict[str, Any]) -> None:
    """Speed ratios (>1: this project is faster) and the target, added to ``row``."""
    ours_s = _seconds(row, "pallas_core_mosaic_gpu")
    for other in ("jax_pallas_mosaic_gpu", "jax_attention_mgpu", "jnp"):
        other_s = _seconds(row, other)
        if ours_s and other_s:
            row[f"ours_over_{other}"] = other_s / ours_s
    if case.target == "jnp90":
        ratio, goal = row.get("ours_over_jnp"), 0.9
        against = "90% of " + ("jnp.dot" if case.name.startswith("matmul") else "jax.numpy") \
            + "'s throughput"
    else:
        ratio, goal, against = (row.get("ours_over_jax_pallas_mosaic_gpu"), 1.0,
                                "the jax.experimental.pallas kernel")
    row["target"] = {"goal": f">= {against}", "ratio": ratio,
                     "met": None if ratio is None else ratio >= goal}


def _fmt_target(t: dict[str, Any]) -> str:
    if t["met"] is None:
        return f"target {t['goal']}: not measured"
    return f"target {t['goal']}: {t['ratio']:.2f} -> {'MET' if t['met'] else 'MISSED'}"


def summary_line(row: dict[str, Any]) -> str:
    parts = []
    for key, way in row["ways"].items():
        best = way["best"]
        parts.append(f"{key} " + (f"{best['seconds'] * 1e3:.3f} ms ({_rate(best)})" if best
                                  else "n/a"))
    ratios = ", ".join(f"vs {k[len('ours_over_'):]} {v:.2f}x" for k, v in row.items()
                       if k.startswith("ours_over_"))
    copy = row.get("fraction_of_copy_bandwidth")
    return f"{row['title']}: " + "  ".join(parts) + f"\n    speed of ours {ratios or 'n/a'}; " \
        + _fmt_target(row["target"]) + (f"; ours at {copy:.0%} of the copy bandwidth"
                                        if copy is not None else "")


def markdown(results: dict[str, Any], command: str) -> str:
    """The figures as a section for ``benchmarks/RESULTS.md``."""
    env = results["environment"]
    quick = " (--quick: small sizes, a smoke test)" if results["quick"] else ""
    lines = [f"## Mosaic GPU backend on a GPU — {env['date']}{quick}", "",
             f"Machine: {env['device']} (compute capability {env['compute_capability']}), "
             f"{env['device_count']} device(s), Python {env['python']}, JAX {env['jax']}, "
             f"jaxlib {env['jaxlib']}; copy bandwidth "
             f"{results['copy_bandwidth_bytes_per_s'] / 1e9:.0f} GB/s.",
             f"Command: `{command}`", "",
             "| kernel | this project | `jax.experimental.pallas` (Mosaic GPU) | "
             "`attention_mgpu` (JAX's, f16) | `jax.numpy` | ours / jax.pallas | ours / jnp | "
             "target |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]

    def cell(row: dict[str, Any], key: str) -> str:
        way = row["ways"].get(key)
        if way is None:
            return "—"
        best = way["best"]
        return f"{best['seconds'] * 1e3:.3f} ms ({_rate(best)})" if best \
            else "failed"

    def ratio(row: dict[str, Any], key: str) -> str:
        return f"{row[key]:.2f}" if key in row else "—"

    for row in results["cases"].values():
        t = row["target"]
        tgt = "—" if t["met"] is None else \
            f"{t['goal']}: {'met' if t['met'] else 'missed'} ({t['ratio']:.2f})"
        lines.append(f"| {row['title']} | {cell(row, 'pallas_core_mosaic_gpu')} | "
                     f"{cell(row, 'jax_pallas_mosaic_gpu')} | {cell(row, 'jax_attention_mgpu')} "
                     f"| {cell(row, 'jnp')} | {ratio(row, 'ours_over_jax_pallas_mosaic_gpu')} | "
                     f"{ratio(row, 'ours_over_jnp')} | {tgt} |")
    lines += ["", "Notes:", f"- Per-call medians of {results['repeats']} samples of "
              f"{results['inner']} back-to-back calls, after {results['warmup']} warm-up samples, "
              "all ways in the same run; ratios > 1 mean this project is faster.",
              "- Configurations tried (best in bold; errors are max |got - float32 reference|):"]
    for row in results["cases"].values():
        for way in row["ways"].values():
            if len(way["tried"]) < 2 and way["best"]:
                continue
            items = []
            for t in way["tried"]:
                text = f"{t['config']}: " + (f"{t['seconds'] * 1e3:.3f} ms" if "seconds" in t
                                            else t["error"])
                items.append(f"**{text}**" if t is way["best"] else text)
            lines.append(f"  - {row['title']}, {way['label']}: " + "; ".join(items))
    for row in results["cases"].values():
        errs = ", ".join(f"{key} {way['best']['max_abs_error']:.3g}"
                         for key, way in row["ways"].items() if way["best"])
        diff = row.get("max_abs_diff_ours_vs_jax_pallas")
        shipped = row.get("ours_over_jax_attention_mgpu")
        lines.append(f"- {row['title']}: max error of the best configs: {errs}"
                     + (f"; ours vs jax.pallas max |difference| {diff:.3g}" if diff is not None
                        else "")
                     + (f"; ours / JAX's attention_mgpu (f16) speed {shipped:.2f}"
                        if shipped is not None else "")
                     + (f"; ours at {row['fraction_of_copy_bandwidth']:.0%} of the copy "
                        "bandwidth" if "fraction_of_copy_bandwidth" in row else "") + ".")
    return "\n".join(lines) + "\n"


def environment() -> dict[str, Any]:
    dev = jax.devices()[0]
    return {"date": datetime.date.today().isoformat(),
            "time": datetime.datetime.now().isoformat(timespec="seconds"),
            "device": dev.device_kind,
            "compute_capability": getattr(dev, "compute_capability", "?"),
            "device_count": jax.device_count(), "python": platform.python_version(),
            "jax": jax.__version__, "jaxlib": _version("jaxlib")}


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "?"


def run(quick: bool, warmup: int, repeats: int, inner: int) -> dict[str, Any]:
    """Times every case on the default device; returns the figures."""
    env = environment()
    print(f"{env['date']} {env['time']}  {env['device']} (compute capability "
          f"{env['compute_capability']}), JAX {env['jax']}, Python {env['python']}"
          f"{'  [--quick: small sizes]' if quick else ''}", flush=True)
    rng = np.random.default_rng(0)
    bandwidth = copy_bandwidth(quick, warmup, repeats, inner)
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    results: dict[str, Any] = {"environment": env, "quick": quick, "warmup": warmup,
                               "repeats": repeats, "inner": inner,
                               "copy_bandwidth_bytes_per_s": bandwidth, "cases": {}}
    for case in cases(quick):
        print(f"{case.title}:", flush=True)
        row = run_case(case, warmup, repeats, inner, rng)
        ours_s = _seconds(row, "pallas_core_mosaic_gpu")
        if case.bytes and ours_s:
            row["fraction_of_copy_bandwidth"] = case.bytes / ours_s / bandwidth
        results["cases"][case.name] = row
    print("\nSummary (best configuration of each way):")
    for row in results["cases"].values():
        print(summary_line(row))
    return results


def dry_run(quick: bool) -> None:
    """Builds every configuration of every way of every case for ``cuda``, running none: this
    project's and ``jax.numpy``'s are lowered; JAX's are lowered where its lowering needs no
    attached GPU, else traced (JAX's shipped attention_mgpu, an extra, asks for the CUDA
    runtime's version even then: it is left out where there is none)."""
    for case in cases(quick):
        structs = [jax.ShapeDtypeStruct(s, BF16) for s in case.shapes]
        for key, way in case.ways.items():
            for cfg, fn in way.configs:
                def whole(*a: Any, fn: Callable[..., Any] = fn, way: Way = way) -> Any:
                    return fn(*(way.prepare(*a) if way.prepare else a))

                try:
                    jax.jit(whole).trace(*structs).lower(lowering_platforms=("cuda",))
                    done = "lowered for cuda"
                except Exception as e:
                    if key in ("pallas_core_mosaic_gpu", "jnp"):
                        raise SystemExit(f"{case.name}/{key} [{cfg}] does not lower for cuda: "
                                         f"{_first_line(e)}") from e
                    try:
                        jax.make_jaxpr(whole)(*structs)
                        done = f"traced (lowering needs a GPU: {_first_line(e)[:60]})"
                    except Exception as e2:
                        if key != "jax_attention_mgpu":  # an extra, as in main()
                            raise
                        done = f"not built (needs the CUDA runtime: {_first_line(e2)[:60]})"
                print(f"  {case.name:<20} {key:<24} {cfg:<70} {done}", flush=True)


def _require_hopper(script: str) -> None:
    """Exits with a message (no traceback) unless JAX's default device is a Hopper GPU."""
    try:
        backend = jax.default_backend()
    except Exception as e:  # e.g. JAX_PLATFORMS=cuda on a machine without a usable GPU
        platforms = os.environ.get("JAX_PLATFORMS")
        raise SystemExit(f"{script} needs a Hopper GPU (sm_90); JAX could not start a backend"
                         + (f" (JAX_PLATFORMS={platforms!r})" if platforms else "")
                         + f": {_first_line(e)}") from None
    if backend != "gpu":
        raise SystemExit(f"{script} needs a Hopper GPU (sm_90), but jax.default_backend() is "
                         f"{backend!r}: no GPU is visible to JAX (install a CUDA jaxlib, "
                         "e.g. jax[cuda12], and run on a GPU machine).")
    dev = jax.devices()[0]
    cc = str(getattr(dev, "compute_capability", ""))
    if not cc.startswith("9."):
        raise SystemExit(f"{script} needs a Hopper GPU (compute capability 9.x, sm_90a: TMA and "
                         f"wgmma); found {dev.device_kind} with compute capability {cc or '?'}.")


def main() -> None:
    """Command line: ``--quick``, ``--warmup``, ``--repeats``, ``--inner``, ``--json``,
    ``--markdown``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="small sizes (matmul 2048, attention 1x2x1024x128, softmax 2048x1024, "
                             "add 2048x2048) and "
                             "fewer configurations: a smoke test, not figures to record")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20, help="timed samples (median)")
    parser.add_argument("--inner", type=int, default=10,
                        help="back-to-back calls per timed sample (1: single calls)")
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--markdown", help="also write the RESULTS.md snippet to this file")
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: build every configuration for cuda, run nothing")
    args = parser.parse_args()
    if args.warmup < 0 or args.repeats < 1 or args.inner < 1:
        parser.error("--warmup must be >= 0, --repeats and --inner >= 1")
    if args.dry_run:
        dry_run(args.quick)
        return
    _require_hopper("benchmarks/gpu_mosaic.py")
    figures = run(args.quick, args.warmup, args.repeats, args.inner)
    command = "python benchmarks/gpu_mosaic.py " + " ".join(sys.argv[1:])
    snippet = markdown(figures, command.strip())
    print("\n--- markdown for benchmarks/RESULTS.md ---\n" + snippet + "--- end ---")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(snippet)
    failed = [f"{name}/{key}" for name, row in figures["cases"].items()
              for key, way in row["ways"].items()
              if way["best"] is None and key != "jax_attention_mgpu"]  # that one is an extra
    if failed:
        raise SystemExit(f"no working configuration for: {', '.join(failed)} (see above)")


if __name__ == "__main__":
    main()
