"""Small helpers every module shares: argument checks and "log this once".

    check_int("top_k", top_k, min=0, hint="0 = no worst-head keys")
    check_bool("log_per_head", log_per_head)
    check_float("eps", eps, above=0.0, hint="the tie tolerance, e.g. 1e-3")
    log_once(log, self._logged, "sink", "flashwatch: %s failed", what, level=logging.ERROR)
    except ImportError as e:  # around an optional import
        raise missing_extra("lightning", "lightning", "flashwatch.integrations.lightning") from e

A bool is not accepted as an int or a float (True is an int to Python, never a count or
a threshold to a user); a float must be finite unless the caller says otherwise.
Messages name the argument, the bad value and what to pass instead (the house rule).
"""

from __future__ import annotations

import logging
import math


def check_int(name: str, value, *, min: int | None = None, max: int | None = None,
              hint: str = "") -> int:
    """`value` if it is an int (not a bool) within [min, max]; else TypeError (not an
    int) or ValueError (out of range) naming `name`, the value and the range. `hint`,
    when given, ends the message (e.g. the default, or what 0 means)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(_message(name, _int_range(min, max), value, hint, typed=True))
    if (min is not None and value < min) or (max is not None and value > max):
        raise ValueError(_message(name, _int_range(min, max), value, hint))
    return value


def check_float(name: str, value, *, min: float | None = None, max: float | None = None,
                above: float | None = None, finite: bool = True, hint: str = "") -> float:
    """float(`value`) if it is an int or a float (not a bool), finite (unless
    finite=False; NaN never passes) and within the bounds: `min` and `max` inclusive,
    `above` exclusive (give it instead of `min`). Else TypeError (not a number) or
    ValueError (NaN, inf, out of range) naming `name`, the value and the range. `hint`,
    when given, ends the message."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(_message(name, _float_range(min, max, above, finite), value, hint,
                                 typed=True))
    x = float(value)
    if math.isnan(x) or (finite and math.isinf(x)) or (above is not None and x <= above) \
            or (min is not None and x < min) or (max is not None and x > max):
        raise ValueError(_message(name, _float_range(min, max, above, finite), value, hint))
    return x


# The messages are built only when a check fails: check_inputs runs these on every
# flashwatch.attention call.
def _int_range(min, max) -> str:
    if min is not None and max is not None:
        return f"an int in [{min}, {max}]"
    return "an int" + (f" ≥ {min}" if min is not None else "") + (
        f" ≤ {max}" if max is not None else "")


def _float_range(min, max, above, finite) -> str:
    lower = f"> {above:g}" if above is not None else f"≥ {min:g}" if min is not None else ""
    if max is not None:
        lower = f"≤ {max:g}" if not lower else (
            f"in ({above:g}, {max:g}]" if above is not None else f"in [{min:g}, {max:g}]")
    parts = ", ".join(p for p in ("finite" if finite else "", lower) if p)
    # "a positive number": > 0 is the usual bound, and MonitorGroup's message says so
    return ("a positive number" if above == 0 and max is None else "a number") + (
        f" ({parts})" if parts else "")


def _message(name: str, want: str, value, hint: str, typed: bool = False) -> str:
    kind = f" ({type(value).__name__})" if typed else ""
    return f"{name} must be {want}, got {value!r}{kind}" + (f"; {hint}" if hint else "")


def check_bool(name: str, value, *, hint: str = "") -> bool:
    """`value` if it is a bool; else TypeError naming `name` and the value (1 and "yes"
    are refused: a flag passed as something else is usually a misplaced argument)."""
    if not isinstance(value, bool):
        tail = f"; {hint}" if hint else ""
        raise TypeError(f"{name} must be True or False, got {value!r} "
                        f"({type(value).__name__}){tail}")
    return value


def log_once(logger: logging.Logger, seen: set, key, msg: str, *args,
             level: int = logging.WARNING, exc_info=None) -> bool:
    """Log `msg % args` at `level` unless `key` is already in `seen`; add it. Returns
    whether it logged. `seen` belongs to the caller, so "once" means once per that owner
    (a watcher, a layer, a callback), not once per process: a second watcher in the same
    process still says what is wrong with it."""
    if key in seen:
        return False
    seen.add(key)
    logger.log(level, msg, *args, exc_info=exc_info)
    return True


def missing_extra(package: str, extra: str, needed_by: str) -> ImportError:
    """The one-line ImportError to raise when `needed_by` cannot import `package`:
    which extra installs it, pip install 'flashwatch[<extra>]'."""
    return ImportError(f"{needed_by} needs {package}, which is not installed; install it "
                       f"with: pip install 'flashwatch[{extra}]'")
