/* Quest's page choice on CPU (octavo/attention/quest.py): the per-block key
 * bounds kept up to date as keys are written, and each decode row's pages
 * chosen from them, each in one call per layer.
 *
 * In torch the two took ~15 small ops per full-attention layer and step
 * (reads of the written keys, index fills and scatter reductions, a gather
 * of the bounds, a batched product, topk and sort), run eagerly: at 32k
 * tokens their Python and allocations cost about what the sparse attention
 * saved. Here they are two calls whose arguments a kernel tape records, so a
 * recorded decode step replays them like any other kernel.
 *
 * Bounds: [kv_heads, num_blocks, 2, head_dim] (minimum, maximum) in the
 * cache's float dtype, float32 for an int8 / e4m3 cache (its keys are stored
 * values times float32 scales [num_blocks, kv_heads, block_size]).
 *
 * A page's bound for query q is sum_c max(q_c * min_c, q_c * max_c): no key
 * between the page's minimum and maximum scores more. A row's score for a
 * page is the largest bound over its query heads (one block table serves all
 * of a row's heads). A row of more than top + recent pages reads its first
 * page, the top - 1 other pages of highest score and its last `recent` pages,
 * in their order, its context length cut by the pages left out; a shorter row
 * reads its table unchanged. Equal scores go to the earlier page.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#define FAIL_MEMORY -1
#define FAIL_SLOT -2
/* Pages scored per work item: enough work to be worth a thread at 32k tokens (2048 pages of 16). */
#define PAGES_PER_ITEM 64

/* Fold the keys just written to `slots` [n] into their blocks' bounds. A
 * block's first slot starts it afresh: a block from the pool still holds its
 * previous owner's bounds, and a request writes each block from slot 0 on, in
 * order (a prefix hit reuses whole blocks, bounds and all). Returns 0, or
 * FAIL_SLOT for a slot outside the cache. */
int octavo_quest_fold_bounds(const void *k_cache, int kv_dtype, const float *k_scales, void *bounds, int bounds_dtype,
                             const int64_t *slots, int64_t n, int64_t num_blocks, int64_t block_size,
                             int64_t kv_heads, int64_t head_dim) {
    for (int64_t i = 0; i < n; i++)
        if (slots[i] < 0 || slots[i] >= num_blocks * block_size) return FAIL_SLOT;
    const int64_t kv_elem = element_size(kv_dtype), bound_elem = element_size(bounds_dtype);
    float key[head_dim], low[head_dim], high[head_dim];
    for (int64_t i = 0; i < n; i++) {
        const int64_t block = slots[i] / block_size, offset = slots[i] % block_size;
        for (int64_t h = 0; h < kv_heads; h++) {
            load_row((const char *)k_cache + (slots[i] * kv_heads + h) * head_dim * kv_elem, kv_dtype, head_dim, key);
            if (k_scales != NULL) {
                const float scale = k_scales[(block * kv_heads + h) * block_size + offset];
                for (int64_t d = 0; d < head_dim; d++) key[d] *= scale;
            }
            char *lo = (char *)bounds + (h * num_blocks + block) * 2 * head_dim * bound_elem;
            char *hi = lo + head_dim * bound_elem;
            if (offset == 0) {
                store_row(key, bounds_dtype, head_dim, lo);
                store_row(key, bounds_dtype, head_dim, hi);
                continue;
            }
            load_row(lo, bounds_dtype, head_dim, low);
            load_row(hi, bounds_dtype, head_dim, high);
            for (int64_t d = 0; d < head_dim; d++) {
                low[d] = key[d] < low[d] ? key[d] : low[d];
                high[d] = key[d] > high[d] ? key[d] : high[d];
            }
            store_row(low, bounds_dtype, head_dim, lo);
            store_row(high, bounds_dtype, head_dim, hi);
        }
    }
    return 0;
}

/* The highest bound over a row's query heads qf [heads][head_dim] for the page
 * at `block`; `work`: 2 * head_dim floats. */
static float page_score(const float *qf, const void *bounds, int bounds_dtype, int64_t block, int64_t num_blocks,
                        int64_t heads, int64_t kv_heads, int64_t head_dim, float *work) {
    const int64_t group = heads / kv_heads, bound_elem = element_size(bounds_dtype);
    float best = -INFINITY;
    for (int64_t g = 0; g < kv_heads; g++) {
        load_row((const char *)bounds + (g * num_blocks + block) * 2 * head_dim * bound_elem, bounds_dtype,
                 2 * head_dim, work);
        const float *low = work, *high = work + head_dim;
        for (int64_t h = g * group; h < (g + 1) * group; h++) {
            const float *qh = qf + h * head_dim;
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t d = 0; d < head_dim; d++) {
                const float a = qh[d] * low[d], b = qh[d] * high[d];
                sum += a > b ? a : b;
            }
            best = sum > best ? sum : best;
        }
    }
    return best;
}

/* Whether page a (score sa) ranks before page b (score sb). */
static inline int ranks_before(float sa, int64_t a, float sb, int64_t b) { return sa > sb || (sa == sb && a < b); }

/* Mark in `picked` the `m` candidates of highest score among pages first..end-1,
 * through a heap of the m best so far whose root is the weakest. `heap`: m entries. */
static void pick_top(const float *scores, int64_t first, int64_t end, int64_t m, int64_t *heap, char *picked) {
    int64_t size = 0;
    for (int64_t p = first; p < end && m > 0; p++) {
        if (size < m) { /* sift the new entry up */
            int64_t i = size++;
            while (i > 0) {
                const int64_t parent = (i - 1) / 2;
                if (!ranks_before(scores[heap[parent]], heap[parent], scores[p], p)) break;
                heap[i] = heap[parent];
                i = parent;
            }
            heap[i] = p;
            continue;
        }
        if (!ranks_before(scores[p], p, scores[heap[0]], heap[0])) continue;
        int64_t i = 0; /* replace the weakest, sift down */
        for (;;) {
            int64_t child = 2 * i + 1;
            if (child >= size) break;
            const int64_t a = heap[child], b = child + 1 < size ? heap[child + 1] : -1;
            if (b >= 0 && ranks_before(scores[a], a, scores[b], b)) child++;
            if (!ranks_before(scores[p], p, scores[heap[child]], heap[child])) break;
            heap[i] = heap[child];
            i = child;
        }
        heap[i] = p;
    }
    for (int64_t i = 0; i < size; i++) picked[heap[i]] = 1;
}

/* Each row's pages into out_table [rows, top + recent] and its cut context length into out_lens [rows].
 *   q            [rows, heads, head_dim] of q_dtype, q_stride elements from one row to the next
 *   tables       [rows, ...] int64, table_stride elements from one row to the next
 *   lens         [rows] int64
 * Returns 0, or FAIL_MEMORY when a work buffer could not be allocated. */
int octavo_quest_select(const void *q, int64_t q_stride, int q_dtype, const void *bounds, int bounds_dtype,
                        int64_t num_blocks, const int64_t *tables, int64_t table_stride, const int64_t *lens,
                        int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                        int64_t top_pages, int64_t recent_pages, int64_t *out_table, int64_t *out_lens) {
    const int64_t keep = top_pages + recent_pages, q_elem = element_size(q_dtype);
    int64_t widest = 0, items = 0;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t pages = lens[r] > 0 ? (lens[r] + block_size - 1) / block_size : 0;
        widest = pages > widest ? pages : widest;
        if (pages > keep) items += (pages + PAGES_PER_ITEM - 1) / PAGES_PER_ITEM;
    }
    /* Per row: its float32 queries and its pages' scores (and picks). */
    float *qf = malloc(sizeof(float) * (size_t)(rows * heads * head_dim + rows * widest + 1));
    char *picked = calloc((size_t)(rows * widest + 1), 1);
    int64_t *heap = malloc(sizeof(int64_t) * (size_t)(rows * top_pages + 1));
    if (qf == NULL || picked == NULL || heap == NULL) {
        free(qf), free(picked), free(heap);
        return FAIL_MEMORY;
    }
    float *scores = qf + rows * heads * head_dim;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < heads; h++)
            load_row((const char *)q + (r * q_stride + h * head_dim) * q_elem, q_dtype, head_dim,
                     qf + (r * heads + h) * head_dim);

    /* Score the candidate pages (neither the first nor a recent one) of the rows that choose, item by item;
     * a thread only where there are pages enough to repay waking it. */
#pragma omp parallel if (items > 1)
    {
        float work[2 * head_dim];
#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; item++) {
            int64_t r = 0, skip = item, pages = 0;
            for (;; r++) { /* the row and the item's place in it */
                pages = lens[r] > 0 ? (lens[r] + block_size - 1) / block_size : 0;
                if (pages <= keep) continue;
                const int64_t row_items = (pages + PAGES_PER_ITEM - 1) / PAGES_PER_ITEM;
                if (skip < row_items) break;
                skip -= row_items;
            }
            const int64_t first = skip * PAGES_PER_ITEM > 1 ? skip * PAGES_PER_ITEM : 1;
            const int64_t last = pages - recent_pages;
            const int64_t end = (skip + 1) * PAGES_PER_ITEM < last ? (skip + 1) * PAGES_PER_ITEM : last;
            for (int64_t p = first; p < end; p++)
                scores[r * widest + p] = page_score(qf + r * heads * head_dim, bounds, bounds_dtype,
                                                    tables[r * table_stride + p], num_blocks, heads, kv_heads,
                                                    head_dim, work);
        }
    }

    for (int64_t r = 0; r < rows; r++) {
        const int64_t *table = tables + r * table_stride;
        int64_t *out = out_table + r * keep;
        const int64_t pages = lens[r] > 0 ? (lens[r] + block_size - 1) / block_size : 0;
        if (pages <= keep) {
            for (int64_t p = 0; p < keep; p++) out[p] = p < pages ? table[p] : table[0];
            out_lens[r] = lens[r];
            continue;
        }
        char *mark = picked + r * widest;
        mark[0] = 1;
        for (int64_t p = pages - recent_pages; p < pages; p++) mark[p] = 1;
        pick_top(scores + r * widest, 1, pages - recent_pages, top_pages - 1, heap + r * top_pages, mark);
        int64_t j = 0;
        for (int64_t p = 0; p < pages; p++)
            if (mark[p]) out[j++] = table[p];
        out_lens[r] = lens[r] - (pages - keep) * block_size;
    }
    free(qf), free(picked), free(heap);
    return 0;
}
