/* Decode attention read straight from the paged KV cache (CPU).
 *
 * One query token per sequence. A work item is a sequence (at small batch: a
 * sequence's share of the KV heads, so that every thread has work) and walks
 * its block table, so K/V are read once in place: no gather copy, no padding
 * to the longest context in the batch, no mask tensor. The query heads
 * sharing a KV head (GQA) are handled together, so each K/V row is loaded
 * once per group.
 *
 * Memory: a block holds all KV heads' rows for its tokens, so a sequence's
 * K/V is a few contiguous spans at scattered places in the pool. A thread
 * reads them span by span, whole rows (every KV head) at a time, and keeps
 * prefetches running a fixed distance ahead through its next spans and next
 * sequences (the hardware prefetcher cannot guess where the next block
 * lies). Per-(sequence, KV head) items, which read 128-byte pieces of rows
 * at a stride and start cold, took 15.7 ms per batch-256 step of llama-100m;
 * this takes 9.4-10.3 (benchmarks/attention_kernel.py, BENCHMARKS.md).
 *
 * Arithmetic, bf16 q and cache: q.k with vdpbf16ps on the raw bf16 pairs
 * (exact products, float32 sums), p.v in float32 FMAs. (q.k on AMX tiles was
 * tried: no faster with the data in cache, slower from memory.) Other dtypes
 * convert rows to float32 first.
 *
 * Quantized caches (int8 or e4m3, one byte per element, a float32 scale per
 * token and KV head: octavo/attention/kv_quant.py): each 16-row tile of a KV
 * head is widened to float32 once (into L1) and serves the group's query
 * heads, held in float32 with the softmax scale folded in; the 16 rows' K
 * scales multiply the 16 scores with one vector load (scales are laid out
 * [block, kv_head, position] for that), and each row's V scale is folded into
 * its softmax weight. Half the bytes of bf16 are read per position.
 *
 * Built on first use by octavo/kernels/build.py with the machine's C compiler
 * (-O3 -march=native -fopenmp) and called through ctypes. Linked against
 * libgomp.so.1, which resolves to the copy torch has already loaded, so the
 * kernel shares torch's OpenMP thread pool and thread count.
 *
 * Layouts (contiguous but for q's sequences):
 *   q             [num_seqs, num_heads, head_dim], q_stride elements from one sequence to the next
 *                 (the engine's q is a view of its fused QKV projection: read in place, not copied)
 *   out           [num_seqs, num_heads, head_dim]
 *   k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]
 *   k_scales, v_scales [num_blocks, num_kv_heads, block_size] float32 (quantized caches; else NULL)
 *   block_tables  [num_seqs, ...] int64, table_width elements from one sequence's row to the next
 *                 (a view of the engine's wider table is read in place)
 *   context_lens  [num_seqs] int64: the query attends to positions 0..len-1
 * window > 0 keeps only the last `window` positions (sliding window).
 * softcap > 0 caps the scaled scores to softcap * tanh(score / softcap)
 * (Gemma 2) in one pass over them before the softmax; the score loops are
 * untouched, so models without a cap run exactly as before.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#if defined(__x86_64__)
#include <xmmintrin.h>
/* Results below float32's normal range become zero and such inputs are read
 * as zero (MXCSR FTZ and DAZ), for the kernel's threads while it runs. A
 * peaked softmax (a head leaning on its sink) leaves most weights near
 * exp(-87), whose products with values fall below it: each such product took
 * a microcode assist, and their sum changes the output by less than 1e-37.
 * Qwen2.5-0.5B's heads at 32k with queries scaled x100: 3.8 ms a layer, 1.8
 * flushed (as unscaled queries take). */
#define DENORMALS_ZERO 0x8040u
#endif

/* Return codes (the Python side turns them into exceptions). */
#define FAIL_MEMORY -1
#define FAIL_EMPTY_CONTEXT -2
/* Most work items per scheduling chunk: a thread reads ahead within its chunk. */
#define CHUNK_ITEMS 8
/* How far the prefetches run ahead of the compute (see read_ahead). */
#define READ_AHEAD_BYTES 32768

/* A work item is one sequence and a range of its KV heads: all of them when
 * there are sequences enough to keep every thread busy (rows are then read
 * whole), fewer at small batch so that the threads share a long context. */
typedef struct {
    int64_t parts;    /* items per sequence */
    int64_t per_part; /* KV heads per item (the last may have fewer) */
} item_split;

ALWAYS_INLINE void item_heads(const item_split *split, int64_t item, int64_t num_kv_heads, int64_t *kv0, int64_t *kv1) {
    *kv0 = item % split->parts * split->per_part;
    *kv1 = *kv0 + split->per_part < num_kv_heads ? *kv0 + split->per_part : num_kv_heads;
}

/* The K and V rows a thread reads, in its order: item after item of its
 * chunk, each one's K spans (a span: its positions in one block; of each row
 * the item's KV heads, contiguous), then its V spans. The compute calls
 * read_ahead_advance() with what it is about to consume, per KV head and 16
 * rows, so the prefetches stay READ_AHEAD_BYTES ahead of it, a few rows at a
 * time (whole spans per call were ~6% slower at context 300). Into L2
 * (prefetcht1): the distance mattered little (8-128 KiB within noise); into
 * L1 it was 10% slower, and prefetching only each page's first lines, to
 * start the hardware streamer, 1.5x slower. */
typedef struct {
    const char *cache[2]; /* K, V */
    const int64_t *block_tables, *context_lens;
    int64_t table_width, block_size, row_bytes, head_bytes, num_kv_heads, window;
    item_split split;
    int64_t item, end, pass, t; /* the next span to open: work item, K or V, position */
    const char *row;            /* the next row to prefetch (its first byte of the item's heads) */
    int64_t rows_left, cols;    /* rows left in the open span, bytes of each */
    int64_t credit;             /* bytes granted and not yet prefetched */
} read_ahead;

/* Open the span at the cursor: its rows, and where the item's columns start. */
static void read_ahead_open_span(read_ahead *ra) {
    const int64_t s = ra->item / ra->split.parts, len = ra->context_lens[s];
    int64_t kv0, kv1;
    item_heads(&ra->split, ra->item, ra->num_kv_heads, &kv0, &kv1);
    const int64_t begin = (ra->window > 0 && len > ra->window) ? len - ra->window : 0;
    const int64_t pos = begin + ra->t, first = pos % ra->block_size;
    const int64_t count = (ra->block_size - first < len - pos) ? ra->block_size - first : len - pos;
    const int64_t block = ra->block_tables[s * ra->table_width + pos / ra->block_size];
    ra->row = ra->cache[ra->pass] + (block * ra->block_size + first) * ra->row_bytes + kv0 * ra->head_bytes;
    ra->rows_left = count;
    ra->cols = (kv1 - kv0) * ra->head_bytes;
    ra->t += count;
    if (begin + ra->t >= len) { /* the next span is the item's V, or the next item's K */
        ra->t = 0;
        ra->item += ra->pass;
        ra->pass ^= 1;
    }
}

static void read_ahead_advance(read_ahead *ra, int64_t bytes) {
    ra->credit += bytes;
    while (ra->credit > 0) {
        if (ra->rows_left == 0) {
            if (ra->item >= ra->end) return;
            read_ahead_open_span(ra);
        }
        for (int64_t off = 0; off < ra->cols; off += 64) __builtin_prefetch(ra->row + off, 0, 2);
        ra->row += ra->row_bytes;
        ra->rows_left--;
        ra->credit -= ra->cols;
    }
}

/* scores[h * n + t] for t in 0..n-1: softmax weights of the query heads of one group. */
static void softmax_rows(float *scores, int64_t group, int64_t n) {
    for (int64_t h = 0; h < group; h++) {
        float *sh = scores + h * n;
#ifdef HAVE_AVX512_BF16
        /* 16 lanes at a time, the tail masked: no scalar remainder loops. */
        __m512 peak = _mm512_set1_ps(-INFINITY), total = _mm512_setzero_ps();
        for (int64_t t = 0; t < n; t += 16) {
            const __mmask16 m = n - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - t)) - 1u);
            peak = _mm512_max_ps(peak, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, sh + t));
        }
        const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(peak));
        for (int64_t t = 0; t < n; t += 16) {
            const __mmask16 m = n - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - t)) - 1u);
            const __m512 e = exp16_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sh + t), top));
            total = _mm512_mask_add_ps(total, m, total, e);
            _mm512_mask_storeu_ps(sh + t, m, e);
        }
        const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
        for (int64_t t = 0; t < n; t += 16) {
            const __mmask16 m = n - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - t)) - 1u);
            _mm512_mask_storeu_ps(sh + t, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, sh + t), inv));
        }
#else
        float peak = -INFINITY, total = 0.0f;
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
#endif
    }
}

/* softcap * tanh(x / softcap), from exp_nonpositive: tanh|t| = (1 - e) / (1 + e)
 * with e = exp(-2|t|). */
ALWAYS_INLINE float softcap_one(float x, float softcap) {
    const float t = x / softcap, e = exp_nonpositive(-2.0f * fabsf(t));
    const float th = (1.0f - e) / (1.0f + e);
    return softcap * (t < 0.0f ? -th : th);
}

/* scores[0 .. n-1] capped in place (generic path). */
static void softcap_scores(float *scores, int64_t n, float softcap) {
#pragma omp simd
    for (int64_t t = 0; t < n; t++) scores[t] = softcap_one(scores[t], softcap);
}

/* One (sequence, KV head) item, any dtypes: rows converted to float32 first.
 * k_sc, v_sc: the item's KV head's scales (quantized caches; else NULL), a
 * block's at block * scale_stride. */
static void attend_generic(const float *qf, const char *k_base, const char *v_base, int kv_dtype,
                           const float *k_sc, const float *v_sc, int64_t scale_stride,
                           const int64_t *table, int64_t begin, int64_t n, int64_t group, int64_t head_dim,
                           int64_t block_size, int64_t row_bytes, float softcap, float *row, float *scores,
                           float *acc) {
    for (int pass = 0; pass < 2; pass++) {
        const char *base = pass == 0 ? k_base : v_base;
        const float *sc = pass == 0 ? k_sc : v_sc;
        int64_t t = 0, pos = begin;
        while (t < n) {
            const int64_t block = table[pos / block_size], first = pos % block_size;
            const int64_t count = (block_size - first < n - t) ? block_size - first : n - t;
            const char *src = base + (block * block_size + first) * row_bytes;
            for (int64_t i = 0; i < count; i++, t++, src += row_bytes) {
                load_row(src, kv_dtype, head_dim, row);
                const float row_scale = sc ? sc[block * scale_stride + first + i] : 1.0f;
                for (int64_t h = 0; h < group; h++) {
                    if (pass == 0) {
                        const float *qh = qf + h * head_dim;
                        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                        for (int64_t d = 0; d < head_dim; d++) dot += qh[d] * row[d];
                        scores[h * n + t] = dot * row_scale;
                    } else {
                        const float p = scores[h * n + t] * row_scale;
                        float *ah = acc + h * head_dim;
#pragma omp simd
                        for (int64_t d = 0; d < head_dim; d++) ah[d] += p * row[d];
                    }
                }
            }
            pos += count;
        }
        if (pass == 0) {
            if (softcap > 0.0f) softcap_scores(scores, group * n, softcap);
            softmax_rows(scores, group, n);
        }
    }
}

#ifdef HAVE_AVX512_BF16
/* The bf16 path (bf16 q and cache, head_dim a multiple of 32). A sequence is
 * read span by span (a span: its tokens in one block), each span front to back
 * with all KV heads' rows, the order the hardware prefetcher streams best; per
 * KV head the group's query heads go together. scores[head * n + t] holds
 * query head `head`'s score of position begin + t. */
typedef struct {
    const int64_t *table;
    int64_t begin, n, block_size, row_bytes;
    int64_t kv0, kv1; /* the KV heads this item covers */
    int64_t kv_heads; /* of the cache: the stride of a block's scales is kv_heads * block_size */
} seq_view;

/* Position t's span: its first row and how many rows follow in the block. */
ALWAYS_INLINE const char *span_at(const seq_view *sv, const char *cache, int64_t t, int64_t *count) {
    const int64_t pos = sv->begin + t, first = pos % sv->block_size;
    *count = (sv->block_size - first < sv->n - t) ? sv->block_size - first : sv->n - t;
    return cache + (sv->table[pos / sv->block_size] * sv->block_size + first) * sv->row_bytes;
}

/* The scales of position t's span for KV head 0 (head kv's: + kv * block_size). */
ALWAYS_INLINE const float *span_scales(const seq_view *sv, const float *scales, int64_t t) {
    const int64_t pos = sv->begin + t;
    return scales + sv->table[pos / sv->block_size] * sv->kv_heads * sv->block_size + pos % sv->block_size;
}

/* q.k for one span with vdpbf16ps on the raw bf16 pairs (exact products,
 * float32 sums), up to 16 rows at a time: their 16 partial-sum vectors are
 * reduced together (sum16), far cheaper than one horizontal sum each. The
 * running maximum of each head's scores is kept lane-wise in peaks[head][16]. */
ALWAYS_INLINE void span_scores_avx512(const uint16_t *qb, float scale, const char *span, int64_t count, int64_t t,
                                      int64_t n, int64_t kv0, int64_t kv1, int64_t group, int64_t head_dim,
                                      int64_t row_bytes, float *scores, float *peaks, read_ahead *ra) {
    const int64_t chunks = head_dim / 32;
    for (int64_t i0 = 0; i0 < count; i0 += 16) {
        const int64_t m = count - i0 < 16 ? count - i0 : 16;
        for (int64_t kv = kv0; kv < kv1; kv++) {
            read_ahead_advance(ra, m * head_dim * 2);
            for (int64_t h = 0; h < group; h++) {
                const uint16_t *qh = qb + (kv * group + h) * head_dim;
                __m512 sums[16];
                const char *row = span + i0 * row_bytes + kv * head_dim * 2;
                for (int64_t i = 0; i < 16; i++, row += row_bytes) {
                    __m512 sum = _mm512_setzero_ps();
                    if (i < m) {
                        for (int64_t c = 0; c < chunks; c++) {
                            const __m512i k = _mm512_loadu_si512((const void *)(row + c * 64));
                            const __m512i q = _mm512_loadu_si512((const void *)(qh + c * 32));
                            sum = _mm512_dpbf16_ps(sum, (__m512bh)k, (__m512bh)q);
                        }
                    }
                    sums[i] = sum;
                }
                const __m512 dots = _mm512_mul_ps(sum16(sums), _mm512_set1_ps(scale));
                const __mmask16 valid = (__mmask16)((1u << m) - 1u);
                float *peak = peaks + (kv * group + h) * 16;
                _mm512_mask_storeu_ps(scores + (kv * group + h) * n + t + i0, valid, dots);
                _mm512_storeu_ps(peak, _mm512_mask_max_ps(_mm512_loadu_ps(peak), valid, _mm512_loadu_ps(peak), dots));
            }
        }
    }
}

/* 16 values of a quantized cache row as float32, before their scale (e4m3:
 * 2^-8 of it, see load16_e4m3_scaled_down; QUANT_UNIT undoes that). */
ALWAYS_INLINE __m512 load16_quant(const char *src, int kind) {
    return kind == I8 ? load16_i8(src) : load16_e4m3_scaled_down(src);
}
#define QUANT_UNIT(kind) ((kind) == I8 ? 1.0f : 256.0f)

/* span_scores_avx512 for a quantized cache. sc: the span's K scales (KV
 * head 0's; see span_scales). Each 16-row tile of a KV head is widened once
 * into `tile` (16 * head_dim floats of room) and serves the group's heads.
 *
 * int8 (INT8_DOTS): q holds each head's query as int16 (q ~= q16 * qscale,
 * qscale[head] with the softmax scale folded in), the rows are widened to
 * int16 and multiplied with vpdpwssd: exact products and int32 sums, 32 per
 * instruction as vdpbf16ps does, where float32 FMAs on rows widened to
 * float32 did 16 (the int8 path's arithmetic took 1.4x bf16's then). The
 * sums fit: 127 * 32767 * head_dim < 2^31 up to head_dim 512. A 15-bit query
 * is finer than the bf16 one it comes from for all but its smallest elements.
 * e4m3: q holds float32 queries times the softmax scale, rows widened to
 * float32, FMAs. */
#if defined(__AVX512VNNI__)
#define INT8_DOTS 1
#else
#define INT8_DOTS 0
#endif
ALWAYS_INLINE void span_scores_quant(const void *q, const float *qscale, const char *span, const float *sc,
                                     int64_t count, int64_t t, int64_t n, int64_t kv0, int64_t kv1, int64_t group,
                                     int64_t head_dim, int64_t row_bytes, int64_t block_size, int kind, void *tile,
                                     float *scores, float *peaks, read_ahead *ra) {
    const int int_dots = INT8_DOTS && kind == I8;
    const int64_t lanes = head_dim / 16, pairs = head_dim / 32;
    int16_t *tile16 = (int16_t *)tile;
    float *tilef = (float *)tile;
    for (int64_t i0 = 0; i0 < count; i0 += 16) {
        const int64_t m = count - i0 < 16 ? count - i0 : 16;
        const __mmask16 valid = (__mmask16)((1u << m) - 1u);
        for (int64_t kv = kv0; kv < kv1; kv++) {
            read_ahead_advance(ra, m * head_dim);
            const char *row = span + i0 * row_bytes + kv * head_dim;
            for (int64_t i = 0; i < m; i++, row += row_bytes) {
                if (int_dots)
                    for (int64_t c = 0; c < pairs; c++)
                        _mm512_storeu_si512((void *)(tile16 + i * head_dim + c * 32),
                                            _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(row + c * 32))));
                else
                    for (int64_t c = 0; c < lanes; c++)
                        _mm512_storeu_ps(tilef + i * head_dim + c * 16, load16_quant(row + c * 16, kind));
            }
            const __m512 k_scale = _mm512_mul_ps(_mm512_maskz_loadu_ps(valid, sc + kv * block_size + i0),
                                                 _mm512_set1_ps(QUANT_UNIT(kind)));
            for (int64_t h = 0; h < group; h++) {
                const int64_t head = kv * group + h;
                __m512 sums[16];
                for (int64_t i = 0; i < 16; i++) {
                    if (int_dots) {
                        const int16_t *qh = (const int16_t *)q + head * head_dim;
                        __m512i sum = _mm512_setzero_si512();
#if INT8_DOTS
                        if (i < m)
                            for (int64_t c = 0; c < pairs; c++)
                                sum = _mm512_dpwssd_epi32(sum, _mm512_loadu_si512((const void *)(tile16 + i * head_dim + c * 32)),
                                                          _mm512_loadu_si512((const void *)(qh + c * 32)));
#endif
                        sums[i] = _mm512_cvtepi32_ps(sum);
                    } else {
                        const float *qh = (const float *)q + head * head_dim;
                        __m512 sum = _mm512_setzero_ps();
                        if (i < m)
                            for (int64_t c = 0; c < lanes; c++)
                                sum = _mm512_fmadd_ps(_mm512_loadu_ps(tilef + i * head_dim + c * 16),
                                                      _mm512_loadu_ps(qh + c * 16), sum);
                        sums[i] = sum;
                    }
                }
                __m512 dots = _mm512_mul_ps(sum16(sums), k_scale);
                if (int_dots) dots = _mm512_mul_ps(dots, _mm512_set1_ps(qscale[head]));
                float *peak = peaks + head * 16;
                _mm512_mask_storeu_ps(scores + head * n + t + i0, valid, dots);
                _mm512_storeu_ps(peak, _mm512_mask_max_ps(_mm512_loadu_ps(peak), valid, _mm512_loadu_ps(peak), dots));
            }
        }
    }
}

/* Half of 32 bf16 at src as float32: the even elements (odd 0) or the odd ones. */
ALWAYS_INLINE __m512 load16_bf16_half(const char *src, int odd) {
    const __m512i pairs = _mm512_loadu_si512((const void *)src);
    return odd ? bf16_odds(pairs) : bf16_evens(pairs);
}

/* Each 32 of a BF16 accumulator (16 even elements, 16 odd: span_values)
 * back in order, times `factor`. */
ALWAYS_INLINE void interleave_bf16_acc(float *a, int64_t head_dim, float factor) {
    const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    const __m512 f = _mm512_set1_ps(factor);
    for (int64_t d = 0; d < head_dim; d += 32) {
        const __m512 even = _mm512_mul_ps(_mm512_loadu_ps(a + d), f), odd = _mm512_mul_ps(_mm512_loadu_ps(a + d + 16), f);
        _mm512_storeu_ps(a + d, _mm512_permutex2var_ps(even, lo, odd));
        _mm512_storeu_ps(a + d + 16, _mm512_permutex2var_ps(even, hi, odd));
    }
}

/* acc[head] += sum over the span's rows of p * v, in float32; per KV head the
 * group's accumulators sit in registers for the span when they fit. `kind`:
 * BF16, or I8 / FP8 with the span's V scales `sc` (KV head 0's; see
 * span_scales) folded into each row's weights.
 *
 * BF16 rows are widened 32 at a time (bf16_evens / bf16_odds): two
 * operations per 32 elements on the ports the FMAs use, where widening in
 * order (vpmovzxwd and a shift per 16) took four. acc then holds each 32
 * elements as 16 even, 16 odd (see interleave_bf16_acc). */
#define MAX_REG_ACC 24 /* zmm accumulators kept in registers (of 32) */
ALWAYS_INLINE void span_values(const float *scores, const char *span, const float *sc, int64_t count, int64_t t,
                               int64_t n, int64_t kv0, int64_t kv1, int64_t group, int64_t head_dim, int64_t row_bytes,
                               int64_t block_size, int kind, float *acc, read_ahead *ra) {
    const int64_t lanes = head_dim / 16, elem = kind == BF16 ? 2 : 1;
    for (int64_t kv = kv0; kv < kv1; kv++) {
        read_ahead_advance(ra, count * head_dim * elem);
        const float *p = scores + kv * group * n + t;
        const float *vs = kind == BF16 ? NULL : sc + kv * block_size;
        float *a = acc + kv * group * head_dim;
        const char *row = span + kv * head_dim * elem;
#define ROW_WEIGHT(h, i) (kind == BF16 ? p[(h) * n + (i)] : p[(h) * n + (i)] * vs[i] * QUANT_UNIT(kind))
#define ROW_VALUES(c) (kind == BF16 ? load16_bf16_half(row + (c) / 2 * 64, (c) % 2) : load16_quant(row + (c) * 16, kind))
        if (group * lanes <= MAX_REG_ACC) {
            __m512 regs[MAX_REG_ACC];
            for (int64_t j = 0; j < group * lanes; j++) regs[j] = _mm512_loadu_ps(a + j * 16);
            for (int64_t i = 0; i < count; i++, row += row_bytes)
                for (int64_t c = 0; c < lanes; c++) {
                    const __m512 v = ROW_VALUES(c);
                    for (int64_t h = 0; h < group; h++)
                        regs[h * lanes + c] = _mm512_fmadd_ps(_mm512_set1_ps(ROW_WEIGHT(h, i)), v, regs[h * lanes + c]);
                }
            for (int64_t j = 0; j < group * lanes; j++) _mm512_storeu_ps(a + j * 16, regs[j]);
        } else {
            for (int64_t i = 0; i < count; i++, row += row_bytes)
                for (int64_t c = 0; c < lanes; c++) {
                    const __m512 v = ROW_VALUES(c);
                    for (int64_t h = 0; h < group; h++) {
                        float *ah = a + h * head_dim + c * 16;
                        _mm512_storeu_ps(ah, _mm512_fmadd_ps(_mm512_set1_ps(ROW_WEIGHT(h, i)), v, _mm512_loadu_ps(ah)));
                    }
                }
        }
#undef ROW_WEIGHT
#undef ROW_VALUES
    }
}

/* Scores -> exp(score - max) in place; inv[head] = 1 / their sum. The
 * normalisation is applied to the outputs, not to every weight. */
static void exponentiate_rows(float *scores, const float *peaks, int64_t heads, int64_t n, float *inv) {
    for (int64_t h = 0; h < heads; h++) {
        float *sh = scores + h * n;
        const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(_mm512_loadu_ps(peaks + h * 16)));
        __m512 total = _mm512_setzero_ps();
        for (int64_t t = 0; t < n; t += 16) {
            const __mmask16 m = n - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - t)) - 1u);
            const __m512 e = exp16_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sh + t), top));
            total = _mm512_mask_add_ps(total, m, total, e);
            _mm512_mask_storeu_ps(sh + t, m, e);
        }
        inv[h] = 1.0f / _mm512_reduce_add_ps(total);
    }
}

/* softcap_one on 16 lanes. */
ALWAYS_INLINE __m512 softcap16(__m512 x, float softcap) {
    const __m512 t = _mm512_div_ps(x, _mm512_set1_ps(softcap));
    const __m512 magnitude = _mm512_abs_ps(t);
    const __m512 e = exp16_nonpositive(_mm512_mul_ps(magnitude, _mm512_set1_ps(-2.0f)));
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 th = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
    /* tanh is odd: the sign of t onto |tanh t|. */
    const __m512i sign = _mm512_and_si512(_mm512_castps_si512(t), _mm512_set1_epi32((int)0x80000000u));
    return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(th), sign)),
                         _mm512_set1_ps(softcap));
}

/* The heads' scores [heads][n] and their lane-wise peaks [heads][16]
 * capped in place: tanh is increasing, so a capped peak is the peak of the
 * capped scores. */
static void softcap_rows(float *scores, float *peaks, int64_t heads, int64_t n, float softcap) {
    for (int64_t h = 0; h < heads; h++) {
        float *sh = scores + h * n;
        for (int64_t t = 0; t < n; t += 16) {
            const __mmask16 m = n - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - t)) - 1u);
            _mm512_mask_storeu_ps(sh + t, m, softcap16(_mm512_maskz_loadu_ps(m, sh + t), softcap));
        }
        _mm512_storeu_ps(peaks + h * 16, softcap16(_mm512_loadu_ps(peaks + h * 16), softcap));
    }
}

/* One item: scores, their exponentials, then the values into
 * acc[head][head_dim] for the item's heads (buffers are indexed by the head's
 * number in the sequence). `peaks` holds num_heads * 16 floats, `inv`
 * num_heads. kind BF16: q is the sequence's raw bf16 queries; I8 / FP8: as
 * span_scores_quant takes them (`scale` unused), with the caches' scales and
 * a tile of 16 * head_dim floats. Inlined by attend_avx512 with
 * constant kind, group and head_dim for the common shapes, so the loops
 * unroll and the accumulators stay in registers. */
ALWAYS_INLINE void sequence_avx512(const void *q, const float *qscale, float scale, const char *k_cache,
                                   const char *v_cache, const float *k_scales, const float *v_scales,
                                   const seq_view *sv, read_ahead *ra, int kind, int64_t group, int64_t head_dim,
                                   float softcap, float *tile, float *scores,
                                   float *peaks, float *inv, float *acc) {
    const int64_t n = sv->n, h0 = sv->kv0 * group, heads = (sv->kv1 - sv->kv0) * group;
    int64_t count;
    for (int64_t h = h0; h < h0 + heads; h++) _mm512_storeu_ps(peaks + h * 16, _mm512_set1_ps(-INFINITY));
    for (int64_t t = 0; t < n; t += count) {
        const char *span = span_at(sv, k_cache, t, &count);
        if (kind == BF16)
            span_scores_avx512((const uint16_t *)q, scale, span, count, t, n, sv->kv0, sv->kv1, group, head_dim,
                               sv->row_bytes, scores, peaks, ra);
        else
            span_scores_quant(q, qscale, span, span_scales(sv, k_scales, t), count, t, n, sv->kv0, sv->kv1, group,
                              head_dim, sv->row_bytes, sv->block_size, kind, tile, scores, peaks, ra);
    }
    if (softcap > 0.0f) softcap_rows(scores + h0 * n, peaks + h0 * 16, heads, n, softcap);
    exponentiate_rows(scores + h0 * n, peaks + h0 * 16, heads, n, inv + h0);
    memset(acc + h0 * head_dim, 0, sizeof(float) * (size_t)(heads * head_dim));
    for (int64_t t = 0; t < n; t += count) {
        const char *span = span_at(sv, v_cache, t, &count);
        span_values(scores, span, kind == BF16 ? NULL : span_scales(sv, v_scales, t), count, t, n, sv->kv0, sv->kv1,
                    group, head_dim, sv->row_bytes, sv->block_size, kind, acc, ra);
    }
    for (int64_t h = h0; h < h0 + heads; h++) {
        if (kind == BF16) {
            interleave_bf16_acc(acc + h * head_dim, head_dim, inv[h]);
            continue;
        }
        for (int64_t d = 0; d < head_dim; d += 16)
            _mm512_storeu_ps(acc + h * head_dim + d, _mm512_mul_ps(_mm512_loadu_ps(acc + h * head_dim + d),
                                                                   _mm512_set1_ps(inv[h])));
    }
}

#define OCTAVO_SHAPE(KIND, G, D)                                                                                  \
    if (group == G && head_dim == D) {                                                                            \
        sequence_avx512(q, qscale, scale, k_cache, v_cache, k_scales, v_scales, sv, ra, KIND, G, D, softcap,      \
                        tile, scores, peaks, inv, acc);                                                           \
        return;                                                                                                   \
    }
#define OCTAVO_SHAPES(KIND)                                                                                       \
    OCTAVO_SHAPE(KIND, 1, 64) OCTAVO_SHAPE(KIND, 2, 64) OCTAVO_SHAPE(KIND, 3, 64) OCTAVO_SHAPE(KIND, 4, 64)       \
    OCTAVO_SHAPE(KIND, 5, 64) OCTAVO_SHAPE(KIND, 6, 64) OCTAVO_SHAPE(KIND, 7, 64) OCTAVO_SHAPE(KIND, 8, 64)       \
    OCTAVO_SHAPE(KIND, 1, 128) OCTAVO_SHAPE(KIND, 2, 128) OCTAVO_SHAPE(KIND, 3, 128) OCTAVO_SHAPE(KIND, 4, 128)   \
    OCTAVO_SHAPE(KIND, 5, 128) OCTAVO_SHAPE(KIND, 6, 128) OCTAVO_SHAPE(KIND, 7, 128) OCTAVO_SHAPE(KIND, 8, 128)   \
    sequence_avx512(q, qscale, scale, k_cache, v_cache, k_scales, v_scales, sv, ra, KIND, group, head_dim,        \
                    softcap, tile, scores, peaks, inv, acc);
#define OCTAVO_ATTEND(NAME, KIND)                                                                                 \
    static void NAME(const void *q, const float *qscale, float scale, const char *k_cache, const char *v_cache,   \
                     const float *k_scales, const float *v_scales, const seq_view *sv, read_ahead *ra,            \
                     int64_t group, int64_t head_dim, float softcap, float *tile, float *scores, float *peaks,     \
                     float *inv, float *acc) {                                                                    \
        OCTAVO_SHAPES(KIND)                                                                                       \
    }
OCTAVO_ATTEND(attend_bf16, BF16)
OCTAVO_ATTEND(attend_i8, I8)
OCTAVO_ATTEND(attend_fp8, FP8)
#undef OCTAVO_ATTEND
#undef OCTAVO_SHAPES
#undef OCTAVO_SHAPE

/* Head `head`'s query for span_scores_quant: into `out` (room for num_heads *
 * head_dim floats) as int16 with qscale[head] (int8 caches with INT8_DOTS;
 * softmax scale folded into qscale), else as float32 times the softmax scale.
 * `work`: head_dim floats. */
static void prepare_query(const char *src, int q_dtype, int64_t head_dim, float scale, int kv_dtype, float *work,
                          float *out, int64_t head, float *qscale) {
    load_row(src, q_dtype, head_dim, work);
    if (!(INT8_DOTS && kv_dtype == I8)) {
        for (int64_t d = 0; d < head_dim; d++) out[head * head_dim + d] = work[d] * scale;
        return;
    }
    float peak = 0.0f;
    for (int64_t d = 0; d < head_dim; d++) peak = fabsf(work[d]) > peak ? fabsf(work[d]) : peak;
    const float step = peak > 0.0f ? peak / 32767.0f : 1.0f;
    int16_t *q16 = (int16_t *)out + head * head_dim;
    for (int64_t d = 0; d < head_dim; d++) q16[d] = (int16_t)nearbyintf(work[d] / step);
    qscale[head] = step * scale;
}
#endif

/* Returns 0, FAIL_MEMORY when a work buffer could not be allocated, or
 * FAIL_EMPTY_CONTEXT when a sequence has no position to attend to. */
int octavo_paged_decode(const void *q, int64_t q_stride, void *out, int q_dtype,
                        const void *k_cache, const void *v_cache, int kv_dtype,
                        const float *k_scales, const float *v_scales,
                        const int64_t *block_tables, int64_t table_width,
                        const int64_t *context_lens, int64_t num_seqs,
                        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                        int64_t block_size, int64_t window, float scale, float softcap) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t q_elem = element_size(q_dtype), kv_elem = element_size(kv_dtype);
    const int64_t row_bytes = num_kv_heads * head_dim * kv_elem; /* between consecutive tokens */
    int64_t longest = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t n = window > 0 && context_lens[s] > window ? window : context_lens[s];
        if (n <= 0) return FAIL_EMPTY_CONTEXT;
        longest = n > longest ? n : longest;
    }
#ifdef HAVE_AVX512_BF16
    const int fast_bf16 = q_dtype == BF16 && kv_dtype == BF16 && head_dim % 32 == 0;
    const int fast_quant = (kv_dtype == I8 && head_dim % 32 == 0) || (kv_dtype == FP8 && head_dim % 16 == 0);
#else
    const int fast_bf16 = 0, fast_quant = 0;
#endif
    /* Enough items for ~4 per thread: few sequences are split by KV heads.
     * One thread has no one to share with: a split would only make it read
     * each row in pieces, one KV head's pass after another (Qwen2.5-0.5B's
     * shape, 32k, 24 layers' caches round robin, CPU time: 3.1 ms a layer
     * split, 2.5 unsplit, against the 2.2 of its 16.8 MB at the single
     * thread's read rate). */
    const int64_t threads = omp_get_max_threads();
    item_split split = {1, num_kv_heads};
    if (threads > 1 && num_seqs < 4 * threads) {
        int64_t parts = (4 * threads + num_seqs - 1) / num_seqs;
        parts = parts < num_kv_heads ? parts : num_kv_heads;
        split.per_part = (num_kv_heads + parts - 1) / parts;
        split.parts = (num_kv_heads + split.per_part - 1) / split.per_part;
    }
    const int64_t num_items = num_seqs * split.parts;
    int64_t chunk_items = num_items / (4 * threads);
    chunk_items = chunk_items < 1 ? 1 : (chunk_items > CHUNK_ITEMS ? CHUNK_ITEMS : chunk_items);
    const int64_t num_chunks = (num_items + chunk_items - 1) / chunk_items;
    int failed = 0;

#pragma omp parallel
    {
#if defined(__x86_64__)
        const unsigned int caller_csr = _mm_getcsr();
        _mm_setcsr(caller_csr | DENORMALS_ZERO);
#endif
        /* Per thread: accumulators and scores of every head, one K/V row, the
         * float32 queries of every head, each head's running maximum and
         * 1/sum, a tile of 16 widened quantized rows, the queries' scales. */
        const size_t floats = (size_t)(num_heads * head_dim + num_heads * longest + head_dim + num_heads * head_dim +
                                       num_heads * 17 + 16 * head_dim + num_heads);
        float *work = malloc(sizeof(float) * floats);
        if (work == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        float *acc = work, *scores = acc + num_heads * head_dim, *row = scores + num_heads * longest;
        float *qf = row + head_dim, *peaks = qf + num_heads * head_dim, *inv = peaks + num_heads * 16;
        float *tile = inv + num_heads, *qscale = tile + 16 * head_dim;
#pragma omp for schedule(dynamic, 1)
        for (int64_t chunk = 0; chunk < num_chunks; chunk++) {
            if (work == NULL) continue;
            const int64_t first_item = chunk * chunk_items;
            const int64_t end_item = first_item + chunk_items < num_items ? first_item + chunk_items : num_items;
            read_ahead ra = {{k_cache, v_cache}, block_tables, context_lens, table_width, block_size, row_bytes,
                             head_dim * kv_elem, num_kv_heads, window, split, first_item, end_item, 0, 0,
                             NULL, 0, 0, 0};
            read_ahead_advance(&ra, READ_AHEAD_BYTES);
            for (int64_t item = first_item; item < end_item; item++) {
                const int64_t s = item / split.parts, end = context_lens[s];
                const int64_t begin = (window > 0 && end > window) ? end - window : 0;
                const int64_t n = end - begin;
                const int64_t *table = block_tables + s * table_width;
                const char *q_seq = (const char *)q + s * q_stride * q_elem;
                int64_t kv0, kv1;
                item_heads(&split, item, num_kv_heads, &kv0, &kv1);
#ifdef HAVE_AVX512_BF16
                if (fast_bf16 || fast_quant) {
                    const seq_view sv = {table, begin, n, block_size, row_bytes, kv0, kv1, num_kv_heads};
                    const void *q_in = q_seq;
                    if (fast_quant) { /* the item's queries as span_scores_quant takes them */
                        for (int64_t h = kv0 * group; h < kv1 * group; h++)
                            prepare_query(q_seq + h * head_dim * q_elem, q_dtype, head_dim, scale, kv_dtype, row,
                                          qf, h, qscale);
                        q_in = qf;
                    }
                    void (*attend)(const void *, const float *, float, const char *, const char *, const float *,
                                   const float *, const seq_view *, read_ahead *, int64_t, int64_t, float, float *,
                                   float *, float *, float *, float *) =
                        fast_bf16 ? attend_bf16 : kv_dtype == I8 ? attend_i8 : attend_fp8;
                    attend(q_in, qscale, scale, k_cache, v_cache, k_scales, v_scales, &sv, &ra, group, head_dim,
                           softcap, tile, scores, peaks, inv, acc);
                } else
#endif
                {
                    (void)fast_bf16, (void)fast_quant, (void)peaks, (void)inv, (void)tile, (void)qscale;
                    read_ahead_advance(&ra, 2 * n * (kv1 - kv0) * head_dim * kv_elem);
                    for (int64_t g = kv0; g < kv1; g++) {
                        for (int64_t h = 0; h < group; h++) {
                            load_row(q_seq + (g * group + h) * head_dim * q_elem, q_dtype, head_dim, qf + h * head_dim);
                            for (int64_t d = 0; d < head_dim; d++) qf[h * head_dim + d] *= scale;
                        }
                        memset(acc + g * group * head_dim, 0, sizeof(float) * (size_t)(group * head_dim));
                        attend_generic(qf, (const char *)k_cache + g * head_dim * kv_elem,
                                       (const char *)v_cache + g * head_dim * kv_elem, kv_dtype,
                                       k_scales ? k_scales + g * block_size : NULL,
                                       v_scales ? v_scales + g * block_size : NULL, num_kv_heads * block_size, table,
                                       begin, n, group, head_dim, block_size, row_bytes, softcap, row, scores,
                                       acc + g * group * head_dim);
                    }
                }
                for (int64_t h = kv0 * group; h < kv1 * group; h++)
                    store_row(acc + h * head_dim, q_dtype, head_dim, (char *)out + (s * num_heads + h) * head_dim * q_elem);
            }
        }
        free(work);
#if defined(__x86_64__)
        _mm_setcsr(caller_csr); /* the caller's thread runs torch's ops next, in its own mode */
#endif
    }
    return failed ? FAIL_MEMORY : 0;
}
