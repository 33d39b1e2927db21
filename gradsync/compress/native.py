"""The codecs' fused CPU kernels (native.c), compiled on first use and called through ctypes.

A torch op is one pass over its operands, so a codec written in torch ops reads and writes a
full-size array once per op: int4's encode alone took eleven passes. The kernels in native.c do
each codec step in one pass and give the same bits as the torch ops (that file says how), so
whether a rank has them changes its speed, never its results; tests compare the two paths.

native.c is plain C99: it is compiled once per machine with the system's C compiler (`$CC`, else
`cc`) into gradsync's cache directory (`$GRADSYNC_CACHE`, else `$XDG_CACHE_HOME/gradsync`, else
`~/.cache/gradsync`), named by a hash of the source and flags, so an edit rebuilds it. Without a
compiler the torch ops run, with one warning. `GRADSYNC_NATIVE=0` turns the kernels off.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

log = logging.getLogger("gradsync")

_SOURCE = Path(__file__).with_name("native.c")
# -ffp-contract=off: no fused multiply-add, whose single rounding the torch ops do not have.
# -fno-math-errno lets fabsf and nearbyintf vectorize and -fno-strict-aliasing lets a kernel read
# floats as their bit patterns; neither changes a result.
_FLAGS = (
    "-O3",
    "-std=c99",
    "-shared",
    "-fPIC",
    "-ffp-contract=off",
    "-fno-math-errno",
    "-fno-strict-aliasing",
)

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False
_enabled = os.environ.get("GRADSYNC_NATIVE", "1") != "0"

_i64, _i32, _f32, _ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_void_p
_SIGNATURES = {
    "gs_absmax_encode": (None, [_ptr, _i64, _i64, _i32, _ptr, _ptr]),
    "gs_absmax_decode": (None, [_ptr, _ptr, _ptr, _i64, _i64, _i32, _i32]),
    "gs_at_least": (_i64, [_ptr, _i64, _f32, _ptr, _i64]),
    "gs_cast_mean": (None, [_ptr, _i64, _f32, _i32, _ptr]),
}
_HALF_KINDS = {torch.float16: 0, torch.bfloat16: 1}


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the kernels can run on `tensors`: built here, and each on the CPU and contiguous."""
    return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors) and _load() is not None


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Run the codecs' torch ops instead of the kernels inside the block (tests, comparisons)."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before


def absmax_encode(x: torch.Tensor, block: int, bits: int, packed: torch.Tensor, scales: torch.Tensor) -> None:
    """Int8's and Int4's codes of float32 `x` into `packed` (uint8) and its blocks' scales."""
    _call("gs_absmax_encode", x.data_ptr(), x.numel(), block, bits, packed.data_ptr(), scales.data_ptr())


def absmax_decode(
    out: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, block: int, bits: int, mode: int
) -> None:
    """float32 `out` = (0), += (1) or -= (2) the decoded codes."""
    args = (out.data_ptr(), packed.data_ptr(), scales.data_ptr(), out.numel(), block, bits, mode)
    _call("gs_absmax_decode", *args)


def at_least(x: torch.Tensor, threshold: float, expected: int) -> torch.Tensor:
    """Ascending int64 positions of float32 `x`'s entries with |x| >= threshold, in one pass;
    `expected` (about how many) sizes the first try, and a second pass follows where more pass."""
    capacity = max(expected, 16)
    while True:
        indices = torch.empty(capacity, dtype=torch.int64)
        count = _call("gs_at_least", x.data_ptr(), x.numel(), threshold, indices.data_ptr(), capacity)
        if count <= capacity:
            return indices[:count]
        capacity = count


def cast_mean(x: torch.Tensor, divisor: int, out: torch.Tensor) -> None:
    """float16 or bfloat16 `out` = float32 `x` / divisor, each rounded once to out's type."""
    _call("gs_cast_mean", x.data_ptr(), x.numel(), float(divisor), _HALF_KINDS[out.dtype], out.data_ptr())


def _call(name: str, *args: object) -> int:
    library = _load()
    assert library is not None, "native kernels called where usable() is False"
    return getattr(library, name)(*args)


def _load() -> ctypes.CDLL | None:
    global _library, _tried
    if not _enabled:
        return None
    if _tried:
        return _library
    with _lock:
        if not _tried:
            try:
                _library = _bind(ctypes.CDLL(str(_build())))
            except (OSError, subprocess.SubprocessError) as error:
                log.warning("gradsync: CPU kernels unavailable, using torch ops (slower): %s", error)
            _tried = True
    return _library


def _bind(library: ctypes.CDLL) -> ctypes.CDLL:
    for name, (result, arguments) in _SIGNATURES.items():
        function = getattr(library, name)
        function.restype, function.argtypes = result, arguments
    return library


def _build() -> Path:
    """The compiled library, built now if this source and these flags were never built here."""
    source = _SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join(_FLAGS).encode()).hexdigest()[:16]
    target = _cache_dir() / f"native-{digest}.so"
    if target.exists():
        return target
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise OSError(f"no C compiler: {compiler!r} is not on PATH (set CC)")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built under a private name and renamed into place: ranks that build at once never load a
    # half-written file.
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        built = Path(work) / target.name
        done = subprocess.run(
            [compiler, *_FLAGS, str(_SOURCE), "-o", str(built), "-lm"], capture_output=True, text=True
        )
        if done.returncode != 0:
            raise OSError(f"{compiler} failed on {_SOURCE.name}: {done.stderr.strip()[-2000:]}")
        os.replace(built, target)
    return target


def _cache_dir() -> Path:
    if os.environ.get("GRADSYNC_CACHE"):
        return Path(os.environ["GRADSYNC_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "gradsync"
