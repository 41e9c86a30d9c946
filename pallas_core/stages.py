"""``pl.stages``: each backend's named compilation stages for the kernels in a function."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax

from pallas_core import _jax
from pallas_core.call import pallas_call_p, resolve_backend, validate
from pallas_core.chips import backend_of_target, target_chip
from pallas_core.errors import StageNotFoundError, UnsupportedError
from pallas_core.plugins import manager
from pallas_core.reference import sub_jaxprs
from pallas_core.request import KernelCall
from pallas_core.utils import check_tool_arguments


@dataclasses.dataclass(frozen=True, eq=False)
class KernelStages(Mapping[str, "str | bytes"]):
    """The stages of one kernel, a mapping of stage name to text in pipeline order:
    ``s["jaxpr"]``, ``s["stablehlo"]``, ...; ``for name in s``, ``len(s)``, ``s.items()``
    as a dict's; ``s[i]``, an int, is the text of the ``i``-th stage (``s[0]`` the jaxpr,
    ``s[-1]`` the last). ``pl.stages`` returns a list of these, one per kernel."""

    name: str
    backend: str
    stages: Mapping[str, str | bytes]

    def __getitem__(self, stage: str | int) -> str | bytes:
        if isinstance(stage, int):
            names = list(self.stages)
            if not -len(names) <= stage < len(names):
                raise StageNotFoundError(
                    f"stage {stage} of kernel {self.name!r}: it has {len(names)} stages "
                    f"({', '.join(names)}). Fix: index by a position in "
                    f"{-len(names)}..{len(names) - 1}, or by name (s[{names[0]!r}]).")
            stage = names[stage]
        try:
            return self.stages[stage]
        except KeyError:
            raise StageNotFoundError(
                f"kernel {self.name!r} has no stage {stage!r} on the {self.backend!r} "
                f"backend; its stages: {', '.join(self.stages)}. Fix: ask for one of "
                "those.") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.stages)

    def __len__(self) -> int:
        return len(self.stages)

    def __contains__(self, stage: object) -> bool:
        return stage in self.stages


class _LazyStages(Mapping[str, "str | bytes"]):
    """Stage name -> text; a stage given as a function is produced on first access."""

    def __init__(self, stages: Mapping[str, Any]) -> None:
        self._stages = dict(stages)

    def __getitem__(self, stage: str) -> str | bytes:
        value = self._stages[stage]
        if callable(value):
            value = self._stages[stage] = value()
        return value  # type: ignore[no-any-return]

    def __iter__(self) -> Iterator[str]:
        return iter(self._stages)

    def __len__(self) -> int:
        return len(self._stages)

    def __repr__(self) -> str:
        return f"stages({', '.join(self._stages)})"


def kernel_calls(jaxpr: Any) -> Iterator[KernelCall]:
    """Every ``pallas_call`` in ``jaxpr``, nested jaxprs included, in program order."""
    for eqn in jaxpr.eqns:
        if eqn.primitive is pallas_call_p:
            yield eqn.params["call"]
            continue
        if eqn.primitive in _jax.KEY_PRIMITIVES:
            # A key implementation's functions (a Pallas PRNG's random_bits) are traced
            # only when the program is lowered: traced here, their kernels are found.
            expanded = _jax.key_expansion(eqn)
            if not isinstance(expanded, str):
                yield from kernel_calls(expanded.jaxpr)
            continue
        for sub in sub_jaxprs(eqn.params):
            yield from kernel_calls(sub)


def stages(fn: Callable[..., Any], *args: Any, backend: str | None = None,
           target: str | None = None, **kwargs: Any) -> list[KernelStages]:
    """Named stages of every ``pallas_call`` reached by ``fn(*args)``, without running it.

    Each kernel is compiled by ``backend`` (default: the one chosen in the program, else the
    default for this machine's platform). ``target`` is backend-specific (e.g. ``"sm_90"``, or
    a TPU generation such as ``"v5e"``). Every kernel has ``"jaxpr"``, then ``"stablehlo"`` (the
    whole program lowered for the backend's platform, ``rocm`` for an AMD ``gfx*`` target, which
    carries the kernel's custom call; made when first read), then its backend's stages.
    """
    check_tool_arguments("pl.stages", fn, target)
    chosen = resolve_backend(backend, None, False) if backend is not None else None
    # Chip queries (pltpu.get_tpu_info(), ...) answer for the target while the function is
    # traced and its stages made, where no such device is attached (pallas_core.chips).
    owner = chosen or (backend_of_target(target) if target is not None else None)

    def for_target() -> contextlib.AbstractContextManager[Any]:
        return target_chip(owner, target)

    with for_target():
        closed = jax.make_jaxpr(lambda *a: fn(*a, **kwargs))(*args)
    programs: dict[str, str] = {}

    def stablehlo(platform: str) -> str:
        if platform not in programs:
            with for_target():
                traced = jax.jit(lambda *a: fn(*a, **kwargs)).trace(*args)
                programs[platform] = traced.lower(lowering_platforms=(platform,)).as_text()
        return programs[platform]

    def made_for_target(stage: Any) -> Any:
        if not callable(stage):
            return stage

        def make() -> Any:
            with for_target():
                return stage()
        return make

    result = []
    for call in kernel_calls(closed.jaxpr):
        name = (chosen or call.backend
                or manager.default_for_platform(jax.default_backend()))
        validate(call, name)
        with for_target():
            found = manager.call_hook(name, "pallas_stages", call=call, target=target)
        if found is None:
            raise UnsupportedError(
                f"backend {name!r} does not report compilation stages (its plugin has no "
                "`pallas_stages` hook)."
            )
        platforms = manager.get(name).info.platforms
        # An AMD target (``gfx942``) is lowered for ROCm where the backend lowers for it.
        gfx = target is not None and target.startswith("gfx") and "rocm" in platforms
        platform = "rocm" if gfx else platforms[0]
        result.append(KernelStages(call.name, name, _LazyStages({
            "jaxpr": str(call.jaxpr), "stablehlo": lambda p=platform: stablehlo(p),
            **{k: made_for_target(v) for k, v in found.items()}})))
    return result
