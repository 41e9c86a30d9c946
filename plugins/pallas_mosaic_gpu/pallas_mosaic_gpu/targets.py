"""Which GPU architecture a Mosaic GPU module is built for: Hopper (sm_90a) or Blackwell
(sm_100a).

JAX's Mosaic GPU library records the architecture in the module (``mosaic_gpu.arch_major`` and
``arch_minor``) and consults it while emitting code (for example float32 warp reductions and
8-bit float conversions differ on Blackwell). It takes the architecture from the device:
the abstract mesh's device if it has a ``compute_capability``, else JAX's default device.
Without a GPU (lowering with ``lowering_platforms=("cuda",)`` on a CPU machine) it assumes
Hopper, 9.0, even for a kernel full of Blackwell instructions.

This backend chooses, in order:

1. the target named by ``pl.stages(..., backend="mosaic_gpu", target=...)``
   (:func:`targeting`);
2. the GPU that JAX would use, as above;
3. Blackwell for a kernel that uses TMEM or tcgen05 (it runs on nothing else), else Hopper.

The library reads the architecture from the device, so a chosen one is handed to it as the
device of an abstract mesh (:func:`assume`) while the module is built.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

import jax

from pallas_core.backend import PallasError

TARGETS: dict[str, tuple[int, int]] = {"sm_90a": (9, 0), "sm_90": (9, 0), "sm_100a": (10, 0)}
"""The targets ``pl.stages(..., backend="mosaic_gpu", target=...)`` accepts."""
HOPPER = (9, 0)
BLACKWELL = (10, 0)

_CHOSEN: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "pallas_mosaic_gpu_target", default=None)


def parse(target: str) -> tuple[int, int]:
    """The (major, minor) compute capability of ``target``; a ``PallasError`` if unknown."""
    try:
        return TARGETS[target]
    except KeyError:
        raise PallasError(
            f"pl.stages(backend='mosaic_gpu', target={target!r}): unknown target. Fix: use "
            f"one of {sorted(TARGETS)} (sm_90a: Hopper, sm_100a: Blackwell).") from None


@contextlib.contextmanager
def targeting(target: str | None) -> Iterator[None]:
    """Within the block, kernels are built for ``target`` (``None``: chosen as usual)."""
    token = _CHOSEN.set(parse(target) if target is not None else _CHOSEN.get())
    try:
        yield
    finally:
        _CHOSEN.reset(token)


def device_arch() -> tuple[int, int] | None:
    """The compute capability of the GPU JAX would build for, or ``None`` without one."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    if device is None:
        try:
            device = jax.devices()[0]
        except RuntimeError:
            return None
    cc = getattr(device, "compute_capability", None)
    if not isinstance(cc, str) or cc.startswith("gfx"):
        return None
    major, _, minor = cc.partition(".")
    return int(major), int(minor or 0)


def choose(uses_blackwell: bool) -> tuple[tuple[int, int], str]:
    """The architecture to build for and where that choice came from."""
    chosen = _CHOSEN.get()
    if chosen is not None:
        return chosen, "the target given to pl.stages"
    found = device_arch()
    if found is not None:
        return found, "the GPU JAX builds for"
    return (BLACKWELL, "its use of TMEM/tcgen05") if uses_blackwell else \
        (HOPPER, "the default without a GPU")


def name(arch: tuple[int, int]) -> str:
    """``sm_90a``-style name of a compute capability."""
    return f"sm_{arch[0]}{arch[1]}a"


@dataclasses.dataclass(frozen=True)
class _Device:
    """What the Mosaic GPU library reads of a device: its compute capability."""

    compute_capability: str
    device_kind: str = "assumed GPU"
    num_cores: int | None = None
    platform: str = "cuda"


@contextlib.contextmanager
def assume(arch: tuple[int, int]) -> Iterator[None]:
    """Within the block, JAX's Mosaic GPU library builds modules for ``arch`` (see the module
    docstring); a no-op when it would anyway."""
    if _library_default() == arch:
        yield
        return
    mesh = jax.sharding.get_abstract_mesh()
    device = _Device(f"{arch[0]}.{arch[1]}")
    if mesh.empty:
        assumed = jax.sharding.AbstractMesh((1,), ("_pallas_mosaic_gpu_target",),
                                            abstract_device=device)
    else:
        assumed = jax.sharding.AbstractMesh(mesh.axis_sizes, mesh.axis_names,
                                            axis_types=mesh.axis_types,
                                            abstract_device=device)
    with jax.sharding.use_abstract_mesh(assumed):
        yield


def _library_default() -> tuple[int, int]:
    found = device_arch()
    return found if found is not None else HOPPER
