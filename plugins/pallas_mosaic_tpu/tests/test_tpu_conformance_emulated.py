"""The conformance suite in emulate mode on Mosaic TPU: every feature is lowered for TPU, its
``tpu_custom_call`` executed by the emulator and compared with ``jax.numpy`` and with the
interpreter; features the backend does not support must raise a ``PallasError``."""

from __future__ import annotations

from typing import Any

import pallas_mosaic_tpu as pltpu

from pallas_core.testing import ATOMICS, MASKED_ACCESS, MESH, ConformanceSuite


class TestMosaicTPUEmulated(ConformanceSuite):
    backend = "mosaic_tpu"
    emulate = True
    unsupported = frozenset({
        ATOMICS,  # a TensorCore has no atomic memory operations
        MASKED_ACCESS,  # the suite's masked access reaches past the Ref's end, which a
        # TPU's whole-view VMEM read cannot (refused by name)
        MESH,  # pl.kernel's operands stay in HBM: the suite's kernel reads them directly
    })
    scratch_memory = pltpu.VMEM

    def semaphores(self, n: int, *, dma: bool = False) -> Any:
        kind = pltpu.SemaphoreType.DMA if dma else pltpu.SemaphoreType.REGULAR
        return kind((n,))
