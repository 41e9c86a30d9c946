"""Test setup shared by every test directory: eight host CPU devices for shard_map tests (set
before jax is imported, so it lives at the root, where pytest loads it first), and the ``gpu``
marker's skip where JAX sees no GPU.
"""

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

FAKE_GPU_ENV = "PALLAS_GPU_CHECK_FAKE_GPU"
"""Set to 1, tests marked ``gpu`` run as if JAX saw a GPU (scripts/gpu_check.sh's fake mode,
which shows on CPU that every step is wired: the tests then fail at their first GPU call)."""


def gpu_present() -> bool:
    """Whether JAX sees a GPU (or ``PALLAS_GPU_CHECK_FAKE_GPU=1`` says to believe so)."""
    if os.environ.get(FAKE_GPU_ENV) == "1":
        return True
    import jax

    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:  # "Unknown backend: 'gpu' requested, but no platforms ..."
        return False


SAMPLE_ENV = "PALLAS_TEST_SAMPLE"
"""Set to ``first``, each parametrized test runs only its first case (every unparametrized test
still runs). tox.ini sets it where the README's test command runs a suite a second time under
another JAX release, to stay within CI's time; ``PALLAS_TEST_SAMPLE=all`` runs every case."""


def _first_cases(config, items):  # type: ignore[no-untyped-def]
    """Keeps the first collected case of each test function, deselecting the others."""
    seen: set[str] = set()
    kept, dropped = [], []
    for item in items:
        function = item.nodeid.split("[", 1)[0]
        (dropped if function in seen else kept).append(item)
        seen.add(function)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def pytest_collection_modifyitems(config, items):  # type: ignore[no-untyped-def]
    """Tests marked ``gpu`` are skipped where JAX sees no GPU; ``PALLAS_TEST_SAMPLE=first``
    keeps one case of each parametrized test."""
    sample = os.environ.get(SAMPLE_ENV, "all")
    if sample not in ("all", "first"):
        raise ValueError(f"{SAMPLE_ENV}={sample!r}: expected 'all' (every case) or 'first' "
                         "(the first case of each parametrized test)")
    if sample == "first":
        _first_cases(config, items)
    marked = [item for item in items if item.get_closest_marker("gpu") is not None]
    if marked and not gpu_present():
        import pytest

        skip = pytest.mark.skip(reason="needs a GPU: JAX sees none (jax.devices('gpu') fails); "
                                "scripts/gpu_check.sh runs these on a CUDA machine")
        for item in marked:
            item.add_marker(skip)
