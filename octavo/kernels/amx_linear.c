/* bf16 linear layers for a few rows at a time, on Intel AMX tiles.
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
 * Rows come in tiles of 16 (the last one zero-padded once per call); a weight
 * block is loaded once per 32 rows, so up to 32 rows read the weights once.
 * Many rows are oneDNN's business: its blocking beats this simple loop there.
 *
 * Built with -march=native: on a CPU without AMX the functions exist but
 * octavo_amx_available() says 0 and the Python side never calls the rest. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include "amx_tiles.h"

/* Rows of activations per pass over the weights: a pass keeps this many rows
 * (at most ~1 MiB of them) in L2 while each thread streams its weight groups. */
#define L2_ROW_BYTES (1 << 20)

int octavo_amx_available(void) { return amx_request(); }

/* out[M, N] = a[M, K] @ W^T (+ bias[N]); a, out row-major bf16, W in the
 * blocked layout above with N padded to a multiple of 32. K must be a
 * multiple of 32. Returns 0, or -1 when the padded last tile cannot be allocated. */
int octavo_amx_linear(const uint16_t *a, const uint16_t *w, const uint16_t *bias, int64_t M, int64_t K, int64_t N,
                      uint16_t *out) {
    const int64_t groups = (N + 31) / 32; /* of 32 outputs: two 16-wide weight tiles */
    const int64_t full_tiles = M / 16, tail_rows = M % 16;
    uint16_t *tail = NULL;
    if (tail_rows && full_tiles) { /* the last rows, zero-padded to a whole tile so its loads stay in bounds */
        tail = aligned_alloc(64, (size_t)(16 * K * 2));
        if (tail == NULL) return -1;
        memset(tail, 0, (size_t)(16 * K * 2));
        memcpy(tail, a + full_tiles * 16 * K, (size_t)(tail_rows * K * 2));
    }
    const int64_t row_tiles = full_tiles + (tail_rows != 0);
    const int tile_rows = full_tiles ? 16 : (int)M;
    int64_t chunk = (L2_ROW_BYTES / (K * 2)) / 32 * 2; /* row tiles per pass, even */
    if (chunk < 2) chunk = 2;
#pragma omp parallel
    {
        configure_tiles(tile_rows);
        float acc[4][256] __attribute__((aligned(64)));
        for (int64_t t0 = 0; t0 < row_tiles; t0 += chunk) {
            const int64_t t_end = t0 + chunk < row_tiles ? t0 + chunk : row_tiles;
#pragma omp for schedule(static)
            for (int64_t g = 0; g < groups; g++)
                for (int64_t t = t0; t < t_end; t += 2)
                    multiply_block(a, tail, full_tiles, t, t + 1 < t_end, w + g * 32 * K, bias, M, K, N, g, out,
                                   acc);
        }
        _tile_release();
    }
    free(tail);
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
        configure_tiles(16);
        float acc[4][256] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t item = 0; item < runs * groups; item++) {
            const expert_run *r = run + item / groups;
            const int64_t g = item % groups;
            multiply_run(a, r, blocks[experts[r->start]] + g * 32 * K, K, N, g, out, acc);
        }
        _tile_release();
    }
    free(tails);
    free(run);
    return 0;
}

#else

int octavo_amx_available(void) { return 0; }

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
