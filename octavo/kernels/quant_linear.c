/* Linear layers with int8 or int4 weights and bf16/float32 activations
 * (weight-only quantization: W8A16, W4A16).
 *
 * A weight element is w[n, k] = q[n, k] * scale[n, G] + min[n, G] for the
 * group G = k / group of its row (min = -zero * scale; NULL mins: zero 0).
 * Decode reads every weight once per step, so int8 halves and int4 quarters
 * the bytes of bf16; the kernel must turn those bytes into products faster
 * than memory delivers them.
 *
 * Layout (made once at load by octavo/quant/qweights.py), outputs in SIMD
 * lanes, so no horizontal sums are ever needed:
 *   int8: w[N/16][K][16]     one signed byte per weight
 *   int4: w[N/16][K/2][16]   byte = q[n, k] | q[n, k + 1] << 4 (k even)
 *   scales, mins: [N/16][K/group][16] float32
 *
 * Any number of rows (the `fma` path): rows in blocks of up to 4; each
 * vector of weights is widened to float32 in registers once and multiplied
 * into every row of the block with FMAs, exactly (float32 products and sums
 * of the float32 x and the integer q; the scale and min once per group).
 * Several accumulator chains per row hide the FMA latency: as many as the
 * registers hold. One source, the instruction set chosen by the compiler's
 * target (build.py compiles per target), the loop the same on each:
 *   AVX-512F (with or without BF16): 16 outputs a vector;
 *   AVX2 + FMA: a 16-output block is two 8-lane halves;
 *   anything else: GCC/Clang generic 4-float vectors (a block is four),
 *                  lowered to whatever the target has (NEON, SSE2).
 * The products are exact inside the FMAs (the portable path rounds each
 * product once more); otherwise only the summation order (the number of
 * chains) differs between the paths.
 *
 * Rows rounded to int8 (llama.cpp's Q8_0 activations) times these same
 * packed bytes by integer dot products are qdot_linear.c's: the default at
 * few rows; this path runs them with --quantized-activations float.
 * Rounding the rows costs ~2^-8 relative per row element, 400x the 1e-5
 * this path promises (tests/quant/test_qweights.py). Int8 rows per token at
 * any number of rows are a scheme of their own (--quantization w8a8,
 * compressed-tensors W8A8): w8a8_linear.c. Tried and dropped: int4 times
 * bf16 rows by vdpbf16ps (each nibble or'ed into the bf16 128 + q, the 128
 * taken off per group): slower on the Xeon measured (in L2, one thread:
 * 13.8 vs 14.9 GB/s at one row, 5.9 vs 8.8 at four).
 *
 * Many rows with bf16 activations (prefill, big batches) on AMX CPUs: each
 * thread dequantizes a 32-output group over all of K into an L2-resident
 * bf16 buffer in the AMX layout (amx_tiles.h) and multiplies it into all
 * rows on AMX tiles: the weights are then bf16-rounded (|error| <= 2^-9
 * relative per weight), the price of tile throughput. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#define BLOCK 16   /* outputs per packed block: the layout's, on every ISA */
#define KSTEP 4    /* k's per step of the FMA loop */
#define MAX_ROWS 4 /* rows per FMA block: each widened weight feeds up to 4 rows */
/* Each step also asks for the weight bytes this far ahead into L2: a thread
 * reads one sequential stream, yet the hardware prefetchers alone kept one
 * row at ~0.55 of a sum's read rate (int8, llama-100m's matrices, one
 * thread); with this, ~0.95 (8 KiB beat 4 KiB and the next block's start). */
#define PREFETCH_AHEAD 8192

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#ifdef __AVX512BF16__
#define ISA "avx512_bf16"
#else
#define ISA "avx512"
#endif
#define LANES 16
#define ACC_REGS 16 /* of 32 zmm: the rest hold weights, scales, the outputs */
typedef __m512 vec;
ALWAYS_INLINE vec vzero(void) { return _mm512_setzero_ps(); }
ALWAYS_INLINE vec vset1(float x) { return _mm512_set1_ps(x); }
ALWAYS_INLINE vec vload(const float *p) { return _mm512_loadu_ps(p); }
ALWAYS_INLINE void vstore(float *p, vec v) { _mm512_storeu_ps(p, v); }
ALWAYS_INLINE vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
ALWAYS_INLINE vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }

/* 16 weights (k, lanes n0..n0+15) as float32. */
ALWAYS_INLINE vec load_q8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* Weights k and k + 1 (k even) of 16 lanes from 16 bytes of int4 pairs.
 * The values 0..15 are looked up (vpermps), not converted: it reads only
 * an index's low 4 bits, so the low nibble needs no mask (one op less a
 * pair than and + two conversions; ~7% at one row, measured in L2). */
ALWAYS_INLINE void load_q4(const uint8_t *p, vec *even, vec *odd) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    *even = _mm512_permutexvar_ps(b, values);
    *odd = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), values);
}

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ISA "avx2"
#define LANES 8
#define ACC_REGS 8 /* of 16 ymm */
typedef __m256 vec;
ALWAYS_INLINE vec vzero(void) { return _mm256_setzero_ps(); }
ALWAYS_INLINE vec vset1(float x) { return _mm256_set1_ps(x); }
ALWAYS_INLINE vec vload(const float *p) { return _mm256_loadu_ps(p); }
ALWAYS_INLINE void vstore(float *p, vec v) { _mm256_storeu_ps(p, v); }
ALWAYS_INLINE vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
ALWAYS_INLINE vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }

ALWAYS_INLINE vec load_q8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

ALWAYS_INLINE void load_q4(const uint8_t *p, vec *even, vec *odd) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    *even = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
    *odd = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}

#else
#define ISA "portable"
/* GCC/Clang generic vectors of 4 floats: the width every SIMD target has
 * (NEON, SSE2), so the vectors and the accumulators stay in registers. */
#define LANES 4
#define ACC_REGS 8
typedef float vec __attribute__((vector_size(16)));
typedef int32_t ints __attribute__((vector_size(16)));
typedef int8_t bytes_s __attribute__((vector_size(4)));
typedef uint8_t bytes_u __attribute__((vector_size(4)));
ALWAYS_INLINE vec vzero(void) { return (vec){0}; }
ALWAYS_INLINE vec vset1(float x) { return (vec){x, x, x, x}; }
ALWAYS_INLINE vec vload(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}
ALWAYS_INLINE void vstore(float *p, vec v) { memcpy(p, &v, sizeof v); }
ALWAYS_INLINE vec vadd(vec a, vec b) { return a + b; }
/* Two roundings, not one: -std=c11 does not contract a * b + c into an FMA. */
ALWAYS_INLINE vec vfma(vec a, vec b, vec c) { return a * b + c; }

/* Bytes to int32 lanes, then to float: each step has a vector instruction
 * on every SIMD target (a direct byte -> float conversion is scalar on SSE2). */
ALWAYS_INLINE vec load_q8(const int8_t *p) {
    bytes_s b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(__builtin_convertvector(b, ints), vec);
}

ALWAYS_INLINE void load_q4(const uint8_t *p, vec *even, vec *odd) {
    bytes_u b;
    memcpy(&b, p, sizeof b);
    const ints i = __builtin_convertvector(b, ints);
    *even = __builtin_convertvector(i & 15, vec);
    *odd = __builtin_convertvector(i >> 4, vec);
}
#endif

#define HALVES (BLOCK / LANES) /* vectors per 16-output block */

/* Accumulator chains per row for R rows: up to one per k of a step, as
 * many as ACC_REGS registers hold. */
#define CHAINS(R) (ACC_REGS / ((R) * HALVES) >= 4 ? 4 : ACC_REGS / ((R) * HALVES) >= 2 ? 2 : 1)

const char *octavo_qlinear_isa(void) { return ISA; }

/* Rows r0..r0+R-1 times the 16 outputs of block nb: float32 x (xf, [M][K])
 * and per-row group sums of x (xs, [M][G]) prepared by the caller. */
ALWAYS_INLINE void fma_block(const int R, const int bits, const float *xf, const float *xs, int64_t r0, int64_t K,
                             int64_t group, const void *w, const float *scales, const float *mins, int64_t nb,
                             vec out[MAX_ROWS][HALVES]) {
    const int CH = CHAINS(R);
    const int64_t G = K / group;
    const float *sc = scales + nb * G * BLOCK, *mn = mins ? mins + nb * G * BLOCK : NULL;
    for (int r = 0; r < R; r++)
        for (int h = 0; h < HALVES; h++) out[r][h] = vzero();
    for (int64_t g = 0; g < G; g++) {
        vec acc[MAX_ROWS][KSTEP][HALVES];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < CH; c++)
                for (int h = 0; h < HALVES; h++) acc[r][c][h] = vzero();
        const int64_t k0 = g * group;
        for (int64_t k = k0; k < k0 + group; k += KSTEP) {
            __builtin_prefetch((const char *)w + (nb * K + k) * BLOCK * bits / 8 + PREFETCH_AHEAD, 0, 2);
            for (int h = 0; h < HALVES; h++) {
                vec v[KSTEP];
                if (bits == 8) {
                    const int8_t *p = (const int8_t *)w + (nb * K + k) * BLOCK + h * LANES;
                    for (int c = 0; c < KSTEP; c++) v[c] = load_q8(p + c * BLOCK);
                } else {
                    const uint8_t *p = (const uint8_t *)w + (nb * K + k) * (BLOCK / 2) + h * LANES;
                    load_q4(p, &v[0], &v[1]);
                    load_q4(p + BLOCK, &v[2], &v[3]);
                }
                for (int r = 0; r < R; r++) {
                    const float *x = xf + (r0 + r) * K + k;
                    for (int c = 0; c < KSTEP; c++) acc[r][c % CH][h] = vfma(v[c], vset1(x[c]), acc[r][c % CH][h]);
                }
            }
        }
        for (int h = 0; h < HALVES; h++) {
            const vec s = vload(sc + g * BLOCK + h * LANES);
            for (int r = 0; r < R; r++) {
                vec dot = acc[r][0][h];
                if (CH == 2) dot = vadd(dot, acc[r][1][h]);
                if (CH == 4) dot = vadd(vadd(dot, acc[r][1][h]), vadd(acc[r][2][h], acc[r][3][h]));
                out[r][h] = vfma(dot, s, out[r][h]);
                if (mn) out[r][h] = vfma(vload(mn + g * BLOCK + h * LANES), vset1(xs[(r0 + r) * G + g]), out[r][h]);
            }
        }
    }
}

/* The block's sums plus the bias, converted to `dtype` (bf16: rounded to
 * nearest even, as torch rounds). */
ALWAYS_INLINE void store_block(int R, vec acc[MAX_ROWS][HALVES], const void *bias, int dtype, int64_t r0, int64_t N,
                               int64_t nb, void *out) {
    const int64_t size = element_size(dtype);
    float b[BLOCK] = {0}, y[BLOCK];
    if (bias) load_row((const char *)bias + nb * BLOCK * size, dtype, BLOCK, b);
    for (int r = 0; r < R; r++) {
        for (int h = 0; h < HALVES; h++) vstore(y + h * LANES, vadd(acc[r][h], vload(b + h * LANES)));
        store_row(y, dtype, BLOCK, (char *)out + ((r0 + r) * N + nb * BLOCK) * size);
    }
}

/* R as a constant in each copy, so the row loops unroll into registers. */
#define ROWS_CASE(R)                                                                          \
    case R: {                                                                                 \
        vec acc[MAX_ROWS][HALVES];                                                            \
        if (bits == 8)                                                                        \
            fma_block(R, 8, xf, xs, r0, K, group, w, scales, mins, nb, acc);                  \
        else                                                                                  \
            fma_block(R, 4, xf, xs, r0, K, group, w, scales, mins, nb, acc);                  \
        store_block(R, acc, bias, dtype, r0, N, nb, out);                                     \
        break;                                                                                \
    }

static void fma_linear(const float *xf, const float *xs, int64_t M, int64_t K, int64_t N, const void *w, int bits,
                       int64_t group, const float *scales, const float *mins, const void *bias, int dtype, void *out) {
    const int64_t blocks = N / BLOCK;
#pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < blocks; nb++) FOR_ROW_BLOCKS_OF_4(M, r0, ROWS_CASE)
}

/* float32 copies of the rows and their sums per group (the mins' factor). */
static void prepare_rows(const void *x, int dtype, int64_t M, int64_t K, int64_t group, float *xf, float *xs) {
    const int64_t G = K / group;
    for (int64_t m = 0; m < M; m++) {
        float *row = xf + m * K;
        load_row((const char *)x + m * K * element_size(dtype), dtype, K, row);
        for (int64_t g = 0; g < G; g++) {
            float s = 0.0f;
            for (int64_t k = g * group; k < (g + 1) * group; k++) s += row[k];
            xs[m * G + g] = s;
        }
    }
}

/* out[M, N] = x[M, K] @ W^T (+ bias[N]) by FMAs; x, bias, out of `dtype`
 * (F32 or BF16). N a multiple of 16, group a multiple of 4 dividing K.
 * Returns 0, or -1 when the row buffers cannot be allocated. */
int octavo_qlinear_fma(const void *x, int dtype, int64_t M, int64_t K, int64_t N, const void *w, int bits,
                       int64_t group, const float *scales, const float *mins, const void *bias, void *out) {
    float *xf = malloc((size_t)(M * K + M * (K / group)) * sizeof(float));
    if (xf == NULL) return -1;
    float *xs = xf + M * K;
    prepare_rows(x, dtype, M, K, group, xf, xs);
    fma_linear(xf, xs, M, K, N, w, bits, group, scales, mins, bias, dtype, out);
    free(xf);
    return 0;
}

#if defined(HAVE_AVX512_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include "amx_tiles.h"

/* 16 lanes of weights k and k + 1 (scaled, float32) -> 16 dwords of the AMX
 * layout's k-pair row: (bf16 w[n, k], bf16 w[n, k + 1]) per output. */
ALWAYS_INLINE __m512i pair_bf16(__m512 even, __m512 odd) {
    const __m512i lo = _mm512_cvtepu16_epi32(narrow16_bf16(even));
    const __m512i hi = _mm512_cvtepu16_epi32(narrow16_bf16(odd));
    return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
}

/* Weight group g (outputs 32g .. 32g + 31) over all of K, dequantized into
 * buf as [K/32][16 k-pairs][32 outputs][2] bf16. */
static void dequant_group(const void *w, int bits, int64_t K, int64_t group, const float *scales, const float *mins,
                          int64_t g, uint16_t *buf) {
    const int64_t G = K / group;
    for (int h = 0; h < 2; h++) { /* the two 16-output blocks */
        const int64_t nb = 2 * g + h;
        for (int64_t k = 0; k < K; k += 2) {
            const int64_t gi = k / group;
            const __m512 s = _mm512_loadu_ps(scales + (nb * G + gi) * 16);
            const __m512 m = mins ? _mm512_loadu_ps(mins + (nb * G + gi) * 16) : _mm512_setzero_ps();
            __m512 even, odd;
            if (bits == 8) {
                const int8_t *p = (const int8_t *)w + (nb * K + k) * 16;
                even = load_q8(p);
                odd = load_q8(p + 16);
            } else {
                load_q4((const uint8_t *)w + (nb * K + k) * 8, &even, &odd);
            }
            even = _mm512_fmadd_ps(even, s, m);
            odd = _mm512_fmadd_ps(odd, s, m);
            /* block k/32, pair row (k%32)/2, outputs 16h.. of the 32 */
            uint16_t *dst = buf + (k / 32) * 1024 + ((k % 32) / 2) * 64 + h * 32;
            _mm512_storeu_si512((void *)dst, pair_bf16(even, odd));
        }
    }
}

int octavo_qlinear_amx_available(void) { return amx_request(); }

/* out[M, N] = x[M, K] @ dequant(W)^T (+ bias) on AMX tiles; x, bias, out
 * bf16. N a multiple of 32, K of 32. Returns 0, or -1 on allocation failure. */
int octavo_qlinear_amx(const uint16_t *x, int64_t M, int64_t K, int64_t N, const void *w, int bits, int64_t group,
                       const float *scales, const float *mins, const uint16_t *bias, uint16_t *out) {
    const int64_t groups = N / 32;
    const int64_t full_tiles = M / 16, tail_rows = M % 16;
    uint16_t *tail = NULL;
    if (tail_rows && full_tiles) {
        tail = aligned_alloc(64, (size_t)(16 * K * 2));
        if (tail == NULL) return -1;
        memset(tail, 0, (size_t)(16 * K * 2));
        memcpy(tail, x + full_tiles * 16 * K, (size_t)(tail_rows * K * 2));
    }
    const int64_t row_tiles = full_tiles + (tail_rows != 0);
    const int tile_rows = full_tiles ? 16 : (int)M;
    int failed = 0;
#pragma omp parallel
    {
        /* Every thread takes part in the loop (a worksharing loop must be
         * met by all); one without a buffer only records the failure. */
        uint16_t *buf = aligned_alloc(64, (size_t)(64 * K));
        if (buf != NULL) configure_tiles(tile_rows);
        float acc[4][256] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            if (buf == NULL) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            dequant_group(w, bits, K, group, scales, mins, g, buf);
            for (int64_t t = 0; t < row_tiles; t += 2)
                multiply_block(x, tail, full_tiles, t, t + 1 < row_tiles, buf, bias, M, K, N, g, out, acc);
        }
        if (buf != NULL) {
            _tile_release();
            free(buf);
        }
    }
    free(tail);
    return failed ? -1 : 0;
}

/* A mixture of experts' products on AMX tiles, every expert in one call: out[m] = x[m] @ dequant(W_e)^T for
 * e = experts[m], expert e's weight at packed[e], scales[e], mins[e] (mins NULL: none has them), all of one
 * shape, rows of one expert next to each other. The threads share the (run, output group) pairs: each
 * group is dequantized once for all its expert's rows, as octavo_qlinear_amx does for a layer's.
 * N and K multiples of 32. Returns 0, or -1 on allocation failure. */
int octavo_qlinear_amx_experts(const uint16_t *x, int64_t M, int64_t K, int64_t N, const int64_t *experts,
                               const void *const *packed, int bits, int64_t group, const float *const *scales,
                               const float *const *mins, uint16_t *out) {
    int64_t runs = 0;
    uint16_t *tails = NULL;
    expert_run *run = expert_runs(x, experts, M, K, &runs, &tails);
    if (run == NULL) return -1;
    const int64_t groups = N / 32;
    int failed = 0;
#pragma omp parallel
    {
        uint16_t *buf = aligned_alloc(64, (size_t)(64 * K));
        int configured = 0;
        float acc[4][256] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t item = 0; item < runs * groups; item++) {
            if (buf == NULL) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            const expert_run *r = run + item / groups;
            const int64_t g = item % groups, e = experts[r->start];
            dequant_group(packed[e], bits, K, group, scales[e], mins ? mins[e] : NULL, g, buf);
            multiply_run(x, r, buf, K, N, g, out, acc, &configured);
        }
        if (configured) _tile_release();
        free(buf);
    }
    free(tails);
    free(run);
    return failed ? -1 : 0;
}

#else

int octavo_qlinear_amx_available(void) { return 0; }

int octavo_qlinear_amx(const uint16_t *x, int64_t M, int64_t K, int64_t N, const void *w, int bits, int64_t group,
                       const float *scales, const float *mins, const uint16_t *bias, uint16_t *out) {
    (void)x, (void)M, (void)K, (void)N, (void)w, (void)bits, (void)group, (void)scales, (void)mins, (void)bias;
    (void)out;
    abort(); /* unreachable: the Python side checks octavo_qlinear_amx_available() first */
}

int octavo_qlinear_amx_experts(const uint16_t *x, int64_t M, int64_t K, int64_t N, const int64_t *experts,
                               const void *const *packed, int bits, int64_t group, const float *const *scales,
                               const float *const *mins, uint16_t *out) {
    (void)x, (void)M, (void)K, (void)N, (void)experts, (void)packed, (void)bits, (void)group, (void)scales;
    (void)mins, (void)out;
    abort(); /* unreachable: the Python side checks octavo_qlinear_amx_available() first */
}

#endif
