"""Finding, loading and choosing backend plugins (entry-point group ``pallas.backends``).

Plugins are loaded lazily, on the first call that needs a backend, never on import.
Environment variables:

* ``PALLAS_DISABLE_PLUGIN_AUTOLOAD``: ``1`` (or ``true``, ``yes``, ``on``) loads no entry
  points (register plugins by hand with :func:`register_backend`); ``0`` (``false``, ``no``,
  ``off``) or unset loads them. Any other value is a ``PluginConfigError``.
* ``PALLAS_BACKENDS=a,b``: load only the named entry points (an allow-list);
* ``PALLAS_DISABLED_BACKENDS=a,b``: skip the named entry points;
* ``PALLAS_OVERRIDE_BACKENDS=a,b``: let another distribution's entry point take the name of
  a first-party backend (``interpret``, ``triton``, ...). Without it such an entry point is
  not loaded (an error names it): installation order never replaces a built-in backend;
* ``PALLAS_DEFAULT_BACKEND=platform=name,...``: the backend used on a platform when a kernel
  names none. Without it, a first-party backend that is the default for the platform is
  chosen before any third-party one, whatever their priorities.

A plugin that fails to import, to describe itself or to match the hook specifications is
recorded with its error and reported by name (``python -m pallas_core``), and warned about
once (a ``PluginLoadWarning``) when the plugins are first used; the others load.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import importlib.metadata
import os
import sys
import threading
import traceback
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import pluggy

from pallas_core import _jax, hookspecs
from pallas_core.errors import (
    BackendNotFoundError,
    LoweringError,
    PallasError,
    PluginConfigError,
    PluginError,
    PluginLoadError,
    PluginLoadWarning,
    PluginWarning,
)

ENTRY_POINT_GROUP = "pallas.backends"
DISABLE_AUTOLOAD_ENV = "PALLAS_DISABLE_PLUGIN_AUTOLOAD"
DISABLED_BACKENDS_ENV = "PALLAS_DISABLED_BACKENDS"
ALLOWED_BACKENDS_ENV = "PALLAS_BACKENDS"
OVERRIDE_BACKENDS_ENV = "PALLAS_OVERRIDE_BACKENDS"
DEFAULT_BACKEND_ENV = "PALLAS_DEFAULT_BACKEND"

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})

KNOWN_PACKAGES: Mapping[str, str] = {
    "interpret": "pallas-interpret",
    "triton": "pallas-triton",
    "mosaic_tpu": "pallas-mosaic-tpu",
    "mosaic_gpu": "pallas-mosaic-gpu",
    "sparsecore": "pallas-sparsecore",
}
"""The distribution that provides each first-party backend (for error messages)."""


class Capability(enum.StrEnum):
    """A feature a backend declares it runs, in ``BackendInfo.capabilities``
    (``pallas_core.backend.Capability``). Each member equals its value as a string
    (``Capability.ATOMICS == "atomics"``). A feature the core reads is refused by the core for
    a backend that lacks it; one the conformance suite tests (``pallas_core.testing.
    CAPABILITIES``) must be refused by a backend that does not declare it."""

    ALIASING = "aliasing"
    """``input_output_aliases`` (conformance)."""
    ASYNC_COPY = "async_copy"
    """Local asynchronous copies, ``pallas_core.copies`` (conformance)."""
    ATOMICS = "atomics"
    """``pl.atomic_add``, ``pl.atomic_max``, ... (conformance)."""
    BOUNDED_SLICE_BLOCKS = "bounded_slice_blocks"
    """``pl.BoundedSlice`` block dimensions (read by the core)."""
    CHECKED_MODE = "checked_mode"
    """A checked mode: uninitialised memory poisoned, out-of-bounds blocks and races
    reported."""
    DEBUG_PRINT = "debug_print"
    """``pl.debug_print`` (conformance)."""
    DYNAMIC_GRID = "dynamic_grid"
    """Grid sizes that are traced values (read by the core)."""
    ELEMENT_BLOCKS = "element_blocks"
    """``pl.Element`` block dimensions (read by the core)."""
    FOREIGN_MEMORY_SPACES = "foreign_memory_spaces"
    """Refs in other backends' memory spaces, as the interpreter runs them (read by the
    core)."""
    MASKED_ACCESS = "masked_access"
    """``pl.load``/``pl.store`` with ``mask=`` (conformance)."""
    MESH = "mesh"
    """``pl.kernel`` over a ``pl.Mesh`` (conformance)."""
    PIPELINE_MODE = "pipeline_mode"
    """``BlockSpec(pipeline_mode=pl.Buffered(n))`` (read by the core)."""
    REMOTE_COPY = "remote_copy"
    """Copies to other devices' memory (``make_async_remote_copy``)."""
    RUN_SCOPED = "run_scoped"
    """``pl.run_scoped`` (conformance)."""
    SCALAR_PREFETCH = "scalar_prefetch"
    """``GridSpec(num_scalar_prefetch=...)`` (conformance)."""
    SCRATCH = "scratch"
    """``scratch_shapes`` (conformance)."""
    SEMAPHORES = "semaphores"
    """``pl.semaphore_signal``/``wait``/``read`` (conformance)."""
    SYMBOLIC_BLOCKS = "symbolic_blocks"
    """Symbolic block shapes, ``jax.export`` with shape polymorphism (read by the core;
    conformance)."""
    VMAP = "vmap"
    """``jax.vmap`` of a kernel (conformance)."""


@dataclasses.dataclass(frozen=True)
class BackendInfo:
    """What a plugin says about itself (returned by its ``pallas_describe`` hook)."""

    name: str
    version: str
    platforms: tuple[str, ...]
    """JAX platforms it lowers for (``"cpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"``)."""
    compiler_params_type: type | None = None
    default_for: tuple[str, ...] = ()
    """Platforms on which it is chosen when the user names no backend."""
    default_priority: Callable[[str], int] | None = None
    """Where several loaded backends name a platform in ``default_for``, the one whose
    ``default_priority(platform)`` is highest is chosen (``None`` counts as 0; ties go to the
    first name alphabetically). Asked each time a backend is chosen, so it may follow a setting
    (Mosaic GPU and Triton follow JAX's ``jax_pallas_use_mosaic_gpu`` on ``cuda``)."""
    capabilities: frozenset[Capability] = frozenset()
    """The features the backend runs, as :class:`Capability` members (plain strings naming
    one, ``"atomics"``, are accepted and converted; anything else is a ``PluginLoadError``).
    The core reads ``FOREIGN_MEMORY_SPACES``, ``PIPELINE_MODE``, ``DYNAMIC_GRID``,
    ``ELEMENT_BLOCKS``, ``BOUNDED_SLICE_BLOCKS`` and ``SYMBOLIC_BLOCKS``, refusing kernels that
    need one the backend lacks; the conformance suite tests the others."""
    package: str = ""
    """The pip distribution that provides it."""
    device_kinds: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Hardware targets (as ``target=`` names them) -> JAX device kinds (``"v5e"`` ->
    ``"TPU v5 lite"``), the first being the default: the device ``pl.emulate`` tells JAX it
    compiles for, since lowerings may ask and no such device is attached."""
    chips: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Chips (target name -> ``pallas_core.roofline.Chip``) whose peaks and on-chip memory
    ``pl.report`` uses, the first being the default; keys may differ from ``device_kinds``'
    (``"h100"`` where the compile target is ``"sm_90"``)."""
    block_traffic: str = "pipeline"
    """How blocks reach the kernel, for ``pl.report``'s HBM bytes: ``"pipeline"`` (each grid
    step's blocks are copied into on-chip memory, a copy skipped where the step keeps the
    previous step's block: Mosaic TPU, Mosaic GPU) or ``"loads"`` (a block is a window on
    HBM, and the bytes are those the body loads and stores: Triton)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "capabilities", _capabilities(self.capabilities, self.name))


def _capabilities(value: Any, backend: str) -> frozenset[Capability]:
    """``value`` (``BackendInfo.capabilities``) as a frozenset of :class:`Capability`, or a
    ``PluginLoadError`` naming what is not one."""
    where = f"BackendInfo(name={backend!r}, capabilities=...)"
    valid = ", ".join(c.value for c in Capability)
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise PluginLoadError(
            f"{where}: expected a collection of pallas_core.backend.Capability members, found "
            f"{type(value).__name__} {value!r}. Fix: capabilities=frozenset({{Capability.X, "
            f"...}}), with X one of {valid}.")
    found, unknown = set(), []
    for c in value:
        try:
            found.add(Capability(c))
        except ValueError:
            unknown.append(c)
    if unknown:
        bad = unknown[0]
        close = (difflib.get_close_matches(bad, [c.value for c in Capability], n=1)
                 if isinstance(bad, str) else [])
        hint = f" (did you mean Capability.{Capability(close[0]).name}?)" if close else ""
        raise PluginLoadError(
            f"{where}: {bad!r} is not a capability{hint}. Expected members of "
            f"pallas_core.backend.Capability (or their names as strings): {valid}. Fix: "
            f"correct the spelling, or drop {bad!r} (a backend's own features are not "
            "capabilities: the core and the conformance suite read only these).")
    return frozenset(found)


@dataclasses.dataclass(frozen=True)
class Backend:
    """A loaded backend: its description and the plugin object holding its hooks."""

    info: BackendInfo
    plugin: Any


class PluginManager:
    """The registry of backends, loaded from entry points on first use."""

    def __init__(self) -> None:
        self._pm = pluggy.PluginManager(hookspecs.PROJECT)
        self._pm.add_hookspecs(hookspecs)
        self._backends: dict[str, Backend] = {}
        self._errors: dict[str, str] = {}
        self._skipped: dict[str, tuple[str, str]] = {}
        """Installed entry points not loaded because of the environment: (reason, fix)."""
        self._loaded = False
        self._lock = threading.RLock()
        self._listeners: list[Any] = []
        self._register_core()

    @property
    def hook(self) -> Any:
        """The pluggy hook relay, for the broadcast hooks
        (``manager.hook.pallas_primitives()``); backend hooks go through :meth:`call_hook`
        (calling one here would ask every backend)."""
        self.ensure_loaded()
        return self._pm.hook

    def _register_core(self) -> None:
        from pallas_core import copies, semantics

        class CorePlugin:
            @staticmethod
            @hookspecs.hookimpl
            def pallas_primitives() -> Any:
                return semantics.CORE_SEMANTICS + copies.SEMANTICS

        self._pm.register(CorePlugin(), name="pallas_core")

    def ensure_loaded(self) -> None:
        """Loads the entry points once (unless autoload is disabled)."""
        with self._lock:
            if self._loaded:
                return
            autoload = os.environ.get(DISABLE_AUTOLOAD_ENV, "").strip()
            if autoload.lower() not in _TRUE | _FALSE:
                raise PluginConfigError(
                    f"{DISABLE_AUTOLOAD_ENV}={autoload!r}: expected 1 (or true, yes, on) to "
                    "load no backend plugins, or 0 (false, no, off) or unset to load them. "
                    f"Fix: set {DISABLE_AUTOLOAD_ENV}=1 or unset it; to choose the backends "
                    f"that load, use {ALLOWED_BACKENDS_ENV}=a,b or {DISABLED_BACKENDS_ENV}=a,b.")
            self._loaded = True
            disabled_env = os.environ.get(DISABLED_BACKENDS_ENV, "")
            disabled = _names(disabled_env)
            allowed_env = os.environ.get(ALLOWED_BACKENDS_ENV)
            allowed = _names(allowed_env) if allowed_env is not None else None
            for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
                impostor = _impostor(ep.name, _dist_name(ep))
                if impostor:
                    self._errors[f"{ep.name} (from {_dist_name(ep)})"] = impostor
                    continue
                if ep.name in self._backends:
                    continue
                if autoload.lower() in _TRUE:
                    self._skipped[ep.name] = (
                        f"{DISABLE_AUTOLOAD_ENV}={autoload}",
                        f"unset {DISABLE_AUTOLOAD_ENV}, or register the backend by hand with "
                        "pl.register_backend")
                    continue
                if allowed is not None and ep.name not in allowed:
                    self._skipped[ep.name] = (
                        f"{ALLOWED_BACKENDS_ENV}={allowed_env}",
                        f"add {ep.name!r} to {ALLOWED_BACKENDS_ENV}, or unset it")
                    continue
                if ep.name in disabled:
                    self._skipped[ep.name] = (
                        f"{DISABLED_BACKENDS_ENV}={disabled_env}",
                        f"remove {ep.name!r} from {DISABLED_BACKENDS_ENV}")
                    continue
                try:
                    plugin = ep.load()
                except Exception as e:
                    error = "".join(traceback.format_exception_only(e)).strip()
                    self._errors[ep.name] = (
                        f"importing {ep.value!r} failed: {error}. Fix: reinstall or uninstall "
                        f"the distribution {_dist_name(ep)!r}, or skip it with "
                        f"{DISABLED_BACKENDS_ENV}={ep.name}."
                    )
                    continue
                dist = _dist_name(ep)
                try:
                    self._add(ep.name, plugin, dist)
                except PluginLoadError as e:
                    self._errors[ep.name] = str(e)
                    continue
                _hide_package_frames(plugin)
            if self._errors:
                failed = "; ".join(f"{name!r}: {why}" for name, why in sorted(
                    self._errors.items()))
                warnings.warn(PluginLoadWarning(
                    f"{len(self._errors)} installed backend plugin(s) failed to load and are "
                    f"unavailable ({failed}). `python -m pallas_core` lists every backend."),
                    stacklevel=3)

    def register(self, plugin: Any, name: str | None = None) -> Backend:
        """Registers a backend plugin object (or module) by hand; returns it loaded.

        Raises ``PluginLoadError`` if it does not satisfy the hook specifications.
        """
        with self._lock:
            self.ensure_loaded()
            return self._add(name, plugin, "")

    def unregister(self, name: str) -> None:
        """Removes a backend registered under ``name``."""
        with self._lock:
            backend = self._backends.pop(name, None)
            if backend is not None:
                self._pm.unregister(backend.plugin)
                self._notify()

    def _add(self, name: str | None, plugin: Any, dist: str) -> Backend:
        label = name or getattr(plugin, "__name__", None) or type(plugin).__name__
        describe = getattr(plugin, "pallas_describe", None)
        if describe is None:
            raise PluginLoadError(
                f"backend plugin {label!r} has no `pallas_describe` hook; every backend must "
                "describe itself (see docs/writing-a-backend.md)."
            )
        try:
            info = describe()
        except Exception as e:
            raise PluginLoadError(
                f"backend plugin {label!r}: hook `pallas_describe` raised "
                f"{type(e).__name__}: {e}"
            ) from e
        if not isinstance(info, BackendInfo):
            raise PluginLoadError(
                f"backend plugin {label!r}: hook `pallas_describe` must return a "
                f"pallas_core.BackendInfo, returned {type(info).__name__}. Fix: return "
                "BackendInfo(name=..., version=..., platforms=(...))."
            )
        if name is not None and info.name != name:
            raise PluginLoadError(
                f"backend plugin registered as {name!r} describes itself as {info.name!r}; "
                "the entry-point name and BackendInfo.name must agree."
            )
        if info.name in self._backends:
            raise PluginLoadError(
                f"backend plugin {label!r}: a backend named {info.name!r} is already "
                "registered. Fix: choose another name, or unregister the other first "
                f"(pallas_core.plugins.manager.unregister({info.name!r}))."
            )
        if not info.package and dist:
            info = dataclasses.replace(info, package=dist)
        try:
            self._pm.register(plugin, name=info.name)
            self._pm.check_pending()
        except pluggy.PluginValidationError as e:
            if self._pm.is_registered(plugin):
                self._pm.unregister(plugin)
            raise PluginLoadError(
                f"backend plugin {info.name!r} implements a hook wrongly: {e}. "
                f"Fix: {_hook_fix(plugin)}"
            ) from e
        backend = Backend(info, plugin)
        self._backends[info.name] = backend
        self._errors.pop(info.name, None)
        self._skipped.pop(info.name, None)
        self._notify()
        return backend

    def add_listener(self, fn: Any) -> None:
        """Calls ``fn()`` whenever the set of backends changes (used to drop caches)."""
        self._listeners.append(fn)

    def _notify(self) -> None:
        for fn in self._listeners:
            fn()

    def backends(self) -> Mapping[str, Backend]:
        """The loaded backends by name."""
        self.ensure_loaded()
        return dict(self._backends)

    def errors(self) -> Mapping[str, str]:
        """Backends that failed to load, by entry-point name, with the reason."""
        self.ensure_loaded()
        return dict(self._errors)

    def skipped(self) -> Mapping[str, str]:
        """Installed backends not loaded because of the environment, with the variable set."""
        self.ensure_loaded()
        return {name: reason for name, (reason, _) in self._skipped.items()}

    def get(self, name: str) -> Backend:
        """The backend called ``name``, or a ``BackendNotFoundError`` that says how to get it."""
        backends = self.backends()
        if name in backends:
            return backends[name]
        installed = ", ".join(sorted(backends)) or "none"
        if name in self._errors:
            raise BackendNotFoundError(
                f"backend {name!r} is installed but failed to load: {self._errors[name]}"
            )
        if name in self._skipped:
            reason, fix = self._skipped[name]
            raise BackendNotFoundError(
                f"backend {name!r} is installed but was not loaded because {reason} is set. "
                f"Fix: {fix}."
            )
        known = {*backends, *self._errors, *self._skipped, *KNOWN_PACKAGES} - {name}
        close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
        if close and name not in KNOWN_PACKAGES:
            raise BackendNotFoundError(
                f"no backend named {name!r}; did you mean {close[0]!r}? Installed backends: "
                f"{installed}. Fix: backend={close[0]!r}.")
        package = KNOWN_PACKAGES.get(name)
        fix = (f"Fix: `pip install {package}`" if package
               else "Fix: install the package that provides it, or check the spelling")
        raise BackendNotFoundError(
            f"no backend named {name!r}. Installed backends: {installed}. {fix}, or choose "
            "one of the installed backends."
        )

    @property
    def pluggy_manager(self) -> pluggy.PluginManager:
        """The underlying ``pluggy.PluginManager``, for plugins that observe hook calls
        rather than answer them: register a hook wrapper with ``.register(obj)`` (an object
        whose ``@hookimpl(wrapper=True)`` methods wrap ``pallas_lower``, ...), trace with
        ``.enable_tracing()`` or ``.add_hookcall_monitoring(...)``. Backends register through
        :meth:`register`. Does not load the entry points, so tracing may start first."""
        return self._pm

    def call_hook(self, name: str, hook: str, *, passthrough: tuple[type[BaseException], ...]
                  = (), **kwargs: Any) -> Any:
        """Calls ``hook`` on backend ``name``'s plugin alone, through pluggy's hook caller, so
        that hook wrappers (``@hookimpl(wrapper=True)`` or ``hookwrapper=True``, from any
        plugin), ``firstresult`` and pluggy's tracing and monitoring apply; ``None`` if the
        plugin does not implement it. How the core calls the backend hooks: it resolves the
        backend once, and no other plugin's implementation is asked. The result is the
        implementation's (for a hook without ``firstresult``, not pluggy's list of results).

        A ``PallasError`` the hook raises (a refusal) propagates unchanged, as do exceptions
        of the types in ``passthrough`` (for a caller that reports them itself); any other
        exception, or a result of the wrong kind (:func:`results`), is the plugin's defect: a
        ``PluginError`` naming the backend, its distribution and the hook."""
        plugin = self.get(name).plugin
        answers = self._answering(hook)
        if not any(p is plugin for p in answers):
            return None
        try:
            result = self._call_one(hook, plugin, answers, kwargs)
        except Exception as e:
            if isinstance(e, (PallasError, *passthrough)):
                raise
            raise self.plugin_error(name, hook, f"raised {type(e).__name__}: {e}") from e
        wrong = _malformed(hook, result)
        if wrong:
            raise self.plugin_error(name, hook, wrong)
        return result

    def _answering(self, hook: str) -> list[Any]:
        """The plugins implementing ``hook`` (wrappers aside), in registration order."""
        return [impl.plugin for impl in getattr(self._pm.hook, hook).get_hookimpls()
                if not (impl.wrapper or impl.hookwrapper)]

    def _call_one(self, hook: str, plugin: Any, answers: list[Any],
                  kwargs: Mapping[str, Any]) -> Any:
        """``plugin``'s answer to ``hook`` alone, through pluggy (every plugin's wrappers
        kept, the other ``answers`` left out): the result itself, also for a hook without
        ``firstresult`` (not pluggy's list)."""
        caller = getattr(self._pm.hook, hook)
        subset = self._pm.subset_hook_caller(hook, [p for p in answers if p is not plugin])
        result = subset(**kwargs)
        if not (caller.spec is not None and caller.spec.opts.get("firstresult")):
            result = result[0] if result else None
        return result

    def plugin_error(self, name: str, hook: str, what: str) -> PluginError:
        """The ``PluginError`` for backend ``name``'s hook ``hook`` having done ``what`` (a
        ``LoweringError``, one kind of it, for ``pallas_lower``)."""
        backend = self._backends.get(name)
        dist = (backend.info.package if backend is not None else "") or \
            KNOWN_PACKAGES.get(name, "")
        by = f" (distribution {dist!r})" if dist else ""
        kind = LoweringError if hook == "pallas_lower" else PluginError
        return kind(
            f"the {name!r} backend plugin{by}: its `{hook}` hook {what}. This is a defect of "
            "the plugin, not of the kernel: a hook refuses what it cannot do with a "
            "PallasError. Fix: report it to the plugin's authors; meanwhile use another "
            f"backend, or keep this one from loading ({DISABLED_BACKENDS_ENV}={name}).")

    def broadcast(self, hook: str, *, first: bool = False, **kwargs: Any
                  ) -> list[tuple[str, Any]]:
        """Calls every plugin's implementation of the broadcast hook ``hook`` one at a time
        (through pluggy, wrappers included), newest first as pluggy orders them, and returns
        ``(plugin name, answer)`` for each that answered (``None`` is no answer). A
        ``PallasError`` propagates (a refusal); any other exception, or an answer of the wrong
        kind (:func:`results`), is that plugin's defect: a ``PluginWarning`` naming it, and
        its answer is left out, so that one faulty plugin breaks no other plugin or kernel."""
        self.ensure_loaded()
        answers = self._answering(hook)
        found: list[tuple[str, Any]] = []
        faults: list[tuple[str, str, BaseException | None]] = []
        for plugin in reversed(answers):
            name = self._pm.get_name(plugin) or type(plugin).__name__
            try:
                result = self._call_one(hook, plugin, answers, kwargs)
            except PallasError:
                raise
            except Exception as e:
                faults.append((name, f"raised {type(e).__name__}: {e}", e))
                continue
            wrong = _malformed(hook, result)
            if wrong:
                faults.append((name, wrong, None))
                continue
            if result is not None:
                found.append((name, result))
                if first:
                    break
        if first and not found and faults:  # the faulty plugin was the one to answer
            name, what, cause = faults[0]
            raise self.plugin_error(name, hook, what) from cause
        for name, what, _ in faults:
            self._warn(name, hook, what)
        return found

    def _warn(self, name: str, hook: str, what: str) -> None:
        message = str(self.plugin_error(name, hook, what)).replace(
            "This is a defect", "Its answer is left out. This is a defect")
        warnings.warn(PluginWarning(message), stacklevel=4)

    def memory_spaces(self, name: str) -> tuple[Any, ...]:
        """The memory spaces backend ``name`` defines (its ``pallas_memory_spaces`` hook)."""
        return tuple(self.call_hook(name, "pallas_memory_spaces") or ())

    def backend_for_params(self, params: Any) -> str | None:
        """The backend whose ``CompilerParams`` type ``params`` is an instance of."""
        for name, b in self.backends().items():
            t = b.info.compiler_params_type
            if t is not None and isinstance(params, t):
                return name
        backend = getattr(type(params), "BACKEND", None)
        if isinstance(backend, str):
            return backend
        from pallas_core import _jax  # JAX's own params classes, by where JAX defines them

        return _jax.jax_params_backend(params)

    def default_for_platform(self, platform: str) -> str:
        """The backend used on ``platform`` when the user chose none: the one
        ``PALLAS_DEFAULT_BACKEND`` names for it, else, of the loaded backends whose
        ``default_for`` names it, a first-party one before any other, then the one of highest
        ``default_priority`` (ties: the first name alphabetically)."""
        chosen = _defaults().get(platform)
        if chosen is not None:
            return self.get(chosen).info.name
        candidates = [(not _first_party(b), -_priority(b.info, platform), name)
                      for name, b in self.backends().items() if platform in b.info.default_for]
        if candidates:
            return min(candidates)[2]
        skipped = ", ".join(f"{n} ({reason})" for n, reason in sorted(self.skipped().items()))
        skipped = f" Installed but not loaded: {skipped}." if skipped else ""
        raise BackendNotFoundError(
            f"no installed backend is the default for platform {platform!r}. Loaded: "
            f"{', '.join(sorted(self.backends())) or 'none'}.{skipped} Fix: pass "
            "backend=NAME, install a backend for this platform (e.g. `pip install "
            "pallas-interpret`), or unset the environment variable that keeps it from loading."
        )


def _sequence_of(kind: type | tuple[type, ...]) -> Callable[[Any], bool]:
    return lambda r: isinstance(r, (list, tuple)) and all(isinstance(x, kind) for x in r)


@functools.cache
def results() -> Mapping[str, tuple[Callable[[Any], bool], str]]:
    """Per hook, a check of what an implementation returned and what it should return; a
    result that fails it is a ``PluginError`` (or, from a broadcast hook, a
    ``PluginWarning``). Built on first use: the checks' types live in modules that import
    this one."""
    from pallas_core.report_work import OpCost
    from pallas_core.semantics import PrimitiveSemantics
    from pallas_core.spec import MemorySpace

    return {
        "pallas_validate": (lambda r: r is None, "None (a refusal raises a PallasError)"),
        "pallas_validate_call": (lambda r: r is None,
                                 "None (a refusal raises a PallasError)"),
        "pallas_lower": (lambda r: isinstance(r, (list, tuple)),
                         "a sequence of MLIR values, one per kernel output"),
        "pallas_stages": (lambda r: isinstance(r, Mapping) and all(
            isinstance(k, str) for k in r), "a mapping of stage name to text or bytes"),
        "pallas_memory_spaces": (_sequence_of(MemorySpace), "a sequence of MemorySpace"),
        "pallas_primitives": (_sequence_of(PrimitiveSemantics),
                              "a sequence of PrimitiveSemantics"),
        "pallas_emulate": (lambda r: isinstance(r, (list, tuple)),
                           "a sequence of arrays, one per result"),
        "pallas_footprint": (lambda r: isinstance(r, tuple) and len(r) == 2,
                             "(parts, limit): a sequence of (what, bytes) and an int"),
        "pallas_op_cost": (lambda r: isinstance(r, OpCost),
                           "a pallas_core.backend.OpCost, or None"),
    }


def _malformed(hook: str, result: Any) -> str:
    """What is wrong with ``result`` as an answer to ``hook`` (:func:`results`), or ``""``
    (``None``, no answer, is never malformed here: callers decide what it means)."""
    expected = results().get(hook)
    if result is None or expected is None or expected[0](result):
        return ""
    return f"returned {_show(result)}, where its specification expects {expected[1]}"


def _show(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:80]}{'...' if len(text) > 80 else ''}"


def _normalized(dist: str) -> str:
    return dist.lower().replace("_", "-").replace(".", "-")


def _first_party(backend: Backend) -> bool:
    """Whether ``backend`` is a first-party one: its name and distribution those of
    :data:`KNOWN_PACKAGES` (a backend registered by hand with a first-party name counts)."""
    dist = KNOWN_PACKAGES.get(backend.info.name)
    return dist is not None and _normalized(backend.info.package or dist) == dist


def _impostor(name: str, dist: str) -> str:
    """Why the entry point ``name`` of distribution ``dist`` is not loaded, if it takes a
    first-party backend's name from another distribution without ``PALLAS_OVERRIDE_BACKENDS``
    (``""`` otherwise)."""
    owner = KNOWN_PACKAGES.get(name)
    if owner is None or not dist or _normalized(dist) == owner:
        return ""
    if name in _names(os.environ.get(OVERRIDE_BACKENDS_ENV, "")):
        return ""
    return (f"the distribution {dist!r} provides an entry point named {name!r}, the name of "
            f"the first-party backend of {owner!r}; it is not loaded, so that installing a "
            "package never replaces a built-in backend. Fix: give that backend another name, "
            f"or set {OVERRIDE_BACKENDS_ENV}={name} to let it replace the built-in.")


def _defaults() -> dict[str, str]:
    """``PALLAS_DEFAULT_BACKEND`` as platform -> backend name."""
    value = os.environ.get(DEFAULT_BACKEND_ENV, "").strip()
    found: dict[str, str] = {}
    for item in filter(None, (i.strip() for i in value.split(","))):
        platform, sep, name = item.partition("=")
        if not sep or not platform.strip() or not name.strip():
            raise PluginConfigError(
                f"{DEFAULT_BACKEND_ENV}={value!r}: expected platform=backend pairs separated "
                f"by commas, found {item!r}. Fix: e.g. {DEFAULT_BACKEND_ENV}=cpu=interpret,"
                "cuda=triton.")
        found[platform.strip()] = name.strip()
    return found


def _priority(info: BackendInfo, platform: str) -> int:
    return 0 if info.default_priority is None else int(info.default_priority(platform))


def _names(value: str) -> set[str]:
    """The backend names of a comma-separated environment variable."""
    return {n.strip() for n in value.split(",") if n.strip()}


def _dist_name(ep: importlib.metadata.EntryPoint) -> str:
    return ep.dist.name if ep.dist is not None else ""


def _hook_fix(plugin: Any) -> str:
    """How to repair a plugin whose hook implementations pluggy rejected."""
    specs = sorted(n for n in dir(hookspecs) if n.startswith("pallas_"))
    unknown = [n for n in dir(plugin) if n.startswith("pallas_") and n not in specs
               and callable(getattr(plugin, n, None))]
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, specs, n=1)
        hints.append(f"{name!r} is not a pallas hook" + (f" (did you mean {close[0]!r}?)"
                                                         if close else ""))
    return "; ".join([*hints, "give each hook the name and parameters of its specification "
                      f"in pallas_core.hookspecs ({', '.join(specs)})."])


manager = PluginManager()
"""The process-wide plugin manager."""


def _hide_package_frames(plugin: Any) -> None:
    """The package holding an installed plugin's entry module (``pallas_triton`` for
    ``pallas_triton.plugin``) is internal to the source lines of kernels' equations, as the
    core is: an error raised where a kernel calls the plugin's own primitives (``plgpu.load``,
    ``pltpu.async_copy``) points at the kernel's line, not the plugin's. Only that package: not
    a larger project it sits in, nor a namespace package (whose directories may hold the
    user's own code), nor a lone module."""
    parent = str(getattr(plugin, "__name__", "")).rpartition(".")[0]
    package = sys.modules.get(parent) if parent else None
    if package is None or getattr(package, "__file__", None) is None:
        return
    for path in getattr(package, "__path__", ()):
        _jax.hide_frames_in(os.path.abspath(path))


def register_backend(plugin: Any, name: str | None = None) -> Backend:
    """Registers a backend plugin by hand (e.g. in tests, or with autoload disabled)."""
    return manager.register(plugin, name)
