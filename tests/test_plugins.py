"""The plugin system: discovery by entry point, lazy loading, switches in the environment,
reporting of broken plugins, and how a backend is chosen for a call."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_core as pl
from pallas_core import plugins
from pallas_core.hookspecs import hookimpl
from pallas_core.plugins import BackendInfo, PluginManager
from pallas_core.stages import kernel_calls

# --- helpers --------------------------------------------------------------------------------


def _run_python(code: str, tmp_path=None, **env: str) -> subprocess.CompletedProcess[str]:
    """Runs ``code`` in a fresh interpreter (so nothing is loaded yet), with ``env`` added."""
    full_env = {k: v for k, v in os.environ.items()
                if k not in (plugins.DISABLE_AUTOLOAD_ENV, plugins.DISABLED_BACKENDS_ENV,
                             plugins.ALLOWED_BACKENDS_ENV)}
    full_env["JAX_PLATFORMS"] = "cpu"
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=full_env, timeout=120, cwd=tmp_path)


def _check(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


_CALL_COPY = """
import jax, jax.numpy as jnp
import pallas_core as pl

def copy(x_ref, o_ref):
    o_ref[...] = x_ref[...]

x = jnp.arange(8.0)
"""

_EXPECT_NOT_FOUND = _CALL_COPY + """
try:
    pl.pallas_call(copy, jax.ShapeDtypeStruct(x.shape, x.dtype), backend=BACKEND)(x)
except pl.BackendNotFoundError as e:
    print("BackendNotFoundError:", e)
else:
    print("no error")
"""


def _info(name: str, **kw) -> BackendInfo:
    return BackendInfo(name=name, version="0.0.1", platforms=("cpu",), **kw)


def add_kernel(x_ref, y_ref, o_ref):
    o_ref[...] = x_ref[...] + y_ref[...]


def _add(x, y, **kw):
    return pl.pallas_call(add_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), **kw)(x, y)


def _backend_of(fn, *args) -> list[str | None]:
    """The backend recorded in each pallas_call of ``fn`` (None: chosen when lowering)."""
    return [c.backend for c in kernel_calls(jax.make_jaxpr(fn)(*args).jaxpr)]


# --- python -m pallas_core ------------------------------------------------------------------


def test_main_lists_backends_with_versions_and_platforms():
    proc = subprocess.run([sys.executable, "-m", "pallas_core"], capture_output=True,
                          text=True, timeout=120)
    out = _check(proc)
    import pallas_interpret

    assert f"pallas-core {pl.__version__}" in out and f"jax {jax.__version__}" in out
    line = next(ln for ln in out.splitlines() if ln.split()[:1] == ["interpret"])
    assert line.split()[1] == pallas_interpret.__version__ and "pallas-interpret" in line
    assert "platforms: cpu" in line and "default on cpu" in line


# --- lazy loading and the environment switches ------------------------------------------------


def test_importing_the_core_loads_no_plugin():
    out = _check(_run_python(_CALL_COPY + """
import sys
print("after import:", "pallas_interpret" in sys.modules)
y = pl.pallas_call(copy, jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
print("after call:", "pallas_interpret" in sys.modules, bool((y == x).all()))
"""))
    assert "after import: False" in out
    assert "after call: True True" in out


def test_disable_autoload_loads_no_entry_point():
    out = _check(_run_python(_CALL_COPY + """
import sys
from pallas_core.plugins import manager
try:
    pl.pallas_call(copy, jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
except pl.BackendNotFoundError as e:
    print("BackendNotFoundError:", e)
print("backends:", sorted(manager.backends()), "pallas_interpret" in sys.modules)
""", PALLAS_DISABLE_PLUGIN_AUTOLOAD="1"))
    assert "BackendNotFoundError: no installed backend is the default for platform 'cpu'" in out
    assert "Loaded: none" in out
    assert "Installed but not loaded: interpret (PALLAS_DISABLE_PLUGIN_AUTOLOAD=1)" in out
    assert "Fix: pass backend=NAME" in out and "pip install pallas-interpret" in out
    assert "backends: [] False" in out

    out = _check(_run_python("BACKEND = 'interpret'\n" + _EXPECT_NOT_FOUND,
                             PALLAS_DISABLE_PLUGIN_AUTOLOAD="1"))
    assert ("BackendNotFoundError: backend 'interpret' is installed but was not loaded because "
            "PALLAS_DISABLE_PLUGIN_AUTOLOAD=1 is set") in out
    assert "Fix: unset PALLAS_DISABLE_PLUGIN_AUTOLOAD, or register the backend by hand" in out


def test_disabled_backends_skips_the_named_entry_point():
    env = {"PALLAS_DISABLED_BACKENDS": "triton, interpret"}
    out = _check(_run_python("BACKEND = 'interpret'\n" + _EXPECT_NOT_FOUND + """
from pallas_core.plugins import manager
print("loaded:", "interpret" in manager.backends())
try:
    pl.pallas_call(copy, jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
except pl.BackendNotFoundError as e:
    print("default:", e)
""", **env))
    assert ("BackendNotFoundError: backend 'interpret' is installed but was not loaded because "
            "PALLAS_DISABLED_BACKENDS=triton, interpret is set") in out
    assert "Fix: remove 'interpret' from PALLAS_DISABLED_BACKENDS" in out
    assert "loaded: False" in out
    assert "default: no installed backend is the default for platform 'cpu'" in out

    main = _check(_run_python("from pallas_core.__main__ import main; main()", **env))
    assert "interpret    not loaded: PALLAS_DISABLED_BACKENDS=triton, interpret is set" in main


def test_autoload_switch_takes_its_documented_values_only():
    for value in ("true", "yes", "ON"):
        out = _check(_run_python("BACKEND = 'interpret'\n" + _EXPECT_NOT_FOUND,
                                 PALLAS_DISABLE_PLUGIN_AUTOLOAD=value))
        assert f"was not loaded because PALLAS_DISABLE_PLUGIN_AUTOLOAD={value} is set" in out
    for value in ("0", "false", "off"):
        out = _check(_run_python("BACKEND = 'interpret'\n" + _EXPECT_NOT_FOUND,
                                 PALLAS_DISABLE_PLUGIN_AUTOLOAD=value))
        assert "no error" in out
    out = _check(_run_python(_CALL_COPY + """
try:
    pl.pallas_call(copy, jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
except pl.PluginConfigError as e:
    print("PluginConfigError:", e)
""", PALLAS_DISABLE_PLUGIN_AUTOLOAD="maybe"))
    assert ("PluginConfigError: PALLAS_DISABLE_PLUGIN_AUTOLOAD='maybe': expected 1 (or true, "
            "yes, on)") in out
    assert "Fix: set PALLAS_DISABLE_PLUGIN_AUTOLOAD=1 or unset it" in out


def test_allowed_backends_load_and_the_others_are_skipped_by_name():
    env = {"PALLAS_BACKENDS": "interpret"}
    out = _check(_run_python("BACKEND = 'triton'\n" + _EXPECT_NOT_FOUND + """
from pallas_core.plugins import manager
print("loaded:", sorted(manager.backends()))
y = pl.pallas_call(copy, jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
print("interpret works:", bool((y == x).all()))
""", **env))
    assert ("BackendNotFoundError: backend 'triton' is installed but was not loaded because "
            "PALLAS_BACKENDS=interpret is set. Fix: add 'triton' to PALLAS_BACKENDS") in out
    assert "loaded: ['interpret']" in out
    assert "interpret works: True" in out


def test_a_mistyped_backend_name_gets_did_you_mean(jnp_backend):
    x = jnp.arange(8.0)
    with pytest.raises(pl.BackendNotFoundError,
                       match=r"no backend named 'interpet'; did you mean 'interpret'\?.*"
                             r"Fix: backend='interpret'"):
        pl.pallas_call(lambda x_ref, o_ref: None, jax.ShapeDtypeStruct(x.shape, x.dtype),
                       backend="interpet")(x)
    with pytest.raises(pl.BackendNotFoundError, match=r"no backend named 'cuda_thing'\. "):
        pl.pallas_call(lambda x_ref, o_ref: None, jax.ShapeDtypeStruct(x.shape, x.dtype),
                       backend="cuda_thing")(x)


def _write_dist(root, dist: str, entry_points: dict[str, str], modules: dict[str, str]):
    """A minimal installed distribution (dist-info) that importlib.metadata finds on the path."""
    info = root / f"{dist}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    eps = "".join(f"{k} = {v}\n" for k, v in entry_points.items())
    (info / "entry_points.txt").write_text(f"[pallas.backends]\n{eps}")
    for name, source in modules.items():
        (root / f"{name}.py").write_text(textwrap.dedent(source))


def test_broken_plugins_are_reported_by_name_and_the_others_still_load(tmp_path):
    _write_dist(tmp_path, "broken-import", {"broken_import": "broken_import_plugin"},
                {"broken_import_plugin": "raise RuntimeError('no GPU driver here')\n"})
    _write_dist(tmp_path, "misspelt-hook", {"misspelt_hook": "misspelt_hook_plugin"},
                {"misspelt_hook_plugin": """
                    from pallas_core import BackendInfo
                    from pallas_core.hookspecs import hookimpl

                    @hookimpl
                    def pallas_describe():
                        return BackendInfo("misspelt_hook", "0.1", ("cpu",))

                    @hookimpl
                    def pallas_lowr(request):
                        return None
                    """})
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}

    main = _run_python("from pallas_core.__main__ import main; raise SystemExit(main())",
                       **env)
    assert main.returncode == 1, main.stdout + main.stderr
    lines = main.stdout.splitlines()
    broken = next(ln for ln in lines if "broken_import" in ln)
    assert "FAILED TO LOAD" in broken and "RuntimeError: no GPU driver here" in broken
    assert "PALLAS_DISABLED_BACKENDS=broken_import" in broken
    misspelt = next(ln for ln in lines if "misspelt_hook" in ln)
    assert "FAILED TO LOAD" in misspelt and "'pallas_lowr'" in misspelt
    assert "did you mean 'pallas_lower'?" in misspelt
    assert any(ln.split()[:1] == ["interpret"] for ln in lines)

    out = _check(_run_python("BACKEND = 'broken_import'\n" + _EXPECT_NOT_FOUND + """
y = pl.pallas_call(copy, jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
print("interpret still works:", bool((y == x).all()))
""", **env))
    assert "backend 'broken_import' is installed but failed to load" in out
    assert "no GPU driver here" in out
    assert "interpret still works: True" in out

    # Using the plugins at all warns once about the broken ones (not only python -m pallas_core).
    proc = _run_python(_CALL_COPY + """
import warnings
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    for _ in range(3):
        pl.pallas_call(copy, jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
loads = [w for w in seen if issubclass(w.category, pl.PluginLoadWarning)]
print("warnings:", len(loads))
print(loads[0].message)
""", **env)
    out = _check(proc)
    assert "warnings: 1" in out
    assert "2 installed backend plugin(s) failed to load" in out
    assert "'broken_import': importing" in out and "'misspelt_hook':" in out


# --- plugins that implement hooks wrongly (fresh managers, nothing installed) -----------------


class WrongParameter:
    @hookimpl
    def pallas_describe(self):
        return _info("wrong_parameter")

    @hookimpl
    def pallas_lower(self, self_wrong_arg):
        return None


class MisspeltHook:
    @hookimpl
    def pallas_describe(self):
        return _info("misspelt")

    @hookimpl
    def pallas_lowr(self, request):
        return None


class DescribeReturnsDict:
    @hookimpl
    def pallas_describe(self):
        return {"name": "dict_backend", "platforms": ["cpu"]}


class DescribeRaises:
    @hookimpl
    def pallas_describe(self):
        raise RuntimeError("cannot find libfoo.so")


class NoDescribe:
    @hookimpl
    def pallas_lower(self, request):
        return None


@pytest.mark.parametrize(("plugin", "phrases"), [
    (WrongParameter(), ["'wrong_parameter'", "hook 'pallas_lower'", "self_wrong_arg",
                        "Fix:", "pallas_core.hookspecs"]),
    (MisspeltHook(), ["'misspelt'", "unknown hook 'pallas_lowr'",
                      "did you mean 'pallas_lower'?"]),
    (DescribeReturnsDict(), ["'DescribeReturnsDict'", "hook `pallas_describe`",
                             "must return a pallas_core.BackendInfo", "returned dict",
                             "Fix: return BackendInfo("]),
    (DescribeRaises(), ["'DescribeRaises'", "hook `pallas_describe` raised RuntimeError",
                        "cannot find libfoo.so"]),
    (NoDescribe(), ["'NoDescribe'", "no `pallas_describe` hook"]),
], ids=lambda p: type(p).__name__ if not isinstance(p, list) else "")
def test_plugin_with_a_wrong_hook_is_rejected_naming_plugin_and_hook(plugin, phrases):
    pm = PluginManager()
    before = set(pm.backends())
    with pytest.raises(pl.PluginLoadError) as excinfo:
        pm.register(plugin)
    for phrase in phrases:
        assert phrase in str(excinfo.value)
    assert set(pm.backends()) == before  # nothing half-registered
    assert "interpret" in pm.backends()


def test_registering_a_name_twice_is_rejected():
    pm = PluginManager()

    class Twin:
        @hookimpl
        def pallas_describe(self):
            return _info("interpret")

    with pytest.raises(pl.PluginLoadError, match=r"already registered.*Fix"):
        pm.register(Twin())


def test_entry_point_name_must_match_the_description():
    pm = PluginManager()

    class Liar:
        @hookimpl
        def pallas_describe(self):
            return _info("something_else")

    with pytest.raises(pl.PluginLoadError, match=r"registered as 'liar'.*'something_else'"):
        pm.register(Liar(), name="liar")


# --- an in-test backend ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class JnpParams(pl.CompilerParams):
    """Compiler params of the in-test backend; passing them selects it."""

    BACKEND: ClassVar[str] = "jnp_add"
    fast: bool = True


class JnpAddBackend:
    """Lowers the one kernel it knows (``add_kernel``) to plain ``x + y``, counting calls."""

    name = "jnp_add"

    def __init__(self) -> None:
        self.lowered: list[pl.LoweringRequest] = []
        self.validated: list[str] = []

    @hookimpl
    def pallas_describe(self):
        return _info(self.name, compiler_params_type=JnpParams, package="pallas-jnp-add")

    @hookimpl
    def pallas_validate(self, call):
        self.validated.append(call.name)
        if call.grid_mapping.grid:
            raise pl.UnsupportedError(
                f"kernel {call.name!r} has grid {call.grid_mapping.grid}; the {self.name!r} "
                "backend runs only grid=(). Fix: drop the grid.")

    @hookimpl
    def pallas_lower(self, request):
        assert request.call.name == "add_kernel"
        assert request.platform == "cpu"
        self.lowered.append(request)
        return request.lower_jax(lambda x, y: [x + y])


@pytest.fixture
def jnp_backend():
    backend = JnpAddBackend()
    registered = pl.register_backend(backend)
    try:
        yield backend
    finally:
        plugins.manager.unregister(registered.info.name)
    assert "jnp_add" not in plugins.manager.backends()


def test_registered_backend_is_selected_by_name(jnp_backend):
    x, y = jnp.arange(8.0), jnp.ones(8)
    np.testing.assert_allclose(_add(x, y, backend="jnp_add"), x + y)
    assert len(jnp_backend.lowered) == 1
    assert jnp_backend.validated == ["add_kernel"]
    assert _backend_of(lambda a, b: _add(a, b, backend="jnp_add"), x, y) == ["jnp_add"]


def test_registered_backend_is_selected_by_its_compiler_params_type(jnp_backend):
    x, y = jnp.arange(8.0), jnp.ones(8)
    np.testing.assert_allclose(jax.jit(lambda a, b: _add(a, b, compiler_params=JnpParams()))(
        x, y), x + y)
    assert len(jnp_backend.lowered) == 1
    assert jnp_backend.lowered[0].call.compiler_params == JnpParams()
    # The dict spelling {"backend name": {...}} selects it too.
    assert _backend_of(lambda a, b: _add(a, b, compiler_params={"jnp_add": {}}), x, y) == [
        "jnp_add"]


def test_backend_name_beats_compiler_params_type(jnp_backend):
    x, y = jnp.arange(8.0), jnp.ones(8)
    fn = lambda a, b: _add(a, b, backend="interpret", compiler_params=JnpParams())  # noqa: E731
    assert _backend_of(fn, x, y) == ["interpret"]
    np.testing.assert_allclose(fn(x, y), x + y)
    assert jnp_backend.lowered == []


def test_default_on_cpu_is_the_interpreter(jnp_backend):
    x, y = jnp.arange(8.0), jnp.ones(8)
    assert _backend_of(_add, x, y) == [None]  # chosen by platform when lowering
    np.testing.assert_allclose(_add(x, y), x + y)
    assert jnp_backend.lowered == []
    assert plugins.manager.default_for_platform("cpu") == "interpret"
    assert [s.backend for s in pl.stages(_add, x, y)] == ["interpret"]


def test_interpret_true_selects_the_interpreter(jnp_backend):
    x, y = jnp.arange(8.0), jnp.ones(8)
    fn = lambda a, b: _add(a, b, interpret=True)  # noqa: E731
    assert _backend_of(fn, x, y) == ["interpret"]
    np.testing.assert_allclose(fn(x, y), x + y)
    assert jnp_backend.lowered == []


def test_backend_validate_hook_rejects_before_lowering(jnp_backend):
    x = jnp.arange(16.0)
    spec = pl.BlockSpec((8,), lambda i: (i,))
    with pytest.raises(pl.UnsupportedError, match=r"grid \(2,\).*Fix: drop the grid"):
        pl.pallas_call(add_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(2,),
                       in_specs=[spec, spec], out_specs=spec, backend="jnp_add")(x, x)
    assert jnp_backend.lowered == []


def test_unregistered_backend_is_gone(jnp_backend):
    plugins.manager.unregister("jnp_add")
    with pytest.raises(pl.BackendNotFoundError, match="no backend named 'jnp_add'"):
        _add(jnp.ones(8), jnp.ones(8), backend="jnp_add")
    pl.register_backend(jnp_backend)  # the fixture unregisters it again


def test_memory_spaces_of_a_backend_are_listed() -> None:
    """``manager.memory_spaces`` reads a backend's hook; an absent hook gives an empty tuple."""
    space = pl.MemorySpace("SCRATCHPAD", backend="spaces_demo")

    class SpacesDemo:
        @hookimpl
        def pallas_describe(self) -> pl.BackendInfo:
            return pl.BackendInfo(name="spaces_demo", version="0", platforms=("cpu",))

        @hookimpl
        def pallas_memory_spaces(self) -> list[pl.MemorySpace]:
            return [space]

    plugins.manager.register(SpacesDemo())
    try:
        assert plugins.manager.memory_spaces("spaces_demo") == (space,)
        assert plugins.manager.memory_spaces("xla_unrolled") == ()
    finally:
        plugins.manager.unregister("spaces_demo")


def test_the_removed_meshes_hook_is_refused_by_name() -> None:
    """``pallas_meshes`` is no hook (meshes are made by each plugin's own functions)."""

    class OldMeshes:
        @hookimpl
        def pallas_describe(self) -> pl.BackendInfo:
            return pl.BackendInfo(name="old_meshes", version="0", platforms=("cpu",))

        @hookimpl
        def pallas_meshes(self) -> dict[str, Any]:
            return {}

    with pytest.raises(pl.PluginLoadError, match="'pallas_meshes' is not a pallas hook"):
        plugins.PluginManager().register(OldMeshes())


class Recorder:
    """A backend without any check of which backend it is asked for: it records each hook
    call, and lowers ``x + y``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls: list[tuple[str, str]] = []

    @hookimpl
    def pallas_describe(self) -> pl.BackendInfo:
        return pl.BackendInfo(name=self.name, version="0", platforms=("cpu",))

    @hookimpl
    def pallas_validate(self, call: Any) -> None:
        self.calls.append(("validate", call.name))

    @hookimpl
    def pallas_validate_call(self, call: Any, backend: str) -> None:
        self.calls.append(("validate_call", backend))

    @hookimpl
    def pallas_lower(self, request: Any) -> Any:
        self.calls.append(("lower", request.backend))
        return request.lower_jax(lambda x, y: [x + y])

    @hookimpl
    def pallas_stages(self, call: Any, target: Any) -> dict[str, str]:
        self.calls.append(("stages", self.name))
        return {"mine": self.name}


def test_only_the_chosen_backend_is_asked_and_every_plugin_validates_the_call() -> None:
    """The core resolves the backend once and calls that plugin's backend hooks alone (no
    plugin needs an ``if backend != NAME`` guard); ``pallas_validate_call`` reaches all."""
    first, second = Recorder("rec_first"), Recorder("rec_second")
    pl.register_backend(first)
    pl.register_backend(second)
    try:
        x, y = jnp.arange(8.0), jnp.arange(8.0) * 3
        out = _add(x, y, backend="rec_second")
        np.testing.assert_allclose(out, x + y)
        assert first.calls == [("validate_call", "rec_second")]
        assert second.calls == [("validate", "add_kernel"), ("validate_call", "rec_second"),
                                ("lower", "rec_second")]
        found = pl.stages(lambda a, b: _add(a, b, backend="rec_first"), x, y)
        assert found[0]["mine"] == "rec_first"
        assert ("stages", "rec_first") in first.calls
        assert ("stages", "rec_second") not in second.calls
    finally:
        plugins.manager.unregister("rec_first")
        plugins.manager.unregister("rec_second")
