"""``pl.autotune`` without hardware on JAX's kernel library: how much of each kernel's natural
block-size space the pruner removes, what the model picks on each chip, and how long it takes.

Each kernel is JAX's own (ported, only its Pallas imports rewritten, as the tests load it),
tuned over the tunables it takes (``tests/jax_library/tuning_spaces.py``), for production
shapes given as ``ShapeDtypeStruct``s: the TPU kernels on v5e and v6e (Mosaic TPU), the Triton
kernels on H100. Nothing runs: ``pl.report`` traces each config, and for Triton compiles it to
LLVM IR for its shared memory (with the ``triton`` package installed).

Run: ``python benchmarks/autotune_library.py [--only tpu|triton]`` (prints a Markdown table for
RESULTS.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax

import pallas_core as pl
from tests.jax_library import tuning_spaces


def _config(config: Any) -> str:
    return ", ".join(f"{k}={v}" for k, v in config.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("tpu", "triton"), help="one family of kernels")
    only = parser.parse_args().only
    cases = ([] if only == "triton" else tuning_spaces.tpu_cases()) + (
        [] if only == "tpu" else tuning_spaces.triton_cases())
    print(f"jax {jax.__version__}, {time.strftime('%Y-%m-%d')}")
    print("| kernel | chip | configs | pruned | best | bound | predicted | JAX's default, "
          "predicted | seconds |")
    print("|---|---|---|---|---|---|---|---|---|")
    for case in cases:
        for chip in case.chips:
            start = time.perf_counter()
            result = pl.autotune(case.build, case.space, *case.args, backend=case.backend,
                                 target=chip, progress=False)
            took = time.perf_counter() - start
            pruned = sum(r.verdict == "pruned" for r in result.table)
            best = next(r for r in result.table if r.config == result.best)
            default = next((r for r in result.table if dict(r.config) == case.default), None)
            versus = ("not in the space" if default is None else "pruned"
                      if default.predicted_seconds is None
                      else f"{_config(default.config)}: {default.predicted_seconds * 1e6:.0f} us")
            print(f"| {case.label} | {chip} | {len(result.table)} | {pruned} | "
                  f"{_config(result.best)} | {best.bound} | "
                  f"{best.predicted_seconds * 1e6:.0f} us | {versus} | {took:.1f} |",
                  flush=True)


if __name__ == "__main__":
    main()
