/* AMX bf16 tile helpers shared by amx_linear.c and quant_linear.c: the
 * tile set-up and one 32-output weight group (blocked as oneDNN's
 * AB16b32a2b: for each block of 32 k's, [16 k-pairs][32 outputs][2 k's])
 * times one or two 16-row activation tiles, and a mixture of experts' rows cut
 * into runs of one expert each. Included only where the compiler
 * targets AMX (see the guard in each .c file). */
#ifndef OCTAVO_KERNELS_AMX_TILES_H
#define OCTAVO_KERNELS_AMX_TILES_H

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

long syscall(long number, ...); /* unistd.h declares it only under _DEFAULT_SOURCE */

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* How far ahead (in 2 KiB weight blocks) the few-row loop prefetches. */
#define PREFETCH_BLOCKS 4

typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Linux hands out AMX state only to a process that asks for it. */
static inline int amx_request(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; }

/* Tiles 0-3 accumulate float32 (rows x 16), 4-5 hold activations (rows x 32
 * bf16), 6-7 weights (16 k-pairs x 16 outputs x 2). rows is 16, or M when a
 * call has fewer rows: then no tile needs zero padding. */
static void configure_tiles(int rows) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) {
        cfg.rows[i] = i < 6 ? rows : 16;
        cfg.colsb[i] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* One 16x16 float32 tile (+ bias) rounded to bf16 into `rows` rows and `cols`
 * (<= 16) columns of out. */
static void store_tile(const float *acc, const __m512 bias, int64_t rows, int cols, uint16_t *out, int64_t ldo) {
    const __mmask16 mask = (__mmask16)((1u << cols) - 1);
    for (int64_t r = 0; r < rows; r++) {
        const __m512 v = _mm512_add_ps(_mm512_load_ps(acc + r * 16), bias);
        _mm256_mask_storeu_epi16(out + r * ldo, mask, (__m256i)_mm512_cvtneps_pbh(v));
    }
}

static __m512 load_bias(const uint16_t *bias, int64_t n0, int cols) {
    if (bias == NULL) return _mm512_setzero_ps();
    const __m256i h = _mm256_maskz_loadu_epi16((__mmask16)((1u << cols) - 1), bias + n0);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* The accumulator tiles of one row tile (0-1) or of a pair (0-3): zeroed, or stored into acc. */
static inline void zero_accumulators(int pair) {
    _tile_zero(0);
    _tile_zero(1);
    if (pair) {
        _tile_zero(2);
        _tile_zero(3);
    }
}

static inline void store_accumulators(float acc[4][256], int pair) {
    _tile_stored(0, acc[0], 64);
    _tile_stored(1, acc[1], 64);
    if (pair) {
        _tile_stored(2, acc[2], 64);
        _tile_stored(3, acc[3], 64);
    }
}

/* Row tile t (and t + 1 when `pair`) times weight group g (outputs 32g ..
 * 32g + 31), summed in float32 in acc (acc[2h + j]: row tile t + h, outputs
 * 32g + 16j ..), plus the bias, rounded into out [M, N]. */
static inline void write_block(float acc[4][256], int64_t t, int pair, const uint16_t *bias, int64_t M, int64_t N,
                               int64_t g, uint16_t *out) {
    const int64_t n0 = 32 * g;
    const int cols0 = N - n0 >= 16 ? 16 : (int)(N - n0);
    const int cols1 = N - n0 - 16 >= 16 ? 16 : (int)(N - n0 - 16 > 0 ? N - n0 - 16 : 0);
    const __m512 bias0 = load_bias(bias, n0, cols0);
    const __m512 bias1 = cols1 ? load_bias(bias, n0 + 16, cols1) : _mm512_setzero_ps();
    for (int h = 0; h <= pair; h++) {
        const int64_t row = (t + h) * 16;
        const int64_t rows = M - row < 16 ? M - row : 16;
        store_tile(acc[2 * h], bias0, rows, cols0, out + row * N + n0, N);
        if (cols1) store_tile(acc[2 * h + 1], bias1, rows, cols1, out + row * N + n0 + 16, N);
    }
}

/* Rows of tiles t (and t + 1 when `pair`) times weight group g (outputs
 * 32g .. 32g + 31, whose K/32 blocks lie one after another from `wg`): the
 * accumulators stay in tiles over all of K, then are rounded into out.
 * `tail`, when set, stands in for the zero-padded last tile. */
static inline void multiply_block(const uint16_t *a, const uint16_t *tail, int64_t full_tiles, int64_t t, int pair,
                                  const uint16_t *wg, const uint16_t *bias, int64_t M, int64_t K, int64_t N, int64_t g,
                                  uint16_t *out, float acc[4][256]) {
    const uint16_t *a0 = t < full_tiles || tail == NULL ? a + t * 16 * K : tail;
    const uint16_t *a1 = t + 1 < full_tiles ? a + (t + 1) * 16 * K : tail;
    const int64_t stride = K * 2;
    zero_accumulators(pair);
    if (pair) {
        for (int64_t k = 0; k < K; k += 32) {
            _tile_loadd(4, a0 + k, stride);
            _tile_loadd(5, a1 + k, stride);
            _tile_loadd(6, wg + k * 32, 128);
            _tile_loadd(7, wg + k * 32 + 32, 128);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    } else {
        for (int64_t k = 0; k < K; k += 32) {
            /* Few rows: nothing but this stream, so ask for it early (+8-15%
             * over the hardware prefetcher on the 128-byte-strided tiles). */
            for (int line = 0; line < 32; line++)
                _mm_prefetch((const char *)(wg + (k + 32 * PREFETCH_BLOCKS) * 32 + line * 32), _MM_HINT_T0);
            _tile_loadd(4, a0 + k, stride);
            _tile_loadd(6, wg + k * 32, 128);
            _tile_loadd(7, wg + k * 32 + 32, 128);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
        }
    }
    store_accumulators(acc, pair);
    write_block(acc, t, pair, bias, M, N, g, out);
}

/* A mixture of experts' rows, sorted by expert (the caller's order): one run per expert. A run of up to
 * 16 rows is multiplied in place, the tiles configured to its rows (decode: Qwen3-30B-A3B's 128 experts
 * top-8 give ~2 rows per expert at 32 tokens), so nothing is copied or zero-padded for it. A longer run is
 * cut into tiles of 16, its last, partial tile copied zero-padded (`tail`), so every tile load stays
 * inside the run's own rows. */
typedef struct {
    int64_t start, rows; /* rows start .. start + rows - 1 of the call */
    const uint16_t *tail; /* the zero-padded last tile of a run past 16 rows; NULL otherwise */
} expert_run;

/* The runs of x [M, K] given each row's expert; *tails holds the padded tiles (the caller frees it and
 * the result). At most M runs and M padded tiles. Returns NULL when out of memory. */
static expert_run *expert_runs(const uint16_t *x, const int64_t *experts, int64_t M, int64_t K, int64_t *count,
                               uint16_t **tails) {
    expert_run *runs = malloc((size_t)(M > 0 ? M : 1) * sizeof *runs);
    int64_t n = 0, partial = 0;
    if (runs == NULL) return NULL;
    for (int64_t m = 0; m < M; m++)
        if (m == 0 || experts[m] != experts[m - 1]) runs[n++].start = m;
    for (int64_t j = 0; j < n; j++) {
        runs[j].rows = (j + 1 < n ? runs[j + 1].start : M) - runs[j].start;
        partial += runs[j].rows > 16 && runs[j].rows % 16 != 0;
    }
    *tails = aligned_alloc(64, (size_t)((partial > 0 ? partial : 1) * 16 * K * 2));
    if (*tails == NULL) {
        free(runs);
        return NULL;
    }
    uint16_t *tail = *tails;
    for (int64_t j = 0; j < n; j++) {
        const int64_t left = runs[j].rows % 16;
        runs[j].tail = NULL;
        if (runs[j].rows <= 16 || left == 0) continue;
        memset(tail, 0, (size_t)(16 * K * 2));
        memcpy(tail, x + (runs[j].start + runs[j].rows - left) * K, (size_t)(left * K * 2));
        runs[j].tail = tail;
        tail += 16 * K;
    }
    *count = n;
    return runs;
}

/* A run's rows times weight group g (outputs 32g .. 32g + 31, blocked from `wg`) into the run's rows
 * of out [M, N]. *configured: the rows the thread's tiles are configured to (0: not yet), changed only
 * where the run needs others: a thread's (run, group) pairs come a run at a time. */
static void multiply_run(const uint16_t *x, const expert_run *run, const uint16_t *wg, int64_t K, int64_t N,
                         int64_t g, uint16_t *out, float acc[4][256], int *configured) {
    const int rows = run->rows < 16 ? (int)run->rows : 16;
    if (*configured != rows) {
        configure_tiles(rows);
        *configured = rows;
    }
    if (run->rows < 16) { /* one tile of the run's own rows, read in place */
        multiply_block(x + run->start * K, NULL, 1, 0, 0, wg, NULL, run->rows, K, N, g, out + run->start * N, acc);
        return;
    }
    const int64_t full = run->rows / 16, tiles = full + (run->tail != NULL);
    for (int64_t t = 0; t < tiles; t += 2)
        multiply_block(x + run->start * K, run->tail, full, t, t + 1 < tiles, wg, NULL, run->rows, K, N, g,
                       out + run->start * N, acc);
}

#endif
