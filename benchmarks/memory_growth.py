"""Memory kept per distinct kernel: this project's pallas_call against JAX's (interpret=True).

Creates ``--kernels`` pallas_calls, each with its own grid and block shape (a blocked add),
traces each (``jax.eval_shape``: the grid mapping, the ahead-of-time index-map check and the
kernel's jaxpr; ``--run`` also executes them), first with this project then with
``jax.experimental.pallas``, and reports the growth of the resident set size (read from
``/proc/self/statm``) after a warm-up, at checkpoints, so that a growth that levels off can be
told from one that does not. Usage::

    python benchmarks/memory_growth.py --kernels 500 --warmup 20
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as jax_pl

import pallas_core as pl

_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mb() -> float:
    """The resident set size of this process, in MiB (after a garbage collection)."""
    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE / 2**20


def _kernel(x_ref: Any, y_ref: Any, o_ref: Any) -> None:
    o_ref[...] = x_ref[...] + y_ref[...]


def kernel_number(api: Any, k: int, run: bool, **extra: Any) -> None:
    """Builds and traces (or runs) kernel number ``k``: grid ``(40 + k, 3)``, blocks of
    ``(1 + k % 16, 128)``, so that grid sizes and block shapes differ from kernel to kernel."""
    grid = (40 + k, 3)
    block = (1 + k % 16, 128)
    shape = (grid[0] * block[0], grid[1] * block[1])
    spec = api.BlockSpec(block, lambda i, j: (i, j))
    f = api.pallas_call(_kernel, grid=grid, in_specs=[spec, spec], out_specs=spec,
                        out_shape=jax.ShapeDtypeStruct(shape, jnp.float32), **extra)
    if run:
        x = jnp.asarray(np.random.default_rng(k).standard_normal(shape, np.float32))
        np.testing.assert_allclose(np.asarray(f(x, x)), np.asarray(x + x), rtol=1e-6)
    else:
        arg = jax.ShapeDtypeStruct(shape, jnp.float32)
        jax.eval_shape(f, arg, arg)


def measure(name: str, make: Callable[[int], None], kernels: int, warmup: int,
            checkpoints: int, offset: int) -> dict[str, Any]:
    """Warms up on ``warmup`` kernels, then builds ``kernels`` more (numbers from ``offset``,
    unlike any other run's), noting the RSS growth at ``checkpoints`` even intervals."""
    for k in range(warmup):
        make(offset + k)
    base = rss_mb()
    start = time.perf_counter()
    marks = []
    step = max(kernels // checkpoints, 1)
    for k in range(kernels):
        make(offset + warmup + k)
        if (k + 1) % step == 0 or k + 1 == kernels:
            marks.append((k + 1, rss_mb() - base))
    seconds = time.perf_counter() - start
    return {"name": name, "base": base, "marks": marks, "seconds": seconds}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kernels", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--checkpoints", type=int, default=5)
    parser.add_argument("--run", action="store_true", help="execute the kernels too")
    parser.add_argument("--jax-first", action="store_true", help="measure JAX's first")
    args = parser.parse_args(argv)
    print(f"python {sys.version.split()[0]}, jax {jax.__version__}, {platform.machine()}, "
          f"{os.cpu_count()} cpus; {args.kernels} kernels after {args.warmup} warm-up, "
          f"{'run' if args.run else 'traced (eval_shape)'}")
    ways = [("pallas (this project)", lambda k: kernel_number(pl, k, args.run)),
            ("jax.experimental.pallas interpret=True",
             lambda k: kernel_number(jax_pl, k, args.run, interpret=True))]
    if args.jax_first:
        ways.reverse()
    results = []
    for n, (name, make) in enumerate(ways):
        # Each way gets kernel numbers of its own: no grid seen before.
        offset = n * (args.kernels + args.warmup)
        results.append(measure(name, make, args.kernels, args.warmup, args.checkpoints,
                               offset))
    header = " | ".join(f"+{k} kernels" for k, _ in results[0]["marks"])
    print(f"| way | RSS after warm-up (MiB) | {header} | KiB per kernel | s |")
    print("| --- | ---: |" + " ---: |" * (len(results[0]["marks"]) + 2))
    for r in results:
        growth = " | ".join(f"+{g:.1f}" for _, g in r["marks"])
        per = r["marks"][-1][1] * 1024 / r["marks"][-1][0]
        print(f"| {r['name']} | {r['base']:.0f} | {growth} | {per:.0f} | {r['seconds']:.1f} |")


if __name__ == "__main__":
    main()
