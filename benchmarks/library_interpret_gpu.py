"""JAX's Triton kernel library in interpret mode: this project's interpreter vs JAX's own.

Every Triton kernel of the installed ``jax.experimental.pallas.ops.gpu`` (flash attention
forward and backward, decode attention MQA and GQA, paged attention, layer norm and RMS norm
forward and backward, softmax) runs two ways on the same inputs, both with ``interpret=True``:

1. ``ours``: the module as ``tests/jax_library/porting.py`` loads it (only its Pallas imports
   rewritten to ``pallas_core`` / ``pallas_triton``), so on this project's interpreter;
2. ``jax``: the unmodified module, so on ``jax.experimental.pallas``'s interpreter.

Both outputs are compared (max absolute difference printed). Each way's first call (trace,
compile and run) is timed once; then, after ``--warmup`` calls, the median over ``--repeats``
rounds, each round timing both ways in turn (``timing.paired_medians``: the order alternates
between rounds, and a sample is as many back-to-back calls as fill 20 ms). The ratio is
``jax / ours`` (above 1: this project is faster). A markdown table is printed at the end. Run
from the repository root: ``python benchmarks/library_interpret_gpu.py [--quick] [--json PATH]``.
"""

from __future__ import annotations

import functools
import importlib
import json
import math
import pathlib
import platform
import statistics
import sys
import time
import types
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from timing import command_line, paired_medians

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from tests.jax_library import porting

MODULES = ("attention", "decode_attention", "paged_attention", "layer_norm", "rms_norm",
           "softmax")


def _libraries() -> dict[str, types.SimpleNamespace]:
    ours = {m: porting.ported(f"gpu.{m}") for m in MODULES}
    jaxs = {m: importlib.import_module(f"jax.experimental.pallas.ops.gpu.{m}") for m in MODULES}
    return {"ours": types.SimpleNamespace(**ours), "jax": types.SimpleNamespace(**jaxs)}


def _normal(seed: int, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


Case = Callable[[types.SimpleNamespace], tuple[Callable[..., Any], tuple[Any, ...]]]


def _mha(lib: types.SimpleNamespace, backward: bool, seq: int) -> tuple[Any, tuple[Any, ...]]:
    blocks = lib.attention.BlockSizes(block_q=64, block_k=64, block_q_dkv=32, block_kv_dkv=32,
                                      block_q_dq=32, block_kv_dq=32)
    fn = functools.partial(lib.attention.mha, segment_ids=None, causal=True,
                           block_sizes=blocks, interpret=True)
    qkv = tuple(_normal(s, (1, seq, 2, 64)) for s in range(3))
    if not backward:
        return fn, qkv
    do = _normal(3, qkv[0].shape)
    return (lambda *a: jax.vjp(fn, *a)[1](do)), qkv


def _decode(lib: types.SimpleNamespace, gqa: bool, seq: int) -> tuple[Any, tuple[Any, ...]]:
    if gqa:
        q, k, v = _normal(0, (2, 16, 64)), _normal(1, (2, seq, 4, 64)), _normal(2, (2, seq, 4, 64))
        f = lib.decode_attention.gqa
    else:
        q, k, v = _normal(0, (2, 8, 64)), _normal(1, (2, seq, 64)), _normal(2, (2, seq, 64))
        f = lib.decode_attention.mqa
    end = jnp.array([seq // 3, seq], jnp.int32)
    fn = functools.partial(f, kv_seq_len=end, block_h=16, block_k=64, k_splits=4,
                           interpret=True)
    return fn, (q, k, v)


def _paged(lib: types.SimpleNamespace, pages_per_seq: int) -> tuple[Any, tuple[Any, ...]]:
    batch, kv_heads, page = 3, 2, 16
    pages = batch * pages_per_seq
    k_pages, v_pages = (_normal(s, (kv_heads, pages, page, 64)) for s in (0, 1))
    tables = jax.random.permutation(jax.random.key(2), jnp.arange(pages, dtype=jnp.int32))
    lengths = jnp.array([5, page * pages_per_seq // 2, page * pages_per_seq], jnp.int32)
    fn = functools.partial(lib.paged_attention.paged_attention, block_h=16,
                           pages_per_compute_block=4, k_splits=4, interpret=True)
    return fn, (_normal(3, (batch, kv_heads * 8, 64)), k_pages, v_pages,
                tables.reshape(batch, pages_per_seq), lengths)


def _norm(lib: types.SimpleNamespace, name: str, backward: bool,
          shape: tuple[int, ...]) -> tuple[Any, tuple[Any, ...]]:
    fn = functools.partial(getattr(getattr(lib, name), name), interpret=True)
    args = (_normal(0, shape), _normal(1, shape[-1:]), _normal(2, shape[-1:]))
    if not backward:
        return fn, args
    do = _normal(3, shape)
    return (lambda *a: jax.vjp(fn, *a)[1](do)), args


def _softmax(lib: types.SimpleNamespace, shape: tuple[int, ...]) -> tuple[Any, tuple[Any, ...]]:
    return functools.partial(lib.softmax.softmax, axis=-1, interpret=True), (_normal(0, shape),)


def cases(quick: bool) -> dict[str, tuple[str, Case]]:
    """name -> (shape description, builder of (function, arguments) from a library)."""
    seq, dec, pps, rows = (128, 256, 8, 32) if quick else (256, 1024, 32, 128)
    norm_shape = (2, rows, 384)
    return {
        "mha forward": (f"1x{seq}x2x64 causal", functools.partial(_mha, backward=False, seq=seq)),
        "mha backward": (f"1x{seq}x2x64 causal", functools.partial(_mha, backward=True, seq=seq)),
        "mqa": (f"2x8x64, kv {dec}, ragged", functools.partial(_decode, gqa=False, seq=dec)),
        "gqa": (f"2x16x64, kv {dec}x4, ragged", functools.partial(_decode, gqa=True, seq=dec)),
        "paged_attention": (f"3x16x64, {pps} pages of 16",
                            functools.partial(_paged, pages_per_seq=pps)),
        **{f"{n} {d}": ("x".join(map(str, norm_shape)),
                        functools.partial(_norm, name=n, backward=d == "backward",
                                          shape=norm_shape))
           for n in ("layer_norm", "rms_norm") for d in ("forward", "backward")},
        "softmax": (f"{rows * 4}x1000", functools.partial(_softmax, shape=(rows * 4, 1000))),
    }


def _first_call(fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return time.perf_counter() - start, out


def run(quick: bool, warmup: int, repeats: int) -> dict[str, Any]:
    """Times every case both ways; returns the figures."""
    libs = _libraries()
    results: dict[str, Any] = {}
    for name, (shape, build) in cases(quick).items():
        row: dict[str, Any] = {"shape": shape}
        outs, ways = {}, {}
        for way, lib in libs.items():
            fn, args = build(lib)
            fn = jax.jit(fn)
            first, outs[way] = _first_call(fn, args)
            row[way] = {"first_call_s": first}
            ways[way] = (fn, list(args))
        for way, median in paired_medians(ways, warmup, repeats).items():
            row[way]["median_s"] = median
        row["max_abs_diff"] = max(
            float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32))))
            for a, b in zip(jax.tree.leaves(outs["ours"]), jax.tree.leaves(outs["jax"])))
        row["jax_over_ours"] = row["jax"]["median_s"] / row["ours"]["median_s"]
        results[name] = row
        print(f"{name:<20} ours {row['ours']['median_s'] * 1e3:9.2f} ms   jax "
              f"{row['jax']['median_s'] * 1e3:9.2f} ms   jax/ours {row['jax_over_ours']:6.2f}   "
              f"first call: ours {row['ours']['first_call_s']:.2f} s, jax "
              f"{row['jax']['first_call_s']:.2f} s   max |diff| {row['max_abs_diff']:.1e}",
              flush=True)
    return results


def markdown(results: dict[str, Any]) -> str:
    """The figures as a markdown table."""
    lines = ["| kernel | shape | ours median (ms) | JAX median (ms) | JAX / ours | "
             "ours first call (s) | JAX first call (s) | max abs diff |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['shape']} | {r['ours']['median_s'] * 1e3:.2f} | "
                     f"{r['jax']['median_s'] * 1e3:.2f} | {r['jax_over_ours']:.2f} | "
                     f"{r['ours']['first_call_s']:.2f} | {r['jax']['first_call_s']:.2f} | "
                     f"{r['max_abs_diff']:.1e} |")
    gm = math.exp(statistics.mean(math.log(r["jax_over_ours"]) for r in results.values()))
    lines.append(f"\nGeometric mean of JAX / ours: {gm:.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = command_line(__doc__, warmup=2, repeats=7)
    parser.add_argument("--quick", action="store_true", help="smaller shapes")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {platform.machine()}, {jax.devices()[0].device_kind}, "
          f"quick={args.quick}, warmup={args.warmup}, repeats={args.repeats}")
    results = run(args.quick, args.warmup, args.repeats)
    print()
    print(markdown(results))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
