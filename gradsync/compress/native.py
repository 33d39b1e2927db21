"""The codecs' fused CPU kernels (native.c), compiled on first use and called through ctypes.

A torch op is one pass over its operands, so a codec written in torch ops reads and writes a
full-size array once per op: int4's encode alone took eleven passes. The kernels in native.c do
each codec step in one pass and give the same bits as the torch ops (that file says how), so
whether a rank has them changes its speed, not its results (one exception, below); tests
compare the two paths.

native.c is plain C99: it is compiled once per machine with the system's C compiler (`$CC`, else
`cc`) into gradsync's cache directory (`$GRADSYNC_CACHE`, else `$XDG_CACHE_HOME/gradsync`, else
`~/.cache/gradsync`; a temporary directory where that cannot be written), named by a hash of the
source, the flags and the machine's architecture, so an edit rebuilds it. Without a compiler the
torch ops run, with one warning. `GRADSYNC_NATIVE=0` turns the kernels off.

Large tensors are cut into as many pieces as torch has threads (torch.get_num_threads()), each
piece a kernel call on a thread of its own (ctypes lets go of the GIL), as torch's own ops use
every thread they are given. Not the top-k count and the bitmap kernels, which run top-k's
warm-up only: one call each (a piece of a bitmap needs the count of the marks before it).

The exception: top-k's counted selection (its warm-up's densities) keeps the first of equal
magnitudes, where the torch path keeps any of them, and ranks NaN first, as torch.topk does,
where the sampled threshold never passes one (the hook hands a codec finite gradients only).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import stat
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

log = logging.getLogger("gradsync")

_SOURCE = Path(__file__).with_name("native.c")
# -ffp-contract=off: no implicit fused multiply-add, whose single rounding the torch ops do not
# have (native.c calls fmaf where they do);
# -fno-fast-math against compilers that default to it. -fno-math-errno lets fabsf and nearbyintf
# vectorize and -fno-strict-aliasing lets a kernel read floats as their bit patterns; neither
# changes a result.
_FLAGS = (
    "-O3",
    "-std=c99",
    "-shared",
    "-fPIC",
    "-ffp-contract=off",
    "-fno-fast-math",
    "-fno-math-errno",
    "-fno-strict-aliasing",
)
_BUILD_TIMEOUT_S = 120
# Below this many entries a tensor is one call: a thread's start costs more than it saves.
_PARALLEL_NUMEL = 1 << 20

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False
_enabled = os.environ.get("GRADSYNC_NATIVE", "1") != "0"
_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def _after_fork_in_child() -> None:
    # A forked child has none of the pool's threads (work queued for them would wait for ever)
    # and may hold the lock as another thread of the parent held it: both start afresh.
    global _pool, _pool_size, _lock
    _pool, _pool_size, _lock = None, 0, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

_i64, _i32, _f32, _ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_void_p
_SIGNATURES = {
    "gs_absmax_encode": (None, [_ptr, _i64, _i64, _i32, _ptr, _ptr]),
    "gs_absmax_encode_corrected": (None, [_ptr, _ptr, _f32, _i64, _i64, _i32, _ptr, _ptr, _ptr]),
    "gs_absmax_decode": (None, [_ptr, _ptr, _ptr, _i64, _i64, _i32, _i32]),
    "gs_absmax_sum_decoded": (None, [_ptr, _ptr, _ptr, _i32, _i64, _i64, _i32]),
    "gs_at_least": (_i64, [_ptr, _i64, _f32, _ptr, _i64]),
    "gs_top_magnitudes": (None, [_ptr, _i64, _i64, _ptr]),
    "gs_bitmap_count": (_i64, [_ptr, _i64]),
    "gs_bitmap_of": (None, [_ptr, _i64, _i64, _ptr]),
    "gs_bitmap_add": (None, [_ptr, _ptr, _ptr, _i64, _i32]),
    "gs_cast_mean": (None, [_ptr, _i64, _f32, _i32, _ptr]),
}
_HALF, _BFLOAT16, _HALF_PORTABLE = 0, 1, 2  # gs_cast_mean's kinds


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
    """Int8's and Int4's codes of float32 `x` into `packed` (int8 or uint8) and its blocks' scales;
    `bits` is 8 or 4, and `block` even where it is 4 (no byte holds two blocks' codes)."""
    assert bits in (4, 8) and (bits == 8 or block % 2 == 0), (bits, block)

    def piece(lo: int, hi: int) -> None:
        _call(
            "gs_absmax_encode",
            x.data_ptr() + 4 * lo,
            hi - lo,
            block,
            bits,
            packed.data_ptr() + lo * bits // 8,
            scales.data_ptr() + 4 * (lo // block),
        )

    _in_pieces(x.numel(), block, piece)


def absmax_encode_corrected(
    g: torch.Tensor,
    base: torch.Tensor,
    alpha: float,
    block: int,
    bits: int,
    packed: torch.Tensor,
    scales: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """absmax_encode of p = base + alpha * g (float32, one rounding, as torch.add with alpha),
    leaving p - decoded in float32 `out`: error feedback's add and residual fused into the encode."""
    assert bits in (4, 8) and (bits == 8 or block % 2 == 0), (bits, block)

    def piece(lo: int, hi: int) -> None:
        _call(
            "gs_absmax_encode_corrected",
            g.data_ptr() + 4 * lo,
            base.data_ptr() + 4 * lo,
            alpha,
            hi - lo,
            block,
            bits,
            packed.data_ptr() + lo * bits // 8,
            scales.data_ptr() + 4 * (lo // block),
            out.data_ptr() + 4 * lo,
        )

    _in_pieces(g.numel(), block, piece)


def absmax_decode(
    out: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, block: int, bits: int, mode: int
) -> None:
    """float32 `out` = (mode 0), += (1) or -= (2) the decoded codes (as absmax_encode's)."""
    assert bits in (4, 8) and (bits == 8 or block % 2 == 0), (bits, block)

    def piece(lo: int, hi: int) -> None:
        _call(
            "gs_absmax_decode",
            out.data_ptr() + 4 * lo,
            packed.data_ptr() + lo * bits // 8,
            scales.data_ptr() + 4 * (lo // block),
            hi - lo,
            block,
            bits,
            mode,
        )

    _in_pieces(out.numel(), block, piece)


def absmax_sum_decoded(
    out: torch.Tensor, packed: Sequence[torch.Tensor], scales: Sequence[torch.Tensor], block: int, bits: int
) -> None:
    """float32 `out` = the sum of the payloads (packed[r], scales[r]) decoded, added in order to a
    zero (the bits of out.zero_() and one absmax_decode(mode=1) per payload), in one pass."""
    assert bits in (4, 8) and (bits == 8 or block % 2 == 0), (bits, block)
    assert len(packed) == len(scales), (len(packed), len(scales))

    def piece(lo: int, hi: int) -> None:
        codes = (ctypes.c_void_p * len(packed))(*(t.data_ptr() + lo * bits // 8 for t in packed))
        blocks = (ctypes.c_void_p * len(scales))(*(t.data_ptr() + 4 * (lo // block) for t in scales))
        start = out.data_ptr() + 4 * lo
        _call("gs_absmax_sum_decoded", start, codes, blocks, len(packed), hi - lo, block, bits)

    _in_pieces(out.numel(), block, piece)


def at_least(x: torch.Tensor, threshold: float, expected: int) -> torch.Tensor:
    """Ascending int64 positions of float32 `x`'s entries with |x| >= threshold, in one pass;
    `expected` (about how many) sizes the first try, and a second pass follows where more pass."""
    found: dict[int, torch.Tensor] = {}

    def piece(lo: int, hi: int) -> None:
        capacity = max(expected * (hi - lo) // max(x.numel(), 1), 16)
        while True:
            indices = torch.empty(capacity, dtype=torch.int64)
            count = _call(
                "gs_at_least", x.data_ptr() + 4 * lo, hi - lo, threshold, indices.data_ptr(), capacity
            )
            if count <= capacity:
                found[lo] = indices[:count].add_(lo) if lo else indices[:count]
                return
            capacity = count

    _in_pieces(x.numel(), 1, piece)
    return found[0] if len(found) == 1 else torch.cat([found[lo] for lo in sorted(found)])


def top_magnitudes(x: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending int64 positions of the k entries of float32 `x` with the largest magnitudes
    (ties: the first ones; NaN above infinity), 0 < k <= x.numel(): four passes over `x`,
    whatever k is."""
    assert 0 < k <= x.numel(), f"top_magnitudes needs 0 < k <= numel, got k={k} of {x.numel()}"
    indices = torch.empty(k + 1, dtype=torch.int64)  # the kernel writes one past the last kept
    _call("gs_top_magnitudes", x.data_ptr(), x.numel(), k, indices.data_ptr())
    return indices[:k]


def bitmap_count(bitmap: torch.Tensor, numel: int) -> int:
    """How many of `numel` entries a uint8 bitmap (wire.pack_bits's layout) marks."""
    return _call("gs_bitmap_count", bitmap.data_ptr(), numel)


def bitmap_of(indices: torch.Tensor, numel: int) -> torch.Tensor:
    """The uint8 bitmap (wire.pack_bits's layout) marking distinct int64 `indices` below `numel`."""
    assert indices.dtype == torch.int64, f"bitmap_of reads int64 positions, got {indices.dtype}"
    bitmap = torch.empty((numel + 7) // 8, dtype=torch.uint8)
    _call("gs_bitmap_of", indices.data_ptr(), indices.numel(), numel, bitmap.data_ptr())
    return bitmap


def bitmap_add(out: torch.Tensor, bitmap: torch.Tensor, values: torch.Tensor, negate: bool) -> None:
    """float32 `out` += (or, `negate`, -= 0 +) float32 `values` at the entries the bitmap marks,
    in ascending order; `values` must hold bitmap_count(bitmap, out.numel()) entries."""
    _call("gs_bitmap_add", out.data_ptr(), bitmap.data_ptr(), values.data_ptr(), out.numel(), int(negate))


def cast_mean(x: torch.Tensor, divisor: int, out: torch.Tensor, portable: bool = False) -> None:
    """float16 or bfloat16 `out` = float32 `x` / divisor, each rounded once to out's type;
    `portable`: half precision by native.c's own rounding even where the CPU has F16C (tests)."""
    kind = _BFLOAT16 if out.dtype == torch.bfloat16 else _HALF_PORTABLE if portable else _HALF

    def piece(lo: int, hi: int) -> None:
        _call("gs_cast_mean", x.data_ptr() + 4 * lo, hi - lo, float(divisor), kind, out.data_ptr() + 2 * lo)

    _in_pieces(x.numel(), 1, piece)


def _in_pieces(numel: int, align: int, piece: Callable[[int, int], None]) -> None:
    """piece(lo, hi) over [0, numel) in as many pieces as torch has threads, each starting at a
    multiple of `align`, run at once on a pool of threads; one call where the tensor is small."""
    threads = torch.get_num_threads()
    if threads <= 1 or numel < _PARALLEL_NUMEL:
        piece(0, numel)
        return
    step = -(-numel // threads)
    step = -(-step // align) * align
    bounds = [(lo, min(lo + step, numel)) for lo in range(0, numel, step)]
    for done in [_threads(threads).submit(piece, lo, hi) for lo, hi in bounds]:
        done.result()


def _threads(count: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _lock:
        if _pool is None or _pool_size < count:
            _pool, _pool_size = ThreadPoolExecutor(count, thread_name_prefix="gradsync-kernel"), count
        return _pool


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
            except Exception as error:  # whatever fails (no home directory, no compiler): torch ops
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
    name = _library_name()
    for directory in _cache_dirs():
        if _trusted(directory) and (directory / name).exists():  # trusted first: it may delete
            return directory / name
    compiler = shlex.split(os.environ.get("CC") or "cc")
    if not compiler or shutil.which(compiler[0]) is None:
        raise OSError(f"no C compiler: {os.environ.get('CC') or 'cc'!r} is not on PATH (set CC)")
    errors = []
    for directory in _cache_dirs():
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            if not _trusted(directory):
                errors.append(f"{directory} is not this user's alone")
                continue
            return _compile(compiler, directory / name)
        except OSError as error:  # unwritable, read-only or full: the next place
            errors.append(str(error))
    raise OSError(f"no cache directory gradsync can write: {'; '.join(errors)}")


def _library_name() -> str:
    """The library's file name: a hash of the source and how it is compiled, so an edit rebuilds."""
    key = _SOURCE.read_bytes() + " ".join((*_FLAGS, platform.machine())).encode()
    return f"native-{hashlib.sha256(key).hexdigest()[:16]}.so"


def _trusted(directory: Path) -> bool:
    """Whether a library in `directory` may be loaded. The shared one (_shared_dir) must be this
    user's, closed to others, in a temporary directory whose sticky bit keeps others from renaming
    it away, or another user could have put code there under the name this source hashes to. One
    of this user's that others could write (made under a umask of 002 by an earlier gradsync) is
    closed to them and its libraries, which anyone may have written, deleted."""
    if directory != _shared_dir():
        return True  # the user's own cache, or where GRADSYNC_CACHE points
    try:
        status, parent = directory.lstat(), directory.parent.stat()
    except OSError:
        return False
    owner = getattr(os, "getuid", lambda: status.st_uid)()
    if not stat.S_ISDIR(status.st_mode) or status.st_uid != owner:
        return False
    if parent.st_mode & stat.S_IWOTH and not parent.st_mode & stat.S_ISVTX:
        return False
    if status.st_mode & 0o022:
        directory.chmod(0o700)
        for library in directory.glob("native-*.so"):
            library.unlink(missing_ok=True)
    return True


def _compile(compiler: list[str], target: Path) -> Path:
    # Built under a private name and renamed into place: ranks that build at once never load a
    # half-written file.
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        built = Path(work) / target.name
        command = [*compiler, *_FLAGS, str(_SOURCE), "-o", str(built), "-lm"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise OSError(f"{' '.join(compiler)} failed on {_SOURCE.name}: {done.stderr.strip()[-2000:]}")
        os.replace(built, target)
    return target


def _shared_dir() -> Path:
    """The cache in the system's temporary directory, where the user's own cannot be written."""
    user = getattr(os, "getuid", lambda: "user")()  # no uid on Windows
    return Path(tempfile.gettempdir()) / f"gradsync-{user}"


def _cache_dirs() -> list[Path]:
    """Where the library is kept, in order of preference."""
    shared = _shared_dir()
    if os.environ.get("GRADSYNC_CACHE"):
        return [Path(os.environ["GRADSYNC_CACHE"]), shared]
    if os.environ.get("XDG_CACHE_HOME"):
        return [Path(os.environ["XDG_CACHE_HOME"]) / "gradsync", shared]
    try:
        return [Path.home() / ".cache" / "gradsync", shared]
    except RuntimeError:  # no home directory (a uid without a passwd entry, HOME unset)
        return [shared]
