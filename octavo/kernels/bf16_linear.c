/* bf16 linear layers for a few rows (decode at small batch) on CPUs without
 * AMX: out[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]), bf16 in and out, float32
 * products and sums, reading the plain row-major weight the model holds.
 *
 * A step of small-batch decode is one read of every weight, so the kernel's
 * job is to stream the weight at the machine's read rate and do the math on
 * the way. Work is cut into tiles of BO outputs x BR rows with BO x BR = one
 * register's lanes (16 with AVX-512, 8 with AVX2): one row takes 16 outputs
 * at a time, two rows 8, more rows 4 (each weight load then feeds BR rows).
 * A tile walks K with one accumulator per (row, output), in vector lanes of
 * k's; the accumulators are reduced together at the end by a transpose-and-
 * add (one horizontal sum each would cost as much as the products at K =
 * 768). A thread's tiles cover a run of outputs for all rows, so rows after
 * the first re-read the tile's weights from L1/L2, not from memory.
 *
 * One source, three instruction sets, chosen by the compiler's target
 * (build.py compiles per target):
 *   AVX-512 BF16: vdpbf16ps on the raw bf16 pairs of weight and row (exact
 *                 products, float32 sums);
 *   AVX-512F:     a 64-byte load of 32 weights splits into the even and odd
 *                 k's as float32 by a shift and a mask (bf16 is the top half
 *                 of a float32); the row is laid out the same way once per
 *                 call, then two FMAs;
 *   AVX2 + FMA:   the same on 8 lanes;
 *   anything else: plain C the compiler vectorises (NEON, SVE, baseline x86).
 * Products of the same bf16 inputs are exact in float32 on every path; only
 * the summation order differs between them (and from torch's). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#define LANES_MAX 16

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* A tile of several rows prefetches the next tile's weights (its rows are the
 * next BO * K * 2 bytes) into L2 at the pace it reads its own: a tile's rows
 * are short interleaved streams (1.5 KiB each at K = 768), too short for the
 * hardware prefetchers to lock on (measured 4.9 GB/s of 18 without this, one
 * thread), while the next tile is one sequential run. Every row group does
 * it, not only the first (the later ones hit the cache): measured, prefetching
 * in the first group only halves the rate at 8 rows, spreading it over all
 * groups does not. A tile of one row needs none of it (see tile()). */
ALWAYS_INLINE void prefetch_lines(const char *p, int64_t bytes) {
    for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(p + at, 0, 2);
}

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define ISA "avx512_bf16"
#define LANES 16
#define KSTEP 32 /* k's per step: one 64-byte load of a weight row */
typedef __m512 vec;
/* Rows stay bf16 (vdpbf16ps reads them as they are), zero-padded to whole steps. */
typedef uint16_t row_t;
typedef __m512bh xvec;
ALWAYS_INLINE xvec load_x(const row_t *x, int64_t k) { return (__m512bh)_mm512_loadu_si512((const void *)(x + k)); }
ALWAYS_INLINE vec step(vec acc, const uint16_t *row, int64_t k, __mmask32 m, xvec x) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(m, row + k), x);
}
ALWAYS_INLINE void prepare_row(const uint16_t *x, int64_t K, int64_t width, row_t *dst) {
    memcpy(dst, x, (size_t)K * 2);
    memset(dst + K, 0, (size_t)(width - K) * 2);
}
#define REDUCE sum16

#elif defined(__AVX512F__) && defined(__AVX512BW__)
#define ISA "avx512"
#define LANES 16
#define KSTEP 32
typedef __m512 vec;
/* Rows as float32 in steps of 32 k's: the 16 even k's, then the 16 odd ones,
 * matching how a 64-byte weight load splits (bf16 is the top half of a
 * float32: the even k's by a shift, the odd ones by a mask). */
typedef float row_t;
typedef struct {
    __m512 even, odd;
} xvec;
ALWAYS_INLINE xvec load_x(const row_t *x, int64_t k) {
    return (xvec){_mm512_loadu_ps(x + k), _mm512_loadu_ps(x + k + 16)};
}
ALWAYS_INLINE vec step(vec acc, const uint16_t *row, int64_t k, __mmask32 m, xvec x) {
    const __m512i v = _mm512_maskz_loadu_epi16(m, row + k);
    return _mm512_fmadd_ps(bf16_odds(v), x.odd, _mm512_fmadd_ps(bf16_evens(v), x.even, acc));
}
ALWAYS_INLINE void prepare_row(const uint16_t *x, int64_t K, int64_t width, row_t *dst) {
    for (int64_t k = 0; k < width; k++)
        dst[(k / 32) * 32 + (k % 2) * 16 + (k % 32) / 2] = k < K ? bf16_to_float(x[k]) : 0.0f;
}
#define REDUCE sum16

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ISA "avx2"
#define LANES 8
#define KSTEP 16
typedef __m256 vec;
typedef float row_t;
typedef struct {
    __m256 even, odd;
} xvec;
/* As for AVX-512F on 8 lanes. AVX2 has no 16-bit masked loads: steps cover
 * K rounded down to 16 (the mask is unused), the rest is summed in scalar. */
ALWAYS_INLINE xvec load_x(const row_t *x, int64_t k) { return (xvec){_mm256_loadu_ps(x + k), _mm256_loadu_ps(x + k + 8)}; }
ALWAYS_INLINE vec step(vec acc, const uint16_t *row, int64_t k, int m, xvec x) {
    (void)m;
    const __m256i v = _mm256_loadu_si256((const __m256i *)(row + k));
    acc = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), x.even, acc);
    return _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u))), x.odd, acc);
}
ALWAYS_INLINE void prepare_row(const uint16_t *x, int64_t K, int64_t width, row_t *dst) {
    const int64_t body = K / 16 * 16;
    (void)width;
    for (int64_t k = 0; k < K; k++)
        dst[k < body ? (k / 16) * 16 + (k % 2) * 8 + (k % 16) / 2 : k] = bf16_to_float(x[k]);
}
/* Lane i of the result = the sum of v[i]'s 8 lanes. */
static inline __m256 sum8(const __m256 v[8]) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
#define REDUCE sum8
#define SCALAR_TAIL 1

#else
#define ISA "portable"
#define PORTABLE 1
typedef float row_t;
ALWAYS_INLINE void prepare_row(const uint16_t *x, int64_t K, int64_t width, row_t *dst) {
    (void)width;
    for (int64_t k = 0; k < K; k++) dst[k] = bf16_to_float(x[k]);
}
#endif

const char *octavo_bf16_linear_isa(void) { return ISA; }

/* Width of a prepared row: K rounded up to whole vector steps (AVX2 and plain C: K). */
static int64_t prepared_width(int64_t K) {
#if defined(PORTABLE) || defined(SCALAR_TAIL)
    return K;
#else
    return (K + KSTEP - 1) / KSTEP * KSTEP;
#endif
}

#ifndef PORTABLE
/* The mask of a step's k's below K (AVX2 steps never pass K: its tail is summed in scalar). */
#ifdef SCALAR_TAIL
#define STEP_MASK(K, k) 0
#else
#define STEP_MASK(K, k) ((K) - (k) >= 32 ? (__mmask32)~0u : (__mmask32)((1ull << ((K) - (k))) - 1))
#endif

/* Outputs n0..n0+BO-1 of rows m0..m0+BR-1 (float32 sums, no bias) into
 * sums[r * BO + o]. Outputs past N read the weight's last row (never stored). */
ALWAYS_INLINE void tile(const int BO, const int BR, const row_t *xs, int64_t width, const uint16_t *w, int64_t m0,
                        int64_t n0, int64_t N, int64_t K, float *sums) {
    vec acc[LANES];
    const uint16_t *rows[LANES];
    const row_t *xr[LANES];
    for (int i = 0; i < LANES; i++) acc[i] = (vec){0};
    for (int o = 0; o < BO; o++) rows[o] = w + min64(n0 + o, N - 1) * K;
    for (int r = 0; r < BR; r++) xr[r] = xs + (m0 + r) * width;
    const char *next = (const char *)(w + (n0 + BO) * K);
#ifdef SCALAR_TAIL
    const int64_t body = K / KSTEP * KSTEP;
#else
    const int64_t body = K;
#endif
    if (BR == 1) {
        /* One row (batch-1 decode): the tile's weight rows one after another, so the weights are read as
         * one sequential run the hardware prefetcher follows, no software prefetch. The same sums in the
         * same order as the interleaved loop below, 1.2-1.3x faster: Qwen3-30B-A3B's 8 experts of a token
         * (gate/up and down) at 15.7-19.4 GB/s interleaved, 20.8-25.9 in turn, a 32000 x 2048 output
         * layer 16.8 against 20.6 (avx512_bf16 on a Zen 4 EPYC, one thread, CPU time, loaded). At 2 and 4
         * rows the interleaved loop, whose weight loads serve every row, was as fast or faster. */
        for (int o = 0; o < BO; o++)
            for (int64_t k = 0; k < body; k += KSTEP)
                acc[o] = step(acc[o], rows[o], k, STEP_MASK(K, k), load_x(xr[0], k));
    } else {
        for (int64_t k = 0; k < body; k += KSTEP) {
            prefetch_lines(next + k * 2 * BO, KSTEP * 2 * BO);
            xvec x[LANES];
            for (int r = 0; r < BR; r++) x[r] = load_x(xr[r], k);
            for (int o = 0; o < BO; o++)
                for (int r = 0; r < BR; r++)
                    acc[r * BO + o] = step(acc[r * BO + o], rows[o], k, STEP_MASK(K, k), x[r]);
        }
    }
    float lanes[LANES] __attribute__((aligned(64)));
    const vec total = REDUCE(acc);
    memcpy(lanes, &total, sizeof lanes);
    for (int r = 0; r < BR; r++)
        for (int o = 0; o < BO; o++) {
            float s = lanes[r * BO + o];
#ifdef SCALAR_TAIL
            for (int64_t k = body; k < K; k++) s += bf16_to_float(rows[o][k]) * xr[r][k];
#endif
            sums[r * BO + o] = s;
        }
}
#endif

/* Rows m0..m0+rows-1 times outputs n0..n0+BO-1 (those below N) with the bias,
 * rounded to bf16. */
ALWAYS_INLINE void store_tile(const float *sums, int BO, int64_t rows, const uint16_t *bias, int64_t m0, int64_t n0,
                              int64_t N, uint16_t *out) {
    for (int o = 0; o < BO && n0 + o < N; o++) {
        const float b = bias ? bf16_to_float(bias[n0 + o]) : 0.0f;
        for (int64_t r = 0; r < rows; r++) out[(m0 + r) * N + n0 + o] = float_to_bf16(sums[r * BO + o] + b);
    }
}

#ifdef PORTABLE
#define BO_FOR(M) 8
#else
/* One row: a whole register of outputs; two: half each; more: 4 x 4. */
#define BO_FOR(M) ((M) == 1 ? LANES : (M) == 2 ? LANES / 2 : 4)
#endif

/* Every row of outputs n0..n0+BO-1. */
static void output_block(const row_t *xs, int64_t width, const uint16_t *w, const uint16_t *bias, int64_t M,
                         int64_t K, int64_t N, int64_t n0, uint16_t *out) {
    float sums[LANES_MAX];
#ifdef PORTABLE
    for (int64_t m = 0; m < M; m++) {
        for (int o = 0; o < 8 && n0 + o < N; o++) {
            const uint16_t *row = w + (n0 + o) * K;
            const row_t *x = xs + m * width;
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int64_t k = 0; k < K; k++) s += bf16_to_float(row[k]) * x[k];
            sums[o] = s;
        }
        store_tile(sums, 8, 1, bias, m, n0, N, out);
    }
#else
    if (M == 1) {
        tile(LANES, 1, xs, width, w, 0, n0, N, K, sums);
        store_tile(sums, LANES, 1, bias, 0, n0, N, out);
    } else if (M == 2) {
        tile(LANES / 2, 2, xs, width, w, 0, n0, N, K, sums);
        store_tile(sums, LANES / 2, 2, bias, 0, n0, N, out);
    } else {
        const int BR = LANES / 4;
        for (int64_t m0 = 0; m0 < M; m0 += BR) {
            const int64_t rows = min64(BR, M - m0);
            switch (rows) { /* a constant per copy: the tile's loops unroll into registers */
            case 1: tile(4, 1, xs, width, w, m0, n0, N, K, sums); break;
            case 2: tile(4, 2, xs, width, w, m0, n0, N, K, sums); break;
#if LANES == 16
            case 3: tile(4, 3, xs, width, w, m0, n0, N, K, sums); break;
#endif
            default: tile(4, BR, xs, width, w, m0, n0, N, K, sums); break;
            }
            store_tile(sums, 4, rows, bias, m0, n0, N, out);
        }
    }
#endif
}

/* out[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]), all bf16 and contiguous.
 * Returns 0, or -1 when the prepared rows cannot be allocated. */
int octavo_bf16_linear(const uint16_t *x, const uint16_t *w, const uint16_t *bias, int64_t M, int64_t K, int64_t N,
                       uint16_t *out) {
    const int64_t width = prepared_width(K);
    row_t *xs = malloc((size_t)(M * width) * sizeof(row_t));
    if (xs == NULL) return -1;
    for (int64_t m = 0; m < M; m++) prepare_row(x + m * K, K, width, xs + m * width);
    const int64_t bo = BO_FOR(M), blocks = (N + bo - 1) / bo;
#pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < blocks; nb++) output_block(xs, width, w, bias, M, K, N, nb * bo, out);
    free(xs);
    return 0;
}

/* A mixture of experts' products at decode, every chosen expert in one call: out[m] = x[m] @
 * w[experts[m]]^T, w the experts' weights stacked [E, N, K] (bf16, contiguous). One call instead of
 * one per expert keeps a call's Python and thread start-up per expert off a step that only reads
 * weights; the threads split the chosen experts' outputs between them, 16 at a time, so only those
 * experts' bytes are read. Rows of one expert next to each other (the caller sorts them by expert)
 * are one run, each weight load shared by up to 4 of them and the weights read from memory once for
 * all of them (the run's further rows re-read a tile's few weight rows from L1). Returns 0, or -1 when
 * the buffers cannot be allocated. */
int octavo_bf16_linear_experts(const uint16_t *x, const uint16_t *w, const int64_t *experts, int64_t M, int64_t K,
                               int64_t N, uint16_t *out) {
    const int64_t width = prepared_width(K);
    row_t *xs = malloc((size_t)(M * width) * sizeof(row_t));
    int64_t *starts = malloc((size_t)(M > 0 ? M : 1) * sizeof(int64_t));
    if (xs == NULL || starts == NULL) {
        free(xs);
        free(starts);
        return -1;
    }
    for (int64_t m = 0; m < M; m++) prepare_row(x + m * K, K, width, xs + m * width);
    /* One run per expert; run j is rows starts[j] .. starts[j + 1] - 1. A run cut every 4 rows read an
     * expert's weights from memory once per 4 rows: Qwen3-30B-A3B's 8 experts at 8 / 16 / 32 rows each
     * took 6.3 / 9.8 / 18.2 ms cut, 5.1 / 8.2 / 16.3 whole (avx512_bf16 on a Zen 4 EPYC, one thread, CPU
     * time, loaded). */
    int64_t runs = 0;
    for (int64_t m = 0; m < M; m++)
        if (m == 0 || experts[m] != experts[m - 1]) starts[runs++] = m;
    const int64_t blocks = (N + LANES_MAX - 1) / LANES_MAX;
#pragma omp parallel for schedule(static)
    for (int64_t item = 0; item < runs * blocks; item++) {
        const int64_t j = item / blocks, r0 = starts[j], rows = (j + 1 < runs ? starts[j + 1] : M) - r0;
        const int64_t n0 = item % blocks * LANES_MAX, bo = BO_FOR(rows);
        for (int64_t n = n0; n < n0 + LANES_MAX && n < N; n += bo)
            output_block(xs + r0 * width, width, w + experts[r0] * N * K, NULL, rows, K, N, n, out + r0 * N);
    }
    free(starts);
    free(xs);
    return 0;
}
