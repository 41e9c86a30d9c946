"""JAX's own TPU kernel library lowered for ``tpu`` on CPU by this project's Mosaic TPU backend,
and compared with JAX's lowering of the unmodified library.

Each case builds its kernel from a module getter: ``porting.ported`` (the library with its Pallas
imports rewritten to this project) or ``importlib.import_module`` of JAX's own module. Both are
lowered with ``lowering_platforms=("tpu",)`` (JAX's under an assumed TPU v5e device kind); every
``tpu_custom_call`` is decoded and verified, and what a TPU runtime acts on must agree, kernel
by kernel: the backend config (body aside), grid, dimension semantics, windows, scratch and
scalar-prefetch counts, operand types with their memory spaces, and every index map evaluated
at every grid point (on the same pseudo-random scalar-prefetch values for both).

That the same kernels compute what their references do is checked in the interpreter by
``test_tpu_library.py``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_core import _jax
from tests.jax_library import porting

pltpu = pytest.importorskip("pallas_mosaic_tpu")
from pallas_mosaic_tpu import inspection  # noqa: E402

Library = Callable[[str], Any]
"""``"tpu.matmul"`` -> that library module (ported, or JAX's own)."""


def _ours(name: str) -> Any:
    return porting.ported(name)


def _theirs(name: str) -> Any:
    return importlib.import_module(f"jax.experimental.pallas.ops.{name}")


F32 = jnp.float32


def _normal(seed: int, shape: tuple[int, ...], dtype: Any = F32) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape, dtype)


# --- the kernels: (function, arguments) built from a library ----------------------------------


def example_kernel(lib: Library) -> tuple[Callable[..., Any], list[Any]]:
    return lib("tpu.example_kernel").double, [_normal(0, (16, 128))]


def matmul(lib: Library) -> tuple[Callable[..., Any], list[Any]]:
    mm = lib("tpu.matmul")
    return (functools.partial(mm.matmul, block_shape=(128, 128), block_k=128),
            [_normal(1, (256, 384)), _normal(2, (384, 256))])


def _flash(lib: Library) -> tuple[Any, Any]:
    flash = lib("tpu.flash_attention")
    blocks = flash.BlockSizes(
        block_q=128, block_k_major=256, block_k=128, block_b=1,
        block_q_major_dkv=128, block_k_major_dkv=128, block_k_dkv=128, block_q_dkv=128,
        block_k_major_dq=256, block_k_dq=128, block_q_dq=128)
    return flash, blocks


_QKV = [_normal(3, (2, 2, 256, 128)), _normal(4, (2, 2, 256, 128)), _normal(5, (2, 2, 256, 128))]
_SEG = jnp.asarray(np.repeat([[0, 1]], 128, axis=1).repeat(2, axis=0), jnp.int32)


def flash_forward_causal(lib: Library) -> tuple[Callable[..., Any], list[Any]]:
    flash, blocks = _flash(lib)
    return (lambda q, k, v: flash.flash_attention(q, k, v, causal=True, sm_scale=0.125,
                                                  block_sizes=blocks), _QKV)


def flash_forward_segments(lib: Library) -> tuple[Callable[..., Any], list[Any]]:
    flash, blocks = _flash(lib)

    def f(q: Any, k: Any, v: Any, ab: Any, ids: Any) -> Any:
        return flash.flash_attention(q, k, v, ab, flash.SegmentIds(q=ids, kv=ids),
                                     sm_scale=0.125, block_sizes=blocks)

    return f, [*_QKV, _normal(6, (2, 2, 256, 256)), _SEG]


def _flash_backward(causal: bool, segments: bool) -> Callable[[Library], Any]:
    def build(lib: Library) -> tuple[Callable[..., Any], list[Any]]:
        flash, blocks = _flash(lib)

        def f(q: Any, k: Any, v: Any, ids: Any) -> Any:
            seg = flash.SegmentIds(q=ids, kv=ids) if segments else None
            _, vjp = jax.vjp(lambda *a: flash.flash_attention(
                *a, None, seg, causal=causal, sm_scale=0.125, block_sizes=blocks), q, k, v)
            return vjp(q)

        return f, [*_QKV, _SEG]
    return build


def _splash(lib: Library, backward: bool, form: str) -> tuple[Callable[..., Any], list[Any]]:
    splash = lib("tpu.splash_attention.splash_attention_kernel")
    masks = lib("tpu.splash_attention.splash_attention_mask")
    heads = 2
    mask = masks.MultiHeadMask([masks.CausalMask((256, 256))] * heads)
    blocks = splash.BlockSizes(block_q=128, block_kv=128, block_kv_compute=128,
                               block_q_dkv=128, block_kv_dkv=128, block_kv_dkv_compute=128,
                               block_q_dq=128, block_kv_dq=128)
    q = _normal(7, (heads, 256, 128))
    if form == "mqa":
        kernel = splash.make_splash_mqa_single_device(mask, block_sizes=blocks)
        k, v = _normal(8, (256, 128)), _normal(9, (256, 128))
    else:
        kernel = splash.make_splash_mha_single_device(mask, block_sizes=blocks)
        k, v = _normal(8, (heads, 256, 128)), _normal(9, (heads, 256, 128))
    if not backward:
        return kernel, [q, k, v]
    return (lambda q, k, v: jax.vjp(kernel, q, k, v)[1](q)), [q, k, v]


def splash_forward(lib: Library) -> tuple[Callable[..., Any], list[Any]]:
    return _splash(lib, False, "mha")


def splash_forward_mqa(lib: Library) -> tuple[Callable[..., Any], list[Any]]:
    return _splash(lib, False, "mqa")


def splash_backward(lib: Library) -> tuple[Callable[..., Any], list[Any]]:
    return _splash(lib, True, "mha")


_SEQ_LENS = np.asarray([3, 64, 100, 17], np.int32)


def paged_attention(lib: Library) -> tuple[Callable[..., Any], list[Any]]:
    paged = lib("tpu.paged_attention")
    num_kv, per_seq, page, d = 2, 8, 16, 128
    total = len(_SEQ_LENS) * per_seq
    pages = [_normal(10, (num_kv, total, page, d)), _normal(11, (num_kv, total, page, d))]
    indices = jax.random.permutation(jax.random.key(12), total).astype(jnp.int32).reshape(
        -1, per_seq)
    q = _normal(13, (len(_SEQ_LENS), num_kv * 2, d))
    return (functools.partial(paged.paged_attention, pages_per_compute_block=4),
            [q, *pages, jnp.asarray(_SEQ_LENS), indices])


def ragged_paged_attention(lib: Library) -> tuple[Callable[..., Any], list[Any]]:
    ragged = lib("tpu.ragged_paged_attention")
    rows, heads, kv_heads, d, num_pages, page, max_seqs = 64, 4, 2, 128, 24, 16, 4
    q = _normal(14, (rows, heads, d))
    cache = _normal(15, (num_pages, page, 2 * kv_heads, d))
    kv_lens = jnp.asarray([40, 20, 16, 0], jnp.int32)
    table = jnp.asarray(np.arange(max_seqs * 3).reshape(max_seqs, 3) % num_pages, jnp.int32)
    cu_q = jnp.asarray([0, 12, 13, 29, 29], jnp.int32)
    num_seqs = jnp.asarray([3], jnp.int32)
    return (functools.partial(ragged.ragged_paged_attention, num_kv_pages_per_block=2,
                              num_queries_per_block=8),
            [q, cache, kv_lens, table, cu_q, num_seqs])


_GROUPS = jnp.asarray([10, 0, 30, 24], jnp.int32)


def megablox_gmm(lib: Library) -> tuple[Callable[..., Any], list[Any]]:
    gmm = lib("tpu.megablox.gmm")
    return (functools.partial(gmm.gmm, tiling=(16, 128, 128)),
            [_normal(16, (64, 128)), _normal(17, (4, 128, 256)), _GROUPS])


def megablox_tgmm(lib: Library) -> tuple[Callable[..., Any], list[Any]]:
    gmm = lib("tpu.megablox.gmm")
    return (functools.partial(gmm.tgmm, tiling=(16, 128, 128)),
            [_normal(16, (128, 64)), _normal(18, (64, 256)), _GROUPS])


def _all_gather(devices: int) -> Callable[[Library], Any]:
    def build(lib: Library) -> tuple[Callable[..., Any], list[Any]]:
        if jax.device_count() < devices:
            pytest.skip(f"needs {devices} devices: "
                        "XLA_FLAGS=--xla_force_host_platform_device_count=8")
        all_gather = lib("tpu.all_gather")
        mesh = jax.make_mesh((devices,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
                             devices=jax.devices()[:devices])
        x = jax.device_put(_normal(19, (devices * 16, 128)), NamedSharding(mesh, P("x")))
        return functools.partial(all_gather.all_gather, mesh=mesh, axis_name="x"), [x]
    return build


def threefry(lib: Library) -> tuple[Callable[..., Any], list[Any]]:
    impl = lib("tpu.random.threefry").plthreefry_prng_impl

    def f(seed: Any) -> Any:
        with jax.threefry_partitionable(True):
            return jax.random.bits(jax.random.key(seed, impl=impl), (16, 256))

    return f, [jnp.uint32(7)]


def philox(lib: Library) -> tuple[Callable[..., Any], list[Any]]:
    philox = lib("tpu.random.philox")
    return (functools.partial(philox.philox_4x32_count, shape=(16, 256), offset=5),
            [jnp.asarray([0x12345678, 0x9ABCDEF0], jnp.uint32)])


CASES: dict[str, Callable[[Library], tuple[Callable[..., Any], list[Any]]]] = {
    "example_kernel": example_kernel,
    "matmul": matmul,
    "flash_forward_causal": flash_forward_causal,
    "flash_forward_bias_segments": flash_forward_segments,
    "flash_backward_causal": _flash_backward(True, False),
    "flash_backward_segments": _flash_backward(False, True),
    "splash_forward": splash_forward,
    "splash_forward_mqa": splash_forward_mqa,
    "splash_backward": splash_backward,
    "paged_attention": paged_attention,
    "ragged_paged_attention": ragged_paged_attention,
    "megablox_gmm": megablox_gmm,
    "megablox_tgmm": megablox_tgmm,
    "all_gather_2": _all_gather(2),
    "all_gather_4": _all_gather(4),
    "threefry": threefry,
    "philox": philox,
}

GAPS: dict[str, str] = {
}
"""Kernels whose lowering stops on a rule this backend does not have yet: the error."""


def _params(name: str) -> Any:
    if name in GAPS:
        return pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=GAPS[name]))
    return name


def _lowered(name: str, lib: Library, device: tuple[str, str] | None = None) -> str:
    f, args = CASES[name](lib)  # arrays made outside the assumed device (JAX 0.12 runs no
    # eager computation under an abstract mesh)
    with _jax.assume_device(*device) if device else contextlib.nullcontext():
        return jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",)).as_text()


@pytest.mark.parametrize("name", [_params(n) for n in CASES])
def test_lowers_and_agrees_with_jax(name: str) -> None:
    ours = inspection.kernels(_lowered(name, _ours))  # decoded and verified
    if name.startswith("all_gather"):  # under shard_map: the mesh's devices are the chips
        theirs = inspection.kernels(_lowered(name, _theirs))
    else:
        theirs = inspection.kernels(_lowered(name, _theirs, ("TPU v5 lite", "tpu")))
    assert len(ours) == len(theirs) >= 1
    for (our_config, our_module), (their_config, their_module) in zip(ours, theirs):
        inspection.assert_same_config(our_config, their_config)
        inspection.assert_same_kernel(our_module, their_module)
