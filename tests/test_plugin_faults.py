"""A plugin's fault is the plugin's (issue 34): a hook that raises something other than a
``PallasError``, or returns what its specification does not allow, becomes a ``PluginError``
naming the backend, its distribution and the hook (a backend hook), or a ``PluginWarning``
with its answer left out (a broadcast hook every plugin answers), and breaks no other backend
or kernel. A first-party backend's name or platform default is taken over only by an explicit
setting, never by installing a package."""

from __future__ import annotations

import sys
import textwrap
import warnings
from typing import Any

import jax
import numpy as np
import pytest

import pallas_core as pl
from pallas_core import backend as plb
from pallas_core.plugins import PluginManager, manager


def copy(x_ref: Any, o_ref: Any) -> None:
    o_ref[...] = x_ref[...]


X = np.arange(8 * 128, dtype=np.float32).reshape(8, 128)


def _copy(backend: str | None = None) -> Any:
    return pl.pallas_call(copy, out_shape=jax.ShapeDtypeStruct(X.shape, X.dtype),
                          backend=backend)


def _interpret_still_works() -> None:
    np.testing.assert_array_equal(np.asarray(_copy("interpret")(X)), X)


class _Plugin:
    """A cpu backend whose hooks fail as ``faults`` says: hook name -> what to raise (an
    exception) or return."""

    package = ""

    def __init__(self, name: str, faults: dict[str, Any]) -> None:
        self.name, self.faults = name, faults

    def _do(self, hook: str, default: Any = None) -> Any:
        fault = self.faults.get(hook, default)
        if isinstance(fault, BaseException):
            raise fault
        return fault

    @plb.hookimpl
    def pallas_describe(self) -> pl.BackendInfo:
        return pl.BackendInfo(name=self.name, version="0", platforms=("cpu",),
                              package=self.package)


class Faulty(_Plugin):
    """Backend hooks that fail."""

    package = "faulty-dist"

    @plb.hookimpl
    def pallas_validate(self, call: Any) -> None:
        return self._do("pallas_validate")

    @plb.hookimpl
    def pallas_stages(self, call: Any, target: Any) -> Any:
        return self._do("pallas_stages", {"ir": "ok"})

    @plb.hookimpl
    def pallas_lower(self, request: Any) -> Any:
        return self._do("pallas_lower")

    @plb.hookimpl
    def pallas_memory_spaces(self) -> Any:
        return self._do("pallas_memory_spaces", ())


@pytest.fixture
def faulty(request: pytest.FixtureRequest) -> Any:
    registered = []

    def make(**faults: Any) -> str:
        name = f"faulty_{len(registered)}"
        pl.register_backend(Faulty(name, faults))
        registered.append(name)
        return name

    yield make
    for name in registered:
        manager.unregister(name)


@pytest.mark.parametrize(("hook", "fault", "phrase"), [
    ("pallas_validate", ValueError("a bad day"), "raised ValueError: a bad day"),
    ("pallas_validate", 42, "returned int 42, where its specification expects None"),
    ("pallas_stages", KeyError("ir"), "raised KeyError"),
    ("pallas_stages", ["ir"], "returned list ['ir'], where its specification expects a "
                              "mapping of stage name"),
])
def test_a_backend_hooks_fault_names_the_plugin(faulty: Any, hook: str, fault: Any,
                                                phrase: str) -> None:
    name = faulty(**{hook: fault})
    with pytest.raises(pl.PluginError) as info:
        pl.stages(_copy(name), X, backend=name)
    text = str(info.value)
    for part in (f"the {name!r} backend plugin (distribution 'faulty-dist')", f"`{hook}`",
                 phrase, "a defect of the plugin", f"PALLAS_DISABLED_BACKENDS={name}"):
        assert part in text, text
    if isinstance(fault, BaseException):
        assert info.value.__cause__ is fault
    _interpret_still_works()


def test_a_refusal_passes_through_unchanged(faulty: Any) -> None:
    refusal = pl.UnsupportedError("this backend does not copy on Tuesdays")
    name = faulty(pallas_validate=refusal)
    with pytest.raises(pl.UnsupportedError) as info:
        pl.stages(_copy(name), X, backend=name)
    assert info.value is refusal


def test_a_lowering_returning_garbage_is_a_lowering_error(faulty: Any) -> None:
    name = faulty(pallas_lower="not values")
    with pytest.raises(pl.LoweringError) as info:
        _copy(name)(X)
    assert isinstance(info.value, pl.PluginError)
    text = str(info.value)
    assert f"the {name!r} backend plugin (distribution 'faulty-dist')" in text
    assert "`pallas_lower` hook returned str 'not values'" in text
    assert "a sequence of MLIR values, one per kernel output" in text
    _interpret_still_works()


def test_memory_spaces_fault(faulty: Any) -> None:
    name = faulty(pallas_memory_spaces=RuntimeError("no table"))
    with pytest.raises(pl.PluginError, match=r"`pallas_memory_spaces` hook raised "
                       r"RuntimeError: no table"):
        manager.memory_spaces(name)
    bad = faulty(pallas_memory_spaces=["VMEM"])
    with pytest.raises(pl.PluginError, match=r"a sequence of MemorySpace"):
        manager.memory_spaces(bad)


class Broadcaster(_Plugin):
    """A plugin whose broadcast hooks fail."""

    package = "noisy-dist"

    @plb.hookimpl
    def pallas_validate_call(self, call: Any, backend: str) -> None:
        return self._do("pallas_validate_call")

    @plb.hookimpl
    def pallas_primitives(self) -> Any:
        return self._do("pallas_primitives") or ()

    @plb.hookimpl
    def pallas_emulate(self, call: Any) -> Any:
        return self._do("pallas_emulate")


@pytest.mark.parametrize(("hook", "fault", "phrase"), [
    ("pallas_validate_call", TypeError("every kernel"), "raised TypeError: every kernel"),
    ("pallas_primitives", ZeroDivisionError("oops"), "raised ZeroDivisionError: oops"),
    ("pallas_primitives", ["not semantics"], "a sequence of PrimitiveSemantics"),
])
def test_a_broadcast_hooks_fault_is_a_warning_and_kernels_still_run(hook: str, fault: Any,
                                                                    phrase: str) -> None:
    pl.register_backend(Broadcaster("noisy", {hook: fault}))
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            out = _copy("interpret")(X + 1)
        np.testing.assert_array_equal(np.asarray(out), X + 1)
        found = [str(w.message) for w in seen if issubclass(w.category, pl.PluginWarning)]
        assert found, [str(w.message) for w in seen]
        assert "the 'noisy' backend plugin (distribution 'noisy-dist')" in found[0]
        assert f"`{hook}`" in found[0] and phrase in found[0]
        assert "'interpret'" not in found[0]  # the interpreter is not blamed
    finally:
        manager.unregister("noisy")


def test_an_emulate_hook_fault_leaves_the_others_emulating() -> None:
    pytest.importorskip("pallas_mosaic_tpu")
    pl.register_backend(Broadcaster("noisy", {"pallas_emulate": KeyError("custom call")}))
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            out = pl.emulate(_copy("mosaic_tpu"), backend="mosaic_tpu")(X)
        np.testing.assert_array_equal(np.asarray(out), X)
        assert any(issubclass(w.category, pl.PluginWarning) and "`pallas_emulate`" in
                   str(w.message) for w in seen)
    finally:
        manager.unregister("noisy")


# --- first-party names and defaults --------------------------------------------------------

IMPOSTOR = """
    from pallas_core import BackendInfo
    from pallas_core.hookspecs import hookimpl

    @hookimpl
    def pallas_describe():
        return BackendInfo({name!r}, "6.6.6", ("cpu",), default_for=("cpu",))

    @hookimpl
    def pallas_lower(request):
        raise RuntimeError("the impostor ran")
"""


def _install(tmp_path: Any, monkeypatch: Any, dist: str, name: str, module: str) -> None:
    info = tmp_path / f"{dist}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[pallas.backends]\n{name} = {module}\n")
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(IMPOSTOR.format(name=name)))
    monkeypatch.syspath_prepend(str(tmp_path))


def test_another_distribution_cannot_take_a_first_party_name(tmp_path: Any,
                                                            monkeypatch: Any) -> None:
    _install(tmp_path, monkeypatch, "evil-dist", "interpret", "evil_interpret")
    monkeypatch.delenv("PALLAS_OVERRIDE_BACKENDS", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pl.PluginLoadWarning)
        pm = PluginManager()
        backends = pm.backends()
    assert backends["interpret"].info.version != "6.6.6"  # the real one
    why = pm.errors()["interpret (from evil-dist)"]
    assert "'evil-dist' provides an entry point named 'interpret'" in why
    assert "PALLAS_OVERRIDE_BACKENDS=interpret" in why


def test_an_explicit_setting_lets_it_replace_the_built_in(tmp_path: Any,
                                                          monkeypatch: Any) -> None:
    _install(tmp_path, monkeypatch, "evil-dist", "interpret", "evil_interpret")
    monkeypatch.setenv("PALLAS_OVERRIDE_BACKENDS", "interpret")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pl.PluginLoadWarning)
        pm = PluginManager()
        version = pm.get("interpret").info.version
    # Not refused now (the first of the two entry points named "interpret" loads).
    assert "interpret (from evil-dist)" not in pm.errors() and version


def test_a_third_party_default_does_not_displace_the_interpreter(tmp_path: Any,
                                                                 monkeypatch: Any) -> None:
    _install(tmp_path, monkeypatch, "aaa-dist", "aaa_cpu", "aaa_cpu_plugin")
    monkeypatch.delenv("PALLAS_DEFAULT_BACKEND", raising=False)
    pm = PluginManager()
    assert "aaa_cpu" in pm.backends()
    assert pm.default_for_platform("cpu") == "interpret"  # "aaa_cpu" sorts first
    monkeypatch.setenv("PALLAS_DEFAULT_BACKEND", "cpu=aaa_cpu")
    assert pm.default_for_platform("cpu") == "aaa_cpu"
    monkeypatch.setenv("PALLAS_DEFAULT_BACKEND", "cpu")
    with pytest.raises(pl.PluginConfigError, match=r"expected platform=backend pairs"):
        pm.default_for_platform("cpu")


def test_an_emulate_fault_with_no_other_answer_is_the_plugins_error() -> None:
    """When the faulty plugin is the only one that could have answered, its fault is the
    answer (not "no plugin emulates this")."""
    pytest.importorskip("pallas_mosaic_tpu")
    from pallas_core.emulation.call import EmulatedCall

    pl.register_backend(Broadcaster("noisy", {"pallas_emulate": KeyError("custom call")}))
    try:
        call = EmulatedCall(target="nobody_emulates_this", backend_config=b"", attributes={},
                            operands=(), results=(), aliases=(), options=None, name="k")
        with pytest.raises(pl.PluginError, match=r"'noisy' backend plugin .*`pallas_emulate` "
                           r"hook raised KeyError") as info:
            manager.broadcast("pallas_emulate", first=True, call=call)
        assert isinstance(info.value.__cause__, KeyError)
    finally:
        manager.unregister("noisy")


def test_only_the_plugin_package_is_hidden_from_source_lines(monkeypatch: Any,
                                                             tmp_path: Any) -> None:
    """Errors point at the kernel's line, not at a plugin's primitives: the package holding an
    installed plugin's entry module is hidden from source lines, and nothing more: not the
    larger project it sits in, not a namespace package (its directories may hold the user's
    code), not a lone module."""
    import types

    from pallas_core import _jax, plugins

    hidden: list[str] = []
    monkeypatch.setattr(_jax, "hide_frames_in", hidden.append)

    def module(name: str, path: list[str] | None, file: str | None) -> types.ModuleType:
        m = types.ModuleType(name)
        m.__file__ = file
        if path is not None:
            m.__path__ = path
        monkeypatch.setitem(sys.modules, name, m)
        return m

    acme = tmp_path / "acme"
    module("acme", [str(acme)], str(acme / "__init__.py"))
    module("acme.backend", [str(acme / "backend")], str(acme / "backend" / "__init__.py"))
    plugins._hide_package_frames(module("acme.backend.plugin", None, "plugin.py"))
    assert hidden == [str(acme / "backend")]

    hidden.clear()
    module("space", [str(tmp_path / "a"), str(tmp_path / "b")], None)  # a namespace package
    plugins._hide_package_frames(module("space.plugin", None, "plugin.py"))
    plugins._hide_package_frames(module("lone_backend", None, "lone_backend.py"))
    plugins._hide_package_frames(object())  # a plugin object, not a module
    assert hidden == []
