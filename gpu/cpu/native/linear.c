/* y = x W^T (+ bias) in float32 for the CPU, with W packed once into column panels.
 *
 * Why: at this project's shapes (a decode batch of 1-64 rows against a 256-wide hidden state, and an
 * output projection of 32k-49k columns) the BLAS and oneDNN kernels reach about half of the machine's
 * matmul peak (gpu/cpu/linear.py). A register-blocked AVX2 kernel over a panel layout keeps both FMA ports
 * busy: each step of k loads two weight vectors from one contiguous panel, broadcasts six x values and
 * issues twelve FMAs. Which kernel a shape uses is still measured at engine start (gpu/cpu/autotune.py).
 *
 * Layouts: x [m, k] with x_stride floats between rows; W packed as [panels][k][16] (the last panel
 * zero-padded), from `linear_pack_f32`; y [m, n] contiguous; bias [n] or NULL.
 * Work is split over OpenMP threads by (row chunk, panel), the libgomp pool torch uses.
 * Each output is one running sum over k in order (fused multiply-adds), like a BLAS dot product.
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define NR 16 /* columns per panel: two 8-float vectors */
#define MR 6  /* rows per register block: 6 x 2 accumulators, 2 weight vectors, 1 broadcast */
#define MC 96 /* rows per chunk: a chunk of x stays in L2 while the panels stream past it */

int inferq_linear_abi_version(void) { return 1; }

int64_t linear_panels(int64_t n) { return (n + NR - 1) / NR; }

/* packed[p][kk][j] = w[p * NR + j][kk] (0 past n); packed holds linear_panels(n) * k * NR floats. */
void linear_pack_f32(const float *w, int64_t n, int64_t k, float *packed) {
    const int64_t panels = linear_panels(n);
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
        float *dst = packed + p * k * NR;
        for (int64_t kk = 0; kk < k; ++kk) {
            for (int64_t j = 0; j < NR; ++j) {
                const int64_t col = p * NR + j;
                dst[kk * NR + j] = col < n ? w[col * k + kk] : 0.0f;
            }
        }
    }
}

/* Rows [0, mr) of a block, one panel: out[i][j] = sum_k x[i][k] * panel[k][j] (+ bias). */
static void block_scalar(const float *x, int64_t x_stride, int64_t mr, const float *panel, int64_t k,
                         const float *bias, float *out, int64_t out_stride, int64_t nr) {
    for (int64_t i = 0; i < mr; ++i) {
        float acc[NR] = {0};
        for (int64_t kk = 0; kk < k; ++kk) {
            const float a = x[i * x_stride + kk];
            for (int64_t j = 0; j < NR; ++j) acc[j] = __builtin_fmaf(a, panel[kk * NR + j], acc[j]);
        }
        for (int64_t j = 0; j < nr; ++j) out[i * out_stride + j] = acc[j] + (bias ? bias[j] : 0.0f);
    }
}

#if defined(__AVX2__) && defined(__FMA__)
/* The same for up to MR rows with AVX2: the row count is a compile-time constant in each instance, and
 * its loops are unrolled, so the accumulators stay in registers (not unrolled, GCC kept them in memory
 * and the kernel ran at 40% of this one's speed). */
#define EACH_ROW(R) _Pragma("GCC unroll 8") for (int i = 0; i < (R); ++i)
#define DEFINE_BLOCK(R)                                                                                 \
    static void block_##R(const float *x, int64_t x_stride, const float *panel, int64_t k,              \
                          const float *bias, float *out, int64_t out_stride, int64_t nr) {              \
        __m256 lo[R], hi[R];                                                                            \
        EACH_ROW(R) lo[i] = hi[i] = _mm256_setzero_ps();                                                \
        for (int64_t kk = 0; kk < k; ++kk) {                                                            \
            const __m256 b0 = _mm256_loadu_ps(panel + kk * NR);                                         \
            const __m256 b1 = _mm256_loadu_ps(panel + kk * NR + 8);                                     \
            EACH_ROW(R) {                                                                               \
                const __m256 a = _mm256_broadcast_ss(x + i * x_stride + kk);                            \
                lo[i] = _mm256_fmadd_ps(a, b0, lo[i]);                                                  \
                hi[i] = _mm256_fmadd_ps(a, b1, hi[i]);                                                  \
            }                                                                                           \
        }                                                                                               \
        if (bias) {                                                                                     \
            float padded[NR] = {0};                                                                     \
            memcpy(padded, bias, (size_t)nr * sizeof(float));                                           \
            const __m256 c0 = _mm256_loadu_ps(padded), c1 = _mm256_loadu_ps(padded + 8);                \
            EACH_ROW(R) {                                                                               \
                lo[i] = _mm256_add_ps(lo[i], c0);                                                       \
                hi[i] = _mm256_add_ps(hi[i], c1);                                                       \
            }                                                                                           \
        }                                                                                               \
        if (nr == NR) {                                                                                 \
            EACH_ROW(R) {                                                                               \
                _mm256_storeu_ps(out + i * out_stride, lo[i]);                                          \
                _mm256_storeu_ps(out + i * out_stride + 8, hi[i]);                                      \
            }                                                                                           \
        } else {                                                                                        \
            float tail[NR];                                                                             \
            EACH_ROW(R) {                                                                               \
                _mm256_storeu_ps(tail, lo[i]);                                                          \
                _mm256_storeu_ps(tail + 8, hi[i]);                                                      \
                memcpy(out + i * out_stride, tail, (size_t)nr * sizeof(float));                         \
            }                                                                                           \
        }                                                                                               \
    }
DEFINE_BLOCK(1)
DEFINE_BLOCK(2)
DEFINE_BLOCK(3)
DEFINE_BLOCK(4)
DEFINE_BLOCK(5)
DEFINE_BLOCK(6)
#endif

static void block(const float *x, int64_t x_stride, int64_t mr, const float *panel, int64_t k,
                  const float *bias, float *out, int64_t out_stride, int64_t nr) {
#if defined(__AVX2__) && defined(__FMA__)
    switch (mr) {
    case 6: block_6(x, x_stride, panel, k, bias, out, out_stride, nr); return;
    case 5: block_5(x, x_stride, panel, k, bias, out, out_stride, nr); return;
    case 4: block_4(x, x_stride, panel, k, bias, out, out_stride, nr); return;
    case 3: block_3(x, x_stride, panel, k, bias, out, out_stride, nr); return;
    case 2: block_2(x, x_stride, panel, k, bias, out, out_stride, nr); return;
    case 1: block_1(x, x_stride, panel, k, bias, out, out_stride, nr); return;
    }
#endif
    block_scalar(x, x_stride, mr, panel, k, bias, out, out_stride, nr);
}

int linear_has_simd(void) {
#if defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

void linear_f32(const float *x, int64_t x_stride, int64_t m, int64_t k, const float *packed, int64_t n,
                const float *bias, float *y) {
    const int64_t panels = linear_panels(n);
    const int64_t chunks = (m + MC - 1) / MC;
#pragma omp parallel for schedule(static) collapse(2)
    for (int64_t c = 0; c < chunks; ++c) {
        for (int64_t p = 0; p < panels; ++p) {
            const float *panel = packed + p * k * NR;
            const int64_t col = p * NR;
            const int64_t nr = n - col < NR ? n - col : NR;
            const int64_t row_end = (c + 1) * MC < m ? (c + 1) * MC : m;
            /* Blocks as even as possible (32 rows: 6,6,5,5,5,5, not 6x5 and a 2-row block that costs a
             * whole pass over the panel for a third of the work). */
            const int64_t rows = row_end - c * MC;
            const int64_t blocks = (rows + MR - 1) / MR;
            for (int64_t b = 0, row = c * MC; b < blocks; ++b) {
                const int64_t mr = rows / blocks + (b < rows % blocks);
                block(x + row * x_stride, x_stride, mr, panel, k, bias ? bias + col : NULL, y + row * n + col,
                      n, nr);
                row += mr;
            }
        }
    }
}
