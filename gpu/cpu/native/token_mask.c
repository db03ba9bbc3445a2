/* A grammar's token bitmask applied to rows of float32 logits: every token whose bit is clear gets -inf.
 *
 * xgrammar's CPU kernel tests every token's bit; here a whole 32-token word is decided at once, which is
 * what grammar masks look like: inside a JSON string nearly every word is all ones (nothing to write, only
 * the 6 KB bitmask is read), at a structural position nearly every word is zero (32 stores of -inf, which
 * vectorise). Only mixed words test bits, branch-free.
 *
 * Layouts: logits rows `row_stride` floats apart; bitmask int32 [*, words_per_row], bit i of word w is
 * token 32 w + i (xgrammar's layout); `rows` names the logits rows to mask, each masked by the bitmask row
 * of the same index; tokens at or past `vocab` are left alone.
 */
#include <math.h>
#include <stdint.h>

int inferq_token_mask_abi_version(void) { return 1; }

void apply_token_bitmask_f32(float *logits, int64_t row_stride, const int32_t *bitmask, int64_t words_per_row,
                             const int64_t *rows, int64_t nrows, int64_t vocab) {
    const int64_t words = (vocab + 31) / 32 < words_per_row ? (vocab + 31) / 32 : words_per_row;
    for (int64_t r = 0; r < nrows; r++) {
        float *x = logits + rows[r] * row_stride;
        const uint32_t *mask = (const uint32_t *)(bitmask + rows[r] * words_per_row);
        for (int64_t w = 0; w < words; w++) {
            const uint32_t word = mask[w];
            if (word == 0xFFFFFFFFu) continue;
            const int64_t base = w * 32;
            const int64_t n = vocab - base < 32 ? vocab - base : 32;
            float *y = x + base;
            if (word == 0) {
                for (int64_t i = 0; i < n; i++) y[i] = -INFINITY;
            } else {
                for (int64_t i = 0; i < n; i++) y[i] = (word >> i) & 1u ? y[i] : -INFINITY;
            }
        }
    }
}
