"""The Triton backend against JAX's own Triton lowering, without a GPU.

Each kernel of ``test_gpu_library.LOWERINGS`` (and the norm backward passes) is lowered for
``cuda`` twice: by ``jax.experimental.pallas`` (JAX's module as installed; its Triton compiler
params pick JAX's Triton lowering) and by this project (the ported module, ``porting.ported``).
``pallas_triton.inspection`` decodes both programs' Triton custom calls; this test compares, call
by call, what XLA's GPU runtime acts on: the custom-call target, the kernel's name, launch grid,
``num_warps`` and ``num_stages``, the call's operand and result types, and the kernel function's
signature (argument order and pointer element types, and the hints on the arguments).

Where the two differ by design, the difference is pinned exactly in :data:`BY_DESIGN` with its
reason, so that a change on either side fails here.
"""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import pytest

from pallas_core import _jax
from tests.jax_library import porting
from tests.jax_library import test_gpu_library as library

inspection = pytest.importorskip("pallas_triton.inspection")

MODULES = ("attention", "decode_attention", "paged_attention", "layer_norm", "rms_norm",
           "softmax")
_S = jax.ShapeDtypeStruct
F16, F32 = jnp.float16, jnp.float32


def _modules(lowered_by: str) -> dict[str, Any]:
    if lowered_by == "jax":
        return {m: importlib.import_module(f"jax.experimental.pallas.ops.gpu.{m}")
                for m in MODULES}
    return {m: porting.ported(f"gpu.{m}") for m in MODULES}


def _blocks(m: dict[str, Any]) -> Any:
    return m["attention"].BlockSizes(block_q=16, block_k=16, block_q_dkv=16, block_kv_dkv=16,
                                     block_q_dq=16, block_kv_dq=16)


def _grad(fn: Callable[..., jax.Array]) -> Callable[..., Any]:
    return jax.grad(lambda *a: jnp.sum(fn(*a).astype(F32)), argnums=(0, 1, 2))


# The kernels of test_gpu_library.LOWERINGS (same arguments), for either module set.
KERNELS: dict[str, Callable[[dict[str, Any]], Callable[..., Any]]] = {
    "mha": lambda m: lambda q, k, v: m["attention"].mha(q, k, v, None, causal=True,
                                                        block_sizes=_blocks(m)),
    "mha_backward": lambda m: _grad(lambda q, k, v: m["attention"].mha(
        q, k, v, None, block_sizes=_blocks(m))),
    "mqa": lambda m: functools.partial(m["decode_attention"].mqa, block_h=16, block_k=16,
                                       k_splits=2),
    "gqa": lambda m: functools.partial(m["decode_attention"].gqa, block_h=16, block_k=16,
                                       k_splits=2),
    "paged_attention": lambda m: functools.partial(
        m["paged_attention"].paged_attention, block_h=16, pages_per_compute_block=2,
        k_splits=2),
    "layer_norm": lambda m: m["layer_norm"].layer_norm,
    "rms_norm": lambda m: m["rms_norm"].rms_norm,
    "softmax": lambda m: functools.partial(m["softmax"].softmax, axis=-1),
    "layer_norm_backward": lambda m: _grad(m["layer_norm"].layer_norm),
    "rms_norm_backward": lambda m: _grad(m["rms_norm"].rms_norm),
}
ARGS = {**{name: args for name, (_, args) in library.LOWERINGS.items()},
        "layer_norm_backward": library._NORM, "rms_norm_backward": library._NORM}
ARGS["mqa"] = ARGS["mqa"][:3]  # the kv_seq_len operand goes by keyword below

JAX_DIVISIBILITY, OUR_DIVISIBILITY = 32, 16
"""Every pointer argument's ``tt.divisibility`` hint: JAX promises 32-byte aligned buffers;
this backend promises 16, Triton's own convention for pointer arguments and the smaller claim:
a promise larger than the alignment the runtime gives a buffer would let Triton emit wider
vector accesses that fault."""

SEQUENTIAL_STEPS = {("layer_norm_backward", 2), ("rms_norm_backward", 2)}
"""(kernel, call index) whose grid this backend runs in order inside one program: the dW/dB
kernel stores into the whole dW and dB arrays from every step (each step its own columns,
through index arrays), so its output block never changes along the grid, and steps that
revisit an output block could race as separate programs (``pallas_triton.lowering.
grid_axes``). JAX launches one program per step and trusts the kernel's stores to be
disjoint."""


def _our_grid(name: str, i: int, jax_grid: tuple[int, int, int]) -> tuple[int, int, int]:
    """The launch grid this backend gives where JAX gives ``jax_grid``: JAX launches up to three
    grid axes as CUDA's x, y, z; this backend folds every parallel grid axis into x (any number
    of axes, unfolded with div/mod in the kernel)."""
    if (name, i) in SEQUENTIAL_STEPS:
        return (1, 1, 1)
    return (math.prod(jax_grid), 1, 1)


def _calls(name: str, lowered_by: str) -> list[Any]:
    fn = KERNELS[name](_modules(lowered_by))
    args = ARGS[name]
    if name == "mqa":
        fn = functools.partial(fn, kv_seq_len=None)
    # JAX's Triton lowering asks which GPU it compiles for, and from 0.11 on refuses to guess
    # when no GPU is attached: it is told an H100 (sm_90, what our lowering targets).
    with _jax.assume_device("NVIDIA H100", "gpu"):
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    return inspection.triton_calls(lowered)  # type: ignore[no-any-return]


def _fields(call: Any) -> dict[str, Any]:
    return {"target": call.target, "name": call.name, "grid": call.grid,
            "num_warps": call.num_warps, "num_stages": call.num_stages,
            "operand_types": call.operand_types, "result_types": call.result_types,
            "argument_types": tuple(a.type for a in call.arguments),
            "argument_hints": tuple(tuple(sorted(a.hints.items())) for a in call.arguments)}


def test_every_lowering_is_compared() -> None:
    assert set(KERNELS) == set(library.LOWERINGS) | {"layer_norm_backward",
                                                     "rms_norm_backward"}


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_agrees_with_jax_triton_lowering(name: str) -> None:
    theirs, ours = _calls(name, "jax"), _calls(name, "ours")
    assert theirs and len(ours) == len(theirs), (len(theirs), len(ours))
    for i, (t, o) in enumerate(zip(theirs, ours, strict=True)):
        assert t.target == o.target == inspection.CUSTOM_CALL_TARGET
        want, got = _fields(t), _fields(o)
        assert got.pop("grid") == _our_grid(name, i, want.pop("grid")), f"call {i} of {name}"
        hints = (want.pop("argument_hints"), got.pop("argument_hints"))
        n = len(t.arguments)
        assert hints == (((("tt.divisibility", JAX_DIVISIBILITY),),) * n,
                         ((("tt.divisibility", OUR_DIVISIBILITY),),) * n), f"call {i} of {name}"
        assert got == want, f"call {i} ({t.name}) of {name} differs from JAX's"
