"""Setup of the GPU suite (tests/gpu, every test marked ``gpu``; the root conftest.py skips them
where JAX sees no GPU).

* Every test first asks JAX for the GPU (``jax.devices("gpu")``): that is the first call that
  needs one, where a run in scripts/gpu_check.sh's fake mode (``PALLAS_GPU_CHECK_FAKE_GPU=1``,
  on CPU) stops.
* ``capfd`` flushes the C library's output buffers before it reads, a precaution: a GPU
  kernel's prints (``pl.debug_print``) are written to the process's stdout by the CUDA runtime
  at a synchronisation, and must not be left in a stdio buffer when the test reads them.
* ``PALLAS_TEST_TIMEOUT=SECONDS`` fails a test that runs longer (SIGALRM, between Python
  operations: a call blocked inside the GPU runtime is interrupted when it returns), where the
  pytest-timeout plugin is not installed to do it. scripts/gpu_check.sh sets it.
"""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Iterator
from typing import Any

import jax
import pytest

TIMEOUT_ENV = "PALLAS_TEST_TIMEOUT"


@pytest.fixture(autouse=True)
def gpu() -> Any:
    """The first GPU, as JAX sees it (the default device of a CUDA machine)."""
    return jax.devices("gpu")[0]


@pytest.fixture
def capfd(capfd: pytest.CaptureFixture[str]) -> pytest.CaptureFixture[str]:
    """pytest's ``capfd``, its ``readouterr`` first flushing C's stdio buffers."""
    read = capfd.readouterr

    def readouterr() -> Any:
        ctypes.CDLL(None).fflush(None)
        return read()

    capfd.readouterr = readouterr  # type: ignore[method-assign]
    return capfd


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """Fails a test that runs past ``PALLAS_TEST_TIMEOUT`` seconds (unless pytest-timeout is
    loaded, which does it itself)."""
    seconds = int(os.environ.get(TIMEOUT_ENV, "0") or 0)
    if seconds <= 0 or item.config.pluginmanager.hasplugin("timeout"):
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"{item.nodeid} ran past {seconds} s ({TIMEOUT_ENV})")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
