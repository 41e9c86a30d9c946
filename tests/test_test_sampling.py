"""PALLAS_TEST_SAMPLE (conftest.py): how the README's test command runs the suite a second time
under an older JAX within CI's time. ``first`` must keep every unparametrized test and exactly
the first case of each parametrized one; anything else is refused."""

import pathlib
from typing import Any

import pytest

pytest_plugins = ["pytester"]

_ROOT_CONFTEST = pathlib.Path(__file__).resolve().parent.parent / "conftest.py"

_TESTS = """
import pytest

def test_plain():
    pass

@pytest.mark.parametrize("n", [3, 1, 2])
def test_cases(n):
    pass

class TestGroup:
    @pytest.mark.parametrize("a,b", [(1, 2), (5, 6)])
    def test_pairs(self, a, b):
        pass
"""


def _run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, sample: str) -> Any:
    monkeypatch.setenv("PALLAS_TEST_SAMPLE", sample)
    pytester.makeconftest(_ROOT_CONFTEST.read_text())
    pytester.makepyfile(test_sampled=_TESTS)
    return pytester.runpytest_inprocess("-q", "--collect-only", "-p", "no:cacheprovider")


def test_first_keeps_one_case_of_each_test(pytester: pytest.Pytester,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    result = _run(pytester, monkeypatch, "first")
    collected = [line for line in result.outlines if "::" in line]
    assert collected == ["test_sampled.py::test_plain", "test_sampled.py::test_cases[3]",
                         "test_sampled.py::TestGroup::test_pairs[1-2]"]
    result.stdout.fnmatch_lines(["*3/6 tests collected (3 deselected)*"])


def test_all_keeps_every_case(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    result = _run(pytester, monkeypatch, "all")
    assert len([line for line in result.outlines if "::" in line]) == 6


def test_an_unknown_value_is_refused(pytester: pytest.Pytester,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    result = _run(pytester, monkeypatch, "half")
    result.stdout.fnmatch_lines(["*PALLAS_TEST_SAMPLE='half': expected 'all'*"])
    assert result.ret != 0
