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

enum { F32 = 0, BF16 = 1, F16 = 2 };

static inline void load_row(const void *src, int dtype, int64_t n, float *dst) {
    if (dtype == F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
    } else if (dtype == BF16) {
        const uint16_t *s = (const uint16_t *)src;
        uint32_t *d = (uint32_t *)dst;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) d[i] = (uint32_t)s[i] << 16;
    } else {
        const _Float16 *s = (const _Float16 *)src;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) dst[i] = (float)s[i];
    }
}

static inline void store_row(const float *src, int dtype, int64_t n, void *dst) {
    if (dtype == F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
    } else if (dtype == BF16) {
        uint16_t *d = (uint16_t *)dst;
        for (int64_t i = 0; i < n; i++) {
            uint32_t u;
            memcpy(&u, &src[i], sizeof u);
            if ((u & 0x7fffffffu) > 0x7f800000u) {
                d[i] = (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
            } else {
                d[i] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16); /* round to nearest even */
            }
        }
    } else {
        _Float16 *d = (_Float16 *)dst;
        for (int64_t i = 0; i < n; i++) d[i] = (_Float16)src[i];
    }
}

static inline int64_t element_size(int dtype) { return dtype == F32 ? 4 : 2; }

/* Returns 0, or -1 when a work buffer could not be allocated. */
int octavo_paged_decode(const void *q, void *out, int q_dtype,
                        const void *k_cache, const void *v_cache, int kv_dtype,
                        const int64_t *block_tables, int64_t table_width,
                        const int64_t *context_lens, int64_t num_seqs,
                        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                        int64_t block_size, int64_t window, float scale) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t q_elem = element_size(q_dtype), kv_elem = element_size(kv_dtype);
    const int64_t row_stride = num_kv_heads * head_dim; /* elements between tokens */
    int failed = 0;

#pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int64_t s = 0; s < num_seqs; s++) {
        for (int64_t g = 0; g < num_kv_heads; g++) {
            const int64_t end = context_lens[s];
            const int64_t begin = (window > 0 && end > window) ? end - window : 0;
            const int64_t n = end - begin;
            const int64_t *table = block_tables + s * table_width;
            /* q (scaled), accumulators, one K/V row, then the scores. */
            float *work = malloc(sizeof(float) * (size_t)(2 * group * head_dim + head_dim + group * n));
            if (work == NULL) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            float *qf = work, *acc = qf + group * head_dim, *row = acc + group * head_dim;
            float *scores = row + head_dim;

            for (int64_t h = 0; h < group; h++) {
                const char *src = (const char *)q + ((s * num_heads + g * group + h) * head_dim) * q_elem;
                load_row(src, q_dtype, head_dim, qf + h * head_dim);
                for (int64_t d = 0; d < head_dim; d++) qf[h * head_dim + d] *= scale;
            }
            for (int64_t t = 0; t < n; t++) {
                const int64_t pos = begin + t;
                const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
                load_row((const char *)k_cache + (slot * row_stride + g * head_dim) * kv_elem, kv_dtype, head_dim, row);
                for (int64_t h = 0; h < group; h++) {
                    const float *qh = qf + h * head_dim;
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t d = 0; d < head_dim; d++) dot += qh[d] * row[d];
                    scores[h * n + t] = dot;
                }
            }
            for (int64_t h = 0; h < group; h++) {
                float *sh = scores + h * n, peak = -INFINITY, total = 0.0f;
                for (int64_t t = 0; t < n; t++) peak = sh[t] > peak ? sh[t] : peak;
                for (int64_t t = 0; t < n; t++) {
                    sh[t] = expf(sh[t] - peak);
                    total += sh[t];
                }
                const float inv = n > 0 ? 1.0f / total : 0.0f;
                for (int64_t t = 0; t < n; t++) sh[t] *= inv;
            }
            memset(acc, 0, sizeof(float) * (size_t)(group * head_dim));
            for (int64_t t = 0; t < n; t++) {
                const int64_t pos = begin + t;
                const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
                load_row((const char *)v_cache + (slot * row_stride + g * head_dim) * kv_elem, kv_dtype, head_dim, row);
                for (int64_t h = 0; h < group; h++) {
                    const float p = scores[h * n + t];
                    float *ah = acc + h * head_dim;
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; d++) ah[d] += p * row[d];
                }
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
