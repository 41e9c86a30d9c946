"""The operations that were gaps of the rule parity (``test_gpu_rule_parity.py``), lowered as
JAX's own Mosaic GPU lowering lowers them.

Each kernel is written twice, with ``jax.experimental.pallas`` and with this project, lowered
for ``cuda`` by both (JAX's with its lane semantics, the one this backend follows; ``relayout``
in warpgroup semantics, the only ones where JAX lowers it), each module parsed back and
verified, and the operations that carry the feature (the PTX of inline
assembly by its text, ``gpu.printf``, ``cf.assert``, the arithmetic of a reduction) counted in
both: the counts must be equal and not zero. Kernels that compute values also run in the
interpreter against ``jax.numpy`` on random inputs.
"""

from __future__ import annotations

import collections
import functools
import inspect
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import pallas_core as pl
from pallas_core import backend as plb

plgpu = pytest.importorskip("pallas_mosaic_gpu")
jpl = pytest.importorskip("jax.experimental.pallas")
jgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
from jax.experimental.mosaic import gpu as mgpu  # noqa: E402
from pallas_mosaic_gpu import inspection, targets  # noqa: E402

S = jax.ShapeDtypeStruct
F32 = jnp.float32
OURS = (pl, plgpu)
JAXS = (jpl, jgpu)


def _rand(seed: int, shape: tuple[int, ...], dtype: Any = F32) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape, F32).astype(dtype)


def op_kinds(module: Any) -> collections.Counter[str]:
    """Every operation of ``module`` by name; inline assembly by its text as well
    (``llvm.inline_asm:nanosleep.u32 $0;``), shuffles by their kind (``nvvm.shfl.sync:bfly``)."""
    found: collections.Counter[str] = collections.Counter()

    def walk(op: Any) -> None:
        name = op.operation.name
        if name == "llvm.inline_asm":
            name += ":" + str(op.operation.attributes["asm_string"]).strip('"')
        elif name == "nvvm.shfl.sync":  # bfly: a reduction's; idx: picking one thread
            kind = str(op.operation.attributes["kind"])  # #nvvm.shfl_kind<bfly>, #nvvm<...>
            name += ":" + kind.rstrip(">").replace("<", " ").split()[-1]
        found[name] += 1
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    walk(inner)

    walk(module.operation)
    return found


def _lowered(fn: Any, *args: Any) -> collections.Counter[str]:
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    (found,) = inspection.kernels(text)  # hash checked, parsed back and verified
    return op_kinds(found[1])


def _kernel(mods: tuple[Any, Any], body: Any, out: Any, scratch: Any = (),
            semantics: str = "Lane", **kw: Any) -> Any:
    """``plgpu.kernel`` of either project, in lane semantics unless ``semantics`` names
    another (this backend lowers both alike); JAX 0.11 renamed ``out_shape`` and
    ``scratch_shapes`` to ``out_type`` and ``scratch_types`` (this backend takes both)."""
    gpu = mods[1]
    new = "out_type" in inspect.signature(gpu.kernel).parameters
    params = gpu.CompilerParams(lowering_semantics=getattr(gpu.LoweringSemantics, semantics))
    return gpu.kernel(body, **{"out_type" if new else "out_shape": out,
                               "scratch_types" if new else "scratch_shapes": list(scratch)},
                      compiler_params=params, **kw)


def _wgmma_read(gpu: Any, ref: Any) -> Any:
    """``ref`` (an untiled SMEM buffer, which no vectorised read without bank conflicts
    takes) read into the wgmma register layout (JAX 0.10's ``load`` needs an index)."""
    idx = inspect.signature(gpu.load).parameters.get("idx")
    args = ((),) if idx is not None and idx.default is inspect.Parameter.empty else ()
    return gpu.load(ref, *args, layout=gpu.Layout.WGMMA, optimized=False)


def _through_smem(mods: tuple[Any, Any], compute: Any, shape: tuple[int, ...],
                  out_shape: tuple[int, ...], semantics: str = "Lane") -> Any:
    """A kernel storing ``compute(gpu, x_smem)`` for ``x`` of ``shape``, both ways by TMA
    through SMEM (JAX's library reads and writes GMEM arrays in the wgmma layout only from
    JAX 0.12 on)."""
    gpu = mods[1]

    def body(x_ref: Any, o_ref: Any, x_smem: Any, o_smem: Any, bar: Any) -> None:
        gpu.copy_gmem_to_smem(x_ref, x_smem, bar)
        gpu.barrier_wait(bar)
        o_smem[...] = compute(gpu, x_smem)
        gpu.commit_smem()
        gpu.copy_smem_to_gmem(o_smem, o_ref)
        gpu.wait_smem_to_gmem(0)

    return _kernel(mods, body, S(out_shape, F32), [
        gpu.SMEM(shape, F32), gpu.SMEM(out_shape, F32), gpu.Barrier(num_arrivals=1)],
        semantics=semantics)


def _agree(make: Any, args: tuple[Any, ...], kinds: list[str]) -> collections.Counter[str]:
    """Lowers ``make(pl, plgpu)`` and ``make(jpl, jgpu)``; ``kinds`` are emitted by JAX's and
    as often by ours. Returns their counts."""
    theirs, ours = _lowered(make(*JAXS), *args), _lowered(make(*OURS), *args)
    want = {k: theirs[k] for k in kinds}
    assert all(want.values()), f"JAX's lowering emits none of some of {want}"
    assert {k: ours[k] for k in kinds} == want
    return collections.Counter(want)


def _run(fn: Any, *args: Any) -> Any:
    from pallas_core.call import force_interpret_mode

    with force_interpret_mode():
        return fn(*args)


# --- grid-dependency control, delay, semaphore_read ---------------------------------------------


def _doubled(mods: tuple[Any, Any], before: Any = None, after: Any = None) -> Any:
    def body(x_ref: Any, o_ref: Any) -> None:
        if before is not None:
            before(mods)
        o_ref[...] = x_ref[...] * 2.0
        if after is not None:
            after(mods)
    return _kernel(mods, body, S((64, 128), F32))


def test_griddepcontrol_emits_ptxs_instructions() -> None:
    x = _rand(0, (64, 128))

    def make(*mods: Any) -> Any:
        return _doubled(mods, lambda m: m[1].griddepcontrol_wait(),
                        lambda m: m[1].griddepcontrol_launch_dependents())

    counts = _agree(make, (x,), ["llvm.inline_asm:griddepcontrol.wait;",
                                 "llvm.inline_asm:griddepcontrol.launch_dependents;"])
    assert set(counts.values()) == {1}
    np.testing.assert_allclose(_run(make(*OURS), x), x * 2.0, rtol=1e-6)


def test_delay_is_nanosleep() -> None:
    x = _rand(1, (64, 128))

    def make(*mods: Any) -> Any:
        return _doubled(mods, lambda m: m[0].delay(100))

    assert _agree(make, (x,), ["llvm.inline_asm:nanosleep.u32 $0;"])
    np.testing.assert_allclose(_run(make(*OURS), x), x * 2.0, rtol=1e-6)

    # A delay computed in the kernel (JAX's lane lowering takes constants only).
    def computed(x_ref: Any, o_ref: Any) -> None:
        pl.delay(jax.lax.axis_index("x") * 50 + 10)
        o_ref[...] = x_ref[...] * 2.0

    kernel = _kernel(OURS, computed, S((64, 128), F32), grid=(2,), grid_names=("x",))
    assert _lowered(kernel, x)["llvm.inline_asm:nanosleep.u32 $0;"] == 1


def test_semaphore_read_is_an_acquiring_load() -> None:
    x = _rand(2, (64, 128))

    def make(p: Any, gpu: Any) -> Any:
        def body(x_ref: Any, o_ref: Any, sem: Any) -> None:
            p.semaphore_signal(sem, 3)
            p.semaphore_wait(sem, 1)
            o_ref[...] = x_ref[...] + p.semaphore_read(sem).astype(F32)
        return _kernel((p, gpu), body, S((64, 128), F32), [gpu.SemaphoreType.REGULAR])

    _agree(make, (x,), ["llvm.inline_asm:ld.acquire.sys.u32 $0,[$1];"])
    np.testing.assert_allclose(_run(make(*OURS), x), x + 2.0, rtol=1e-6)


# --- reduce_prod, concatenate ------------------------------------------------------------------


@pytest.mark.parametrize("reduce", ["prod", "sum"])
def test_row_products_reduce_as_jaxs(reduce: str) -> None:
    """``jnp.prod`` of rows in the wgmma layout multiplies and shuffles as ``jnp.sum`` adds,
    in both lowerings."""
    x = 1.0 + 0.05 * _rand(3, (64, 128))
    fn = getattr(jnp, reduce)

    def make(*mods: Any) -> Any:
        return _through_smem(mods, lambda gpu, ref: fn(_wgmma_read(gpu, ref), axis=1),
                             (64, 128), (64,))

    op = "arith.mulf" if reduce == "prod" else "arith.addf"
    try:
        _agree(make, (x,), [op, "nvvm.shfl.sync:bfly"])
    except NotImplementedError:  # JAX 0.10's lane semantics have no reduce_prod: as jnp.sum
        assert reduce == "prod"
        ours = _lowered(make(*OURS), x)
        sums = _lowered(_through_smem(OURS, lambda gpu, ref: jnp.sum(_wgmma_read(gpu, ref),
                                                                     axis=1), (64, 128), (64,)), x)
        assert (ours["arith.mulf"], ours["nvvm.shfl.sync:bfly"]) == (
            sums["arith.addf"], sums["nvvm.shfl.sync:bfly"]) and ours["arith.mulf"]
    np.testing.assert_allclose(_run(make(*OURS), x), fn(x, axis=1), rtol=1e-5)


def _concatenated(mods: tuple[Any, Any], shape: tuple[int, ...], axis: int, wgmma: bool,
                  constant: bool = False) -> Any:
    out = list(shape)
    out[axis] *= 2

    def body(x_ref: Any, y_ref: Any, o_ref: Any) -> None:
        read = functools.partial(_wgmma_read, mods[1]) if wgmma else (lambda r: r[...])
        second = jnp.full(shape, 3.0, F32) if constant else read(y_ref) * 2.0
        o_ref[...] = jnp.concatenate([read(x_ref), second], axis=axis) + 1.0
    return _kernel(mods, body, S(tuple(out), F32))


CONCATENATIONS = [((64, 128), 0, True), ((64, 128), 1, True), ((256,), 0, False)]


@pytest.mark.parametrize(("shape", "axis", "wgmma"), CONCATENATIONS,
                         ids=["wgmma-rows", "wgmma-columns", "strided"])
def test_concatenate_as_jaxs(shape: tuple[int, ...], axis: int, wgmma: bool) -> None:
    """The registers of the operands side by side: nothing is emitted for the concatenation,
    and what follows computes on as many registers in both lowerings."""
    x, y = _rand(4, shape), _rand(5, shape)

    def make(*mods: Any) -> Any:
        return _concatenated(mods, shape, axis, wgmma)

    if not hasattr(mgpu, "concatenate"):  # JAX 0.10: neither lowering has it
        with pytest.raises(Exception):  # noqa: B017 - JAX's error types vary by version
            _lowered(make(*JAXS), x, y)
        with pytest.raises(pl.UnsupportedError, match="concatenate"):
            _lowered(make(*OURS), x, y)
    else:
        _agree(make, (x, y), ["arith.addf", "arith.mulf"])
    want = jnp.concatenate([x, y * 2.0], axis=axis) + 1.0
    np.testing.assert_allclose(_run(make(*OURS), x, y), want, rtol=1e-6)


@pytest.mark.skipif(not hasattr(mgpu, "concatenate"), reason="JAX 0.11's library")
def test_concatenate_with_a_constant() -> None:
    x = _rand(6, (64, 128))
    kernel = _concatenated(OURS, (64, 128), 0, wgmma=True, constant=True)
    assert _lowered(kernel, x, x)["arith.addf"]
    want = jnp.concatenate([x, jnp.full_like(x, 3.0)]) + 1.0
    np.testing.assert_allclose(_run(kernel, x, x), want, rtol=1e-6)


# --- debug_print, checks -----------------------------------------------------------------------


def _printing(p: Any, gpu: Any) -> Any:
    def body(x_ref: Any, o_ref: Any) -> None:
        v = _wgmma_read(gpu, x_ref)
        p.debug_print("row sums {}", jnp.sum(v, axis=1))
        p.debug_print("block {} first {}", jax.lax.axis_index("x"), x_ref[0, 0])
        o_ref[...] = v + 1.0
    return _kernel((p, gpu), body, S((64, 128), F32), grid=(2,), grid_names=("x",))


def test_debug_print_as_jaxs(capfd: Any) -> None:
    """Scalars by one thread, an array by every thread for its elements: ``gpu.printf`` as
    often as in JAX's module."""
    x = _rand(7, (64, 128))
    assert _agree(_printing, (x,), ["gpu.printf"])
    np.testing.assert_allclose(_run(_printing(*OURS), x), x + 1.0, rtol=1e-6)
    jax.effects_barrier()
    printed = capfd.readouterr().out
    assert "row sums" in printed and "block" in printed


def test_debug_print_refuses_what_jax_refuses() -> None:
    def body(x_ref: Any, o_ref: Any) -> None:
        v = x_ref[...]
        pl.debug_print("{} {}", v, v)
        o_ref[...] = v

    with pytest.raises(pl.UnsupportedError, match="debug_print of an array together"):
        _lowered(_kernel(OURS, body, S((128,), F32)), jnp.zeros((128,), F32))


def _checked(check: Any) -> Any:
    def make(p: Any, gpu: Any) -> Any:
        def body(x_ref: Any, o_ref: Any) -> None:
            check(p, x_ref[0] > 0.0)
            o_ref[...] = x_ref[...] * 2.0
        return _kernel((p, gpu), body, S((128,), F32))
    return make


CHECKS = {
    "pl.debug_check": lambda p, ok: p.debug_check(ok, "the first element is positive"),
    "checkify.debug_check": lambda p, ok: checkify.debug_check(ok, "first must be positive"),
}


@pytest.mark.parametrize("how", sorted(CHECKS))
def test_checks_assert_while_enabled(how: str) -> None:
    """While ``pl.enable_debug_checks`` is on, a check is ``cf.assert`` of its condition (in
    JAX's lowering and here); off, nothing is emitted. JAX's ``pl.debug_check`` is
    ``checkify``'s check; this project's is a primitive of its own."""
    x = jnp.abs(_rand(8, (128,))) + 0.5
    make = _checked(CHECKS[how])
    with pl.enable_debug_checks(True):
        assert _agree(make, (x,), ["cf.assert"])["cf.assert"] == 1
        np.testing.assert_allclose(_run(make(*OURS), x), x * 2.0, rtol=1e-6)
    assert _lowered(make(*OURS), x)["cf.assert"] == 0


def test_a_failed_check_is_reported_by_the_interpreter() -> None:
    x = -jnp.abs(_rand(9, (128,))) - 0.5
    with pl.enable_debug_checks(True), pytest.raises(Exception, match="positive"):
        jax.block_until_ready(_run(_checked(CHECKS["pl.debug_check"])(*OURS), x))


def test_a_functionalized_check_is_refused_by_name() -> None:
    def body(x_ref: Any, o_ref: Any) -> None:
        checkify.check(x_ref[0] > 0.0, "positive")
        o_ref[...] = x_ref[...]

    with pytest.raises(pl.UnsupportedError, match=r"checkify\.check"):
        _lowered(_kernel(OURS, body, S((128,), F32)), jnp.ones((128,), F32))


# --- atomics (plgpu.atomic_*: the core's atomic primitive) -------------------------------------


@pytest.mark.parametrize(("dtype", "ops"), [(jnp.int32, ("add", "max", "min", "and", "or",
                                                         "xor")), (F32, ("add",))],
                         ids=["int32", "float32"])
def test_atomics_emit_jaxs_reductions(dtype: Any, ops: tuple[str, ...]) -> None:
    """JAX binds ``mgpu_atomic_store`` for ``plgpu.atomic_add`` and the others; this backend
    the core's atomic primitive. Both emit one PTX ``red`` per vector of elements and
    operation."""
    x = (_rand(10, (256,)) * 8).astype(dtype)
    y = (_rand(11, (256,)) * 8).astype(dtype)

    def make(p: Any, gpu: Any) -> Any:
        def body(x_ref: Any, y_ref: Any, o_ref: Any) -> None:
            o_ref[...] = x_ref[...]
            for op in ops:
                getattr(gpu, f"atomic_{op}")(o_ref, y_ref[...])
        return _kernel((p, gpu), body, S((256,), dtype))

    theirs = _lowered(make(*JAXS), x, y)
    reds = [k for k in theirs if k.startswith("llvm.inline_asm:") and " red." in f" {k[16:]}"]
    assert len(reds) == len(ops)
    _agree(make, (x, y), reds)
    want = x
    for op in ops:
        want = {"add": jnp.add, "max": jnp.maximum, "min": jnp.minimum, "and": jnp.bitwise_and,
                "or": jnp.bitwise_or, "xor": jnp.bitwise_xor}[op](want, y)
    np.testing.assert_allclose(_run(make(*OURS), x, y), want, rtol=1e-6)


# --- async_copy_smem_to_tmem -------------------------------------------------------------------


def _smem_to_tmem(p: Any, gpu: Any, tiled: bool = True) -> Any:
    def body(x_ref: Any, o_ref: Any, smem: Any, tmem: Any, bar: Any, tc_bar: Any) -> None:
        gpu.copy_gmem_to_smem(x_ref, smem, bar)
        gpu.barrier_wait(bar)
        gpu.async_copy_smem_to_tmem(smem, tmem)
        gpu.tcgen05_commit_arrive(tc_bar)
        gpu.barrier_wait(tc_bar)
        o_ref[...] = gpu.async_load_tmem(tmem) + 1.0
        gpu.wait_load_tmem()

    transforms = (gpu.TilingTransform((8, 32)), gpu.SwizzleTransform(128)) if tiled else ()
    return _kernel((p, gpu), body, S((128, 128), F32), [
        gpu.SMEM((128, 128), F32, transforms=transforms), gpu.TMEM((128, 128), F32),
        gpu.Barrier(num_arrivals=1), gpu.Barrier(num_arrivals=1, orders_tensor_core=True)])


def test_async_copy_smem_to_tmem_is_tcgen05_cp() -> None:
    """A tiled SMEM buffer goes to TMEM by ``tcgen05.cp`` from one thread, as in JAX's
    lowering (both built for sm_100a); the interpreter copies it."""
    x = _rand(12, (128, 128))
    with targets.assume(targets.BLACKWELL):
        theirs = _lowered(_smem_to_tmem(*JAXS), x)
        tcgen05 = [k for k in theirs if "tcgen05" in k]
        assert any("tcgen05.cp" in k for k in tcgen05)
        _agree(_smem_to_tmem, (x,), tcgen05)
    np.testing.assert_allclose(_run(_smem_to_tmem(*OURS), x), x + 1.0, rtol=1e-6)


def test_async_copy_smem_to_tmem_from_an_untiled_buffer() -> None:
    """JAX's lowering refuses an untiled source (``tcgen05.cp`` reads tiles); here it is read
    into registers and stored to TMEM (``tcgen05.st``)."""
    x = _rand(13, (128, 128))
    with targets.assume(targets.BLACKWELL):
        ours = _lowered(_smem_to_tmem(*OURS, tiled=False), x)
    assert not any("tcgen05.cp" in k for k in ours)
    assert any("tcgen05.st" in k for k in ours)
    np.testing.assert_allclose(_run(_smem_to_tmem(*OURS, tiled=False), x), x + 1.0, rtol=1e-6)


# --- relayout (jax.experimental.layout.explicit_layout) ----------------------------------------


def _explicit(p: Any, gpu: Any) -> Any:
    """``v + v`` computed in the wgmma register layout that ``explicit_layout`` gives ``v``;
    JAX's lowering takes it in warpgroup semantics only."""
    def compute(gpu: Any, ref: Any) -> Any:
        v = ref[...]

        @functools.partial(plb.explicit_layout,
                           in_layouts=plb.mosaic_gpu_explicit_layout(v, jgpu.Layout.WGMMA))
        def doubled(v: Any) -> Any:
            return v + v

        return doubled(v)

    return _through_smem((p, gpu), compute, (64, 128), (64, 128), semantics="Warpgroup")


@pytest.mark.skipif(plb.relayout_p is None, reason="JAX 0.11's explicit layouts")
def test_relayout_casts_into_the_layout() -> None:
    """A Mosaic GPU register layout given by ``explicit_layout`` is a cast into it and
    ``AutoLayout`` hands the value back, as in JAX's (warpgroup) lowering: the SMEM reads
    and the sum are as many as in JAX's module, and the reads are not those of the layout
    chosen without the cast."""
    x = _rand(14, (64, 128))
    counts = _agree(_explicit, (x,), ["arith.addf", "llvm.load"])
    plain = _through_smem(OURS, lambda gpu, ref: ref[...] + ref[...], (64, 128), (64, 128))
    assert _lowered(plain, x)["llvm.load"] != counts["llvm.load"]
    np.testing.assert_allclose(_run(_explicit(*OURS), x), x + x, rtol=1e-6)


# --- lax.switch with more than two branches --------------------------------------------------


def test_a_switch_of_four_branches_is_an_index_switch() -> None:
    """``lax.switch`` over four branches on the block's index: ``scf.index_switch`` (the last
    branch its default, as JAX lowers it); in the interpreter each block takes its branch, the
    index clamped as ``lax.switch`` clamps it."""
    x = _rand(11, (64, 128))

    def make(p: Any, gpu: Any) -> Any:
        def body(x_ref: Any, o_ref: Any) -> None:
            b = jax.lax.axis_index("x")

            def branch(k: int) -> Any:
                def write() -> None:
                    o_ref[b] = x_ref[...] * (k + 1.0) + k
                return write

            jax.lax.switch(b * 2, [branch(k) for k in range(4)])

        return _kernel((p, gpu), body, S((3, 64, 128), F32), grid=(3,), grid_names=("x",))

    if jax.__version_info__ >= (0, 11):
        assert _agree(make, (x,), ["scf.index_switch"])["scf.index_switch"] == 1
    else:  # JAX 0.10's module holds a second copy of the switch (its result-type probe)
        assert _lowered(make(*OURS), x)["scf.index_switch"] == 1
    want = jnp.stack([x * (k + 1.0) + k for k in (0, 2, 3)])  # branches min(2b, 3)
    np.testing.assert_allclose(_run(make(*OURS), x), want, rtol=1e-6, atol=1e-5)


# --- while loops carrying arrays ---------------------------------------------------------------


def _halving_loop(p: Any, gpu: Any, splat: bool = False) -> Any:
    """``acc = acc / 2 + x`` five times in a ``lax.while_loop`` that is no ``fori_loop``."""
    def body(x_ref: Any, o_ref: Any) -> None:
        def step(c: Any) -> Any:
            i, acc = c
            return i + 1, acc * 0.5 + x_ref[...]

        init = jnp.zeros((64, 128), F32) if splat else x_ref[...]
        _, acc = jax.lax.while_loop(lambda c: c[0] < 5, step, (jnp.int32(0), init))
        o_ref[...] = acc

    return _kernel((p, gpu), body, S((64, 128), F32))


def test_a_while_loop_carries_arrays_in_registers() -> None:
    """A general ``lax.while_loop`` carrying an array: one ``scf.while`` whose carried values
    are the array's registers, as JAX lowers it; a splat carry (which JAX's lowering refuses)
    takes the layout the body gives it. The interpreter matches jax.numpy."""
    x = _rand(12, (64, 128))
    theirs = _agree(lambda p, gpu: _halving_loop(p, gpu), (x,), ["scf.while"])
    assert theirs["scf.while"] == 1
    for splat in (False, True):
        want = jnp.zeros_like(x) if splat else x
        for _ in range(5):
            want = want * 0.5 + x
        np.testing.assert_allclose(_run(_halving_loop(*OURS, splat=splat), x), want,
                                   rtol=1e-6, atol=1e-6)
    assert _lowered(_halving_loop(*OURS, splat=True), x)["scf.while"] == 1


# --- conditionals returning arrays ---------------------------------------------------------


def _branching(p: Any, gpu: Any, splat: bool = False) -> Any:
    """Each block returns ``x * 2`` from one branch and ``x + 1`` (or zeros) from the other."""
    def body(x_ref: Any, o_ref: Any) -> None:
        b = jax.lax.axis_index("x")
        other = (lambda: jnp.zeros((64, 128), F32)) if splat else (lambda: x_ref[...] + 1.0)
        o_ref[b] = jax.lax.cond(b == 0, lambda: x_ref[...] * 2.0, other)

    return _kernel((p, gpu), body, S((2, 64, 128), F32), grid=(2,), grid_names=("x",))


def _conditional_results(fn: Any, *args: Any) -> int:
    """How many values the kernel's conditional (``scf.if`` or ``scf.index_switch``)
    yields."""
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    (found,) = inspection.kernels(text)
    counts = []

    def walk(op: Any) -> None:
        if op.operation.name in ("scf.if", "scf.index_switch"):
            counts.append(len(op.operation.results))
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    walk(inner)

    walk(found[1].operation)
    # JAX 0.10's module holds a second copy without results (its result-type probe).
    return max(counts)


def test_a_conditional_returns_arrays_as_their_registers() -> None:
    """``lax.cond`` returning an array: the conditional yields the array's registers, as many
    as JAX's lowering yields; a splat branch takes the other branch's layout. The interpreter
    matches jax.numpy."""
    x = _rand(13, (64, 128))
    assert _conditional_results(_branching(*OURS), x) == _conditional_results(
        _branching(*JAXS), x) > 1
    for splat in (False, True):
        want = jnp.stack([x * 2.0, jnp.zeros_like(x) if splat else x + 1.0])
        np.testing.assert_allclose(_run(_branching(*OURS, splat=splat), x), want, rtol=1e-6)
    assert _conditional_results(_branching(*OURS, splat=True), x) > 1
