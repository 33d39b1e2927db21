"""Units as people write them: link rates in tc's units, durations, and rates for reading.

Used by the simulator's cluster presets and by the testbed, which hands the same strings to tc.
"""

from __future__ import annotations

import math
import re

# tc's rate units (tc(8) "RATES"); as in tc, a bare number is bit/s and the *bps units are BYTES/s.
_RATE_UNITS_BPS = {
    "": 1.0, "bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
    "kibit": 2.0**10, "mibit": 2.0**20, "gibit": 2.0**30, "tibit": 2.0**40,
    "bps": 8.0, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12,
    "kibps": 8 * 2.0**10, "mibps": 8 * 2.0**20, "gibps": 8 * 2.0**30, "tibps": 8 * 2.0**40,
}  # fmt: skip
_TIME_UNITS_MS = {
    "us": 1e-3, "usec": 1e-3, "usecs": 1e-3,
    "ms": 1.0, "msec": 1.0, "msecs": 1.0,
    "s": 1e3, "sec": 1e3, "secs": 1e3,
}  # fmt: skip
_NUMBER_UNIT = re.compile(r"\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_bandwidth(text: str) -> float:
    """Bits per second from a tc rate: "1gbit" -> 1e9, "2.5gbit", "100mbit", "1000000bit".

    Units are tc's, case-insensitive: bit, kbit, mbit, gbit, tbit (powers of 1000), kibit..tibit
    (powers of 1024), and bps, kbps, ... which, as in tc, mean BYTES per second.
    """
    match = _NUMBER_UNIT.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _RATE_UNITS_BPS:
        raise ValueError(
            f"bandwidth {text!r} is not a rate; write a number and a tc unit, e.g. '1gbit', "
            "'100mbit', '2.5gbit' or '1000000bit' (units: bit, kbit, mbit, gbit, tbit)"
        )
    bps = float(match.group(1)) * _RATE_UNITS_BPS[unit]
    if not (bps > 0 and math.isfinite(bps)):
        raise ValueError(f"bandwidth {text!r} must be a positive, finite rate, e.g. '1gbit'")
    return bps


def parse_latency(text: str) -> float:
    """Milliseconds from a duration with a unit: "0.2ms" -> 0.2, "150us" -> 0.15, "1s" -> 1000; "0" -> 0."""
    match = _NUMBER_UNIT.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    # tc reads a bare number as microseconds; refuse it rather than guess (bare zero is unambiguous).
    bare_zero = match is not None and unit == "" and float(match.group(1)) == 0
    if match is None or (unit not in _TIME_UNITS_MS and not bare_zero):
        raise ValueError(
            f"latency {text!r} is not a duration; write a number and a unit (us, ms or s), "
            "e.g. '0.2ms', '150us' or '0'"
        )
    ms = float(match.group(1)) * _TIME_UNITS_MS.get(unit, 0.0)
    if not (ms >= 0 and math.isfinite(ms)):
        raise ValueError(f"latency {text!r} must be zero or positive and finite, e.g. '0.2ms'")
    return ms


def format_bandwidth(bits_per_s: float) -> str:
    """ "1 Gbit/s", "200 Mbit/s", "2.5 Gbit/s"."""
    for scale, unit in ((1e12, "Tbit/s"), (1e9, "Gbit/s"), (1e6, "Mbit/s"), (1e3, "kbit/s")):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:.4g} {unit}"
    return f"{bits_per_s:.4g} bit/s"
