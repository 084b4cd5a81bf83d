/* Interleaved static rANS for the transform codec's integer codes (kernels/rans.py calls it).
 *
 * The format and its numpy reference are in kernels/rans_ref.py; this file is that reference's
 * loop in C, bit for bit. In short: N symbols, symbol i in lane i % W, each lane a 32-bit state
 * in [2^16, 2^32), frequencies out of 2^13, one 16-bit word read (decode) or written (encode) per
 * renormalization, all lanes sharing one word stream in decode order.
 *
 * Symbols come as rows of T codes. Row r (in coding order) is rows[r] of the caller's [R, T]
 * array and uses model models[r]. A model m has n[m] symbols: code v in [-E, E] is symbol v + E
 * (E = (n - 1) / 2, or (n - 2) / 2 with an escape symbol n - 1 for |v| > E, its value then
 * taken from the escape list), frequencies freq[m][..], cumulative cum[m][..] and a slot ->
 * symbol table slots[m][2^13] (16 KB: it stays in L1, which a 2^15 table did not; measured
 * 1.5x faster decode and no larger streams on real kvtc blocks).
 *
 * Decode checks every read against the input's length and ends by checking that every lane is
 * back at its initial state and every word and escape was used: a stream that fails these checks
 * is refused (nonzero return), and no stream is read or written out of bounds. (Some damage passes
 * the checks and decodes to other codes; the block's checksum is what catches it.)
 */
#include <stdint.h>

#define PROB_BITS 13
#define PROB_SCALE (1u << PROB_BITS)
#define STATE_LOW (1u << 16)

static const uint16_t zero_word = 0;

typedef struct {
    const uint32_t *freq, *cum;
    const uint16_t *slots;
    int64_t n, half;
    int esc;
} model_t;

/* model m's tables: n[m] symbols, escape flag, and pointers to its frequencies, cumulative
 * frequencies and slot table (the tables stay where the caller keeps them) */
static model_t model_of(int64_t m, const int64_t *n, const int32_t *has_esc, const uint32_t *const *freq,
                        const uint32_t *const *cum, const uint16_t *const *slots) {
    model_t md;
    md.freq = freq[m];
    md.cum = cum[m];
    md.slots = slots[m];
    md.n = n[m];
    md.esc = has_esc[m];
    md.half = (n[m] - 1 - (has_esc[m] ? 1 : 0)) / 2;
    return md;
}

/* codes [*, T] int32 (row stride T) -> words (filled backward from words[cap]), states [W], escapes
 * (filled backward from escapes[n_esc], so that they end in coding order). Returns the number of
 * words written plus the number of escapes times 2^32, -1 if a code lies outside a model without
 * an escape or a buffer is too small (cap >= rows * T + 1 never is), -2 if an escaped code does not
 * fit int16. */
int64_t kvstore_rans_encode(const int32_t *codes, int64_t n_tokens, int64_t n_rows, const int64_t *rows,
                            const int64_t *models, const int64_t *n, const int32_t *has_esc,
                            const uint32_t *const *freq, const uint32_t *const *cum, const uint16_t *const *slots,
                            int64_t lanes,
                            uint32_t *states, uint16_t *words, int64_t cap, int16_t *escapes, int64_t n_esc) {
    for (int64_t l = 0; l < lanes; l++) states[l] = STATE_LOW;
    int64_t w = cap, e = n_esc;
    for (int64_t r = n_rows - 1; r >= 0; r--) {
        model_t md = model_of(models[r], n, has_esc, freq, cum, slots);
        const int32_t *row = codes + rows[r] * n_tokens;
        for (int64_t t = n_tokens - 1; t >= 0; t--) {
            int64_t i = r * n_tokens + t;
            int32_t v = row[t];
            int64_t s;
            if (v < -md.half || v > md.half) {
                if (!md.esc || e <= 0) return -1;  /* outside a model without an escape */
                if (v < -32768 || v > 32767) return -2;  /* escapes are stored as int16 */
                escapes[--e] = (int16_t)v;
                s = md.n - 1;
            } else {
                s = v + md.half;
            }
            uint32_t f = md.freq[s], x = states[i % lanes];
            if ((uint64_t)x >= ((uint64_t)f << (32 - PROB_BITS))) {  /* ((STATE_LOW >> PROB_BITS) << 16) * f; f = 2^13 never emits */
                if (w <= 0) return -1;
                words[--w] = (uint16_t)(x & 0xffffu);
                x >>= 16;
            }
            states[i % lanes] = ((x / f) << PROB_BITS) + (x % f) + md.cum[s];
        }
    }
    return (int64_t)((uint64_t)(cap - w) | ((uint64_t)(n_esc - e) << 32));
}

/* One row of n_tokens symbols. With clamp = 0 the caller has checked that n_tokens words remain
 * (at most one read per symbol), so the word read needs no bound; inlined with a constant clamp,
 * each copy has its own loop. Returns 2 if the escapes run out. */
static inline int decode_row(const model_t *md, const uint16_t *words, int64_t *w_io, int64_t last,
                             const int16_t *escapes, int64_t *e_io, int64_t n_esc, uint32_t *states,
                             int64_t lanes, int64_t *lane_io, int64_t n_tokens, int32_t *row, const int clamp) {
    int64_t w = *w_io, e = *e_io, lane = *lane_io;
    const uint16_t *slots = md->slots;
    const uint32_t *freq = md->freq, *cum = md->cum;
    int32_t half = (int32_t)md->half, esc = md->esc ? (int32_t)md->n - 1 : -1;
    for (int64_t t = 0; t < n_tokens; t++) {
        uint32_t x = states[lane];
        uint32_t slot = x & (PROB_SCALE - 1);
        uint32_t s = slots[slot];
        x = freq[s] * (x >> PROB_BITS) + slot - cum[s];
        /* renormalize without a branch (taken for about bits/16 of the symbols: unpredictable) */
        uint32_t need = x < STATE_LOW;
        uint32_t next = words[clamp ? (w < last ? w : last) : w];
        x = (x << (need * 16)) | (next & (0u - need));  /* arithmetic, as gcc turns a ?: here into a branch */
        w += need;
        states[lane] = x;
        if ((int32_t)s == esc) {
            if (e >= n_esc) return 2;
            row[t] = escapes[e++];
        } else {
            row[t] = (int32_t)s - half;
        }
        if (++lane == lanes) lane = 0;
    }
    *w_io = w, *e_io = e, *lane_io = lane;
    return 0;
}

/* words [n_words] in decode order, states [W] -> out[rows[r] * T + t] (int32). 0, or nonzero if
 * the stream is damaged (1: words run out, 2: escapes run out, 3: not every lane ends at its
 * initial state or words or escapes are left over). */
int kvstore_rans_decode(const uint16_t *words, int64_t n_words, const uint32_t *states_in, int64_t lanes,
                        const int16_t *escapes, int64_t n_esc, int64_t n_tokens, int64_t n_rows,
                        const int64_t *rows, const int64_t *models, const int64_t *n, const int32_t *has_esc,
                        const uint32_t *const *freq, const uint32_t *const *cum, const uint16_t *const *slots,
                        uint32_t *states, int32_t *out) {
    for (int64_t l = 0; l < lanes; l++) states[l] = states_in[l];
    if (n_words == 0) words = &zero_word;  /* the clamped read below reads words[0] at least */
    int64_t w = 0, e = 0, lane = 0, last = n_words > 0 ? n_words - 1 : 0;
    for (int64_t r = 0; r < n_rows; r++) {
        model_t md = model_of(models[r], n, has_esc, freq, cum, slots);
        int32_t *row = out + rows[r] * n_tokens;
        int status = n_words - w >= n_tokens
            ? decode_row(&md, words, &w, last, escapes, &e, n_esc, states, lanes, &lane, n_tokens, row, 0)
            : decode_row(&md, words, &w, last, escapes, &e, n_esc, states, lanes, &lane, n_tokens, row, 1);
        if (status) return status;
        if (w > n_words) return 1;
    }
    for (int64_t l = 0; l < lanes; l++)
        if (states[l] != STATE_LOW) return 3;
    return (w == n_words && e == n_esc) ? 0 : 3;
}
