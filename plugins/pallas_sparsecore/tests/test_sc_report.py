"""``pl.report`` for SparseCore kernels: the on-chip footprint is the per-subcore VMEM the
emitted Mosaic module declares (scratch operands and ``pl.run_scoped`` allocas, read back from
the module's text), and a kernel the report says does not fit is the one the backend refuses,
with the same numbers."""

from __future__ import annotations

import functools
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
import pytest

import pallas_core as pl

plsc = pytest.importorskip("pallas_sparsecore")
from pallas_sparsecore import kernels as K  # noqa: E402, N812

S = jax.ShapeDtypeStruct
_BITS = {"i32": 32, "f32": 32, "bf16": 16, "i16": 16, "i8": 8}
pytestmark = pytest.mark.filterwarnings(
    "ignore::pallas_sparsecore.SparseCorePushStreamWarning",  # the kernels' stream semaphores
    "ignore:pl.core_map is deprecated:DeprecationWarning")  # kernels.scatter_add uses it


def _declared_vmem(fn: Any, *args: Any) -> int:
    """Bytes of every per-subcore VMEM memref the kernel function takes or allocates, read from
    the module ``pl.stages`` gives."""
    (stages,) = pl.stages(fn, *args, backend="sparsecore")
    total = 0
    for dims, elt in re.findall(r"memref<((?:\d+x)*)(\w+), #tpu\.memory_space<vmem>>",
                                _kernel_signature_and_allocas(stages["mosaic"])):
        shape = [int(d) for d in dims.split("x") if d]
        total += math.prod(shape) * _BITS[elt] // 8
    return total


def _kernel_signature_and_allocas(text: str) -> str:
    return "\n".join(line for line in text.splitlines()
                     if "func.func" in line or "memref.alloca" in line)


def _only(fn: Any, *args: Any) -> Any:
    (kernel,) = pl.report(fn, *args, backend="sparsecore").kernels
    return kernel


def _lookup(n: int, target: str) -> tuple[Any, tuple[Any, ...]]:
    """``embedding_lookup`` with ``n`` rows of 128 float32 per subcore (32 subcores)."""
    return (functools.partial(K.embedding_lookup, target=target),
            (S((1024, 128), jnp.float32), S((32 * n,), jnp.int32)))


def test_the_footprint_is_the_vmem_the_module_declares() -> None:
    fn, args = _lookup(64, "v7x")  # two VMEM scratch operands
    k = _only(fn, *args)
    assert k.onchip_bytes == 64 * 4 + 64 * 128 * 4 == _declared_vmem(fn, *args)
    assert k.onchip_limit == 512 * 1024 and k.fits is True
    scatter = functools.partial(K.scatter_add, num_rows=64)  # pl.run_scoped VMEM buffers
    args = (S((256, 128), jnp.float32), S((256,), jnp.int32))
    k = _only(scatter, *args)
    assert k.onchip_parts == (("pl.run_scoped buffers (the most held at once)", 4128),)
    assert k.onchip_bytes == _declared_vmem(scatter, *args)


def test_a_kernel_that_does_not_fit_is_refused_with_the_same_numbers() -> None:
    """512 rows of 128 float32 per subcore: more than a v6e subcore's 256 KiB, within a v7x
    subcore's 512 KiB."""
    fn, args = _lookup(512, "v6e")
    k = _only(fn, *args)
    assert k.fits is False and (k.onchip_bytes, k.onchip_limit) == (264192, 256 * 1024)
    message = f"needs {k.onchip_bytes} bytes of VMEM per vector subcore.*has {k.onchip_limit}"
    assert any(re.search(message, n) for n in k.notes if "refuses this kernel" in n)
    with pytest.raises(pl.PallasError, match=message):
        pl.stages(fn, *args, backend="sparsecore")
    fn, args = _lookup(512, "v7x")
    k = _only(fn, *args)
    assert k.fits is True and k.onchip_bytes == _declared_vmem(fn, *args) == 264192
