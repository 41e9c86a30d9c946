"""``pl.stages``: each backend's named compilation stages for the kernels in a function."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax

from pallas_core.call import pallas_call_p, resolve_backend, validate
from pallas_core.errors import UnsupportedError
from pallas_core.plugins import manager
from pallas_core.reference import sub_jaxprs
from pallas_core.request import KernelCall


@dataclasses.dataclass(frozen=True)
class KernelStages:
    """The stages of one kernel: ``stages["jaxpr"]``, ``stages["stablehlo"]``, ..."""

    name: str
    backend: str
    stages: Mapping[str, str | bytes]

    def __getitem__(self, stage: str) -> str | bytes:
        return self.stages[stage]



def kernel_calls(jaxpr: Any) -> Iterator[KernelCall]:
    """Every ``pallas_call`` in ``jaxpr``, nested jaxprs included, in program order."""
    for eqn in jaxpr.eqns:
        if eqn.primitive is pallas_call_p:
            yield eqn.params["call"]
            continue
        for sub in sub_jaxprs(eqn.params):
            yield from kernel_calls(sub)


def stages(fn: Callable[..., Any], *args: Any, backend: str | None = None,
           target: str | None = None, **kwargs: Any) -> list[KernelStages]:
    """Named stages of every ``pallas_call`` reached by ``fn(*args)``, without running it.

    Each kernel is compiled by ``backend`` (default: the one chosen in the program, else the
    default for this machine's platform). ``target`` is backend-specific (e.g. ``"sm_90"``).
    """
    closed = jax.make_jaxpr(lambda *a: fn(*a, **kwargs))(*args)
    chosen = resolve_backend(backend, None, False) if backend is not None else None
    result = []
    for call in kernel_calls(closed.jaxpr):
        name = (chosen or call.backend
                or manager.default_for_platform(jax.default_backend()))
        validate(call, name)
        found = manager.hook.pallas_stages(call=call, backend=name, target=target)
        if found is None:
            raise UnsupportedError(
                f"backend {name!r} does not report compilation stages (its plugin has no "
                "`pallas_stages` hook)."
            )
        result.append(KernelStages(call.name, name, {"jaxpr": str(call.jaxpr), **found}))
    return result
