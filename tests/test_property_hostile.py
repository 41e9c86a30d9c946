"""Hostile kernels, specs and grids, generated: each must either give JAX's result or raise a
``PallasError``, never another exception and never a silently different result.

Examples mix valid and invalid set-ups: block shapes that do not divide the array, that are 0,
negative, larger than it or of the wrong rank; index maps out of bounds (offsets, constants,
reversed), returning too many or too few indices, taking too few arguments; empty grids and
zero-size arrays; dtypes the interpreter or JAX may refuse. When ours runs, its output must
agree with ``jax.experimental.pallas`` (``interpret=True``) on every element some grid step
writes, and with ``jax.numpy`` when the blocks cover the array once.

The same holds for atomics whose lanes repeat an element (against a sequential model) and for
``pl.emulate`` on random targets (refusing exactly what ``pl.stages`` refuses). A small budget
runs in CI; ``PALLAS_PROPERTY_EXAMPLES=2000`` (``tox -e property``) runs 2000 of each.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.experimental import pallas as jpl

import pallas_core as pl

EXAMPLES = int(os.environ.get("PALLAS_PROPERTY_EXAMPLES", "60"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))

DTYPES = ["float32", "int32", "float16", "bfloat16", "bool", "float64", "int8", "uint32"]


@st.composite
def dimension_blocks(draw: Any, n: int) -> Any:
    """A block size for a dimension of size ``n``: valid or not."""
    kind = draw(st.sampled_from(["divisor"] * 6 + ["any"] * 3 + ["whole", "none"] * 2
                                + ["zero", "negative", "big"]))
    if kind == "divisor":
        return draw(st.sampled_from([d for d in range(1, n + 1) if n % d == 0] or [1]))
    return {"any": draw(st.integers(1, max(n, 1))), "whole": n, "none": None, "zero": 0,
            "negative": -2, "big": n + draw(st.integers(1, 3))}[kind]


@st.composite
def index_terms(draw: Any, rank: int, grid_rank: int) -> list[tuple[str, int, int]]:
    """Per output dimension ``(kind, grid axis, constant)``; possibly the wrong count."""
    count = rank + draw(st.sampled_from([0] * 8 + [-1, 1]))
    kinds = ["axis"] * 6 + ["axis_plus", "const", "reverse", "double"]
    if grid_rank == 0:
        kinds = ["const"]
    return [(draw(st.sampled_from(kinds)), draw(st.integers(0, max(grid_rank - 1, 0))),
             draw(st.sampled_from([0, 0, 1, -1, 2, 3]))) for _ in range(max(count, 0))]


def make_index_map(terms: list[tuple[str, int, int]], grid: tuple[int, ...],
                   arity: int) -> Any:
    """The index map the terms describe, taking ``arity`` grid indices."""
    def index_map(*idx: Any) -> tuple[Any, ...]:
        out = []
        for kind, a, c in terms:
            if kind == "const":
                out.append(c)
            elif kind == "axis":
                out.append(idx[a])
            elif kind == "axis_plus":
                out.append(idx[a] + c)
            elif kind == "reverse":
                out.append(grid[a] - 1 - idx[a])
            else:
                out.append(idx[a] * 2)
        return tuple(out)

    params = ", ".join(f"i{k}" for k in range(arity))
    return eval(f"lambda {params}: index_map({params})", {"index_map": index_map})


@st.composite
def examples(draw: Any) -> dict[str, Any]:
    rank = draw(st.integers(1, 2))
    shape = tuple(draw(st.sampled_from([0, 1, 3, 4, 6, 8])) for _ in range(rank))
    dtype = draw(st.sampled_from(DTYPES[:1] * 6 + DTYPES))
    blocks = tuple(draw(dimension_blocks(n)) for n in shape)
    if draw(st.integers(0, 9)) == 0:
        blocks = (*blocks, 1) if draw(st.booleans()) else blocks[:-1]
    # A grid that walks the blocks, or another one.
    if draw(st.booleans()) and all(isinstance(b, int) and b > 0 for b in blocks[:rank]):
        grid = tuple(-(-n // b) for n, b in zip(shape, blocks))
        in_terms = [("axis", d, 0) for d in range(rank)]
    else:
        grid = tuple(draw(st.integers(0, 4)) for _ in range(draw(st.integers(0, 2))))
        in_terms = draw(index_terms(rank, len(grid)))
    out_terms = in_terms if draw(st.booleans()) else draw(index_terms(rank, len(grid)))
    arity = len(grid) - (1 if grid and draw(st.integers(0, 15)) == 0 else 0)
    whole_input = draw(st.integers(0, 7)) == 0
    seed = draw(st.integers(0, 2**16))
    return dict(shape=shape, dtype=dtype, blocks=blocks, grid=grid, in_terms=in_terms,
                out_terms=out_terms, arity=arity, whole_input=whole_input, seed=seed)


def _kernel(x_ref: Any, o_ref: Any) -> None:
    x = x_ref[...]
    o_ref[...] = x if x.dtype == jnp.bool_ else x * 2 + 1


def _call(api: Any, ex: dict[str, Any], **extra: Any) -> Any:
    in_map = make_index_map(ex["in_terms"], ex["grid"], ex["arity"])
    out_map = make_index_map(ex["out_terms"], ex["grid"], ex["arity"])
    in_spec = api.BlockSpec() if ex["whole_input"] else api.BlockSpec(ex["blocks"], in_map)
    return api.pallas_call(_kernel, grid=ex["grid"], in_specs=[in_spec],
                           out_specs=api.BlockSpec(ex["blocks"], out_map),
                           out_shape=jax.ShapeDtypeStruct(ex["shape"], ex["dtype"]), **extra)


def _input(ex: dict[str, Any]) -> np.ndarray:
    rng = np.random.default_rng(ex["seed"])
    values = rng.integers(-50, 50, ex["shape"])
    if ex["dtype"] == "bool":
        return values > 0
    if ex["dtype"] in ("float64",):
        return values.astype(np.float32) + rng.standard_normal(ex["shape"]).astype(np.float32)
    return values.astype(jnp.dtype(ex["dtype"]))


def _written(ex: dict[str, Any]) -> np.ndarray:
    """Which output elements some grid step writes (index maps evaluated in Python)."""
    shape, blocks = ex["shape"], ex["blocks"]
    full = [1 if b is None else b for b in blocks]
    mask = np.zeros(shape, bool)
    fn = make_index_map(ex["out_terms"], ex["grid"], ex["arity"])
    for point in np.ndindex(*ex["grid"]):
        idx = fn(*point[:ex["arity"]])
        starts = [int(i) * (1 if b is None else b) for i, b in zip(idx, blocks)]
        mask[tuple(slice(s, s + f) for s, f in zip(starts, full))] = True
    return mask


@SETTINGS
@given(examples())
def test_hostile_kernels_match_jax_or_raise_a_pallas_error(ex: dict[str, Any]) -> None:
    x = _input(ex)
    try:
        ours = np.asarray(jax.block_until_ready(_call(pl, ex, interpret=True)(x)))
    except pl.PallasError:
        return
    try:
        theirs = np.asarray(_call(jpl, ex, interpret=True)(x))
    except Exception:
        # JAX's interpreter fails on some set-ups ours runs (a squeezed block of an empty
        # array on an empty grid): only an empty result is then expected.
        assert ours.size == 0 or not _written(ex).any(), ex
        return
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype, (ours, theirs)
    mask = _written(ex)
    np.testing.assert_array_equal(ours[mask], theirs[mask])
    covers = ex["in_terms"] == ex["out_terms"] and mask.all() and not ex["whole_input"]
    if covers and all(t[0] == "axis" and t[1] == d for d, t in enumerate(ex["in_terms"])):
        np.testing.assert_array_equal(ours, np.asarray(_kernel_reference(x)))


def _kernel_reference(x: np.ndarray) -> Any:
    x = jnp.asarray(x)
    return x if x.dtype == jnp.bool_ else x * 2 + 1


# --- atomics at repeated indices, and emulation on random targets (issue 34) ---------------

SMALL = settings(max_examples=EXAMPLES if EXAMPLES > 60 else 20, deadline=None,
                 derandomize=True, suppress_health_check=list(HealthCheck))
ATOMIC_OPS = {"add": (pl.atomic_add, np.add), "max": (pl.atomic_max, np.maximum),
              "min": (pl.atomic_min, np.minimum), "or": (pl.atomic_or, np.bitwise_or),
              "xor": (pl.atomic_xor, np.bitwise_xor), "xchg": (pl.atomic_xchg, lambda a, b: b)}


@st.composite
def atomic_examples(draw: Any) -> dict[str, Any]:
    op = draw(st.sampled_from(sorted(ATOMIC_OPS)))
    n = draw(st.integers(1, 8))
    lanes = draw(st.integers(1, 24))
    return {"op": op, "n": n, "dtype": "int32" if op in ("or", "xor") else draw(
                st.sampled_from(["int32", "float32"])),
            "idx": draw(st.lists(st.integers(0, n - 1), min_size=lanes, max_size=lanes)),
            "mask": draw(st.one_of(st.none(), st.lists(st.booleans(), min_size=lanes,
                                                       max_size=lanes))),
            "seed": draw(st.integers(0, 2**16))}


@SMALL
@given(atomic_examples())
def test_atomics_at_repeated_indices_match_a_sequential_model(ex: dict[str, Any]) -> None:
    """The lanes of one atomic update the Ref one after another: the final contents and each
    lane's old value are those of a numpy loop over the lanes."""
    atomic, combine = ATOMIC_OPS[ex["op"]]
    rng = np.random.default_rng(ex["seed"])
    idx = np.asarray(ex["idx"], np.int32)
    lanes, dtype = len(idx), np.dtype(ex["dtype"])
    x = rng.integers(-20, 20, ex["n"]).astype(dtype)
    v = rng.integers(-20, 20, lanes).astype(dtype)
    mask = np.ones(lanes, bool) if ex["mask"] is None else np.asarray(ex["mask"])

    def kernel(x_ref: Any, i_ref: Any, v_ref: Any, m_ref: Any, o_ref: Any,
               old_ref: Any) -> None:
        o_ref[...] = x_ref[...]
        old_ref[...] = atomic(o_ref, (i_ref[...],), v_ref[...],
                              mask=None if ex["mask"] is None else m_ref[...] != 0)

    got, olds = pl.pallas_call(kernel, backend="interpret", out_shape=(
        jax.ShapeDtypeStruct((ex["n"],), dtype), jax.ShapeDtypeStruct((lanes,), dtype)))(
        x, idx, v, mask.astype(np.int32))
    want, want_olds = x.copy(), np.zeros(lanes, dtype)
    for lane in range(lanes):
        want_olds[lane] = want[idx[lane]]
        if mask[lane]:
            want[idx[lane]] = combine(want[idx[lane]], v[lane])
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(np.asarray(olds), want_olds)


EMULATORS = {name: targets for name, targets in {
    "triton": ["sm_80", "sm_90", "sm_100", "gfx942"], "mosaic_tpu": ["v4", "v5e", "v6e"]}.items()
    if importlib.util.find_spec(f"pallas_{name}") is not None}
"""Each installed emulating backend's targets (a sample of the known ones)."""


@pytest.mark.skipif(not EMULATORS, reason="needs pallas_triton or pallas_mosaic_tpu")
@SMALL
@given(st.sampled_from(sorted(EMULATORS) or ["none"]),
       st.one_of(st.none(), st.sampled_from(sorted({t for ts in EMULATORS.values()
                                                    for t in ts} | {"sm_7", "v99", "h100",
                                                                    "", "TPU v5 lite"})),
                 st.text(max_size=6)),
       st.integers(0, 2**16))
def test_emulation_on_random_targets_runs_or_refuses_as_stages_does(
        backend: str, target: str | None, seed: int) -> None:
    """``pl.emulate`` on any target either gives the right result or raises a
    ``PallasError``; it refuses exactly the targets ``pl.stages`` refuses."""
    x = np.random.default_rng(seed).standard_normal((8, 128)).astype(np.float32)
    fn = pl.pallas_call(_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                        backend=backend)
    stage = {"triton": "ttir", "mosaic_tpu": "mosaic"}[backend]
    try:
        pl.stages(fn, x, backend=backend, target=target)[0][stage]
        staged = None
    except pl.PallasError as e:
        # Without the triton compiler pl.stages cannot make Triton's stages at all: that
        # says nothing of the target.
        staged = None if "needs the `triton` package" in str(e) else e
    try:
        out = np.asarray(pl.emulate(fn, backend=backend, target=target)(x))
    except pl.PallasError as e:
        assert staged is not None, f"pl.emulate refused target {target!r} ({e}); stages ran"
        return
    assert staged is None, f"pl.emulate ran target {target!r}, which stages refuses: {staged}"
    np.testing.assert_allclose(out, x * 2 + 1, rtol=1e-6)
