/* Decode attention read straight from the paged KV cache (CPU).
 *
 * One query token per sequence. Each (sequence, KV head) work item walks the
 * sequence's block table, so K/V are read once in place: no gather copy, no
 * padding to the longest context in the batch, no mask tensor. The query
 * heads sharing a KV head (GQA) are handled together, so each K/V row is
 * loaded and converted once per group.
 *
 * Built on first use by octavo/kernels/build.py with the machine's C compiler
 * (-O3 -march=native -fopenmp) and called through ctypes. Linked against
 * libgomp.so.1, which resolves to the copy torch has already loaded, so the
 * kernel shares torch's OpenMP thread pool and thread count.
 *
 * Layouts (all contiguous):
 *   q, out        [num_seqs, num_heads, head_dim]
 *   k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables  [num_seqs, table_width] int64
 *   context_lens  [num_seqs] int64: the query attends to positions 0..len-1
 * window > 0 keeps only the last `window` positions (sliding window).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#define PREFETCH_AHEAD 1

/* Blocks sit anywhere in the pool, so the hardware prefetcher cannot see the
 * next one coming: ask for its rows of this KV head while the current block
 * is being read. */
static inline void prefetch_block(const char *base, const int64_t *table, int64_t index, int64_t end_index,
                                  int64_t block_size, int64_t row_bytes, int64_t head_bytes) {
    if (index >= end_index) return;
    const char *src = base + table[index] * block_size * row_bytes;
    for (int64_t i = 0; i < block_size; i++, src += row_bytes)
        for (int64_t off = 0; off < head_bytes; off += 64) __builtin_prefetch(src + off, 0, 3);
}

/* scores[h * n + t] for t in 0..n-1: softmax weights of the query heads of one group. */
static void softmax_rows(float *scores, int64_t group, int64_t n) {
    for (int64_t h = 0; h < group; h++) {
        float *sh = scores + h * n, peak = -INFINITY, total = 0.0f;
#pragma omp simd reduction(max : peak)
        for (int64_t t = 0; t < n; t++) peak = sh[t] > peak ? sh[t] : peak;
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < n; t++) {
            sh[t] = exp_nonpositive(sh[t] - peak);
            total += sh[t];
        }
        const float inv = 1.0f / total;
#pragma omp simd
        for (int64_t t = 0; t < n; t++) sh[t] *= inv;
    }
}

/* One (sequence, KV head) item, any dtypes: rows converted to float32 first. */
static void attend_generic(const float *qf, const char *k_base, const char *v_base, int kv_dtype,
                           const int64_t *table, int64_t begin, int64_t n, int64_t group, int64_t head_dim,
                           int64_t block_size, int64_t row_bytes, float *row, float *scores, float *acc) {
    for (int pass = 0; pass < 2; pass++) {
        const char *base = pass == 0 ? k_base : v_base;
        int64_t t = 0, pos = begin;
        while (t < n) {
            const int64_t block = table[pos / block_size], first = pos % block_size;
            const int64_t count = (block_size - first < n - t) ? block_size - first : n - t;
            const char *src = base + (block * block_size + first) * row_bytes;
            for (int64_t i = 0; i < count; i++, t++, src += row_bytes) {
                load_row(src, kv_dtype, head_dim, row);
                for (int64_t h = 0; h < group; h++) {
                    if (pass == 0) {
                        const float *qh = qf + h * head_dim;
                        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                        for (int64_t d = 0; d < head_dim; d++) dot += qh[d] * row[d];
                        scores[h * n + t] = dot;
                    } else {
                        const float p = scores[h * n + t];
                        float *ah = acc + h * head_dim;
#pragma omp simd
                        for (int64_t d = 0; d < head_dim; d++) ah[d] += p * row[d];
                    }
                }
            }
            pos += count;
        }
        if (pass == 0) softmax_rows(scores, group, n);
    }
}

#ifdef HAVE_AVX512_BF16
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

/* bf16 queries and cache, head_dim a multiple of 32: q.k with vdpbf16ps on the
 * raw bf16 pairs (exact products, float32 sums), p.v in float32. qb holds the
 * unscaled bf16 query heads; the scale is applied to the float32 scores.
 * Inlined into dispatch() with constant group and head_dim for the common
 * shapes, so the loops unroll and the p.v accumulators live in registers. */
#define MAX_REG_ACC 24 /* zmm accumulators kept in registers (of 32) */
static inline __attribute__((always_inline)) void attend_bf16(
    const uint16_t *qb, float scale, const char *k_base, const char *v_base, const int64_t *table,
    int64_t begin, int64_t n, int64_t group, int64_t head_dim, int64_t block_size, int64_t row_bytes,
    float *scores, float *acc) {
    const int64_t chunks = head_dim / 32, lanes = head_dim / 16;
    const int64_t last_block = (begin + n - 1) / block_size + 1; /* one past the last block read */
    int64_t t = 0, pos = begin;
    while (t < n) {
        const int64_t block = table[pos / block_size], first = pos % block_size;
        const int64_t count = (block_size - first < n - t) ? block_size - first : n - t;
        prefetch_block(k_base, table, pos / block_size + PREFETCH_AHEAD, last_block, block_size, row_bytes, head_dim * 2);
        const char *src = k_base + (block * block_size + first) * row_bytes;
        /* Up to 16 tokens at a time: their 16 partial-sum vectors are reduced
         * together (sum16), far cheaper than one horizontal sum each. */
        for (int64_t i0 = 0; i0 < count; i0 += 16) {
            const int64_t m = count - i0 < 16 ? count - i0 : 16;
            for (int64_t h = 0; h < group; h++) {
                __m512 sums[16];
                const char *row = src + i0 * row_bytes;
                for (int64_t i = 0; i < 16; i++, row += row_bytes) {
                    __m512 sum = _mm512_setzero_ps();
                    if (i < m) {
                        for (int64_t c = 0; c < chunks; c++) {
                            const __m512i k = _mm512_loadu_si512((const void *)(row + c * 64));
                            const __m512i q = _mm512_loadu_si512((const void *)(qb + h * head_dim + c * 32));
                            sum = _mm512_dpbf16_ps(sum, (__m512bh)k, (__m512bh)q);
                        }
                    }
                    sums[i] = sum;
                }
                const __m512 dots = _mm512_mul_ps(sum16(sums), _mm512_set1_ps(scale));
                _mm512_mask_storeu_ps(scores + h * n + t + i0, (__mmask16)((1u << m) - 1u), dots);
            }
        }
        t += count;
        pos += count;
    }
    softmax_rows(scores, group, n);
    const int in_registers = group * lanes <= MAX_REG_ACC;
    __m512 regs[MAX_REG_ACC];
    if (in_registers)
        for (int64_t j = 0; j < group * lanes; j++) regs[j] = _mm512_setzero_ps();
    t = 0, pos = begin;
    while (t < n) {
        const int64_t block = table[pos / block_size], first = pos % block_size;
        const int64_t count = (block_size - first < n - t) ? block_size - first : n - t;
        prefetch_block(v_base, table, pos / block_size + PREFETCH_AHEAD, last_block, block_size, row_bytes, head_dim * 2);
        const char *src = v_base + (block * block_size + first) * row_bytes;
        for (int64_t i = 0; i < count; i++, t++, src += row_bytes) {
            for (int64_t c = 0; c < lanes; c++) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(src + c * 32));
                const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
                for (int64_t h = 0; h < group; h++) {
                    const __m512 p = _mm512_set1_ps(scores[h * n + t]);
                    if (in_registers) {
                        regs[h * lanes + c] = _mm512_fmadd_ps(p, v, regs[h * lanes + c]);
                    } else {
                        float *a = acc + h * head_dim + c * 16;
                        _mm512_storeu_ps(a, _mm512_fmadd_ps(p, v, _mm512_loadu_ps(a)));
                    }
                }
            }
        }
        pos += count;
    }
    if (in_registers)
        for (int64_t j = 0; j < group * lanes; j++) _mm512_storeu_ps(acc + j * 16, regs[j]);
}

/* attend_bf16 specialised for the common (group, head_dim) pairs. */
static void dispatch_bf16(const uint16_t *qb, float scale, const char *k_base, const char *v_base,
                          const int64_t *table, int64_t begin, int64_t n, int64_t group, int64_t head_dim,
                          int64_t block_size, int64_t row_bytes, float *scores, float *acc) {
#define OCTAVO_SHAPE(G, D)                                                                             \
    if (group == G && head_dim == D) {                                                                 \
        attend_bf16(qb, scale, k_base, v_base, table, begin, n, G, D, block_size, row_bytes, scores, acc); \
        return;                                                                                        \
    }
    OCTAVO_SHAPE(1, 64) OCTAVO_SHAPE(2, 64) OCTAVO_SHAPE(3, 64) OCTAVO_SHAPE(4, 64)
    OCTAVO_SHAPE(5, 64) OCTAVO_SHAPE(6, 64) OCTAVO_SHAPE(7, 64) OCTAVO_SHAPE(8, 64)
    OCTAVO_SHAPE(1, 128) OCTAVO_SHAPE(2, 128) OCTAVO_SHAPE(3, 128) OCTAVO_SHAPE(4, 128)
    OCTAVO_SHAPE(5, 128) OCTAVO_SHAPE(6, 128) OCTAVO_SHAPE(7, 128) OCTAVO_SHAPE(8, 128)
#undef OCTAVO_SHAPE
    attend_bf16(qb, scale, k_base, v_base, table, begin, n, group, head_dim, block_size, row_bytes, scores, acc);
}
#endif

/* Returns 0, or -1 when a work buffer could not be allocated. */
int octavo_paged_decode(const void *q, void *out, int q_dtype,
                        const void *k_cache, const void *v_cache, int kv_dtype,
                        const int64_t *block_tables, int64_t table_width,
                        const int64_t *context_lens, int64_t num_seqs,
                        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                        int64_t block_size, int64_t window, float scale) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t q_elem = element_size(q_dtype), kv_elem = element_size(kv_dtype);
    const int64_t row_bytes = num_kv_heads * head_dim * kv_elem; /* between consecutive tokens */
#ifdef HAVE_AVX512_BF16
    const int fast_bf16 = q_dtype == BF16 && kv_dtype == BF16 && head_dim % 32 == 0;
#else
    const int fast_bf16 = 0;
#endif
    int failed = 0;

#pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int64_t s = 0; s < num_seqs; s++) {
        for (int64_t g = 0; g < num_kv_heads; g++) {
            const int64_t end = context_lens[s];
            const int64_t begin = (window > 0 && end > window) ? end - window : 0;
            const int64_t n = end - begin;
            const int64_t *table = block_tables + s * table_width;
            const char *k_base = (const char *)k_cache + g * head_dim * kv_elem;
            const char *v_base = (const char *)v_cache + g * head_dim * kv_elem;
            const char *q_group = (const char *)q + (s * num_heads + g * group) * head_dim * q_elem;
            /* q (float32, scaled), accumulators, one K/V row, then the scores. */
            float *work = malloc(sizeof(float) * (size_t)(2 * group * head_dim + head_dim + group * n));
            if (work == NULL || n <= 0) {
                free(work);
#pragma omp atomic write
                failed = 1;
                continue;
            }
            float *qf = work, *acc = qf + group * head_dim, *row = acc + group * head_dim;
            float *scores = row + head_dim;
            memset(acc, 0, sizeof(float) * (size_t)(group * head_dim));
#ifdef HAVE_AVX512_BF16
            if (fast_bf16) {
                dispatch_bf16((const uint16_t *)q_group, scale, k_base, v_base, table, begin, n, group, head_dim,
                            block_size, row_bytes, scores, acc);
            } else
#endif
            {
                (void)fast_bf16;
                for (int64_t h = 0; h < group; h++) {
                    load_row(q_group + h * head_dim * q_elem, q_dtype, head_dim, qf + h * head_dim);
                    for (int64_t d = 0; d < head_dim; d++) qf[h * head_dim + d] *= scale;
                }
                attend_generic(qf, k_base, v_base, kv_dtype, table, begin, n, group, head_dim, block_size,
                               row_bytes, row, scores, acc);
            }
            for (int64_t h = 0; h < group; h++) {
                char *dst = (char *)out + ((s * num_heads + g * group + h) * head_dim) * q_elem;
                store_row(acc + h * head_dim, q_dtype, head_dim, dst);
            }
            free(work);
        }
    }
    return failed ? -1 : 0;
}
