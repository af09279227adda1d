/* bf16 linear layers for decode batches, on Intel AMX tiles.
 *
 * Decode at small batch is one read of every weight per step; oneDNN's bf16
 * kernel for one or a few rows reads its prepacked weights at ~3/4 of the
 * machine's read bandwidth (BENCHMARKS.md). This kernel reads the very same
 * prepacked bytes (no second copy of the model) at the stream rate: torch's
 * oneDNN packs a [N, K] weight as AB16b32a2b, i.e. for each group of 32
 * outputs, blocks of 32 k's stored [16 k-pairs][32 outputs][2 k's]. A block
 * is two TDPBF16PS B tiles side by side (16 rows of 64 bytes at a 128-byte
 * stride), and a group's blocks follow each other, so a pass reads the matrix
 * front to back. (The Python side checks the layout byte for byte before
 * using it.)
 *
 * Rows come in tiles of 16; a weight block is loaded once per 32 rows. One
 * tile (up to 16 rows) multiplies the rows in place (the last ones
 * zero-padded once per call); more are first copied into tile order
 * (amx_linear_tiled), and a large output (an LM head's logits) is written
 * past the caches. Past 64 rows oneDNN's blocking wins but for those large
 * outputs: the Python side sends each product where it is faster
 * (octavo/quant/unquantized.py).
 *
 * Built with -march=native: on a CPU without AMX the functions exist but
 * octavo_amx_available() says 0 and the Python side never calls the rest. */
#include <stdint.h>
#include <stdlib.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include "amx_tiles.h"
#include "common.h"

/* Rows of activations per pass over the weights: a pass keeps this many rows
 * (at most ~1 MiB of them) in L2 while each thread streams its weight groups. */
#define L2_ROW_BYTES (1 << 20)
/* From this many rows (two tiles) a call copies its rows into tile order
 * first (below): llama-100m's 49 products streamed, 1 thread, CPU time, at
 * 17-64 rows 1.18-1.24x faster than multiplying them in place; 1-16 rows
 * within 2% either way (benchmarks/linear_kernels.py --amx-baseline). */
#define TILED_ROWS_MIN 17
/* From this many bytes of output (an LM head's logits at a large decode batch) a
 * call writes its rows past the caches (write_rows). Smaller outputs stay in
 * cache for the next op: streaming the layers' outputs too made their products
 * ~10% faster but the ops reading them (SiLU x up, RMSNorm, rotary) as much
 * slower, a batch-256 llama-100m step no faster in all. */
#define STREAM_OUT_BYTES (4 << 20)
#if TILED_ROWS_MIN > 17
#error "the in-place path below multiplies one tile of at most 16 rows"
#endif

int octavo_amx_available(void) { return amx_request(); }

/* Whether a product of M rows and N outputs writes its output past the caches (write_rows). */
int octavo_amx_streams(int64_t M, int64_t N) { return M >= TILED_ROWS_MIN && M * N * 2 >= STREAM_OUT_BYTES; }

/* Two tiles or more. Each weight group then serves several row tiles, so the products
 * are bound by the tiles' arithmetic, not by the weights' read, and two
 * things starve them in the few-row loop: an activation tile's 16 rows lie
 * K * 2 bytes apart (4 KiB at K = 2048: every row in the same L1 set), and
 * each new weight group comes cold from L3 or memory. So the rows of a pass
 * are first copied tile by tile, each tile's block of 32 k's one 1 KiB run
 * (tiles[t][K/32][16][32], rows past M zero), and while a group multiplies
 * the pass's tiles the thread prefetches its next group into L2, a few lines
 * per step. */
ALWAYS_INLINE void copy_tile(const uint16_t *a, int64_t M, int64_t K, int64_t t, uint16_t *tile) {
    for (int64_t r = 0; r < 16; r++) {
        const int64_t row = t * 16 + r;
        for (int64_t kb = 0; kb < K / 32; kb++) {
            const __m512i v = row < M ? _mm512_loadu_si512((const void *)(a + row * K + kb * 32))
                                      : _mm512_setzero_si512();
            _mm512_store_si512((void *)(tile + (kb * 16 + r) * 32), v);
        }
    }
}

/* Copied tiles t0 (and t1 when `pair`) times weight group wg over all of K,
 * into acc; prefetching `lines` 64-byte lines a step from *next (up to end). */
ALWAYS_INLINE void multiply_tiles(const uint16_t *t0, const uint16_t *t1, const int pair, const uint16_t *wg, int64_t K,
                                  const char **next, const char *end, int64_t lines, float acc[4][256]) {
    zero_accumulators(pair);
    for (int64_t k = 0; k < K; k += 32) {
        for (int64_t l = 0; l < lines && *next < end; l++, *next += 64) _mm_prefetch(*next, _MM_HINT_T1);
        _tile_loadd(4, t0 + k * 16, 64);
        if (pair) _tile_loadd(5, t1 + k * 16, 64);
        _tile_loadd(6, wg + k * 32, 128);
        _tile_loadd(7, wg + k * 32 + 32, 128);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (pair) {
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    store_accumulators(acc, pair);
}

/* The sums of row tile t (and t + 1 when `pair`) times weight group g, plus
 * the bias, rounded into out [M, N]: each row's 32 outputs one 64-byte store.
 * With `stream`, whole aligned rows go to memory without first reading their
 * lines into the caches (and evicting the tiles' operands from L2 for them):
 * llama-100m's LM head in a batch-256 decode step, 1 thread, CPU time,
 * 8.6-10.4 ms against oneDNN's 10.9-12.0 (benchmarks/step_breakdown.py). */
ALWAYS_INLINE void write_rows(float acc[4][256], int64_t t, int pair, const uint16_t *bias, int64_t M, int64_t N,
                              int64_t g, int stream, uint16_t *out) {
    const int64_t n0 = 32 * g, row = t * 16, cols = N - n0 < 32 ? N - n0 : 32;
    const int64_t rows = M - row < (pair + 1) * 16 ? M - row : (pair + 1) * 16;
    const __mmask32 mask = (__mmask32)(((uint64_t)1 << cols) - 1);
    const __m512 bias0 = load_bias(bias, n0, cols < 16 ? (int)cols : 16);
    const __m512 bias1 = cols > 16 ? load_bias(bias, n0 + 16, (int)cols - 16) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; r++) {
        const float *sums = acc[2 * (r / 16)] + (r % 16) * 16;
        const __m512i v = (__m512i)_mm512_cvtne2ps_pbh(_mm512_add_ps(_mm512_load_ps(sums + 256), bias1),
                                                        _mm512_add_ps(_mm512_load_ps(sums), bias0));
        uint16_t *dst = out + (row + r) * N + n0;
        if (stream && cols == 32 && ((uintptr_t)dst & 63) == 0)
            _mm512_stream_si512((void *)dst, v);
        else
            _mm512_mask_storeu_epi16(dst, mask, v);
    }
}

static int amx_linear_tiled(const uint16_t *a, const uint16_t *w, const uint16_t *bias, int64_t M, int64_t K,
                            int64_t N, uint16_t *out) {
    const int64_t groups = (N + 31) / 32, row_tiles = (M + 15) / 16;
    int64_t chunk = (L2_ROW_BYTES / (K * 2)) / 32 * 2; /* row tiles per pass, even */
    if (chunk < 2) chunk = 2;
    if (chunk > row_tiles) chunk = row_tiles;
    uint16_t *tiles = aligned_alloc(64, (size_t)(chunk * 16 * K * 2));
    if (tiles == NULL) return -1;
    const int stream = octavo_amx_streams(M, N);
#pragma omp parallel
    {
        configure_tiles(16);
        float acc[4][256] __attribute__((aligned(64)));
        for (int64_t p0 = 0; p0 < row_tiles; p0 += chunk) {
            const int64_t count = p0 + chunk < row_tiles ? chunk : row_tiles - p0;
#pragma omp for schedule(static)
            for (int64_t t = 0; t < count; t++) copy_tile(a, M, K, p0 + t, tiles + t * 16 * K);
            /* A group's weights are K lines; its steps are (count + 1) / 2 * K / 32. */
            const int64_t lines = (32 + (count + 1) / 2 - 1) / ((count + 1) / 2);
#pragma omp for schedule(static)
            for (int64_t g = 0; g < groups; g++) {
                const uint16_t *wg = w + g * 32 * K;
                const char *next = (const char *)(wg + 32 * K);
                const char *end = g + 1 < groups ? next + K * 64 : next;
                for (int64_t t = 0; t < count; t += 2) {
                    const uint16_t *t0 = tiles + t * 16 * K;
                    const int pair = t + 1 < count;
                    multiply_tiles(t0, pair ? t0 + 16 * K : NULL, pair, wg, K, &next, end, lines, acc);
                    write_rows(acc, p0 + t, pair, bias, M, N, g, stream, out);
                }
            }
        }
        _mm_sfence(); /* the streamed rows visible before the call returns */
        _tile_release();
    }
    free(tiles);
    return 0;
}

/* out[M, N] = a[M, K] @ W^T (+ bias[N]); a, out row-major bf16, W in the
 * blocked layout above with N padded to a multiple of 32. K must be a
 * multiple of 32. Returns 0, or -1 when the copied row tiles cannot be
 * allocated. */
int octavo_amx_linear(const uint16_t *a, const uint16_t *w, const uint16_t *bias, int64_t M, int64_t K, int64_t N,
                      uint16_t *out) {
    if (M >= TILED_ROWS_MIN) return amx_linear_tiled(a, w, bias, M, K, N, out);
    /* One tile of M <= 16 rows, in place: its tiles are configured to M rows, so nothing past them is read. */
    const int64_t groups = (N + 31) / 32; /* of 32 outputs: two 16-wide weight tiles */
#pragma omp parallel
    {
        configure_tiles((int)M);
        float acc[4][256] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) multiply_block(a, NULL, 1, 0, 0, w + g * 32 * K, bias, M, K, N, g, out, acc);
        _tile_release();
    }
    return 0;
}

/* A mixture of experts' products, every expert in one call: out[m] = a[m] @ W_{experts[m]}^T, expert e's
 * weight in the blocked layout above at blocks[e] (each expert prepacked on its own, [N, K] with N padded
 * to a multiple of 32; K a multiple of 32), rows of one expert next to each other (the caller sorts them
 * by expert). The threads share the (run, output group) pairs, so each weight group is read once for all
 * its expert's rows, and only the experts given rows are read. Meant for up to a few row tiles per expert
 * (the rows of a run are re-read from L2 for each group). Returns 0, or -1 when out of memory. */
int octavo_amx_linear_experts(const uint16_t *a, const uint16_t *const *blocks, const int64_t *experts, int64_t M,
                              int64_t K, int64_t N, uint16_t *out) {
    int64_t runs = 0;
    uint16_t *tails = NULL;
    expert_run *run = expert_runs(a, experts, M, K, &runs, &tails);
    if (run == NULL) return -1;
    const int64_t groups = (N + 31) / 32;
#pragma omp parallel
    {
        int configured = 0;
        float acc[4][256] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t item = 0; item < runs * groups; item++) {
            const expert_run *r = run + item / groups;
            const int64_t g = item % groups;
            multiply_run(a, r, blocks[experts[r->start]] + g * 32 * K, K, N, g, out, acc, &configured);
        }
        if (configured) _tile_release();
    }
    free(tails);
    free(run);
    return 0;
}

#else

int octavo_amx_available(void) { return 0; }

int octavo_amx_streams(int64_t M, int64_t N) {
    (void)M, (void)N;
    return 0;
}

int octavo_amx_linear(const uint16_t *a, const uint16_t *w, const uint16_t *bias, int64_t M, int64_t K, int64_t N,
                      uint16_t *out) {
    (void)a, (void)w, (void)bias, (void)M, (void)K, (void)N, (void)out;
    abort(); /* unreachable: the Python side checks octavo_amx_available() first */
}


int octavo_amx_linear_experts(const uint16_t *a, const uint16_t *const *blocks, const int64_t *experts, int64_t M,
                              int64_t K, int64_t N, uint16_t *out) {
    (void)a, (void)blocks, (void)experts, (void)M, (void)K, (void)N, (void)out;
    abort(); /* unreachable: the Python side checks octavo_amx_available() first */
}

#endif
