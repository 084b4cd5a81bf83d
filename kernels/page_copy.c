/* Block -> paged KV cache in one pass, for CPU caches (vLLM's CPU attention backend).
 *
 * A block layer holds K and V as [kv_heads, tokens, head_dim] (any strides, head_dim contiguous).
 * A paged cache layer is [pages, kv_heads, page_tokens, 2 * head_dim]; each (page, head) plane of
 * 2 * N * D elements (N = page_tokens, D = head_dim) places K and V by one of four layouts:
 *
 *     KT_HALVES  K as [D][N] (transposed), then V as [N][D]      vLLM CPU_ATTN, ISA "vec"
 *     HALVES     K as [N][D], then V as [N][D]
 *     SPLIT      row r = [K(D) | V(D)]                           FLASH_ATTN / TRITON pages
 *     AMX        K as N/16 tiles [D/2][16][2], then V as         vLLM CPU_ATTN, ISA "amx"
 *                D/16 blocks [N/2][16][2] (VNNI pairs)
 *
 * Token i of the block goes to slot slots[i] = page * N + row. Consecutive tokens whose slots are
 * consecutive within one page form a run, copied as one tile per (layer, head):
 *
 *     slots   17 18 19 20 | 512 513 ... 639 | 64 65
 *     runs    |-- page 0, rows 17..20 --|-- page 4, rows 0..127 --|-- page 0, rows 64..65 --|
 *
 * The K transpose of KT_HALVES moves 8x8 tiles of 16-bit elements through SSE2 registers (every
 * x86-64 has SSE2). AMX's K is a transpose of dim pairs (4x4 tiles of 32-bit pairs); its V
 * interleaves two token rows, 8 elements per register. Other element sizes, other CPUs and tile
 * edges go element by element. Layers are shared out among `threads` POSIX threads. Nothing here
 * allocates; slots are checked against the caches' size here, every shape, stride and dtype by
 * kernels/page_copy.py before the call (AMX: N and D multiples of 16).
 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

enum { KT_HALVES = 0, HALVES = 1, SPLIT = 2, AMX = 3 };  /* PLANE_LAYOUTS' order */

typedef struct {
    int layout, elem_size, heads, page_tokens, head_dim;
    const uint64_t *caches;  /* [layers] base address of each layer's paged cache */
    const char *src;         /* block layer 0, K, head 0, token 0 */
    int64_t s_layer, s_kind, s_head, s_token;  /* strides in elements */
    const int64_t *slots;    /* [tokens] page * page_tokens + row of each token */
    int64_t tokens;
    int first_layer, end_layer;
} Job;

#if defined(__SSE2__)
/* dst[c * ds + r] = src[r * ss + c] for r, c in 0..7 (16-bit elements) */
static inline void transpose8x8_u16(const uint16_t *src, int64_t ss, uint16_t *dst, int64_t ds) {
    __m128i a0 = _mm_loadu_si128((const __m128i *)(src + 0 * ss)), a1 = _mm_loadu_si128((const __m128i *)(src + 1 * ss));
    __m128i a2 = _mm_loadu_si128((const __m128i *)(src + 2 * ss)), a3 = _mm_loadu_si128((const __m128i *)(src + 3 * ss));
    __m128i a4 = _mm_loadu_si128((const __m128i *)(src + 4 * ss)), a5 = _mm_loadu_si128((const __m128i *)(src + 5 * ss));
    __m128i a6 = _mm_loadu_si128((const __m128i *)(src + 6 * ss)), a7 = _mm_loadu_si128((const __m128i *)(src + 7 * ss));
    __m128i b0 = _mm_unpacklo_epi16(a0, a1), b1 = _mm_unpackhi_epi16(a0, a1);  /* r0 r1 interleaved */
    __m128i b2 = _mm_unpacklo_epi16(a2, a3), b3 = _mm_unpackhi_epi16(a2, a3);
    __m128i b4 = _mm_unpacklo_epi16(a4, a5), b5 = _mm_unpackhi_epi16(a4, a5);
    __m128i b6 = _mm_unpacklo_epi16(a6, a7), b7 = _mm_unpackhi_epi16(a6, a7);
    __m128i c0 = _mm_unpacklo_epi32(b0, b2), c1 = _mm_unpackhi_epi32(b0, b2);  /* r0..r3, columns 0-1, 2-3 */
    __m128i c2 = _mm_unpacklo_epi32(b1, b3), c3 = _mm_unpackhi_epi32(b1, b3);  /* columns 4-5, 6-7 */
    __m128i c4 = _mm_unpacklo_epi32(b4, b6), c5 = _mm_unpackhi_epi32(b4, b6);  /* r4..r7 */
    __m128i c6 = _mm_unpacklo_epi32(b5, b7), c7 = _mm_unpackhi_epi32(b5, b7);
    _mm_storeu_si128((__m128i *)(dst + 0 * ds), _mm_unpacklo_epi64(c0, c4));
    _mm_storeu_si128((__m128i *)(dst + 1 * ds), _mm_unpackhi_epi64(c0, c4));
    _mm_storeu_si128((__m128i *)(dst + 2 * ds), _mm_unpacklo_epi64(c1, c5));
    _mm_storeu_si128((__m128i *)(dst + 3 * ds), _mm_unpackhi_epi64(c1, c5));
    _mm_storeu_si128((__m128i *)(dst + 4 * ds), _mm_unpacklo_epi64(c2, c6));
    _mm_storeu_si128((__m128i *)(dst + 5 * ds), _mm_unpackhi_epi64(c2, c6));
    _mm_storeu_si128((__m128i *)(dst + 6 * ds), _mm_unpacklo_epi64(c3, c7));
    _mm_storeu_si128((__m128i *)(dst + 7 * ds), _mm_unpackhi_epi64(c3, c7));
}

/* dst[c * ds + r] = src[r * ss + c] for r, c in 0..3 (32-bit elements) */
static inline void transpose4x4_u32(const uint32_t *src, int64_t ss, uint32_t *dst, int64_t ds) {
    __m128i a0 = _mm_loadu_si128((const __m128i *)(src + 0 * ss)), a1 = _mm_loadu_si128((const __m128i *)(src + 1 * ss));
    __m128i a2 = _mm_loadu_si128((const __m128i *)(src + 2 * ss)), a3 = _mm_loadu_si128((const __m128i *)(src + 3 * ss));
    __m128i b0 = _mm_unpacklo_epi32(a0, a1), b1 = _mm_unpackhi_epi32(a0, a1);  /* r0 r1 interleaved */
    __m128i b2 = _mm_unpacklo_epi32(a2, a3), b3 = _mm_unpackhi_epi32(a2, a3);
    _mm_storeu_si128((__m128i *)(dst + 0 * ds), _mm_unpacklo_epi64(b0, b2));
    _mm_storeu_si128((__m128i *)(dst + 1 * ds), _mm_unpackhi_epi64(b0, b2));
    _mm_storeu_si128((__m128i *)(dst + 2 * ds), _mm_unpacklo_epi64(b1, b3));
    _mm_storeu_si128((__m128i *)(dst + 3 * ds), _mm_unpackhi_epi64(b1, b3));
}
#endif

/* dst[c * ds + r * es] = src[r * ss + c * es] for r < rows, c < cols of `es`-byte elements;
 * ss and ds in bytes */
static void transpose(const char *src, int64_t ss, char *dst, int64_t ds, int64_t rows, int64_t cols, int es) {
    int64_t r0 = 0, c0 = 0;
#if defined(__SSE2__)
    if (es == 2 && ss % 2 == 0 && ds % 2 == 0) {
        for (r0 = 0; r0 + 8 <= rows; r0 += 8)
            for (c0 = 0; c0 + 8 <= cols; c0 += 8)
                transpose8x8_u16((const uint16_t *)(src + r0 * ss) + c0, ss / 2, (uint16_t *)(dst + c0 * ds) + r0, ds / 2);
        r0 = rows - rows % 8;
        c0 = cols - cols % 8;
    } else if (es == 4 && ss % 4 == 0 && ds % 4 == 0) {
        for (r0 = 0; r0 + 4 <= rows; r0 += 4)
            for (c0 = 0; c0 + 4 <= cols; c0 += 4)
                transpose4x4_u32((const uint32_t *)(src + r0 * ss) + c0, ss / 4, (uint32_t *)(dst + c0 * ds) + r0, ds / 4);
        r0 = rows - rows % 4;
        c0 = cols - cols % 4;
    }
#endif
    /* what the tiles left: the bottom rows (all columns), then the right columns (tiled rows) */
    for (int64_t r = r0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++)
            memcpy(dst + c * ds + r * es, src + r * ss + c * es, es);
    for (int64_t r = 0; r < r0; r++)
        for (int64_t c = c0; c < cols; c++)
            memcpy(dst + c * ds + r * es, src + r * ss + c * es, es);
}

/* AMX keys: rows row..row+len-1 of a page, K(r, c) at ((r / 16) * 16 * D + (c / 2) * 32 + (r % 16) * 2
 * + c % 2): within a 16-row tile, a transpose of [rows][D/2] dim pairs into [D/2][16] */
static void amx_keys(const char *k, int64_t ss, char *plane, int64_t row, int64_t len, int d, int es) {
    for (int64_t r = row, end = row + len, n; r < end; r += n) {
        const int64_t tile = r / 16, in_tile = r % 16;
        n = 16 - in_tile < end - r ? 16 - in_tile : end - r;
        transpose(k + (r - row) * ss, ss, plane + (tile * 16 * d + in_tile * 2) * es, 32 * (int64_t)es, n, d / 2, 2 * es);
    }
}

/* AMX values: V(r, c) at (N * D + (c / 16) * 16 * N + (r / 2) * 32 + (c % 16) * 2 + r % 2): a row
 * pair interleaved, 16 dims at a time; a lone row (a run's odd start or end) element by element */
static void amx_values(const char *v, int64_t ss, char *plane, int64_t n, int64_t row, int64_t len, int d, int es) {
    char *base = plane + n * d * es;
    for (int64_t r = row, end = row + len; r < end;) {
        const char *src = v + (r - row) * ss;
#if defined(__SSE2__)
        if (es == 2 && r % 2 == 0 && r + 1 < end) {
            for (int c = 0; c < d; c += 16) {
                const uint16_t *a = (const uint16_t *)(src + c * es), *b = (const uint16_t *)(src + ss + c * es);
                uint16_t *out = (uint16_t *)(base + ((c / 16) * 16 * n + (r / 2) * 32) * es);
                const __m128i a0 = _mm_loadu_si128((const __m128i *)a), a1 = _mm_loadu_si128((const __m128i *)(a + 8));
                const __m128i b0 = _mm_loadu_si128((const __m128i *)b), b1 = _mm_loadu_si128((const __m128i *)(b + 8));
                _mm_storeu_si128((__m128i *)out, _mm_unpacklo_epi16(a0, b0));
                _mm_storeu_si128((__m128i *)(out + 8), _mm_unpackhi_epi16(a0, b0));
                _mm_storeu_si128((__m128i *)(out + 16), _mm_unpacklo_epi16(a1, b1));
                _mm_storeu_si128((__m128i *)(out + 24), _mm_unpackhi_epi16(a1, b1));
            }
            r += 2;
            continue;
        }
#endif
        for (int c = 0; c < d; c++)
            memcpy(base + ((c / 16) * 16 * n + (r / 2) * 32 + (c % 16) * 2 + r % 2) * es, src + c * es, es);
        r += 1;
    }
}

/* rows of `width` elements, source rows `ss` apart, destination rows `ds` apart */
static void copy_rows(const char *src, int64_t ss, char *dst, int64_t ds, int64_t rows, int64_t width, int es) {
    if (ss == width && ds == width) {
        memcpy(dst, src, rows * width * es);
        return;
    }
    for (int64_t r = 0; r < rows; r++)
        memcpy(dst + r * ds * es, src + r * ss * es, width * es);
}

static void *run_job(void *arg) {
    const Job *job = (const Job *)arg;
    const int es = job->elem_size, n = job->page_tokens, d = job->head_dim;
    const int64_t plane = 2 * (int64_t)n * d;  /* elements of one (page, head) plane */
    for (int layer = job->first_layer; layer < job->end_layer; layer++) {
        char *cache = (char *)(uintptr_t)job->caches[layer];
        const char *src_layer = job->src + layer * job->s_layer * es;
        for (int64_t token = 0, len; token < job->tokens; token += len) {
            /* the run: tokens whose slots follow each other within one page */
            const int64_t page = job->slots[token] / n, row = job->slots[token] % n;
            for (len = 1; token + len < job->tokens && row + len < n && job->slots[token + len] == job->slots[token] + len;)
                len++;
            for (int h = 0; h < job->heads; h++) {
                const char *k = src_layer + (h * job->s_head + token * job->s_token) * es;
                const char *v = k + job->s_kind * es;
                char *p = cache + ((page * job->heads + h) * plane) * es;  /* the (page, head) plane */
                switch (job->layout) {
                case KT_HALVES:
                    transpose(k, job->s_token * es, p + row * es, (int64_t)n * es, len, d, es);
                    copy_rows(v, job->s_token, p + ((int64_t)n * d + row * d) * es, d, len, d, es);
                    break;
                case HALVES:
                    copy_rows(k, job->s_token, p + row * d * es, d, len, d, es);
                    copy_rows(v, job->s_token, p + ((int64_t)n * d + row * d) * es, d, len, d, es);
                    break;
                case AMX:
                    amx_keys(k, job->s_token * es, p, row, len, d, es);
                    amx_values(v, job->s_token * es, p, n, row, len, d, es);
                    break;
                default: /* SPLIT */
                    copy_rows(k, job->s_token, p + row * 2 * d * es, 2 * d, len, d, es);
                    copy_rows(v, job->s_token, p + (row * 2 * d + d) * es, 2 * d, len, d, es);
                }
            }
        }
    }
    return NULL;
}

/* Write a block's tokens into the pages of `layers` caches; each cache holds `slot_count` slots.
 * Returns -1, having written nothing, when a slot is outside 0..slot_count-1; else 0. A thread
 * that cannot start leaves its layers to the calling thread, so the copy is always complete. */
int kvstore_write_pages(int layout, int elem_size, const uint64_t *caches, int layers, int heads, int page_tokens,
                        int head_dim, const char *src, int64_t s_layer, int64_t s_kind, int64_t s_head,
                        int64_t s_token, const int64_t *slots, int64_t tokens, int64_t slot_count, int threads) {
    Job jobs[64];
    pthread_t ids[64];
    for (int64_t i = 0; i < tokens; i++)
        if (slots[i] < 0 || slots[i] >= slot_count)
            return -1;
    if (threads < 1) threads = 1;
    if (threads > 64) threads = 64;
    if (threads > layers) threads = layers;
    for (int t = 0; t < threads; t++) {
        Job job = {layout, elem_size, heads, page_tokens, head_dim, caches, src, s_layer, s_kind, s_head, s_token,
                   slots, tokens, layers * t / threads, layers * (t + 1) / threads};
        jobs[t] = job;
    }
    int started = 0;
    for (int t = 1; t < threads; t++) {
        if (pthread_create(&ids[t], NULL, run_job, &jobs[t]) != 0)
            break;
        started = t;
    }
    run_job(&jobs[0]);
    for (int t = started + 1; t < threads; t++)  /* a thread that did not start: its layers here */
        run_job(&jobs[t]);
    for (int t = 1; t <= started; t++)
        pthread_join(ids[t], NULL);
    return 0;
}
