"""``pl.report`` on JAX's Triton attention (ported, imports rewritten) for the Triton backend:
flops against XLA's own count of the library's reference; the causal kernel's shortened inner
loop counted trip by trip; HBM bytes as each distinct block once, and the loads as issued, both
against closed forms."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import pytest

import pallas_core as pl
from pallas_core.plugins import manager
from tests.jax_library import porting
from tests.xla_cost import xla_flops

if "triton" not in manager.backends():
    pytest.skip("the triton backend is not installed", allow_module_level=True)

B, S, H, D = 2, 512, 4, 64
BQ, BK = 128, 64
QKV = [jax.ShapeDtypeStruct((B, S, H, D), jnp.float16)] * 3


def _mha(causal: bool) -> tuple[Any, Any]:
    attention = porting.ported("gpu.attention")
    blocks = attention.BlockSizes(block_q=BQ, block_k=BK)
    return attention, functools.partial(attention.mha, segment_ids=None, causal=causal,
                                        block_sizes=blocks)


def test_triton_attention_flops_and_bytes() -> None:
    attention, fn = _mha(causal=False)
    (k,) = pl.report(fn, *QKV, backend="triton", target="h100").kernels
    xla = xla_flops(functools.partial(attention.mha_reference, segment_ids=None), *QKV)
    assert abs(k.flops - xla) <= 0.1 * xla, (k.flops, xla)
    assert k.matmul_flops == 2 * (2 * B * H * S * S * D)  # q @ k.T and p @ v
    array = B * S * H * D * 2
    assert k.hbm_bytes == 4 * array  # q, k, v read once and o written once: the caches
    # As issued: each of the B * H * S / BQ programs loads its q block, all of K and V in
    # BK-row slices, and stores its o block.
    programs = B * H * (S // BQ)
    assert k.loaded_bytes == 2 * array + programs * 2 * (S * D * 2)


def test_triton_causal_attention_runs_fewer_trips() -> None:
    """The causal kernel's inner loop runs to the diagonal: program ``i`` of the q axis
    (block ``BQ``) runs ``(i + 1) * BQ // BK`` trips of ``BK`` keys."""
    _, fn = _mha(causal=True)
    (k,) = pl.report(fn, *QKV, backend="triton", target="h100").kernels
    trips = sum((i + 1) * BQ // BK for i in range(S // BQ))
    assert k.matmul_flops == B * H * trips * 2 * (2 * BQ * BK * D)
    dense = B * H * (S // BQ) * (S // BK) * 2 * (2 * BQ * BK * D)
    assert k.skipped_flops >= dense - k.matmul_flops  # the vector work is skipped too
    assert any("decided per grid step" in n for n in k.notes)
