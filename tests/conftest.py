"""Test setup of tests/ (the eight host CPU devices are set up by the root conftest.py)."""

import pathlib
import sys

# The seed-example tests import the kernels of examples/ (`from examples import ...`).
_REPO_ROOT = str(pathlib.Path(__file__).resolve().parent.parent)
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)
