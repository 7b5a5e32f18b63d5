"""flashwatch/_checks.py: the shared argument checks and the log-once helper."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from flashwatch._checks import check_bool, check_float, check_int, log_once


@pytest.mark.parametrize("value,kw,exc,text", [
    (True, {}, TypeError, r"top_k must be an int, got True \(bool\)"),
    (2.0, {"min": 0}, TypeError, r"top_k must be an int ≥ 0, got 2.0 \(float\)"),
    ("3", {}, TypeError, r"got '3' \(str\)"),
    (-1, {"min": 0}, ValueError, r"top_k must be an int ≥ 0, got -1$"),
    (70000, {"min": 0, "max": 65535}, ValueError, r"must be an int in \[0, 65535\], got 70000"),
    (6, {"max": 5}, ValueError, r"must be an int ≤ 5, got 6"),
    (-1, {"min": 0, "hint": "0 = none"}, ValueError, r"got -1; 0 = none$"),
])
def test_check_int_refuses_with_the_name_the_value_and_the_range(value, kw, exc, text):
    with pytest.raises(exc, match=text):
        check_int("top_k", value, **kw)


def test_check_int_accepts_the_bounds_themselves():
    assert check_int("n", 0, min=0) == 0
    assert check_int("n", 65535, min=0, max=65535) == 65535
    assert check_int("n", -7) == -7  # no bounds: any int


INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize("value,kw,exc,text", [
    (True, {"above": 0}, TypeError, r"^tol must be a positive number \(finite, > 0\), got True "
                                    r"\(bool\)$"),
    ("1e-7", {}, TypeError, r"^tol must be a number \(finite\), got '1e-7' \(str\)$"),
    (None, {"min": 0}, TypeError, r"got None \(NoneType\)"),
    (NAN, {}, ValueError, r"^tol must be a number \(finite\), got nan$"),
    (NAN, {"min": 0, "finite": False}, ValueError, r"^tol must be a number \(≥ 0\), got nan$"),
    (INF, {"above": 0}, ValueError, r"must be a positive number \(finite, > 0\), got inf$"),
    (-INF, {}, ValueError, r"got -inf$"),
    (0, {"above": 0}, ValueError, r"got 0$"),  # the value as passed, not float(0)
    (1.0, {"above": 1}, ValueError, r"must be a number \(finite, > 1\), got 1.0$"),
    (-1e-9, {"min": 0}, ValueError, r"must be a number \(finite, ≥ 0\), got -1e-09$"),
    (1.5, {"min": 0, "max": 1}, ValueError, r"in \[0, 1\]\), got 1.5$"),
    (0.0, {"above": 0, "max": 1}, ValueError, r"in \(0, 1\]\), got 0.0$"),
    (2.5, {"max": 2}, ValueError, r"\(finite, ≤ 2\), got 2.5$"),
    (-1, {"above": 0, "hint": "e.g. 1e-7"}, ValueError, r"got -1; e.g. 1e-7$"),
    ("x", {"above": 0, "hint": "e.g. 1e-7"}, TypeError, r"got 'x' \(str\); e.g. 1e-7$"),
])
def test_check_float_refuses_with_the_name_the_value_and_the_range(value, kw, exc, text):
    with pytest.raises(exc, match=text):
        check_float("tol", value, **kw)


def test_check_float_accepts_ints_the_bounds_and_inf_when_asked():
    assert check_float("x", 0, min=0) == 0.0 and type(check_float("x", 3)) is float
    assert check_float("x", 1.0, min=0, max=1) == 1.0  # max is inclusive
    assert check_float("x", 1e-300, above=0) == 1e-300
    assert check_float("x", -1e300) == -1e300  # no bounds: any finite number
    assert check_float("x", INF, min=0, finite=False) == INF


@pytest.mark.parametrize("value", [1, 0, "yes", None])
def test_check_bool_refuses_everything_but_a_bool(value):
    with pytest.raises(TypeError, match=rf"flag must be True or False, got {value!r}"):
        check_bool("flag", value)
    assert check_bool("flag", False) is False


def test_log_once_logs_once_per_key_and_per_owner(caplog):
    log = logging.getLogger("flashwatch.test_checks")
    mine, other = set(), set()
    with caplog.at_level(logging.INFO, logger=log.name):
        results = [log_once(log, mine, "a", "first %s", 1),
                   log_once(log, mine, "a", "first %s", 2),  # same key, same owner: quiet
                   log_once(log, mine, ("b", 1), "second", level=logging.ERROR),
                   log_once(log, other, "a", "other owner")]
    assert results == [True, False, True, True]
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, "first 1"), (logging.ERROR, "second"), (logging.WARNING, "other owner")]
    assert mine == {"a", ("b", 1)}


def test_missing_extra_names_the_package_and_the_pip_command():
    from flashwatch._checks import missing_extra

    e = missing_extra("matplotlib", "report", "flashwatch report")
    assert isinstance(e, ImportError)
    assert str(e) == ("flashwatch report needs matplotlib, which is not installed; install "
                      "it with: pip install 'flashwatch[report]'")


@pytest.mark.parametrize("package,module,extra", [
    ("lightning", "flashwatch.integrations.lightning", "lightning"),
    ("transformers", "flashwatch.integrations.transformers", "transformers"),
])
def test_an_integration_without_its_extra_fails_with_one_line(package, module, extra):
    """The package is made unimportable in a fresh interpreter (sys.modules[...] = None)."""
    code = (f"import sys; sys.modules[{package!r}] = None\n"
            f"try:\n    import {module}\nexcept ImportError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300).stdout
    assert out == (f"{module} needs {package}, which is not installed; install it with: "
                   f"pip install 'flashwatch[{extra}]'\n")
