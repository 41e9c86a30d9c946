"""Hostile shapes and dtypes driven into each hardware backend's lowering (issue 34): every
case lowers, or is refused by validation with a ``PallasError`` that names the rule and the
fix. None may reach MLIR's or Triton's verifier (a message "does not verify", "error:
unknown", "a bug in the ... backend"), escape as another exception (``IndexError``), or hang:
the cases run in a subprocess with a timeout.

The kernels are a copy and an elementwise ``x * 2 + 1`` (``x & x`` for bool); the shapes
include a 0-d array, sizes that are not powers of two or not tile multiples, an empty array
and one larger than a Triton tensor may hold; the dtypes include bool, 8-bit, unsigned,
complex and 64-bit types (with ``jax_enable_x64``). Each backend lowers for its platform
(``lowering_platforms``), no compiler or device needed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

PLATFORM = {"triton": "cuda", "mosaic_tpu": "tpu", "mosaic_gpu": "cuda"}

SCRIPT = textwrap.dedent('''
    import json, sys
    import jax, jax.numpy as jnp
    import pallas_core as pl

    jax.config.update("jax_enable_x64", True)
    backend, platform = sys.argv[1], sys.argv[2]
    DTYPES = ["float32", "bfloat16", "int8", "uint32", "bool", "complex64", "float64"]
    SHAPES = [(), (1,), (3,), (1 << 21,), (7, 129), (8, 128), (1, 1, 1), (2, 0)]
    RAW = ("does not verify", "error: unknown", "a bug in the")

    def copy(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    def scale(x_ref, o_ref):
        x = x_ref[...]
        o_ref[...] = (x & x) if x.dtype == jnp.bool_ else x * 2 + 1

    for kernel in (copy, scale):
        for dtype in DTYPES:
            for shape in SHAPES:
                x = jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))
                case = f"{kernel.__name__} {dtype} {shape}"
                try:
                    fn = pl.pallas_call(kernel, out_shape=x, backend=backend)
                    jax.jit(fn).trace(x).lower(lowering_platforms=(platform,))
                    outcome = "lowered"
                except pl.PallasError as e:
                    text = str(e)
                    outcome = ("raw " if any(r in text for r in RAW) else "refused ") + text
                except Exception as e:
                    outcome = f"escaped {type(e).__name__}: {e}"
                print(json.dumps([case, outcome[:400]]), flush=True)
''')


@pytest.mark.parametrize("backend", list(PLATFORM))
def test_hostile_shapes_and_dtypes_are_refused_by_validation(backend: str) -> None:
    pytest.importorskip(f"pallas_{backend}")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, backend, PLATFORM[backend]],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    outcomes = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("[")]
    assert len(outcomes) == 2 * 7 * 8, done.stdout[-2000:]
    bad = [f"{case}: {outcome}" for case, outcome in outcomes
           if not outcome.startswith(("lowered", "refused"))]
    assert not bad, "\n".join(bad)
    # The hostile cases are really refused (and the ordinary ones really lower).
    refused = {case for case, outcome in outcomes if outcome.startswith("refused")}
    assert "copy float32 (2, 0)" in refused and "copy complex64 (8, 128)" in refused
    assert "copy float32 (8, 128)" not in refused
