"""The conformance suite on the interpreter (which supports every feature), and the suite's
own checks of a backend's declarations."""

from __future__ import annotations

import pytest
from pallas_interpret import InterpretParams

from pallas_core.testing import ATOMICS, ELEMENTWISE, ConformanceSuite


class TestInterpret(ConformanceSuite):
    """The interpreter with its default parameters."""

    backend = "interpret"


class TestInterpretChecked(ConformanceSuite):
    """The interpreter in checked mode: uninitialised memory is poisoned."""

    backend = "interpret"
    compiler_params = InterpretParams(checked=True)


def test_unknown_feature_name_is_rejected() -> None:
    """A typo in `unsupported` fails when the class is defined, and lists the features."""
    with pytest.raises(ValueError, match=r"unknown conformance features \['atomic'\]"):

        class Typo(ConformanceSuite):
            backend = "interpret"
            unsupported = frozenset({"atomic"})


def test_unsupported_feature_is_skipped_and_must_raise() -> None:
    """A feature declared unsupported is skipped, and the suite fails if it works after all."""

    class Wrong(ConformanceSuite):  # not collected: the name does not start with "Test"
        backend = "interpret"
        unsupported = frozenset({ELEMENTWISE, ATOMICS})

    suite = Wrong()
    suite.setup_method(None)
    with pytest.raises(pytest.skip.Exception, match="declares 'elementwise' unsupported"):
        suite.test_elementwise_add()
    with pytest.raises(pytest.fail.Exception, match="Fix: remove 'elementwise'"):
        suite.test_unsupported_feature_raises(ELEMENTWISE, request=None)  # type: ignore[arg-type]
    with pytest.raises(pytest.fail.Exception, match=r"advertises \['atomics'\]"):
        suite.test_capabilities_agree_with_unsupported()
