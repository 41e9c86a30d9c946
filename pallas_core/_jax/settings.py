"""JAX settings the core reads or adds (Pallas' debug flags, a setting in ``jax.jit``'s cache
key), the chip JAX is told it compiles for where none is attached, which platforms have a
device, and the runtime tokens of effectful computations."""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Iterator
from typing import Any

import jax
from jax._src import config as _config
from jax._src import dispatch

pallas_enable_debug_checks = _config.jax_pallas_enable_debug_checks
"""JAX's ``jax_pallas_enable_debug_checks`` flag: a context manager, ``.value`` reads it."""
pallas_poison_buffers = _config.jax_pallas_poison_buffers
"""JAX's ``jax_pallas_poison_buffers`` flag: a context manager, ``.value`` reads it."""


def settle_runtime_tokens() -> None:
    """Waits for the effectful computations dispatched so far and forgets them, ignoring their
    failures: after a failed callback has been reported, JAX would otherwise raise it again at
    every later ``jax.effects_barrier()`` and at exit."""
    tokens = dispatch.runtime_tokens
    for token in [*tokens.current_tokens.values(), *tokens.output_runtime_tokens.values()]:
        with contextlib.suppress(Exception):  # the failure already reached the caller
            token.block_until_ready()
    tokens.clear()


def jit_keyed_setting(name: str, default: Any = None) -> Any:
    """A thread-local setting that ``jax.jit`` includes in its cache key and trace context, so a
    function traced under one value is traced again under another. ``.value`` reads it;
    ``.swap_local(v)`` sets it for this thread and returns the previous value for
    ``.set_local``; ``.set_global(v)`` sets it for every thread. Values must be hashable."""
    return _config.config_ext.Config(name, default, include_in_jit_key=True,
                                     include_in_trace_context=True)


def pallas_use_mosaic_gpu() -> bool:
    """JAX's ``jax_pallas_use_mosaic_gpu`` setting: whether a ``pallas_call`` lowered for
    ``cuda`` with neither a backend nor compiler parameters goes to Mosaic GPU (``True``, the
    default of JAX 0.10, the one version that has the setting) or to Triton. JAX 0.11 and 0.12
    dropped the setting and always chooses Triton, so without it the answer is ``False``."""
    setting = getattr(_config, "jax_pallas_use_mosaic_gpu", None)
    return bool(setting.value) if setting is not None else False


@contextlib.contextmanager
def assume_device(device_kind: str, platform: str, num_cores: int = 1) -> Iterator[None]:
    """Inside, JAX believes it compiles for ``device_kind`` (e.g. ``"TPU v5 lite"``) on
    ``platform``, for lowerings that ask which chip they target when none is attached: the
    context mesh is one such device (and :func:`chip_answers` holds)."""
    from jax._src.mesh import AbstractDevice, AbstractMesh

    device = AbstractDevice(device_kind, num_cores, platform)
    with chip_answers(device_kind, platform, num_cores), jax.sharding.use_abstract_mesh(
            AbstractMesh((1,), ("_device",), (jax.sharding.AxisType.Auto,),
                         abstract_device=device)):
        yield


@contextlib.contextmanager
def chip_answers(device_kind: str, platform: str, num_cores: int = 1) -> Iterator[None]:
    """Inside, JAX's TPU code asking which chip it targets (``tpu_info.get_device_kind``,
    ``get_num_device_cores``) is told ``device_kind`` wherever the context mesh names no
    device of its own: also where no mesh is current (tracing on CPU) and where a jitted
    function inside a kernel is lowered under its own mesh. Meshes stay as they are, so
    ``shard_map`` and jitted code on CPU run unchanged (JAX 0.10 and 0.11 keep these
    functions in different modules)."""
    from jax._src.mesh import get_abstract_mesh

    previous = _ASSUMED_DEVICES.swap_local(
        (*[d for d in _ASSUMED_DEVICES.value if d[0] != platform],
         (platform, device_kind, num_cores)))
    patched = []
    for module_name in (("jax._src.tpu_info", "jax._src.pallas.mosaic.tpu_info")
                        if platform == "tpu" else ()):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for attr, value in (("get_device_kind", device_kind),
                            ("get_num_device_cores", num_cores)):
            asked = getattr(module, attr, None)
            if asked is None:
                continue

            def answer(asked: Any = asked, value: Any = value) -> Any:
                return asked() if get_abstract_mesh().abstract_device is not None else value
            patched.append((module, attr, asked))
            setattr(module, attr, answer)
    try:
        yield
    finally:
        for module, attr, asked in reversed(patched):
            setattr(module, attr, asked)
        _ASSUMED_DEVICES.set_local(previous)


_ASSUMED_DEVICES = jit_keyed_setting("pallas_assumed_devices", ())
"""``(platform, device_kind, num_cores)`` of each device :func:`chip_answers` holds; in
``jax.jit``'s cache key, so code traced for one chip is traced again for another."""


def assumed_device(platform: str) -> tuple[str, int] | None:
    """``(device_kind, num_cores)`` of the device JAX is told it compiles for on ``platform``
    (inside :func:`chip_answers` or :func:`assume_device`: ``pl.emulate``, ``pl.stages`` with a
    target, a kernel traced for a hardware backend with none attached), or ``None``."""
    for held, kind, cores in _ASSUMED_DEVICES.value:
        if held == platform:
            return kind, cores
    return None


@functools.cache
def platform_attached(platform: str) -> bool:
    """Whether a device of ``platform`` (``"tpu"``, ``"cuda"``, ...) is attached."""
    try:
        return bool(jax.devices(platform))
    except RuntimeError:
        return False
