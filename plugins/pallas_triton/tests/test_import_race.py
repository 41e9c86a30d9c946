"""Threads compiling Triton kernels at once, in a process that has not imported ``triton``
yet, all get their cubins: none meets Triton's modules partially initialized and reports the
package as missing (issue 34; before the import lock about two runs in three failed so)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent('''
    import threading
    import jax, jax.numpy as jnp
    import pallas_core as pl

    def add(x_ref, y_ref, o_ref):
        o_ref[...] = x_ref[...] + y_ref[...]

    x = jax.ShapeDtypeStruct((256,), jnp.float32)
    fn = pl.pallas_call(add, out_shape=x, backend="triton")
    barrier = threading.Barrier(12)
    errors = []

    def work():
        barrier.wait()
        try:
            (k,) = pl.stages(fn, x, x, backend="triton", target="sm_90")
            assert k["cubin"][:4] == b"\\x7fELF"
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=work) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print("\\n".join(errors))
    raise SystemExit(1 if errors else 0)
''')


def test_threads_compiling_at_once_all_find_triton() -> None:
    pytest.importorskip("triton", reason="compiling to cubin needs the triton package")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
