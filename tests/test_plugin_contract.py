"""The plugin contract holds itself: backend hooks go through pluggy's hook callers (so hook
wrappers and pluggy's tracing see them), and capabilities are typed (a misspelt one is an
error)."""

from __future__ import annotations

import ast
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import pytest

import pallas_core as pl
from pallas_core import backend as plb
from pallas_core import testing as plt
from pallas_core.plugins import PluginManager, manager

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _add_one(x_ref: Any, o_ref: Any) -> None:
    o_ref[...] = x_ref[...] + 1


def _program(x: jax.Array) -> jax.Array:
    return pl.pallas_call(_add_one, jax.ShapeDtypeStruct(x.shape, x.dtype))(x)


# --- backend hooks through pluggy -------------------------------------------------------------


class Observer:
    """A plugin that answers nothing: it wraps backend hooks (new-style wrappers, and an
    old-style ``hookwrapper``) and records what it sees."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, Any]] = []

    @plb.hookimpl(wrapper=True)
    def pallas_lower(self, request: Any) -> Any:
        result = yield
        self.seen.append(("lower", request.backend))
        return result

    @plb.hookimpl(wrapper=True)
    def pallas_stages(self, call: Any, target: Any) -> Any:
        result = yield
        self.seen.append(("stages", target))
        return {**result, "observed": "by a wrapper"}  # a wrapper may change the result

    @plb.hookimpl(hookwrapper=True)
    def pallas_validate(self, call: Any) -> Any:
        outcome = yield
        self.seen.append(("validate", outcome.get_result()))


@pytest.fixture
def observer() -> Any:
    obs = Observer()
    manager.pluggy_manager.register(obs, name="observer")
    try:
        yield obs
    finally:
        manager.pluggy_manager.unregister(obs)


def test_a_hook_wrapper_sees_the_backend_hooks_of_a_real_kernel(observer: Observer) -> None:
    """Wrappers registered by any plugin see the chosen backend's ``pallas_validate``,
    ``pallas_stages`` and ``pallas_lower``, with the backend's results, and may change them."""
    x = jnp.ones((8, 128), jnp.float32)
    found = pl.stages(_program, x, backend="mosaic_tpu", target="v5e")
    assert found[0]["observed"] == "by a wrapper"
    assert "tpu_custom_call" in found[0]["stablehlo"]  # lowered through the wrapper
    # pl.stages validates, then asks for the stages; reading "stablehlo" lowers the program
    # for TPU, where the kernel is validated again and lowered. A hook without firstresult
    # gives its wrappers pluggy's list of results.
    assert observer.seen == [("validate", []), ("stages", "v5e"), ("validate", []),
                             ("lower", "mosaic_tpu")]


def test_enable_tracing_shows_the_backend_hooks() -> None:
    """pluggy's ``enable_tracing`` on the core's manager traces backend hooks too."""
    lines: list[str] = []
    pm = manager.pluggy_manager
    pm.trace.root.setwriter(lines.append)
    undo = pm.enable_tracing()
    try:
        x = jnp.arange(8.0)
        out = pl.pallas_call(_add_one, jax.ShapeDtypeStruct(x.shape, x.dtype),
                             backend="interpret")(x)
    finally:
        undo()
        pm.trace.root.setwriter(None)
    assert float(out[0]) == 1.0
    traced = "".join(lines)
    assert "pallas_lower [hook]" in traced
    assert "finish pallas_lower -->" in traced


def test_wrappers_see_hooks_without_firstresult_and_exceptions_as_pluggy_says() -> None:
    """A wrapper of a hook without ``firstresult`` (``pallas_memory_spaces``) sees pluggy's
    list of results while the core still gets the backend's answer; an exception the backend
    raises passes through the wrappers unchanged and reaches the core as the plugin's error (a
    ``PluginError`` naming the backend, the original its cause); a backend without the hook
    gives ``None``, no wrapper called."""
    space = pl.MemorySpace("SCRATCHPAD", backend="contract_demo")

    class Demo:
        @plb.hookimpl
        def pallas_describe(self) -> plb.BackendInfo:
            return plb.BackendInfo(name="contract_demo", version="0", platforms=("cpu",))

        @plb.hookimpl
        def pallas_memory_spaces(self) -> list[Any]:
            return [space]

        @plb.hookimpl
        def pallas_lower(self, request: Any) -> Any:
            raise KeyError("boom")

    seen: list[Any] = []

    class Watcher:
        @plb.hookimpl(wrapper=True)
        def pallas_memory_spaces(self) -> Any:
            result = yield
            seen.append(result)
            return result

        @plb.hookimpl(wrapper=True)
        def pallas_lower(self, request: Any) -> Any:
            try:
                return (yield)
            except KeyError as e:
                seen.append(e)
                raise

        @plb.hookimpl(wrapper=True)
        def pallas_stages(self, call: Any, target: Any) -> Any:
            seen.append("stages")
            return (yield)

    pm = PluginManager()
    pm.register(Demo())
    pm.pluggy_manager.register(Watcher())
    assert pm.memory_spaces("contract_demo") == (space,)
    with pytest.raises(pl.LoweringError, match="hook raised KeyError: 'boom'") as info:
        pm.call_hook("contract_demo", "pallas_lower", request=None)
    assert isinstance(info.value, pl.PluginError) and isinstance(info.value.__cause__, KeyError)
    assert pm.call_hook("contract_demo", "pallas_stages", call=None, target=None) is None
    assert [type(s) for s in seen] == [list, KeyError]
    assert seen[0] == [[space]]


# --- typed capabilities -----------------------------------------------------------------------


def _info(capabilities: Any) -> plb.BackendInfo:
    return plb.BackendInfo(name="caps", version="0", platforms=("cpu",),
                           capabilities=capabilities)


def test_a_misspelt_capability_is_refused_naming_it_and_the_valid_ones() -> None:
    with pytest.raises(pl.PluginLoadError) as e:
        _info({plb.Capability.SCRATCH, "atomcs"})
    message = str(e.value)
    assert "'atomcs' is not a capability (did you mean Capability.ATOMICS?)" in message
    assert all(c.value in message for c in plb.Capability)
    with pytest.raises(pl.PluginLoadError, match="found str 'atomics'"):
        _info("atomics")  # a bare string, not a collection of capabilities


def test_a_plugin_declaring_a_misspelt_capability_fails_to_load_by_name() -> None:
    class Typo:
        @plb.hookimpl
        def pallas_describe(self) -> plb.BackendInfo:
            return plb.BackendInfo(name="typo", version="0", platforms=("cpu",),
                                   capabilities=frozenset({"scrach"}))

    with pytest.raises(pl.PluginLoadError,
                       match=r"'typo'.*'scrach' is not a capability.*Capability.SCRATCH"):
        PluginManager().register(Typo(), name="typo")


def test_capabilities_are_typed_and_strings_naming_one_are_converted() -> None:
    info = _info(["atomics", plb.Capability.VMAP])
    assert info.capabilities == frozenset({plb.Capability.ATOMICS, plb.Capability.VMAP})
    assert all(type(c) is plb.Capability for c in info.capabilities)
    for name, backend in manager.backends().items():
        assert all(type(c) is plb.Capability for c in backend.info.capabilities), name
    assert plt.SCRATCH is plb.Capability.SCRATCH
    assert all(type(c) is plb.Capability for c in plt.CAPABILITIES)


_DECLARING = ["pallas_core/dispatch.py", "pallas_core/testing/conformance.py",
              *sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("plugins/*/pallas_*/plugin.py")),
              "tests/third_party_backend/pallas_xla_unrolled/plugin.py"]
"""The files that name capabilities: the core's checks, the suite, every plugin's description."""


def test_capabilities_are_named_by_the_enum_not_by_strings() -> None:
    """The core's checks, the conformance suite and every plugin name capabilities as
    ``Capability`` members: no string literal equal to a capability's value."""
    values = {c.value for c in plb.Capability}
    literals = []
    for path in _DECLARING:
        tree = ast.parse((ROOT / path).read_text())
        literals += [f"{path}:{node.lineno}: {node.value!r}" for node in ast.walk(tree)
                     if isinstance(node, ast.Constant) and node.value in values]
    assert not literals, f"capabilities named as strings: {literals}"
