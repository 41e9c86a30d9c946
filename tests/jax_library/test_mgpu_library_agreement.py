"""The Mosaic GPU backend against JAX's own Mosaic GPU lowering, without a GPU.

No emulator runs a Mosaic GPU module here (docs/backends/mosaic_gpu.md, "Emulation"). Instead,
the same kernel is lowered for ``cuda`` twice, by ``jax.experimental.pallas`` (its
``mosaic_gpu`` backend) and by this project (``pallas_core`` with ``pallas_mosaic_gpu``), and
``pallas_mosaic_gpu.inspection`` compares what a GPU runtime acts on: the ``mosaic_gpu_v2``
call's config, operand and result types and layouts, and the module's ``gpu.launch`` (grid,
cluster, threads per block, dynamic shared memory) and target architecture.

* JAX's Hopper kernel library (``hopper_matmul_mgpu``, ``ragged_dot_mgpu``,
  ``attention_mgpu``, ``hopper_mixed_type_matmul_mgpu``, ``transposed_ragged_dot_mgpu``):
  JAX's lowering is checked against the launch its parameters imply. The ported modules
  (``porting.ported``) are lowered too and compared with it: hopper_matmul's port (a
  warp-specialised pipeline) lowers exactly like JAX's, ragged_dot's and attention_mgpu's
  (plain and causal, and its gradient's kernels) with pinned, explained differences, the
  mixed-type matmul's (int8 blocks tiled as its transforms ask) exactly; they
  run in the interpreter against ``jnp.dot`` / ``lax.ragged_dot`` / attention_mgpu's own
  ``attention_reference`` (and its gradient). A port that does not lower (issue 17) would
  be a strict xfail naming what it lacks (``PORT_GAPS``, empty now).
* This plugin's own kernels (``pallas_mosaic_gpu.hopper_kernels``), written again with JAX's
  ``plgpu``: the differences that remain are design choices, pinned exactly below.
* Blackwell (sm_100a): JAX's blackwell_matmul and blackwell_ragged_dot as JAX lowers them on
  CPU (what they need, which architecture the module says), this plugin's Blackwell matmul
  against the same kernel written with JAX's ``plgpu`` (identical), and the port of
  blackwell_matmul (cluster launch control, a TMA warp and an MMA warp) lowering like JAX's
  with one pinned difference and running in the interpreter; its collective form (2-CTA,
  clusters of 2 blocks) lowering like JAX's, the collective instructions counted alike.
"""

from __future__ import annotations

import functools
import itertools
import types
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as jpl

import pallas_core as pl
from pallas_core.call import force_interpret_mode
from pallas_core.stages import kernel_calls
from tests.jax_library import porting

plgpu = pytest.importorskip("pallas_mosaic_gpu")  # the mosaic_gpu environment runs this file
from jax.experimental.pallas import mosaic_gpu as jgpu  # noqa: E402 - needs absl, as plgpu does
from pallas_mosaic_gpu import hopper_kernels as K  # noqa: E402, N812
from pallas_mosaic_gpu import inspection  # noqa: E402

from pallas_core import _jax  # noqa: E402

_AT_012 = _jax.JAX_VERSION[:2] >= (0, 12)
# Known gaps at JAX 0.12 (issue 28 goes on), each with its reason:
_NO_JAX_PALLAS_CALL = pytest.mark.skipif(
    _jax.JAX_VERSION[:2] >= (0, 11),
    reason="JAX 0.11 and 0.12 lower Mosaic GPU kernels only through plgpu.kernel (mpmd_map): "
    "their pallas_call has no Mosaic GPU rule (0.11.2's GPU lowering asserts that it finds "
    "one), so there is no JAX lowering to compare with")
# The ports of the big kernels take minutes each in the interpreter (XLA compiles the whole
# warp-specialised program on the host): `tox -e slow` runs them, not the README's test command.
_SLOW = pytest.mark.slow


S = jax.ShapeDtypeStruct
F16, F32 = jnp.float16, jnp.float32
NUM_SMS = 4  # hopper_matmul asks the device for its SM count; there is no device here


def _lower(fn: Any, *args: Any) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _one_kernel(text: str) -> tuple[dict[str, Any], Any]:
    (found,) = inspection.kernels(text)  # hash checked, module parsed back and verified
    return found


# --- JAX's Mosaic GPU kernel library ---------------------------------------------------------

LIBRARY = ("hopper_matmul_mgpu", "ragged_dot_mgpu", "attention_mgpu", "attention_mgpu_causal",
           "hopper_mixed_type_matmul_mgpu", "transposed_ragged_dot_mgpu")
CUDA_VERSION = 12091
"""The CUDA runtime version attention_mgpu is told (it refuses causal masking from 12.8.0 to
12.9.0, for a ptxas miscompilation)."""


def _library(name: str, ours: bool) -> types.ModuleType:
    name = name.removesuffix("_causal")  # a case of the same module
    if ours:
        module = porting.ported(f"gpu.{name}")
        assert module.plgpu is plgpu and module.pl is pl, "the port still runs JAX's Pallas"
    else:
        module = __import__(f"jax.experimental.pallas.ops.gpu.{name}", fromlist=["_"])
    return module


class _JaxWithDevices(types.ModuleType):
    """``jax`` as transposed_ragged_dot sees it: ``jax.devices()`` answers with a GPU's SM
    count (``core_count``), which a CPU device lacks."""

    def __getattr__(self, name: str) -> Any:
        return getattr(jax, name)

    def devices(self, *_: Any) -> list[Any]:
        return [types.SimpleNamespace(core_count=NUM_SMS)]


@pytest.fixture(autouse=True)
def _no_device_queries(monkeypatch: pytest.MonkeyPatch) -> None:
    """The library asks the runtime for facts a CPU machine lacks: the SM count
    (hopper_matmul's persistent grid, through ``get_num_sms``; the mixed-type matmul's and
    transposed_ragged_dot's, through the default device's ``core_count``) and the CUDA
    runtime version (attention refuses causal masking on some versions). Both modules, JAX's
    and the port, get fixed answers."""
    device = types.SimpleNamespace(core_count=NUM_SMS)
    for ours in (False, True):
        try:
            monkeypatch.setattr(_library("hopper_matmul_mgpu", ours), "get_num_sms",
                                lambda: NUM_SMS)
            monkeypatch.setattr(_library("attention_mgpu", ours), "cuda_versions",
                                types.SimpleNamespace(cuda_runtime_get_version=lambda:
                                                      CUDA_VERSION))
            monkeypatch.setattr(_library("hopper_mixed_type_matmul_mgpu", ours), "backend",
                                types.SimpleNamespace(get_default_device=lambda: device))
            monkeypatch.setattr(_library("transposed_ragged_dot_mgpu", ours), "jax",
                                _JaxWithDevices("jax"))
        except AttributeError:
            pass  # a port that does not import yet fails in its own test


def _library_case(name: str, lib: types.ModuleType) -> tuple[Any, tuple[S, ...]]:
    if name == "hopper_matmul_mgpu":
        config = lib.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=2)
        return (lambda a, b: lib.matmul(a, b, None, config)), (S((256, 256), F16),) * 2
    if name == "ragged_dot_mgpu":
        return (functools.partial(lib.ragged_dot, block_m=64, block_n=64, block_k=64,
                                  max_concurrent_steps=2, grid_block_n=1),
                (S((256, 128), F16), S((4, 128, 128), F16), S((4,), jnp.int32)))
    if name == "hopper_mixed_type_matmul_mgpu":
        mixed = lib.TuningConfig(tile_m=64, tile_n=128, tile_k=128, max_concurrent_steps=2)
        return (lambda a, b: lib.mixed_matmul_kernel(a, b, out_dtype=F16, config=mixed),
                (S((256, 256), jnp.int8), S((256, 256), F16)))
    if name == "transposed_ragged_dot_mgpu":
        return (functools.partial(lib.transposed_ragged_dot, block_m=64, block_n=64,
                                  block_k=64, max_concurrent_steps=2, grid_block_n=1),
                (S((256, 128), F16), S((256, 128), F16), S((4,), jnp.int32)))
    config = lib.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=2,
                              causal=name.endswith("_causal"))
    return (lambda q, k, v: lib.attention(q, k, v, config)), (S((1, 256, 2, 64), F16),) * 3


def _lower_library(name: str, ours: bool) -> str:
    fn, args = _library_case(name, _library(name, ours))
    if name in ("ragged_dot_mgpu", "transposed_ragged_dot_mgpu"):  # group sizes: keyword
        return _lower(lambda lhs, rhs, g: fn(lhs, rhs, group_sizes=g), *args)
    return _lower(fn, *args)


# What JAX's lowering launches, from the kernels' parameters: hopper_matmul is persistent (one
# block per SM, 3 warpgroups: two compute, one memory); ragged_dot runs on every SM (its
# nd_loop's collective axis "sm", 132 when no device says otherwise) with one warpgroup;
# attention has a block per (head, q tile, batch) = (2, 256 // (2 * 64), 1), given to CUDA
# reversed (x is the minor axis), with 3 warpgroups.
LIBRARY_LAUNCH = {
    "hopper_matmul_mgpu": dict(grid=(NUM_SMS, 1, 1), cluster=(1, 1, 1), block=(384, 1, 1)),
    "ragged_dot_mgpu": dict(grid=(132, 1, 1), cluster=(1, 1, 1), block=(128, 1, 1)),
    "attention_mgpu": dict(grid=(1, 2, 2), cluster=(1, 1, 1), block=(384, 1, 1)),
    "attention_mgpu_causal": dict(grid=(1, 2, 2), cluster=(1, 1, 1), block=(384, 1, 1)),
    # Persistent like hopper_matmul (3 warpgroups); transposed_ragged_dot's nd_loop runs on
    # every SM with one warpgroup.
    "hopper_mixed_type_matmul_mgpu": dict(grid=(NUM_SMS, 1, 1), cluster=(1, 1, 1),
                                          block=(384, 1, 1)),
    "transposed_ragged_dot_mgpu": dict(grid=(NUM_SMS, 1, 1), cluster=(1, 1, 1),
                                       block=(128, 1, 1)),
}

# Why this project's port of a kernel does not lower yet (issue 17): what it lacks (plgpu
# refuses the names it does not have with pl.UnsupportedError naming them). Every port of
# the Hopper library lowers now.
PORT_GAPS: dict[str, str] = {}

# The ports that lower: the fields in which they differ from JAX's lowering, as (ours, JAX's),
# and why.
PORT_DIFFERENCES: dict[str, dict[str, tuple[Any, Any]]] = {
    # The warp-specialised pipeline's buffers and barriers, the epilogue's buffer and the
    # launch are JAX's, buffer for buffer (test_hopper_matmul_port_shares_jax_smem_plan).
    "hopper_matmul_mgpu": {},
    # Its int8 blocks tiled (8, 128) and swizzled by 128 bytes, as its transforms ask, beside
    # the f16 blocks and output buffers: the warp-specialised pipeline's plan is JAX's.
    "hopper_mixed_type_matmul_mgpu": {},
    # Shared memory: the pipeline's two inputs x 2 slots of (64, 64) f16 (32768 bytes), then
    # the (64, 64) f16 output buffer of the store's pl.run_scoped (8192), then barriers. JAX
    # reuses the pipeline's region for the output buffer once the pipeline's scope has ended
    # (32768 + 16); here every pl.run_scoped has a region of its own (32768 + 8192 + 32).
    # JAX uses one mbarrier per pipeline slot (2 x 8 bytes); this backend one per input and
    # slot (4 x 8).
    "ragged_dot_mgpu": {"smem_bytes": (32768 + 8192 + 4 * 8, 32768 + 2 * 8)},
    # The grid (heads, q tiles, batch) = (2, 2, 1): this backend gives CUDA a plgpu.kernel's
    # grid in order (x = the first axis), JAX reversed (x = the last); both launch the same
    # blocks. Shared memory: Q/O (2 warpgroups), K and V (2 slots) of (64, 64) f16, tiled,
    # 3 x 16384 bytes, then 11 mbarriers (88 bytes) in both; JAX reserves 2048 bytes more for
    # the reductions it may lower through SMEM (it asks that much of every kernel holding a
    # reduction); the row maxima and sums of the wgmma layout here are shuffles in registers.
    "attention_mgpu": {"grid": ((2, 2, 1), (1, 2, 2)),
                       "smem_bytes": (3 * 16384 + 88, 3 * 16384 + 2048 + 88)},
    "attention_mgpu_causal": {"grid": ((2, 2, 1), (1, 2, 2)),
                              "smem_bytes": (3 * 16384 + 88, 3 * 16384 + 2048 + 88)},
    # The same plan as ragged_dot's: its pipeline (a grid read from GMEM at run time) has 2
    # inputs x 2 slots of (64, 64) f16, then the output buffer of its own run_scoped.
    "transposed_ragged_dot_mgpu": {"smem_bytes": (32768 + 8192 + 4 * 8, 32768 + 2 * 8)},
}


@pytest.mark.parametrize("name", LIBRARY)
def test_jax_lowers_its_library_kernel(name: str) -> None:
    config, module = _one_kernel(_lower_library(name, ours=False))
    got = inspection.launch(module)
    assert {k: got[k] for k in LIBRARY_LAUNCH[name]} == LIBRARY_LAUNCH[name]
    assert got["arch"] == (9, 0) and got["smem_bytes"] > 0
    assert config["use_custom_barrier"] is False
    assert config["uses_xla_collective_metadata"] is False
    assert all(off % 1024 == 0 for off, ty in inspection.smem_buffers(module)
               if "xi64," not in ty)


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.xfail(strict=True, raises=pl.PallasError,
                                            reason=PORT_GAPS[n])) if n in PORT_GAPS else n
    for n in LIBRARY])
def test_port_lowers_like_jax(name: str) -> None:
    ours = _one_kernel(_lower_library(name, ours=True))
    theirs = _one_kernel(_lower_library(name, ours=False))
    inspection.assert_same_kernel(ours, theirs, PORT_DIFFERENCES[name])
    # TMA and wgmma need 1024-byte aligned buffers.
    assert all(off % 1024 == 0 for off, ty in inspection.smem_buffers(ours[1])
               if "xi64," not in ty)


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_ragged_dot_port_runs_in_the_interpreter(transpose_rhs: bool) -> None:
    """The port's meaning: JAX's ragged_dot kernel, unchanged but for its imports, run by
    this project's interpreter (pl.kernel under force_interpret_mode) on random inputs with
    uneven groups (one empty, one spanning blocks), against ``lax.ragged_dot``."""
    lib = _library("ragged_dot_mgpu", ours=True)
    m, k, n = 256, 128, 128
    sizes = jnp.array([50, 0, 130, 76], jnp.int32)
    keys = jax.random.split(jax.random.key(7))
    lhs = jax.random.normal(keys[0], (m, k), F32).astype(F16)
    rhs = jax.random.normal(keys[1], (4, k, n), F32).astype(F16)
    fn = functools.partial(lib.ragged_dot, group_sizes=sizes, block_m=64, block_n=64,
                           block_k=64, max_concurrent_steps=2, grid_block_n=1,
                           transpose_rhs=transpose_rhs)
    operand = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
    with force_interpret_mode():
        calls = list(kernel_calls(jax.make_jaxpr(fn)(lhs, operand).jaxpr))
        got = fn(lhs, operand)
    assert [c.backend for c in calls] == ["interpret"]
    expected = lax.ragged_dot(lhs.astype(F32), rhs.astype(F32), group_sizes=sizes)
    np.testing.assert_allclose(got.astype(F32), expected, rtol=2e-2, atol=5e-2)
    # The same port, with B read transposed from SMEM (transpose_ref), lowers for cuda too.
    _one_kernel(_lower(fn, lhs, operand))


@_SLOW
@pytest.mark.parametrize("wg_dimension", ["N", "M"])
@pytest.mark.parametrize("with_c", [False, True])
def test_hopper_matmul_port_runs_in_the_interpreter(wg_dimension: str, with_c: bool) -> None:
    """The warp-specialised matmul's meaning: JAX's hopper_matmul, unchanged but for its
    imports, run by this project's interpreter (each compute warpgroup fetching its own
    blocks, see pallas_mosaic_gpu.warp_specialized) on random inputs against ``jnp.dot``,
    with the warpgroups splitting N or M, three pipeline slots over 8 K steps, a snaking
    persistent grid, and the optional ``c`` accumulated in the epilogue. The same
    configuration lowers for cuda exactly as JAX's own lowering of the kernel does."""
    ours, theirs = (_library("hopper_matmul_mgpu", o) for o in (True, False))

    def config(lib: types.ModuleType) -> Any:
        dim = lib.MatmulDimension[wg_dimension]
        return lib.TuningConfig(tile_m=64, tile_n=128, tile_k=64, max_concurrent_steps=3,
                                wg_dimension=dim, grid_minor_dim=lib.MatmulDimension.M,
                                grid_tile_width=2)

    keys = jax.random.split(jax.random.key(11), 3)
    a = jax.random.normal(keys[0], (256, 512), F32).astype(F16)
    b = jax.random.normal(keys[1], (512, 512), F32).astype(F16)
    c = jax.random.normal(keys[2], (256, 512), F32).astype(F16) if with_c else None
    fn = functools.partial(ours.matmul, config=config(ours))
    with force_interpret_mode():
        calls = list(kernel_calls(jax.make_jaxpr(fn)(a, b, c).jaxpr))
        got = fn(a, b, c)
    assert [k.backend for k in calls] == ["interpret"]
    expected = jnp.dot(a.astype(F32), b.astype(F32)) + (0 if c is None else c.astype(F32))
    np.testing.assert_allclose(got.astype(F32), expected, rtol=2e-2, atol=0.1)
    inspection.assert_same_kernel(
        _one_kernel(_lower(fn, a, b, c)),
        _one_kernel(_lower(functools.partial(theirs.matmul, config=config(theirs)), a, b, c)))


@_SLOW
@pytest.mark.parametrize("wg_dimension", ["N", "M"])
def test_mixed_type_matmul_port_runs_in_the_interpreter(wg_dimension: str) -> None:
    """JAX's hopper_mixed_type_matmul (int8 A blocks tiled (8, 128) in SMEM, read into
    registers and converted to float16 for a wgmma against the float16 B blocks), unchanged
    but for its imports, run by the interpreter on random int8 / float16 inputs against
    ``jnp.dot(a.astype(f16), b)``, with the warpgroups splitting N or M; the same
    configuration lowers for cuda exactly as JAX's own lowering of it does."""
    ours, theirs = (_library("hopper_mixed_type_matmul_mgpu", o) for o in (True, False))

    def fn(lib: types.ModuleType) -> Any:
        dim = lib.MatmulDimension[wg_dimension]
        config = lib.TuningConfig(tile_m=64, tile_n=128, tile_k=128, max_concurrent_steps=2,
                                  wg_dimension=dim, grid_minor_dim=lib.MatmulDimension.M,
                                  grid_tile_width=2)
        return functools.partial(lib.mixed_matmul_kernel, out_dtype=F16, config=config)

    keys = jax.random.split(jax.random.key(14))
    a = jax.random.randint(keys[0], (256, 512), -128, 128, jnp.int32).astype(jnp.int8)
    b = (jax.random.normal(keys[1], (512, 512), F32) / 32).astype(F16)
    with force_interpret_mode():
        calls = list(kernel_calls(jax.make_jaxpr(fn(ours))(a, b).jaxpr))
        got = fn(ours)(a, b)
    assert [c.backend for c in calls] == ["interpret"]
    expected = jnp.dot(a.astype(F16), b, preferred_element_type=F32)
    np.testing.assert_allclose(got.astype(F32), expected, rtol=2e-2, atol=0.1)
    inspection.assert_same_kernel(_one_kernel(_lower(fn(ours), a, b)),
                                  _one_kernel(_lower(fn(theirs), a, b)))


@pytest.mark.parametrize("block_q,block_kv,steps,head_dim,heads,causal,residuals", [
    (64, 128, 2, 128, 4, False, False), (64, 64, 3, 64, 2, True, False),
    (128, 64, 2, 64, 2, False, True), (64, 64, 2, 256, 2, False, False)])
def test_attention_port_configs_lower_like_jax(block_q: int, block_kv: int, steps: int,
                                               head_dim: int, heads: int, causal: bool,
                                               residuals: bool) -> None:
    """Other tilings of the attention port (wider K/V blocks and heads, three slots, causal,
    the log-sum-exp residuals written by a second TMA store) lower like JAX's but for the
    differences pinned for the test case: the grid's order and JAX's 2 KiB reduction
    scratch."""
    def lower(lib: types.ModuleType) -> tuple[dict[str, Any], Any]:
        config = lib.TuningConfig(block_q=block_q, block_kv=block_kv,
                                  max_concurrent_steps=steps, causal=causal)
        fn = functools.partial(lib._attention_forward, config=config,
                               save_residuals=residuals)
        return _one_kernel(_lower(fn, *(S((2, 512, heads, head_dim), F16),) * 3))

    ours, theirs = (lower(_library("attention_mgpu", o)) for o in (True, False))
    grid = (heads, 512 // (2 * block_q), 2)
    smem = inspection.launch(ours[1])["smem_bytes"]
    different = {"smem_bytes": (smem, smem + 2048)}
    if grid != grid[::-1]:
        different["grid"] = (grid, grid[::-1])
    inspection.assert_same_kernel(ours, theirs, different)


def _lower_attention_grad(ours: bool) -> list[tuple[dict[str, Any], Any]]:
    """The kernels of attention_mgpu's gradient: the forward kernel saving the log-sum-exp,
    then the backward's dQ and dK/dV kernels (warp-specialised pipelines)."""
    lib = _library("attention_mgpu", ours)
    config = lib.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=2, block_q_dkv=64,
                              block_kv_dkv=64, block_q_dq=64, block_kv_dq=64)
    grad = jax.grad(lambda q, k, v: lib.attention(q, k, v, config).astype(F32).sum(),
                    argnums=(0, 1, 2))
    return inspection.kernels(_lower(grad, *(S((1, 256, 2, 64), F16),) * 3))


def test_jax_lowers_the_attention_backward() -> None:
    """Forward (3 warpgroups, a block per (head, pair of q tiles, batch)), then dQ (per q tile)
    and dK/dV (per kv tile), each one compute warpgroup and one memory warpgroup."""
    launches = [inspection.launch(module) for _, module in _lower_attention_grad(False)]
    assert [(x["grid"], x["block"]) for x in launches] == [
        ((1, 2, 2), (384, 1, 1)), ((1, 4, 2), (256, 1, 1)), ((1, 4, 2), (256, 1, 1))]


# The gradient's kernels against JAX's, as (ours, JAX's): each grid in order here, reversed in
# JAX (see PORT_DIFFERENCES). Shared memory: the forward kernel saving the log-sum-exp has the
# forward's plan plus its (2, 64) float32 buffer (512 bytes, which JAX rounds up to 1024) and
# JAX's 2048 bytes of reduction scratch; the dQ kernel's plan is JAX's, buffer for buffer; the
# dK/dV kernel's too, but for its last buffer (delta, (2, 64) float32) that JAX rounds up.
BACKWARD_DIFFERENCES: list[dict[str, tuple[Any, Any]]] = [
    {"grid": ((2, 2, 1), (1, 2, 2)),
     "smem_bytes": (3 * 16384 + 512 + 88, 3 * 16384 + 1024 + 2048 + 88)},
    {"grid": ((2, 4, 1), (1, 4, 2))},
    {"grid": ((2, 4, 1), (1, 4, 2)), "smem_bytes": (50688 + 96, 50688 + 512 + 96)},
]


def test_attention_backward_port_lowers_like_jax() -> None:
    ours, theirs = _lower_attention_grad(True), _lower_attention_grad(False)
    assert len(ours) == len(theirs) == 3
    for mine, jax_kernel, different in zip(ours, theirs, BACKWARD_DIFFERENCES):
        inspection.assert_same_kernel(mine, jax_kernel, different)


@_SLOW
def test_attention_backward_port_runs_in_the_interpreter() -> None:
    """The gradient of the port (its forward kernel with residuals, then the dQ and dK/dV
    kernels, warp-specialised pipelines) in the interpreter, against the gradient of
    attention_mgpu's ``attention_reference``, on random inputs and cotangents."""
    lib = _library("attention_mgpu", ours=True)
    config = lib.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=2, block_q_dkv=64,
                              block_kv_dkv=64, block_q_dq=64, block_kv_dq=64)
    q, k, v, do = (jax.random.normal(key, (1, 256, 2, 64), F32).astype(F16)
                   for key in jax.random.split(jax.random.key(12), 4))
    with force_interpret_mode():
        _, grads = jax.vjp(lambda q, k, v: lib.attention(q, k, v, config), q, k, v)
        got = grads(do)
    _, reference = jax.vjp(lib.attention_reference, q, k, v)
    for g, e in zip(got, reference(do.astype(F32))):
        np.testing.assert_allclose(g.astype(F32), e.astype(F32), rtol=1e-2, atol=5e-2)


@_SLOW
@pytest.mark.parametrize("causal", [False, True])
def test_attention_port_runs_in_the_interpreter(causal: bool) -> None:
    """The port's meaning: JAX's attention_mgpu forward kernel (two compute warpgroups and a
    memory warpgroup sharing SMEM, synchronised by mbarriers), unchanged but for its imports,
    run by this project's interpreter (its warpgroups each at its own pace,
    pallas_interpret.phases) on random inputs, against the module's own
    ``attention_reference``, with JAX's test tolerance."""
    lib = _library("attention_mgpu", ours=True)
    config = lib.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=2, causal=causal)
    q, k, v = (jax.random.normal(key, (1, 256, 2, 64), F32).astype(F16)
               for key in jax.random.split(jax.random.key(11), 3))
    fn = functools.partial(lib.attention, config=config)
    with force_interpret_mode():
        calls = list(kernel_calls(jax.make_jaxpr(fn)(q, k, v).jaxpr))
        got = fn(q, k, v)
    assert [c.backend for c in calls] == ["interpret"]
    expected = lib.attention_reference(q, k, v, causal=causal)
    np.testing.assert_allclose(got.astype(F32), expected.astype(F32), atol=2e-3, rtol=1e-3)


def test_transposed_ragged_dot_port_runs_in_the_interpreter() -> None:
    """JAX's transposed_ragged_dot (per group g: lhs[rows of g].T @ rhs[rows of g]) run by
    the interpreter on uneven groups (one empty, one whose K window runs past the array's end,
    which TMA copies address as one box) against ``lax.ragged_dot_general``."""
    lib = _library("transposed_ragged_dot_mgpu", ours=True)
    keys = jax.random.split(jax.random.key(13))
    lhs = jax.random.normal(keys[0], (256, 128), F32).astype(F16)
    rhs = jax.random.normal(keys[1], (256, 128), F32).astype(F16)
    sizes = jnp.array([50, 0, 130, 76], jnp.int32)
    fn = functools.partial(lib.transposed_ragged_dot, group_sizes=sizes, block_m=64,
                           block_n=64, block_k=64, max_concurrent_steps=2, grid_block_n=1)
    with force_interpret_mode():
        got = fn(lhs, rhs)
    numbers = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((0,), (0,)), ((), ())),
                                            lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    expected = lax.ragged_dot_general(lhs.astype(F32), rhs.astype(F32), sizes,
                                      ragged_dot_dimension_numbers=numbers)
    np.testing.assert_allclose(got.astype(F32), expected, rtol=2e-2, atol=5e-2)


# --- this plugin's kernels, written again with JAX's plgpu ------------------------------------


def _jax_add_one(x: jax.Array) -> jax.Array:
    n = x.shape[0] // 2

    @functools.partial(jgpu.kernel, out_type=S(x.shape, x.dtype), grid=(2,), grid_names=("x",))
    def kernel(x_ref: Any, o_ref: Any) -> None:
        window = jpl.ds(lax.axis_index("x") * n, n)
        o_ref[window] = x_ref[window] + 1.0

    return kernel(x)  # type: ignore[no-any-return]


def _jax_add_one_tma(x: jax.Array) -> jax.Array:
    n = x.shape[0] // 2

    @functools.partial(jgpu.kernel, out_type=S(x.shape, x.dtype), grid=(2,), grid_names=("x",),
                       scratch_types=[jgpu.SMEM((n,), x.dtype), jgpu.Barrier(num_arrivals=1)])
    def kernel(x_ref: Any, o_ref: Any, smem: Any, barrier: Any) -> None:
        window = jpl.ds(lax.axis_index("x") * n, n)
        jgpu.copy_gmem_to_smem(x_ref.at[window], smem, barrier)
        jgpu.barrier_wait(barrier)
        smem[...] = smem[...] + 1.0
        jgpu.commit_smem()
        jgpu.copy_smem_to_gmem(smem, o_ref.at[window])
        jgpu.wait_smem_to_gmem(0)

    return kernel(x)  # type: ignore[no-any-return]


def _jax_blocked_add(x: jax.Array, y: jax.Array, block: tuple[int, int] = (64, 128)
                     ) -> jax.Array:
    def kernel(x_ref: Any, y_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...] + y_ref[...]

    spec = jpl.BlockSpec(block, lambda i, j: (i, j))
    return jpl.pallas_call(  # type: ignore[no-any-return]
        kernel, S(x.shape, x.dtype), grid=(x.shape[0] // block[0], x.shape[1] // block[1]),
        in_specs=[spec, spec], out_specs=spec, compiler_params=jgpu.CompilerParams())(x, y)


def _jax_matmul(a: jax.Array, b: jax.Array, tile: int = 128, tile_k: int = 64) -> jax.Array:
    """K.matmul as JAX writes it: the (8, 64) tiling and 128-byte swizzle this plugin picks
    itself are spelled out; JAX's ACC starts at zero, so there is no initialising step."""
    (m, k), n = a.shape, b.shape[1]
    swizzled = (jgpu.TilingTransform((8, 64)), jgpu.SwizzleTransform(128))

    def kernel(a_ref: Any, b_ref: Any, o_ref: Any, acc_ref: Any) -> None:
        jgpu.wgmma(acc_ref, a_ref, b_ref)
        jgpu.wgmma_wait(0)

        @jpl.when(jpl.program_id(2) == jpl.num_programs(2) - 1)
        def _store() -> None:
            o_ref[...] = acc_ref[...].astype(o_ref.dtype)

    return jpl.pallas_call(  # type: ignore[no-any-return]
        kernel, S((m, n), a.dtype), grid=(m // tile, n // tile, k // tile_k),
        in_specs=[jgpu.BlockSpec((tile, tile_k), lambda i, j, kk: (i, kk), transforms=swizzled),
                  jgpu.BlockSpec((tile_k, tile), lambda i, j, kk: (kk, j), transforms=swizzled)],
        out_specs=jgpu.BlockSpec((tile, tile), lambda i, j, kk: (i, j), transforms=swizzled),
        scratch_shapes=[jgpu.ACC((tile, tile), F32)],
        compiler_params=jgpu.CompilerParams(
            dimension_semantics=["parallel", "parallel", "sequential"],
            max_concurrent_steps=2))(a, b)


def _jax_softmax(x: jax.Array, block_rows: int = 64) -> jax.Array:
    """K.softmax as JAX writes it for a block wider than one TMA box (256 elements): JAX needs
    the SMEM blocks tiled (8, 32) with a 128-byte swizzle (an untiled (64, 384) float32 box is
    refused), where this plugin splits the copy; JAX's row layouts take no keepdims."""
    swizzled = (jgpu.TilingTransform((8, 32)), jgpu.SwizzleTransform(128))

    def kernel(x_ref: Any, o_ref: Any) -> None:
        v = x_ref[...]
        rows = functools.partial(lax.broadcast_in_dim, shape=v.shape, broadcast_dimensions=(0,))
        e = jnp.exp(v - rows(jnp.max(v, axis=1)))
        o_ref[...] = e / rows(jnp.sum(e, axis=1))

    spec = jgpu.BlockSpec((block_rows, x.shape[1]), lambda i: (i, 0), transforms=swizzled)
    return jpl.pallas_call(  # type: ignore[no-any-return]
        kernel, S(x.shape, x.dtype), grid=(x.shape[0] // block_rows,), in_specs=[spec],
        out_specs=spec, compiler_params=jgpu.CompilerParams())(x)


def _clusters(kernel: Any, **kw: Any) -> Any:
    """Clusters of 2 blocks, 2 warpgroups per block, each writing its own row."""
    def body(o_ref: Any) -> None:
        g, c, w = lax.axis_index("g"), lax.axis_index("c"), lax.axis_index("wg")
        o_ref[g, c, w, :] = jnp.full((128,), (g * 100 + c * 10 + w).astype(F32))

    return kernel(body, out_type=S((3, 2, 2, 128), F32), grid=(3,), grid_names=("g",),
                  cluster=(2,), cluster_names=("c",), num_threads=2, thread_name="wg", **kw)()


X256, X2D, H2D = S((256,), F32), S((256, 256), F32), S((256, 256), F16)

# name: (ours, JAX's, operands, the fields that differ as (ours, JAX's) and why)
PLUGIN_KERNELS: dict[str, tuple[Any, Any, tuple[S, ...], dict[str, tuple[Any, Any]]]] = {
    "add_one": (K.add_one, _jax_add_one, (X256,), {}),
    # JAX rounds every SMEM allocation up to 1024 bytes; here only starts are aligned.
    "add_one_tma": (K.add_one_tma, _jax_add_one_tma, (X256,),
                    {"smem_bytes": (512 + 8, 1024 + 8)}),
    # Grid (4, 2): JAX gives CUDA the grid reversed (x = the minor axis); this plugin folds
    # the parallel axes into x. One mbarrier per input and slot here, one per slot in JAX.
    "blocked_add": (K.blocked_add, _jax_blocked_add, (X2D, X2D),
                    {"grid": ((8, 1, 1), (2, 4, 1)),
                     "smem_bytes": (3 * 32768 + 2 * 8, 3 * 32768 + 8)}),
    # As above, and JAX double-buffers the output block (max_concurrent_steps=2).
    "matmul": (K.matmul, _jax_matmul, (H2D, H2D),
               {"grid": ((4, 1, 1), (2, 2, 1)),
                "smem_bytes": (3 * 32768 + 2 * 2 * 8, 4 * 32768 + 2 * 8)}),
    # (64, 384) float32 blocks, above one TMA box: one buffer each way in both; JAX reserves
    # 2 KiB more (for its reductions).
    "softmax_wide": (K.softmax, _jax_softmax, (S((256, 384), F32),),
                     {"smem_bytes": (2 * 98304 + 8, 2 * 98304 + 2048 + 8)}),
    "clusters": (lambda: _clusters(plgpu.kernel, backend="mosaic_gpu"),
                 lambda: _clusters(jgpu.kernel), (), {}),
}


@_NO_JAX_PALLAS_CALL
@pytest.mark.parametrize("name", sorted(PLUGIN_KERNELS))
def test_plugin_kernel_launches_like_jax(name: str) -> None:
    ours_fn, jax_fn, args, differences = PLUGIN_KERNELS[name]
    ours = _one_kernel(_lower(ours_fn, *args))
    theirs = _one_kernel(_lower(jax_fn, *args))
    inspection.assert_same_kernel(ours, theirs, differences)
    for _, module in (ours, theirs):  # TMA and wgmma need 1024-byte aligned buffers
        assert all(off % 1024 == 0 for off, ty in inspection.smem_buffers(module)
                   if "xi64," not in ty)


@_NO_JAX_PALLAS_CALL
def test_a_difference_is_reported() -> None:
    """The comparison can fail: the same kernel with another block shape launches another
    grid, and an unexpected difference names its field."""
    ours = _one_kernel(_lower(K.blocked_add, X2D, X2D))
    theirs = _one_kernel(_lower(functools.partial(_jax_blocked_add, block=(128, 128)),
                                X2D, X2D))
    with pytest.raises(AssertionError, match="grid"):
        inspection.assert_same_kernel(ours, theirs)
    with pytest.raises(AssertionError, match="smem_bytes"):
        inspection.assert_same_kernel(ours, ours, {"smem_bytes": (1, 2)})


# --- Blackwell (sm_100a) ----------------------------------------------------------------------
#
# Without a GPU, JAX's Mosaic GPU library builds every module for 9.0 (the device it would
# ask is a CPU), even one full of tcgen05 instructions; targets.assume gives it an sm_100a
# device to ask, as a Blackwell machine would. This backend builds TMEM/tcgen05 kernels for
# sm_100a on its own (pallas_mosaic_gpu.targets).

BLACKWELL_SMS = 148  # blackwell_ragged_dot asks the device for its SM count


def _jax_blackwell_matmul(a: jax.Array, b: jax.Array, tile: int = 128, tile_k: int = 64,
                          steps: int = 2) -> jax.Array:
    """BK.matmul as JAX writes it (the layout this plugin picks for the SMEM tiles spelled
    out): TMA into `steps` slots, tcgen05_mma into TMEM, TMEM -> registers -> SMEM -> TMA."""
    (m, k), n = a.shape, b.shape[1]
    n_iters, k_iters = n // tile, k // tile_k
    swizzled = (jgpu.TilingTransform((8, 64)), jgpu.SwizzleTransform(128))

    def kernel(a_gmem: Any, b_gmem: Any, out_gmem: Any, a_smem: Any, b_smem: Any,
               acc_tmem: Any, out_smem: Any, loaded: Any, consumed: Any, done: Any) -> None:
        idx = lax.axis_index("tiles")
        rows, cols = jpl.ds((idx // n_iters) * tile, tile), jpl.ds((idx % n_iters) * tile, tile)

        def fetch(ki: Any, slot: Any) -> None:
            ks = jpl.ds(ki * tile_k, tile_k)
            jgpu.copy_gmem_to_smem(a_gmem.at[rows, ks], a_smem.at[slot], loaded.at[slot])
            jgpu.copy_gmem_to_smem(b_gmem.at[ks, cols], b_smem.at[slot], loaded.at[slot])

        for s in range(min(steps, k_iters)):
            fetch(s, s)

        def step(ki: Any, carry: Any) -> Any:
            slot = lax.rem(ki, steps)
            jgpu.barrier_wait(loaded.at[slot])
            jgpu.tcgen05_mma(acc_tmem, a_smem.at[slot], b_smem.at[slot], consumed.at[slot],
                             accumulate=ki > 0)

            @jpl.when(ki + steps < k_iters)
            def _refill() -> None:
                jgpu.barrier_wait(consumed.at[slot])
                fetch(ki + steps, slot)
            return carry

        lax.fori_loop(0, k_iters, step, None)
        one = done.at[0] if done.shape else done  # JAX 0.11 makes one barrier a scalar Ref
        jgpu.tcgen05_commit_arrive(one)
        jgpu.barrier_wait(one)
        out_smem[...] = jgpu.async_load_tmem(acc_tmem).astype(out_smem.dtype)
        jgpu.wait_load_tmem()
        jgpu.commit_smem()
        jgpu.copy_smem_to_gmem(out_smem, out_gmem.at[rows, cols])
        jgpu.wait_smem_to_gmem(0)

    return jgpu.kernel(  # type: ignore[no-any-return]
        kernel, out_type=S((m, n), a.dtype), grid=((m // tile) * n_iters,),
        grid_names=("tiles",), scratch_types=[
            jgpu.SMEM((steps, tile, tile_k), a.dtype, transforms=swizzled),
            jgpu.SMEM((steps, tile_k, tile), a.dtype, transforms=swizzled),
            jgpu.TMEM((tile, tile), F32),
            jgpu.SMEM((tile, tile), a.dtype, transforms=swizzled),
            jgpu.Barrier(num_arrivals=2, num_barriers=steps),
            jgpu.Barrier(num_barriers=steps, orders_tensor_core=True),
            jgpu.Barrier(orders_tensor_core=True)])(a, b)


@_NO_JAX_PALLAS_CALL
def test_blackwell_matmul_launches_like_jax() -> None:
    """The same kernel, ours and JAX's, both for sm_100a: identical launch, call and SMEM."""
    from pallas_mosaic_gpu import blackwell_kernels as BK  # noqa: N812
    from pallas_mosaic_gpu import targets

    args = (S((256, 512), F16), S((512, 256), F16))
    ours = _one_kernel(_lower(functools.partial(BK.matmul, backend="mosaic_gpu"), *args))
    with targets.assume(targets.BLACKWELL):
        theirs = _one_kernel(_lower(_jax_blackwell_matmul, *args))
    inspection.assert_same_kernel(ours, theirs)
    assert inspection.launch(ours[1])["arch"] == (10, 0)
    # The same buffers at the same offsets (JAX adds one view of its whole region).
    assert set(inspection.smem_buffers(ours[1])) == {
        b for b in inspection.smem_buffers(theirs[1]) if "98304xi8" not in b[1]}
    # JAX's lowering without an assumed device marks the same module 9.0.
    assert inspection.launch(_one_kernel(_lower(_jax_blackwell_matmul, *args))[1])["arch"] \
        == (9, 0)


def _blackwell_matmul(lib: types.ModuleType, collective: bool) -> str:
    config = lib.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=2,
                              collective=collective)
    return _lower(lambda a, b: lib.matmul_kernel(a, b, config), S((512, 512), F16),
                  S((512, 512), F16))


@pytest.mark.parametrize("collective", [False, True])
def test_jax_lowers_blackwell_matmul_on_cpu(collective: bool) -> None:
    """JAX's blackwell_matmul_mgpu lowers on this CPU machine: a persistent kernel (cluster
    launch control) of 2 warpgroups, with TMEM and tcgen05; marked 9.0 unless a Blackwell
    device is assumed."""
    from pallas_mosaic_gpu import targets

    lib = _library("blackwell_matmul_mgpu", ours=False)
    for assumed, arch in ((None, (9, 0)), (targets.BLACKWELL, (10, 0))):
        if assumed is None:
            text = _blackwell_matmul(lib, collective)
        else:
            with targets.assume(assumed):
                text = _blackwell_matmul(lib, collective)
        _config, module = _one_kernel(text)
        got = inspection.launch(module)
        assert got["arch"] == arch and got["block"] == (256, 1, 1)
        assert got["cluster"] == ((2, 1, 1) if collective else (1, 1, 1))
        body = str(module)
        assert "tcgen05.mma" in body and "clusterlaunchcontrol.try_cancel" in body


def test_jax_blackwell_ragged_dot_needs_an_sm_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """JAX's blackwell_ragged_dot_mgpu asks ``jax.local_devices()[0].core_count``, which a CPU
    device lacks; given one, its collective form lowers (its non-collective form reads the
    cluster axis "x", which only the collective launch has, and fails in JAX itself)."""
    lib = _library("blackwell_ragged_dot_mgpu", ours=False)
    matmul = _library("blackwell_matmul_mgpu", ours=False)

    def lower(collective: bool) -> str:
        config = lib.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=2,
                                  collective=collective, grid_tile_width=1,
                                  grid_minor_dim=matmul.MatmulDimension.N)
        return _lower(lambda a, b, g: lib.ragged_dot_kernel(a, b, g, config),
                      S((512, 512), F16), S((4, 512, 512), F16), S((4,), jnp.int32))

    with pytest.raises(AttributeError) as info:  # a CPU device has no core_count
        lower(True)
    assert info.traceback[-1].statement.lines[-1].strip().endswith(".core_count")
    monkeypatch.setattr(jax, "local_devices",
                        lambda *a, **k: [types.SimpleNamespace(core_count=BLACKWELL_SMS)])
    got = inspection.launch(_one_kernel(lower(True))[1])
    assert got["grid"] == (BLACKWELL_SMS, 1, 1) and got["cluster"] == (2, 1, 1)
    with pytest.raises(NameError, match="unbound axis name: x"):
        lower(False)


BLACKWELL_ANSWERS = 2 * 16
"""dynamic_scheduling_loop's SMEM for the answers of try_cluster_cancel: 2 slots of 16 bytes."""


def test_blackwell_matmul_port_lowers_like_jax() -> None:
    """The port of blackwell_matmul (collective=False): a persistent kernel claiming its grid
    points with cluster launch control (plgpu.dynamic_scheduling_loop), whose compute
    warpgroup splits into a TMA warp and an MMA warp (pl.core_map over plgpu.WarpMesh) and
    whose other warpgroup stores the TMEM accumulator. Same launch and call as JAX's lowering
    for sm_100a; one pinned difference, the dynamic SMEM size: JAX rounds every SMEM
    allocation up to 1024 bytes, so its 32 bytes of try_cluster_cancel answers take 1024
    before the barriers, while this backend aligns where buffers start (the same rule as the
    ragged_dot and attention differences above)."""
    from pallas_mosaic_gpu import targets

    ours = _one_kernel(_blackwell_matmul(_library("blackwell_matmul_mgpu", True), False))
    with targets.assume(targets.BLACKWELL):
        theirs = _one_kernel(_blackwell_matmul(_library("blackwell_matmul_mgpu", False),
                                               False))
    buffers = 3 * 2 * 128 * 64 * 2  # a_smem, b_smem, acc_smem: 2 slots of 128x64 float16
    barriers = 6 * 2 * 8  # the kernel's 4 and the loop's 2, 2 barriers each
    tmem_address = 4
    inspection.assert_same_kernel(ours, theirs, {"smem_bytes": (
        buffers + BLACKWELL_ANSWERS + barriers + tmem_address,
        buffers + 1024 + barriers + tmem_address)})
    assert inspection.launch(ours[1])["arch"] == (10, 0)
    # The same buffers at the same offsets; the barriers and the TMEM address shifted by the
    # rounding above.
    shift = 1024 - BLACKWELL_ANSWERS
    mine = inspection.smem_buffers(ours[1])
    assert [(o if o < buffers + BLACKWELL_ANSWERS else o + shift, t) for o, t in mine] == \
        inspection.smem_buffers(theirs[1])
    body = str(ours[1])
    for op in ("clusterlaunchcontrol.try_cancel", "clusterlaunchcontrol.query_cancel",
               "tcgen05.mma", "tcgen05.commit"):
        assert op in body, op


@_SLOW
@pytest.mark.parametrize("minor", ["N", "M"])
def test_blackwell_matmul_port_runs_in_the_interpreter(minor: str) -> None:
    """The port's meaning (collective=False), run by this project's interpreter on random
    inputs against ``jnp.dot``: the two warpgroups of a block and the TMA and MMA warps of the
    first each run at their own pace (pallas_interpret.phases), sharing the block's SMEM, TMEM
    and barriers; 8 K steps through 2 slots make the TMA warp wait for the MMA warp's
    consumed barriers. The interpreter runs blocks one after another, so the first block
    claims every other tile through cluster launch control (the others are cancelled): its 6
    tiles alternate the two TMEM accumulator slots, and from the third on the MMA warp waits
    for the store warpgroup to have emptied the slot."""
    lib = _library("blackwell_matmul_mgpu", ours=True)
    config = lib.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=2,
                              collective=False, grid_minor_dim=lib.MatmulDimension[minor],
                              grid_tile_width=2)
    _matmul_port_in_the_interpreter(lib, config, (256, 512, 384), seed=17)


def _matmul_port_in_the_interpreter(lib: types.ModuleType, config: Any,
                                    mkn: tuple[int, int, int], seed: int) -> None:
    """Runs the blackwell_matmul port in the interpreter on random (M, K) @ (K, N) float16
    operands and checks it against ``jnp.dot`` in float32."""
    m, k, n = mkn
    keys = jax.random.split(jax.random.key(seed))
    a = jax.random.normal(keys[0], (m, k), F32).astype(F16)
    b = jax.random.normal(keys[1], (k, n), F32).astype(F16)
    fn = functools.partial(lib.matmul_kernel, config=config)
    with force_interpret_mode():
        calls = list(kernel_calls(jax.make_jaxpr(fn)(a, b).jaxpr))
        got = fn(a, b)
    assert [c.backend for c in calls] == ["interpret"]
    expected = jnp.dot(a.astype(F32), b.astype(F32))
    np.testing.assert_allclose(got.astype(F32), expected, rtol=2e-2, atol=5e-2)


@_SLOW
def test_blackwell_matmul_collective_port_runs_in_the_interpreter() -> None:
    """The port's collective form (``collective=True``), run by this project's interpreter on
    random inputs against ``jnp.dot``: the two blocks of each cluster run together, each at
    its own pace (pallas_interpret.phases), each with its own SMEM, TMEM and barriers. Each
    block's TMA warp copies its half of the A and B tiles (partitioned copies, the first
    block's barrier tracking both blocks' halves), the first block's MMA warp issues the
    2-block matmuls, whose barriers and commits complete in both blocks, and each block's
    store warpgroup writes its half of the rows, both arriving on the ClusterBarrier the
    MMA warp waits on before reusing an accumulator slot. The first cluster claims every
    tile (4 of 256 x 256 here), so both accumulator slots are reused."""
    lib = _library("blackwell_matmul_mgpu", ours=True)
    config = lib.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=2,
                              collective=True)
    _matmul_port_in_the_interpreter(lib, config, (512, 512, 512), seed=19)


# What makes the collective form collective, counted in a module's text: TMA copies into
# one block's part tracked by the first block's barrier, arrivals on every block's barrier
# (ClusterBarrier), 2-CTA matmuls and commits multicast to both blocks, TMEM allocated by both
# blocks, and the cluster meeting after the barriers are made and before TMEM is freed. Each
# instruction is counted in every spelling the installed Mosaic GPU library gives it: JAX 0.10
# and 0.11 build some as NVVM ops (``nvvm.cluster.wait``), JAX 0.12 writes the same
# instructions as inline PTX (``barrier.cluster.wait.aligned;``) or LLVM intrinsics.
COLLECTIVE_MARKS: dict[str, tuple[str, ...]] = {
    "2-CTA TMA load": (
        "bulk.tensor.4d.shared::cta.global.tile.mbarrier::complete_tx::bytes.cta_group::2",),
    "cluster arrive": ("mbarrier.arrive.shared::cluster.b64",),
    "2-CTA mma": ("tcgen05.mma.cta_group::2",),
    "1-CTA mma": ("tcgen05.mma.cta_group::1",),
    "2-CTA multicast commit": ("multicast_mask = %c3_i16 {group = #nvvm.cta_group<cta_2>}",
                               "tcgen05.commit.mc.cg2"),
    "TMEM alloc": ("nvvm.tcgen05.alloc", "tcgen05.alloc.cta_group"),
    "2-CTA TMEM and commit ops": ("cta_group<cta_2>", "cta_group::2.sync.aligned",
                                  "tcgen05.commit.mc.cg2"),
    "cluster arrive (relaxed)": ("nvvm.cluster.arrive.relaxed", "barrier.cluster.arrive.relaxed"),
    "cluster wait": ("nvvm.cluster.wait", "barrier.cluster.wait"),
    "tile scheduler cancel": ("clusterlaunchcontrol.try_cancel",),
    "2-CTA mma descriptor": ("%c272695312",),
}


def _marks(module: Any) -> dict[str, int]:
    text = str(module)
    return {name: sum(text.count(s) for s in spellings)
            for name, spellings in COLLECTIVE_MARKS.items()}


def test_blackwell_matmul_collective_port_lowers_like_jax() -> None:
    """The port's collective form (``collective=True``): a cluster of 2 blocks computing
    256x256 tiles together. Each block's TMA warp loads its half of the A rows and of the B
    columns (``copy_gmem_to_smem(collective_axes="x", leader_tracked=PARTITIONED(d))``), the
    first block's barrier tracking both; the first block's MMA warp issues 2-CTA matmuls
    (``tcgen05_mma(collective_axis="x")``, instruction descriptor M=256) into TMEM both blocks
    allocated (``TMEM(collective=True)``), and each block's store warpgroup hands its TMEM slot
    back to the first block through a ``ClusterBarrier``. Same launch (grid of 8 blocks in
    clusters of 2) and call as JAX's lowering for sm_100a, the same SMEM difference as the
    non-collective form, and the same count of every collective instruction."""
    from pallas_mosaic_gpu import targets

    ours = _one_kernel(_blackwell_matmul(_library("blackwell_matmul_mgpu", True), True))
    with targets.assume(targets.BLACKWELL):
        theirs = _one_kernel(_blackwell_matmul(_library("blackwell_matmul_mgpu", False), True))
    buffers = 3 * 2 * 128 * 64 * 2
    barriers, tmem_address = 6 * 2 * 8, 4
    inspection.assert_same_kernel(ours, theirs, {"smem_bytes": (
        buffers + BLACKWELL_ANSWERS + barriers + tmem_address,
        buffers + 1024 + barriers + tmem_address)})
    launch = inspection.launch(ours[1])
    assert (launch["grid"], launch["cluster"], launch["arch"]) == ((8, 1, 1), (2, 1, 1), (10, 0))
    mine, jax_marks = _marks(ours[1]), _marks(theirs[1])
    assert mine == jax_marks
    assert mine["2-CTA mma"] == 4 and mine["1-CTA mma"] == 0
    assert mine["2-CTA TMA load"] == 2 and mine["cluster wait"] == 2
    assert mine["2-CTA multicast commit"] == 2 and mine["2-CTA TMEM and commit ops"] == 5
    # The non-collective form has none of it.
    single = _marks(_one_kernel(_blackwell_matmul(_library("blackwell_matmul_mgpu", True),
                                                  False))[1])
    assert single["2-CTA TMA load"] == single["2-CTA TMEM and commit ops"] == 0
    assert single["1-CTA mma"] == 4


def test_blackwell_ragged_dot_collective_port_lowers_like_jax(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The port of blackwell_ragged_dot, collective (the form JAX itself lowers), given an SM
    count: a persistent kernel over the SMs (pl.nd_loop) in clusters of 2 whose TMEM
    accumulator is a pl.run_scoped allocation shared by the warpgroups, read with
    plgpu.Layout.TCGEN05 and stored into a plain SMEM buffer in rows of varying count.
    Identical launch (148 / 2 clusters of 2), call and dynamic SMEM size, the same buffers at
    the same offsets (JAX views its plain (128, 64) buffer as (128, 1, 1, 64)), and the same
    counts of every collective instruction."""
    from pallas_mosaic_gpu import targets

    monkeypatch.setattr(jax, "local_devices",
                        lambda *a, **k: [types.SimpleNamespace(core_count=BLACKWELL_SMS)])

    def lower(ours: bool) -> tuple[dict[str, Any], Any]:
        lib = _library("blackwell_ragged_dot_mgpu", ours)
        matmul = _library("blackwell_matmul_mgpu", ours)
        config = lib.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=2,
                                  collective=True, grid_tile_width=1,
                                  grid_minor_dim=matmul.MatmulDimension.N)
        return _one_kernel(_lower(lambda a, b, g: lib.ragged_dot_kernel(a, b, g, config),
                                  S((512, 512), F16), S((4, 512, 512), F16),
                                  S((4,), jnp.int32)))

    ours = lower(True)
    with targets.assume(targets.BLACKWELL):
        theirs = lower(False)
    inspection.assert_same_kernel(ours, theirs)
    launch = inspection.launch(ours[1])
    assert (launch["grid"], launch["cluster"], launch["arch"]) == \
        ((BLACKWELL_SMS, 1, 1), (2, 1, 1), (10, 0))
    plain = "memref<128x64xf16, #gpu.address_space<workgroup>>"
    assert [(o, t.replace("128x1x1x64", "128x64")) for o, t in
            inspection.smem_buffers(theirs[1])] == inspection.smem_buffers(ours[1])
    assert (32768, plain) in inspection.smem_buffers(ours[1])
    mine = _marks(ours[1])
    assert mine == _marks(theirs[1])
    assert mine["2-CTA mma"] == 4 and mine["TMEM alloc"] == 1


@_SLOW
def test_blackwell_ragged_dot_collective_port_runs_in_the_interpreter(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The collective port of blackwell_ragged_dot, run by this project's interpreter on random
    inputs against a numpy ragged dot, given 4 SMs (2 clusters of 2 blocks dealing out the
    tiles with pl.nd_loop): groups of 100, 156, 0 and 256 rows, so tiles straddle groups and
    one group is empty."""
    monkeypatch.setattr(jax, "local_devices",
                        lambda *a, **k: [types.SimpleNamespace(core_count=4)])
    lib = _library("blackwell_ragged_dot_mgpu", True)
    matmul = _library("blackwell_matmul_mgpu", True)
    config = lib.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=2,
                              collective=True, grid_tile_width=1,
                              grid_minor_dim=matmul.MatmulDimension.N)
    keys = jax.random.split(jax.random.key(23))
    a = jax.random.normal(keys[0], (512, 256), F32).astype(F16)
    b = jax.random.normal(keys[1], (4, 256, 256), F32).astype(F16)
    sizes = np.array([100, 156, 0, 256])
    with force_interpret_mode():
        got = lib.ragged_dot_kernel(a, b, jnp.asarray(sizes, jnp.int32), config)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    expected = np.concatenate([np.asarray(a[s:e], np.float32) @ np.asarray(b[g], np.float32)
                               for g, (s, e) in enumerate(itertools.pairwise(starts))])
    np.testing.assert_allclose(np.asarray(got, np.float32), expected, rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("name", LIBRARY)
def test_port_gets_a_report(name: str) -> None:
    """``pl.report`` on each ported kernel: its matrix work (``wgmma``, counted by the
    backend's ``pallas_op_cost``), its TMA traffic, a footprint that fits, an H100 roofline."""
    fn, args = _library_case(name, _library(name, True))
    if name in ("ragged_dot_mgpu", "transposed_ragged_dot_mgpu"):  # group sizes: keyword
        fn = functools.partial(lambda f, lhs, rhs, g: f(lhs, rhs, group_sizes=g), fn)
    rep = pl.report(fn, *args, backend="mosaic_gpu", target="h100")
    assert len(rep) >= 1
    for k in rep:
        assert k.matmul_flops > 0 and k.hbm_bytes > 0 and k.fits is True
        assert k.roofline["h100"].seconds > 0
        assert not any("refuses" in n for n in k.notes), k.notes

