"""``pl.autotune`` on real runs: checking candidates' results on CPU, and timing them on a
device.

- **Checking** (``reference=``): each candidate runs on inputs drawn at random from the
  arguments' shapes (arguments given as arrays are used as they are), through ``pl.emulate``
  for a hardware backend with an emulator, directly for a backend that runs on the CPU (the
  interpreter), and its result is compared with the reference's within a tolerance of the
  output's dtype.
- **Timing**: the candidates are compiled in parallel (a thread pool), then timed one at a
  time: warm-up runs, then the median of ``runs`` runs, each preceded by writing a buffer the
  size of the chip's last-level cache (so that no run finds the operands cached by the one
  before) and each waited for (``block_until_ready``). Dispatch from Python is included.
"""

from __future__ import annotations

import concurrent.futures
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_core.plugins import manager

TOLERANCE = {"bfloat16": 2e-2, "float16": 5e-3, "float32": 1e-4, "float64": 1e-10}
"""Relative tolerance of a candidate's result against the reference's, by output dtype
(scaled by the reference's largest magnitude: blocked sums add in another order)."""


def concrete_inputs(args: Sequence[Any], seed: int = 0) -> list[Any]:
    """``args`` with each ``jax.ShapeDtypeStruct`` replaced by a random array of its shape and
    dtype (floats standard normal, integers in [0, 8), booleans fair coins)."""
    key = jax.random.key(seed)
    out = []
    for i, a in enumerate(args):
        if not isinstance(a, jax.ShapeDtypeStruct):
            out.append(a)
            continue
        k = jax.random.fold_in(key, i)
        dtype = np.dtype(a.dtype)
        if jnp.issubdtype(dtype, jnp.floating):
            out.append(jax.random.normal(k, a.shape, jnp.float32).astype(dtype))
        elif dtype == np.bool_:
            out.append(jax.random.bernoulli(k, 0.5, a.shape))
        elif jnp.issubdtype(dtype, jnp.integer):
            out.append(jax.random.randint(k, a.shape, 0, 8).astype(dtype))
        else:
            out.append(jnp.zeros(a.shape, dtype))
    return out


def cpu_runner(fn: Callable[..., Any], backend: str, target: str | None
               ) -> tuple[Callable[..., Any] | None, str]:
    """``fn`` made to run on CPU as ``backend`` compiles it, or ``None`` and why not."""
    from pallas_core.emulation.api import emulate

    found = manager.get(backend)
    if hasattr(found.plugin, "pallas_emulate"):
        kinds = found.info.device_kinds
        return emulate(fn, backend=backend, target=target if target in kinds else None), ""
    if "cpu" in found.info.platforms:
        return jax.jit(fn), ""
    return None, (f"the {backend} backend has no emulator and does not run on the CPU: "
                  "candidates' results were not checked")


def differs(result: Any, expected: Any) -> str:
    """Why ``result`` is not ``expected`` (``""`` when it is, within :data:`TOLERANCE`)."""
    got, want = jax.tree.leaves(result), jax.tree.leaves(expected)
    if len(got) != len(want):
        return f"{len(got)} outputs, the reference has {len(want)}"
    for n, (g, w) in enumerate(zip(got, want, strict=True)):
        g, w = np.asarray(g), np.asarray(w)
        if g.shape != w.shape:
            return f"output {n} has shape {g.shape}, the reference's {w.shape}"
        tol = TOLERANCE.get(np.dtype(w.dtype).name, 1e-1 if w.dtype.itemsize == 1 else 0.0)
        if not jnp.issubdtype(w.dtype, jnp.inexact):
            tol = 0.0
        g64, w64 = g.astype(np.float64), w.astype(np.float64)
        scale = max(1.0, float(np.nanmax(np.abs(w64), initial=0.0)))
        err = np.abs(g64 - w64)
        bad = ~((err <= tol * scale) | (np.isnan(g64) & np.isnan(w64)))
        if bad.any():
            return (f"output {n} differs from the reference at {int(bad.sum())} of {bad.size} "
                    f"elements (largest difference {float(np.nanmax(err)):.3g}, tolerance "
                    f"{tol * scale:.3g})")
    return ""


def device_platform() -> str:
    """The platform of the default device (``"cpu"``, ``"gpu"``/``"cuda"``, ``"tpu"``)."""
    return jax.devices()[0].platform


def platform_matches(platform: str, platforms: Sequence[str]) -> bool:
    """Whether a device of ``platform`` runs a backend lowering for ``platforms`` (JAX calls
    a CUDA or ROCm device's platform ``"gpu"``)."""
    return platform in platforms or (platform == "gpu" and bool(
        {"cuda", "rocm"} & set(platforms)))


def compile_all(fns: Sequence[Callable[..., Any]], inputs: Sequence[Any]) -> list[Any]:
    """Each of ``fns`` compiled for ``inputs``, in parallel threads; an entry is the compiled
    function, or the exception compiling raised."""

    def one(fn: Callable[..., Any]) -> Any:
        try:
            return jax.jit(fn).lower(*inputs).compile()
        except Exception as e:  # recorded in the table, as the candidate's reason
            return e

    workers = max(1, min(len(fns), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, fns))


class Flusher:
    """Writes a buffer of ``nbytes`` (a last-level cache's worth) to evict the cache."""

    def __init__(self, nbytes: int) -> None:
        self._buffer = jnp.zeros((max(nbytes, 4) // 4,), jnp.int32)
        self._write = jax.jit(lambda b: b + 1)

    def __call__(self) -> None:
        self._buffer = self._write(self._buffer)
        self._buffer.block_until_ready()


def time_runs(compiled: Any, inputs: Sequence[Any], flush: Flusher, runs: int,
              warmup: int = 2) -> list[float]:
    """Seconds of each of ``runs`` runs of ``compiled`` after ``warmup`` untimed ones, the
    cache flushed before each."""
    for _ in range(warmup):
        jax.block_until_ready(compiled(*inputs))
    times = []
    for _ in range(runs):
        flush()
        start = time.perf_counter()
        jax.block_until_ready(compiled(*inputs))
        times.append(time.perf_counter() - start)
    return times


def median(times: Sequence[float]) -> float:
    return float(statistics.median(times))
