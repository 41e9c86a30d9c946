"""JAX's own Triton kernel library emulated: ``pl.emulate(..., backend="triton")``.

Each kernel of ``jax.experimental.pallas.ops.gpu`` runs twice through the Triton emulator, in
checked mode (no unmasked out-of-bounds access, no two programs storing one address): as
``jax.experimental.pallas`` lowers it (JAX's own module, unchanged) and as this project lowers
the ported module (``porting.ported``: JAX's source with its Pallas imports pointing here). Both
are compared with the reference shipped in the same JAX module, on random inputs; each for an
NVIDIA target (``sm_90``, lowered for ``cuda``) and an AMD one (``gfx942``, lowered for
``rocm``). About 30 s.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.gpu import attention as jax_attention
from jax.experimental.pallas.ops.gpu import decode_attention as jax_decode
from jax.experimental.pallas.ops.gpu import layer_norm as jax_layer_norm
from jax.experimental.pallas.ops.gpu import rms_norm as jax_rms_norm
from jax.experimental.pallas.ops.gpu import softmax as jax_softmax

import pallas_core as pl
from tests.jax_library import porting

pytest.importorskip("pallas_triton")

F32 = jnp.float32
MODULES = {
    "jax": {"attention": jax_attention, "decode_attention": jax_decode,
            "layer_norm": jax_layer_norm, "rms_norm": jax_rms_norm, "softmax": jax_softmax},
    "ours": {name: porting.ported(f"gpu.{name}") for name in
             ("attention", "decode_attention", "layer_norm", "rms_norm", "softmax")},
}


def _normal(seed: int, shape: tuple[int, ...]) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape, F32)


def _vjp(fn: Callable[..., Any], do: jax.Array) -> Callable[..., Any]:
    return lambda *args: jax.vjp(fn, *args)[1](do)


def _norm(mods: dict[str, Any], name: str, backward: bool) -> tuple[Any, Any, tuple[Any, ...]]:
    mod = mods[name]
    fn, ref = getattr(mod, name), getattr(mod, f"{name}_reference")
    args = (_normal(0, (2, 9, 40)), _normal(1, (40,)), _normal(2, (40,)))
    if backward:
        do = _normal(3, args[0].shape)
        fn, ref = _vjp(fn, do), _vjp(ref, do)
    return fn, ref, args


def _mha(mods: dict[str, Any], backward: bool) -> tuple[Any, Any, tuple[Any, ...]]:
    mod = mods["attention"]
    blocks = mod.BlockSizes(block_q=16, block_k=16, block_q_dkv=16, block_kv_dkv=16,
                            block_q_dq=16, block_kv_dq=16)
    fn = functools.partial(mod.mha, segment_ids=None, causal=True, sm_scale=0.3,
                           block_sizes=blocks)
    ref = functools.partial(mod.mha_reference, segment_ids=None, causal=True, sm_scale=0.3)
    args = tuple(_normal(s, (2, 32, 2, 16)) for s in range(3))
    if backward:
        do = _normal(7, args[0].shape)
        fn, ref = _vjp(fn, do), _vjp(ref, do)
    return fn, ref, args


def _decode(mods: dict[str, Any], form: str) -> tuple[Any, Any, tuple[Any, ...]]:
    mod = mods["decode_attention"]
    kv = (2, 64, 16) if form == "mqa" else (2, 64, 2, 16)
    args = (_normal(0, (2, 4, 16)), _normal(1, kv), _normal(2, kv))
    return (functools.partial(getattr(mod, form), block_k=16, k_splits=2),
            getattr(mod, f"{form}_reference"), args)


CASES: dict[str, tuple[Callable[[dict[str, Any]], tuple[Any, Any, tuple[Any, ...]]], float]] = {
    "layer_norm": (lambda m: _norm(m, "layer_norm", False), 1e-4),
    "layer_norm_backward": (lambda m: _norm(m, "layer_norm", True), 1e-4),
    "rms_norm": (lambda m: _norm(m, "rms_norm", False), 1e-4),
    "rms_norm_backward": (lambda m: _norm(m, "rms_norm", True), 1e-4),
    "softmax": (lambda m: (functools.partial(m["softmax"].softmax, axis=-1),
                           functools.partial(jax.nn.softmax, axis=-1),
                           (_normal(0, (8, 100)) * 3,)), 1e-6),
    # Dots of float32 run in TensorFloat-32, as on the GPU.
    "mha": (lambda m: _mha(m, False), 2e-2),
    "mha_backward": (lambda m: _mha(m, True), 5e-2),
    "mqa": (lambda m: _decode(m, "mqa"), 2e-2),
    "gqa": (lambda m: _decode(m, "gqa"), 2e-2),
}


@pytest.mark.parametrize("target", ["sm_90", "gfx942"])  # gfx942: lowered for rocm
@pytest.mark.parametrize("lowered_by", ["jax", "ours"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_gpu_library_kernel_emulated(name: str, lowered_by: str, target: str) -> None:
    make, tol = CASES[name]
    fn, ref, args = make(MODULES[lowered_by])
    got = pl.emulate(fn, backend="triton", target=target, checked=True)(*args)
    want = ref(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   rtol=tol, atol=tol)
