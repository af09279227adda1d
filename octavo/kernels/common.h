/* Helpers shared by the CPU kernels: dtype codes, row conversion to and from
 * float32, a vectorisable exp. Included by each kernel's .c file; build.py
 * hashes this header into every kernel's cache key. */
#ifndef OCTAVO_KERNELS_COMMON_H
#define OCTAVO_KERNELS_COMMON_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* The codes the Python wrappers pass for torch.float32 / bfloat16 / float16. */
enum { F32 = 0, BF16 = 1, F16 = 2 };

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

ALWAYS_INLINE int64_t element_size(int dtype) { return dtype == F32 ? 4 : 2; }

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
    } else {
        const _Float16 *s = (const _Float16 *)src;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) dst[i] = (float)s[i];
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


#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
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
