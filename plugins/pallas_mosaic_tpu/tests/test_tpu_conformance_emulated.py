"""The conformance suite in emulate mode on Mosaic TPU: every feature is lowered for TPU, its
``tpu_custom_call`` executed by the emulator and compared with ``jax.numpy`` and with the
interpreter; features the backend does not support must raise a ``PallasError``."""

from __future__ import annotations

from pallas_core.testing import ConformanceSuite


class TestMosaicTPUEmulated(ConformanceSuite):
    backend = "mosaic_tpu"
    emulate = True
