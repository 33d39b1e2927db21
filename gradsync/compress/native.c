/* gradsync's CPU kernels: the codecs' full-size passes fused into one loop each.
 *
 * Each function computes, bit for bit, what the codec's torch ops compute (gradsync.compress:
 * absmax.py, sparse.py), but reads and writes each full-size array once instead of once per op.
 * Bit for bit, so a rank that runs the torch ops and a rank that runs these decode the same
 * payloads into the same sums:
 *   - built with -ffp-contract=off: a * b + c is never fused into one rounding, except by an
 *     explicit fmaf where the torch op fuses it too (torch.add with alpha, on CPUs with FMA);
 *   - x / s is a division (correctly rounded, as torch's div), never a multiply by 1 / s;
 *   - nearbyintf rounds half to even in the default rounding mode, as torch.round does.
 *
 * Plain C99, no Python or torch headers: gradsync.compress.native compiles it on first use and
 * calls it through ctypes, which releases the GIL while a kernel runs.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "gradsync's kernels read flags and codes as little-endian words; the torch ops run instead"
#endif

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__) && __GNUC__ >= 12
/* One clone for AVX-512 machines, one for AVX2 ones (with FMA, which fmaf needs to be one
 * instruction), one for any x86-64; the loader picks by the CPU's features at run time. GCC
 * takes the psABI levels in target_clones from version 12 on. */
#define GS_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#elif defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
/* Older GCC: AVX2 or any x86-64 (fmaf is then a call into libm: the same bits, slower). */
#define GS_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define GS_CLONES
#endif

/* Blockwise absmax quantization (Int8, Int4): per block of `block` entries, scale = absmax /
 * levels, code = round(x / scale) (x / 1 where absmax is 0). A block's absmax is NaN where the
 * block holds a NaN (torch's amax propagates it); its codes are then meaningless, but the scale
 * tells every rank that the payload is not finite. bits 8: one int8 per code; bits 4: code +
 * levels in a nibble, even entries in the low nibble, and `block` even (the caller checks), so
 * that no byte holds codes of two blocks. `packed` holds ceil(numel * bits / 8) bytes and
 * `scales` ceil(numel / block) floats. */

/* Entries quantized per inner round: codes go through a buffer on the stack, so that every loop
 * is a plain elementwise one the compiler vectorizes. */
#define GS_CHUNK 1024

/* max |x| over the block, NaN where one is NaN. Computed on the bit patterns: with the sign bit
 * cleared, floats order as their patterns do, and every NaN's pattern is above infinity's, so one
 * integer max finds both (and vectorizes). */
static inline __attribute__((always_inline)) float block_absmax(const float *restrict x, int64_t count)
{
    const uint32_t *restrict patterns = (const uint32_t *)x; /* built with -fno-strict-aliasing */
    uint32_t largest = 0;
    for (int64_t i = 0; i < count; ++i) {
        const uint32_t size = patterns[i] & 0x7fffffffu;
        largest = size > largest ? size : largest;
    }
    if (largest > 0x7f800000u)
        return NAN;
    float absmax;
    memcpy(&absmax, &largest, sizeof absmax);
    return absmax;
}

/* round(q) within -levels .. levels: a block whose scale is subnormal (absmax below about 1e-36)
 * divides to beyond the levels, as torch's path clamps it. q is NaN in a non-finite block (its
 * scale NaN or inf: the step is skipped on every rank) and where a block's scale underflows to 0
 * (absmax below levels * 2^-150, its zeros divide 0 / 0); the first select turns NaN into +levels,
 * so its conversion to an integer is defined, and code * scale and the residual are as for any
 * code there (non-finite, or 0). Two selects, a vector min and max: a third, NaN-testing one made
 * GCC 12 keep the corrected encode's loop scalar in the AVX2 and baseline clones (37 ms against
 * 14 ms for 22.3M entries on one thread). */
static inline __attribute__((always_inline)) float code_of(float q, float levels)
{
    const float rounded = nearbyintf(q);
    const float below = rounded < levels ? rounded : levels;
    return below > -levels ? below : -levels;
}

/* A block's scale, absmax / levels (stored in the payload), and what its entries are divided by:
 * the scale, or 1 where the block is all zero. */
static inline __attribute__((always_inline)) float block_scale(const float *restrict x, int64_t count,
                                                               float levels, float *divisor)
{
    const float absmax = block_absmax(x, count);
    const float scale = absmax / levels;
    *divisor = absmax > 0.0f ? scale : 1.0f;
    return scale;
}

/* Int4's stored codes (code + levels, 0 .. 14) two a byte: byte j = code 2j | code 2j+1 << 4
 * (`count` codes from an even entry: chunks and blocks start at even entries). */
static inline __attribute__((always_inline)) void pack_pairs(uint8_t *restrict out, const uint8_t *restrict codes,
                                                             int64_t count)
{
    const int64_t pairs = count >> 1;
    for (int64_t j = 0; j < pairs; ++j)
        out[j] = (uint8_t)(codes[2 * j] | (codes[2 * j + 1] << 4));
    if (count & 1)
        out[pairs] = codes[count - 1];
}

GS_CLONES
void gs_absmax_encode(const float *restrict x, int64_t numel, int64_t block, int32_t bits,
                      uint8_t *restrict packed, float *restrict scales)
{
    const float levels = bits == 8 ? 127.0f : 7.0f;
    uint8_t codes[GS_CHUNK];
    for (int64_t start = 0, b = 0; start < numel; start += block, ++b) {
        const int64_t end = start + block < numel ? start + block : numel;
        float divisor;
        scales[b] = block_scale(x + start, end - start, levels, &divisor);
        for (int64_t at = start; at < end; at += GS_CHUNK) {
            const int64_t count = end - at < GS_CHUNK ? end - at : GS_CHUNK;
            const float *restrict in = x + at;
            if (bits == 8) {
                int8_t *restrict out = (int8_t *)packed + at;
                for (int64_t i = 0; i < count; ++i)
                    out[i] = (int8_t)code_of(in[i] / divisor, levels);
                continue;
            }
            for (int64_t i = 0; i < count; ++i)
                codes[i] = (uint8_t)(int32_t)(code_of(in[i] / divisor, levels) + levels);
            pack_pairs(packed + (at >> 1), codes, count);
        }
    }
}

/* Error feedback's add, the encode and the residual in one pass: p = base + alpha * g (one
 * rounding, as torch.add(base, g, alpha=alpha) computes it with a fused multiply-add), encoded as
 * gs_absmax_encode encodes p, and out = p - decoded, as gs_absmax_decode's mode 2 subtracts it.
 * Each block's p is written to `out` and read back while it is in cache, so each full-size array
 * is read or written once: g and base read, out and the codes written. `out` may be `g` itself
 * (not restrict: entry i is read before it is written). */
GS_CLONES
void gs_absmax_encode_corrected(const float *g, const float *restrict base, float alpha, int64_t numel,
                                int64_t block, int32_t bits, uint8_t *restrict packed, float *restrict scales,
                                float *out)
{
    const float levels = bits == 8 ? 127.0f : 7.0f;
    float codes[GS_CHUNK];
    uint8_t stored[GS_CHUNK];
    for (int64_t start = 0, b = 0; start < numel; start += block, ++b) {
        const int64_t end = start + block < numel ? start + block : numel;
        for (int64_t i = start; i < end; ++i)
            out[i] = fmaf(g[i], alpha, base[i]);
        float divisor;
        const float scale = scales[b] = block_scale(out + start, end - start, levels, &divisor);
        for (int64_t at = start; at < end; at += GS_CHUNK) {
            const int64_t count = end - at < GS_CHUNK ? end - at : GS_CHUNK;
            float *restrict p = out + at;
            for (int64_t i = 0; i < count; ++i) {
                /* + 0.0f: a code of -0 is stored as 0 and decodes to +0, not -0 (p == 0 then
                 * keeps the decoder's residual's sign). Decoded: code * scale, rounded once. */
                codes[i] = code_of(p[i] / divisor, levels) + 0.0f;
                p[i] = p[i] - codes[i] * scale;
            }
            if (bits == 8) {
                int8_t *restrict to = (int8_t *)packed + at;
                for (int64_t i = 0; i < count; ++i)
                    to[i] = (int8_t)codes[i];
                continue;
            }
            for (int64_t i = 0; i < count; ++i)
                stored[i] = (uint8_t)(int32_t)(codes[i] + levels);
            pack_pairs(packed + (at >> 1), stored, count);
        }
    }
}

/* to[0, count) = the decoded codes of entries [at, at + count) of one block, scale its scale:
 * (code - offset) * scale, rounded once, as the torch ops do it. */
static inline __attribute__((always_inline)) void decode_chunk(float *restrict to, const uint8_t *restrict packed,
                                                               float scale, int64_t at, int64_t count, int32_t bits)
{
    if (bits == 8) {
        const int8_t *restrict in = (const int8_t *)packed + at;
        for (int64_t i = 0; i < count; ++i)
            to[i] = (float)in[i] * scale;
        return;
    }
    const uint8_t *restrict in = packed + (at >> 1);
    const int64_t pairs = count >> 1;
    for (int64_t j = 0; j < pairs; ++j) {
        to[2 * j] = ((float)(in[j] & 15) - 7.0f) * scale;
        to[2 * j + 1] = ((float)(in[j] >> 4) - 7.0f) * scale;
    }
    if (count & 1)
        to[count - 1] = ((float)(in[pairs] & 15) - 7.0f) * scale;
}

/* out = decoded (mode 0), out += decoded (mode 1) or out -= decoded (mode 2), where decoded =
 * (code - offset) * scale of its block: one rounding for the decode, one for the sum, as the
 * torch ops do them. */
GS_CLONES
void gs_absmax_decode(float *restrict out, const uint8_t *restrict packed, const float *restrict scales,
                      int64_t numel, int64_t block, int32_t bits, int32_t mode)
{
    float decoded[GS_CHUNK];
    for (int64_t start = 0, b = 0; start < numel; start += block, ++b) {
        const int64_t end = start + block < numel ? start + block : numel;
        for (int64_t at = start; at < end; at += GS_CHUNK) {
            const int64_t count = end - at < GS_CHUNK ? end - at : GS_CHUNK;
            decode_chunk(mode == 0 ? out + at : decoded, packed, scales[b], at, count, bits);
            float *restrict sum = out + at;
            if (mode == 1)
                for (int64_t i = 0; i < count; ++i)
                    sum[i] = sum[i] + decoded[i];
            else if (mode == 2)
                for (int64_t i = 0; i < count; ++i)
                    sum[i] = sum[i] - decoded[i];
        }
    }
}

/* out = the sum of `payloads` payloads decoded (each as gs_absmax_decode's), added in their
 * order to a zero: the bits of a zeroed `out` and one mode-1 decode per payload, but `out` is
 * written once where those read and wrote it once per payload, and zeroed it first (a two-shot
 * owner's sum of its shard: 38 bytes moved an entry for 4 ranks at int4, 6 here). packed[r] and
 * scales[r] are payload r's codes and scales, starting at this range's first entry. */
GS_CLONES
void gs_absmax_sum_decoded(float *restrict out, const uint8_t *const *packed, const float *const *scales,
                           int32_t payloads, int64_t numel, int64_t block, int32_t bits)
{
    float decoded[GS_CHUNK];
    for (int64_t start = 0, b = 0; start < numel; start += block, ++b) {
        const int64_t end = start + block < numel ? start + block : numel;
        for (int64_t at = start; at < end; at += GS_CHUNK) {
            const int64_t count = end - at < GS_CHUNK ? end - at : GS_CHUNK;
            float *restrict sum = out + at;
            for (int64_t i = 0; i < count; ++i)
                sum[i] = 0.0f;
            for (int32_t r = 0; r < payloads; ++r) {
                decode_chunk(decoded, packed[r], scales[r][b], at, count, bits);
                for (int64_t i = 0; i < count; ++i)
                    sum[i] = sum[i] + decoded[i]; /* 0 + -0 is +0, as in a zeroed tensor */
            }
        }
    }
}

/* The ascending positions i of 1-D `x` with |x[i]| >= threshold, written to `indices` (at most
 * `capacity` of them); returns how many there are, which may exceed `capacity` (then only the
 * first `capacity` were written). NaN never passes, as in torch's comparison.
 *
 * A chunk's flags are set by a plain vectorized compare, then read as 64-bit words of 8 flags:
 * at top-k's density most words are zero and cost one test, and a word's set flags are found
 * by counting trailing zeros, not one byte at a time. */
GS_CLONES
int64_t gs_at_least(const float *restrict x, int64_t numel, float threshold, int64_t *restrict indices,
                    int64_t capacity)
{
    uint8_t flags[GS_CHUNK] __attribute__((aligned(8)));
    int64_t count = 0;
    for (int64_t at = 0; at < numel; at += GS_CHUNK) {
        const int64_t size = numel - at < GS_CHUNK ? numel - at : GS_CHUNK;
        for (int64_t i = 0; i < size; ++i)
            flags[i] = fabsf(x[at + i]) >= threshold;
        for (int64_t i = size; i % 8; ++i)
            flags[i] = 0;
        for (int64_t w = 0; w < (size + 7) / 8; ++w) {
            uint64_t word;
            memcpy(&word, flags + 8 * w, sizeof word);
            while (word) {
                if (count < capacity)
                    indices[count] = at + 8 * w + (__builtin_ctzll(word) >> 3);
                ++count;
                word &= word - 1;
            }
        }
    }
    return count;
}

/* The ascending positions of the k entries of 1-D `x` with the largest magnitudes, exactly, into
 * `indices`, which has room for k + 1; 0 < k < numel (k == 0 and k >= numel are the caller's).
 * A radix select: with the sign bit cleared, floats order as their bit patterns do, NaN's above
 * infinity's (torch.topk ranks NaN largest too), so the k-th largest magnitude's pattern is found
 * by counting, 11, 11 and 9 bits at a time, each pass over the entries that share the bits found
 * so far; a last pass writes every position above it and, of those equal to it, the first ones,
 * k in all. Four reads of x whatever k is, where a top-k by sorting or by sampled candidates
 * slows as k grows. */
GS_CLONES
void gs_top_magnitudes(const float *restrict x, int64_t numel, int64_t k, int64_t *restrict indices)
{
    static const int shifts[3] = {20, 9, 0}; /* each level's lowest bit: bits 20-30, 9-19, 0-8 */
    const uint32_t *restrict patterns = (const uint32_t *)x; /* built with -fno-strict-aliasing */
    int64_t counts[1 << 11];
    uint32_t kth_pattern = 0; /* the k-th largest magnitude's pattern: its bits found so far */
    int64_t wanted = k;       /* how many of the entries matching those bits are still to take */
    for (int level = 0; level < 3; ++level) {
        const int shift = shifts[level], above = level == 0 ? 31 : shifts[level - 1];
        const uint32_t mask = (1u << (above - shift)) - 1u;
        memset(counts, 0, (mask + 1) * sizeof counts[0]);
        for (int64_t i = 0; i < numel; ++i) {
            const uint32_t size = patterns[i] & 0x7fffffffu;
            if ((size >> above) == (kth_pattern >> above))
                ++counts[(size >> shift) & mask];
        }
        /* From the top bin down to the one holding the wanted-th largest: the bins counted hold
         * at least `wanted` entries, so bin never passes 0. */
        uint32_t bin = mask;
        while (counts[bin] < wanted)
            wanted -= counts[bin--];
        kth_pattern |= bin << shift;
    }
    /* Without a branch on the data, which a quarter of the entries passing would mispredict:
     * each position is written, and kept by counting it. */
    int64_t count = 0, ties = 0;
    for (int64_t i = 0; i < numel; ++i) {
        const uint32_t size = patterns[i] & 0x7fffffffu;
        const int64_t equal = size == kth_pattern;
        indices[count] = i;
        count += (size > kth_pattern) | (equal & (ties < wanted));
        ties += equal;
    }
}

/* Bitmap-coded indices (wire.encode_indices above a density of 1/32): bit i, in byte i / 8 at
 * bit i % 8 (little-endian, as wire.pack_bits packs it), marks entry i; bits past `numel` in the
 * last byte are not read, as wire.unpack_bits ignores them. */

/* How many entries the bitmap marks. */
GS_CLONES
int64_t gs_bitmap_count(const uint8_t *restrict bitmap, int64_t numel)
{
    const int64_t whole = numel / 64;
    int64_t count = 0;
    for (int64_t w = 0; w < whole; ++w) {
        uint64_t word;
        memcpy(&word, bitmap + 8 * w, sizeof word);
        count += __builtin_popcountll(word);
    }
    for (int64_t i = 64 * whole; i < numel; ++i)
        count += (bitmap[i >> 3] >> (i & 7)) & 1;
    return count;
}

/* The bitmap of `count` distinct positions below `numel`: (numel + 7) / 8 bytes, padding zero. */
GS_CLONES
void gs_bitmap_of(const int64_t *restrict indices, int64_t count, int64_t numel, uint8_t *restrict bitmap)
{
    memset(bitmap, 0, (size_t)((numel + 7) / 8));
    for (int64_t j = 0; j < count; ++j)
        bitmap[indices[j] >> 3] |= (uint8_t)(1u << (indices[j] & 7));
}

/* out[i] += v (negate 0) or out[i] -= v + 0 (negate 1) for each marked entry i, ascending, and
 * its value v = values[j], the j-th: index_add_ of the decoded indices, bit for bit (the torch
 * path subtracts 0 + v, which is v with -0 turned +0). `values` holds gs_bitmap_count's count of
 * floats: the caller checks. */
GS_CLONES
void gs_bitmap_add(float *restrict out, const uint8_t *restrict bitmap, const float *restrict values,
                   int64_t numel, int32_t negate)
{
    int64_t j = 0;
    for (int64_t at = 0; at < numel; at += 64) {
        uint64_t word = 0;
        if (numel - at >= 64)
            memcpy(&word, bitmap + at / 8, sizeof word);
        else
            for (int64_t i = at; i < numel; ++i)
                word |= (uint64_t)((bitmap[i >> 3] >> (i & 7)) & 1) << (i - at);
        for (; word; word &= word - 1, ++j) {
            const int64_t i = at + __builtin_ctzll(word);
            out[i] = negate ? out[i] - (values[j] + 0.0f) : out[i] + values[j];
        }
    }
}

/* `value` rounded to IEEE half precision (to nearest, ties to even), as torch's float -> half
 * conversion rounds it: the bit pattern. NaN becomes the quiet NaN 0x7e00 with the sign (torch's
 * NaN patterns differ by path; every NaN is as non-finite). Every case is computed and the right
 * one selected, without branches, so that the loop vectorizes. */
static inline __attribute__((always_inline)) uint16_t to_half(float value)
{
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    const uint32_t sign = (bits >> 16) & 0x8000u;
    const uint32_t size = bits & 0x7fffffffu;
    /* A normal half, from 2^-14 up: 13 mantissa bits dropped, to even; exponent bias 127 -> 15. */
    const uint32_t normal = (size + 0xfffu + ((size >> 13) & 1u) - 0x38000000u) >> 13;
    /* Below 2^-14, a whole number of 2^-24 steps (2^-14 itself where it rounds up): the product is
     * exact (a power of two), nearbyintf rounds half to even, and the clamp keeps the conversion
     * in range for the values that take another case. */
    const float steps = fabsf(value) * 0x1p24f;
    const uint32_t subnormal = (uint32_t)(int32_t)nearbyintf(steps < 1024.0f ? steps : 1024.0f);
    uint32_t half = size >= 0x38800000u ? normal : subnormal;
    half = size >= 0x477ff000u ? 0x7c00u : half; /* 65520 and up: infinity (65520 ties to it) */
    half = size > 0x7f800000u ? 0x7e00u : half;  /* NaN */
    return (uint16_t)(sign | half);
}

/* `value` rounded to bfloat16 (to nearest, ties to even), as torch rounds it; NaN becomes the
 * quiet NaN 0x7fc0 (torch's own NaN patterns differ by path; every NaN is as non-finite). */
static inline __attribute__((always_inline)) uint16_t to_bfloat16(float value)
{
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u)
        return 0x7fc0u;
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
#define GS_F16C 1
#include <cpuid.h>
#include <immintrin.h>

/* Whether this CPU converts to half precision (F16C, CPUID leaf 1, ECX bit 29) and the OS saves
 * AVX state; asked of CPUID itself, as older compilers do not know "f16c" as a feature name. */
static int has_f16c(void)
{
    unsigned int a, b, c, d;
    return __builtin_cpu_supports("avx") && __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29));
}

/* The same rounding by the F16C instruction (vcvtps2ph, to nearest even), eight at a time, as
 * torch's own vectorized cast does it: the compiler does not vectorize a conversion to _Float16. */
__attribute__((target("avx,f16c"))) static void half_mean_f16c(const float *restrict x, int64_t numel,
                                                                 float divisor, uint16_t *restrict out)
{
    const __m256 by = _mm256_set1_ps(divisor);
    int64_t i = 0;
    for (; i + 8 <= numel; i += 8) {
        const __m256 mean = _mm256_div_ps(_mm256_loadu_ps(x + i), by);
        _mm_storeu_si128((__m128i *)(out + i), _mm256_cvtps_ph(mean, _MM_FROUND_TO_NEAREST_INT));
    }
    for (; i < numel; ++i)
        out[i] = to_half(x[i] / divisor);
}
#endif

/* out[i] = x[i] / divisor, rounded to half (kind 0; by F16C where the CPU has it, kind 2: always
 * by to_half, for tests) or bfloat16 (kind 1): a cast codec's payload of this rank's share of the
 * average, in one pass (the torch ops divide in place, then cast). */
GS_CLONES
void gs_cast_mean(const float *restrict x, int64_t numel, float divisor, int32_t kind, uint16_t *restrict out)
{
#ifdef GS_F16C
    if (kind == 0 && has_f16c()) {
        half_mean_f16c(x, numel, divisor, out);
        return;
    }
#endif
    if (kind == 1)
        for (int64_t i = 0; i < numel; ++i)
            out[i] = to_bfloat16(x[i] / divisor);
    else
        for (int64_t i = 0; i < numel; ++i)
            out[i] = to_half(x[i] / divisor);
}
