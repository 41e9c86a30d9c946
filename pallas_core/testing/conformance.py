"""The conformance suite: backend-independent tests that every backend plugin runs on itself.

A plugin subclasses :class:`ConformanceSuite` in one of its test modules::

    from pallas_core.testing import ATOMICS, ConformanceSuite

    class TestMyBackend(ConformanceSuite):
        backend = "my_backend"
        unsupported = frozenset({ATOMICS})

and pytest runs every test of the suite with ``backend="my_backend"``. Each test exercises one
feature and compares the kernel's result with plain ``jax.numpy`` on random inputs. Features
are named by the constants of this module (``ELEMENTWISE``, ``PROGRAM_ID``, ``BLOCKED_GRID``,
``ACCUMULATION``, ``WHEN``, ``FORI_LOOP``, ``SCRATCH``, ``ALIASING``, ``MASKED_ACCESS``,
``ATOMICS``, ``DEBUG_PRINT``, ``RUN_SCOPED``, ``MESH``, ``JIT``, ``VMAP``,
``SCALAR_PREFETCH``, ``SEMAPHORES``, ``ASYNC_COPY``, ``ARG_REDUCTION``, ``GATHER``,
``SYMBOLIC_BLOCKS``);
:data:`FEATURES` says
what each one's tests check.

A feature listed in ``unsupported`` is not passed over in silence: its tests are skipped with a
reason, and ``test_unsupported_feature_raises[<feature>]`` runs the same tests and requires each
to raise a :class:`pallas_core.PallasError` (typically ``UnsupportedError``), not to return a
wrong answer or crash inside JAX. The features in :data:`CAPABILITIES` (scratch, aliasing,
masked access, atomics, debug printing, ``run_scoped``, meshes, vmap, scalar prefetch,
semaphores, async copies, symbolic blocks) are capabilities a backend declares in
``BackendInfo.capabilities``: one it does not declare is treated as unsupported, and
``test_undeclared_capability_is_refused[<feature>]`` fails with "backend X handles <feature> but
does not declare it" when its tests pass. Two more tests always run: a kernel using a primitive
that no plugin defines must raise a ``PallasError`` naming it, and features the backend
advertises in ``BackendInfo.capabilities`` must not be listed in ``unsupported``.

Plugins may add tests of their own to the subclass and tag them with :func:`feature`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Collection, Mapping
from typing import Any, ClassVar, TypeVar, cast

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallas_core as pl
from pallas_core import _jax
from pallas_core.plugins import Capability, manager

ELEMENTWISE = "elementwise"
PROGRAM_ID = "program_id"
BLOCKED_GRID = "blocked_grid"
ACCUMULATION = "accumulation"
WHEN = "when"
FORI_LOOP = "fori_loop"
SCRATCH = Capability.SCRATCH
ALIASING = Capability.ALIASING
MASKED_ACCESS = Capability.MASKED_ACCESS
ATOMICS = Capability.ATOMICS
DEBUG_PRINT = Capability.DEBUG_PRINT
RUN_SCOPED = Capability.RUN_SCOPED
MESH = Capability.MESH
JIT = "jit"
VMAP = Capability.VMAP
SCALAR_PREFETCH = Capability.SCALAR_PREFETCH
SEMAPHORES = Capability.SEMAPHORES
ASYNC_COPY = Capability.ASYNC_COPY
ARG_REDUCTION = "arg_reduction"
GATHER = "gather"
SYMBOLIC_BLOCKS = Capability.SYMBOLIC_BLOCKS

FEATURES: Mapping[str, str] = {
    ELEMENTWISE: "a kernel without a grid: whole arrays in, whole arrays out",
    PROGRAM_ID: "pl.program_id, pl.num_programs and an iota on a 2-D grid",
    BLOCKED_GRID: "blocks that do not divide the array: edge blocks padded, cut on write",
    ACCUMULATION: "an output block revisited along the innermost grid axis (a 3-D matmul)",
    WHEN: "pl.when on the grid position and on data",
    FORI_LOOP: "lax.fori_loop in a kernel, with static and grid-dependent trip counts",
    SCRATCH: "scratch_shapes (in scratch_memory and as jax.ShapeDtypeStruct) persist across "
             "grid steps",
    ALIASING: "input_output_aliases: blocks the grid never writes keep their input values",
    MASKED_ACCESS: "pl.load/pl.store with mask=/other=, reaching past the end of a Ref",
    ATOMICS: "pl.atomic_add (and its result) and pl.atomic_max across grid steps",
    DEBUG_PRINT: "pl.debug_print prints at every grid step",
    RUN_SCOPED: "pl.run_scoped allocates a temporary Ref inside the kernel",
    MESH: "pl.kernel over a pl.Mesh, with lax.axis_index",
    JIT: "a kernel inside jax.jit, composed with other operations",
    VMAP: "jax.vmap of a kernel (program_id keeps meaning the kernel's own grid)",
    SCALAR_PREFETCH: "GridSpec(num_scalar_prefetch=1): index maps choose blocks by data",
    SEMAPHORES: "pl.semaphore_signal/wait/read on semaphores that persist across grid steps",
    ASYNC_COPY: "pallas_core.copies: a local async copy, started then waited on",
    ARG_REDUCTION: "jnp.argmax and jnp.argmin along each axis of a block",
    GATHER: "jnp.take_along_axis along the minor axis of a block, with random indices",
    SYMBOLIC_BLOCKS: "jax.export with shape polymorphism in pl.pallas_export_experimental"
                     "(dynamic_shapes=True): whole blocks of symbolic rows and the row count "
                     "as a value; the exported program runs at two sizes",
}
"""Every feature the suite tests, by name, with what its tests check."""

CAPABILITIES: frozenset[Capability] = frozenset({
    SCRATCH, ALIASING, MASKED_ACCESS, ATOMICS, DEBUG_PRINT, RUN_SCOPED, MESH, VMAP,
    SCALAR_PREFETCH, SEMAPHORES, ASYNC_COPY, SYMBOLIC_BLOCKS})
"""The features that are capabilities (members of ``pallas_core.backend.Capability``, equal to
their names as strings): a backend that runs one lists it in ``BackendInfo.capabilities``, and
one it does not list must be refused with a ``PallasError``
(``test_undeclared_capability_is_refused``). The other features every backend runs."""

_FEATURE_ATTR = "pallas_feature"
_TestFn = TypeVar("_TestFn", bound=Callable[..., None])

unknown_p = _jax.Primitive("conformanceunknown_primitive")
"""A primitive that no plugin defines (no lowering, no reference semantics): a kernel that
binds it must be refused with a ``PallasError`` naming it (``test_unknown_primitive_raises``;
a backend that overrides that test binds it in its own kernel)."""
unknown_p.def_abstract_eval(lambda x: x)


def feature(name: str) -> Callable[[_TestFn], _TestFn]:
    """Tags a test method of a :class:`ConformanceSuite` as exercising feature ``name``.

    On a backend that lists ``name`` in ``unsupported`` the test is skipped, and
    ``test_unsupported_feature_raises[name]`` runs it expecting a ``PallasError`` instead.
    """
    if name not in FEATURES:
        raise ValueError(f"unknown conformance feature {name!r}; known: "
                         f"{sorted(map(str, FEATURES))}.")
    name = str(name)  # a Capability member as its plain name, in messages

    def decorate(fn: _TestFn) -> _TestFn:
        @functools.wraps(fn)
        def test(self: ConformanceSuite, *args: Any, **kwargs: Any) -> None:
            if name in self.unsupported:
                pytest.skip(
                    f"backend {self.backend!r} declares {name!r} unsupported; "
                    f"test_unsupported_feature_raises[{name}] checks that it raises a "
                    "PallasError instead."
                )
            if name in CAPABILITIES and name not in self.declared_capabilities():
                pytest.skip(
                    f"backend {self.backend!r} does not declare {name!r} in "
                    f"BackendInfo.capabilities; test_undeclared_capability_is_refused[{name}] "
                    "checks that it raises a PallasError instead.")
            fn(self, *args, **kwargs)

        setattr(test, _FEATURE_ATTR, name)
        return cast(_TestFn, test)

    return decorate


def _like(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


class ConformanceSuite:
    """Backend-independent tests of pallas semantics; subclass it and set ``backend``.

    Subclass names must start with ``Test`` for pytest to collect them. Each test creates its
    inputs from a generator seeded with ``seed``, so failures reproduce.
    """

    backend: ClassVar[str]
    """The backend under test, as passed to ``pl.pallas_call(..., backend=...)``."""
    unsupported: ClassVar[Collection[str]] = frozenset()
    """Features (constants of this module) that the backend rejects with a ``PallasError``."""
    compiler_params: ClassVar[Any] = None
    """Passed as ``compiler_params=`` to every kernel (e.g. a checked or debug mode)."""
    rtol: ClassVar[float] = 1e-5
    """Relative tolerance of comparisons with ``jax.numpy``."""
    atol: ClassVar[float] = 1e-5
    """Absolute tolerance of comparisons with ``jax.numpy``."""
    seed: ClassVar[int] = 0
    """Seed of the random inputs."""
    scratch_memory: ClassVar[Any] = pl.ANY
    """The memory space of the scratch buffers and ``run_scoped`` temporaries that kernels read
    and write directly (a backend whose ANY memory the kernel cannot access directly, such as
    a TPU's HBM, names its fast memory)."""
    emulate: ClassVar[bool] = False
    """Emulate mode, for hardware backends: every kernel is lowered for the backend's hardware
    and its module executed by the backend's emulator (``pl.emulate``); the result must match
    ``jax.numpy`` and, where the kernel also runs in the interpreter, the interpreter's."""

    rng: np.random.Generator

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        unknown = sorted(set(cls.unsupported) - set(FEATURES))
        if unknown:
            raise ValueError(
                f"{cls.__name__}.unsupported names unknown conformance features {unknown}; "
                f"the suite knows {sorted(map(str, FEATURES))}. Fix: use the constants of "
                "pallas_core.testing (e.g. pallas_core.testing.ATOMICS)."
            )

    def setup_method(self, method: Any) -> None:
        """Checks that the subclass names a backend; seeds the random inputs."""
        if not isinstance(getattr(self, "backend", None), str):
            raise TypeError(
                f"{type(self).__name__} must set `backend = NAME` (a class attribute) to the "
                "backend under test."
            )
        self.rng = np.random.default_rng(self.seed)

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        """Runs ``test_unsupported_feature_raises`` once per feature in ``unsupported``."""
        if "unsupported_feature" in metafunc.fixturenames:
            names: list[str | None] = [str(n) for n in sorted(self.unsupported)]
            ids = [str(n) for n in names]
            metafunc.parametrize("unsupported_feature", names or [None], ids=ids or ["none"])

    # --- helpers for tests -------------------------------------------------------------------

    def declared_capabilities(self) -> frozenset[Capability]:
        """The capabilities the backend under test declares (``BackendInfo.capabilities``)."""
        return frozenset(manager.get(self.backend).info.capabilities)

    def pallas_call(self, kernel: Callable[..., None], out_shape: Any,
                    **kwargs: Any) -> Callable[..., Any]:
        """``pl.pallas_call`` on the backend under test (with ``compiler_params``)."""
        if self.compiler_params is not None:
            kwargs.setdefault("compiler_params", self.compiler_params)
        call = pl.pallas_call(kernel, out_shape, backend=self.backend, **kwargs)
        if not self.emulate:
            return call
        interpreted = pl.pallas_call(kernel, out_shape, backend="interpret", **kwargs)
        return self._emulated(call, interpreted)

    def kernel(self, body: Callable[..., None], **kwargs: Any) -> Callable[..., Any]:
        """``pl.kernel`` on the backend under test (with ``compiler_params``)."""
        call = pl.kernel(body, backend=self.backend, compiler_params=self.compiler_params,
                         **kwargs)
        if not self.emulate:
            return call
        return self._emulated(call, pl.kernel(body, backend="interpret", **kwargs))

    def _emulated(self, call: Callable[..., Any],
                  interpreted: Callable[..., Any]) -> Callable[..., Any]:
        """``call`` emulated for the backend's hardware, checked against the interpreter when
        its results are concrete (not inside ``jit`` or ``vmap``)."""
        emulated = pl.emulate(call, backend=self.backend)

        def run(*args: Any) -> Any:
            out = emulated(*args)
            leaves = jax.tree_util.tree_leaves(out)
            if leaves and not any(isinstance(x, _jax.Tracer) for x in leaves):
                for got, want in zip(leaves, jax.tree_util.tree_leaves(interpreted(*args)),
                                     strict=True):
                    self.assert_close(got, want, what="emulated result (against the "
                                      "interpreter)")
            return out
        return run

    def semaphores(self, n: int, *, dma: bool = False) -> Any:
        """A scratch entry of ``n`` semaphores (for DMA completion when ``dma``), zeroed."""
        return pl.MemorySpace("semaphore", zeroed=True)((n,), jnp.int32)

    def random(self, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
        """Random values: standard normal floats, or integers in [-100, 100)."""
        if jnp.issubdtype(dtype, jnp.integer):
            return jnp.asarray(self.rng.integers(-100, 100, shape), dtype)
        return jnp.asarray(self.rng.standard_normal(shape), dtype)

    def random_ints_as_floats(self, shape: tuple[int, ...], low: int = -4,
                              high: int = 5) -> jax.Array:
        """Small whole numbers as float32: sums and products of them are exact in any order."""
        return jnp.asarray(self.rng.integers(low, high, shape), jnp.float32)

    def assert_close(self, actual: Any, expected: Any, *, what: str = "result",
                     rtol: float | None = None, atol: float | None = None) -> None:
        """Fails, naming the backend, unless ``actual`` matches the ``jax.numpy`` result."""
        np.testing.assert_allclose(
            np.asarray(actual), np.asarray(expected),
            rtol=self.rtol if rtol is None else rtol, atol=self.atol if atol is None else atol,
            err_msg=f"backend {self.backend!r}: {what} differs from plain jax.numpy",
        )

    @classmethod
    def feature_tests(cls) -> dict[str, list[Callable[..., None]]]:
        """The (untagged) test functions of each feature, by feature name."""
        tests: dict[str, list[Callable[..., None]]] = {}
        for attr in sorted(dir(cls)):
            fn = getattr(cls, attr, None)
            name = getattr(fn, _FEATURE_ATTR, None)
            if name is not None:
                tests.setdefault(name, []).append(fn.__wrapped__)  # type: ignore[union-attr]
        return tests

    # --- the suite's own checks --------------------------------------------------------------

    def test_unsupported_feature_raises(self, unsupported_feature: str | None,
                                        request: pytest.FixtureRequest) -> None:
        """An unsupported feature raises a ``PallasError``: never a wrong answer or a crash."""
        if unsupported_feature is None:
            pytest.skip(f"backend {self.backend!r} declares every feature supported.")
        unsupported_feature = str(unsupported_feature)
        self._run_expecting_refusal(
            unsupported_feature, request,
            f"backend {self.backend!r} declares {unsupported_feature!r} unsupported, but",
            f"Fix: remove {unsupported_feature!r} from `unsupported`.")

    @pytest.mark.parametrize("capability", sorted(c.value for c in CAPABILITIES))
    def test_undeclared_capability_is_refused(self, capability: str,
                                              request: pytest.FixtureRequest) -> None:
        """A capability missing from ``BackendInfo.capabilities`` is refused with a
        ``PallasError``: a backend that runs it correctly under-declares (users and tools
        that read the capabilities would avoid what works), and fails here."""
        capability = str(capability)  # a Capability member as its plain name, in messages
        if capability in self.declared_capabilities():
            pytest.skip(f"backend {self.backend!r} declares {capability!r}; its tests run.")
        if capability in self.unsupported:
            pytest.skip(f"{capability!r} is listed in `unsupported`: "
                        f"test_unsupported_feature_raises[{capability}] checks it.")
        self._run_expecting_refusal(
            capability, request,
            f"backend {self.backend!r} does not declare {capability!r} in "
            "BackendInfo.capabilities, but",
            f"backend {self.backend!r} handles {capability!r} but does not declare it. Fix: "
            f"add Capability.{Capability(capability).name} to the capabilities its "
            "pallas_describe hook returns.")

    def _run_expecting_refusal(self, name: str, request: pytest.FixtureRequest, where: str,
                               if_it_passes: str) -> None:
        """Runs feature ``name``'s tests, each of which must raise a ``PallasError``."""
        for fn in self.feature_tests().get(name, []):
            fixtures = list(inspect.signature(fn).parameters)[1:]
            kwargs = {f: request.getfixturevalue(f) for f in fixtures}
            self._expect_pallas_error(fn, kwargs, f"{where} {fn.__name__}", if_it_passes)

    def _expect_pallas_error(self, fn: Callable[..., None], kwargs: dict[str, Any],
                             where: str, if_it_passes: str) -> None:
        try:
            fn(self, **kwargs)
        except pl.LoweringError as e:
            pytest.fail(f"{where} crashed inside the backend instead of refusing it (the core "
                        f"wrapped the crash into a LoweringError: {e}). Expected a "
                        "pallas_core.PallasError such as UnsupportedError, raised by the "
                        "backend's pallas_validate, that names the feature and the fix.")
        except pl.PallasError:
            return
        except AssertionError as e:
            pytest.fail(f"{where} returned a wrong answer instead of raising a "
                        f"pallas_core.PallasError (e.g. UnsupportedError):\n{e}")
        except Exception as e:
            pytest.fail(f"{where} raised {type(e).__name__}: {e}\nExpected a "
                        "pallas_core.PallasError (e.g. UnsupportedError) that names the "
                        "feature and the fix.")
        pytest.fail(f"{where} passed on it: {if_it_passes}")

    def test_unknown_primitive_raises(self) -> None:
        """A primitive that no plugin defines raises a ``PallasError`` that names it."""

        def kernel(x_ref: Any, o_ref: Any) -> None:
            o_ref[...] = unknown_p.bind(x_ref[...])

        x = self.random((8, 128))
        with pytest.raises(pl.PallasError, match=unknown_p.name):
            jax.block_until_ready(self.pallas_call(kernel, _like(x))(x))

    def test_capabilities_agree_with_unsupported(self) -> None:
        """Features advertised in ``BackendInfo.capabilities`` are not listed as unsupported."""
        info = manager.get(self.backend).info
        both = sorted(str(c) for c in set(info.capabilities) & set(self.unsupported))
        if both:
            pytest.fail(
                f"backend {self.backend!r} advertises {both} in BackendInfo.capabilities but "
                "the conformance suite lists them in `unsupported`. Fix: drop them from one."
            )

    # --- features ----------------------------------------------------------------------------

    @feature(ELEMENTWISE)
    def test_elementwise_add(self) -> None:
        """``o = x + y`` on whole arrays, no grid."""

        def kernel(x_ref: Any, y_ref: Any, o_ref: Any) -> None:
            o_ref[...] = x_ref[...] + y_ref[...]

        x, y = self.random((8, 128)), self.random((8, 128))
        self.assert_close(self.pallas_call(kernel, _like(x))(x, y), x + y)

    @feature(PROGRAM_ID)
    def test_program_id_and_iota(self) -> None:
        """Every block records its grid position, the grid size and a lane iota."""

        def kernel(o_ref: Any) -> None:
            lanes = lax.broadcasted_iota(jnp.int32, o_ref.shape, 1)
            o_ref[...] = (1000 * pl.program_id(0) + 100 * pl.program_id(1)
                          + 10 * pl.num_programs(1) + lanes)

        out = self.pallas_call(
            kernel, jax.ShapeDtypeStruct((3 * 8, 2 * 128), jnp.int32), grid=(3, 2),
            out_specs=pl.BlockSpec((8, 128), lambda i, j: (i, j)),
        )()
        rows, cols = jnp.arange(24)[:, None], jnp.arange(256)[None, :]
        self.assert_close(out, 1000 * (rows // 8) + 100 * (cols // 128) + 20 + cols % 128)

    @feature(BLOCKED_GRID)
    def test_uneven_edge_blocks(self) -> None:
        """A (50, 300) array in (16, 128) blocks: the last row and column of blocks are
        partial."""

        def kernel(x_ref: Any, y_ref: Any, o_ref: Any) -> None:
            o_ref[...] = x_ref[...] * 2.0 + y_ref[...]

        x, y = self.random((50, 300)), self.random((1, 300))
        out = self.pallas_call(
            kernel, _like(x), grid=(pl.cdiv(50, 16), pl.cdiv(300, 128)),
            in_specs=[pl.BlockSpec((16, 128), lambda i, j: (i, j)),
                      pl.BlockSpec((1, 128), lambda i, j: (0, j))],
            out_specs=pl.BlockSpec((16, 128), lambda i, j: (i, j)),
        )(x, y)
        self.assert_close(out, x * 2.0 + y)

    @feature(ACCUMULATION)
    def test_revisited_output_matmul(self) -> None:
        """A matmul on grid (i, j, k): the output block (i, j) accumulates over k."""
        m, k, n, bm, bk, bn = 32, 384, 256, 16, 128, 128

        def kernel(a_ref: Any, b_ref: Any, o_ref: Any) -> None:
            acc = jnp.where(pl.program_id(2) == 0, 0.0, o_ref[...])
            o_ref[...] = acc + jnp.dot(a_ref[...], b_ref[...],
                                       preferred_element_type=jnp.float32)

        a, b = self.random_ints_as_floats((m, k)), self.random_ints_as_floats((k, n))
        out = self.pallas_call(
            kernel, jax.ShapeDtypeStruct((m, n), jnp.float32), grid=(m // bm, n // bn, k // bk),
            in_specs=[pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
                      pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j))],
            out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
        )(a, b)
        self.assert_close(out, jnp.dot(a, b, precision=lax.Precision.HIGHEST))

    @feature(WHEN)
    def test_when(self) -> None:
        """``pl.when`` on the grid position (odd steps negate) and on data (shift by 100)."""

        def kernel(x_ref: Any, o_ref: Any) -> None:
            o_ref[...] = x_ref[...]

            @pl.when(pl.program_id(0) % 2 == 1)
            def _negate() -> None:
                o_ref[...] = -x_ref[...]

            @pl.when(x_ref[0:1, 0:1].sum() > 0)
            def _shift() -> None:
                o_ref[...] += 100.0

        x = self.random((32, 128))
        spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
        out = self.pallas_call(kernel, _like(x), grid=(4,), in_specs=[spec], out_specs=spec)(x)
        blocks = x.reshape(4, 8, 128)
        sign = jnp.where(jnp.arange(4) % 2 == 1, -1.0, 1.0)[:, None, None]
        shift = jnp.where(blocks[:, 0, 0] > 0, 100.0, 0.0)[:, None, None]
        self.assert_close(out, (blocks * sign + shift).reshape(32, 128))

    @feature(FORI_LOOP)
    def test_fori_loop(self) -> None:
        """A loop with a static trip count, and one whose trip count is ``program_id + 1``."""

        def kernel(x_ref: Any, o_ref: Any) -> None:
            scale = (pl.program_id(0) + 1).astype(jnp.float32)
            zeros = jnp.zeros((1, 128), jnp.float32)

            def row(r: Any) -> Any:
                return x_ref[pl.ds(r, 1), :]
            total = lax.fori_loop(0, 8, lambda r, acc: acc + row(r) * scale, zeros)
            prefix = lax.fori_loop(0, pl.program_id(0) + 1, lambda r, acc: acc + row(r), zeros)
            o_ref[...] = total + prefix

        x = self.random_ints_as_floats((2, 8, 128))
        out = self.pallas_call(
            kernel, jax.ShapeDtypeStruct((2, 1, 128), jnp.float32), grid=(2,),
            in_specs=[pl.BlockSpec((None, 8, 128), lambda i: (i, 0, 0))],
            out_specs=pl.BlockSpec((None, 1, 128), lambda i: (i, 0, 0)),
        )(x)
        prefix = jnp.stack([x[0, :1].sum(0), x[1, :2].sum(0)])
        self.assert_close(out[:, 0], x.sum(1) * jnp.array([[1.0], [2.0]]) + prefix)

    @feature(SCRATCH)
    def test_scratch_persists_across_steps(self) -> None:
        """A running sum and a step counter kept in scratch buffers, emitted at every step."""

        def kernel(x_ref: Any, sum_ref: Any, count_ref: Any, acc_ref: Any, n_ref: Any) -> None:
            first = pl.program_id(0) == 0
            acc_ref[...] = jnp.where(first, 0.0, acc_ref[...]) + x_ref[...]
            n_ref[...] = jnp.where(first, 0, n_ref[...]) + 1
            sum_ref[...] = acc_ref[...]
            count_ref[...] = n_ref[...]

        x = self.random_ints_as_floats((4, 8, 128))
        row = pl.BlockSpec((None, 8, 128), lambda i: (i, 0, 0))
        sums, counts = self.pallas_call(
            kernel, (_like(x), jax.ShapeDtypeStruct((4, 8, 128), jnp.int32)), grid=(4,),
            in_specs=[row], out_specs=(row, row),
            scratch_shapes=[self.scratch_memory((8, 128), jnp.float32),
                            jax.ShapeDtypeStruct((8, 128), jnp.int32)],
        )(x)
        self.assert_close(sums, jnp.cumsum(x, axis=0), what="running sum")
        self.assert_close(counts, jnp.broadcast_to(jnp.arange(1, 5)[:, None, None], x.shape),
                          what="step count")

    @feature(ALIASING)
    def test_input_output_aliases(self) -> None:
        """The grid writes blocks 0 and 2 of an aliased output; blocks 1 and 3 keep the input."""

        def kernel(x_ref: Any, o_ref: Any) -> None:
            o_ref[...] = x_ref[...] * 2.0

        x = self.random((32, 128))
        spec = pl.BlockSpec((8, 128), lambda i: (2 * i, 0))  # blocks 0 and 2
        out = self.pallas_call(kernel, _like(x), grid=(2,), in_specs=[spec], out_specs=spec,
                               input_output_aliases={0: 0})(x)
        self.assert_close(out, x.at[0:8].multiply(2.0).at[16:24].multiply(2.0))

    @feature(MASKED_ACCESS)
    def test_masked_load_store(self) -> None:
        """Blocks of 128 over a whole-array Ref of 300: the last load reaches 84 elements past
        it."""
        n, block = 300, 128

        def kernel(x_ref: Any, o_ref: Any, raw_ref: Any) -> None:
            start = pl.program_id(0) * block
            mask = start + lax.broadcasted_iota(jnp.int32, (block,), 0) < n
            v = pl.load(x_ref, (pl.ds(start, block),), mask=mask, other=-1.0)
            raw_ref[...] = v
            pl.store(o_ref, (pl.ds(start, block),), v * 2.0 + 1.0, mask=mask)

        x = self.random((n,))
        whole = pl.BlockSpec(memory_space=pl.ANY)
        steps = pl.cdiv(n, block)
        out, raw = self.pallas_call(
            kernel, (_like(x), jax.ShapeDtypeStruct((steps * block,), jnp.float32)),
            grid=(steps,), in_specs=[whole],
            out_specs=(whole, pl.BlockSpec((block,), lambda i: (i,))),
        )(x)
        self.assert_close(out, x * 2.0 + 1.0, what="masked store")
        self.assert_close(raw, jnp.concatenate([x, jnp.full((steps * block - n,), -1.0)]),
                          what="masked load (masked-off lanes must be `other`)")

    @feature(ATOMICS)
    def test_atomics(self) -> None:
        """Every grid step atomically adds (and maxes) a row into whole-array outputs.

        The outputs start as aliased inputs (zeros, int32 min). The values returned by
        ``atomic_add`` are checked in a way that holds in any order of the grid steps.
        """
        steps, n = 4, 8

        def kernel(x_ref: Any, k_ref: Any, sum_in: Any, max_in: Any, sum_ref: Any,
                   max_ref: Any, old_ref: Any) -> None:
            del sum_in, max_in  # aliased to sum_ref and max_ref
            old_ref[...] = pl.atomic_add(sum_ref, (pl.ds(0, n),), x_ref[...])
            pl.atomic_max(max_ref, (pl.ds(0, n),), k_ref[...])

        x = self.random_ints_as_floats((steps, n), low=1, high=10)
        k = self.random((steps, n), jnp.int32)
        row = pl.BlockSpec((None, n), lambda i: (i, 0))
        whole = pl.BlockSpec(memory_space=pl.ANY)
        sums, maxes, old = self.pallas_call(
            kernel, (jax.ShapeDtypeStruct((n,), jnp.float32), jax.ShapeDtypeStruct((n,), jnp.int32),
                     _like(x)),
            grid=(steps,), in_specs=[row, row, whole, whole], out_specs=(whole, whole, row),
            input_output_aliases={2: 0, 3: 1},
        )(x, k, jnp.zeros((n,), jnp.float32), jnp.full((n,), jnp.iinfo(jnp.int32).min))
        self.assert_close(sums, x.sum(0), what="atomic_add total")
        self.assert_close(maxes, k.max(0), what="atomic_max result")
        self.assert_close(old.min(0), jnp.zeros((n,)), what="first value atomic_add returned")
        self.assert_close((old + x).max(0), x.sum(0), what="last value atomic_add returned")

    @feature(ATOMICS)
    def test_atomics_at_repeated_indices(self) -> None:
        """One ``atomic_add`` (and one ``atomic_max``) whose lanes name the same element
        several times, through integer-array indices with repeats, masked: every unmasked
        lane's update counts, as a sequence of atomic operations applies them (checked
        against a sequential model; the values returned depend on the lanes' order and are
        not compared)."""
        n, lanes = 8, 16
        idx = np.concatenate([[0, 1, 1, 3, 3, 3, 5, 7], self.rng.integers(0, n, lanes - 8)])
        mask = np.ones(lanes, bool)
        mask[self.rng.integers(0, lanes, 3)] = False
        x = self.random_ints_as_floats((lanes,), low=1, high=9)
        k = self.random((lanes,), jnp.int32)

        def kernel(i_ref: Any, m_ref: Any, x_ref: Any, k_ref: Any, sum_ref: Any,
                   max_ref: Any) -> None:
            sum_ref[...] = jnp.zeros_like(sum_ref)
            max_ref[...] = jnp.full_like(max_ref, jnp.iinfo(jnp.int32).min)
            lanes_on = m_ref[...] != 0
            pl.atomic_add(sum_ref, (i_ref[...],), x_ref[...], mask=lanes_on)
            pl.atomic_max(max_ref, (i_ref[...],), k_ref[...], mask=lanes_on)

        sums, maxes = self.pallas_call(
            kernel, (jax.ShapeDtypeStruct((n,), jnp.float32),
                     jax.ShapeDtypeStruct((n,), jnp.int32)),
        )(jnp.asarray(idx, jnp.int32), jnp.asarray(mask, jnp.int32), x, k)
        want_sum = np.zeros(n, np.float32)
        want_max = np.full(n, np.iinfo(np.int32).min, np.int32)
        for lane in range(lanes):  # one lane after another
            if mask[lane]:
                want_sum[idx[lane]] += float(x[lane])
                want_max[idx[lane]] = max(want_max[idx[lane]], int(k[lane]))
        self.assert_close(sums, want_sum, what="atomic_add at repeated indices")
        self.assert_close(maxes, want_max, what="atomic_max at repeated indices")

    @feature(DEBUG_PRINT)
    def test_debug_print(self, capfd: pytest.CaptureFixture[str]) -> None:
        """``pl.debug_print`` with a grid-dependent value prints once per grid step."""

        def kernel(x_ref: Any, o_ref: Any) -> None:
            pl.debug_print("conformance step {}", pl.program_id(0))
            o_ref[...] = x_ref[...]

        x = self.random((3, 8, 128))
        spec = pl.BlockSpec((None, 8, 128), lambda i: (i, 0, 0))
        out = self.pallas_call(kernel, _like(x), grid=(3,), in_specs=[spec], out_specs=spec)(x)
        jax.block_until_ready(out)
        jax.effects_barrier()
        printed = capfd.readouterr().out
        missing = [s for s in range(3) if f"conformance step {s}" not in printed]
        if missing:
            pytest.fail(f"backend {self.backend!r}: pl.debug_print printed nothing for grid "
                        f"steps {missing}; stdout was:\n{printed}")
        self.assert_close(out, x)

    @feature(RUN_SCOPED)
    def test_run_scoped(self) -> None:
        """A temporary Ref from ``pl.run_scoped`` carries a value within one kernel step."""

        def kernel(x_ref: Any, o_ref: Any) -> None:
            def body(tmp_ref: Any) -> None:
                tmp_ref[...] = x_ref[...] * 3.0
                o_ref[...] = tmp_ref[...] - 1.0

            pl.run_scoped(body, self.scratch_memory((8, 128), jnp.float32))

        x = self.random((8, 128))
        self.assert_close(self.pallas_call(kernel, _like(x))(x), x * 3.0 - 1.0)

    @feature(MESH)
    def test_kernel_on_mesh(self) -> None:
        """``pl.kernel`` on a mesh of 4: each core writes its quarter of the output."""

        def body(x_ref: Any, o_ref: Any) -> None:
            i = lax.axis_index("x")
            o_ref[pl.ds(i * 8, 8)] = x_ref[pl.ds(i * 8, 8)] * 2.0 + i.astype(jnp.float32)

        x = self.random((32,))
        out = self.kernel(body, out_type=_like(x), mesh=pl.Mesh(("x",), (4,)))(x)
        self.assert_close(out, x * 2.0 + jnp.repeat(jnp.arange(4.0), 8))

    @feature(JIT)
    def test_jit(self) -> None:
        """A blocked kernel inside ``jax.jit``, with other operations around it, called twice."""

        def kernel(x_ref: Any, y_ref: Any, o_ref: Any) -> None:
            o_ref[...] = x_ref[...] * y_ref[...]

        spec = pl.BlockSpec((16, 128), lambda i: (i, 0))
        mul = self.pallas_call(kernel, jax.ShapeDtypeStruct((64, 128), jnp.float32), grid=(4,),
                               in_specs=[spec, spec], out_specs=spec)
        fn = jax.jit(lambda x, y: jnp.tanh(mul(x + 1.0, y)) * 2.0)
        for _ in range(2):
            x, y = self.random((64, 128)), self.random((64, 128))
            self.assert_close(fn(x, y), jnp.tanh((x + 1.0) * y) * 2.0)

    @feature(VMAP)
    def test_vmap(self) -> None:
        """``jax.vmap`` over a batch of 3 (one input unbatched); ``program_id`` is unchanged."""

        def kernel(x_ref: Any, y_ref: Any, o_ref: Any) -> None:
            o_ref[...] = x_ref[...] + y_ref[...] + pl.program_id(0).astype(jnp.float32)

        spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
        add = self.pallas_call(kernel, jax.ShapeDtypeStruct((16, 128), jnp.float32), grid=(2,),
                               in_specs=[spec, spec], out_specs=spec)
        x, y = self.random((3, 16, 128)), self.random((16, 128))
        step = jnp.repeat(jnp.arange(2.0), 8)[:, None]
        self.assert_close(jax.vmap(add, in_axes=(0, None))(x, y), x + y + step)

    @feature(SCALAR_PREFETCH)
    def test_scalar_prefetch(self) -> None:
        """Output block ``i`` is input block ``idx[i]`` plus ``idx[i]``: blocks chosen by data."""

        def kernel(idx_ref: Any, x_ref: Any, o_ref: Any) -> None:
            o_ref[...] = x_ref[...] + idx_ref[pl.program_id(0)].astype(jnp.float32)

        x = self.random((6, 8, 128))
        idx = jnp.asarray(self.rng.integers(0, 6, 4), jnp.int32)
        grid_spec = pl.GridSpec(
            grid=(4,), num_scalar_prefetch=1,
            in_specs=[pl.BlockSpec((None, 8, 128), lambda i, idx_ref: (idx_ref[i], 0, 0))],
            out_specs=pl.BlockSpec((None, 8, 128), lambda i, idx_ref: (i, 0, 0)))
        out = self.pallas_call(kernel, jax.ShapeDtypeStruct((4, 8, 128), jnp.float32),
                               grid_spec=grid_spec)(idx, x)
        self.assert_close(out, x[idx] + idx[:, None, None].astype(jnp.float32))

    @feature(SEMAPHORES)
    def test_semaphores(self) -> None:
        """Signals add, waits subtract, reads see the count; semaphores start at zero."""
        def kernel(x_ref: Any, o_ref: Any, sems: Any) -> None:
            i = pl.program_id(0)
            pl.semaphore_signal(sems.at[0], i + 2)
            pl.semaphore_wait(sems.at[0], 1)
            o_ref[...] = x_ref[...] + pl.semaphore_read(sems.at[0]).astype(jnp.float32)

        x = self.random((4, 8, 128))
        spec = pl.BlockSpec((None, 8, 128), lambda i: (i, 0, 0))
        out = self.pallas_call(kernel, _like(x), grid=(4,), in_specs=[spec], out_specs=spec,
                               scratch_shapes=[self.semaphores(1)])(x)
        counts = jnp.cumsum(jnp.arange(4) + 1).astype(jnp.float32)  # sum of (i + 2 - 1)
        self.assert_close(out, x + counts[:, None, None])

    @feature(ASYNC_COPY)
    def test_async_copy(self) -> None:
        """A local copy from the input to a scratch buffer, started then waited on."""
        from pallas_core import copies

        def kernel(x_ref: Any, o_ref: Any, buf: Any, sems: Any) -> None:
            copies.async_copy(x_ref, buf, sems.at[0]).wait()
            o_ref[...] = buf[...] * 2.0

        x = self.random((8, 128))
        out = self.pallas_call(kernel, _like(x), scratch_shapes=[
            self.scratch_memory((8, 128), jnp.float32), self.semaphores(1, dma=True)])(x)
        self.assert_close(out, x * 2.0)

    @feature(ARG_REDUCTION)
    def test_argmax_argmin(self) -> None:
        """``jnp.argmax`` along the lanes and ``jnp.argmin`` along the rows of a block (distinct
        values, so that each extreme has one index)."""
        def kernel(x_ref: Any, max_ref: Any, min_ref: Any) -> None:
            x = x_ref[...]
            max_ref[...] = jnp.argmax(x, axis=1).astype(jnp.int32)
            min_ref[...] = jnp.argmin(x, axis=0).astype(jnp.int32)

        x = jnp.asarray(self.rng.permutation(8 * 128).reshape(8, 128) / 7.0, jnp.float32)
        out = (jax.ShapeDtypeStruct((8,), jnp.int32), jax.ShapeDtypeStruct((128,), jnp.int32))
        got_max, got_min = self.pallas_call(kernel, out)(x)
        np.testing.assert_array_equal(np.asarray(got_max), np.asarray(jnp.argmax(x, axis=1)))
        np.testing.assert_array_equal(np.asarray(got_min), np.asarray(jnp.argmin(x, axis=0)))

    @feature(GATHER)
    def test_take_along_axis(self) -> None:
        """``jnp.take_along_axis`` along the minor axis with random in-range indices."""
        def kernel(x_ref: Any, i_ref: Any, o_ref: Any) -> None:
            o_ref[...] = jnp.take_along_axis(x_ref[...], i_ref[...], axis=1)

        x = self.random((8, 128))
        idx = jnp.asarray(self.rng.integers(0, 128, (8, 128)), jnp.int32)
        out = self.pallas_call(kernel, _like(x))(x, idx)
        np.testing.assert_array_equal(np.asarray(out),
                                      np.asarray(jnp.take_along_axis(x, idx, axis=1)))

    @feature(SYMBOLIC_BLOCKS)
    def test_exported_with_symbolic_blocks(self) -> None:
        """A kernel exported for the backend's platform with ``m`` rows, whole blocks of
        symbolic shape and ``m`` as a value in the kernel; the program (emulated, for a
        hardware backend in emulate mode) runs with 8 and 24 rows."""
        def kernel(x_ref: Any, o_ref: Any) -> None:
            o_ref[...] = x_ref[...] * 2.0 + jnp.asarray(x_ref.shape[0], x_ref.dtype)

        def f(x: Any) -> Any:
            return pl.pallas_call(kernel, _like(x), backend=self.backend,
                                  compiler_params=self.compiler_params)(x)

        # Emulated: for the backend's hardware; else for the machine running the test.
        hardware = [p for p in manager.get(self.backend).info.platforms if p != "cpu"]
        platform = hardware[0] if self.emulate else jax.export.default_export_platform()
        (rows,) = jax.export.symbolic_shape("m")
        with pl.pallas_export_experimental(dynamic_shapes=True):
            exported = jax.export.export(jax.jit(f), platforms=[platform])(
                jax.ShapeDtypeStruct((rows, 128), jnp.float32))
        run = (pl.emulate(exported.call, backend=self.backend) if self.emulate
               else exported.call)
        for n in (8, 24):
            x = self.random((n, 128))
            self.assert_close(run(x), x * 2.0 + n)

