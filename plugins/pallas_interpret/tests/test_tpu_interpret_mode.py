"""TPU interpret mode (``interpret=pltpu.InterpretParams(...)``) against JAX's own: the same
kernel runs under ``jax.experimental.pallas`` with JAX's TPU interpret mode and under pallas
with ours, on random inputs, and results, visiting orders and errors must agree."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pallas_mosaic_tpu as pltpu
import pytest
from jax.experimental import pallas as jpl
from jax.experimental.pallas import tpu as jpltpu
from pallas_interpret import InterpretParams
from pallas_interpret.checks import HbmAccessError, RaceError, RaceWarning, RevisitError
from pallas_interpret.step_order import ParallelAxesError

import pallas_core as pl
from pallas_core.errors import OutOfBoundsError, PallasError

OURS = (pl, pltpu)
JAXS = (jpl, jpltpu)
V6E = jax.sharding.AbstractMesh(
    (), (), abstract_device=jax.sharding.AbstractDevice("TPU v6e", 1, "tpu"))


def _both(make: Callable[..., Any], *args: Any) -> tuple[Any, Any]:
    """``make(pl, pltpu)(*args)`` with ours and with JAX's modules."""
    return tuple(jax.block_until_ready(make(*mods)(*args)) for mods in (OURS, JAXS))


def _agree(ours: Any, theirs: Any) -> None:
    for a, b in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(theirs)):
        assert a.dtype == b.dtype and a.shape == b.shape
        if jnp.issubdtype(a.dtype, jnp.floating):  # NaNs compare equal in float32, not bf16
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _rand(shape: tuple[int, ...], seed: int = 0) -> Any:
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


# --- visiting order, cores, recorder ---------------------------------------------------------


class _Recorder:
    def __init__(self) -> None:
        self.points: list[tuple[tuple[int, ...], int]] = []

    def __call__(self, token: Any, point: Any, core: Any) -> Any:
        self.points.append((tuple(int(c) for c in point), int(core)))
        return token

    def by_core(self) -> list[tuple[tuple[int, ...], int]]:
        return sorted(self.points, key=lambda p: p[1])  # stable: each core's own order


def _counter(num_cores: int, seed: int | None, semantics: tuple[str, ...]) -> Any:
    """A kernel that numbers its steps with an SMEM counter (per core), and the recorder."""
    def make(pl: Any, pltpu: Any) -> Any:
        rec = _Recorder()

        def kernel(s_ref: Any, x_ref: Any, o_ref: Any) -> None:
            s = s_ref[0]
            s_ref[0] = s + 1
            o_ref[...] = x_ref[...] + s.astype(jnp.float32)

        call = pl.pallas_call(
            kernel, out_shape=jax.ShapeDtypeStruct((24, 512), jnp.float32), grid=(3, 4),
            in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM),
                      pl.BlockSpec((8, 128), lambda i, j: (i, j))],
            out_specs=pl.BlockSpec((8, 128), lambda i, j: (i, j)),
            interpret=pltpu.InterpretParams(random_seed=seed, num_cores_or_threads=num_cores,
                                            grid_point_recorder=rec),
            compiler_params=pltpu.CompilerParams(dimension_semantics=semantics))

        def run(s: Any, x: Any) -> Any:
            rec.points.clear()
            return call(s, x), rec
        return run
    return make


@pytest.mark.parametrize("num_cores", [1, 2, 3, 4])
@pytest.mark.parametrize("seed", [None, 7])
def test_cores_order_and_recorder_match_jax(num_cores: int, seed: int | None) -> None:
    """Steps are split between cores, shuffled along the parallel axis, and recorded, as in
    JAX: each core counts its own steps (its own SMEM copy of the counter)."""
    x = _rand((24, 512))
    (ours, ours_rec), (theirs, theirs_rec) = _both(
        _counter(num_cores, seed, ("parallel", "arbitrary")), jnp.zeros((1,), jnp.int32), x)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    assert ours_rec.by_core() == theirs_rec.by_core()
    assert len(ours_rec.points) == 12


def test_parallel_axes_must_lead_to_split_between_cores() -> None:
    make = _counter(2, None, ("arbitrary", "parallel"))(*OURS)
    with pytest.raises(ParallelAxesError, match=r"parallel axes \(1,\) .* do not lead"):
        make(jnp.zeros((1,), jnp.int32), _rand((24, 512)))
    assert issubclass(ParallelAxesError, ValueError)


def test_recorder_with_our_params() -> None:
    rec = _Recorder()

    def kernel(o_ref: Any) -> None:
        o_ref[...] = jnp.full(o_ref.shape, pl.program_id(0) * 10 + pl.program_id(1), jnp.int32)

    out = pl.pallas_call(kernel, jax.ShapeDtypeStruct((2, 3), jnp.int32), grid=(2, 3),
                         out_specs=pl.BlockSpec((1, 1), lambda i, j: (i, j)),
                         compiler_params=InterpretParams(grid_point_recorder=rec))()
    np.testing.assert_array_equal(out, [[0, 1, 2], [10, 11, 12]])
    assert rec.points == [((i, j), 0) for i in range(2) for j in range(3)]


# --- memory --------------------------------------------------------------------------------


@pytest.mark.parametrize("fill", ["nan", "zero"])
def test_uninitialized_memory_matches_jax(fill: str) -> None:
    """Unwritten scratch reads as JAX's TPU interpret mode fills it: NaN, and the integer
    maximum (not the minimum of plain interpret mode); zeros with "zero", checked mode too."""
    def make(pl: Any, pltpu: Any) -> Any:
        def kernel(o1: Any, o2: Any, o3: Any, t1: Any, t2: Any, t3: Any) -> None:
            o1[...], o2[...], o3[...] = t1[...], t2[...], t3[...]

        dtypes = (jnp.bfloat16, jnp.int16, jnp.int32)
        return pl.pallas_call(
            kernel, out_shape=[jax.ShapeDtypeStruct((8, 128), d) for d in dtypes],
            scratch_shapes=[pltpu.VMEM((8, 128), d) for d in dtypes],
            interpret=pltpu.InterpretParams(uninitialized_memory=fill))
    ours, theirs = _both(make)
    _agree(ours, theirs)
    if fill == "nan":
        assert int(ours[1][0, 0]) == np.iinfo(np.int16).max


def test_aliased_output_shares_its_input_buffer_as_in_jax() -> None:
    """Later steps read, through the aliased input, what earlier steps wrote to the output."""
    def make(pl: Any, pltpu: Any) -> Any:
        def kernel(x_ref: Any, o_ref: Any, s_ref: Any) -> None:
            @pl.when((pl.program_id(0) == 0) & (pl.program_id(1) == 0))
            def _() -> None:
                s_ref[0] = jnp.int32(0)

            s = s_ref[0]
            s_ref[0] = s + 1
            o_ref[...] = x_ref[...] * 0.5 + s.astype(jnp.float32)

        return pl.pallas_call(
            kernel, out_shape=jax.ShapeDtypeStruct((32, 512), jnp.float32), grid=(4, 4),
            in_specs=[pl.BlockSpec((8, 128), lambda i, j: (i, j))],
            out_specs=pl.BlockSpec((8, 128), lambda i, j: (j, i)),
            scratch_shapes=[pltpu.SMEM((1,), jnp.int32)], input_output_aliases={0: 0},
            interpret=pltpu.InterpretParams())
    x = _rand((32, 512))
    ours, theirs = _both(make, x)
    _agree(ours, theirs)


def test_input_block_is_refetched_only_when_its_index_changes_as_in_jax() -> None:
    """A kernel's write to an input block lasts while the block index stays, and is lost when
    it changes (the block is copied in again)."""
    def make(pl: Any, pltpu: Any) -> Any:
        def kernel(x_ref: Any, o_ref: Any) -> None:
            x_ref[...] += 1.0
            o_ref[...] = x_ref[...]

        return pl.pallas_call(
            kernel, out_shape=jax.ShapeDtypeStruct((3, 4, 8, 128), jnp.float32),
            grid=(3, 4),
            in_specs=[pl.BlockSpec((8, 128), lambda i, j: (0, j // 2))],
            out_specs=pl.BlockSpec((None, None, 8, 128), lambda i, j: (i, j, 0, 0)),
            interpret=pltpu.InterpretParams())
    x = _rand((8, 256))
    ours, theirs = _both(make, x)
    _agree(ours, theirs)


def test_revisiting_an_output_block_is_an_error() -> None:
    def make(pl: Any, pltpu: Any) -> Any:
        def kernel(o_ref: Any) -> None:
            o_ref[...] = jnp.ones(o_ref.shape, o_ref.dtype)

        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16, 128), jnp.float32),
                              grid=(2, 2), out_specs=pl.BlockSpec((8, 128), lambda i, j: (j, 0)),
                              interpret=pltpu.InterpretParams())
    with pytest.raises(Exception, match=r"Revisited block"):
        jax.block_until_ready(make(*JAXS)())
    with pytest.raises(RevisitError, match=re.escape(
            "Revisited block (0, 0) of output 0 in iteration (1, 0) of kernel 'kernel' "
            "(output 0 (o_ref), core 0): the core left the block after iteration (0, 0)")):
        make(*OURS)()
    assert issubclass(RevisitError, RuntimeError)


def test_hbm_refs_may_not_be_read_directly() -> None:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...]

    def call(space: Any, params: Any) -> Any:
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
                              in_specs=[pl.BlockSpec(memory_space=space)],
                              interpret=params)(_rand((8, 128)))

    for space in (pltpu.HBM, pl.ANY):
        with pytest.raises(HbmAccessError, match=r"reads input 0 \(x_ref\) directly, but it is "
                           r"in (HBM|ANY).*pltpu.sync_copy"):
            call(space, pltpu.InterpretParams())
        with pytest.raises(ValueError):
            call(space, pltpu.InterpretParams())
        # Our own params do not model TPU memory: the read is fine there.
        np.testing.assert_array_equal(call(space, InterpretParams()), _rand((8, 128)))


def test_hbm_allocation_in_run_scoped() -> None:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        def body(t_ref: Any) -> None:
            pltpu.sync_copy(x_ref, t_ref)
            pltpu.sync_copy(t_ref, o_ref)
        pl.run_scoped(body, pltpu.HBM((8, 128), jnp.float32))

    def call(allow: bool) -> Any:
        return pl.pallas_call(
            kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            interpret=pltpu.InterpretParams(allow_hbm_allocation_in_run_scoped=allow),
        )(_rand((8, 128)))

    with pytest.raises(ValueError, match=r"Cannot allocate HBM in `run_scoped` of kernel "
                       r"'kernel': it asks for a HBM buffer of shape \(8, 128\)"):
        call(False)
    np.testing.assert_array_equal(call(True), _rand((8, 128)))


# --- out-of-bounds accesses ----------------------------------------------------------------


def _dma_read_range(pl: Any, pltpu: Any, oob: str) -> Any:
    def kernel(x_ref: Any, o_ref: Any, sem: Any) -> None:
        pltpu.async_copy(x_ref.at[pl.ds(jnp.int32(4), 8), 1], o_ref, sem).wait()

    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
                          out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
                          in_specs=[pl.BlockSpec(memory_space=pltpu.HBM)],
                          scratch_shapes=[pltpu.SemaphoreType.DMA],
                          interpret=pltpu.InterpretParams(out_of_bounds_reads=oob))


def test_out_of_bounds_reads_uninitialized_match_jax() -> None:
    x = _rand((8, 4, 128))
    ours, theirs = _both(lambda pl, pltpu: _dma_read_range(pl, pltpu, "uninitialized"), x)
    _agree(ours, theirs)
    assert np.isnan(np.asarray(ours)[4:]).all()


def test_out_of_bounds_read_raises() -> None:
    with pytest.raises(Exception, match=r"Out-of-bounds read of input 0 \(x_ref\) in kernel "
                       r"'kernel' at grid step \(\): index starting at \(4, 1, 0\) with sizes "
                       r"\(8, 1, 128\) does not fit in the Ref's shape \(8, 4, 128\)"):
        jax.block_until_ready(_dma_read_range(pl, pltpu, "raise")(_rand((8, 4, 128))))


def test_out_of_bounds_scalar_reads_uninitialized_match_jax() -> None:
    def make(pl: Any, pltpu: Any) -> Any:
        def kernel(s_ref: Any, x_ref: Any, o_ref: Any) -> None:
            o_ref[0] = x_ref[s_ref[0]] + x_ref[s_ref[1]]

        return pl.pallas_call(
            kernel, out_shape=jax.ShapeDtypeStruct((1,), jnp.int32),
            in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM)] * 2,
            out_specs=pl.BlockSpec(memory_space=pltpu.SMEM),
            interpret=pltpu.InterpretParams(out_of_bounds_reads="uninitialized"))
    x = jax.random.randint(jax.random.key(1), (5,), 0, 100, jnp.int32)
    for s in ([1, 3], [2, 5]):
        ours, theirs = _both(make, jnp.array(s, jnp.int32), x)
        _agree(ours, theirs)


def test_out_of_bounds_write_is_reported_as_a_write_even_when_reads_are_lenient() -> None:
    def kernel(x_ref: Any, o_ref: Any, s_ref: Any) -> None:
        pltpu.sync_copy(x_ref.at[0], s_ref.at[10])
        o_ref[0, :] = s_ref[9, :]  # (a constant s_ref[10] would be refused at trace time)

    for oob in ("raise", "uninitialized"):
        f = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
                           in_specs=[pl.BlockSpec(memory_space=pltpu.HBM)],
                           scratch_shapes=[pltpu.VMEM((10, 128), jnp.float32)],
                           interpret=pltpu.InterpretParams(out_of_bounds_reads=oob))
        with pytest.raises(Exception, match=r"Out-of-bounds write to scratch 0 in kernel "
                           r"'kernel' at grid step \(\): index starting at \(10, 0\)"):
            jax.block_until_ready(f(_rand((8, 128))))


def test_out_of_bounds_block_index() -> None:
    def make(pl: Any, pltpu: Any, oob: str, offset: int) -> Any:
        def kernel(x_ref: Any, o_ref: Any) -> None:
            o_ref[...] = x_ref[...]

        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16, 128), jnp.float32),
                              grid=(4,), in_specs=[pl.BlockSpec((4, 128),
                                                                lambda i: (i + offset, 0))],
                              out_specs=pl.BlockSpec((4, 128), lambda i: (i, 0)),
                              interpret=pltpu.InterpretParams(out_of_bounds_reads=oob))
    x = _rand((16, 128))
    ours, theirs = _both(lambda pl, pltpu: make(pl, pltpu, "uninitialized", 1), x)
    _agree(ours, theirs)
    np.testing.assert_array_equal(np.asarray(ours)[:12], np.asarray(x)[4:])
    with pytest.raises(OutOfBoundsError, match=r"Out-of-bounds block index \(4, 0\) for input "
                       r"0 \(x_ref\) in kernel 'kernel' at grid step \(3,\)"):
        make(pl, pltpu, "raise", 1)(x)


# --- padded buffers ---------------------------------------------------------------------------


@pytest.mark.parametrize(("shape", "dtype", "rows"), [
    ((10, 128), jnp.float32, range(4, 12)),
    ((10, 150), jnp.float32, range(8, 16)),
    ((20, 128), jnp.bfloat16, range(16, 24)),
    ((5, 128), jnp.float32, range(2, 6)),
])
def test_padded_buffer_bounds_match_jax(shape: Any, dtype: Any, rows: Any) -> None:
    """With buffer_bounds="padded", accesses inside the TPU tile padding are fine: writes there
    are dropped and reads see uninitialized memory, as in JAX."""
    start, n = rows.start, len(rows)

    def make(pl: Any, pltpu: Any) -> Any:
        def kernel(x_ref: Any, o_ref: Any, s_ref: Any) -> None:
            s_ref[...] = jnp.zeros(s_ref.shape, s_ref.dtype)
            pltpu.sync_copy(x_ref, s_ref.at[pl.ds(jnp.int32(start), n), pl.ds(0, 128)])
            o_ref[...] = s_ref[pl.ds(jnp.int32(start), n), pl.ds(0, 128)]

        return pl.pallas_call(
            kernel, out_shape=jax.ShapeDtypeStruct((n, 128), dtype),
            in_specs=[pl.BlockSpec(memory_space=pltpu.HBM)],
            scratch_shapes=[pltpu.VMEM(shape, dtype)],
            interpret=pltpu.InterpretParams(buffer_bounds="padded",
                                            out_of_bounds_reads="uninitialized"))
    x = _rand((n, 128)).astype(dtype) + 1
    with jax.sharding.use_abstract_mesh(V6E):
        ours, theirs = _both(make, x)
    _agree(ours, theirs)


def test_padded_bounds_need_a_tpu_abstract_mesh() -> None:
    def kernel(o_ref: Any) -> None:
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    f = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
                       interpret=pltpu.InterpretParams(buffer_bounds="padded"))
    with pytest.raises(PallasError, match=r"abstract mesh in use names no TPU"):
        f()


# --- masked loads and stores ---------------------------------------------------------------


def test_pltpu_masked_store_and_load() -> None:
    """pltpu.store/load with a mask touch only the masked elements of a view, which may reach
    past the Ref where the mask is off; a set lane outside is an error."""
    def kernel(i_ref: Any, x_ref: Any, m_ref: Any, o_ref: Any, l_ref: Any) -> None:
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)
        view = o_ref.at[pl.ds(i_ref[0], 16), pl.ds(i_ref[1], 256)]
        pltpu.store(view, x_ref[...], mask=m_ref[...])
        loaded = pltpu.load(o_ref.at[pl.ds(i_ref[0], 16), pl.ds(i_ref[1], 256)],
                            mask=m_ref[...])
        l_ref[...] = jnp.where(m_ref[...], loaded, -1.0)

    def call(i: int, mask: Any) -> Any:
        shapes = [jax.ShapeDtypeStruct((16, 256), jnp.float32)] * 2
        return pl.pallas_call(kernel, out_shape=shapes,
                              grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1),
                              interpret=pltpu.InterpretParams(),
                              )(jnp.array([i, 128], jnp.int32), x, jnp.asarray(mask))

    x = _rand((16, 256))
    mask = np.zeros((16, 256), bool)
    mask[:4, :100] = True
    out, loaded = call(8, mask)
    want = np.zeros((16, 256), np.float32)
    want[8:12, 128:228] = np.asarray(x)[:4, :100]
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(loaded, np.where(mask, np.asarray(x), -1.0))
    mask[12, 200] = True  # row 8 + 12 = 20 of 16
    with pytest.raises(Exception, match=r"Out-of-bounds masked swap of output 0 \(o_ref\) in "
                       r"kernel 'kernel' .* \(in lanes where the mask is set\)"):
        jax.block_until_ready(call(8, mask))


# --- skipping floating-point operations ------------------------------------------------------


def test_skip_floating_point_ops_matches_jax() -> None:
    """Float results become inf and the float math is gone from the program; integer work and
    memory traffic still happen."""
    def make(pl: Any, pltpu: Any) -> Any:
        def kernel(x_ref: Any, y_ref: Any, n_ref: Any, z_ref: Any, c_ref: Any) -> None:
            z_ref[...] = jnp.tanh(x_ref[...] @ y_ref[...])
            c_ref[...] = n_ref[...] * 3 + 1

        return pl.pallas_call(
            kernel, out_shape=[jax.ShapeDtypeStruct((128, 128), jnp.float32),
                               jax.ShapeDtypeStruct((8, 128), jnp.int32)],
            interpret=pltpu.InterpretParams(skip_floating_point_ops=True))
    x, y = _rand((128, 256)), _rand((256, 128), 1)
    n = jax.random.randint(jax.random.key(2), (8, 128), -50, 50, jnp.int32)
    ours, theirs = _both(make, x, y, n)
    _agree(ours, theirs)
    assert np.isinf(np.asarray(ours[0])).all()
    np.testing.assert_array_equal(ours[1], np.asarray(n) * 3 + 1)
    text = jax.jit(make(*OURS)).lower(x, y, n).as_text()
    assert "dot_general" not in text and "tanh" not in text


def test_skip_floating_point_ops_inside_loops() -> None:
    def kernel(x_ref: Any, o_ref: Any, k_ref: Any) -> None:
        def body(i: Any, acc: Any) -> Any:
            k_ref[i] = i * 2
            return acc + jnp.exp(x_ref[...])
        o_ref[...] = jax.lax.fori_loop(0, 4, body, jnp.zeros(o_ref.shape, o_ref.dtype))

    f = pl.pallas_call(kernel, out_shape=[jax.ShapeDtypeStruct((8, 128), jnp.float32),
                                          jax.ShapeDtypeStruct((4,), jnp.int32)],
                       out_specs=[pl.BlockSpec(memory_space=pltpu.VMEM),
                                  pl.BlockSpec(memory_space=pltpu.SMEM)],
                       interpret=pltpu.InterpretParams(skip_floating_point_ops=True))
    out, k = f(_rand((8, 128)))
    assert np.isinf(np.asarray(out)).all()
    np.testing.assert_array_equal(k, [0, 2, 4, 6])
    assert "exponential" not in jax.jit(f).lower(_rand((8, 128))).as_text()


# --- races, forced mode ----------------------------------------------------------------------


def _shared_block(params: Any) -> Any:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...] * 2.0

    return pl.pallas_call(kernel, grid=(2,), out_shape=jax.ShapeDtypeStruct((8, 128),
                                                                              jnp.float32),
                          compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
                          interpret=params)


def test_races_between_cores_warn_with_jax_params() -> None:
    """As JAX does, TPU interpret mode reports races between cores and runs on; one core has
    none. Our own params raise."""
    x = _rand((8, 128))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = _shared_block(pltpu.InterpretParams(detect_races=True))(x)
    np.testing.assert_array_equal(out, np.asarray(x) * 2)
    with pytest.warns(RaceWarning, match=r"block \(0, 0\) is written at grid steps \(0,\) and "
                      r"\(1,\), which run on cores 0 and 1"):
        out = _shared_block(pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2))(x)
    np.testing.assert_array_equal(out, np.asarray(x) * 2)
    with pytest.raises(RaceError, match="parallel grid axis 0"):
        _shared_block(InterpretParams(checked=True))(x)


def test_forced_tpu_interpret_mode_replaces_the_calls_own() -> None:
    """force_tpu_interpret_mode's params win over the interpret= a call passes, as in JAX."""
    def kernel(o_ref: Any, t_ref: Any) -> None:
        o_ref[...] = t_ref[...]

    f = jax.jit(pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
                               scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32)],
                               interpret=pltpu.InterpretParams()))
    assert np.isnan(np.asarray(f())).all()
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams(uninitialized_memory="zero")):
        np.testing.assert_array_equal(f(), np.zeros((8, 128), np.float32))
    assert np.isnan(np.asarray(f())).all()


def test_barrier_kernels_run_with_jax_params_but_refuse_cores_and_recorder() -> None:
    """A SparseCore kernel with a barrier runs in lockstep under pltpu.InterpretParams; several
    simulated cores or a recorder are not simulated there, and are refused by name."""
    plsc = pytest.importorskip("pallas_sparsecore")
    from jax import lax

    def run(params: Any) -> Any:
        mesh = plsc.VectorSubcoreMesh(core_axis_name="c", subcore_axis_name="s", num_cores=1,
                                      num_subcores=4, target="v7x")

        @pl.kernel(out_type=jax.ShapeDtypeStruct((4, 16), jnp.float32), mesh=mesh,
                   interpret=params,
                   scratch_types=[plsc.VMEM_SHARED((4, 16), jnp.float32),
                                  pltpu.VMEM((16,), jnp.float32)])
        def k(x_hbm: Any, o_hbm: Any, shared: Any, mine: Any) -> None:
            s = lax.axis_index("s")
            pltpu.sync_copy(x_hbm.at[s], shared.at[s])
            plsc.subcore_barrier()
            pltpu.sync_copy(shared.at[(s + 1) % 4], mine)
            pltpu.sync_copy(mine, o_hbm.at[s])
        return k(x)

    x = _rand((4, 16))
    np.testing.assert_array_equal(run(pltpu.InterpretParams()), np.roll(np.asarray(x), -1, 0))
    with pytest.raises(PallasError, match=r"has barriers.*neither several cores nor a "
                       r"grid_point_recorder"):
        run(pltpu.InterpretParams(grid_point_recorder=_Recorder()))


def test_translation_of_jax_style_params() -> None:
    """pltpu.InterpretParams become the TPU model (always shuffled, seed 0 when unset); JAX's
    GPU interpret params (no TPU fields) only checked mode with their shared fields."""
    import types

    from pallas_interpret.params import from_interpret_arg

    tpu = from_interpret_arg(pltpu.InterpretParams(num_cores_or_threads=3))
    assert (tpu.tpu_memory, tpu.shuffle_seed, tpu.num_cores, tpu.on_race) == (True, 0, 3, "warn")
    assert not tpu.allow_hbm_allocation_in_run_scoped
    gpu = from_interpret_arg(types.SimpleNamespace(
        detect_races=True, out_of_bounds_reads="uninitialized", uninitialized_memory="zero",
        num_cores_or_threads=4, skip_floating_point_ops=False))
    assert (gpu.tpu_memory, gpu.shuffle_seed, gpu.num_cores) == (False, None, 1)
    assert (gpu.checked, gpu.detect_races, gpu.out_of_bounds_reads, gpu.fill) == (
        True, True, "uninitialized", "zero")
    assert from_interpret_arg(True) == InterpretParams()
