/* A step's LoRA on one product, in float32 for the CPU: out[i] += (x[i] @ A^T) @ B^T for every row i of
 * each adapter's group, A^T [k][r] and B^T [r][n] row-major as gpu/lora keeps them.
 *
 * Why: at these shapes (a few to 64 rows, ranks 8-64, k and n of a few hundred to a few thousand) each
 * BLAS call spends more time packing its operands than multiplying (measured about a tenth of the peak
 * for [16, 256] x [256, 48]), and a step makes two such calls per adapter per product. Here the weights
 * are read in place and each call does every adapter of the product; the expand touches only each part's
 * own output columns (q, k and v of a fused q|k|v product each have their own B block, zeros elsewhere).
 *
 * Table (one row per adapter of the step, int64): a_t pointer (0: the adapter leaves this product alone),
 * b_t pointer, r, parts, then per part (first row of r, its rank, first output column, its columns).
 * Rows: the step's adapter rows grouped by adapter, starts[g] .. starts[g + 1] for group g.
 * Work is split over OpenMP threads by blocks of RB rows (the libgomp pool torch uses). Each output is a
 * running sum over r in order, added to out once.
 */
#include <stdint.h>

#define RB 4         /* rows per block */
#define VB 16        /* columns per vector block (two AVX2 vectors) */
#define MAX_R 1024   /* r at most (parts x max_lora_rank); the caller checks */
#define FIELDS 16    /* int64 per table row */
#define MAX_PARTS 3

/* One AVX2 register; a VB-column block is two of them. (A 64-byte vector type was kept in memory by
 * GCC on AVX2: every FMA read and wrote the stack, a tenth of this speed.) */
typedef float v8 __attribute__((vector_size(8 * sizeof(float))));

int inferq_lora_abi_version(void) { return 1; }

static inline v8 load8(const float *p) {
    v8 v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, v8 v) { __builtin_memcpy(p, &v, sizeof v); }

/* Four rows' accumulators for one VB-column block: eight registers. */
#define ACC_DECLARE v8 a0 = {0}, b0 = {0}, a1 = {0}, b1 = {0}, a2 = {0}, b2 = {0}, a3 = {0}, b3 = {0}
#define ACC_FMA(s0, s1, s2, s3, p)                                   \
    do {                                                              \
        const v8 lo = load8(p), hi = load8((p) + 8);                  \
        a0 += (s0) * lo, b0 += (s0) * hi, a1 += (s1) * lo, b1 += (s1) * hi; \
        a2 += (s2) * lo, b2 += (s2) * hi, a3 += (s3) * lo, b3 += (s3) * hi; \
    } while (0)

/* y[b][0..r) = x_b @ a_t for the block's RB rows (a block short of rows repeats its first row: no
 * branches in the loops, the repeats' results never stored). Four named accumulators, so they stay in
 * registers: an array of them indexed in a loop ended up in memory (GCC). */
static void shrink(const float *const *xs, const float *a_t, int64_t k, int64_t r, float y[RB][MAX_R]) {
    const float *x0 = xs[0], *x1 = xs[1], *x2 = xs[2], *x3 = xs[3];
    int64_t j0 = 0;
    for (; j0 + VB <= r; j0 += VB) {
        ACC_DECLARE;
        const float *a = a_t + j0;
        for (int64_t kk = 0; kk < k; ++kk, a += r) ACC_FMA(x0[kk], x1[kk], x2[kk], x3[kk], a);
        store8(&y[0][j0], a0), store8(&y[0][j0 + 8], b0), store8(&y[1][j0], a1), store8(&y[1][j0 + 8], b1);
        store8(&y[2][j0], a2), store8(&y[2][j0 + 8], b2), store8(&y[3][j0], a3), store8(&y[3][j0 + 8], b3);
    }
    for (; j0 + 8 <= r; j0 += 8) { /* rank 8 and the like: one register a row */
        v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        const float *a = a_t + j0;
        for (int64_t kk = 0; kk < k; ++kk, a += r) {
            const v8 w = load8(a);
            a0 += x0[kk] * w, a1 += x1[kk] * w, a2 += x2[kk] * w, a3 += x3[kk] * w;
        }
        store8(&y[0][j0], a0), store8(&y[1][j0], a1), store8(&y[2][j0], a2), store8(&y[3][j0], a3);
    }
    for (; j0 < r; ++j0) { /* the tail columns of r, one at a time */
        for (int b = 0; b < RB; ++b) {
            float sum = 0.0f;
            for (int64_t kk = 0; kk < k; ++kk) sum = __builtin_fmaf(xs[b][kk], a_t[kk * r + j0], sum);
            y[b][j0] = sum;
        }
    }
}

/* out_b[c0 .. c0 + cols) += y[b][r0 .. r0 + rank) @ b_t[r0 .. r0 + rank][c0 .. c0 + cols), b < m. */
static void expand(float *const *outs, int m, float y[RB][MAX_R], const float *b_t, int64_t n, int64_t r0,
                   int64_t rank, int64_t c0, int64_t cols) {
    int64_t c = c0;
    const int64_t end = c0 + cols;
    const float *y0 = y[0], *y1 = y[1], *y2 = y[2], *y3 = y[3];
    for (; c + VB <= end; c += VB) {
        ACC_DECLARE;
        const float *w_row = b_t + r0 * n + c;
        for (int64_t j = r0; j < r0 + rank; ++j, w_row += n) ACC_FMA(y0[j], y1[j], y2[j], y3[j], w_row);
        const v8 lows[RB] = {a0, a1, a2, a3}, highs[RB] = {b0, b1, b2, b3};
        for (int b = 0; b < m; ++b) {
            store8(outs[b] + c, load8(outs[b] + c) + lows[b]);
            store8(outs[b] + c + 8, load8(outs[b] + c + 8) + highs[b]);
        }
    }
    for (; c + 8 <= end; c += 8) {
        v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        const float *w_row = b_t + r0 * n + c;
        for (int64_t j = r0; j < r0 + rank; ++j, w_row += n) {
            const v8 w = load8(w_row);
            a0 += y0[j] * w, a1 += y1[j] * w, a2 += y2[j] * w, a3 += y3[j] * w;
        }
        const v8 accs[RB] = {a0, a1, a2, a3};
        for (int b = 0; b < m; ++b) store8(outs[b] + c, load8(outs[b] + c) + accs[b]);
    }
    for (; c < end; ++c) {
        for (int b = 0; b < m; ++b) {
            float sum = 0.0f;
            for (int64_t j = r0; j < r0 + rank; ++j) sum = __builtin_fmaf(y[b][j], b_t[j * n + c], sum);
            outs[b][c] += sum;
        }
    }
}

/* Returns 0, or -1 when a table row asks for more than this kernel holds (nothing is written then). */
int lora_apply_f32(int64_t groups, const int64_t *starts, const int64_t *rows, const int64_t *table,
                   int64_t k, int64_t n, const float *x, int64_t x_stride, float *out, int64_t out_stride) {
    int64_t blocks = 0;
    for (int64_t g = 0; g < groups; ++g) {
        const int64_t *t = table + g * FIELDS;
        if (t[2] > MAX_R || t[3] > MAX_PARTS) return -1;
        blocks += (starts[g + 1] - starts[g] + RB - 1) / RB;
    }
#pragma omp parallel for schedule(static)
    for (int64_t block = 0; block < blocks; ++block) {
        /* which group, and which of its row blocks */
        int64_t g = 0, first = block;
        for (;; ++g) {
            const int64_t own = (starts[g + 1] - starts[g] + RB - 1) / RB;
            if (first < own) break;
            first -= own;
        }
        const int64_t *t = table + g * FIELDS;
        if (!t[0]) continue;
        const float *a_t = (const float *)(intptr_t)t[0];
        const float *b_t = (const float *)(intptr_t)t[1];
        const int64_t begin = starts[g] + first * RB;
        const int m = (int)(starts[g + 1] - begin < RB ? starts[g + 1] - begin : RB);
        const float *xs[RB];
        float *outs[RB];
        for (int b = 0; b < RB; ++b) {
            const int64_t row = rows[begin + (b < m ? b : 0)];
            xs[b] = x + row * x_stride;
            outs[b] = out + row * out_stride;
        }
        float y[RB][MAX_R];
        shrink(xs, a_t, k, t[2], y);
        for (int64_t p = 0; p < t[3]; ++p) {
            const int64_t *part = t + 4 + 4 * p;
            expand(outs, m, y, b_t, n, part[0], part[1], part[2], part[3]);
        }
    }
    return 0;
}
