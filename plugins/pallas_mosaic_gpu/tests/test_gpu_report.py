"""``pl.report`` for Mosaic GPU kernels: the on-chip footprint is the dynamic shared memory of
the launch the lowering emits (read back from the module the custom call carries), a kernel the
report says does not fit is the one the backend refuses, with the same numbers, and the chips
are the core's GPU datasheets (h100, h200, b200)."""

from __future__ import annotations

import functools
import re
from typing import Any

import jax
import jax.numpy as jnp
import pytest

import pallas_core as pl
from pallas_core import backend as plb
from pallas_core.plugins import manager

plgpu = pytest.importorskip("pallas_mosaic_gpu")
from pallas_mosaic_gpu import hopper_kernels as K  # noqa: E402, N812

S = jax.ShapeDtypeStruct
F32 = S((256, 512), jnp.float32)
BF16 = S((512, 512), jnp.bfloat16)


def _launch_smem(fn: Any, *args: Any) -> int:
    """The ``dynamic_shared_memory_size`` of the one ``gpu.launch`` in the module the
    ``mosaic_gpu_v2`` custom call carries, read from the module's text."""
    (stages,) = pl.stages(fn, *args, backend="mosaic_gpu")
    text = stages["mosaic_gpu"]
    (name,) = re.findall(r"gpu\.launch .* dynamic_shared_memory_size (%[\w]+)", text)
    (value,) = re.findall(rf"{re.escape(name)} = arith\.constant (\d+) : i32", text)
    return int(value)


def _only(fn: Any, *args: Any, **kwargs: Any) -> Any:
    (kernel,) = pl.report(fn, *args, backend="mosaic_gpu", **kwargs).kernels
    return kernel


@pytest.mark.parametrize("fn, args", [
    (K.blocked_add, (F32, F32)),  # two input blocks with a barrier each, one output block
    # The K axis pipelined three steps deep (3 slots per input), the accumulator in registers.
    (functools.partial(K.matmul, max_concurrent_steps=3), (BF16, BF16)),
    # plgpu.kernel: SMEM scratch, and emit_pipeline's pl.run_scoped buffers and barriers.
    (K.matmul_pipeline, (BF16, BF16)),
    (K.softmax, (F32,)),  # the output staged in the input's buffer
], ids=["blocked_add", "matmul", "matmul_pipeline", "softmax"])
def test_the_footprint_is_the_launchs_shared_memory(fn: Any, args: tuple[Any, ...]) -> None:
    k = _only(fn, *args)
    assert k.onchip_bytes == sum(b for _, b in k.onchip_parts) == _launch_smem(fn, *args)
    assert k.onchip_limit == 227 * 1024 and k.fits is True


def test_the_parts_name_each_buffer() -> None:
    k = _only(functools.partial(K.matmul, max_concurrent_steps=3), BF16, BF16)
    parts = dict(k.onchip_parts)
    assert parts["input 0 (a_ref) (3 x block (128, 64) bfloat16)"] == 3 * 128 * 64 * 2
    assert parts["input 0 (a_ref) barriers (3)"] == 3 * 8
    assert parts["output 0 (o_ref) (block (128, 128) bfloat16)"] == 128 * 128 * 2
    softmax = dict(_only(K.softmax, F32).onchip_parts)
    assert softmax["output 0 (o_ref) (staged in the buffer of input 0 (x_ref))"] == 0


def test_a_kernel_that_does_not_fit_is_refused_with_the_same_numbers() -> None:
    """(128, 256) float32 blocks: two inputs and the output staged in one of them need 256 KiB
    and two barriers; (64, 256) ones fit and lower."""
    big = functools.partial(K.blocked_add, block=(128, 256))
    k = _only(big, F32, F32)
    assert k.fits is False and k.onchip_bytes == 2 * 128 * 256 * 4 + 2 * 8
    assert k.onchip_limit == 232448
    message = f"needs {k.onchip_bytes} bytes of shared memory.*may use {k.onchip_limit}"
    assert any(re.search(message, n) for n in k.notes if "refuses this kernel" in n)
    with pytest.raises(pl.PallasError, match=message):
        pl.stages(big, F32, F32, backend="mosaic_gpu")
    small = functools.partial(K.blocked_add, block=(64, 256))
    k = _only(small, F32, F32)
    assert k.fits is True and k.onchip_bytes == 3 * 64 * 256 * 4 + 2 * 8
    assert _launch_smem(small, F32, F32) == k.onchip_bytes


def test_the_gpu_chips_are_the_cores_datasheets() -> None:
    chips = manager.get("mosaic_gpu").info.chips
    assert list(chips) == ["h100", "h200", "b200"]
    assert all(chips[name] is plb.GPU_CHIPS[name] for name in chips)
    k = _only(K.blocked_add, F32, F32, target=["h100", "b200"])
    h100 = k.roofline["h100"]
    assert set(k.roofline) == {"h100", "b200"} and h100.bound == "memory"
    assert h100.seconds == pytest.approx(k.hbm_bytes / 3.35e12)
    assert k.roofline["b200"].seconds < h100.seconds
