"""Bad input raises a PallasError whose message says what was expected, what was found, and
the fix; plus the happy paths that sit next to those errors (one BlockSpec, ``pl.stages``)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_core as pl


def _rand(shape, seed=0):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _sds(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def add_kernel(x_ref, y_ref, o_ref):
    o_ref[...] = x_ref[...] + y_ref[...]


def copy_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]


def _raises(exc_type, *phrases):
    """``pytest.raises`` that also checks every phrase appears (regex-escaped) in order."""
    return pytest.raises(exc_type, match="(?s)" + ".*".join(re.escape(p) for p in phrases))


def test_error_classes_form_one_hierarchy():
    for cls in (pl.BackendNotFoundError, pl.PluginLoadError, pl.UnsupportedError,
                pl.BlockSpecError, pl.KernelSignatureError, pl.OutOfBoundsError,
                pl.LoweringError, pl.AutodiffError):
        assert issubclass(cls, pl.PallasError)


# --- backends ------------------------------------------------------------------------------


def test_unknown_first_party_backend_names_the_package_and_installed_backends():
    from pallas_core.plugins import KNOWN_PACKAGES, manager
    missing = [n for n in KNOWN_PACKAGES if n not in manager.backends()]
    if not missing:
        pytest.skip("every first-party backend is installed here")
    name = missing[0]
    x = _rand((8, 128))
    with _raises(pl.BackendNotFoundError, f"no backend named '{name}'",
                 "Installed backends:", "interpret", f"pip install {KNOWN_PACKAGES[name]}"):
        pl.pallas_call(copy_kernel, _sds(x), backend=name)(x)


def test_unknown_third_party_backend_suggests_spelling_and_lists_installed():
    with _raises(pl.BackendNotFoundError, "no backend named 'intepret'",
                 "did you mean 'interpret'?", "Installed backends:", "interpret"):
        pl.pallas_call(copy_kernel, jax.ShapeDtypeStruct((8,), jnp.float32),
                       backend="intepret")
    with _raises(pl.BackendNotFoundError, "no backend named 'quantum'", "Installed backends:",
                 "check the spelling"):
        pl.pallas_call(copy_kernel, jax.ShapeDtypeStruct((8,), jnp.float32),
                       backend="quantum")


def test_backend_must_be_a_string():
    with _raises(pl.PallasError, "backend= must be a backend name (str)", "found 3"):
        pl.pallas_call(copy_kernel, jax.ShapeDtypeStruct((8,), jnp.float32), backend=3)


# --- block specs and index maps --------------------------------------------------------------


def test_block_shape_rank_differs_from_array_rank():
    x = _rand((256, 4))
    call = pl.pallas_call(
        copy_kernel, _sds(x), grid=(2,),
        in_specs=[pl.BlockSpec((128,), lambda i: (i,))],
        out_specs=pl.BlockSpec((128, 4), lambda i: (i, 0)))
    # JAX's words first (its own tests match them), then which operand and the fix.
    with _raises(pl.BlockSpecError, "In kernel 'copy_kernel'", "Block shape for args[0] "
                 "(= (128,)) must have the same number of dimensions as the array shape "
                 "(256, 4)", "input 0 (x_ref) has rank 2", "block_shape has rank 1",
                 "Fix: give one block size per array dimension"):
        call(x)


def test_specs_not_nested_like_the_operands():
    # JAX's account of the difference first (its own tests match it), then the fix.
    x = _rand((8, 128))
    spec = pl.BlockSpec((8, 128), lambda: (0, 0))
    call = pl.pallas_call(lambda x_ref, y_ref, o_ref: None, _sds(x), in_specs=[spec, spec])
    with _raises(pl.BlockSpecError, "Pytree for `in_specs` and `inputs` do not match. There "
                 "are 1 mismatches, including:\n    * at [1], `in_specs` is a pytree leaf but "
                 "`inputs` is a", "In kernel '<lambda>', in_specs has 2 BlockSpecs",
                 "Fix: give one BlockSpec per operand"):
        call(x, {"a": x})
    call = pl.pallas_call(lambda x_ref, o_ref, p_ref: None, (_sds(x), _sds(x)),
                          out_specs=[spec])
    with _raises(pl.BlockSpecError, "`out_specs` is a tuple of length 1 but `out_shape` is a "
                 "tuple of length 2", "out_specs has 1 BlockSpecs", "Fix:"):
        call(x)


def test_index_map_of_a_nested_operand_is_named_by_its_path():
    x = _rand((8, 128))
    call = pl.pallas_call(copy_kernel, _sds(x),
                          in_specs=[{"a": pl.BlockSpec((8, 128), lambda: (0,))}])
    with _raises(pl.BlockSpecError, "for args[0]['a'] must return 2 values", "input 0"):
        call({"a": x})


def test_index_map_returns_wrong_number_of_indices():
    x = _rand((256, 4))
    call = pl.pallas_call(
        copy_kernel, _sds(x), grid=(2,),
        in_specs=[pl.BlockSpec((128, 4), lambda i: (i,))],
        out_specs=pl.BlockSpec((128, 4), lambda i: (i, 0)))
    with _raises(pl.BlockSpecError, "Index map function <lambda> at ", "test_errors.py:",
                 "for args[0] must return 2 values to match block_shape=(128, 4). Currently "
                 "returning 1 values", "index map of input 0 (x_ref)", "rank 2",
                 "Fix: return a tuple of 2 block indices"):
        call(x)


@pytest.mark.parametrize(("grid", "index_map", "found"), [
    ((2,), lambda i, j: (i, 0), "missing 1 required positional argument"),
    ((2, 1), lambda i: (i, 0), "takes 1 positional argument but 2 were given"),
])
def test_index_map_takes_wrong_number_of_grid_indices(grid, index_map, found):
    x = _rand((256, 4))
    call = pl.pallas_call(
        copy_kernel, _sds(x), grid=grid,
        in_specs=[pl.BlockSpec((128, 4), index_map)],
        out_specs=pl.BlockSpec((128, 4), lambda *idx: (idx[0], 0)))
    with _raises(pl.BlockSpecError, "index map of input 0 (x_ref)",
                 f"{len(grid)} grid indices of grid {grid}", found,
                 f"Fix: the index map takes one argument per grid axis ({len(grid)})"):
        call(x)


def test_index_map_returning_element_offsets_is_out_of_bounds_with_hint():
    x = _rand((512, 4))
    call = pl.pallas_call(
        copy_kernel, _sds(x), grid=(4,),
        in_specs=[pl.BlockSpec((128, 4), lambda i: (i * 128, 0))],
        out_specs=pl.BlockSpec((128, 4), lambda i: (i, 0)))
    with _raises(pl.OutOfBoundsError, "Out-of-bounds block index (128, 0)", "input 0 (x_ref)",
                 "kernel 'copy_kernel'", "grid step (1,)", "has 4 blocks",
                 "valid indices 0..3", "block indices, not element offsets",
                 "lambda i: (i, 0)"):
        call(x)


def test_out_of_bounds_output_block_is_reported_on_the_output():
    x = _rand((256, 4))
    call = pl.pallas_call(
        copy_kernel, _sds(x), grid=(2,),
        in_specs=[pl.BlockSpec((128, 4), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((128, 4), lambda i: (i + 1, 0)))
    with _raises(pl.OutOfBoundsError, "block index (2, 0)", "output 0 (o_ref)",
                 "grid step (1,)", "valid indices 0..1"):
        call(x)


def test_in_specs_count_mismatch():
    x, y = _rand((256, 4)), _rand((256, 4), 1)
    call = pl.pallas_call(
        add_kernel, _sds(x), grid=(2,),
        in_specs=[pl.BlockSpec((128, 4), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((128, 4), lambda i: (i, 0)))
    with _raises(pl.BlockSpecError, "in_specs has 1 BlockSpecs", "there are 2 inputs",
                 "Fix: give one BlockSpec per operand"):
        call(x, y)


def test_block_shape_must_be_a_tuple():
    with _raises(pl.BlockSpecError, "block_shape must be a tuple", "found 128",
                 "block_shape=(128,)"):
        pl.BlockSpec(128, lambda i: (i,))


def test_lone_block_spec_for_in_specs_is_refused_as_in_jax():
    """``in_specs`` is a sequence, one spec per input (JAX raises ValueError); ``out_specs``
    may be a lone spec for a lone output."""
    x = _rand((256, 4))
    spec = pl.BlockSpec((64, 4), lambda i: (i, 0))

    def double(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2

    with pytest.raises(ValueError, match=r"in_specs=\[spec\]"):
        pl.pallas_call(double, _sds(x), grid=(4,), in_specs=spec, out_specs=spec)
    out = pl.pallas_call(double, _sds(x), grid=(4,), in_specs=[spec], out_specs=spec)(x)
    np.testing.assert_allclose(out, x * 2)


# --- kernel signature and out_shape -------------------------------------------------------


@pytest.mark.parametrize(("kernel", "problem"), [
    (lambda x_ref, o_ref: None, "takes 2 positional arguments but 3 were given"),
    (lambda x_ref, y_ref, z_ref, o_ref: None,
     "gets too few Refs (missing 1 required positional argument: 'o_ref')"),
    (lambda x_ref: None, "takes 1 positional argument but 3 were given"),
    (lambda x_ref, y_ref, z_ref, o_ref, p_ref: None,
     "gets too few Refs (missing 2 required positional arguments: 'o_ref' and 'p_ref')"),
], ids=["too_few", "too_many", "one", "two_missing"])
def test_kernel_signature_does_not_match_operands(kernel, problem):
    # Python's words for the failed call (JAX's tests match them), then the Refs passed.
    x, y = _rand((8, 128)), _rand((8, 128), 1)
    with _raises(pl.KernelSignatureError, f"kernel '<lambda>' {problem}: its parameters are (",
                 "passes 3 Refs: input 0, input 1, output 0",
                 "Fix: the kernel takes one Ref per input, then one per output"):
        pl.pallas_call(kernel, _sds(x))(x, y)


@pytest.mark.parametrize(("out_shape", "phrases"), [
    ((8, 128), ["out_shape=(8, 128)", "a shape without a dtype",
                "Fix: out_shape=jax.ShapeDtypeStruct((8, 128), dtype)"]),
    (jnp.float32, ["a dtype without a shape", "expected a jax.ShapeDtypeStruct",
                   "Fix: out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype)"]),
    (np.dtype("float32"), ["a dtype without a shape", "Fix: out_shape=jax.ShapeDtypeStruct"]),
    (None, ["out_shape=None", "describes no outputs", "expected a jax.ShapeDtypeStruct",
            "Fix: out_shape=jax.ShapeDtypeStruct"]),
    ((jax.ShapeDtypeStruct((8,), jnp.float32), "f32"),
     ["out_shape leaf 1 is 'f32'", "expected a jax.ShapeDtypeStruct", "Fix:"]),
], ids=["tuple_of_ints", "jnp_dtype", "np_dtype", "none", "string_leaf"])
def test_wrong_out_shape_types(out_shape, phrases):
    with _raises(pl.KernelSignatureError, *phrases):
        pl.pallas_call(copy_kernel, out_shape)


def test_kernel_returning_a_value():
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...]
        return x_ref[...]

    x = _rand((8, 128))
    with _raises(pl.KernelSignatureError, "The kernel function in the pallas_call kernel at ",
                 "test_errors.py:", "should return None", "returned an array float32[8,128]",
                 "o_ref[...] = value"):
        pl.pallas_call(kernel, _sds(x))(x)


def test_kernel_capturing_an_array_constant():
    bias = jnp.arange(128, dtype=jnp.float32)

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + bias

    x = _rand((8, 128))
    with _raises(pl.KernelSignatureError, "kernel function 'kernel' captures constants",
                 "float32[128]", "Kernels may only read their Refs",
                 "Fix: pass these arrays to the pallas_call as inputs"):
        pl.pallas_call(kernel, _sds(x))(x)


def test_kernel_may_capture_python_scalars():
    scale = 3.0

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * scale

    x = _rand((8, 128))
    np.testing.assert_allclose(pl.pallas_call(kernel, _sds(x))(x), x * scale)


# --- inside the kernel ----------------------------------------------------------------------


def test_program_id_axis_out_of_range():
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + pl.program_id(1)

    x = _rand((256, 4))
    spec = pl.BlockSpec((128, 4), lambda i: (i, 0))
    with _raises(pl.PallasError, "pl.program_id(axis=1)", "grid (2,) has 1 axes",
                 "Fix: pass an axis in range(1)"):
        pl.pallas_call(kernel, _sds(x), grid=(2,), in_specs=[spec], out_specs=spec)(x)


def test_program_id_outside_a_kernel():
    with _raises(pl.PallasError, "pl.program_id was called outside a kernel"):
        pl.program_id(0)


def test_load_other_without_mask():
    def kernel(x_ref, o_ref):
        o_ref[...] = pl.load(x_ref, ..., other=0.0)

    x = _rand((8, 128))
    with _raises(pl.PallasError, "pl.load: `other`", "given without `mask`",
                 "Fix: pass mask= too"):
        pl.pallas_call(kernel, _sds(x))(x)


# --- aliasing ------------------------------------------------------------------------------


def test_aliasing_shape_mismatch():
    x = _rand((16, 128))
    call = pl.pallas_call(copy_kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32),
                          input_output_aliases={0: 0})
    with _raises(pl.PallasError, "input_output_aliases contains the mapping '0:0' referring to "
                 "input[0] with abstract value float32[16,128] and to output with a different "
                 "abstract value float32[8,128]", "must have the same shape and dtype",
                 "Fix: make out_shape[0] jax.ShapeDtypeStruct((16, 128), float32)"):
        call(x)


def test_aliasing_dtype_mismatch():
    x = _rand((8, 128))
    call = pl.pallas_call(copy_kernel, jax.ShapeDtypeStruct((8, 128), jnp.int32),
                          input_output_aliases={0: 0})
    with _raises(pl.PallasError, "float32[8,128]", "int32[8,128]", "Fix:"):
        call(x)


def test_aliasing_index_out_of_range():
    x = _rand((8, 128))
    call = pl.pallas_call(copy_kernel, _sds(x), input_output_aliases={1: 0})
    with _raises(pl.PallasError, "input_output_aliases contains the mapping '1:0' with input "
                 "index 1 outside the range [0, 1)", "1 inputs and 1 outputs",
                 "Fix: map an input index in range(1)"):
        call(x)


# --- autodiff -------------------------------------------------------------------------------


def test_grad_without_custom_vjp_names_the_fix():
    def square(x):
        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...] ** 2
        return pl.pallas_call(kernel, _sds(x), name="square")(x)

    x = _rand((8, 128))
    with _raises(pl.AutodiffError, "reverse mode", "pallas_call kernel 'square'",
                 "test_errors.py", "forward mode only", "jax.custom_vjp"):
        jax.grad(lambda x: square(x).sum())(x)


# --- pl.stages ------------------------------------------------------------------------------


def test_stages_returns_named_text_stages_without_running(capfd):
    def noisy_double(x_ref, o_ref):
        pl.debug_print("ran the kernel {}", pl.program_id(0))
        o_ref[...] = x_ref[...] * 2

    def fn(x, y):
        spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
        a = pl.pallas_call(noisy_double, _sds(x), grid=(2,), in_specs=[spec],
                           out_specs=spec)(x)
        return pl.pallas_call(add_kernel, _sds(x), name="my_add")(a, y)

    x, y = _rand((16, 128)), _rand((16, 128), 1)
    stages = pl.stages(fn, x, y, backend="interpret")
    assert [s.name for s in stages] == ["noisy_double", "my_add"]
    for s in stages:
        assert s.backend == "interpret"
        assert isinstance(s["jaxpr"], str)
        assert isinstance(s["stablehlo"], str)
    assert "program_id" in stages[0]["jaxpr"]
    assert "func.func" in stages[1]["stablehlo"]
    assert "ran the kernel" not in capfd.readouterr().out

    # The same function does print when it runs: the check above is not vacuous.
    jax.block_until_ready(fn(x, y))
    assert "ran the kernel" in capfd.readouterr().out


# --- more bad input: each raises a PallasError that says what to do ------------------------


def test_index_map_returning_a_float_is_refused():
    x = _rand((16,))
    call = pl.pallas_call(copy_kernel, _sds(x), grid=(2,),
                          in_specs=[pl.BlockSpec((8,), lambda i: (i * 1.0,))],
                          out_specs=pl.BlockSpec((8,), lambda i: (i,)))
    with _raises(pl.BlockSpecError, "index map of input 0", "expected one integer scalar",
                 "Fix"):
        call(x)


def test_index_map_returning_none_is_refused():
    x = _rand((16,))
    call = pl.pallas_call(copy_kernel, _sds(x), grid=(2,),
                          in_specs=[pl.BlockSpec((8,), lambda i: (None,))],
                          out_specs=pl.BlockSpec((8,), lambda i: (i,)))
    with _raises(pl.BlockSpecError, "returned None", "integer scalar"):
        call(x)


def test_compiler_params_of_no_installed_backend():
    class OrphanParams:
        pass

    with _raises(pl.PallasError, "OrphanParams belong to no installed backend", "interpret",
                 "Fix"):
        pl.pallas_call(copy_kernel, jax.ShapeDtypeStruct((8,), jnp.float32),
                       compiler_params=OrphanParams())


@pytest.mark.parametrize("aliases,phrase", [({"0": 0}, "must map input positions"),
                                            ({0: 0, 1: 0}, "several inputs to one output")])
def test_bad_input_output_aliases(aliases, phrase):
    with _raises(pl.PallasError, phrase, "Fix"):
        pl.pallas_call(add_kernel, jax.ShapeDtypeStruct((8,), jnp.float32),
                       input_output_aliases=aliases)


@pytest.mark.parametrize("grid", [(True,), (2.0,), (-1,)])
def test_bad_grid(grid):
    with _raises(pl.BlockSpecError, "grid sizes must be non-negative ints", "Fix"):
        pl.pallas_call(copy_kernel, jax.ShapeDtypeStruct((8,), jnp.float32), grid=grid)


def test_grid_none_means_no_grid():
    x = _rand((8,))
    out = pl.pallas_call(copy_kernel, _sds(x), grid=None)(x)
    np.testing.assert_allclose(out, x)


def test_bad_mesh_and_memory_space_and_cost_estimate():
    with _raises(pl.BlockSpecError, "Mesh needs string axis names and positive int sizes"):
        pl.Mesh(("x",), ("a",))
    with _raises(pl.BlockSpecError, "memory_space must be a pl.MemorySpace", "'vmem'"):
        pl.BlockSpec((8,), lambda i: (i,), memory_space="vmem")
    with _raises(pl.PallasError, "cost_estimate must be a pl.CostEstimate", "dict", "Fix"):
        pl.pallas_call(copy_kernel, jax.ShapeDtypeStruct((8,), jnp.float32),
                       cost_estimate={"flops": 1})


@pytest.mark.parametrize("kwargs,phrase", [({"step": 0}, "never end"),
                                           ({"step": 1.5}, "integer bounds")])
def test_bad_loop(kwargs, phrase):
    def kernel(o_ref):
        pl.loop(0, 4, **kwargs)(lambda i: None)
        o_ref[...] = jnp.zeros(4)

    with _raises(pl.PallasError, phrase, "Fix"):
        pl.pallas_call(kernel, jax.ShapeDtypeStruct((4,), jnp.float32))()


def test_mistake_inside_the_kernel_body_is_a_pallas_error_naming_the_kernel():
    def kernel(x_ref, o_ref):
        o_ref[...] = jnp.ones((3, 3))  # the block is (8,)

    x = _rand((8,))
    with _raises(pl.KernelTraceError, "kernel 'kernel'", "failed while being traced"):
        pl.pallas_call(kernel, _sds(x))(x)


def test_debug_print_placeholder_count():
    def kernel(o_ref):
        pl.debug_print("a {} b {}", 1)
        o_ref[...] = jnp.zeros(4)

    with _raises(pl.PallasError, "2 '{}' placeholders", "1 values", "Fix"):
        pl.pallas_call(kernel, jax.ShapeDtypeStruct((4,), jnp.float32))()


def test_interpret_params_are_validated():
    from pallas_interpret import InterpretParams

    with _raises(pl.PallasError, "InterpretParams(checked='no')", "True or False"):
        InterpretParams(checked="no")


# --- constant indices outside a Ref (issue 18: they were clamped silently) --------------------


def _oob_read_int(x_ref, o_ref):
    o_ref[...] = jnp.broadcast_to(x_ref[10], o_ref.shape)


def _oob_write_int(x_ref, o_ref):
    o_ref[...] = x_ref[...]
    o_ref[9] = x_ref[0]


def _oob_write_row_of_a_view(x_ref, o_ref):
    o_ref[...] = x_ref[...]
    o_ref.at[pl.ds(0, 4)][5, :] = x_ref[0, :]


def _oob_negative(x_ref, o_ref):
    o_ref[...] = x_ref[...]
    o_ref[-9] = x_ref[0]


def _oob_slice_negative_start(x_ref, o_ref):
    o_ref[...] = x_ref[...]
    o_ref[pl.ds(-1, 2)] = x_ref[pl.ds(0, 2)]


def _oob_slice_past_the_end(x_ref, o_ref):
    o_ref[...] = jnp.broadcast_to(x_ref[pl.ds(6, 4)][0], o_ref.shape)


def _oob_masked_load(x_ref, o_ref):
    o_ref[...] = jnp.broadcast_to(pl.load(x_ref, (8, pl.ds(0, 128))), o_ref.shape)


def _oob_masked_slice_start(x_ref, o_ref):
    o_ref[...] = x_ref[...]
    row = pl.load(x_ref.at[0], pl.ds(130, 128), mask=jnp.arange(128) < 0, other=0.0)
    o_ref[0] = row


_OOB_CASES = {
    "read x_ref[10]": (_oob_read_int, ["reads index 10 of dimension 0", "shape (8, 128)",
                                       "-8..7"]),
    "write o_ref[9]": (_oob_write_int, ["writes index 9 of dimension 0"]),
    "write a row of a 4-row view": (_oob_write_row_of_a_view, ["writes index 5 of dimension 0",
                                                                "shape (4, 128)"]),
    "write o_ref[-9]": (_oob_negative, ["writes index -9"]),
    "a negative pl.ds start": (_oob_slice_negative_start, ["writes the slice of 2 from -1",
                                                           "0 <= start and start + size <= 8"]),
    "a slice past the end": (_oob_slice_past_the_end, ["static slice past its end",
                                                       "start=6, size=4"]),
    "pl.load at row 8": (_oob_masked_load, ["reads index 8 of dimension 0"]),
    "a masked load starting past the end": (_oob_masked_slice_start, [
        "static slice past its end", "start=130", "a masked access needs only its start"]),
}


@pytest.mark.parametrize("case", sorted(_OOB_CASES))
def test_a_constant_index_outside_its_ref_is_refused_at_trace_time(case):
    kernel, phrases = _OOB_CASES[case]
    x = _rand((8, 128))
    line = kernel.__code__.co_firstlineno
    with _raises(pl.OutOfBoundsError, f"kernel '{kernel.__name__}'", "test_errors.py:",
                 *phrases) as raised:
        pl.pallas_call(kernel, _sds(x))(x)
    assert "Fix:" in str(raised.value)
    # The line of the access, not of the kernel's def.
    assert f"test_errors.py:{line})" not in str(raised.value)


def test_a_masked_access_may_run_past_the_end_of_its_ref():
    """A power-of-two masked load over a shorter row (as JAX's Triton softmax does), from 0
    or from a start computed when the kernel runs."""
    def kernel(x_ref, o_ref):
        lanes = jnp.arange(256)
        row = pl.load(x_ref.at[0], pl.ds(0, 256), mask=lanes < 128, other=-1.0)
        o_ref[0] = row[:128]
        start = pl.program_id(0) + 64
        tail = pl.load(x_ref.at[1], pl.ds(start, 128), mask=jnp.arange(128) < 64, other=-1.0)
        o_ref[1] = tail

    x = _rand((8, 128))
    out = np.asarray(pl.pallas_call(kernel, _sds(x), grid=(1,))(x))
    np.testing.assert_array_equal(out[0], np.asarray(x)[0])
    want = np.concatenate([np.asarray(x)[1, 64:], -np.ones(64, np.float32)])
    np.testing.assert_array_equal(out[1], want)


def test_constant_indices_inside_the_ref_still_run():
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...]
        o_ref[-1] = x_ref[-8] + x_ref[7]
        o_ref[pl.ds(2, 6)] = x_ref[pl.ds(0, 6)]

    x = _rand((8, 128))
    want = np.asarray(x).copy()
    want[-1] = want[0] + want[7]
    want[2:8] = np.asarray(x)[0:6]
    np.testing.assert_array_equal(pl.pallas_call(kernel, _sds(x))(x), want)


# --- user mistakes that raised raw exceptions (issue 18) --------------------------------------


def _printing(fmt):
    def kernel(x_ref, o_ref):
        pl.debug_print(fmt, x_ref[0, 0])
        o_ref[...] = x_ref[...]
    return kernel


@pytest.mark.parametrize(("fmt", "what"), [("v={:.3f}", "the format spec ':.3f'"),
                                           ("v={!r}", "the conversion '!r'"),
                                           ("v={v}", "the field name 'v'"),
                                           ("v={0}", "the field name '0'")])
def test_debug_print_refuses_format_specs_and_named_fields(fmt, what):
    x = _rand((8, 128))
    with _raises(pl.PallasError, f"pl.debug_print format {fmt!r} has {what}",
                 "Fix: write '{}'"):
        pl.pallas_call(_printing(fmt), _sds(x))(x)


def test_debug_print_of_a_ref_prints_its_contents(capfd):
    def kernel(x_ref, o_ref):
        pl.debug_print("row={}", x_ref)
        o_ref[...] = x_ref[...]

    x = jnp.arange(4, dtype=jnp.float32)
    jax.block_until_ready(pl.pallas_call(kernel, _sds(x))(x))
    assert "row=[0. 1. 2. 3.]" in capfd.readouterr().out


def test_axis_index_of_an_unknown_axis_names_the_axes_there_are():
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + jax.lax.axis_index("rows")

    x = _rand((16, 128))
    spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
    with _raises(pl.KernelTraceError, "kernel 'kernel'", "test_errors.py:",
                 "asks for an axis no one named", "named grid axes: ['i']",
                 "Fix: name the grid axes"):
        pl.pallas_call(kernel, _sds(x), grid=(("i", 2),), in_specs=[spec], out_specs=spec)(x)


def test_python_if_on_a_grid_index_names_the_index_map():
    def index_map(i):
        if i > 0:
            return (i, 0)
        return (0, 0)

    x = _rand((16, 128))
    with _raises(pl.BlockSpecError, "the index map of input 0 (x_ref)",
                 f"test_errors.py:{index_map.__code__.co_firstlineno}",
                 "Python control flow", "Fix: compute with jnp.where"):
        pl.pallas_call(copy_kernel, _sds(x), grid=(2,),
                       in_specs=[pl.BlockSpec((8, 128), index_map)],
                       out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)))(x)


def test_a_traced_out_shape_dimension_is_refused():
    x = _rand((16, 128))
    f = jax.jit(lambda x, n: pl.pallas_call(copy_kernel, jax.ShapeDtypeStruct((n, 128),
                                                                              x.dtype))(x))
    with _raises(pl.KernelSignatureError, "out_shape leaf 0 has dimension 0 known only when",
                 "static_argnums"):
        f(x, 16)


def test_a_64_bit_output_without_x64_names_the_flag():
    if jax.config.read("jax_enable_x64"):
        pytest.skip("64-bit types are on here")
    x = _rand((8, 128))
    with _raises(pl.KernelSignatureError, "has dtype float64", "jax_enable_x64 is False",
                 "jax.config.update('jax_enable_x64', True)"):
        pl.pallas_call(copy_kernel, jax.ShapeDtypeStruct(x.shape, np.float64))(x)


def test_an_empty_array_walked_by_blocks_is_refused_and_whole_blocks_run():
    x = jnp.zeros((0, 128), jnp.float32)
    spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
    with _raises(pl.ArgumentError, "input 0 (x_ref) has shape (0, 128), empty along dimension 0",
                 "blocks have size 8", "Fix: skip the call when the array is empty"):
        pl.pallas_call(copy_kernel, _sds(x), grid=(1,), in_specs=[spec], out_specs=spec)(x)
    assert pl.pallas_call(copy_kernel, _sds(x))(x).shape == (0, 128)


# --- issue 18: hostile input --------------------------------------------------------------------


def test_more_scalar_prefetch_operands_than_given_is_reported_as_such():
    import pallas_mosaic_tpu as pltpu

    x = _rand((4, 8), 7)
    spec = pl.BlockSpec((1, 8), lambda i, *refs: (i, 0))
    fn = pl.pallas_call(copy_kernel, _sds(x), grid_spec=pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3, grid=(4,), in_specs=[spec], out_specs=spec))
    with _raises(pl.ArgumentError, "kernel 'copy_kernel'", "num_scalar_prefetch=3",
                 "called with 2 operand(s)", "Fix: pass every scalar-prefetch operand"):
        fn(jnp.arange(4, dtype=jnp.int32), x)


def test_a_raw_exception_escaping_a_backend_becomes_a_lowering_error(monkeypatch):
    from pallas_interpret import plugin

    def broken(*args, **kwargs):
        raise KeyError("a backend's own bug")

    monkeypatch.setattr(plugin.grid, "run", broken)
    x = _rand((8, 128), 8)
    with _raises(pl.LoweringError, "backend 'interpret' failed to lower kernel 'copy_kernel'",
                 "test_errors.py:", "KeyError", "a backend's own bug", "Fix: report it") as info:
        pl.pallas_call(copy_kernel, _sds(x))(x)
    # The original is the LoweringError's cause (JAX slips its record of the user's stack in
    # between, as it does for every error raised while lowering).
    causes, e = [], info.value.__cause__
    while e is not None:
        causes.append(e)
        e = e.__cause__
    assert any(isinstance(c, KeyError) for c in causes), causes
    monkeypatch.undo()
    np.testing.assert_array_equal(pl.pallas_call(copy_kernel, _sds(x))(x), x)


def test_an_index_map_closing_over_a_traced_value_is_refused():
    x = _rand((16, 128))

    def f(x, k):
        spec = pl.BlockSpec((8, 128), lambda i: (i + k, 0))
        return pl.pallas_call(copy_kernel, _sds(x), grid=(2,), in_specs=[spec],
                              out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)))(x)

    with _raises(pl.BlockSpecError, "Index map function <lambda> at ", "for args[0] must not "
                 "capture constants: the index map of input 0 (x_ref) closes over arrays",
                 "Fix: pass the data as a scalar-prefetch operand"):
        jax.jit(f)(x, 0)
