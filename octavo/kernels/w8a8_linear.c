/* Linear layers with int8 weights AND int8 activations (W8A8): the rows are
 * rounded to 8 bits per row (per token) on every call, then multiplied by
 * integer dot products. A scheme the user or the checkpoint asks for
 * (--quantization w8a8, compressed-tensors W8A8), never a silent switch:
 * rounding the rows costs ~2^-8 relative per element (quant_linear.c's
 * "Not done" paragraph), the price of integer throughput: vpdpbusd does 64
 * multiply-adds an instruction where a float32 FMA does 16.
 *
 *   scale_x[m] = max_k |x[m, k]| / 127 (1 for a zero row)
 *   xq[m, k]   = round(x[m, k] / scale_x[m]), ties to even, in -127..127
 *   out[m, n]  = (float)(sum_k xq[m, k] * q[n, k]) * (scale_x[m] * scale_w[n]) + bias[n]
 *
 * in float32 (a multiply, then an add: -std=c11 does not contract them into
 * an FMA), converted to the rows' dtype. The integer sum is exact (int32),
 * so the result is bit for bit what torch gives doing the same operations
 * (octavo/quant/w8a8.py's torch path, the tests' reference).
 *
 * Weight layout (w8a8_linear.py packs it once, at load): [N/16][Kp/4][16][4]
 * int8, Kp = K rounded up to a multiple of 4 (padding zeros): 4 consecutive
 * k of one output in a 32-bit lane, 16 outputs a 64-byte vector, so a dot
 * product step needs no shuffle and no horizontal sum. The per-output sums
 * of q (wsum, int32 [N]) come with it.
 *
 * One source, the instruction set chosen by the compiler's target:
 *   AVX-512 VNNI (the avx512_bf16 and amx targets): vpdpbusd multiplies
 *     unsigned by signed bytes, so the rows are stored as xq + 128 (1..255)
 *     and 128 * wsum[n] is taken off the sum: exact for any int8 q,
 *     -128 included (compressed-tensors' int8 range is -128..127).
 *   AVX-512 without VNNI, AVX2: the weights widened to int16 (vpmovsxbw)
 *     and vpmaddwd with the rows as int16: pairs of products summed into
 *     int32, never saturating (vpmaddubsw would: 2 * 255 * 127 > 32767).
 *   anything else: plain C loops on int32, vectorised where the compiler can.
 *
 * Each weight vector feeds up to MAX_ROWS rows, each broadcast row quad up
 * to NB 16-output blocks: at one row the loop reads the weights as fast as
 * they stream (decode), at many rows each weight byte loaded from L1/L2
 * does MAX_ROWS multiply-adds. Threads split the output blocks
 * (OpenMP, like the other linear kernels); the row quantization is split
 * by rows first, in the same parallel region. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#define BLOCK 16 /* outputs per packed block, on every ISA */
/* Each step also asks for the weight bytes this far ahead in each block's
 * stream (NB streams at a time): a single stream kept ~0.55 of the read
 * rate on the prefetchers alone in quant_linear.c's measurements. */
#define PREFETCH_AHEAD 4096

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define ISA "avx512_vnni"
#define MAX_ROWS 4
#define NB 4 /* 16 accumulators, 4 weight vectors, 4 broadcasts of 32 zmm */
typedef uint8_t xq_t; /* xq + 128 */
#define XQ_OFFSET 128
typedef struct { __m512i v; } acc_t;
typedef struct { __m512i v; } wvec_t;
typedef __m512i xvec_t;
ALWAYS_INLINE acc_t acc_zero(void) { return (acc_t){_mm512_setzero_si512()}; }
ALWAYS_INLINE wvec_t load_w(const int8_t *p) { return (wvec_t){_mm512_loadu_si512((const void *)p)}; }
ALWAYS_INLINE xvec_t load_x(const xq_t *p) {
    int32_t quad;
    memcpy(&quad, p, sizeof quad);
    return _mm512_set1_epi32(quad);
}
ALWAYS_INLINE acc_t acc_step(acc_t a, xvec_t x, wvec_t w) { return (acc_t){_mm512_dpbusd_epi32(a.v, x, w.v)}; }
/* The 16 outputs' sums, in order. */
ALWAYS_INLINE void acc_sums(acc_t a, int32_t out[BLOCK]) { _mm512_storeu_si512((void *)out, a.v); }

#elif defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define ISA "avx512"
#define MAX_ROWS 4
#define NB 2 /* 16 accumulators (two a block), 4 widened weight halves, 4 broadcasts */
typedef int16_t xq_t;
#define XQ_OFFSET 0
/* lo: outputs 0..7, hi: 8..15; output j's two partial sums in dwords 2j, 2j + 1 */
typedef struct { __m512i lo, hi; } acc_t;
typedef struct { __m512i lo, hi; } wvec_t;
typedef __m512i xvec_t;
ALWAYS_INLINE acc_t acc_zero(void) { return (acc_t){_mm512_setzero_si512(), _mm512_setzero_si512()}; }
ALWAYS_INLINE wvec_t load_w(const int8_t *p) {
    return (wvec_t){_mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p)),
                    _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(p + 32)))};
}
ALWAYS_INLINE xvec_t load_x(const xq_t *p) {
    int64_t quad;
    memcpy(&quad, p, sizeof quad);
    return _mm512_set1_epi64(quad);
}
ALWAYS_INLINE acc_t acc_step(acc_t a, xvec_t x, wvec_t w) {
    return (acc_t){_mm512_add_epi32(a.lo, _mm512_madd_epi16(x, w.lo)),
                   _mm512_add_epi32(a.hi, _mm512_madd_epi16(x, w.hi))};
}
ALWAYS_INLINE void acc_sums(acc_t a, int32_t out[BLOCK]) {
    int32_t pairs[2 * BLOCK];
    _mm512_storeu_si512((void *)pairs, a.lo);
    _mm512_storeu_si512((void *)(pairs + 16), a.hi);
    for (int j = 0; j < BLOCK; j++) out[j] = pairs[2 * j] + pairs[2 * j + 1];
}

#elif defined(__AVX2__)
#include <immintrin.h>
#define ISA "avx2"
#define MAX_ROWS 2
#define NB 1 /* 8 accumulators (four a block), 4 widened weight quarters, 2 broadcasts of 16 ymm */
typedef int16_t xq_t;
#define XQ_OFFSET 0
/* v[c]: outputs 4c..4c+3, output 4c + i's partial sums in dwords 2i, 2i + 1 */
typedef struct { __m256i v[4]; } acc_t;
typedef struct { __m256i v[4]; } wvec_t;
typedef __m256i xvec_t;
ALWAYS_INLINE acc_t acc_zero(void) {
    acc_t a;
    for (int c = 0; c < 4; c++) a.v[c] = _mm256_setzero_si256();
    return a;
}
ALWAYS_INLINE wvec_t load_w(const int8_t *p) {
    wvec_t w;
    for (int c = 0; c < 4; c++) w.v[c] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 16 * c)));
    return w;
}
ALWAYS_INLINE xvec_t load_x(const xq_t *p) {
    int64_t quad;
    memcpy(&quad, p, sizeof quad);
    return _mm256_set1_epi64x(quad);
}
ALWAYS_INLINE acc_t acc_step(acc_t a, xvec_t x, wvec_t w) {
    for (int c = 0; c < 4; c++) a.v[c] = _mm256_add_epi32(a.v[c], _mm256_madd_epi16(x, w.v[c]));
    return a;
}
ALWAYS_INLINE void acc_sums(acc_t a, int32_t out[BLOCK]) {
    int32_t pairs[2 * BLOCK];
    for (int c = 0; c < 4; c++) _mm256_storeu_si256((__m256i *)(pairs + 8 * c), a.v[c]);
    for (int j = 0; j < BLOCK; j++) out[j] = pairs[2 * j] + pairs[2 * j + 1];
}

#else
#define ISA "portable"
#define MAX_ROWS 4
#define NB 1
typedef int8_t xq_t;
#define XQ_OFFSET 0
typedef struct { int32_t v[BLOCK]; } acc_t;
typedef struct { const int8_t *p; } wvec_t;
typedef const xq_t *xvec_t;
ALWAYS_INLINE acc_t acc_zero(void) { return (acc_t){{0}}; }
ALWAYS_INLINE wvec_t load_w(const int8_t *p) { return (wvec_t){p}; }
ALWAYS_INLINE xvec_t load_x(const xq_t *p) { return p; }
ALWAYS_INLINE acc_t acc_step(acc_t a, xvec_t x, wvec_t w) {
    for (int j = 0; j < BLOCK; j++)
        for (int t = 0; t < 4; t++) a.v[j] += (int32_t)x[t] * (int32_t)w.p[4 * j + t];
    return a;
}
ALWAYS_INLINE void acc_sums(acc_t a, int32_t out[BLOCK]) { memcpy(out, a.v, sizeof a.v); }
#endif

const char *octavo_w8a8_isa(void) { return ISA; }

/* Row m of x quantized into xq (Kp values, the padding zero) and its scale. */
static void quantize_row(const void *x, int dtype, int64_t K, int64_t Kp, float *buf, xq_t *xq, float *scale) {
    load_row(x, dtype, K, buf);
    float amax = 0.0f;
#pragma omp simd reduction(max : amax)
    for (int64_t k = 0; k < K; k++) {
        const float a = fabsf(buf[k]);
        amax = a > amax ? a : amax;
    }
    const float s = amax > 0.0f ? amax / 127.0f : 1.0f;
#pragma omp simd
    for (int64_t k = 0; k < K; k++) {
        /* A true division, as torch's x / scale: the quotient is the same float. */
        float v = nearbyintf(buf[k] / s);
        v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
        xq[k] = (xq_t)((int32_t)v + XQ_OFFSET);
    }
    for (int64_t k = K; k < Kp; k++) xq[k] = (xq_t)XQ_OFFSET;
    *scale = s;
}

/* Rows r0..r0+R-1 times blocks nb..nb+NBK-1: the integer sums. */
ALWAYS_INLINE void dot_blocks(const int R, const int NBK, const xq_t *xq, int64_t r0, int64_t Kp, const int8_t *w,
                              int64_t nb, int32_t sums[MAX_ROWS][NB][BLOCK]) {
    acc_t acc[MAX_ROWS][NB];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < NBK; b++) acc[r][b] = acc_zero();
    const int64_t block_bytes = Kp * BLOCK;
    const int8_t *wb = w + nb * block_bytes;
    for (int64_t k = 0; k < Kp; k += 4) {
        xvec_t xv[MAX_ROWS];
        for (int r = 0; r < R; r++) xv[r] = load_x(xq + (r0 + r) * Kp + k);
        for (int b = 0; b < NBK; b++) {
            const int8_t *p = wb + b * block_bytes + k * BLOCK;
            __builtin_prefetch(p + PREFETCH_AHEAD, 0, 2);
            const wvec_t wv = load_w(p);
            for (int r = 0; r < R; r++) acc[r][b] = acc_step(acc[r][b], xv[r], wv);
        }
    }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < NBK; b++) acc_sums(acc[r][b], sums[r][b]);
}

/* The sums scaled, plus the bias, stored in `dtype`. */
ALWAYS_INLINE void store_blocks(const int R, const int NBK, int32_t sums[MAX_ROWS][NB][BLOCK], const float *xscale,
                                int64_t r0, const int32_t *wsum, const float *wscale, const void *bias, int dtype,
                                int64_t N, int64_t nb, void *out) {
    const int64_t size = element_size(dtype);
    for (int b = 0; b < NBK; b++) {
        const int64_t n0 = (nb + b) * BLOCK;
        float bv[BLOCK] = {0}, y[BLOCK];
        if (bias) load_row((const char *)bias + n0 * size, dtype, BLOCK, bv);
        for (int r = 0; r < R; r++) {
            const float sx = xscale[r0 + r];
            for (int j = 0; j < BLOCK; j++) {
                const int32_t dot = sums[r][b][j] - XQ_OFFSET * wsum[n0 + j];
                const float scaled = (float)dot * (sx * wscale[n0 + j]);
                y[j] = bias ? scaled + bv[j] : scaled;
            }
            store_row(y, dtype, BLOCK, (char *)out + ((r0 + r) * N + n0) * size);
        }
    }
}

/* R and NBK constants in each copy, so the loops unroll into registers. */
#define CASE(R, NBK)                                                                       \
    case R: {                                                                              \
        int32_t sums[MAX_ROWS][NB][BLOCK];                                                 \
        dot_blocks(R, NBK, xq, r0, Kp, w, nb, sums);                                       \
        store_blocks(R, NBK, sums, xscale, r0, wsum, wscale, bias, dtype, N, nb, out);     \
        break;                                                                             \
    }

#if MAX_ROWS == 4
#define ROW_CASES(NBK) CASE(1, NBK) CASE(2, NBK) CASE(3, NBK) CASE(4, NBK)
#else
#define ROW_CASES(NBK) CASE(1, NBK) CASE(2, NBK)
#endif

/* Rows r0.. (up to MAX_ROWS) times NBK blocks from nb. */
static void multiply(int64_t rows, int nbk, const xq_t *xq, int64_t r0, int64_t Kp, const int8_t *w, int64_t nb,
                     const float *xscale, const int32_t *wsum, const float *wscale, const void *bias, int dtype,
                     int64_t N, void *out) {
    if (nbk == NB) {
        switch ((int)rows) { ROW_CASES(NB) }
    } else {
        switch ((int)rows) { ROW_CASES(1) }
    }
}

/* out[M, N] = W8A8(x[M, K], W) (+ bias[N]); x, bias, out of `dtype` (F32 or
 * BF16); w packed [N/16][Kp/4][16][4], N a multiple of 16; wsum int32 [N];
 * wscale float32 [N]. Returns 0, or -1 when the row buffers cannot be allocated. */
int octavo_w8a8_linear(const void *x, int dtype, int64_t M, int64_t K, int64_t N, const int8_t *w,
                       const int32_t *wsum, const float *wscale, const void *bias, void *out) {
    const int64_t Kp = (K + 3) / 4 * 4;
    xq_t *xq = malloc((size_t)(M * Kp) * sizeof(xq_t));
    float *xscale = malloc((size_t)M * sizeof(float));
    if (xq == NULL || xscale == NULL) {
        free(xq);
        free(xscale);
        return -1;
    }
    const int64_t blocks = N / BLOCK, groups = (blocks + NB - 1) / NB;
    const int64_t size = element_size(dtype);
    int failed = 0;
#pragma omp parallel
    {
        float *buf = malloc((size_t)K * sizeof(float));
        if (buf == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++)
            if (buf != NULL) quantize_row((const char *)x + m * K * size, dtype, K, Kp, buf, xq + m * Kp, xscale + m);
        free(buf);
        /* the implicit barrier: every row is quantized (or the call has failed) */
        if (!failed) {
#pragma omp for schedule(static)
            for (int64_t g = 0; g < groups; g++) {
                /* a whole group of NB blocks at once, a last partial one block by block */
                const int64_t nb = g * NB;
                const int nbk = blocks - nb >= NB ? NB : 1;
                for (int64_t b = nb; b < nb + NB && b < blocks; b += nbk)
                    for (int64_t r0 = 0; r0 < M; r0 += MAX_ROWS)
                        multiply(M - r0 < MAX_ROWS ? M - r0 : MAX_ROWS, nbk, xq, r0, Kp, w, b, xscale, wsum, wscale,
                                 bias, dtype, N, out);
            }
        }
    }
    free(xq);
    free(xscale);
    return failed ? -1 : 0;
}
