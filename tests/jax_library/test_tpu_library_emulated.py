"""JAX's TPU kernel library run through ``pl.emulate(..., backend="mosaic_tpu")``: every kernel
is lowered for the TPU and its ``tpu_custom_call`` executed by the Mosaic TPU emulator, then
compared with the library's reference on the inputs of ``test_tpu_library.py``.

Each case runs twice: on the library ported to this project (``porting.ported``, our lowering)
and on JAX's own modules (``jax.experimental.pallas.ops.tpu``, JAX's lowering of the same
kernel). The kernels are called as in ``test_tpu_library.py``, with ``interpret=True`` or
under the library's forced TPU interpret mode: ``pl.emulate`` must lower them for the hardware
all the same, and every case checks that the emulator ran at least one kernel.

Backward passes emulate ``jax.vjp`` of the kernel function (the library's custom VJP with its
backward kernels). The PRNG implementations are called directly (``plthreefry_random_bits``),
since ``jax.random.bits`` on a custom implementation hides the kernel from ``pl.emulate``
inside its ``random_bits`` primitive.
"""

from __future__ import annotations

import functools
import importlib
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as jax_pltpu
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pallas_core as pl
from tests.jax_library import porting
from tests.jax_library import test_tpu_library as cases

pltpu = pytest.importorskip("pallas_mosaic_tpu")
from pallas_mosaic_tpu import emulator  # noqa: E402

Library = cases.Library


def _theirs(name: str) -> Any:
    return importlib.import_module(f"jax.experimental.pallas.ops.{name}")


_LIBRARIES: dict[str, tuple[Library, Callable[[], Any]]] = {
    "ours": (porting.ported, pltpu.force_tpu_interpret_mode),
    # JAX's TPU lowering asks which chip it targets: pl.emulate tells it (a v5e by default).
    "jax": (_theirs, jax_pltpu.force_tpu_interpret_mode),
}


class Emulated:
    """Runs functions through ``pl.emulate`` under the library's forced interpret mode and
    counts the kernels the Mosaic TPU emulator executes."""

    def __init__(self, lib: Library, forced: Callable[..., Any]) -> None:
        self.lib, self.forced, self.kernels = lib, forced, 0

    def __call__(self, fn: Callable[..., Any], *args: Any, target: str | None = None) -> Any:
        before = self.kernels
        with self.forced():
            out = pl.emulate(fn, backend="mosaic_tpu", target=target)(*args)
        assert self.kernels > before, "pl.emulate ran no kernel in the TPU emulator"
        return out


@pytest.fixture(params=list(_LIBRARIES))
def run(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Emulated]:
    runner = Emulated(*_LIBRARIES[request.param])
    original = emulator.emulate

    def counting(call: Any) -> Any:
        out = original(call)
        runner.kernels += out is not None
        return out

    monkeypatch.setattr(emulator, "emulate", counting)
    yield runner


_close = cases._close


# --- example_kernel, matmul -------------------------------------------------------------------


def test_example_double(run: Emulated) -> None:
    x = jax.random.normal(jax.random.key(0), (16, 128))
    np.testing.assert_array_equal(run(run.lib("tpu.example_kernel").double, x), 2 * x)


@pytest.mark.parametrize(("dtype", "tol"), [(jnp.float32, 1e-4), (jnp.bfloat16, 2e-2)])
def test_matmul(run: Emulated, dtype: Any, tol: float) -> None:
    matmul = run.lib("tpu.matmul")
    k1, k2 = cases._keys(1, 2)
    x = jax.random.normal(k1, (256, 384), dtype)
    y = jax.random.normal(k2, (384, 256), dtype)
    out = run(functools.partial(matmul.matmul, block_shape=(128, 128), block_k=128), x, y)
    assert out.dtype == dtype
    _close(out / 20, jnp.dot(x, y, preferred_element_type=jnp.float32) / 20, tol)


# --- flash_attention --------------------------------------------------------------------------


@pytest.mark.parametrize("with_extras", [False, True], ids=["plain", "bias+segments"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flash_attention_forward(run: Emulated, causal: bool, with_extras: bool) -> None:
    flash = run.lib("tpu.flash_attention")
    q, k, v, ab, seg = cases._flash_inputs(with_extras, run.lib)
    kernel = functools.partial(flash.flash_attention, causal=causal, sm_scale=0.125,
                               block_sizes=cases._flash_blocks(run.lib))
    out = run(lambda *a: kernel(*a, seg), q, k, v, ab)
    _close(out, flash.mha_reference(q, k, v, ab, seg, causal=causal, sm_scale=0.125), 2e-4)


@pytest.mark.parametrize(("causal", "with_extras"), [(False, False), (True, True)],
                         ids=["full-plain", "causal-bias+segments"])
def test_flash_attention_backward(run: Emulated, causal: bool, with_extras: bool) -> None:
    flash = run.lib("tpu.flash_attention")
    q, k, v, ab, seg = cases._flash_inputs(with_extras, run.lib)
    dout = jax.random.normal(jax.random.key(3), q.shape)
    kw = {"causal": causal, "sm_scale": 0.125}

    def kernel(*a: Any) -> Any:
        return flash.flash_attention(*a, seg, block_sizes=cases._flash_blocks(run.lib), **kw)

    grads = run(lambda *a: jax.vjp(kernel, *a)[1](dout), q, k, v, ab)
    _, ref_vjp = jax.vjp(lambda *a: flash.mha_reference_no_custom_vjp(*a, seg, **kw), q, k, v, ab)
    for got, want in zip(grads, ref_vjp(dout)):
        if want is not None:
            _close(got, want, 2e-3)


# --- all_gather -------------------------------------------------------------------------------


_GATHER_MESHES = {"x2": ((2,), ("x",)), "x8": ((8,), ("x",)), "y2x4": ((2, 4), ("y", "x"))}


@pytest.mark.parametrize("memory", ["vmem", "any"])
@pytest.mark.parametrize("mesh_name", sorted(_GATHER_MESHES))
def test_all_gather(run: Emulated, mesh_name: str, memory: str) -> None:
    """The ring all-gather: every device of the shard_map runs the kernel, which sends its
    shard round the ring with remote DMAs after a barrier handshake with its neighbours."""
    all_gather = run.lib("tpu.all_gather")
    shape, axes = _GATHER_MESHES[mesh_name]
    n = int(np.prod(shape))
    if jax.device_count() < n:
        pytest.skip(f"needs {n} devices: XLA_FLAGS=--xla_force_host_platform_device_count=8")
    mesh = jax.make_mesh(shape, axes, axis_types=(jax.sharding.AxisType.Auto,) * len(axes),
                         devices=jax.devices()[:n])
    x = jax.device_put(jax.random.normal(jax.random.key(4), (16 * shape[-1], 128)),
                       NamedSharding(mesh, P("x")))
    space = {"vmem": all_gather.pltpu.VMEM, "any": all_gather.pl.ANY}[memory]
    out = run(functools.partial(all_gather.all_gather, mesh=mesh, axis_name="x",
                                memory_space=space), x)
    np.testing.assert_array_equal(out, x)


# --- random: threefry, philox -----------------------------------------------------------------


@pytest.mark.parametrize("shape", [(256, 256), (137, 275), (2, 256, 256), (34,)])
def test_threefry_matches_jax_random(run: Emulated, shape: tuple[int, ...]) -> None:
    """The implementation's random_bits (one kernel per call) against jax.random's
    partitionable threefry on the same key data."""
    threefry = run.lib("tpu.random.threefry")
    key = jax.random.key(11, impl="threefry2x32")
    with jax.threefry_partitionable(True):
        expected = jax.random.bits(key, shape)
        got = run(lambda k: threefry.plthreefry_random_bits(k, 32, shape),
                  jax.random.key_data(key))
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize(("shape", "offset"), [((256, 512), 0), ((37, 300), 5), ((3,), 0)])
def test_philox_counts(run: Emulated, shape: tuple[int, ...], offset: int) -> None:
    """Element ``n`` (row-major) is Philox of counter ``(0, n + offset, 0, 0)``, checked on a
    numpy Philox4x32-10 (itself checked on Random123's vectors in test_tpu_library.py)."""
    philox = run.lib("tpu.random.philox")
    key = [0x12345678, 0x9ABCDEF0]

    def both(k: Any) -> Any:
        return (philox.philox_4x32_count(k, shape, offset=offset),
                philox.philox_4x32_count(k, shape, offset=offset, fuse_output=False))

    fused, halves = run(both, jnp.array(key, jnp.uint32))
    count = np.arange(int(np.prod(shape)), dtype=np.uint64).reshape(shape) + np.uint64(offset)
    zero = np.zeros_like(count)
    c = cases._philox4x32_10([zero, count, zero, zero], [np.uint64(x) for x in key])
    np.testing.assert_array_equal(fused, (c[0] ^ c[1]).astype(np.uint32))
    np.testing.assert_array_equal(halves, np.stack([c[0], c[1]]).astype(np.uint32))


# --- paged_attention --------------------------------------------------------------------------


def _check_paged(run: Emulated, num_kv: int, ratio: int, dtype: Any, quantized: bool,
                 target: str | None = None, **kw: Any) -> None:
    paged = run.lib("tpu.paged_attention")
    util = run.lib("tpu.paged_attention.util")
    q, k_pages, v_pages, indices = cases._paged_inputs(num_kv, num_kv * ratio, dtype,
                                                       quantized, run.lib)
    lens = jnp.asarray(cases._SEQ_LENS)
    out = run(lambda *a: paged.paged_attention(*a, pages_per_compute_block=4, **kw),
              q, k_pages, v_pages, lens, indices, target=target)
    expected = util.grouped_query_attention_reference(
        q.astype(jnp.float32), cases._gather_pages(k_pages, indices, run.lib),
        cases._gather_pages(v_pages, indices, run.lib), lens, kw.get("attn_logits_soft_cap"))
    nonempty = cases._SEQ_LENS > 0
    _close(out[nonempty], expected[nonempty], 2e-2 if dtype == jnp.bfloat16 else 1e-3)


@pytest.mark.parametrize(("num_kv", "ratio", "dtype", "quantized", "kw"), [
    (1, 1, jnp.float32, False, {}),
    (2, 4, jnp.float32, False, {"inline_seq_dim": False, "attn_logits_soft_cap": 1.0}),
    (2, 8, jnp.bfloat16, False, {}),
    (2, 1, jnp.float32, True, {"inline_seq_dim": False}),
], ids=["mha", "gqa-grid-softcap", "gqa8-bf16", "int8-grid"])
def test_paged_attention(run: Emulated, num_kv: int, ratio: int, dtype: Any, quantized: bool,
                         kw: dict[str, Any]) -> None:
    _check_paged(run, num_kv, ratio, dtype, quantized, **kw)


@pytest.mark.parametrize("megacore_mode", ["batch", "kv_head"])
def test_paged_attention_megacore(run: Emulated, megacore_mode: str) -> None:
    """On a v5p the grid's leading parallel axis is shared by the chip's two TensorCores."""
    _check_paged(run, 2, 2, jnp.float32, False, target="v5p", megacore_mode=megacore_mode,
                 inline_seq_dim=False)


def test_paged_attention_megacore_on_one_core_would_hang(run: Emulated) -> None:
    """On a one-core v5e the second half of a megacore grid waits for a prefetch that the
    first half's last step never started: the emulator says the kernel would hang."""
    with pytest.raises(pl.PallasError, match="would hang"):
        _check_paged(run, 2, 2, jnp.float32, False, target="v5e", megacore_mode="kv_head",
                     inline_seq_dim=False)


# --- ragged_paged_attention -------------------------------------------------------------------


@pytest.mark.parametrize(("seq_lens", "heads", "kw"), [
    ([(12, 40), (1, 20), (16, 16)], (8, 2), {}),
    ([(5, 33), (20, 50)], (4, 4), {"sliding_window": 8}),
    ([(1, 7), (1, 60), (3, 3)], (4, 2), {"soft_cap": 50.0, "k_scale": 0.5, "v_scale": 0.8}),
], ids=["mixed", "sliding-window", "decode-softcap-kv-scales"])
def test_ragged_paged_attention(run: Emulated, seq_lens: list[tuple[int, int]],
                                heads: tuple[int, int], kw: dict[str, Any]) -> None:
    ragged = run.lib("tpu.ragged_paged_attention")
    args = cases._ragged_inputs(seq_lens, heads)
    out = run(lambda *a: ragged.ragged_paged_attention(
        *a, num_kv_pages_per_block=2, num_queries_per_block=8, **kw), *args)
    expected = ragged.ref_ragged_paged_attention(*args, **kw)
    rows = sum(q for q, _ in seq_lens)
    _close(out[:rows], expected[:rows], 1e-4)


# --- megablox ---------------------------------------------------------------------------------


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_megablox_gmm(run: Emulated, transpose_rhs: bool) -> None:
    gmm = run.lib("tpu.megablox.gmm")
    lhs, rhs, sizes, _ = cases._gmm_inputs()
    out = run(lambda a, b, s: gmm.gmm(a, b, s, tiling=(16, 128, 128),
                                      transpose_rhs=transpose_rhs, interpret=True),
              lhs, rhs.swapaxes(1, 2) if transpose_rhs else rhs, sizes)
    _close(out, cases._reference_gmm(lhs, rhs, cases._GROUP_SIZES), 1e-4)


def test_megablox_tgmm(run: Emulated) -> None:
    gmm = run.lib("tpu.megablox.gmm")
    lhs, _, sizes, dy = cases._gmm_inputs()
    out = run(lambda a, b, s: gmm.tgmm(a, b, s, tiling=(16, 128, 128), interpret=True),
              lhs.T, dy, sizes)
    ends = np.cumsum([0, *cases._GROUP_SIZES])
    expected = jnp.stack([lhs[a:b].T @ dy[a:b] for a, b in itertools.pairwise(ends)])
    _close(out, expected, 1e-4)


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_megablox_gmm_backward(run: Emulated, transpose_rhs: bool) -> None:
    """ops.gmm's custom VJP: a gmm for the lhs gradient, a tgmm for the rhs one."""
    ops = run.lib("tpu.megablox.ops")
    lhs, rhs, sizes, dy = cases._gmm_inputs()
    rhs_in = rhs.swapaxes(1, 2) if transpose_rhs else rhs
    gmm = functools.partial(ops.gmm, preferred_element_type=jnp.float32, tiling=(16, 128, 128),
                            transpose_rhs=transpose_rhs, interpret=True)

    def forward_and_grads(a: Any, b: Any, s: Any) -> Any:
        out, vjp = jax.vjp(lambda a, b: gmm(a, b, s), a, b)
        return out, vjp(dy)

    out, grads = run(forward_and_grads, lhs, rhs_in, sizes)

    def reference(a: Any, b: Any) -> jax.Array:
        return cases._reference_gmm(a, b.swapaxes(1, 2) if transpose_rhs else b,
                                    cases._GROUP_SIZES)

    expected, ref_vjp = jax.vjp(reference, lhs, rhs_in)
    _close(out, expected, 1e-4)
    for got, want in zip(grads, ref_vjp(dy)):
        _close(got, want, 1e-4)


# --- splash_attention -------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["mha", "gqa", "mqa"])
@pytest.mark.parametrize("kind", ["causal", "local", "full"])
def test_splash_attention_forward(run: Emulated, kind: str, form: str) -> None:
    kernel, reference, args = cases._splash_call(kind, form, run.lib)
    _close(run(kernel, *args), reference(*args), 1e-5)


@pytest.mark.parametrize(("kind", "form"), [("causal", "mha"), ("local", "gqa"),
                                             ("full", "mqa")])
def test_splash_attention_backward(run: Emulated, kind: str, form: str) -> None:
    kernel, reference, args = cases._splash_call(kind, form, run.lib)
    dout = jax.random.uniform(jax.random.key(9), args[0].shape)
    grads = run(lambda *a: jax.vjp(kernel, *a)[1](dout), *args)
    for got, want in zip(grads, jax.vjp(reference, *args)[1](dout)):
        _close(got, want, 1e-4)


def test_splash_attention_segments_softcap_and_residuals(run: Emulated) -> None:
    splash = run.lib("tpu.splash_attention.splash_attention_kernel")
    kernel, reference, args = cases._splash_call("causal", "gqa", run.lib, save_residuals=True,
                                                 attn_logits_soft_cap=20.0)
    ids = (jnp.arange(cases._SPLASH_SEQ) >= 100).astype(jnp.int32)
    segments = splash.SegmentIds(q=ids, kv=ids)
    out, (lse,) = run(lambda *a: kernel(*a, segments), *args)
    expected, (expected_lse,) = reference(*args, segments, save_residuals=True,
                                          attn_logits_soft_cap=20.0)
    _close(out, expected, 1e-5)
    _close(lse, expected_lse, 1e-5)


def test_splash_attention_fused_backward(run: Emulated) -> None:
    splash = run.lib("tpu.splash_attention.splash_attention_kernel")
    blocks = splash.BlockSizes(block_q=128, block_kv=128, block_kv_compute=128,
                               block_q_dkv=128, block_kv_dkv=128, block_kv_dkv_compute=128,
                               use_fused_bwd_kernel=True)
    kernel, reference, args = cases._splash_call("local", "mha", run.lib, block_sizes=blocks)
    dout = jax.random.uniform(jax.random.key(10), args[0].shape)
    grads = run(lambda *a: jax.vjp(kernel, *a)[1](dout), *args)
    for got, want in zip(grads, jax.vjp(reference, *args)[1](dout)):
        _close(got, want, 1e-4)

