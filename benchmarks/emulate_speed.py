"""Emulator speed: kernels emulated for their hardware, against the interpreter, in one run.

For each kernel (the 1024x1024 blocked add and the 1024^3 matmul on a 3-D grid of
``interpret_speed.py``) and each hardware backend with an emulator (``mosaic_tpu``,
``triton``), times side by side (``timing.paired_medians``: warm-up, then alternating rounds):

1. ``pl.emulate(f, backend=...)``: the kernel lowered for the hardware and its module executed
   by the backend's emulator (this project's emulation);
2. the same kernel on the ``interpret`` backend (this project's interpreter, jitted);
3. ``jax.experimental.pallas`` with ``interpret=True`` (JAX's interpreter, the peer).

The emulated result is checked against ``jax.numpy`` before timing. Run:
``python benchmarks/emulate_speed.py [--repeats N]``.
"""

from __future__ import annotations

import datetime
import functools
import platform
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from interpret_speed import blocked_add, matmul_3d
from jax.experimental import pallas as jax_pl
from timing import command_line, paired_medians

import pallas_core as our_pl

KERNELS: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "blocked_add 1024x1024 (8x8 grid)": (blocked_add, jnp.add),
    "matmul_3d 1024^3 (4x4x8 grid)": (matmul_3d, jnp.dot),
}


def main() -> None:
    parser = command_line(__doc__, warmup=1, repeats=5)
    parser.add_argument("--backends", default="mosaic_tpu,triton")
    args = parser.parse_args()
    print(f"# {datetime.date.today()} on {platform.machine()} {platform.processor() or ''}"
          f" ({jax.devices()[0].device_kind}), jax {jax.__version__}")
    print("| kernel | backend | emulated (s) | our interpreter (s) | JAX interpret (s) | "
          "emulated / ours | emulated / JAX |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    rng = np.random.default_rng(0)
    for name, (kernel, reference) in KERNELS.items():
        xs = [jnp.asarray(rng.integers(-4, 5, (1024, 1024)), jnp.float32) for _ in range(2)]
        for backend in args.backends.split(","):
            emulated = our_pl.emulate(functools.partial(kernel, our_pl, backend=backend),
                                      backend=backend)
            np.testing.assert_allclose(emulated(*xs), reference(*xs), rtol=1e-5, atol=1e-3)
            ways = {
                "emulated": (emulated, xs),
                "ours": (jax.jit(functools.partial(kernel, our_pl, backend="interpret")), xs),
                "jax": (jax.jit(functools.partial(kernel, jax_pl, interpret=True)), xs),
            }
            t = paired_medians(ways, args.warmup, args.repeats)
            print(f"| {name} | {backend} | {t['emulated']:.3f} | {t['ours']:.4f} | "
                  f"{t['jax']:.3f} | {t['emulated'] / t['ours']:.1f} | "
                  f"{t['emulated'] / t['jax']:.2f} |")


if __name__ == "__main__":
    main()
