"""A third-party backend, `xla_unrolled` from tests/third_party_backend, tested black-box.

The package is installed into the environment before pytest runs (tox does it; by hand:
``pip install --no-deps -e tests/third_party_backend``); nothing here installs it. It depends
on pallas-core alone and is found through its entry point, like any backend a third party
publishes. The module imports it only inside tests, so a missing install fails each test
with the fix instead of breaking collection.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_core as pl
from pallas_core import backend as plb
from pallas_core.plugins import ENTRY_POINT_GROUP, manager
from pallas_core.testing import (
    ALIASING,
    ATOMICS,
    ELEMENTWISE,
    SCALAR_PREFETCH,
    SCRATCH,
    ConformanceSuite,
)

NAME = "xla_unrolled"
INSTALL = "pip install --no-deps -e tests/third_party_backend"


@pytest.fixture(autouse=True)
def _installed() -> None:
    """Fails with the fix when the example backend is not installed or did not load."""
    if not importlib.metadata.entry_points(group=ENTRY_POINT_GROUP, name=NAME):
        pytest.fail(
            f"no entry point {NAME!r} in group {ENTRY_POINT_GROUP!r}: the example third-party "
            f"backend is not installed in this environment. Fix: {INSTALL}", pytrace=False)
    error = manager.errors().get(NAME)
    if error is not None:
        pytest.fail(f"backend {NAME!r} is installed but failed to load: {error}", pytrace=False)


def _lower_calls() -> int:
    from pallas_xla_unrolled import plugin

    return plugin.LOWER_CALLS


def _add_kernel(x_ref: Any, y_ref: Any, o_ref: Any) -> None:
    o_ref[...] = x_ref[...] + y_ref[...]


def _blocked_add(**kwargs: Any) -> Any:
    spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
    return pl.pallas_call(_add_kernel, jax.ShapeDtypeStruct((24, 128), jnp.float32), grid=(3,),
                          in_specs=[spec, spec], out_specs=spec, **kwargs)


def _inputs() -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(0)
    return (jnp.asarray(rng.standard_normal((24, 128)), jnp.float32),
            jnp.asarray(rng.standard_normal((24, 128)), jnp.float32))


def test_depends_on_pallas_core_only() -> None:
    """The distribution needs nothing but pallas-core: no change to, or import of, the rest."""
    requires = importlib.metadata.requires("pallas-xla-unrolled") or []
    assert [r for r in requires if not r.startswith("pallas-core")] == []


def test_selected_by_name() -> None:
    """``backend="xla_unrolled"`` runs the kernel through the plugin's lower hook."""
    x, y = _inputs()
    before = _lower_calls()
    out = _blocked_add(backend=NAME)(x, y)
    np.testing.assert_allclose(out, x + y, rtol=1e-6)
    assert _lower_calls() == before + 1


def test_selected_by_compiler_params() -> None:
    """An instance of the plugin's CompilerParams selects it without ``backend=``."""
    import pallas_xla_unrolled

    x, y = _inputs()
    before = _lower_calls()
    out = jax.jit(_blocked_add(compiler_params=pallas_xla_unrolled.CompilerParams()))(x, y)
    np.testing.assert_allclose(out, x + y, rtol=1e-6)
    assert _lower_calls() == before + 1


def _run_pallas_core(**env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PALLAS_")}
    return subprocess.run([sys.executable, "-m", "pallas_core"], capture_output=True, text=True,
                          env={**environ, "JAX_PLATFORMS": "cpu", **env}, timeout=120)


def test_listed_by_python_m_pallas_core() -> None:
    """``python -m pallas_core`` lists the backend, and PALLAS_DISABLED_BACKENDS hides it."""
    import pallas_xla_unrolled

    listed = _run_pallas_core()
    line = next((ln for ln in listed.stdout.splitlines() if ln.strip().startswith(NAME)), "")
    assert "pallas-xla-unrolled" in line and line.split()[1] == pallas_xla_unrolled.__version__, (
        listed.stdout + listed.stderr)
    hidden = _run_pallas_core(PALLAS_DISABLED_BACKENDS=NAME)
    assert "pallas-xla-unrolled" not in hidden.stdout and "interpret" in hidden.stdout, (
        hidden.stdout)


@pytest.mark.parametrize("backend", ["interpret", NAME])
def test_plugin_primitive_runs_on_any_interpreting_backend(backend: str) -> None:
    """``step_index`` carries reference semantics: the interpreter runs it without knowing it."""
    from pallas_xla_unrolled import step_index

    def kernel(o_ref: Any) -> None:
        o_ref[...] = jnp.full(o_ref.shape, step_index())

    out = pl.pallas_call(kernel, jax.ShapeDtypeStruct((3, 4), jnp.int32), grid=(3, 4),
                         out_specs=pl.BlockSpec((None, None), lambda i, j: (i, j)),
                         backend=backend)()
    np.testing.assert_array_equal(out, np.arange(12).reshape(3, 4))


def _copy_kernel(x_ref: Any, o_ref: Any) -> None:
    o_ref[...] = x_ref[...]


def _copy(steps: int, **kwargs: Any) -> Any:
    spec = pl.BlockSpec((1,), lambda i: (i,))
    return pl.pallas_call(_copy_kernel, jax.ShapeDtypeStruct((steps,), jnp.float32),
                          grid=(steps,), in_specs=[spec], out_specs=spec, **kwargs)


def test_grid_over_max_steps_is_rejected_with_fix() -> None:
    """Grids over ``max_steps`` raise ``UnsupportedError`` saying how to fix it."""
    import pallas_xla_unrolled

    with pytest.raises(pl.UnsupportedError, match=r"65 steps.*max_steps=64.*Fix:"):
        _copy(65, backend=NAME)(jnp.zeros((65,)))
    x = jnp.arange(65.0)
    out = _copy(65, compiler_params=pallas_xla_unrolled.CompilerParams(max_steps=65))(x)
    np.testing.assert_array_equal(out, x)
    # vmap adds a grid axis after validation; the lower hook checks again.
    with pytest.raises(pl.UnsupportedError, match=r"\(2, 40\) = 80 steps"):
        jax.vmap(_copy(40, backend=NAME))(jnp.zeros((2, 40)))


def test_atomics_are_rejected_with_fix() -> None:
    """Atomics raise ``UnsupportedError`` naming the primitive, the backend and the fix."""

    def kernel(x_ref: Any, o_ref: Any) -> None:
        pl.atomic_add(o_ref, (pl.ds(0, 4),), x_ref[...])

    with pytest.raises(pl.UnsupportedError,
                       match=r"atomic_rmw .*not supported by the 'xla_unrolled' backend.*Fix:"):
        pl.pallas_call(kernel, jax.ShapeDtypeStruct((4,), jnp.float32), backend=NAME)(
            jnp.ones((4,)))


def test_compiler_params_validate() -> None:
    """Bad parameters fail when constructed, with the fix."""
    import pallas_xla_unrolled

    with pytest.raises(pl.PallasError, match=r"max_steps=0.*positive int.*Fix"):
        pallas_xla_unrolled.CompilerParams(max_steps=0)


def test_stages_show_the_unrolled_program() -> None:
    """``pl.stages`` reports the unrolled program: a ``pl.when`` on the grid step is gone."""

    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...]

        @pl.when(pl.program_id(0) == 0)
        def _() -> None:
            o_ref[...] = -x_ref[...]

    spec = pl.BlockSpec((8,), lambda i: (i,))
    fn = pl.pallas_call(kernel, jax.ShapeDtypeStruct((16,), jnp.float32), grid=(2,),
                        in_specs=[spec], out_specs=spec, backend=NAME)
    (stages,) = pl.stages(fn, jnp.zeros((16,)))
    assert stages.backend == NAME
    assert set(stages.stages) == {"jaxpr", "stablehlo", "unrolled_jaxpr"}
    assert "cond" in str(stages["jaxpr"]) and "cond" not in str(stages["unrolled_jaxpr"])


class TestXlaUnrolled(ConformanceSuite):
    """The conformance suite on the third-party backend; it declares atomics unsupported."""

    backend = NAME
    unsupported = frozenset({ATOMICS, SCALAR_PREFETCH})


UNDER = "xla_unrolled_underdeclared"


class UnderDeclared:
    """``xla_unrolled`` under another name, declaring one capability (``scratch``) less than
    it runs."""

    def __init__(self) -> None:
        import pallas_xla_unrolled.plugin as plugin

        self.plugin = plugin

    @plb.hookimpl
    def pallas_describe(self) -> pl.BackendInfo:
        info = self.plugin.pallas_describe()
        return pl.BackendInfo(name=UNDER, version=info.version, platforms=info.platforms,
                              capabilities=info.capabilities - {SCRATCH})

    @plb.hookimpl
    def pallas_validate(self, call: pl.KernelCall) -> None:
        self.plugin.pallas_validate(call)

    @plb.hookimpl
    def pallas_lower(self, request: pl.LoweringRequest) -> Any:
        return self.plugin.pallas_lower(request)


def test_conformance_flags_a_capability_handled_but_not_declared(
        request: pytest.FixtureRequest) -> None:
    """A backend that runs scratch buffers correctly without declaring ``scratch`` fails the
    suite by name; its scratch tests are skipped as undeclared; a declared one passes."""

    class Under(ConformanceSuite):  # not collected: the name does not start with "Test"
        backend = UNDER
        unsupported = frozenset({ATOMICS, SCALAR_PREFETCH})

    pl.register_backend(UnderDeclared())
    try:
        suite = Under()
        suite.setup_method(None)
        with pytest.raises(pytest.fail.Exception,
                           match=f"backend '{UNDER}' handles 'scratch' but does not declare it"):
            suite.test_undeclared_capability_is_refused(SCRATCH, request)
        with pytest.raises(pytest.skip.Exception, match="does not declare 'scratch'"):
            suite.test_scratch_persists_across_steps()
        with pytest.raises(pytest.skip.Exception, match="declares 'aliasing'; its tests run"):
            suite.test_undeclared_capability_is_refused(ALIASING, request)
        with pytest.raises(pytest.skip.Exception, match="listed in `unsupported`"):
            suite.test_undeclared_capability_is_refused(ATOMICS, request)
    finally:
        manager.unregister(UNDER)


class Crashing:
    """A backend whose lowering crashes (a plugin defect, which the core wraps into a
    ``LoweringError``) instead of refusing what it cannot run."""

    @plb.hookimpl
    def pallas_describe(self) -> pl.BackendInfo:
        return pl.BackendInfo(name="crashing", version="0", platforms=("cpu",))

    @plb.hookimpl
    def pallas_lower(self, request: pl.LoweringRequest) -> Any:
        raise ValueError("foreach() argument 2 is shorter than argument 1")


def test_conformance_does_not_take_a_crash_for_a_refusal(request: pytest.FixtureRequest) -> None:
    """A feature must be refused (by ``pallas_validate``, with the fix), not crashed on: the
    ``LoweringError`` the core wraps a crash into fails the suite's refusal checks."""

    class Crash(ConformanceSuite):  # not collected
        backend = "crashing"
        unsupported = frozenset({ELEMENTWISE})

    pl.register_backend(Crashing())
    try:
        suite = Crash()
        suite.setup_method(None)
        with pytest.raises(pytest.fail.Exception, match=r"crashed inside the backend instead of "
                           r"refusing it .*foreach"):
            suite.test_unsupported_feature_raises(ELEMENTWISE, request)
        with pytest.raises(pytest.fail.Exception, match=r"'atomics'.*crashed inside the backend"):
            suite.test_undeclared_capability_is_refused(ATOMICS, request)
    finally:
        manager.unregister("crashing")
