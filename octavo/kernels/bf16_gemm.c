/* bf16 linear layers for many rows (batched decode, prefill) on CPUs without
 * AMX: out[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]), bf16 in and out, float32
 * sums, on the plain row-major weight the model holds (no second copy).
 *
 * Many rows make the product compute-bound, so this is a register-blocked
 * GEMM in the BLIS manner, laid out so that nothing large is transposed:
 * vector lanes run over ROWS (LANES of them per register, RV registers per
 * micro-tile) and each of the micro-tile's MO outputs is a broadcast weight
 * element. The rows are rearranged once per call into that layout ("packed
 * x": per block of rows, step by step, the rows side by side); the weight is
 * read as it is, MO output rows at a time, copied (as float32 bits, or as
 * bf16 pairs) into a small per-thread panel whose row stride avoids the L1
 * set conflicts of a power-of-two K. A micro-tile does MO x RV vector
 * products per step with no horizontal sums; only its store transposes the
 * (rows x outputs) tile, LANES x LANES at a time in registers, once per tile.
 * (Lanes over outputs instead would need every weight panel transposed per
 * call, ~4/M of the arithmetic in shuffles; this way the transposes are
 * ~8/K of it, and the weight copy is a plain one.)
 *
 * Cache blocking: K is cut into blocks of at most KC_MAX k's (partial sums of
 * a tile wait in a per-thread float32 buffer between blocks) and rows into
 * chunks whose packed x fits X_BUDGET bytes (kept in L2 while up to NC
 * panels of outputs sweep it). Threads take such groups of panels as they
 * come free.
 *
 * Two kinds of step ("flavours"):
 *   FLOAT: a step is one k; rows and panel hold float32 bits (bf16 is the top
 *          half of a float32); vfmadd with the broadcast weight. Every target:
 *          AVX-512F (16 lanes), AVX2 + FMA (8 lanes, 16 registers: smaller
 *          tiles), anything else GCC vector extensions (NEON, SSE, scalar).
 *   DOT:   a step is a (k, k+1) pair of bf16; vdpbf16ps of the rows' pairs
 *          with the output's broadcast pair. AVX-512 BF16 builds only.
 * Both exist on AVX-512 BF16 builds because which is faster depends on the
 * CPU: on a Sapphire Rapids core with AMX off, FLOAT ran at ~1.7x DOT's
 * products per second (vdpbf16ps issues at half vfmadd's rate there), where
 * CPUs with full-rate vdpbf16ps reverse that; the measured table (octavo/quant/linear_table.py) decides.
 * Products of the same bf16 inputs are exact in float32 in both; only the
 * summation order differs (from each other and from torch's). Results are
 * rounded to bf16 to nearest even, as torch rounds. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "common.h"

/* k's per K block, bytes of packed x per row chunk, output panels a thread
 * sweeps over one row chunk (sized for a 48 KiB L1 and a 1-2 MiB L2; K
 * blocks of 256 to 1024 measured alike). */
#ifndef KC_MAX
#define KC_MAX 1024
#endif
#ifndef X_BUDGET
#define X_BUDGET (512 * 1024)
#endif
#ifndef NC
#define NC 16
#endif

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
static inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

enum { FLOAT = 0, DOT = 1 };
typedef uint32_t el_t; /* float32 bits (FLOAT) or a bf16 pair, low half the even k (DOT) */

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define AVX512_STORE 1
#define LANES 16
/* Tiles: 12 outputs x 16 rows for up to 16 rows, else 5 outputs x 64 rows
 * (20 accumulators: measured on Sapphire Rapids with AMX off, float32 steps,
 * 1.25x the products/s of 6 x 64 or 24 x 16, matching torch's float32 mm). */
#ifndef MO_SMALL
#define MO_SMALL 12
#endif
#ifndef MO_BIG
#define MO_BIG 5
#endif
#ifndef RV_BIG
#define RV_BIG 4
#endif
typedef __m512 vec;
typedef __m512i xvec;
ALWAYS_INLINE xvec xload(const el_t *p) { return _mm512_loadu_si512((const void *)p); }
ALWAYS_INLINE vec vload(const float *p) { return _mm512_loadu_ps(p); }
ALWAYS_INLINE void vstore(float *p, vec v) { _mm512_storeu_ps(p, v); }
ALWAYS_INLINE vec madd_float(vec acc, xvec x, el_t w) {
    return _mm512_fmadd_ps(_mm512_castsi512_ps(x), _mm512_castsi512_ps(_mm512_set1_epi32((int)w)), acc);
}
#if defined(__AVX512BF16__)
#define ISA "avx512_bf16"
#define HAVE_DOT 1
ALWAYS_INLINE vec madd_dot(vec acc, xvec x, el_t w) {
    return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)_mm512_set1_epi32((int)w));
}
ALWAYS_INLINE __m256i narrow16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
#else
#define ISA "avx512"
/* Round to nearest even, NaN kept quiet, as common.h's float_to_bf16, 16 at a time. */
ALWAYS_INLINE __m256i narrow16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, quiet));
}
#endif

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ISA "avx2"
#define AVX2_STORE 1
#define LANES 8
/* 16 registers: 12 accumulators (12 outputs x 8 rows, or 6 x 16). */
#ifndef MO_SMALL
#define MO_SMALL 12
#endif
#ifndef MO_BIG
#define MO_BIG 5
#endif
#ifndef RV_BIG
#define RV_BIG 2
#endif
typedef __m256 vec;
typedef __m256 xvec;
ALWAYS_INLINE xvec xload(const el_t *p) { return _mm256_loadu_ps((const float *)p); }
ALWAYS_INLINE vec vload(const float *p) { return _mm256_loadu_ps(p); }
ALWAYS_INLINE void vstore(float *p, vec v) { _mm256_storeu_ps(p, v); }
ALWAYS_INLINE vec madd_float(vec acc, xvec x, el_t w) {
    return _mm256_fmadd_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32((int)w)), acc);
}

#else
#define ISA "portable"
/* 128-bit vectors: what NEON and baseline x86 (SSE2) have. */
#define LANES 4
#define MO_SMALL 8
#define MO_BIG 8
#define RV_BIG 2
typedef float vec __attribute__((vector_size(16)));
typedef vec xvec;
ALWAYS_INLINE vec vload(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}
ALWAYS_INLINE xvec xload(const el_t *p) { return vload((const float *)p); }
ALWAYS_INLINE void vstore(float *p, vec v) { memcpy(p, &v, sizeof v); }
ALWAYS_INLINE vec madd_float(vec acc, xvec x, el_t w) {
    float f;
    memcpy(&f, &w, sizeof f);
    return acc + x * f;
}
#endif

#ifdef HAVE_DOT
ALWAYS_INLINE vec madd(int flavour, vec acc, xvec x, el_t w) {
    return flavour == DOT ? madd_dot(acc, x, w) : madd_float(acc, x, w);
}
#else
ALWAYS_INLINE vec madd(int flavour, vec acc, xvec x, el_t w) {
    (void)flavour;
    return madd_float(acc, x, w);
}
#endif

const char *octavo_bf16_gemm_isa(void) { return ISA; }

/* ---- rows and weights into the layouts the tile reads ---- */

ALWAYS_INLINE int64_t kstep(int flavour) { return flavour == DOT ? 2 : 1; }

/* Step s of a row of K bf16 (zero past K). */
ALWAYS_INLINE el_t element(int flavour, const uint16_t *row, int64_t s, int64_t K) {
    if (flavour == FLOAT) return s < K ? (uint32_t)row[s] << 16 : 0;
    const int64_t k = 2 * s;
    const uint32_t lo = k < K ? row[k] : 0, hi = k + 1 < K ? row[k + 1] : 0;
    return lo | hi << 16;
}

/* Steps s0..s0+n of a weight row into dst. */
ALWAYS_INLINE void panel_row(int flavour, const uint16_t *row, int64_t s0, int64_t n, int64_t K, el_t *dst) {
    if (flavour == FLOAT) {
        const int64_t whole = min64(n, max64(0, K - s0));
        const uint16_t *src = row + s0;
#pragma omp simd
        for (int64_t s = 0; s < whole; s++) dst[s] = (uint32_t)src[s] << 16;
        for (int64_t s = whole; s < n; s++) dst[s] = 0;
    } else {
        const int64_t whole = min64(n, max64(0, K / 2 - s0));
        memcpy(dst, row + 2 * s0, (size_t)whole * 4);
        for (int64_t s = whole; s < n; s++) dst[s] = element(DOT, row, s0 + s, K);
    }
}

/* ---- storing a finished tile: transposed to rows, bias added, rounded ---- */

#ifdef AVX512_STORE
/* t[i] lane j <- t[j] lane i. */
ALWAYS_INLINE void transpose16(__m512 t[16]) {
    __m512 a[16], b[16];
    for (int i = 0; i < 8; i++) { /* per 128-bit lane L: rows 2i, 2i+1 at columns 4L, 4L+1 / 4L+2, 4L+3 */
        a[2 * i] = _mm512_unpacklo_ps(t[2 * i], t[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_ps(t[2 * i], t[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* b[4i + c] lane L: column 4L + c, rows 4i..4i+3 */
        const __m512d p = _mm512_castps_pd(a[4 * i]), q = _mm512_castps_pd(a[4 * i + 2]);
        const __m512d r = _mm512_castps_pd(a[4 * i + 1]), s = _mm512_castps_pd(a[4 * i + 3]);
        b[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(p, q));
        b[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(p, q));
        b[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(r, s));
        b[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(r, s));
    }
    for (int c = 0; c < 4; c++) { /* column 4L + c: lane L of b[c], b[4 + c], b[8 + c], b[12 + c] */
        const __m512 e0 = _mm512_shuffle_f32x4(b[c], b[4 + c], 0x88), e1 = _mm512_shuffle_f32x4(b[c], b[4 + c], 0xDD);
        const __m512 f0 = _mm512_shuffle_f32x4(b[8 + c], b[12 + c], 0x88);
        const __m512 f1 = _mm512_shuffle_f32x4(b[8 + c], b[12 + c], 0xDD);
        t[c] = _mm512_shuffle_f32x4(e0, f0, 0x88);
        t[4 + c] = _mm512_shuffle_f32x4(e1, f1, 0x88);
        t[8 + c] = _mm512_shuffle_f32x4(e0, f0, 0xDD);
        t[12 + c] = _mm512_shuffle_f32x4(e1, f1, 0xDD);
    }
}

#define TRANSPOSE transpose16
/* Steps s0..s0+15 of a row, as the tile reads them. */
ALWAYS_INLINE __m512 load_steps(int flavour, const uint16_t *row, int64_t s0) {
    if (flavour == DOT) return _mm512_castsi512_ps(_mm512_loadu_si512((const void *)(row + 2 * s0)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(row + s0))), 16));
}

/* t[o] = output o's sums for LANES rows: rows < rows, outputs < count
 * stored (row r at out + r * N) with the bias, as bf16. */
ALWAYS_INLINE void store_block(__m512 t[16], const uint16_t *bias, int64_t count, int64_t rows, uint16_t *out,
                               int64_t N) {
    transpose16(t);
    const __mmask16 m = (__mmask16)((1u << count) - 1);
    const __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, bias)), 16))
                          : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; r++) _mm256_mask_storeu_epi16(out + r * N, m, narrow16(_mm512_add_ps(t[r], b)));
}
#elif defined(AVX2_STORE)
ALWAYS_INLINE void transpose8(__m256 t[8]) {
    __m256 a[8], b[8];
    for (int i = 0; i < 4; i++) {
        a[2 * i] = _mm256_unpacklo_ps(t[2 * i], t[2 * i + 1]);
        a[2 * i + 1] = _mm256_unpackhi_ps(t[2 * i], t[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        const __m256d p = _mm256_castps_pd(a[4 * i]), q = _mm256_castps_pd(a[4 * i + 2]);
        const __m256d r = _mm256_castps_pd(a[4 * i + 1]), s = _mm256_castps_pd(a[4 * i + 3]);
        b[4 * i] = _mm256_castpd_ps(_mm256_unpacklo_pd(p, q));
        b[4 * i + 1] = _mm256_castpd_ps(_mm256_unpackhi_pd(p, q));
        b[4 * i + 2] = _mm256_castpd_ps(_mm256_unpacklo_pd(r, s));
        b[4 * i + 3] = _mm256_castpd_ps(_mm256_unpackhi_pd(r, s));
    }
    for (int c = 0; c < 4; c++) {
        t[c] = _mm256_permute2f128_ps(b[c], b[4 + c], 0x20);
        t[4 + c] = _mm256_permute2f128_ps(b[c], b[4 + c], 0x31);
    }
}

#define TRANSPOSE transpose8
ALWAYS_INLINE __m256 load_steps(int flavour, const uint16_t *row, int64_t s0) {
    (void)flavour; /* FLOAT only */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(row + s0))), 16));
}

/* As narrow16, 8 at a time. */
ALWAYS_INLINE __m128i narrow8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    const __m256i r = _mm256_blendv_epi8(rounded, quiet, nan);
    /* The values fit 16 bits, so the saturating pack keeps them; then the two 128-bit halves' low quads together. */
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
}

ALWAYS_INLINE void store_block(__m256 t[8], const uint16_t *bias, int64_t count, int64_t rows, uint16_t *out,
                               int64_t N) {
    transpose8(t);
    uint16_t tmp[8] = {0};
    __m256 b = _mm256_setzero_ps();
    if (bias) {
        memcpy(tmp, bias, (size_t)count * 2);
        b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)tmp)), 16));
    }
    for (int64_t r = 0; r < rows; r++) {
        const __m128i h = narrow8(_mm256_add_ps(t[r], b));
        if (count == 8) {
            _mm_storeu_si128((__m128i *)(out + r * N), h);
        } else {
            _mm_storeu_si128((__m128i *)tmp, h);
            memcpy(out + r * N, tmp, (size_t)count * 2);
        }
    }
}
#else
ALWAYS_INLINE void store_block(vec t[LANES], const uint16_t *bias, int64_t count, int64_t rows, uint16_t *out,
                               int64_t N) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t o = 0; o < count; o++)
            out[r * N + o] = float_to_bf16(t[o][r] + (bias ? bf16_to_float(bias[o]) : 0.0f));
}
#endif

/* Rows m0..m0+R-1 of x (zero past M) as steps x R lanes: LANES rows x LANES
 * steps at a time loaded, widened and transposed in registers, the K tail
 * one element at a time. */
ALWAYS_INLINE void pack_rows(int flavour, const uint16_t *x, int64_t M, int64_t K, int64_t m0, int64_t R,
                             int64_t steps, el_t *dst) {
    int64_t done = 0;
#ifdef TRANSPOSE
    done = (flavour == DOT ? K / 2 : K) / LANES * LANES;
    for (int64_t v = 0; v < R / LANES; v++)
        for (int64_t s0 = 0; s0 < done; s0 += LANES) {
            vec t[LANES];
            for (int r = 0; r < LANES; r++) {
                const int64_t m = m0 + v * LANES + r;
                t[r] = m < M ? load_steps(flavour, x + m * K, s0) : (vec){0};
            }
            TRANSPOSE(t);
            for (int j = 0; j < LANES; j++) vstore((float *)(dst + (s0 + j) * R + v * LANES), t[j]);
        }
#endif
    for (int64_t r = 0; r < R; r++) {
        el_t *col = dst + r;
        const uint16_t *row = x + (m0 + r) * K;
        for (int64_t s = done; s < steps; s++) col[s * R] = m0 + r < M ? element(flavour, row, s, K) : 0;
    }
}

/* ---- the micro-tile ---- */

/* Where a tile's result goes: rows row0.. (below M) of outputs n0.. (below N). */
typedef struct {
    uint16_t *out;
    const uint16_t *bias;
    int64_t M, N, row0, n0;
} Dest;

/* The next panel's weights, fetched into L2 while this tile computes:
 * copying a panel otherwise waits on memory (a decode batch's weights come
 * from DRAM or L3 once per step), and at 8-32 rows that wait is most of
 * the product. Measured on 2 cores of an Emerald Rapids
 * without AMX, llama-100m's 49 matrices, calls interleaved: 5-15% less time
 * at 8-128 rows, none lost at 256 and more. */
typedef struct {
    const uint16_t *w; /* the next panel's first weight row at its K block (NULL: none) */
    int64_t K, rows, lines; /* row stride (elements), rows, cache lines per row */
} Prefetch;

/* MO outputs x RV * LANES rows over `steps` steps: xb is the row block's
 * packed x at the K block's first step (RV * LANES lanes a step), wb the
 * panel (MO rows of stride ws). first: start from zero, else from the
 * partial sums in cb; last: store to d, else leave the sums in cb; pf:
 * the next panel to fetch. */
ALWAYS_INLINE void tile(const int flavour, const int MO, const int RV, const el_t *xb, const el_t *wb, int64_t ws,
                        int64_t steps, int first, int last, float *cb, Dest d, Prefetch pf) {
    /* Spread over the tile's steps: a burst at its start measured 4-9% slower at 48-64 rows. */
    const int64_t pf_lines = pf.w ? pf.rows * pf.lines : 0;
    const int64_t pf_stride = pf_lines && steps > pf_lines ? steps / pf_lines : 1;
    int64_t pf_i = 0, pf_next = 0;
    /* Fixed sizes: MO and RV are constants only after inlining; arrays sized
     * by them would be VLAs, kept in memory instead of registers. */
    vec acc[MO_SMALL > MO_BIG * RV_BIG ? MO_SMALL : MO_BIG * RV_BIG];
#pragma GCC unroll 32
    for (int i = 0; i < MO * RV; i++) acc[i] = first ? (vec){0} : vload(cb + i * LANES);
    for (int64_t s = 0; s < steps; s++) {
        if (s == pf_next && pf_i < pf_lines) {
            __builtin_prefetch((const char *)(pf.w + (pf_i / pf.lines) * pf.K) + (pf_i % pf.lines) * 64, 0, 2);
            pf_i++;
            pf_next += pf_stride;
        }
        xvec x[RV_BIG];
#pragma GCC unroll 8
        for (int v = 0; v < RV; v++) x[v] = xload(xb + (s * RV + v) * LANES);
#pragma GCC unroll 32
        for (int o = 0; o < MO; o++) {
            const el_t w = wb[o * ws + s];
#pragma GCC unroll 8
            for (int v = 0; v < RV; v++) acc[o * RV + v] = madd(flavour, acc[o * RV + v], x[v], w);
        }
    }
    if (!last) {
#pragma GCC unroll 32
        for (int i = 0; i < MO * RV; i++) vstore(cb + i * LANES, acc[i]);
        return;
    }
    for (int v = 0; v < RV; v++) {
        const int64_t r0 = d.row0 + v * LANES, rows = min64(LANES, d.M - r0);
        if (rows <= 0) break;
        for (int c = 0; c < MO; c += LANES) {
            const int64_t count = min64(min64(LANES, MO - c), d.N - d.n0 - c);
            if (count <= 0) break;
            vec t[LANES];
            for (int i = 0; i < LANES; i++) t[i] = c + i < MO ? acc[(c + i) * RV + v] : (vec){0};
            store_block(t, d.bias ? d.bias + d.n0 + c : NULL, count, rows, d.out + r0 * d.N + d.n0 + c, d.N);
        }
    }
}

/* One row block (rv registers of rows; the last block may be short) with
 * the call's tile shape: a constant per copy, so the tile unrolls into registers. */
ALWAYS_INLINE void row_block(const int flavour, int small, int rv, const el_t *xb, const el_t *wb, int64_t ws,
                             int64_t steps, int first, int last, float *cb, Dest d, Prefetch pf) {
    if (small) {
        tile(flavour, MO_SMALL, 1, xb, wb, ws, steps, first, last, cb, d, pf);
        return;
    }
    switch (rv) {
    case 1: tile(flavour, MO_BIG, 1, xb, wb, ws, steps, first, last, cb, d, pf); break;
#if RV_BIG > 2
    case 2: tile(flavour, MO_BIG, 2, xb, wb, ws, steps, first, last, cb, d, pf); break;
#endif
#if RV_BIG > 3
    case 3: tile(flavour, MO_BIG, 3, xb, wb, ws, steps, first, last, cb, d, pf); break;
#endif
#if RV_BIG > 4
    case 4: tile(flavour, MO_BIG, 4, xb, wb, ws, steps, first, last, cb, d, pf); break;
#endif
#if RV_BIG > 5
    case 5: tile(flavour, MO_BIG, 5, xb, wb, ws, steps, first, last, cb, d, pf); break;
#endif
#if RV_BIG > 6
#error "RV_BIG above 6: add the shorter tiles above"
#endif
    default: tile(flavour, MO_BIG, RV_BIG, xb, wb, ws, steps, first, last, cb, d, pf); break;
    }
}

/* ---- buffers: grown as needed, kept per thread (OpenMP's threads persist) ---- */

typedef struct {
    void *p;
    size_t size;
} Buffer;

static void *grow(Buffer *b, size_t size) {
    if (size > b->size) {
        free(b->p);
        b->p = aligned_alloc(64, (size + 63) / 64 * 64);
        b->size = b->p ? size : 0;
    }
    return b->p;
}

static _Thread_local Buffer packed_x, panel, partial;

/* Packed x above this is freed after the call (a long prompt's prefill):
 * allocating it anew costs little next to such a product, keeping it would
 * hold that memory for the life of the thread. */
#define KEEP_PACKED_MAX (8u << 20)

static void release(Buffer *b) {
    free(b->p);
    b->p = NULL;
    b->size = 0;
}

/* Lanes of row block b: R, or the last block's rows rounded up to whole registers. */
static int64_t block_lanes(int64_t b, int64_t R, int64_t M) { return min64(R, cdiv(M - b * R, LANES) * LANES); }

/* out[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]), all bf16 and contiguous.
 * Returns 0, or -1 when a buffer cannot be allocated. */
ALWAYS_INLINE int gemm(const int flavour, const uint16_t *x, const uint16_t *w, const uint16_t *bias, int64_t M,
                       int64_t K, int64_t N, uint16_t *out) {
    const int small = M <= LANES;
    const int64_t mo = small ? MO_SMALL : MO_BIG, R = small ? LANES : (int64_t)RV_BIG * LANES;
    const int64_t steps = cdiv(K, kstep(flavour)), blocks = cdiv(M, R);
    const int64_t kblocks = cdiv(steps, KC_MAX / kstep(flavour)), kc = cdiv(steps, kblocks);
    /* Row blocks per chunk: its packed x within X_BUDGET. */
    const int64_t chunk = max64(1, X_BUDGET / (R * kc * (int64_t)sizeof(el_t)));
    /* Panel row stride: one cache line past a whole number of lines, so the MO rows fall in different L1 sets. */
    const int64_t line = 64 / (int64_t)sizeof(el_t), ws = cdiv(kc, line) * line + line;
    const int64_t panels = cdiv(N, mo);
    el_t *xp = grow(&packed_x, (size_t)(blocks * R * steps) * sizeof(el_t));
    if (xp == NULL) return -1;
    int failed = 0;
#ifdef _OPENMP
    const int64_t threads = omp_get_max_threads();
#else
    const int64_t threads = 1;
#endif
    /* Groups of up to NC panels, handed to threads as they come free (one
     * held up by the OS delays a group, not a fixed share); at least ~4 a
     * thread where N allows. */
    const int64_t group = max64(1, min64(NC, cdiv(panels, 4 * threads))), groups = cdiv(panels, group);
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++)
            pack_rows(flavour, x, M, K, b * R, block_lanes(b, R, M), steps, xp + b * R * steps);
        el_t *wb = grow(&panel, (size_t)(mo * ws) * sizeof(el_t));
        float *cb = kblocks > 1 ? grow(&partial, (size_t)(NC * chunk * R * mo) * sizeof(float)) : NULL;
        const int ok = wb != NULL && (kblocks == 1 || cb != NULL);
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t c = 0; c < groups; c++) {
            const int64_t pc = c * group, pe = min64(pc + group, panels);
            for (int64_t b0 = 0; ok && b0 < blocks; b0 += chunk)
                for (int64_t kb = 0; kb < kblocks; kb++) {
                    const int64_t s0 = kb * kc, sn = min64(kc, steps - s0);
                    for (int64_t p = pc; p < pe; p++) {
                        const int64_t n0 = p * mo;
                        for (int64_t o = 0; o < mo; o++) {
                            if (n0 + o < N)
                                panel_row(flavour, w + (n0 + o) * K, s0, sn, K, wb + o * ws);
                            else
                                memset(wb + o * ws, 0, (size_t)sn * sizeof(el_t));
                        }
                        for (int64_t b = b0; b < min64(b0 + chunk, blocks); b++) {
                            /* A short last block is packed `lanes` wide (pack_rows). */
                            const int64_t lanes = block_lanes(b, R, M);
                            float *sums = cb ? cb + ((p - pc) * chunk + (b - b0)) * R * mo : NULL;
                            const Dest d = {out, bias, M, N, b * R, n0};
                            const int64_t next = n0 + mo;
                            const Prefetch pf = {b == b0 && p + 1 < pe ? w + next * K + s0 * kstep(flavour) : NULL, K,
                                                 min64(mo, N - next), cdiv(sn * kstep(flavour) * 2, 64)};
                            row_block(flavour, small, (int)(lanes / LANES), xp + b * R * steps + s0 * lanes, wb, ws,
                                      sn, kb == 0, kb == kblocks - 1, sums, d, pf);
                        }
                    }
                }
        }
    }
    if (packed_x.size > KEEP_PACKED_MAX) release(&packed_x);
    return failed ? -1 : 0;
}

int octavo_bf16_gemm(const uint16_t *x, const uint16_t *w, const uint16_t *bias, int64_t M, int64_t K, int64_t N,
                     uint16_t *out) {
    return gemm(FLOAT, x, w, bias, M, K, N, out);
}

#ifdef HAVE_DOT
const char *octavo_bf16_gemm_dot_isa(void) { return ISA; }

int octavo_bf16_gemm_dot(const uint16_t *x, const uint16_t *w, const uint16_t *bias, int64_t M, int64_t K, int64_t N,
                         uint16_t *out) {
    return gemm(DOT, x, w, bias, M, K, N, out);
}
#endif
