/* y = x W^T (+ bias) for a few rows of bf16 activations and bf16 weights (CPU).
 *
 * torch's CPU bf16 matmul is built for big batches: with one to a few rows it
 * reads the weights at well under the memory bandwidth, and batch-1 decode
 * is nothing but such products. Here each thread streams a contiguous slice
 * of weight rows once for all the input rows, multiplying bf16 pairs with
 * vdpbf16ps (exact products, float32 sums), and rounds the result to bf16
 * like torch does.
 *
 * Layouts (contiguous): x [m, k], w [n, k], bias [n] or NULL, y [m, n].
 * Built by octavo/kernels/build.py; without AVX512-BF16 the entry point says
 * so (returns -1) and the caller keeps torch's matmul.
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_AVX512_BF16 1
#endif

#define MAX_ROWS 4 /* beyond 4 rows torch's matmul is as fast or faster (measured) */

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);                  /* round to nearest even */
}

int octavo_bf16_gemv_available(void) {
#ifdef HAVE_AVX512_BF16
    return 1;
#else
    return 0;
#endif
}

/* Returns 0, or -1 when this build cannot run it (no AVX512-BF16, too many rows). */
int octavo_bf16_gemv(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                     int64_t m, int64_t n, int64_t k) {
#ifdef HAVE_AVX512_BF16
    if (m < 1 || m > MAX_ROWS) return -1;
    const int64_t full = k / 32 * 32;
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < n; j++) {
        const uint16_t *row = w + j * k;
        __m512 sums[MAX_ROWS];
        for (int64_t r = 0; r < m; r++) sums[r] = _mm512_setzero_ps();
        for (int64_t c = 0; c < full; c += 32) {
            const __m512bh wv = (__m512bh)_mm512_loadu_si512((const void *)(row + c));
            for (int64_t r = 0; r < m; r++) {
                const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + r * k + c));
                sums[r] = _mm512_dpbf16_ps(sums[r], wv, xv);
            }
        }
        for (int64_t r = 0; r < m; r++) {
            float total = _mm512_reduce_add_ps(sums[r]);
            for (int64_t c = full; c < k; c++) total += bf16_to_float(row[c]) * bf16_to_float(x[r * k + c]);
            if (bias != NULL) total += bf16_to_float(bias[j]);
            y[r * n + j] = float_to_bf16(total);
        }
    }
    return 0;
#else
    (void)x, (void)w, (void)bias, (void)y, (void)m, (void)n, (void)k;
    return -1;
#endif
}
