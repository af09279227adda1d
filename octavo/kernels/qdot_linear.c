/* Linear layers with int8 or int4 weights at few rows (decode) by integer
 * dot products: each row is rounded to 8 bits per block of 32 inputs
 * exactly as llama.cpp's Q8_0 rounds its activations (its reference
 * quantize_row_q8_0), then the weights' integers multiply the row's.
 *
 * At one row quant_linear.c's float path is bound by widening every weight
 * to float32 (one conversion and one FMA per 16 weights); here one
 * vpdpbusd does 64 multiply-adds on the bytes as they are.
 *
 * Row rounding, per block b of 32 inputs:
 *   d_b  = max |x| / 127, kept as float16 (llama.cpp stores it so)
 *   xq_k = roundf(x_k * (d_b ? 1 / d_b : 0)) (the 1 / d of the float32 d_b;
 *          roundf: halves away from zero), in -127..127
 * and the product, per output n, with the weight's groups g (scale s, min m,
 * a group a whole number of blocks):
 *   out = sum_g s_g * sum_{b in g} d_b * isum(q, xq)_b + m_g * sum_{b in g} d_b * isum(xq)_b
 * isum exact in int32, the rest in float32 (FMAs on VNNI and AVX2: the
 * tests' reference does the same sums in float64, within float32 rounding).
 *
 * Weights: quant_linear.c's layout, read as it is (no second copy):
 *   int8: w[N/16][K][16]; int4: w[N/16][K/2][16], byte q[k] | q[k + 1] << 4;
 *   scales, mins: [N/16][G][16] float32.
 * Four 16-byte rows of it (4 k's of int8, 8 of int4) are one 64-byte load;
 * a byte transpose turns it into 16 dwords, one output's 4 bytes each, the
 * operand vpdpbusd wants. int4's dword then holds the nibbles of k0..k7:
 * its low nibbles are k0, k2, k4, k6 and its high ones k1, k3, k5, k7, so
 * the rounded row is stored in that order for int4 (per 8 inputs).
 *
 * One source, the instruction set chosen by the compiler's target:
 *   AVX-512 VNNI (the amx and avx512_bf16 targets): vpdpbusd, unsigned
 *     weight bytes times signed row bytes; int4's 0..15 are unsigned as
 *     they are, int8's get + 128 (an xor) and 128 * isum(xq) comes off.
 *   AVX2 (the avx2 and avx512 targets): vpmaddubsw + vpmaddwd; int8 by the
 *     sign trick (|q| times xq with q's sign: no pair sum saturates 16 bits).
 *   anything else: plain C on the same layout. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "common.h"

#define BLOCK 16    /* outputs per packed block: the layout's */
#define QK 32       /* inputs per rounded activation block: llama.cpp's Q8_0 */
#define MAX_ROWS 4  /* rows sharing each loaded weight vector */
/* Weight bytes asked for ahead into L2 (quant_linear.c measured 8 KiB best
 * for one sequential stream a thread), every line of a block's 512 (int8) or
 * 256 (int4) bytes: asking for one line a block left the weights read from
 * memory at ~0.7 of the float rows' kernel (which asks for every line). */
#define PREFETCH_AHEAD 8192
#define CACHE_LINE 64

/* 16 outputs' sums: GCC/Clang vectors, one zmm (two ymm, four xmm) each, so
 * the per-row accumulators stay in registers on every target. */
typedef float fvec __attribute__((vector_size(BLOCK * sizeof(float))));
typedef int32_t ivec __attribute__((vector_size(BLOCK * sizeof(int32_t))));

ALWAYS_INLINE fvec load_fvec(const float *p) {
    fvec v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The rounded rows, the caller's buffers: xq [M][K] (int4: per 8 inputs in
 * the order 0, 2, 4, 6, 1, 3, 5, 7), d and isum(xq) [M][K/32], and per
 * weight group sum_b d_b * isum(xq)_b [M][G] (the mins' factor). */
typedef struct {
    int8_t *xq;
    float *d;
    int32_t *xsum;
    float *gsum;
} rounded_rows;

ALWAYS_INLINE int64_t stored_at(int bits, int64_t k) {
    if (bits == 8) return k;
    const int64_t i = k % 8;
    return k - i + (i % 2 ? 4 + i / 2 : i / 2);
}

/* Half a block (16 inputs) in the vector types: the rounding runs in vector
 * registers on every target, as fast as the row is read (one element at a
 * time it was ~20 us of a 230 us product at K = 4864, then run once
 * before the threads started). Bit-exact to the scalar rule above: max is exact in any
 * order; truncation, then one away from zero where the exact fraction
 * y - trunc(y) is >= 0.5, is roundf. */
typedef int8_t bvec __attribute__((vector_size(BLOCK)));
#ifdef __clang__
#define SHUFFLE_BYTES(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#else
#define SHUFFLE_BYTES(v, ...) __builtin_shuffle(v, (bvec){__VA_ARGS__})
#endif

ALWAYS_INLINE fvec abs_fvec(fvec v) { return (fvec)((ivec)v & 0x7fffffff); }

ALWAYS_INLINE fvec max_fvec(fvec a, fvec b) {
    const ivec a_larger = a > b;
    return (fvec)(((ivec)a & a_larger) | ((ivec)b & ~a_larger));
}

/* Horizontal max and sum by halving the vector: a lane at a time, the max
 * went through libm's fmaxf (a call per lane, -O3 keeps its NaN rules) and
 * the rounding was ~90 ns a block, ~6 us of a K = 2048 product (which
 * every thread now spends before its share). The max of finite values is
 * the same in any order, and the integer sum is exact. */
typedef float fhalf __attribute__((vector_size(BLOCK * sizeof(float) / 2)));
typedef float fquarter __attribute__((vector_size(BLOCK * sizeof(float) / 4)));
typedef int32_t ihalf __attribute__((vector_size(BLOCK * sizeof(int32_t) / 2)));
typedef int32_t iquarter __attribute__((vector_size(BLOCK * sizeof(int32_t) / 4)));

#define HALVES(T, v, lo, hi) \
    T lo, hi;                \
    memcpy(&lo, &v, sizeof lo); \
    memcpy(&hi, (const char *)&v + sizeof lo, sizeof hi)

ALWAYS_INLINE float max_lanes(fvec v) {
    HALVES(fhalf, v, a, b);
    const ihalf a8 = a > b; /* a true comparison is all ones */
    const fhalf m8 = (fhalf)(((ihalf)a & a8) | ((ihalf)b & ~a8));
    HALVES(fquarter, m8, c, d);
    const iquarter c4 = c > d;
    const fquarter m4 = (fquarter)(((iquarter)c & c4) | ((iquarter)d & ~c4));
    const float m2[2] = {m4[0] > m4[2] ? m4[0] : m4[2], m4[1] > m4[3] ? m4[1] : m4[3]};
    return m2[0] > m2[1] ? m2[0] : m2[1];
}

ALWAYS_INLINE int32_t sum_lanes(ivec v) {
    HALVES(ihalf, v, a, b);
    const ihalf s8 = a + b;
    HALVES(iquarter, s8, c, d);
    const iquarter s4 = c + d;
    return s4[0] + s4[1] + s4[2] + s4[3];
}

ALWAYS_INLINE ivec round_half_away(fvec y) {
    const ivec whole = __builtin_convertvector(y, ivec);
    const fvec fraction = y - __builtin_convertvector(whole, fvec);
    /* a true comparison is -1 */
    return whole - (fraction >= (fvec){0} + 0.5f) + (fraction <= (fvec){0} - 0.5f);
}

static void round_rows(const void *x, int dtype, int64_t M, int64_t K, int64_t group, int bits, float *row,
                       rounded_rows rr) {
    const int64_t B = K / QK, G = K / group;
    for (int64_t m = 0; m < M; m++) {
        load_row((const char *)x + m * K * element_size(dtype), dtype, K, row);
        int8_t *xq = rr.xq + m * K;
        for (int64_t b = 0; b < B; b++) {
            const fvec v0 = load_fvec(row + b * QK), v1 = load_fvec(row + b * QK + BLOCK);
            const fvec most = max_fvec(abs_fvec(v0), abs_fvec(v1));
            const float d = max_lanes(most) / 127.0f;
            const float id = d != 0.0f ? 1.0f / d : 0.0f;
            const ivec q0 = round_half_away(v0 * id), q1 = round_half_away(v1 * id);
            const int32_t sum = sum_lanes(q0 + q1);
            const bvec b0 = __builtin_convertvector(q0, bvec), b1 = __builtin_convertvector(q1, bvec);
            if (bits == 8) {
                memcpy(xq + b * QK, &b0, sizeof b0);
                memcpy(xq + b * QK + BLOCK, &b1, sizeof b1);
            } else { /* stored_at's order: a byte loop here was a third of the rounding's time */
                const bvec s0 = SHUFFLE_BYTES(b0, 0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
                const bvec s1 = SHUFFLE_BYTES(b1, 0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
                memcpy(xq + b * QK, &s0, sizeof s0);
                memcpy(xq + b * QK + BLOCK, &s1, sizeof s1);
            }
            rr.d[m * B + b] = (float)(_Float16)d;
            rr.xsum[m * B + b] = sum;
        }
        for (int64_t g = 0; g < G; g++) {
            float s = 0.0f;
            for (int64_t b = g * (group / QK); b < (g + 1) * (group / QK); b++) s += rr.d[m * B + b] * rr.xsum[m * B + b];
            rr.gsum[m * G + g] = s;
        }
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define ISA "avx512_vnni"
#define INT8_OFFSET 128 /* int8 weights read as q + 128 */

/* a * s + c, one rounding: the per-block scaling is a sixth of a row's work at one row. */
ALWAYS_INLINE fvec fmadd(fvec a, float s, fvec c) { return (fvec)_mm512_fmadd_ps((__m512)a, _mm512_set1_ps(s), (__m512)c); }

/* Four 16-byte rows at p -> 16 dwords, dword j = the rows' byte j. */
ALWAYS_INLINE __m512i quad_rows(const void *p) {
    const __m512i v = _mm512_loadu_si512(p);
#ifdef __AVX512VBMI__
    static const uint8_t order[64] = {
        0, 16, 32, 48, 1, 17, 33, 49, 2,  18, 34, 50, 3,  19, 35, 51, 4,  20, 36, 52, 5,  21,
        37, 53, 6, 22, 38, 54, 7, 23, 39, 55, 8,  24, 40, 56, 9,  25, 41, 57, 10, 26, 42, 58,
        11, 27, 43, 59, 12, 28, 44, 60, 13, 29, 45, 61, 14, 30, 46, 62, 15, 31, 47, 63};
    return _mm512_permutexvar_epi8(_mm512_loadu_si512((const void *)order), v);
#else
    /* dwords across lanes first (lane L gets dword L of each row), then a
     * 4 x 4 byte transpose inside each lane */
    const __m512i lanes = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), v);
    const __m128i t = _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_shuffle_epi8(lanes, _mm512_broadcast_i32x4(t));
#endif
}

ALWAYS_INLINE __m512i row_quad(const int8_t *p) {
    int32_t quad;
    memcpy(&quad, p, sizeof quad);
    return _mm512_set1_epi32(quad);
}

/* isum(q, xq) of one 32-input block for 16 outputs and R rows (int8: plus
 * 128 * isum(xq), taken off by the caller). Two chains per row halve the
 * vpdpbusd latency chain. */
ALWAYS_INLINE void block_isums(const int R, const int bits, const void *w, const int8_t *xq[MAX_ROWS],
                               ivec out[MAX_ROWS]) {
    __m512i a0[MAX_ROWS], a1[MAX_ROWS];
    for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm512_setzero_si512();
    if (bits == 8) {
        const __m512i flip = _mm512_set1_epi8((char)0x80);
        for (int s = 0; s < QK / 4; s += 2) {
            const __m512i w0 = _mm512_xor_si512(quad_rows((const int8_t *)w + s * 64), flip);
            const __m512i w1 = _mm512_xor_si512(quad_rows((const int8_t *)w + s * 64 + 64), flip);
            for (int r = 0; r < R; r++) {
                a0[r] = _mm512_dpbusd_epi32(a0[r], w0, row_quad(xq[r] + 4 * s));
                a1[r] = _mm512_dpbusd_epi32(a1[r], w1, row_quad(xq[r] + 4 * s + 4));
            }
        }
    } else {
        const __m512i nibble = _mm512_set1_epi8(15);
        for (int s = 0; s < QK / 8; s++) {
            const __m512i v = quad_rows((const uint8_t *)w + s * 64);
            const __m512i lo = _mm512_and_si512(v, nibble);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
            for (int r = 0; r < R; r++) {
                a0[r] = _mm512_dpbusd_epi32(a0[r], lo, row_quad(xq[r] + 8 * s));
                a1[r] = _mm512_dpbusd_epi32(a1[r], hi, row_quad(xq[r] + 8 * s + 4));
            }
        }
    }
    for (int r = 0; r < R; r++) out[r] = (ivec)_mm512_add_epi32(a0[r], a1[r]);
}

#elif defined(__AVX2__)
#include <immintrin.h>
#define ISA "avx2"
#define INT8_OFFSET 0

ALWAYS_INLINE fvec fmadd(fvec a, float s, fvec c) {
    __m256 x[2], y[2];
    memcpy(x, &a, sizeof a);
    memcpy(y, &c, sizeof c);
    for (int i = 0; i < 2; i++) y[i] = _mm256_fmadd_ps(x[i], _mm256_set1_ps(s), y[i]);
    memcpy(&c, y, sizeof c);
    return c;
}

/* Four 16-byte rows at p -> (X, Y), 8 dwords each, dword = one output's 4
 * bytes: X holds outputs 0..3 | 8..11, Y 4..7 | 12..15 (the 128-bit lanes
 * stay apart; block_isums puts them back in order once per block). */
ALWAYS_INLINE void quad_rows(const void *p, __m256i *X, __m256i *Y) {
    const __m256i pairs = _mm256_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15,
                                           0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
    /* rows 0, 1 -> lanes (row0[0..7], row1[0..7] | row0[8..15], row1[8..15]), bytes interleaved */
    const __m256i ab = _mm256_shuffle_epi8(
        _mm256_permute4x64_epi64(_mm256_loadu_si256((const __m256i *)p), _MM_SHUFFLE(3, 1, 2, 0)), pairs);
    const __m256i cd = _mm256_shuffle_epi8(
        _mm256_permute4x64_epi64(_mm256_loadu_si256((const __m256i *)((const char *)p + 32)), _MM_SHUFFLE(3, 1, 2, 0)),
        pairs);
    *X = _mm256_unpacklo_epi16(ab, cd);
    *Y = _mm256_unpackhi_epi16(ab, cd);
}

ALWAYS_INLINE __m256i row_quad(const int8_t *p) {
    int32_t quad;
    memcpy(&quad, p, sizeof quad);
    return _mm256_set1_epi32(quad);
}

ALWAYS_INLINE __m256i dot_s8(__m256i acc, __m256i w, __m256i x) {
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

/* Two unsigned-nibble products (each pair sum <= 2 * 15 * 127) added in 16 bits, then widened. */
ALWAYS_INLINE __m256i dot_u4(__m256i acc, __m256i v, __m256i xlo, __m256i xhi) {
    const __m256i nibble = _mm256_set1_epi8(15);
    const __m256i lo = _mm256_and_si256(v, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

ALWAYS_INLINE void block_isums(const int R, const int bits, const void *w, const int8_t *xq[MAX_ROWS],
                               ivec out[MAX_ROWS]) {
    __m256i ax[MAX_ROWS], ay[MAX_ROWS];
    for (int r = 0; r < R; r++) ax[r] = ay[r] = _mm256_setzero_si256();
    const int steps = bits == 8 ? QK / 4 : QK / 8;
    for (int s = 0; s < steps; s++) {
        __m256i X, Y;
        quad_rows((const char *)w + s * 64, &X, &Y);
        for (int r = 0; r < R; r++) {
            if (bits == 8) {
                const __m256i x = row_quad(xq[r] + 4 * s);
                ax[r] = dot_s8(ax[r], X, x);
                ay[r] = dot_s8(ay[r], Y, x);
            } else {
                const __m256i xlo = row_quad(xq[r] + 8 * s), xhi = row_quad(xq[r] + 8 * s + 4);
                ax[r] = dot_u4(ax[r], X, xlo, xhi);
                ay[r] = dot_u4(ay[r], Y, xlo, xhi);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        const __m256i halves[2] = {_mm256_permute2x128_si256(ax[r], ay[r], 0x20),
                                   _mm256_permute2x128_si256(ax[r], ay[r], 0x31)};
        memcpy(&out[r], halves, sizeof out[r]);
    }
}

#else
#define ISA "portable"
#define INT8_OFFSET 0

ALWAYS_INLINE fvec fmadd(fvec a, float s, fvec c) { return a * s + c; }

ALWAYS_INLINE void block_isums(const int R, const int bits, const void *w, const int8_t *xq[MAX_ROWS],
                               ivec out[MAX_ROWS]) {
    for (int r = 0; r < R; r++)
        for (int j = 0; j < BLOCK; j++) {
            int32_t sum = 0;
            for (int k = 0; k < QK; k++) {
                const int32_t q = bits == 8 ? ((const int8_t *)w)[k * BLOCK + j]
                                            : (((const uint8_t *)w)[(k / 2) * BLOCK + j] >> (4 * (k % 2))) & 15;
                sum += q * xq[r][stored_at(bits, k)];
            }
            out[r][j] = sum;
        }
}
#endif

const char *octavo_qdot_isa(void) { return ISA; }

/* Rows r0..r0+R-1 times the 16 outputs of block nb, plus the bias, stored as `dtype`. */
ALWAYS_INLINE void rows_block(const int R, const int bits, const rounded_rows rr, int64_t r0, int64_t K,
                              int64_t N, int64_t group, const void *w, const float *scales, const float *mins,
                              const void *bias, int dtype, int64_t nb, void *out) {
    const int64_t B = K / QK, G = K / group, per_group = group / QK;
    const float *sc = scales + nb * G * BLOCK, *mn = mins ? mins + nb * G * BLOCK : NULL;
    const char *wb = (const char *)w + nb * K * BLOCK * bits / 8;
    fvec acc[MAX_ROWS];
    for (int r = 0; r < R; r++) acc[r] = (fvec){0};
    for (int64_t g = 0; g < G; g++) {
        fvec gacc[MAX_ROWS];
        for (int r = 0; r < R; r++) gacc[r] = (fvec){0};
        for (int64_t b = g * per_group; b < (g + 1) * per_group; b++) {
            const char *p = wb + b * QK * BLOCK * bits / 8;
            for (int line = 0; line < QK * BLOCK * bits / 8; line += CACHE_LINE)
                __builtin_prefetch(p + PREFETCH_AHEAD + line, 0, 2);
            const int8_t *xq[MAX_ROWS];
            for (int r = 0; r < R; r++) xq[r] = rr.xq + (r0 + r) * K + b * QK;
            ivec isum[MAX_ROWS];
            block_isums(R, bits, p, xq, isum);
            for (int r = 0; r < R; r++) {
                const int32_t offset = bits == 8 ? INT8_OFFSET * rr.xsum[(r0 + r) * B + b] : 0;
                gacc[r] = fmadd(__builtin_convertvector(isum[r] - offset, fvec), rr.d[(r0 + r) * B + b], gacc[r]);
            }
        }
        const fvec s = load_fvec(sc + g * BLOCK);
        for (int r = 0; r < R; r++) {
            acc[r] += gacc[r] * s;
            if (mn) acc[r] = fmadd(load_fvec(mn + g * BLOCK), rr.gsum[(r0 + r) * G + g], acc[r]);
        }
    }
    const int64_t size = element_size(dtype);
    float b[BLOCK] = {0}, y[BLOCK];
    if (bias) load_row((const char *)bias + nb * BLOCK * size, dtype, BLOCK, b);
    for (int r = 0; r < R; r++) {
        acc[r] += load_fvec(b);
        memcpy(y, &acc[r], sizeof y);
        store_row(y, dtype, BLOCK, (char *)out + ((r0 + r) * N + nb * BLOCK) * size);
    }
}

#define ROWS_CASE(R)                                                                                    \
    case R:                                                                                             \
        if (bits == 8)                                                                                  \
            rows_block(R, 8, rr, r0, K, N, group, w, scales, mins, bias, dtype, nb, out);              \
        else                                                                                            \
            rows_block(R, 4, rr, r0, K, N, group, w, scales, mins, bias, dtype, nb, out);              \
        return;

/* rows_block with its row count R (1..MAX_ROWS) and bits made constants, so that its loops unroll into
 * registers. */
static void rows_block_of(int R, int bits, const rounded_rows rr, int64_t r0, int64_t K, int64_t N, int64_t group,
                          const void *w, const float *scales, const float *mins, const void *bias, int dtype,
                          int64_t nb, void *out) {
    switch (R) {
        ROWS_CASE(1)
        ROWS_CASE(2)
        ROWS_CASE(3)
        ROWS_CASE(4)
    }
}

/* One allocation for the rounded rows of M rows (and the float row round_rows converts through); NULL
 * when it cannot be made. The caller frees the returned buffer. */
static char *rounded_buffers(int64_t M, int64_t K, int64_t group, float **row, rounded_rows *rr) {
    const int64_t B = K / QK, G = K / group;
    char *buf = malloc((size_t)(K * sizeof(float) + M * K + M * B * (sizeof(float) + sizeof(int32_t)) +
                                M * G * sizeof(float)));
    if (buf == NULL) return NULL;
    *row = (float *)buf;
    rr->d = (float *)(buf + K * sizeof(float));
    rr->xsum = (int32_t *)(buf + K * sizeof(float) + M * B * sizeof(float));
    rr->gsum = (float *)(buf + K * sizeof(float) + M * B * (sizeof(float) + sizeof(int32_t)));
    rr->xq = (int8_t *)(buf + K * sizeof(float) + M * B * (sizeof(float) + sizeof(int32_t)) + M * G * sizeof(float));
    return buf;
}

/* out[M, N] = round_q8_0(x[M, K]) @ W^T (+ bias[N]); x, bias, out of `dtype`
 * (F32 or BF16). N a multiple of 16, K of 32, group a multiple of 32
 * dividing K. Returns 0, or -1 when the row buffers cannot be allocated. */
int octavo_qdot_linear(const void *x, int dtype, int64_t M, int64_t K, int64_t N, const void *w, int bits,
                       int64_t group, const float *scales, const float *mins, const void *bias, void *out) {
    const int64_t blocks = N / BLOCK, block_bytes = K * BLOCK * bits / 8;
    int failed = 0;
#pragma omp parallel
    {
        /* Each thread's output blocks are one contiguous stretch of the weight (a static schedule's), read
         * from its start: its first PREFETCH_AHEAD bytes are asked for at once, as the loop asks for the
         * rest ahead of it, rather than missing line by line while the hardware's prefetcher warms up
         * (in every product, twice a thread at decode: a product of a small model is ~10-40 us). */
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t first = blocks * t / threads, end = blocks * (t + 1) / threads;
        const int64_t ahead = (end - first) * block_bytes < PREFETCH_AHEAD ? (end - first) * block_bytes
                                                                             : PREFETCH_AHEAD;
        for (int64_t line = 0; line < ahead; line += CACHE_LINE)
            __builtin_prefetch((const char *)w + first * block_bytes + line, 0, 2);
        /* Every thread rounds the rows itself, at the same time as the others, into buffers of its own:
         * rounded once by the first thread before the others started, the rows were a serial step and
         * then read by every other thread from the first one's cache. At two threads a product of
         * llama-100m's shapes took 1.25-1.34x as long that way (Zen 4). The rounding is the same on
         * every thread, so the outputs are too. */
        float *row;
        rounded_rows rr;
        char *buf = first < end ? rounded_buffers(M, K, group, &row, &rr) : NULL;
        if (first < end && buf == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        if (buf != NULL) {
            round_rows(x, dtype, M, K, group, bits, row, rr);
            for (int64_t nb = first; nb < end; nb++)
                for (int64_t r0 = 0; r0 < M; r0 += MAX_ROWS)
                    rows_block_of(M - r0 < MAX_ROWS ? (int)(M - r0) : MAX_ROWS, bits, rr, r0, K, N, group, w,
                                  scales, mins, bias, dtype, nb, out);
        }
        free(buf);
    }
    return failed ? -1 : 0;
}

/* A mixture of experts' products at decode, every chosen expert in one call: out[m] = round_q8_0(x[m]) @
 * W_{experts[m]}^T. One call instead of one per expert keeps the Python and the thread start-up of a
 * call per expert (8 experts x 2 products a layer at top-8) off a step that only reads weights; the
 * threads split the chosen experts' output blocks between them, so only those experts' bytes are read.
 * Each expert's weight is quant_linear.c's layout in its own buffers, found through the tables
 * packed[e], scales[e] and mins[e] (mins NULL: no expert has them); all share bits, K, N and group.
 * Rows of one expert next to each other (the caller sorts them by expert) share each weight load, up
 * to MAX_ROWS at a time: every row's sums are the ones octavo_qdot_linear gives it. Returns 0, or -1
 * when the buffers cannot be allocated. */
int octavo_qdot_linear_experts(const void *x, int dtype, int64_t M, int64_t K, int64_t N, const int64_t *experts,
                               const void *const *packed, int bits, int64_t group, const float *const *scales,
                               const float *const *mins, void *out) {
    float *row;
    rounded_rows rr;
    char *buf = rounded_buffers(M, K, group, &row, &rr);
    int64_t *starts = malloc((size_t)(M > 0 ? M : 1) * sizeof(int64_t));
    if (buf == NULL || starts == NULL) {
        free(buf);
        free(starts);
        return -1;
    }
    round_rows(x, dtype, M, K, group, bits, row, rr);
    /* Runs of up to MAX_ROWS consecutive rows of one expert; run j is rows starts[j] .. starts[j + 1] - 1. */
    int64_t runs = 0;
    for (int64_t m = 0; m < M; m++)
        if (m == 0 || experts[m] != experts[m - 1] || m - starts[runs - 1] == MAX_ROWS) starts[runs++] = m;
    const int64_t blocks = N / BLOCK;
#pragma omp parallel for schedule(static)
    for (int64_t item = 0; item < runs * blocks; item++) {
        const int64_t j = item / blocks, r0 = starts[j], end = j + 1 < runs ? starts[j + 1] : M;
        const int64_t e = experts[r0];
        rows_block_of((int)(end - r0), bits, rr, r0, K, N, group, packed[e], scales[e], mins ? mins[e] : NULL, NULL,
                      dtype, item % blocks, out);
    }
    free(starts);
    free(buf);
    return 0;
}
