"""Kernels of JAX's own Pallas kernel library, timed under this project's interpreter and under
JAX's interpret mode, on the same inputs, in one run.

Each kernel is a :class:`Case` in ``CASES``: a row label, a family that says how each way runs
it (``FAMILIES``), and a ``build(load)`` that gets the library's modules through ``load`` (JAX's
own for one way, the ported ones, ``tests/jax_library/porting.py``, for the other) and returns
the function to time and its inputs. TPU kernels run under each side's
``force_tpu_interpret_mode()``; GPU kernels (family ``"gpu"``) pass ``interpret=True`` in their
``build``. Per way: the first call (trace + compile + run) once, then the median of repeated
calls after warm-up; both ways' outputs must agree. A way that cannot run a kernel shows why.
Run: ``python benchmarks/library_interpret.py [--only NAME ...] [--repeats N]``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import pathlib
import platform
import re
import sys
import traceback
import types
from collections.abc import Callable
from typing import Any

# The all_gather case runs over 4 host devices; XLA must be told before jax starts.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import jax
import jax.numpy as jnp
import numpy as np
import pallas_mosaic_tpu as our_pltpu
from jax.experimental.pallas import tpu as jax_pltpu
from timing import call_seconds, command_line, median_seconds

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from tests.jax_library import porting

Load = Callable[[str], types.ModuleType]
Built = tuple[Callable[..., Any], list[Any]]


@dataclasses.dataclass(frozen=True)
class Case:
    """One kernel: ``build(load)`` returns ``(fn, args)``; ``fn(*args)`` is what gets timed
    (under ``jax.jit``). ``load("tpu.matmul")`` is the library module the way runs."""

    name: str
    family: str
    build: Callable[[Load], Built]
    tolerance: float = 1e-4
    jax_params: Any = None  # JAX's pltpu.InterpretParams for this case (None: its defaults)


@dataclasses.dataclass(frozen=True)
class Way:
    """How one side runs a family's kernels: where modules come from and the context the
    function is traced, compiled and called in."""

    label: str
    load: Load
    context: Callable[[Case], contextlib.AbstractContextManager[Any]]


def _jax_module(name: str) -> types.ModuleType:
    return importlib.import_module(f"jax.experimental.pallas.ops.{name}")


def _jax_tpu_interpret(case: Case) -> contextlib.AbstractContextManager[Any]:
    return jax_pltpu.force_tpu_interpret_mode(case.jax_params or jax_pltpu.InterpretParams())


def _nothing(case: Case) -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext()


FAMILIES: dict[str, list[Way]] = {
    "tpu": [Way("this interpreter", porting.ported,
                lambda case: our_pltpu.force_tpu_interpret_mode()),
            Way("JAX TPU interpret", _jax_module, _jax_tpu_interpret)],
    # GPU kernels pass interpret=True themselves (in their build).
    "gpu": [Way("this interpreter", porting.ported, _nothing),
            Way("JAX interpret=True", _jax_module, _nothing)],
}


def _normal(seed: int, *shapes: tuple[int, ...], dtype: Any = jnp.float32) -> list[jax.Array]:
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return [jax.random.normal(k, s, dtype) for k, s in zip(keys, shapes)]


# --- the TPU kernels ---------------------------------------------------------------------------


def _matmul(load: Load) -> Built:
    mod = load("tpu.matmul")
    return (lambda x, y: mod.matmul(x, y, block_shape=(128, 128), block_k=128),
            _normal(0, (512, 512), (512, 512)))


def _flash_blocks(mod: types.ModuleType) -> Any:
    return mod.BlockSizes(block_q=128, block_k_major=256, block_k=128, block_b=1,
                          block_q_major_dkv=128, block_k_major_dkv=128, block_k_dkv=128,
                          block_q_dkv=128, block_k_major_dq=256, block_k_dq=128, block_q_dq=128)


def _flash_forward(load: Load) -> Built:
    mod = load("tpu.flash_attention")
    return (lambda q, k, v: mod.flash_attention(q, k, v, causal=True,
                                                block_sizes=_flash_blocks(mod)),
            _normal(1, *[(2, 2, 256, 128)] * 3))


def _flash_backward(load: Load) -> Built:
    mod = load("tpu.flash_attention")

    def grads(q: Any, k: Any, v: Any, dout: Any) -> Any:
        attn = lambda *a: mod.flash_attention(*a, causal=True,  # noqa: E731
                                              block_sizes=_flash_blocks(mod))
        return jax.vjp(attn, q, k, v)[1](dout)

    return grads, _normal(2, *[(2, 2, 256, 128)] * 4)


# JAX's interpret mode did not finish the gather over 8 devices in 5 minutes on a 2-core
# machine (its devices wait on each other in callbacks); 4 run.
N_GATHER = 4


def _all_gather(load: Load) -> Built:
    mod = load("tpu.all_gather")
    mesh = jax.make_mesh((N_GATHER,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:N_GATHER])
    x = jax.device_put(_normal(3, (N_GATHER * 64, 128))[0],
                       jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x")))
    return lambda a: mod.all_gather(a, mesh=mesh, axis_name="x"), [x]


def _threefry(load: Load) -> Built:
    mod = load("tpu.random.threefry")
    # The kernel itself: JAX's interpret mode fails on jax.random.bits under jit (its
    # callbacks' ordered effect is not allowed in a PRNG implementation).
    return (lambda k: mod.threefry_2x32_count(k, (512, 512), (512, 512), mod.BLOCK_SIZE),
            [jnp.array([0x12345678, 0x9ABCDEF0], jnp.uint32)])


def _philox(load: Load) -> Built:
    mod = load("tpu.random.philox")
    return (lambda k: mod.philox_4x32_count(k, (512, 512)),
            [jnp.array([0x12345678, 0x9ABCDEF0], jnp.uint32)])


def _paged_attention(load: Load) -> Built:
    mod = load("tpu.paged_attention")
    seq_lens = jnp.array([3, 64, 100, 128, 17, 90], jnp.int32)
    k_pages, v_pages = _normal(4, (2, 48, 16, 128), (2, 48, 16, 128))
    indices = jax.random.permutation(jax.random.key(5), 48).astype(jnp.int32).reshape(6, 8)
    (q,) = _normal(6, (6, 8, 128))
    return (lambda *a: mod.paged_attention(*a, pages_per_compute_block=4),
            [q, k_pages, v_pages, seq_lens, indices])


def _ragged_paged_attention(load: Load) -> Built:
    mod = load("tpu.ragged_paged_attention")
    (q,) = _normal(7, (64, 8, 128))
    (cache,) = _normal(8, (24, 16, 4, 128))  # 24 pages of 16 tokens, 2 kv heads (k and v)
    table = jax.random.permutation(jax.random.key(9), 24).astype(jnp.int32)[:12].reshape(4, 3)
    args = [q, cache, jnp.array([40, 20, 16, 0], jnp.int32), table,
            jnp.array([0, 12, 13, 29, 29], jnp.int32), jnp.array([3], jnp.int32)]
    return (lambda *a: mod.ragged_paged_attention(*a, num_kv_pages_per_block=2,
                                                   num_queries_per_block=8), args)


_GROUPS = jnp.array([100, 0, 300, 112], jnp.int32)


def _gmm(load: Load) -> Built:
    mod = load("tpu.megablox.gmm")
    lhs, rhs = _normal(10, (512, 256), (4, 256, 256))
    return (lambda a, b: mod.gmm(a, b, _GROUPS, tiling=(128, 128, 128), interpret=True),
            [lhs, rhs])


def _gmm_backward(load: Load) -> Built:
    mod = load("tpu.megablox.ops")

    def grads(a: Any, b: Any, dy: Any) -> Any:
        gmm = lambda x, y: mod.gmm(x, y, _GROUPS, jnp.float32, (128, 128, 128),  # noqa: E731
                                   None, None, False, True)
        return jax.vjp(gmm, a, b)[1](dy)

    return grads, _normal(11, (512, 256), (4, 256, 256), (512, 256))


def _splash(load: Load, backward: bool) -> Built:
    kernel_mod = load("tpu.splash_attention.splash_attention_kernel")
    masks = load("tpu.splash_attention.splash_attention_mask")
    mask = masks.MultiHeadMask([masks.CausalMask((512, 512))] * 4)
    blocks = kernel_mod.BlockSizes(block_q=128, block_kv=128, block_kv_compute=128,
                                   block_q_dkv=128, block_kv_dkv=128, block_kv_dkv_compute=128,
                                   block_q_dq=128, block_kv_dq=128)
    attn = kernel_mod.make_splash_mha_single_device(mask, block_sizes=blocks, interpret=True)
    args = _normal(12, *[(4, 512, 128)] * (4 if backward else 3))
    if not backward:
        return attn, args
    return (lambda q, k, v, dout: jax.vjp(attn, q, k, v)[1](dout)), args


CASES: list[Case] = [
    Case("matmul 512³, blocks 128", "tpu", _matmul, 1e-3),
    Case("flash_attention fwd, causal, 2x2x256x128", "tpu", _flash_forward),
    Case("flash_attention bwd (dq, dkv kernels)", "tpu", _flash_backward, 1e-3),
    # JAX's default dma_execution_mode="on_wait" leaves half a shard unwritten (NaN) here.
    Case(f"all_gather over {N_GATHER} devices, 64x128 each", "tpu", _all_gather, 0,
         jax_pltpu.InterpretParams(dma_execution_mode="eager")),
    Case("threefry bits 512²", "tpu", _threefry, 0),
    Case("philox bits 512²", "tpu", _philox, 0),
    Case("paged_attention, 6 seqs ≤128 tokens, GQA 8:2", "tpu", _paged_attention),
    Case("ragged_paged_attention, 3 seqs", "tpu", _ragged_paged_attention),
    Case("megablox gmm 512x256x256, 4 groups", "tpu", _gmm, 1e-3),
    Case("megablox gmm bwd (gmm + tgmm)", "tpu", _gmm_backward, 1e-3),
    Case("splash fwd, causal MHA 4x512x128", "tpu", lambda load: _splash(load, False)),
    Case("splash bwd (dq, dkv kernels)", "tpu", lambda load: _splash(load, True), 1e-3),
]

# --- timing ----------------------------------------------------------------------------------


def _time_way(case: Case, way: Way, warmup: int, repeats: int) -> dict[str, Any]:
    """First call and median of one way; ``{"error": ...}`` if it cannot run the kernel."""
    try:
        with way.context(case):
            fn, args = case.build(way.load)
            fn = jax.jit(fn)
            first = call_seconds(fn, args)
            out = jax.block_until_ready(fn(*args))
            median = median_seconds(fn, args, warmup, repeats)
    except Exception as e:  # a way that fails is reported, not fatal
        return {"error": _reason(e)}
    return {"first_s": first, "median_s": median, "out": out}


def _reason(e: Exception) -> str:
    """One line saying why a way failed: the innermost ``SomeError: ...`` line of the message
    (errors raised inside callbacks arrive wrapped), or where an error without one came from."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    inner = [ln for ln in lines if re.match(r"^\w+(Error|Exception)\b", ln)]
    if inner:
        return inner[-1][:110]
    if lines:
        return f"{type(e).__name__}: {lines[0][:90]}"
    frame = traceback.extract_tb(e.__traceback__)[-1]
    return f"{type(e).__name__} at {pathlib.Path(frame.filename).name}:{frame.lineno}"


def _agree(a: Any, b: Any, tol: float) -> bool:
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(leaves_a) == len(leaves_b) and all(
        np.allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), atol=tol, rtol=tol)
        for x, y in zip(leaves_a, leaves_b))


def _cell(r: dict[str, Any]) -> str:
    if "error" in r:
        return "fails: " + r["error"].replace("|", "/")
    return f"{r['median_s'] * 1e3:.1f} ms (first {r['first_s']:.2f} s)"


def run(cases: list[Case], warmup: int, repeats: int) -> list[str]:
    """Times every case both ways; returns the rows of the markdown table."""
    rows = []
    for case in cases:
        ours, theirs = (_time_way(case, way, warmup, repeats) for way in FAMILIES[case.family])
        if "error" in ours or "error" in theirs:
            ratio = "—"
        elif not _agree(ours["out"], theirs["out"], case.tolerance):
            ratio = "outputs differ"
        else:
            ratio = f"{theirs['median_s'] / ours['median_s']:.2f}"
        row = f"| {case.name} | {_cell(ours)} | {_cell(theirs)} | {ratio} |"
        print(row, flush=True)
        rows.append(row)
    return rows


def main() -> None:
    """Command line: ``--only`` (substrings of case names), ``--warmup``, ``--repeats``."""
    parser = command_line(__doc__, warmup=1, repeats=5)
    parser.add_argument("--only", nargs="*", default=[], help="run cases whose name has one "
                        "of these substrings")
    args = parser.parse_args()
    cases = [c for c in CASES if not args.only or any(s in c.name for s in args.only)]
    print(f"jax {jax.__version__}, {platform.machine()}, {jax.device_count()} CPU devices; "
          f"median of {args.repeats} calls after {args.warmup} warm-up\n")
    print("| kernel | this interpreter: median (first call) | JAX interpret mode: median "
          "(first call) | JAX / ours |")
    print("| --- | ---: | ---: | ---: |")
    run(cases, args.warmup, args.repeats)


if __name__ == "__main__":
    main()
