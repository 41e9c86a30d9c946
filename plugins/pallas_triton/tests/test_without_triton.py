"""``triton`` is an optional extra (``pallas-triton[compile]``): without it a kernel still lowers
for ``cuda`` and ``rocm`` (through jaxlib's own Triton dialect), and only the stages that need
Triton's compiler (``ptx``/``cubin``, ``amdgcn``/``hsaco``) fail, with a PallasError that names
the extra to install. ``pl.report`` gives no on-chip footprint (only Triton's compiler knows
the shared memory it allocates).

The check runs in a fresh interpreter in which importing ``triton`` fails, as it does where the
package is not installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent("""
    import importlib.abc
    import sys

    class _NoTriton(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, _NoTriton())

    import jax
    import jax.numpy as jnp
    import numpy as np

    import pallas_core as pl

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2.0 + 1.0

    def f(x):
        return pl.pallas_call(
            kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(2,),
            in_specs=[pl.BlockSpec((128,), lambda i: (i,))],
            out_specs=pl.BlockSpec((128,), lambda i: (i,)), backend="triton")(x)

    x = jnp.asarray(np.random.default_rng(0).standard_normal(256), jnp.float32)
    for platform in ("cuda", "rocm"):
        text = jax.jit(f).trace(x).lower(lowering_platforms=(platform,)).as_text()
        assert "__gpu$xla.gpu.triton" in text, text
    for target in ("sm_90", "gfx942"):
        try:
            pl.stages(f, x, backend="triton", target=target)
        except pl.PallasError as e:
            assert "pip install 'pallas-triton[compile]'" in str(e), e
            assert target in str(e), e
        else:
            raise SystemExit(f"compiling for {target} without triton did not fail")
    (k,) = pl.report(f, x, backend="triton").kernels
    assert k.onchip_bytes is None and k.fits is None and not k.onchip_parts, k
    assert not any(m == "triton" or m.startswith("triton.") for m in sys.modules)
    print("OK")
""")


def test_lowers_without_triton_and_compiling_names_the_extra() -> None:
    done = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                          env=dict(os.environ), timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), (
        done.stdout + done.stderr)
