/* RoPE on the new q/k rows and the K/V cache write, fused into one pass over the step's tokens.
 *
 * The torch path spends five elementwise operators (cat, neg, two mul, add) on the rotation and two
 * index_copy_ on the cache write, each a pass over memory with its own dispatch; here every row is
 * read once and written twice (in place and into its cache slot).
 *
 * Bit-identical to the torch (and HF) formula x * cos + rotate_half(x) * sin: this file is compiled
 * with -ffp-contract=off, so each product and the sum are rounded separately, as torch rounds each
 * operator's result, and no fused multiply-add changes the last bit.
 *
 * Layouts (float32): qk [T, heads + kv_heads, dim] with qk_stride floats between token rows (heads and
 * dims contiguous), rotated in place; v [T, kv_heads, dim] with v_stride floats between rows;
 * cos, sin [max_positions, dim] tables indexed by positions[t]; k_cache, v_cache
 * [kv_heads, num_slots, dim] (one layer), written at slots[t].
 */
#include <stdint.h>
#include <string.h>

int inferq_rope_abi_version(void) { return 1; }

static inline void rotate_row(float *x, const float *c, const float *s, int64_t dim) {
    const int64_t half = dim / 2;
    float first[512];  /* dim <= 1024 is checked by the caller */
    memcpy(first, x, sizeof(float) * (size_t)half);
    for (int64_t d = 0; d < half; d++) {
        const float a = x[d] * c[d];
        const float b = -x[d + half] * s[d];
        x[d] = a + b;
    }
    for (int64_t d = half; d < dim; d++) {
        const float a = x[d] * c[d];
        const float b = first[d - half] * s[d];
        x[d] = a + b;
    }
}

void rope_cache_write_f32(float *qk, int64_t qk_stride, const float *v, int64_t v_stride, const float *cos,
                          const float *sin, const int64_t *positions, const int64_t *slots, float *k_cache,
                          float *v_cache, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t dim,
                          int64_t num_slots) {
    const int64_t rows_per_token = heads + kv_heads;
#pragma omp parallel for schedule(static) if (tokens * rows_per_token * dim > 32768)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + positions[t] * dim;
        const float *s = sin + positions[t] * dim;
        float *row = qk + t * qk_stride;
        for (int64_t h = 0; h < rows_per_token; h++) rotate_row(row + h * dim, c, s, dim);
        const int64_t slot = slots[t];
        for (int64_t h = 0; h < kv_heads; h++) {
            const size_t at = (size_t)(h * num_slots + slot) * (size_t)dim;
            memcpy(k_cache + at, row + (heads + h) * dim, sizeof(float) * (size_t)dim);
            memcpy(v_cache + at, v + t * v_stride + h * dim, sizeof(float) * (size_t)dim);
        }
    }
}
