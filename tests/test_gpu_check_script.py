"""scripts/gpu_check.sh on a machine without a GPU (CI): its dry run passes, and in fake-GPU mode
(``PALLAS_GPU_CHECK_FAKE_GPU=1``) it goes through every step, each failing at its first call
that needs the GPU, which shows the steps are wired. The dry run installs with pip (a pip
``--dry-run``), the fake-GPU run with the fallback (the checkout on ``PYTHONPATH`` beside
generated package metadata). The two runs go side by side (about 45 s on 2 cores).
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
DRY_STEPS = ["install", "versions", "collect", "bench_triton", "bench_mosaic"]
GPU_STEPS = ["install", "versions", "device", "suite", "bench_triton", "bench_mosaic"]
NO_GPU = "Unknown backend: 'gpu' requested"
"""JAX's error where the first call that needs a GPU finds none."""

pytestmark = pytest.mark.skipif(
    shutil.which("bash") is None or shutil.which("timeout") is None,
    reason="scripts/gpu_check.sh needs bash and coreutils' timeout")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, str, pathlib.Path]]:
    """The script run in its dry-run and fake-GPU modes (in parallel): exit status, standard
    output, OUTDIR, by mode."""
    for module in ("pallas_triton", "pallas_mosaic_gpu"):
        pytest.importorskip(module, reason="the GPU check needs both GPU backends installed")
    env = dict(os.environ, PYTHON=sys.executable, JAX_PLATFORMS="cpu")
    for name in ("PALLAS_GPU_CHECK_FAKE_GPU", "PALLAS_GPU_CHECK_INSTALL",
                 "PALLAS_GPU_CHECK_BUDGET"):
        env.pop(name, None)
    started = {}
    # Without a GPU the script chooses its dry run itself; where nvidia-smi is found (a GPU
    # machine, JAX held to the CPU here), it is asked for.
    dry = ["--dry-run"] if shutil.which("nvidia-smi") else []
    for mode, args, extra in (("dry", dry, {}),
                              ("fake", [], {"PALLAS_GPU_CHECK_FAKE_GPU": "1",
                                            "PALLAS_GPU_CHECK_INSTALL": "pythonpath"})):
        out = tmp_path_factory.mktemp(f"gpu_check_{mode}")
        started[mode] = (subprocess.Popen(
            ["bash", str(SCRIPT), *args, str(out)], cwd=ROOT, env={**env, **extra},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), out)
    result = {}
    for mode, (proc, out) in started.items():
        stdout, _ = proc.communicate(timeout=300)
        result[mode] = (proc.returncode, stdout, out)
    return result


def _summary(out: pathlib.Path) -> dict[str, str]:
    """Each step's outcome, from OUTDIR/summary.txt."""
    lines = (out / "summary.txt").read_text().splitlines()
    found = [re.fullmatch(r"step (\w+): (ok|FAILED).*", line) for line in lines]
    return dict(m.groups() for m in found if m)


def _section(log: str, step: str) -> str:
    """The log's output of ``step``."""
    return log.split(f"=== step {step} (limit", 1)[1].split(f"=== step {step}:", 1)[0]


def test_dry_run_passes_and_says_so_in_one_line(runs: dict) -> None:
    rc, stdout, out = runs["dry"]
    log = (out / "gpu_check.log").read_text()
    assert rc == 0, f"dry run failed:\n{stdout}\n{log[-5000:]}"
    assert stdout.count("\n") == 1 and "dry run passed" in stdout, stdout
    assert stdout.startswith("gpu_check: no GPU found" if not shutil.which("nvidia-smi")
                             else "gpu_check: --dry-run"), stdout
    assert _summary(out) == dict.fromkeys(DRY_STEPS, "ok")
    assert "Would install pallas-core" in _section(log, "install")  # pip, offline, --dry-run
    collected = _section(log, "collect")
    for module in ("seeds", "conformance", "triton_library", "mosaic_library"):
        assert f"tests/gpu/test_on_gpu_{module}.py::" in collected
    assert re.search(r"\b\d{2,} tests collected", collected), collected[-500:]
    assert "pallas_core_triton   lowered for cuda" in _section(log, "bench_triton")
    assert "pallas_core_mosaic_gpu" in _section(log, "bench_mosaic")


def test_fake_gpu_reaches_every_step_and_stops_at_the_gpu(runs: dict) -> None:
    rc, stdout, out = runs["fake"]
    log = (out / "gpu_check.log").read_text()
    assert rc == 1, stdout
    assert list(_summary(out)) == GPU_STEPS
    assert _summary(out) == {"install": "ok", "versions": "ok", "device": "FAILED",
                             "suite": "FAILED", "bench_triton": "FAILED",
                             "bench_mosaic": "FAILED"}, (out / "summary.txt").read_text()
    assert "gpu_check: FAILED steps: device suite bench_triton bench_mosaic" in stdout
    # The fallback install: generated metadata first on PYTHONPATH, the backends found by it.
    install = _section(log, "install")
    assert f"PYTHONPATH={out}/site:{ROOT}/." in install, install
    assert re.search(r"pallas_core backends: .*mosaic_gpu.*triton", _section(log, "versions"))
    assert NO_GPU in _section(log, "device")
    assert NO_GPU in _section(log, "bench_triton")
    assert "needs a Hopper GPU" in _section(log, "bench_mosaic")
    # The suite ran: a GPU test reached its first GPU call, recorded in the JUnit XML.
    suite = ET.parse(out / "junit.xml").getroot().find("testsuite")
    assert suite is not None and int(suite.get("errors", "0")) >= 1
    messages = [e.get("message", "") + (e.text or "") for e in suite.iter("error")]
    assert messages and all(NO_GPU in m for m in messages), messages[:1]
    assert re.search(r"^suite: 0 passed, 0 failed, [1-9]\d* errors", (out / "summary.txt")
                     .read_text(), re.M)
