/* Helpers shared by the CPU kernels: dtype codes, row conversion to and from
 * float32, a vectorisable exp. Included by each kernel's .c file; build.py
 * hashes this header into every kernel's cache key. */
#ifndef OCTAVO_KERNELS_COMMON_H
#define OCTAVO_KERNELS_COMMON_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* The codes the Python wrappers pass for torch.float32 / bfloat16 / float16,
 * and for the quantized KV cache's int8 / float8_e4m3fn (cache only). */
enum { F32 = 0, BF16 = 1, F16 = 2, I8 = 3, FP8 = 4 };

/* The row helpers below branch on the dtype; inlined into a loop where the
 * dtype is a constant (see DTYPE_SWITCH), the branches fold away and the
 * loops vectorise. */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* Runs STATEMENT with `dt` bound to the constant matching `dtype`. */
#define DTYPE_SWITCH(dtype, STATEMENT)      \
    do {                                    \
        if ((dtype) == BF16) {              \
            const int dt = BF16;            \
            STATEMENT;                      \
        } else if ((dtype) == F16) {        \
            const int dt = F16;             \
            STATEMENT;                      \
        } else {                            \
            const int dt = F32;             \
            STATEMENT;                      \
        }                                   \
    } while (0)

/* Runs CASE(R) for each block of up to 4 rows r0..r0+R-1 of M: R a
 * constant in each copy, so a kernel's row loops unroll into registers. */
#define FOR_ROW_BLOCKS_OF_4(M, r0, CASE)                                  \
    for (int64_t r0 = 0; r0 < (M); r0 += 4) {                             \
        switch ((M) - r0 < 4 ? (int)((M) - r0) : 4) {                     \
            CASE(1)                                                       \
            CASE(2)                                                       \
            CASE(3)                                                       \
            CASE(4)                                                       \
        }                                                                 \
    }

ALWAYS_INLINE int64_t element_size(int dtype) { return dtype == F32 ? 4 : (dtype == I8 || dtype == FP8) ? 1 : 2; }

/* float8_e4m3fn (1 sign, 4 exponent bits of bias 7, 3 mantissa bits, no
 * infinities) -> float. Placed in a float16's bit positions the byte is the
 * same number divided by 2^8 (the bias differs by 8), subnormals included. */
ALWAYS_INLINE float e4m3_to_float(uint8_t b) {
    const uint16_t h = (uint16_t)(((b & 0x80u) << 8) | ((b & 0x7fu) << 7));
    _Float16 f;
    memcpy(&f, &h, sizeof f);
    return (float)f * 256.0f;
}

/* |x| <= 448 (the caller clamps) -> the nearest e4m3fn, ties to even, as
 * torch converts. */
ALWAYS_INLINE uint8_t float_to_e4m3(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    const float a = fabsf(x);
    if (a < 0.015625f) /* below 2^-6: subnormal steps of 2^-9 (a result of 8 is 2^-6, the first normal) */
        return sign | (uint8_t)nearbyintf(a * 512.0f);
    const uint32_t m = u & 0x7fffffffu;
    /* Drop 20 of float's 23 mantissa bits, rounding to nearest even; a carry
     * moves into the exponent, as it should. */
    const uint32_t r = (m + 0x7ffffu + ((m >> 20) & 1u)) >> 20;
    return sign | (uint8_t)((((r >> 3) - 120u) << 3) | (r & 7u));
}

ALWAYS_INLINE float bf16_to_float(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even, as torch does; NaN stays NaN. Branch-free so that
 * loops over it vectorise. */
ALWAYS_INLINE uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t quiet_nan = (u >> 16) | 0x40u;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

ALWAYS_INLINE void load_row(const void *src, int dtype, int64_t n, float *dst) {
    if (dtype == F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
    } else if (dtype == BF16) {
        const uint16_t *s = (const uint16_t *)src;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_float(s[i]);
    } else if (dtype == F16) {
        const _Float16 *s = (const _Float16 *)src;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) dst[i] = (float)s[i];
    } else if (dtype == I8) { /* quantized values, before their scale */
        const int8_t *s = (const int8_t *)src;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) dst[i] = (float)s[i];
    } else {
        const uint8_t *s = (const uint8_t *)src;
        for (int64_t i = 0; i < n; i++) dst[i] = e4m3_to_float(s[i]);
    }
}

ALWAYS_INLINE void store_row(const float *src, int dtype, int64_t n, void *dst) {
    if (dtype == F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
    } else if (dtype == BF16) {
        uint16_t *d = (uint16_t *)dst;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) d[i] = float_to_bf16(src[i]);
    } else {
        _Float16 *d = (_Float16 *)dst;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) d[i] = (_Float16)src[i];
    }
}

/* x rounded to the dtype's precision and back: what storing a float32 result
 * in a bf16/f16 tensor and reading it again gives (torch rounds every op). */
ALWAYS_INLINE float round_to(float x, int dtype) {
    if (dtype == BF16) return bf16_to_float(float_to_bf16(x));
    if (dtype == F16) return (float)(_Float16)x;
    return x;
}

/* e^x for x <= 0 (scores minus their max), vectorisable: 2^(x log2 e) split
 * into an integer power (exponent bits) and a degree-6 polynomial on
 * [-0.5, 0.5]; relative error below 2e-7. Below -87 the result is 0. */
ALWAYS_INLINE float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float t = x * 1.44269504088896341f;
    /* Round to nearest by the float adder (|t| < 2^22): vectorises, unlike roundf. */
    const float n = (t + 12582912.0f) - 12582912.0f;
    const float f = t - n; /* in [-0.5, 0.5] */
    float p = 1.5353362e-4f;
    p = p * f + 1.3398874e-3f;
    p = p * f + 9.6180346e-3f;
    p = p * f + 5.5503406e-2f;
    p = p * f + 2.4022652e-1f;
    p = p * f + 6.9314720e-1f;
    p = p * f + 1.0f;
    int32_t bits;
    memcpy(&bits, &p, sizeof bits);
    bits += (int32_t)n << 23;
    float r;
    memcpy(&r, &bits, sizeof r);
    return r;
}


#if defined(__AVX512F__)
#include <immintrin.h>

/* Lane t of the result = the sum of v[t]'s 16 lanes: a transpose-and-add tree
 * (45 shuffles and adds for 16 vectors instead of ~9 per vector). */
static inline __m512 sum16(const __m512 v[16]) {
    __m512 a[8], b[4];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3] */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int j = 0; j < 4; j++) { /* per 128-bit lane: tokens 4j..4j+3, that lane's part of each sum */
        const __m512d x = _mm512_castps_pd(a[2 * j]), y = _mm512_castps_pd(a[2 * j + 1]);
        b[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    /* Add the four 128-bit lanes of each b[j] and put b[j]'s total in lane j. */
    const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x44), _mm512_shuffle_f32x4(b[0], b[1], 0xEE));
    const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x44), _mm512_shuffle_f32x4(b[2], b[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
}

/* 32 bf16 (one 64-byte load) as two float32 vectors: a bf16 is the top half
 * of a float32, so the 16 even elements come by a shift and the 16 odd ones
 * by a mask, one operation each where widening 16 in order takes two. */
ALWAYS_INLINE __m512 bf16_evens(__m512i pairs) { return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)); }
ALWAYS_INLINE __m512 bf16_odds(__m512i pairs) {
    return _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32((int)0xffff0000u)));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define HAVE_AVX512_BF16 1

/* 16 bf16 values <-> float32 lanes. The narrowing is vcvtneps2bf16: round to
 * nearest even, NaN kept quiet, as torch rounds. */
ALWAYS_INLINE __m512 load16_bf16(const void *src) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)src);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

ALWAYS_INLINE __m256i narrow16_bf16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }

ALWAYS_INLINE void store16_bf16(void *dst, __m512 x) { _mm256_storeu_si256((__m256i *)dst, narrow16_bf16(x)); }

/* x rounded to bf16 and widened back. */
ALWAYS_INLINE __m512 round16_bf16(__m512 x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(narrow16_bf16(x)), 16));
}

/* 16 quantized cache values (before their scale) as float32 lanes. e4m3
 * bytes are moved into float16 bit positions (see e4m3_to_float) and widened
 * by vcvtph2ps: the results are 2^-8 of the values; the caller folds the 2^8
 * into the scale. */
ALWAYS_INLINE __m512 load16_i8(const void *src) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)src)));
}

ALWAYS_INLINE __m512 load16_e4m3_scaled_down(const void *src) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)src));
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8);
    const __m256i rest = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7);
    return _mm512_cvtph_ps(_mm256_or_si256(sign, rest));
}

/* exp_nonpositive for 16 lanes; the power of two is applied with vscalefps. */
ALWAYS_INLINE __m512 exp16_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.5353362e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3398874e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6180346e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5503406e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022652e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314720e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}
#endif

#endif
