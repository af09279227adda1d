/* Fused elementwise ops of a decoder layer (CPU): one pass over the data
 * where torch runs several ops, each reading and writing the whole tensor.
 *
 * Every op rounds where the reference implementation (transformers, step by
 * step in torch) rounds, so bf16/f16 results match it: each intermediate
 * that torch would store in the model dtype is rounded to it here too.
 * All tensors are contiguous, in one dtype (`dtype`: see common.h).
 * Rows are split across torch's OpenMP threads when there is enough work.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

/* Below this many elements a parallel region costs more than it saves. */
#define PARALLEL_MIN 32768
/* Columns converted to float32 at a time: a few KiB on the stack, vectorised loops. */
#define CHUNK 256

ALWAYS_INLINE const char *row_at(const void *base, int64_t row, int64_t row_elems, int dtype) {
    return (const char *)base + row * row_elems * element_size(dtype);
}

/* RMSNorm as transformers computes it: x in float32, x * rsqrt(mean(x^2) + eps)
 * rounded to the dtype, then times the weight (a dtype product, rounded).
 * With `residual` (not NULL) the input is first x + residual rounded to the
 * dtype, and that sum is written back to `residual`: the next layer's
 * residual stream. x, residual, out [rows, dim]; weight [dim]. */
#ifdef HAVE_AVX512_BF16
/* rms_norm_row for bf16 rows of a multiple of 16, with native bf16 rounding. */
static void rms_norm_row_bf16(const char *src, char *res, const void *weight, char *dst, int64_t dim, float eps) {
    __m512 squares = _mm512_setzero_ps();
    for (int64_t c = 0; c < dim; c += 16) {
        __m512 a = load16_bf16(src + c * 2);
        if (res) {
            a = round16_bf16(_mm512_add_ps(a, load16_bf16(res + c * 2)));
            store16_bf16(res + c * 2, a);
        }
        squares = _mm512_fmadd_ps(a, a, squares);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(squares) / (float)dim + eps));
    const char *normed_src = res ? res : src;
    for (int64_t c = 0; c < dim; c += 16) {
        const __m512 normed = round16_bf16(_mm512_mul_ps(load16_bf16(normed_src + c * 2), inv));
        store16_bf16(dst + c * 2, _mm512_mul_ps(load16_bf16((const char *)weight + c * 2), normed));
    }
}
#endif

ALWAYS_INLINE void rms_norm_row(const char *src, char *res, const void *weight, char *dst, int64_t dim, float eps,
                               const int dtype) {
#ifdef HAVE_AVX512_BF16
        if (dtype == BF16 && dim % 16 == 0) {
            rms_norm_row_bf16(src, res, weight, dst, dim, eps);
            return;
        }
#endif
        const int64_t es = element_size(dtype);
        float a[CHUNK], b[CHUNK];
        float squares = 0.0f;
        for (int64_t c = 0; c < dim; c += CHUNK) {
            const int64_t n = dim - c < CHUNK ? dim - c : CHUNK;
            load_row(src + c * es, dtype, n, a);
            if (res) {
                load_row(res + c * es, dtype, n, b);
#pragma omp simd
                for (int64_t i = 0; i < n; i++) a[i] = round_to(a[i] + b[i], dtype);
                store_row(a, dtype, n, res + c * es);
            }
#pragma omp simd reduction(+ : squares)
            for (int64_t i = 0; i < n; i++) squares += a[i] * a[i];
        }
        const float inv = 1.0f / sqrtf(squares / (float)dim + eps);
        const char *normed_src = res ? res : src;
        for (int64_t c = 0; c < dim; c += CHUNK) {
            const int64_t n = dim - c < CHUNK ? dim - c : CHUNK;
            load_row(normed_src + c * es, dtype, n, a);
            load_row((const char *)weight + c * es, dtype, n, b);
#pragma omp simd
            for (int64_t i = 0; i < n; i++) a[i] = round_to(b[i] * round_to(a[i] * inv, dtype), dtype);
            store_row(a, dtype, n, dst + c * es);
        }
}

void octavo_rms_norm(const void *x, void *residual, const void *weight, void *out, int64_t rows, int64_t dim,
                     float eps, int dtype) {
#pragma omp parallel for schedule(static) if (rows * dim >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const char *src = row_at(x, r, dim, dtype);
        char *res = residual ? (char *)row_at(residual, r, dim, dtype) : NULL;
        char *dst = (char *)row_at(out, r, dim, dtype);
        DTYPE_SWITCH(dtype, rms_norm_row(src, res, weight, dst, dim, eps, dt));
    }
}

/* silu(gate) * up over a fused gate/up projection's output: gate_up
 * [rows, 2 * inter] (gate first), out [rows, inter]. silu is rounded to the
 * dtype before the product, as torch's two ops do. */
ALWAYS_INLINE void silu_mul_row(const char *gate, char *dst, int64_t inter, const int dtype) {
        const int64_t es = element_size(dtype);
        const char *up = gate + inter * es;
        int64_t c = 0;
#ifdef HAVE_AVX512_BF16
        if (dtype == BF16) {
            /* The loop below, 16 lanes at a time with native bf16 rounding. */
            const __m512 one = _mm512_set1_ps(1.0f);
            for (; c + 16 <= inter; c += 16) {
                const __m512 g = load16_bf16(gate + c * 2), u = load16_bf16(up + c * 2);
                const __m512 e = exp16_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
                const __mmask16 positive = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_GE_OQ);
                /* 1 / (1 + e) by vrcp14ps and one Newton step (float precision): a
                 * 512-bit divide has a fraction of the throughput and bounded this loop. */
                const __m512 denominator = _mm512_add_ps(one, e);
                __m512 inverse = _mm512_rcp14_ps(denominator);
                inverse = _mm512_mul_ps(inverse, _mm512_fnmadd_ps(denominator, inverse, _mm512_set1_ps(2.0f)));
                const __m512 sigmoid = _mm512_mul_ps(_mm512_mask_blend_ps(positive, e, one), inverse);
                store16_bf16(dst + c * 2, _mm512_mul_ps(round16_bf16(_mm512_mul_ps(g, sigmoid)), u));
            }
        }
#endif
        float g[CHUNK], u[CHUNK];
        for (; c < inter; c += CHUNK) {
            const int64_t n = inter - c < CHUNK ? inter - c : CHUNK;
            load_row(gate + c * es, dtype, n, g);
            load_row(up + c * es, dtype, n, u);
#pragma omp simd
            for (int64_t i = 0; i < n; i++) {
                /* sigmoid from e^-|x| (<= 1): no overflow for either sign. */
                const float e = exp_nonpositive(-fabsf(g[i]));
                const float sigmoid = (g[i] >= 0.0f ? 1.0f : e) / (1.0f + e);
                g[i] = round_to(round_to(g[i] * sigmoid, dtype) * u[i], dtype);
            }
            store_row(g, dtype, n, dst + c * es);
        }
}

void octavo_silu_mul(const void *gate_up, void *out, int64_t rows, int64_t inter, int dtype) {
#pragma omp parallel for schedule(static) if (rows * inter >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const char *gate = row_at(gate_up, r, 2 * inter, dtype);
        char *dst = (char *)row_at(out, r, inter, dtype);
        DTYPE_SWITCH(dtype, silu_mul_row(gate, dst, inter, dt));
    }
}

/* Rotate one head in place by the half-split convention:
 * x * cos + rotate_half(x) * sin, each product and the sum rounded to the dtype. */
ALWAYS_INLINE void rotate_head(char *head, const float *cos_row, const float *sin_row, int64_t head_dim,
                              const int dtype) {
    float x[512], y[512];
    const int64_t half = head_dim / 2;
    load_row(head, dtype, head_dim, x);
#pragma omp simd
    for (int64_t i = 0; i < half; i++)
        y[i] = round_to(round_to(x[i] * cos_row[i], dtype) + round_to(-x[i + half] * sin_row[i], dtype), dtype);
#pragma omp simd
    for (int64_t i = half; i < head_dim; i++)
        y[i] = round_to(round_to(x[i] * cos_row[i], dtype) + round_to(x[i - half] * sin_row[i], dtype), dtype);
    store_row(y, dtype, head_dim, head);
}

#ifdef HAVE_AVX512_BF16
/* rotate_head for bf16 heads whose half is a multiple of 16 lanes, with native bf16 rounding. */
static void rotate_head_bf16(char *head, const float *cos_row, const float *sin_row, int64_t head_dim) {
    const int64_t half = head_dim / 2;
    char *upper = head + half * 2;
    for (int64_t i = 0; i < half; i += 16) {
        const __m512 x1 = load16_bf16(head + i * 2), x2 = load16_bf16(upper + i * 2);
        const __m512 c1 = _mm512_loadu_ps(cos_row + i), s1 = _mm512_loadu_ps(sin_row + i);
        const __m512 c2 = _mm512_loadu_ps(cos_row + half + i), s2 = _mm512_loadu_ps(sin_row + half + i);
        /* rotate_half(x) = (-x2, x1); rounding -(x2 * s) equals rounding (-x2) * s. */
        const __m512 y1 = _mm512_sub_ps(round16_bf16(_mm512_mul_ps(x1, c1)), round16_bf16(_mm512_mul_ps(x2, s1)));
        const __m512 y2 = _mm512_add_ps(round16_bf16(_mm512_mul_ps(x2, c2)), round16_bf16(_mm512_mul_ps(x1, s2)));
        store16_bf16(head + i * 2, y1);
        store16_bf16(upper + i * 2, y2);
    }
}
#endif

/* One head's row x[n] (float32) into a quantized cache row: symmetric, the
 * scale max|x| / qmax (int8: 127, e4m3: 448), or `fixed` when > 0 (a static
 * per-head scale from the checkpoint; values beyond its range saturate).
 * Divides, rounds and clamps as kv_quant.quantize does in torch, so both
 * paths store the same bytes. Returns the scale. */
static float quantize_row(const float *x, int64_t n, int kind, float fixed, void *dst) {
    const float qmax = kind == I8 ? 127.0f : 448.0f;
    float scale = fixed;
    if (!(fixed > 0.0f)) {
        float peak = 0.0f;
#pragma omp simd reduction(max : peak)
        for (int64_t i = 0; i < n; i++) peak = fabsf(x[i]) > peak ? fabsf(x[i]) : peak;
        scale = peak / qmax;
        scale = scale == 0.0f ? 1.0f : scale; /* an all-zero row: any scale stores it exactly */
    }
    if (kind == I8) {
        int8_t *d = (int8_t *)dst;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) {
            float y = x[i] / scale;
            y = y > qmax ? qmax : (y < -qmax ? -qmax : y);
            d[i] = (int8_t)nearbyintf(y);
        }
    } else {
        uint8_t *d = (uint8_t *)dst;
        for (int64_t i = 0; i < n; i++) {
            float y = x[i] / scale;
            y = y > qmax ? qmax : (y < -qmax ? -qmax : y);
            d[i] = float_to_e4m3(y);
        }
    }
    return scale;
}

/* Rotary embedding and the K/V cache write of a fused q/k/v projection's
 * output. qkv [rows, (heads + 2 kv_heads) * head_dim]: q and k are rotated
 * in place; then k and v go to their cache slots. cos, sin [rows, head_dim]
 * (model dtype); k_cache, v_cache [num_slots, kv_heads, head_dim] of
 * cache_dtype; slots [rows].
 *
 * A quantized cache (cache_dtype I8 or FP8) takes each head's row quantized,
 * its scale stored at k_scales / v_scales [num_slots / block_size, kv_heads,
 * block_size] (float32); static_scales [2, kv_heads] (K's, then V's) fixes
 * them when not NULL. Otherwise cache_dtype equals dtype and rows are copied.
 * Returns 0; -1 when head_dim is odd or above 512, -2 when a slot is not in
 * [0, num_slots) (nothing is written then). */
int octavo_rotary_write_kv(void *qkv, int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim,
                           const void *cos, const void *sin, void *k_cache, void *v_cache, const int64_t *slots,
                           int64_t num_slots, int dtype, int cache_dtype, float *k_scales, float *v_scales,
                           const float *static_scales, int64_t block_size) {
    if (head_dim > 512 || head_dim % 2) return -1;
    for (int64_t r = 0; r < rows; r++)
        if (slots[r] < 0 || slots[r] >= num_slots) return -2;
    const int64_t es = element_size(dtype), width = (heads + 2 * kv_heads) * head_dim;
    const int64_t rotated_heads = heads + kv_heads, kv_bytes = kv_heads * head_dim * es;
    const int quantized = cache_dtype == I8 || cache_dtype == FP8;
#pragma omp parallel for schedule(static) if (rows * width >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        char *row = (char *)qkv + r * width * es;
        float c[512], s[512];
        DTYPE_SWITCH(dtype, load_row(row_at(cos, r, head_dim, dt), dt, head_dim, c);
                            load_row(row_at(sin, r, head_dim, dt), dt, head_dim, s));
#ifdef HAVE_AVX512_BF16
        if (dtype == BF16 && head_dim % 32 == 0) {
            for (int64_t h = 0; h < rotated_heads; h++) rotate_head_bf16(row + h * head_dim * es, c, s, head_dim);
        } else
#endif
            DTYPE_SWITCH(dtype, for (int64_t h = 0; h < rotated_heads; h++)
                                    rotate_head(row + h * head_dim * es, c, s, head_dim, dt));
        const char *k = row + heads * head_dim * es;
        if (!quantized) {
            memcpy((char *)k_cache + slots[r] * kv_bytes, k, (size_t)kv_bytes);
            memcpy((char *)v_cache + slots[r] * kv_bytes, k + kv_bytes, (size_t)kv_bytes);
            continue;
        }
        const int64_t block = slots[r] / block_size, offset = slots[r] % block_size;
        for (int pass = 0; pass < 2; pass++) {
            char *cache = (char *)(pass == 0 ? k_cache : v_cache) + slots[r] * kv_heads * head_dim;
            float *scales = (pass == 0 ? k_scales : v_scales) + block * kv_heads * block_size + offset;
            for (int64_t h = 0; h < kv_heads; h++) {
                float x[512];
                DTYPE_SWITCH(dtype, load_row(k + (pass * kv_heads + h) * head_dim * es, dt, head_dim, x));
                const float fixed = static_scales ? static_scales[pass * kv_heads + h] : 0.0f;
                scales[h * block_size] = quantize_row(x, head_dim, cache_dtype, fixed, cache + h * head_dim);
            }
        }
    }
    return 0;
}

#ifdef HAVE_AVX512_BF16
/* One bf16 row in a single pass: each lane keeps its first maximum (only a
 * strictly greater value replaces it), then the smallest index among the
 * lanes holding the peak wins. -1 when the row holds a NaN: the exact path
 * below then finds the first one. */
static int64_t argmax_row_bf16(const uint16_t *row, int64_t vocab) {
    __m512 best = _mm512_set1_ps(-INFINITY);
    __m512i best_at = _mm512_setzero_si512();
    __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __mmask16 nans = 0;
    for (int64_t c = 0; c < vocab; c += 16) {
        const __mmask16 m = vocab - c >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (vocab - c)) - 1u);
        const __m512 v =
            _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, row + c)), 16));
        const __mmask16 greater = _mm512_mask_cmp_ps_mask(m, v, best, _CMP_GT_OQ);
        nans |= _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q);
        best = _mm512_mask_mov_ps(best, greater, v);
        best_at = _mm512_mask_mov_epi32(best_at, greater, at);
        at = _mm512_add_epi32(at, _mm512_set1_epi32(16));
    }
    if (nans) return -1;
    const __mmask16 holders = _mm512_cmp_ps_mask(best, _mm512_set1_ps(_mm512_reduce_max_ps(best)), _CMP_EQ_OQ);
    return _mm512_mask_reduce_min_epi32(holders, best_at);
}
#endif

/* Index of each row's first maximum (a NaN counts as the maximum, as in
 * torch.max). logits [rows, vocab]; out [rows] int64. */
void octavo_argmax(const void *logits, int64_t rows, int64_t vocab, int64_t *out, int dtype) {
#pragma omp parallel for schedule(static) if (rows * vocab >= 4 * PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const char *src = row_at(logits, r, vocab, dtype);
#ifdef HAVE_AVX512_BF16
        if (dtype == BF16 && vocab < INT32_MAX) {
            const int64_t found = argmax_row_bf16((const uint16_t *)src, vocab);
            if (found >= 0) {
                out[r] = found;
                continue;
            }
        }
#endif
        const int64_t es = element_size(dtype);
        float a[CHUNK];
        float peak = -INFINITY;
        int nans = 0;
        for (int64_t c = 0; c < vocab; c += CHUNK) {
            const int64_t n = vocab - c < CHUNK ? vocab - c : CHUNK;
            load_row(src + c * es, dtype, n, a);
#pragma omp simd reduction(max : peak) reduction(| : nans)
            for (int64_t i = 0; i < n; i++) {
                peak = a[i] > peak ? a[i] : peak;
                nans |= a[i] != a[i];
            }
        }
        /* Second pass: the first index holding the peak (the first NaN if any). The row
         * is in cache by now. */
        int64_t found = 0;
        for (int64_t c = 0; c < vocab; c += CHUNK) {
            const int64_t n = vocab - c < CHUNK ? vocab - c : CHUNK;
            load_row(src + c * es, dtype, n, a);
            int64_t hit = -1;
            for (int64_t i = 0; i < n; i++) {
                if (nans ? a[i] != a[i] : a[i] == peak) {
                    hit = i;
                    break;
                }
            }
            if (hit >= 0) {
                found = c + hit;
                break;
            }
        }
        out[r] = found;
    }
}
