/* RoPE re-rotation of cached keys on the CPU, one pass (kernels/rope_native.py calls it).
 *
 * keys [A, B, T, D] (any strides for A, B and T; D contiguous) rotated by the angles whose cos and
 * sin [T, D/2] (float32, formed as in kernels/rope_ref.py) are given, into out (same shape, its own
 * strides; out may be keys itself). With h = D/2, for each row and frequency i:
 *
 *     y[i]     = x[i] * c[i] - x[i + h] * s[i]
 *     y[i + h] = x[i + h] * c[i] + x[i] * s[i]
 *
 * in float32 in this order, each product and sum rounded (built with -ffp-contract=off: no fused
 * multiply-add), then rounded to the keys' type as torch rounds (bfloat16: to nearest even, NaN to
 * 0x7FC0). That is the torch reference's arithmetic, so results are bit for bit the same. Both
 * halves of a pair are read before either is written, so in place is safe.
 */
#include <stdint.h>
#include <string.h>

enum { BF16 = 0, F32 = 1 };

static inline float bf16_to_float(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);  /* NaN: 0x7FC0 (a select: vectorizes) */
}

static void row_bf16(const uint16_t *x, uint16_t *y, const float *c, const float *s, int64_t h) {
    for (int64_t i = 0; i < h; i++) {
        float x1 = bf16_to_float(x[i]), x2 = bf16_to_float(x[i + h]);
        float a = x1 * c[i], b = x2 * s[i], p = x2 * c[i], q = x1 * s[i];
        y[i] = float_to_bf16(a - b);
        y[i + h] = float_to_bf16(p + q);
    }
}

static void row_f32(const float *x, float *y, const float *c, const float *s, int64_t h) {
    for (int64_t i = 0; i < h; i++) {
        float x1 = x[i], x2 = x[i + h];
        float a = x1 * c[i], b = x2 * s[i], p = x2 * c[i], q = x1 * s[i];
        y[i] = a - b;
        y[i + h] = p + q;
    }
}

/* Strides in elements. Returns 0, or -1 for an unknown dtype or an odd head_dim. */
int kvstore_rerotate(int dtype, const void *keys, void *out, int64_t A, int64_t B, int64_t T, int64_t D,
                     int64_t ka, int64_t kb, int64_t kt, int64_t oa, int64_t ob, int64_t ot,
                     const float *cos, const float *sin) {
    if ((dtype != BF16 && dtype != F32) || D % 2) return -1;
    int64_t h = D / 2;
    for (int64_t a = 0; a < A; a++)
        for (int64_t b = 0; b < B; b++)
            for (int64_t t = 0; t < T; t++) {
                int64_t src = a * ka + b * kb + t * kt, dst = a * oa + b * ob + t * ot;
                if (dtype == BF16)
                    row_bf16((const uint16_t *)keys + src, (uint16_t *)out + dst, cos + t * h, sin + t * h, h);
                else
                    row_f32((const float *)keys + src, (float *)out + dst, cos + t * h, sin + t * h, h);
            }
    return 0;
}
