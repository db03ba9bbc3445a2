/* Paged attention for query rows on the CPU, reading K/V blocks in place (no gather copy).
 *
 * Each query row r (a decode token, or one token of a short prefill chunk) attends to the first
 * lens[r] positions of its sequence (under a sliding window > 0: only the last `window` of them; the
 * blocks before are not read; with softcap > 0 each score becomes softcap * tanh(score / softcap)), whose blocks are tables[row_table[r]][*]. For every (row, KV head)
 * the G = heads / kv_heads query heads of the group share each K/V row read: scores for the whole
 * context first, then one max, exp and sum per head, then the weighted sum of V. Work items are split
 * over OpenMP threads (the same libgomp runtime torch uses, so torch.set_num_threads governs both).
 *
 * Layouts (float32): q [*, heads, head_dim] with q_stride floats between token rows (heads and dims
 * contiguous), out [*, heads, head_dim] contiguous, both indexed by rows[r];
 * k, v [kv_heads, num_blocks, block_size, head_dim] (one layer); tables [*, max_blocks] int64.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

int inferq_abi_version(void) { return 2; }

/* exp(x) for x <= 0 in a form the compiler vectorises (glibc's expf is only vectorised under
 * -ffast-math, which would also drop the infinities the masking relies on): Cody-Waite range
 * reduction to r in [-ln2/2, ln2/2], a degree-6 polynomial (relative error ~2e-7, like expf's last
 * bit), then the power of two assembled in the exponent bits. Below -87 the result is 0. */
static inline float exp_nonpositive(float x) {
    const float clamped = x < -87.0f ? -87.0f : x;
    const float n = floorf(clamped * 1.44269504088896341f + 0.5f);
    float r = clamped - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union {
        int32_t i;
        float f;
    } scale;
    scale.i = (int32_t)(n + 127.0f) << 23;
    return x < -87.0f ? 0.0f : p * scale.f;
}

/* scores[j] = scale * dot(q, k_j) for the n rows of one K block (row stride dim). */
static void block_scores(const float *q, const float *kb, int64_t n, int64_t dim, float scale, float *scores) {
    int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
    if (dim % 8 == 0) {
        /* Eight rows at a time: eight running vector sums, then one transpose-and-add gives the eight
         * dot products in one vector (no horizontal sum per row). */
        for (; j + 8 <= n; j += 8) {
            const float *k0 = kb + j * dim;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
            for (int64_t d = 0; d < dim; d += 8) {
                const __m256 qd = _mm256_loadu_ps(q + d);
                a0 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k0 + 0 * dim + d), a0);
                a1 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k0 + 1 * dim + d), a1);
                a2 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k0 + 2 * dim + d), a2);
                a3 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k0 + 3 * dim + d), a3);
                a4 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k0 + 4 * dim + d), a4);
                a5 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k0 + 5 * dim + d), a5);
                a6 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k0 + 6 * dim + d), a6);
                a7 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k0 + 7 * dim + d), a7);
            }
            const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
            const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
            const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                                              _mm256_permute2f128_ps(u0, u1, 0x31));
            _mm256_storeu_ps(scores + j, _mm256_mul_ps(sums, _mm256_set1_ps(scale)));
        }
    }
#endif
    for (; j < n; j++) {
        const float *kr = kb + j * dim;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < dim; d++) dot += q[d] * kr[d];
        scores[j] = dot * scale;
    }
}

/* Ask for the next block while this one is processed: blocks are scattered, so the hardware prefetcher
 * cannot guess the next address and each block would otherwise start with a full memory latency. */
static inline void prefetch_block(const float *block, int64_t floats) {
    for (int64_t i = 0; i < floats; i += 16) __builtin_prefetch(block + i, 0, 3);
}

/* acc[0:dim] = sum over positions first..len-1 of p[t] * v_t, for one query head. */
static void weighted_sum(const float *p, const float *vh, const int64_t *table, int64_t first, int64_t len,
                         int64_t block_size, int64_t dim, float *acc) {
    const int64_t block_floats = block_size * dim;
    const int64_t num_table_blocks = (len + block_size - 1) / block_size;
    const int64_t first_block = first / block_size;
#if defined(__AVX2__) && defined(__FMA__)
    if (dim % 32 == 0) {
        /* 32 output floats at a time held in four registers across the whole context. */
        for (int64_t c = 0; c < dim; c += 32) {
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t b = first_block; b < num_table_blocks; b++) {
                const int64_t start = b * block_size;
                const int64_t n = len - start < block_size ? len - start : block_size;
                const float *vb = vh + table[b] * block_floats + c;
                if (c == 0 && b + 1 < num_table_blocks) prefetch_block(vh + table[b + 1] * block_floats, block_floats);
                for (int64_t j = start < first ? first - start : 0; j < n; j++) {
                    const __m256 pj = _mm256_set1_ps(p[start + j]);
                    const float *vr = vb + j * dim;
                    a0 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr), a0);
                    a1 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 8), a1);
                    a2 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 16), a2);
                    a3 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 24), a3);
                }
            }
            _mm256_storeu_ps(acc + c, a0);
            _mm256_storeu_ps(acc + c + 8, a1);
            _mm256_storeu_ps(acc + c + 16, a2);
            _mm256_storeu_ps(acc + c + 24, a3);
        }
        return;
    }
#endif
    memset(acc, 0, sizeof(float) * (size_t)dim);
    for (int64_t b = first_block; b < num_table_blocks; b++) {
        const int64_t start = b * block_size;
        const int64_t n = len - start < block_size ? len - start : block_size;
        const float *vb = vh + table[b] * block_floats;
        for (int64_t j = start < first ? first - start : 0; j < n; j++) {
            const float pj = p[start + j];
            const float *vr = vb + j * dim;
#pragma omp simd
            for (int64_t d = 0; d < dim; d++) acc[d] += pj * vr[d];
        }
    }
}

int paged_attention_f32(const float *q, int64_t q_stride, const float *k, const float *v, float *out,
                        const int64_t *rows, const int64_t *row_table, const int64_t *lens,
                        const int64_t *tables, int64_t num_rows, int64_t heads, int64_t kv_heads,
                        int64_t head_dim, int64_t block_size, int64_t num_blocks, int64_t max_blocks,
                        int64_t max_len, float scale, int64_t window, float softcap) {
    const int64_t group = heads / kv_heads;
    const int64_t dim = head_dim;
    const int64_t block_floats = block_size * dim;
    const int64_t head_stride = num_blocks * block_floats;
    int failed = 0;
#pragma omp parallel
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)(group * max_len));
        float *acc = (float *)malloc(sizeof(float) * (size_t)(group * dim));
        if (scores == NULL || acc == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t r = 0; r < num_rows; r++) {
            for (int64_t h = 0; h < kv_heads; h++) {
                if (scores == NULL || acc == NULL) continue;
                const int64_t len = lens[r];
                const int64_t first = window > 0 && len > window ? len - window : 0;
                const int64_t num_table_blocks = (len + block_size - 1) / block_size;
                const float *qr = q + rows[r] * q_stride + h * group * dim;
                const int64_t *table = tables + row_table[r] * max_blocks;
                const float *kh = k + h * head_stride;
                const float *vh = v + h * head_stride;
                /* Scores of every context position, block by block (no division per position). */
                for (int64_t b = first / block_size; b < num_table_blocks; b++) {
                    const int64_t start = b * block_size;
                    const int64_t skip = start < first ? first - start : 0; /* before the window */
                    const int64_t n = (len - start < block_size ? len - start : block_size) - skip;
                    const float *kb = kh + table[b] * block_floats + skip * dim;
                    if (b + 1 < num_table_blocks) prefetch_block(kh + table[b + 1] * block_floats, block_floats);
                    for (int64_t g = 0; g < group; g++)
                        block_scores(qr + g * dim, kb, n, dim, scale, scores + g * max_len + start + skip);
                }
                float inv_sum[64];
                for (int64_t g = 0; g < group; g++) {
                    float *s = scores + g * max_len;
                    if (softcap > 0.0f) /* Gemma 2: softcap * tanh(score / softcap) */
                        for (int64_t t = first; t < len; t++) s[t] = softcap * tanhf(s[t] / softcap);
                    float m = -INFINITY;
                    for (int64_t t = first; t < len; t++) m = s[t] > m ? s[t] : m;
                    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                    for (int64_t t = first; t < len; t++) {
                        s[t] = exp_nonpositive(s[t] - m);
                        sum += s[t];
                    }
                    inv_sum[g] = 1.0f / sum;
                }
                for (int64_t g = 0; g < group; g++)
                    weighted_sum(scores + g * max_len, vh, table, first, len, block_size, dim, acc + g * dim);
                float *o = out + (rows[r] * heads + h * group) * dim;
                for (int64_t g = 0; g < group; g++)
                    for (int64_t d = 0; d < dim; d++) o[g * dim + d] = acc[g * dim + d] * inv_sum[g];
            }
        }
        free(scores);
        free(acc);
    }
    return failed;
}
