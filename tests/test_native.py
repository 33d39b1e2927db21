"""native.c's kernels against the torch ops they replace: the same bits, on every input shape.

A rank with the kernels and a rank without them must decode the same sums, so each test runs a
codec both ways (native.disabled() is the torch path) and compares bit patterns, not values.
"""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from gradsync.compress import build, native
from gradsync.compress.sparse import (
    COUNT_FROM_DENSITY,
    add_sparse_,
    exact_topk,
    magnitude_at_least,
    sampled_topk,
    sparse_payload,
    sub_sparse_,
)
from gradsync.wire import encode_indices

COMPILER = shlex.split(os.environ.get("CC") or "cc")[0]
pytestmark = pytest.mark.skipif(
    shutil.which(COMPILER) is None, reason=f"no C compiler ({COMPILER}) here: the codecs run their torch ops"
)


def test_the_kernels_build_wherever_there_is_a_compiler():
    # Not a skip: a native.c this compiler rejects must fail here, not pass as "no compiler".
    assert native.usable(torch.zeros(1))


SIZES = [1, 2, 7, 128, 129, 255, 256, 1000, 4097]


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bit patterns, so that equal NaNs and -0.0 versus 0.0 compare as they are."""
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def gradient(numel: int, seed: int) -> torch.Tensor:
    """Normal entries with the cases rounding has to get right: zero blocks, exact halves of a
    step (round half to even), -0.0, huge and tiny magnitudes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g)
    if numel >= 256:
        x[:128] = 0.0  # an all-zero block: divided by 1, not 0
        x[128:136] = torch.tensor([7.0, 0.5, 1.5, 2.5, -0.5, -1.5, -0.0, 3.5])  # scale 1: ties
    if numel >= 1000:
        x[300:428] *= 1e-38  # subnormal scales
        x[500:628] *= 1e30
    if numel >= 1024:
        # Blocks whose scale underflows to 0 (absmax below levels * 2^-150) beside zeros, which
        # divide to NaN: a code of +levels on both paths.
        x[768:1024] = 0.0
        x[769] = 2.8e-45
    return x


def both_ways(fn):
    """fn() with the kernels and with the torch ops."""
    fast = fn()
    with native.disabled():
        slow = fn()
    return fast, slow


@pytest.mark.parametrize("name,block", [("int8", 256), ("int8", 3), ("int4", 128), ("int4", 2), ("int4", 64)])
@pytest.mark.parametrize("numel", SIZES)
def test_absmax_encode_and_every_decode_give_the_torch_ops_bits(name, block, numel):
    codec = build(name, block_size=block)
    x = gradient(numel, seed=numel)
    (fast, _), (slow, ctx) = both_ways(lambda: codec.compress(x))
    for a, b in zip(fast, slow, strict=True):
        assert a.dtype == b.dtype and torch.equal(bits(a), bits(b))
    payload = slow
    decoded = both_ways(lambda: codec.decompress(payload, ctx))
    assert torch.equal(bits(decoded[0]), bits(decoded[1]))
    into = both_ways(lambda: codec.decompress_into(torch.full_like(x, 9.0), payload, ctx))
    assert torch.equal(bits(into[0]), bits(into[1]))
    base = torch.randn(numel, generator=torch.Generator().manual_seed(1))
    for method in ("add_decoded_", "sub_decoded_"):

        def apply(method=method):
            out = base.clone()
            getattr(codec, method)(out, payload, ctx)
            return out

        fast_out, slow_out = both_ways(apply)
        assert torch.equal(bits(fast_out), bits(slow_out)), method


@pytest.mark.parametrize(
    "name,block", [("int8", 256), ("int8", 3), ("int4", 128), ("int4", 2), ("int8", 2048), ("int4", 2048)]
)
@pytest.mark.parametrize("numel", [*SIZES, 2 * 1024 + 1])  # blocks of 2048: chunks of 1024 within one
@pytest.mark.parametrize("count", [1, 2, 4, 5])
def test_a_sum_of_payloads_has_the_bits_of_a_zero_and_one_add_per_payload(
    name, block, numel, count, monkeypatch
):
    calls = []
    kernel = native.absmax_sum_decoded
    monkeypatch.setattr(native, "absmax_sum_decoded", lambda *a: calls.append(len(a[1])) or kernel(*a))
    codec = build(name, block_size=block)
    payloads = []
    for r in range(count):
        x = gradient(numel, seed=100 * numel + r)
        if r % 2:
            x = -x  # sums of both signs, so that a sum taken in another order rounds differently
        payload, ctx = codec.compress(x)
        payloads.append(payload)

    def summed():
        out = torch.full((numel,), 9.0)  # whatever the output held is not read
        codec.sum_decoded_(out, payloads, ctx)
        return out

    fast, slow = both_ways(summed)
    reference = torch.zeros(numel)
    with native.disabled():
        for payload in payloads:
            reference += codec.decompress(payload, ctx)
    assert calls == [count]  # the kernel ran (once, the fast way)
    assert torch.equal(bits(fast), bits(slow)) and torch.equal(bits(fast), bits(reference))


def test_a_sum_of_payloads_refuses_one_of_another_tensor_before_any_write():
    codec = build("int4")
    (a, ctx), (b, _) = codec.compress(torch.randn(1000)), codec.compress(torch.randn(700))
    out = torch.full((1000,), 9.0)
    with pytest.raises(ValueError, match="belongs to another tensor"):
        codec.sum_decoded_(out, [a, b], ctx)
    assert torch.equal(out, torch.full((1000,), 9.0))


@pytest.mark.parametrize("name,block", [("int8", 256), ("int8", 3), ("int4", 128), ("int4", 2)])
@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("alpha", [1.0, 0.25, 1 / 3])
def test_compress_corrected_is_the_add_the_encode_and_the_residual_bit_for_bit(name, block, numel, alpha):
    if alpha == 1 / 3 and torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        pytest.skip("torch's kernels without FMA round base + alpha * g twice; the kernel's fmaf once")
    # Error feedback's three passes, fused: p = base + alpha * g as torch.add rounds it (once), the
    # payload of p, and p - decoded(payload) left in out.
    codec = build(name, block_size=block)
    g, base = gradient(numel, seed=numel), gradient(numel, seed=numel + 1) * 0.1
    p = torch.add(base, g, alpha=alpha)
    (payload, ctx), residual = codec.compress(p), p.clone()
    codec.sub_decoded_(residual, payload, ctx)

    def corrected():  # out apart from g: a shard memory's spare, as the two-shot owner writes it
        out = torch.full_like(g, 9.0)
        return codec.compress_corrected(g, base, alpha, out), out

    def in_place():  # out is g itself, as the two-shot owner's sum takes its residual without a spare
        out = g.clone()
        return codec.compress_corrected(out, base, alpha, out), out

    for (got, got_ctx), out in [*both_ways(corrected), *both_ways(in_place)]:
        assert got_ctx == ctx
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got, payload, strict=True))
        assert torch.equal(bits(out), bits(residual))


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_entry_makes_its_blocks_scale_non_finite_both_ways(name, bad):
    # Codes of such a block are meaningless either way; the scale is what tells every rank.
    codec = build(name)
    x = gradient(1000, seed=3)
    x[700] = bad
    block = codec.block_size
    (fast, _), (slow, _) = both_ways(lambda: codec.compress(x))
    for payload in (fast, slow):
        finite = torch.isfinite(payload[1])
        assert not finite[700 // block] and int(finite.sum()) == finite.numel() - 1
    keep = torch.isfinite(slow[1])
    assert torch.equal(bits(fast[1][keep]), bits(slow[1][keep]))


def test_an_odd_int4_block_runs_the_torch_ops():
    # Two codes share a byte across a block boundary there: the kernel does not take it on.
    codec = build("int4", block_size=5)
    x = gradient(1001, seed=4)
    (fast, _), (slow, _) = both_ways(lambda: codec.compress(x))
    assert all(torch.equal(a, b) for a, b in zip(fast, slow, strict=True))


@pytest.mark.parametrize("numel", [*SIZES, 100_003])
def test_magnitude_at_least_finds_what_the_comparison_finds(numel):
    x = gradient(numel, seed=numel)
    x[numel // 2] = float("nan")  # never passes, as in torch
    for threshold in (0.0, 0.5, 1.5, 2.5758, float(x.abs().nan_to_num().max()), 1e9):
        expected = (x.abs() >= threshold).nonzero().squeeze(1)
        for guess in (0, 3, numel):  # too few: the kernel's second try; enough; all
            assert torch.equal(magnitude_at_least(x, threshold, guess), expected)
        with native.disabled():
            assert torch.equal(magnitude_at_least(x, threshold, 0), expected)


def test_sampled_topk_and_threshold_choose_the_same_entries_both_ways():
    x = gradient(200_000, seed=5)
    k = 2_000

    def sampled():
        return sampled_topk(x, k, 0.01, torch.Generator().manual_seed(0))

    fast, slow = both_ways(sampled)
    assert torch.equal(fast, slow)
    assert torch.equal(x.abs()[fast].sort().values, x.abs()[exact_topk(x, k)].sort().values)
    codec = build("threshold", threshold=1.0)
    (fast_payload, _), (slow_payload, _) = both_ways(lambda: codec.compress(x))
    assert all(torch.equal(a, b) for a, b in zip(fast_payload, slow_payload, strict=True))


def half_edge_cases() -> torch.Tensor:
    """Values around every rounding edge of a float -> half or bfloat16 cast, once divided by 3
    or 4: ties, the largest finite halves, the overflow to infinity, subnormals, zeros, NaN."""
    g = torch.Generator().manual_seed(8)
    edges = torch.tensor([65504.0, 65519.0, 65520.0, 65536.0, 1e6, 6.1e-5, 6.0e-8, 3.0e-8, 1e-40, 0.0, -0.0])
    edges = torch.cat([edges, -edges, torch.tensor([float("inf"), -float("inf"), float("nan")])])
    scaled = edges.repeat_interleave(8) * torch.linspace(0.999, 1.001, 8).repeat(edges.numel())
    ties = (torch.arange(1, 2049, dtype=torch.float32) + 0.5) * 2.0**-24  # half-way between halves
    return torch.cat([scaled * 3, scaled * 4, ties * 3, ties * 4, torch.randn(100_003, generator=g) * 1e3])


def largest_first(x: torch.Tensor, k: int) -> torch.Tensor:
    """The reference for native.top_magnitudes: ascending positions of the k largest magnitudes,
    NaN above infinity, equal magnitudes taken from the lowest position up (a stable sort)."""
    sizes = (x.view(torch.int32) & 0x7FFFFFFF).long()  # NaN's patterns lie above infinity's
    return torch.sort(sizes, descending=True, stable=True).indices[:k].sort().values


@pytest.mark.parametrize("numel", [*SIZES, 100_003])
def test_the_counted_top_k_is_the_k_largest_magnitudes_with_ties_to_the_lower_position(numel):
    g = torch.Generator().manual_seed(numel)
    ties = torch.randint(-3, 4, (numel,), generator=g).float()  # seven magnitudes, many ties
    ties[ties == 0] = -0.0 if numel % 2 else 0.0
    edges = gradient(numel, seed=numel)
    edges[numel // 3] = float("nan")
    edges[numel // 5] = -float("inf")
    for x in (ties, edges):
        for k in sorted(
            {1, max(1, numel // 32), max(1, numel // 4), max(1, numel // 2), max(1, numel - 1), numel}
        ):
            assert torch.equal(native.top_magnitudes(x, k), largest_first(x, k)), (numel, k)


@pytest.mark.parametrize("density", [COUNT_FROM_DENSITY, 0.25, 0.75])
def test_a_dense_sampled_top_k_is_counted_and_keeps_the_same_magnitudes_both_ways(density):
    x = gradient(100_003, seed=9)
    k = int(x.numel() * density) + 1

    generator = torch.Generator().manual_seed(0)
    counted = sampled_topk(x, k, 0.01, generator)
    assert torch.equal(generator.get_state(), torch.Generator().manual_seed(0).get_state())  # no sample
    assert torch.equal(counted, largest_first(x, k))
    with native.disabled():
        sampled = sampled_topk(x, k, 0.01, generator)
    assert torch.equal(x.abs()[counted].sort().values, x.abs()[sampled].sort().values)


@pytest.mark.parametrize("numel", [1, 40, 64, 128, 129, 1000, 1024, 4097, 100_003])
def test_bitmap_payloads_are_encoded_added_and_subtracted_with_the_torch_ops_bits(numel, monkeypatch):
    calls: list[str] = []
    for name in ("bitmap_of", "bitmap_add"):
        kernel = getattr(native, name)
        monkeypatch.setattr(native, name, lambda *a, _k=kernel, _n=name: calls.append(_n) or _k(*a))
    x = gradient(numel, seed=numel + 1)
    x[1::7] = -0.0  # sent -0.0 values: subtracted as +0.0 by both paths
    indices = torch.arange(0, numel, 3)  # a density above 1/32: a bitmap; some of them -0.0
    out = gradient(numel, seed=numel + 2)
    out[::5] = -0.0

    def apply():
        payload = sparse_payload(x, indices)
        added, subtracted = out.clone(), out.clone()
        add_sparse_(added, payload)
        sub_sparse_(subtracted, payload)
        return [*payload, added, subtracted]

    fast, slow = both_ways(apply)
    assert calls == ["bitmap_of", "bitmap_add", "bitmap_add"]  # the kernels ran, once each way
    assert torch.equal(fast[0], encode_indices(indices, numel))
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(fast, slow, strict=True))


def test_a_bitmap_that_marks_more_or_fewer_entries_than_its_values_is_refused_before_any_write():
    numel = 1001  # the last byte holds one entry's bit and seven of padding
    x = gradient(numel, seed=11)
    bitmap, values = sparse_payload(x, largest_first(x, 300))
    unmarked = int((bitmap[:-1] == 0).nonzero()[0])
    more = bitmap.clone()
    more[unmarked] = 1
    fewer = torch.zeros_like(bitmap)
    out = torch.ones(numel)
    for fn in (add_sparse_, sub_sparse_):
        for encoded, marked in ((more, 301), (fewer, 0)):
            with pytest.raises(
                ValueError, match=f"marks {marked} elements but the payload carries 300 values"
            ):
                fn(out, (encoded, values))
        assert torch.equal(out, torch.ones(numel))
    # Padding bits are not read, by either path: a bitmap with them set decodes as without.
    padded = bitmap.clone()
    padded[-1] |= 0xFE

    def decoded(encoded: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(numel)
        add_sparse_(out, (encoded, values))
        return out

    for encoded in (padded, bitmap):
        fast, slow = both_ways(functools.partial(decoded, encoded))
        assert torch.equal(bits(fast), bits(slow))
        assert torch.equal(fast.nonzero().squeeze(1), largest_first(x, 300))


@pytest.mark.parametrize("name", ["fp16", "bf16"])
@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_a_cast_of_the_mean_gives_the_torch_ops_bits(name, world_size):
    x = half_edge_cases()
    (fast, _), (slow, _) = both_ways(lambda: build(name).compress_mean(x.clone(), world_size))
    nan = torch.isnan(slow[0].float())
    assert torch.equal(nan, torch.isnan(fast[0].float()))
    assert torch.equal(bits(fast[0])[~nan], bits(slow[0])[~nan])
    if name == "fp16":  # native.c's own rounding, which CPUs without F16C run, gives them too
        portable = torch.empty_like(slow[0])
        native.cast_mean(x, world_size, portable, portable=True)
        assert torch.equal(torch.isnan(portable.float()), nan)
        assert torch.equal(bits(portable)[~nan], bits(slow[0])[~nan])


def test_large_tensors_cut_over_torchs_threads_give_one_calls_bits():
    x = gradient(3_000_001, seed=9)
    x[1_500_000] = float("nan")
    codec = build("int4")

    def every_kernel():
        payload, ctx = codec.compress(x)
        out = torch.ones_like(x)
        codec.add_decoded_(out, payload, ctx)
        summed = torch.empty_like(x)
        codec.sum_decoded_(summed, [payload, codec.compress(-x)[0], payload], ctx)
        residual = torch.empty_like(x)
        corrected, _ = codec.compress_corrected(x, out, 1 / 3, residual)
        half = torch.empty(x.numel(), dtype=torch.float16)
        native.cast_mean(x, 3, half)
        return [*payload, out, summed, *corrected, residual, half, magnitude_at_least(x, 1.5, expected=100)]

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = every_kernel()
        torch.set_num_threads(4)
        cut = every_kernel()
    finally:
        torch.set_num_threads(before)
    for a, b in zip(one, cut, strict=True):
        assert torch.equal(bits(a), bits(b)) if a.is_floating_point() else torch.equal(a, b)


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env}, timeout=120
    )


def test_the_kernels_are_built_into_the_cache_once_and_found_there(tmp_path):
    code = "import torch; from gradsync.compress import native; print(native.usable(torch.zeros(1)))"
    first = _python(code, GRADSYNC_CACHE=str(tmp_path))
    assert first.stdout.strip() == "True", first.stderr
    built = list(tmp_path.glob("native-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    again = _python(code, GRADSYNC_CACHE=str(tmp_path), CC="/nonexistent/cc")  # no compiler needed now
    assert again.stdout.strip() == "True", again.stderr
    assert built[0].stat().st_mtime_ns == stamp


def test_without_a_compiler_the_codecs_run_their_torch_ops_with_one_warning(tmp_path):
    code = (
        "import logging, torch; logging.basicConfig(); from gradsync.compress import build, native\n"
        "c = build('int4'); x = torch.randn(1000); p, ctx = c.compress(x); c.decompress(p, ctx)\n"
        "print(native.usable(x))"
    )
    done = _python(code, GRADSYNC_CACHE=str(tmp_path), CC="/nonexistent/cc")
    assert done.returncode == 0 and done.stdout.strip() == "False"
    assert done.stderr.count("CPU kernels unavailable") == 1 and "/nonexistent/cc" in done.stderr
    assert not list(tmp_path.glob("native-*.so"))


def test_gradsync_native_0_turns_the_kernels_off(tmp_path):
    code = "import torch; from gradsync.compress import native; print(native.usable(torch.zeros(1)))"
    done = _python(code, GRADSYNC_CACHE=str(tmp_path), GRADSYNC_NATIVE="0")
    assert done.stdout.strip() == "False" and not list(tmp_path.glob("*.so"))


@pytest.mark.parametrize("owner", ["mine, open to others", "another user's", "mine, in an unsticky tmp"])
def test_a_library_in_a_temporary_directory_others_can_write_is_not_loaded(tmp_path, owner):
    # Another user could put code there under the name this source hashes to.
    from gradsync.compress import native

    shared = tmp_path / "tmp" / f"gradsync-{os.getuid()}"
    shared.mkdir(parents=True)
    planted = shared / native._library_name()
    planted.write_bytes(b"not a library")  # loading it would fail
    shared.chmod(0o777 if owner == "mine, open to others" else 0o700)
    if owner == "another user's":
        if os.getuid() != 0:
            pytest.skip("making a directory another user's needs root")
        os.chown(shared, 12345, -1)
    if owner == "mine, in an unsticky tmp":  # anyone could rename my directory away and put theirs
        (tmp_path / "tmp").chmod(0o777)
    code = "import torch; from gradsync.compress import native; print(native.usable(torch.zeros(1)))"
    cache = {"GRADSYNC_CACHE": "", "XDG_CACHE_HOME": str(tmp_path / "cache")}
    done = _python(code, TMPDIR=str(tmp_path / "tmp"), **cache)
    assert done.stdout.strip() == "True", done.stderr  # built afresh in the user's own cache
    assert len(list((tmp_path / "cache" / "gradsync").glob("native-*.so"))) == 1
    if owner != "mine, open to others":
        assert planted.exists()  # left alone, and never loaded
    else:  # closed to others, and what they may have written there deleted
        assert not planted.exists() and shared.stat().st_mode & 0o777 == 0o700


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_runs_pieces_on_threads_of_its_own() -> None:
    # The parent's pool has threads the child lacks: work queued for them would wait for ever.
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        done: list[tuple[int, int]] = []

        def slow(lo: int, hi: int) -> None:  # both at once: the pool starts two threads, idle after
            time.sleep(0.1)
            done.append((lo, hi))

        native._in_pieces(1 << 21, 64, slow)
        assert len(done) == 2 and len(native._pool._threads) >= 2  # more where an earlier test ran
        pid = os.fork()
        if pid == 0:  # the child: exits 0 once its pieces ran, 1 on an error
            try:
                native._in_pieces(1 << 21, 64, lambda lo, hi: None)
                os._exit(0)
            except BaseException:
                os._exit(1)
        deadline = time.monotonic() + 30
        while (status := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if status[0] == 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child still waited for its pieces after 30 s")
        assert os.waitstatus_to_exitcode(status[1]) == 0
    finally:
        torch.set_num_threads(before)
