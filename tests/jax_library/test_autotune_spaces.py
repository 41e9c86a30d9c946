"""``pl.autotune``'s pruner against the lowering, on JAX's library kernels and their natural
tuning spaces (``tuning_spaces.py``): every configuration of every space is lowered on this
CPU, for every chip the kernel is tuned for.

- A configuration the pruner keeps lowers: Mosaic TPU's module is produced (verified), and a
  Triton kernel compiles to a cubin (``sm_90``, H100) whose shared memory (Triton's own
  allocation, read after its ``llir`` stage) fits the 227 KiB a thread block may use.
- A configuration it prunes is refused by the lowering (a ``PallasError``), or its on-chip
  footprint exceeds the chip's limit.

Minutes per kernel: marked ``spaces``, run in full by ``tox -e autotune``; CI runs one TPU
space (``mosaic_tpu`` env) and the softmax spaces (``triton`` env).
"""

from __future__ import annotations

from typing import Any

import pytest

import pallas_core as pl
from tests.jax_library import tuning_spaces

pytestmark = pytest.mark.spaces

_GPU_TARGET = {"h100": "sm_90"}
_SHARED_PER_BLOCK = 227 * 1024  # H100 (compute capability 9.0), per thread block


def _cases(backend: str) -> list[tuple[Any, str]]:
    try:
        cases = (tuning_spaces.tpu_cases() if backend == "mosaic_tpu"
                 else tuning_spaces.triton_cases())
    except ImportError:  # the backend is not installed in this environment
        return []
    return [(c, chip) for c in cases for chip in c.chips]


def _ids(pairs: list[tuple[Any, str]]) -> list[str]:
    return [f"{c.label}-{chip}".replace(" ", "_") for c, chip in pairs]


def _lower_tpu(case: Any, config: dict[str, Any], chip: str) -> str:
    """``""`` when the config lowers for ``chip``, else the refusal."""
    try:
        found = pl.stages(case.build(**config), *case.args, backend="mosaic_tpu", target=chip)
        for kernel in found:
            assert "func.func" in str(kernel["mosaic"])
    except (pl.PallasError, ValueError) as e:  # the backend's refusal, or the kernel's own
        return f"{type(e).__name__}: {e}"
    return ""


def _compile_triton(case: Any, config: dict[str, Any], chip: str) -> str:
    """``""`` when every kernel compiles to a cubin for ``chip``, else the refusal."""
    try:
        found = pl.stages(case.build(**config), *case.args, backend="triton",
                          target=_GPU_TARGET[chip])
        for kernel in found:
            assert kernel["cubin"][:4] == b"\x7fELF"
    except (pl.PallasError, ValueError) as e:  # the backend's refusal, or the kernel's own
        return f"{type(e).__name__}: {e}"
    return ""


def _check(case: Any, chip: str, lower: Any) -> None:
    result = pl.autotune(case.build, case.space, *case.args, backend=case.backend, target=chip,
                         progress=False)
    assert len(result.table) == case.size
    kept = [r for r in result.table if r.verdict != "pruned"]
    assert kept, "the pruner kept nothing"
    if case.default is not None:  # JAX's own choice is legal: the pruner keeps it
        assert any(dict(r.config) == dict(case.default) for r in kept), case.default
    for row in result.table:
        config = dict(row.config)
        refusal = lower(case, config, chip)
        if row.verdict != "pruned":
            assert refusal == "", f"kept {config}, but the lowering refuses it: {refusal}"
            if case.backend == "triton":
                for k in pl.report(case.build(**config), *case.args, backend="triton",
                                   target=chip).kernels:
                    assert k.onchip_bytes is not None and k.onchip_bytes <= _SHARED_PER_BLOCK
        elif not refusal:  # lowers: then its footprint must be over the limit
            over = [k for k in pl.report(case.build(**config), *case.args,
                                         backend=case.backend, target=chip).kernels
                    if k.fits is False]
            assert over, f"pruned {config} ({row.reason}), yet it lowers and fits"


@pytest.mark.parametrize(("case", "chip"), _cases("mosaic_tpu"),
                         ids=_ids(_cases("mosaic_tpu")))
def test_tpu_space_pruned_as_the_lowering_refuses(case: Any, chip: str) -> None:
    pytest.importorskip("pallas_mosaic_tpu")
    _check(case, chip, _lower_tpu)


@pytest.mark.parametrize(("case", "chip"), _cases("triton"), ids=_ids(_cases("triton")))
def test_triton_space_pruned_as_the_compiler_refuses(case: Any, chip: str) -> None:
    pytest.importorskip("pallas_triton")
    pytest.importorskip("triton", reason="compiling to cubin needs the triton package")
    _check(case, chip, _compile_triton)
