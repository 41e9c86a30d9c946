"""Predicted roofline of JAX's kernel library at production sizes, and how long ``pl.report``
takes to say so.

For each kernel (JAX's library, ported with only its Pallas imports rewritten, as the tests
load it), ``pl.report`` traces the function and counts: flops (matrix and vector), HBM bytes,
on-chip footprint; then the roofline on the chips asked for. Nothing runs; no device is needed.
The TPU kernels are reported on v5e (Mosaic TPU), the GPU kernels on H100 (Triton, Mosaic GPU).
Each report is timed: the first call (tracing included) and the median of five more.

Run: ``python benchmarks/report_library.py`` (prints a Markdown table for RESULTS.md);
``--every-kernel`` also times ``pl.report`` on every kernel the tests report (JAX's library on
each backend that lowers it, its TPU kernels on the interpreter too, every seed example on
interpret, Mosaic TPU and Triton).
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax
import jax.numpy as jnp

import pallas_core as pl
from tests.jax_library import porting

S = jax.ShapeDtypeStruct
BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
NUM_SMS = 132  # H100 SXM: the persistent kernels ask the device, which is absent here

Case = tuple[str, str, str, Callable[[], tuple[Callable[..., Any], list[Any]]]]
"""(label, backend, chip, build) where build() -> (function, argument structs)."""


def _tpu_matmul() -> Any:
    mm = porting.ported("tpu.matmul")
    return (functools.partial(mm.matmul, block_shape=(512, 512), block_k=512),
            [S((4096, 4096), BF16), S((4096, 4096), BF16)])


def _tpu_flash(causal: bool) -> Callable[[], Any]:
    def build() -> Any:
        flash = porting.ported("tpu.flash_attention")
        blocks = flash.BlockSizes(block_q=512, block_k_major=512, block_k=512, block_b=1)
        qkv = [S((8, 16, 4096, 128), BF16)] * 3
        return functools.partial(flash.flash_attention, causal=causal, sm_scale=0.088,
                                 block_sizes=blocks), qkv
    return build


def _tpu_gmm() -> Any:
    gmm = porting.ported("tpu.megablox.gmm")
    groups = jnp.full((8,), 1024, jnp.int32)
    return (lambda lhs, rhs: gmm.gmm(lhs, rhs, groups, tiling=(512, 512, 512)),
            [S((8192, 4096), BF16), S((8, 4096, 4096), BF16)])


def _gpu_modules() -> dict[str, Any]:
    return {m: porting.ported(f"gpu.{m}")
            for m in ("attention", "layer_norm", "softmax", "rms_norm")}


def _triton_mha(causal: bool) -> Callable[[], Any]:
    def build() -> Any:
        att = _gpu_modules()["attention"]
        blocks = att.BlockSizes(block_q=128, block_k=64)
        return (functools.partial(att.mha, segment_ids=None, causal=causal,
                                  block_sizes=blocks),
                [S((8, 4096, 16, 64), F16)] * 3)
    return build


def _triton_layer_norm() -> Any:
    return _gpu_modules()["layer_norm"].layer_norm, [S((4, 1024, 8192), F16), S((8192,), F16),
                                                     S((8192,), F16)]


def _triton_softmax() -> Any:
    return (functools.partial(_gpu_modules()["softmax"].softmax, axis=-1),
            [S((8192, 4096), F32)])


def _mgpu_matmul() -> Any:
    hm = porting.ported("gpu.hopper_matmul_mgpu")
    hm.get_num_sms = lambda: NUM_SMS
    config = hm.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4)
    return (lambda a, b: hm.matmul(a, b, None, config),
            [S((4096, 4096), F16), S((4096, 4096), F16)])


def _mgpu_attention(causal: bool) -> Callable[[], Any]:
    def build() -> Any:
        am = porting.ported("gpu.attention_mgpu")
        am.cuda_versions = types.SimpleNamespace(cuda_runtime_get_version=lambda: 12091)
        config = am.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2,
                                 causal=causal)
        return (lambda q, k, v: am.attention(q, k, v, config),
                [S((8, 4096, 16, 128), F16)] * 3)
    return build


CASES: list[Case] = [
    ("matmul 4096^3 bf16, 512 blocks", "mosaic_tpu", "v5e", _tpu_matmul),
    ("flash_attention 8x16x4096x128 bf16", "mosaic_tpu", "v5e", _tpu_flash(False)),
    ("flash_attention causal", "mosaic_tpu", "v5e", _tpu_flash(True)),
    ("megablox gmm 8 groups 8192x4096x4096", "mosaic_tpu", "v5e", _tpu_gmm),
    ("attention mha 8x4096x16x64 f16", "triton", "h100", _triton_mha(False)),
    ("attention mha causal", "triton", "h100", _triton_mha(True)),
    ("layer_norm 4096x8192 f16", "triton", "h100", _triton_layer_norm),
    ("softmax 8192x4096 f32", "triton", "h100", _triton_softmax),
    ("hopper_matmul 4096^3 f16", "mosaic_gpu", "h100", _mgpu_matmul),
    ("attention_mgpu 8x4096x16x128 f16", "mosaic_gpu", "h100", _mgpu_attention(False)),
    ("attention_mgpu causal", "mosaic_gpu", "h100", _mgpu_attention(True)),
]


def _seconds(s: float) -> str:
    return f"{s * 1e6:.1f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms"


def main() -> None:
    print(f"jax {jax.__version__}, {time.strftime('%Y-%m-%d')}")
    print("| kernel | backend | chip | grid | GFLOP | skipped | HBM MB | on chip | "
          "bound | predicted | report: first, median |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for label, backend, chip, build in CASES:
        try:
            fn, args = build()
            t0 = time.perf_counter()
            rep = pl.report(fn, *args, backend=backend, target=chip)
            first = time.perf_counter() - t0
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                pl.report(fn, *args, backend=backend, target=chip)
                times.append(time.perf_counter() - t0)
        except Exception as e:
            print(f"| {label} | {backend} | {chip} | failed: {type(e).__name__}: "
                  f"{str(e)[:120]} |")
            continue
        for k in rep:
            line = k.roofline[chip]
            onchip = ("?" if k.onchip_bytes is None else
                      f"{k.onchip_bytes / 2**10:.0f} KiB"
                      + ("" if k.fits else " (does not fit)"))
            print(f"| {label}: {k.name} | {backend} | {chip} | {k.grid} | "
                  f"{k.flops / 1e9:.1f} | {k.skipped_fraction:.0%} | {k.hbm_bytes / 1e6:.1f} | "
                  f"{onchip} | {line.bound} | {_seconds(line.seconds)} | "
                  f"{first:.2f} s, {statistics.median(times):.3f} s |")


def _timed(fn: Callable[..., Any], args: Sequence[Any], backend: str) -> tuple[float, float]:
    t0 = time.perf_counter()
    pl.report(fn, *args, backend=backend)
    first = time.perf_counter() - t0
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        pl.report(fn, *args, backend=backend)
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times)


def every_kernel() -> None:
    """How long ``pl.report`` takes on every kernel the tests report (JAX's library on each
    backend that lowers it, the seed examples on each backend): the first call (tracing
    included) and the median of three more."""
    from tests.jax_library import test_gpu_library_agreement as triton_cases
    from tests.jax_library import test_mgpu_library_agreement as mgpu_cases
    from tests.jax_library import test_tpu_library_lowering as tpu_cases
    from tests.test_seed_examples_emulated import CASES as SEEDS

    runs: list[tuple[str, str, Callable[..., Any], Sequence[Any]]] = []
    for name, build in tpu_cases.CASES.items():
        fn, args = build(porting.ported)
        runs.append((f"tpu.{name}", "mosaic_tpu", fn, args))
    modules = triton_cases._modules("ours")
    for name, make in triton_cases.KERNELS.items():
        fn = make(modules)
        if name == "mqa":
            fn = functools.partial(fn, kv_seq_len=None)
        runs.append((f"gpu.{name}", "triton", fn, triton_cases.ARGS[name]))
    # The facts the library asks a GPU for (as the agreement test's fixture gives them).
    lib = functools.partial(mgpu_cases._library, ours=True)
    lib("hopper_matmul_mgpu").get_num_sms = lambda: 4
    lib("attention_mgpu").cuda_versions = types.SimpleNamespace(
        cuda_runtime_get_version=lambda: mgpu_cases.CUDA_VERSION)
    lib("hopper_mixed_type_matmul_mgpu").backend = types.SimpleNamespace(
        get_default_device=lambda: types.SimpleNamespace(core_count=4))
    lib("transposed_ragged_dot_mgpu").jax = mgpu_cases._JaxWithDevices("jax")
    for name in mgpu_cases.LIBRARY:
        fn, args = mgpu_cases._library_case(name, lib(name))
        if "ragged" in name:  # the group sizes go by keyword
            fn = functools.partial(lambda f, lhs, rhs, g: f(lhs, rhs, group_sizes=g), fn)
        runs.append((f"gpu.{name}", "mosaic_gpu", fn, args))
    for name, build in tpu_cases.CASES.items():  # the interpreter runs them all
        fn, args = build(porting.ported)
        runs.append((f"tpu.{name}", "interpret", fn, args))
    for name, (fn, _, inputs, _) in SEEDS.items():
        for backend in ("interpret", "mosaic_tpu", "triton"):
            runs.append((f"examples.{name}", backend, fn, inputs()))
    rows = []
    for label, backend, fn, args in runs:
        first, median = _timed(fn, args, backend)
        rows.append((first, median, label, backend))
    print(f"{len(rows)} reports; first call: median {statistics.median(r[0] for r in rows):.3f} s,"
          f" max {max(r[0] for r in rows):.2f} s; again: median "
          f"{statistics.median(r[1] for r in rows):.3f} s, max {max(r[1] for r in rows):.2f} s")
    print("slowest first calls:")
    for first, median, label, backend in sorted(rows, reverse=True)[:5]:
        print(f"  {label} on {backend}: {first:.2f} s, then {median:.3f} s")


if __name__ == "__main__":
    main()
    if "--every-kernel" in sys.argv:
        every_kernel()
