/* The stale_attention query pass's attention probabilities on the CPU (kernels/query_probs.py).
 *
 * For each KV head g of ``groups``, its M query rows (the query heads that read it, one after
 * another, each over the same R positions) over its keys 0..T-1:
 *
 *     s[m, j]     = scale * sum_d q[g, m, d] * k[g, j, d]        (bfloat16 inputs, float32 sums)
 *     probs[m, j] = softmax over the keys j <= pos[m] of s[m, j], 0 for the keys after pos[m]
 *     mass[j]    += weight[m] * probs[m, j]                         (summed over g and m)
 *
 * which is blend.select.attention_probs's within float32 rounding (the order of the sums, the scale
 * applied after the product, the exp): a bfloat16 product is exact in float32, so the products need
 * no float32 copies of q and k, and two
 * products go into each AVX512-BF16 dot-product instruction (vdpbf16ps) where a float32
 * multiply-add takes one. Keys are packed 16 to a register, a pair of dims per 32-bit lane; a
 * block of 4 rows x 64 keys is summed in 16 registers; each row's scores stay in a scratch row in
 * cache for the softmax, whose exp is a Cephes-style polynomial (about 1 ulp, as torch's).
 *
 * Returns NOT_HANDLED (the caller keeps its torch path) without AVX512F and AVX512-BF16 on this
 * CPU, for an odd head dimension, a row at a negative position (it would see no key), or when
 * scratch memory cannot be had.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { HANDLED = 0, NOT_HANDLED = 1 };

#define ROWS 4      /* rows summed at once */
#define BLOCKS 4    /* key blocks of 16 summed at once */
#define KEYS (16 * BLOCKS)

#define AVX512BF16 __attribute__((target("avx512f,avx512bf16")))

/* e^x for x <= 0 (x - max), Cephes expf's reduction and polynomial; 0 below -87.3 (where float32's
 * normal range ends), NaN for NaN. */
AVX512BF16 static inline __m512 exp_nonpositive(__m512 x) {
    const __m512 lowest = _mm512_set1_ps(-87.33654f);
    const __mmask16 normal = _mm512_cmp_ps_mask(x, lowest, _CMP_NLT_UQ);  /* x >= lowest, or NaN */
    x = _mm512_max_ps(lowest, x);  /* the second operand where either is NaN: NaN passes */
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_maskz_mov_ps(normal, _mm512_scalef_ps(p, n));
}

/* Keys [T, D] (rows ``stride`` elements apart) as packed[(block * pairs + p) * 16 + lane] = the
 * dims 2p, 2p+1 of key block * 16 + lane; 0 past the last key. */
static void pack_keys(uint32_t *packed, const uint16_t *keys, uint64_t n_keys, uint64_t padded, uint64_t pairs,
                      uint64_t stride) {
    for (uint64_t block = 0; block < padded / 16; block++) {
        uint32_t *out = packed + block * pairs * 16;
        for (uint64_t lane = 0; lane < 16; lane++) {
            uint64_t j = block * 16 + lane;
            if (j >= n_keys) {
                for (uint64_t p = 0; p < pairs; p++)
                    out[p * 16 + lane] = 0;
                continue;
            }
            const uint16_t *row = keys + j * stride;
            for (uint64_t p = 0; p < pairs; p++) {
                uint32_t pair;
                memcpy(&pair, row + 2 * p, 4);
                out[p * 16 + lane] = pair;
            }
        }
    }
}

/* Scores of ROWS rows (pairs ``pairs`` apart in ``q``) over the padded keys into scratch rows
 * ``padded`` apart, scaled. */
AVX512BF16 static void row_scores(float *scratch, const uint32_t *q, const uint32_t *packed, uint64_t pairs,
                                  uint64_t padded, float scale) {
    const __m512 scaled = _mm512_set1_ps(scale);
    for (uint64_t first = 0; first < padded; first += KEYS) {
        __m512 acc[ROWS][BLOCKS];
        for (int r = 0; r < ROWS; r++)
            for (int b = 0; b < BLOCKS; b++)
                acc[r][b] = _mm512_setzero_ps();
        const uint32_t *keys = packed + first * pairs;
        for (uint64_t p = 0; p < pairs; p++) {
            __m512bh k[BLOCKS];
            for (int b = 0; b < BLOCKS; b++)
                k[b] = (__m512bh)_mm512_loadu_si512(keys + (b * pairs + p) * 16);
            for (int r = 0; r < ROWS; r++) {
                __m512bh qr = (__m512bh)_mm512_set1_epi32((int)q[r * pairs + p]);
                for (int b = 0; b < BLOCKS; b++)
                    acc[r][b] = _mm512_dpbf16_ps(acc[r][b], qr, k[b]);
            }
        }
        for (int r = 0; r < ROWS; r++)
            for (int b = 0; b < BLOCKS; b++)
                _mm512_storeu_ps(scratch + r * padded + first + b * 16, _mm512_mul_ps(acc[r][b], scaled));
    }
}

/* Softmax of scores[0..visible) into out[0..n_keys) (0 past visible), weight * it added to mass. */
AVX512BF16 static void softmax_row(float *out, float *mass, const float *scores, uint64_t visible, uint64_t n_keys,
                                   float weight) {
    __m512 top = _mm512_set1_ps(-__builtin_inff());
    uint64_t j = 0;
    for (; j + 16 <= visible; j += 16)
        top = _mm512_max_ps(top, _mm512_loadu_ps(scores + j));
    __mmask16 tail = (__mmask16)((1u << (visible - j)) - 1u);
    top = _mm512_mask_max_ps(top, tail, top, _mm512_maskz_loadu_ps(tail, scores + j));
    const __m512 most = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 sums = _mm512_setzero_ps();
    for (j = 0; j + 16 <= visible; j += 16) {
        __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(scores + j), most));
        _mm512_storeu_ps(out + j, e);
        sums = _mm512_add_ps(sums, e);
    }
    if (tail) {
        __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, scores + j), most));
        _mm512_mask_storeu_ps(out + j, tail, e);
        sums = _mm512_add_ps(sums, _mm512_maskz_mov_ps(tail, e));
    }
    const float total = _mm512_reduce_add_ps(sums);
    if (total != total) {  /* a NaN score: the whole row NaN, masked keys too, as torch's softmax */
        for (j = 0; j < n_keys; j++) {
            out[j] = __builtin_nanf("");
            if (weight != 0.0f)
                mass[j] += out[j];
        }
        return;
    }
    const __m512 inverse = _mm512_set1_ps(1.0f / total);
    const __m512 weighted = _mm512_set1_ps(weight);
    for (j = 0; j < visible; j += 16) {
        __mmask16 lanes = visible - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (visible - j)) - 1u);
        __m512 p = _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, out + j), inverse);
        _mm512_mask_storeu_ps(out + j, lanes, p);
        if (weight != 0.0f)
            _mm512_mask_storeu_ps(mass + j, lanes,
                                  _mm512_add_ps(_mm512_maskz_loadu_ps(lanes, mass + j), _mm512_mul_ps(p, weighted)));
    }
    if (visible < n_keys)
        memset(out + visible, 0, (n_keys - visible) * sizeof(float));
}

/* probs [groups, rows, n_keys] float32 (contiguous); mass [n_keys] float32, added to; q [groups, rows, dim]
 * bfloat16 (group_stride elements between groups, rows contiguous); keys [groups, n_keys, dim]
 * bfloat16 (k_group_stride between groups, k_row_stride between keys, dims contiguous);
 * positions [rows]: the last key row m sees; weights [rows]: its share in mass. */
AVX512BF16 static int query_probs_avx512(float *probs, float *mass, const uint16_t *q, const uint16_t *keys,
                                         const int64_t *positions, const float *weights, uint64_t groups,
                                         uint64_t rows, uint64_t n_keys, uint64_t dim, uint64_t q_group_stride,
                                         uint64_t k_group_stride, uint64_t k_row_stride, float scale) {
    const uint64_t pairs = dim / 2, padded = (n_keys + KEYS - 1) / KEYS * KEYS;
    const uint64_t padded_rows = (rows + ROWS - 1) / ROWS * ROWS;
    uint32_t *packed = aligned_alloc(64, padded * pairs * 4);
    uint32_t *qpairs = aligned_alloc(64, (padded_rows * pairs * 4 + 63) / 64 * 64);
    float *scratch = aligned_alloc(64, ROWS * padded * sizeof(float));
    if (packed == NULL || qpairs == NULL || scratch == NULL) {
        free(packed);
        free(qpairs);
        free(scratch);
        return NOT_HANDLED;
    }
    for (uint64_t g = 0; g < groups; g++) {
        pack_keys(packed, keys + g * k_group_stride, n_keys, padded, pairs, k_row_stride);
        memcpy(qpairs, q + g * q_group_stride, rows * dim * 2);
        memset(qpairs + rows * pairs, 0, (padded_rows - rows) * pairs * 4);
        for (uint64_t first = 0; first < rows; first += ROWS) {
            row_scores(scratch, qpairs + first * pairs, packed, pairs, padded, scale);
            for (uint64_t r = 0; r < ROWS && first + r < rows; r++) {
                uint64_t m = first + r;
                uint64_t visible = (uint64_t)positions[m] + 1 > n_keys ? n_keys : (uint64_t)positions[m] + 1;
                softmax_row(probs + (g * rows + m) * n_keys, mass, scratch + r * padded, visible, n_keys, weights[m]);
            }
        }
    }
    free(packed);
    free(qpairs);
    free(scratch);
    return HANDLED;
}

/* 1 where this CPU runs the kernel (AVX512F and AVX512-BF16), else 0. */
int kvstore_query_probs_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
}

int kvstore_query_probs(float *probs, float *mass, const uint16_t *q, const uint16_t *keys, const int64_t *positions,
                        const float *weights, uint64_t groups, uint64_t rows, uint64_t n_keys, uint64_t dim,
                        uint64_t q_group_stride, uint64_t k_group_stride, uint64_t k_row_stride, float scale) {
    if (dim == 0 || dim % 2 != 0 || rows == 0 || n_keys == 0 || !kvstore_query_probs_supported())
        return NOT_HANDLED;
    for (uint64_t m = 0; m < rows; m++)
        if (positions[m] < 0)  /* a row that sees no key (torch's softmax: NaN) */
            return NOT_HANDLED;
    return query_probs_avx512(probs, mass, q, keys, positions, weights, groups, rows, n_keys, dim, q_group_stride,
                              k_group_stride, k_row_stride, scale);
}
