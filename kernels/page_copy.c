/* Block -> paged KV cache in one pass, for CPU caches (vLLM's CPU attention backend); and back
 * (`kvstore_read_pages`, at the end: a save's tokens read out of the pages into a block).
 *
 * A block layer holds K and V as [kv_heads, tokens, head_dim] (any strides, head_dim contiguous).
 * A paged cache layer is [pages, kv_heads, page_tokens, 2 * head_dim]; each (page, head) plane of
 * 2 * N * D elements (N = page_tokens, D = head_dim) places K and V by one of four layouts:
 *
 *     KT_HALVES  K as [D][N] (transposed), then V as [N][D]      vLLM CPU_ATTN, ISA "vec", "vec16"
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
 * Where a run fills a contiguous stretch of the plane (every layout's V rows; HALVES' and SPLIT's
 * rows; KT_HALVES' K of a whole page; AMX's K of a whole 16-row tile and its V of whole row pairs),
 * the stretch is written with streamed (non-temporal) stores: straight from the block where a
 * stretch is rows of it, else put together first in a scratch buffer on the stack (32 KiB, in L1):
 *
 *     block rows --(transpose / interleave, plain stores)--> scratch --(streamed stores)--> page
 *
 * A plain store first reads its destination line (read for ownership): a third more memory
 * traffic than the copy itself, and, with a function call per 128-byte row, what kept the writer at
 * 2-3x a memcpy. A load's pages are read once, by the next forward, after its tens of MB have
 * left the caches. A run's ragged ends (mid-page, mid-tile, a lone row of a pair) keep plain stores.
 *
 * Transposes move tiles through vector registers: KT_HALVES' K as 8x8 tiles of 16-bit elements,
 * AMX's K as 4x4 tiles of 32-bit dim pairs (SSE2, which every x86-64 has), two tiles side by side
 * where the CPU has AVX2 (`simd`); AMX's V interleaves two token rows. Other element sizes, other
 * CPUs and tile edges go element by element. Layers are shared out among `threads` POSIX threads.
 * Nothing here allocates; slots are checked against the caches' size here, every shape, stride and
 * dtype by kernels/page_copy.py before the call (AMX: N and D multiples of 16).
 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#elif defined(__SSE2__)
#include <emmintrin.h>
#endif

enum { KT_HALVES = 0, HALVES = 1, SPLIT = 2, AMX = 3 };  /* PLANE_LAYOUTS' order */
enum { SCRATCH_BYTES = 32768 };  /* a stretch put together before it is streamed out; fits L1 */
enum { AHEAD = 32 };  /* source rows read ahead (prefetched) of the rows being moved */

/* Prefetch `rows` source rows of `row_bytes` bytes, `ss` bytes apart. The rows the loops move
 * next, AHEAD rows on: rows past a run are the block's next tokens, or nothing (a prefetch never
 * faults). Without it the transposes wait on memory (KT_HALVES was 1.2-1.4x the time with it, on
 * the 2-core AVX-512 VM). */
static inline void prefetch_rows(const char *src, int64_t ss, int64_t rows, int64_t row_bytes) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t at = 0; at < row_bytes; at += 64)
            __builtin_prefetch(src + r * ss + at, 0, 3);
}

typedef struct {
    int layout, elem_size, heads, page_tokens, head_dim;
    const uint64_t *caches;  /* [layers] base address of each layer's paged cache */
    const char *src;         /* block layer 0, K, head 0, token 0 */
    int64_t s_layer, s_kind, s_head, s_token;  /* strides in elements */
    const int64_t *slots;    /* [tokens] page * page_tokens + row of each token */
    int64_t tokens;
    int first_layer, end_layer;
    int avx2;                /* AVX2 paths: the CPU has it and the caller allows it */
} Job;

#if defined(__x86_64__)
#define AVX2 __attribute__((target("avx2")))
#define AVX2_INLINE __attribute__((target("avx2"), always_inline)) static inline
#endif

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

#if defined(__x86_64__)
/* dst[c * ds + r] = src[r * ss + c] for r in 0..7, c in 0..15 (16-bit elements): transpose8x8_u16's
 * network on two 8x8 tiles at once, one in each 128-bit half; half 0 holds columns 0..7 */
AVX2_INLINE void transpose8x16_u16(const uint16_t *src, int64_t ss, uint16_t *dst, int64_t ds) {
    __m256i a0 = _mm256_loadu_si256((const __m256i *)(src + 0 * ss)), a1 = _mm256_loadu_si256((const __m256i *)(src + 1 * ss));
    __m256i a2 = _mm256_loadu_si256((const __m256i *)(src + 2 * ss)), a3 = _mm256_loadu_si256((const __m256i *)(src + 3 * ss));
    __m256i a4 = _mm256_loadu_si256((const __m256i *)(src + 4 * ss)), a5 = _mm256_loadu_si256((const __m256i *)(src + 5 * ss));
    __m256i a6 = _mm256_loadu_si256((const __m256i *)(src + 6 * ss)), a7 = _mm256_loadu_si256((const __m256i *)(src + 7 * ss));
    __m256i b0 = _mm256_unpacklo_epi16(a0, a1), b1 = _mm256_unpackhi_epi16(a0, a1);
    __m256i b2 = _mm256_unpacklo_epi16(a2, a3), b3 = _mm256_unpackhi_epi16(a2, a3);
    __m256i b4 = _mm256_unpacklo_epi16(a4, a5), b5 = _mm256_unpackhi_epi16(a4, a5);
    __m256i b6 = _mm256_unpacklo_epi16(a6, a7), b7 = _mm256_unpackhi_epi16(a6, a7);
    __m256i c0 = _mm256_unpacklo_epi32(b0, b2), c1 = _mm256_unpackhi_epi32(b0, b2);
    __m256i c2 = _mm256_unpacklo_epi32(b1, b3), c3 = _mm256_unpackhi_epi32(b1, b3);
    __m256i c4 = _mm256_unpacklo_epi32(b4, b6), c5 = _mm256_unpackhi_epi32(b4, b6);
    __m256i c6 = _mm256_unpacklo_epi32(b5, b7), c7 = _mm256_unpackhi_epi32(b5, b7);
    const __m256i out[8] = {_mm256_unpacklo_epi64(c0, c4), _mm256_unpackhi_epi64(c0, c4), _mm256_unpacklo_epi64(c1, c5),
                            _mm256_unpackhi_epi64(c1, c5), _mm256_unpacklo_epi64(c2, c6), _mm256_unpackhi_epi64(c2, c6),
                            _mm256_unpacklo_epi64(c3, c7), _mm256_unpackhi_epi64(c3, c7)};
    for (int c = 0; c < 8; c++) {
        _mm_storeu_si128((__m128i *)(dst + c * ds), _mm256_castsi256_si128(out[c]));
        _mm_storeu_si128((__m128i *)(dst + (c + 8) * ds), _mm256_extracti128_si256(out[c], 1));
    }
}

/* dst[c * ds + r] = src[r * ss + c] for r in 0..3, c in 0..7 (32-bit elements): two 4x4 tiles at once */
AVX2_INLINE void transpose4x8_u32(const uint32_t *src, int64_t ss, uint32_t *dst, int64_t ds) {
    __m256i a0 = _mm256_loadu_si256((const __m256i *)(src + 0 * ss)), a1 = _mm256_loadu_si256((const __m256i *)(src + 1 * ss));
    __m256i a2 = _mm256_loadu_si256((const __m256i *)(src + 2 * ss)), a3 = _mm256_loadu_si256((const __m256i *)(src + 3 * ss));
    __m256i b0 = _mm256_unpacklo_epi32(a0, a1), b1 = _mm256_unpackhi_epi32(a0, a1);
    __m256i b2 = _mm256_unpacklo_epi32(a2, a3), b3 = _mm256_unpackhi_epi32(a2, a3);
    const __m256i out[4] = {_mm256_unpacklo_epi64(b0, b2), _mm256_unpackhi_epi64(b0, b2), _mm256_unpacklo_epi64(b1, b3),
                            _mm256_unpackhi_epi64(b1, b3)};
    for (int c = 0; c < 4; c++) {
        _mm_storeu_si128((__m128i *)(dst + c * ds), _mm256_castsi256_si128(out[c]));
        _mm_storeu_si128((__m128i *)(dst + (c + 4) * ds), _mm256_extracti128_si256(out[c], 1));
    }
}

/* transpose_tiles for AVX2: the wide tiles, then one SSE2 tile where 8 (4) columns are left */
AVX2 static void transpose_tiles_avx2(const char *src, int64_t ss, char *dst, int64_t ds, int64_t rows, int64_t cols,
                                      int es) {
    if (es == 2) {
        for (int64_t r0 = 0; r0 < rows; r0 += 8) {
            int64_t c0 = 0;
            prefetch_rows(src + (r0 + AHEAD) * ss, ss, 8, cols * 2);
            for (; c0 + 16 <= cols; c0 += 16)
                transpose8x16_u16((const uint16_t *)(src + r0 * ss) + c0, ss / 2, (uint16_t *)(dst + c0 * ds) + r0, ds / 2);
            for (; c0 < cols; c0 += 8)
                transpose8x8_u16((const uint16_t *)(src + r0 * ss) + c0, ss / 2, (uint16_t *)(dst + c0 * ds) + r0, ds / 2);
        }
        return;
    }
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
        int64_t c0 = 0;
        prefetch_rows(src + (r0 + AHEAD) * ss, ss, 4, cols * 4);
        for (; c0 + 8 <= cols; c0 += 8)
            transpose4x8_u32((const uint32_t *)(src + r0 * ss) + c0, ss / 4, (uint32_t *)(dst + c0 * ds) + r0, ds / 4);
        for (; c0 < cols; c0 += 4)
            transpose4x4_u32((const uint32_t *)(src + r0 * ss) + c0, ss / 4, (uint32_t *)(dst + c0 * ds) + r0, ds / 4);
    }
}
#endif

#if defined(__SSE2__)
/* The tiled part of a transpose of 2-byte (8x8 tiles) or 4-byte (4x4) elements: rows and cols
 * multiples of the tile; ss and ds in bytes, multiples of es */
static void transpose_tiles(const char *src, int64_t ss, char *dst, int64_t ds, int64_t rows, int64_t cols, int es,
                            int avx2) {
#if defined(__x86_64__)
    if (avx2) {
        transpose_tiles_avx2(src, ss, dst, ds, rows, cols, es);
        return;
    }
#endif
    (void)avx2;
    if (es == 2) {
        for (int64_t r0 = 0; r0 < rows; r0 += 8) {
            prefetch_rows(src + (r0 + AHEAD) * ss, ss, 8, cols * 2);
            for (int64_t c0 = 0; c0 < cols; c0 += 8)
                transpose8x8_u16((const uint16_t *)(src + r0 * ss) + c0, ss / 2, (uint16_t *)(dst + c0 * ds) + r0, ds / 2);
        }
        return;
    }
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
        prefetch_rows(src + (r0 + AHEAD) * ss, ss, 4, cols * 4);
        for (int64_t c0 = 0; c0 < cols; c0 += 4)
            transpose4x4_u32((const uint32_t *)(src + r0 * ss) + c0, ss / 4, (uint32_t *)(dst + c0 * ds) + r0, ds / 4);
    }
}
#endif

/* dst[c * ds + r * es] = src[r * ss + c * es] for r < rows, c < cols of `es`-byte elements;
 * ss and ds in bytes */
static void transpose(const char *src, int64_t ss, char *dst, int64_t ds, int64_t rows, int64_t cols, int es, int avx2) {
    int64_t r0 = 0, c0 = 0;  /* the tiles cover rows 0..r0-1, columns 0..c0-1 */
#if defined(__SSE2__)
    if ((es == 2 || es == 4) && ss % es == 0 && ds % es == 0) {
        const int64_t tile = es == 2 ? 8 : 4;
        r0 = rows - rows % tile;
        c0 = cols - cols % tile;
        if (r0 && c0)
            transpose_tiles(src, ss, dst, ds, r0, c0, es, avx2);
    }
#else
    (void)avx2;
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
static void amx_keys(const char *k, int64_t ss, char *plane, int64_t row, int64_t len, int d, int es, int avx2) {
    for (int64_t r = row, end = row + len, n; r < end; r += n) {
        const int64_t tile = r / 16, in_tile = r % 16;
        n = 16 - in_tile < end - r ? 16 - in_tile : end - r;
        transpose(k + (r - row) * ss, ss, plane + (tile * 16 * d + in_tile * 2) * es, 32 * (int64_t)es, n, d / 2, 2 * es,
                  avx2);
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

#if defined(__x86_64__)
/* `bytes` from src to dst: dst's whole 32-byte words by streamed stores, its ragged edges plainly */
AVX2 static void stream_out_avx2(char *dst, const char *src, int64_t bytes) {
    int64_t at = (32 - (int64_t)((uintptr_t)dst & 31)) & 31;
    if (at > bytes)
        at = bytes;
    memcpy(dst, src, at);
    for (; at + 64 <= bytes; at += 64) {
        const __m256i a = _mm256_loadu_si256((const __m256i *)(src + at));
        const __m256i b = _mm256_loadu_si256((const __m256i *)(src + at + 32));
        _mm256_stream_si256((__m256i *)(dst + at), a);
        _mm256_stream_si256((__m256i *)(dst + at + 32), b);
    }
    for (; at + 32 <= bytes; at += 32)
        _mm256_stream_si256((__m256i *)(dst + at), _mm256_loadu_si256((const __m256i *)(src + at)));
    memcpy(dst + at, src + at, bytes - at);
}

/* Rows of `row_bytes` bytes, `ss` bytes apart at each of `halves` sources (1 or 2: K, then V at
 * src + s_kind), written one after another from dst by streamed 32-byte stores: HALVES' and V's
 * rows (one source), SPLIT's [K | V] rows (two). row_bytes and dst multiples of 32. */
AVX2 static void stream_rows_avx2(const char *src, int64_t s_kind, int halves, int64_t ss, char *dst, int64_t rows,
                                  int64_t row_bytes) {
    for (int64_t r = 0; r < rows; r++)
        for (int half = 0; half < halves; half++) {
            const char *from = src + half * s_kind + r * ss;
            prefetch_rows(from + AHEAD * ss, ss, 1, row_bytes);
            for (int64_t at = 0; at < row_bytes; at += 32, dst += 32)
                _mm256_stream_si256((__m256i *)dst, _mm256_loadu_si256((const __m256i *)(from + at)));
        }
}

/* AMX's V rows first..last-1 (whole pairs; v at row `first`) into the [N/2][16][2] dim blocks at
 * base, one 64-byte line per pair and 16 dims, streamed; 16-bit elements, base a multiple of 32 */
AVX2 static void amx_value_pairs_avx2(const char *v, int64_t ss, char *base, int64_t n, int64_t first, int64_t last,
                                      int d) {
    for (int64_t r = first; r < last; r += 2, v += 2 * ss) {
        prefetch_rows(v + AHEAD * ss, ss, 2, d * 2);
        for (int c = 0; c < d; c += 16) {
            const __m256i a = _mm256_loadu_si256((const __m256i *)(v + c * 2));
            const __m256i b = _mm256_loadu_si256((const __m256i *)(v + ss + c * 2));
            const __m256i lo = _mm256_unpacklo_epi16(a, b), hi = _mm256_unpackhi_epi16(a, b);  /* dims 0-3 8-11 | 4-7 12-15 */
            char *out = base + ((c / 16) * 16 * n + (r / 2) * 32) * 2;
            _mm256_stream_si256((__m256i *)out, _mm256_permute2x128_si256(lo, hi, 0x20));
            _mm256_stream_si256((__m256i *)(out + 32), _mm256_permute2x128_si256(lo, hi, 0x31));
        }
    }
}
#endif

/* `bytes` from src to dst, dst's whole 16-byte (AVX2: 32-byte) words by streamed stores, its edges plainly */
static void stream_out(char *dst, const char *src, int64_t bytes, int avx2) {
#if defined(__x86_64__)
    if (avx2) {
        stream_out_avx2(dst, src, bytes);
        return;
    }
#endif
    (void)avx2;
#if defined(__SSE2__)
    int64_t at = (16 - (int64_t)((uintptr_t)dst & 15)) & 15;
    if (at > bytes)
        at = bytes;
    memcpy(dst, src, at);
    for (; at + 64 <= bytes; at += 64) {
        const __m128i a = _mm_loadu_si128((const __m128i *)(src + at)), b = _mm_loadu_si128((const __m128i *)(src + at + 16));
        const __m128i c = _mm_loadu_si128((const __m128i *)(src + at + 32)), d = _mm_loadu_si128((const __m128i *)(src + at + 48));
        _mm_stream_si128((__m128i *)(dst + at), a);
        _mm_stream_si128((__m128i *)(dst + at + 16), b);
        _mm_stream_si128((__m128i *)(dst + at + 32), c);
        _mm_stream_si128((__m128i *)(dst + at + 48), d);
    }
    for (; at + 16 <= bytes; at += 16)
        _mm_stream_si128((__m128i *)(dst + at), _mm_loadu_si128((const __m128i *)(src + at)));
    memcpy(dst + at, src + at, bytes - at);
#else
    memcpy(dst, src, bytes);
#endif
}

/* Rows of `width` elements, `ss` apart at each of `halves` sources (K, then V `s_kind` elements
 * on), as one contiguous stretch at dst of rows * halves * width elements, streamed: straight from
 * the block where its rows are the stretch already, or AVX2 may store them whole, else gathered
 * into scratch a piece at a time. One source: HALVES' K, every V but AMX's; two: SPLIT's rows. */
static void stream_rows(const char *src, int64_t s_kind, int halves, int64_t ss, char *dst, int64_t rows,
                        int64_t width, int es, char *scratch, int avx2) {
    const int64_t row_bytes = halves * width * es;
    if (halves == 1 && (ss == width || rows == 1)) {
        stream_out(dst, src, rows * row_bytes, avx2);
        return;
    }
#if defined(__x86_64__)
    if (avx2 && (width * es) % 32 == 0 && (uintptr_t)dst % 32 == 0) {
        stream_rows_avx2(src, s_kind * es, halves, ss * es, dst, rows, width * es);
        return;
    }
#endif
    const int64_t per_piece = SCRATCH_BYTES / row_bytes;
    if (per_piece == 0) {  /* a row larger than scratch: plain stores */
        for (int half = 0; half < halves; half++)
            copy_rows(src + half * s_kind * es, ss, dst + half * width * es, halves * width, rows, width, es);
        return;
    }
    for (int64_t r = 0, n; r < rows; r += n) {
        n = rows - r < per_piece ? rows - r : per_piece;
        for (int half = 0; half < halves; half++)
            copy_rows(src + (half * s_kind + r * ss) * es, ss, scratch + half * width * es, halves * width, n, width, es);
        stream_out(dst + r * row_bytes, scratch, n * row_bytes, avx2);
    }
}

/* KT_HALVES' K of a whole page: the [D][N] half, g dims at a time transposed into scratch and
 * streamed. False (nothing written) when not even 8 dims of the page fit scratch. */
static int stream_page_keys_t(const char *k, int64_t ss, char *plane, int n, int d, int es, char *scratch, int avx2) {
    const int64_t dim_bytes = (int64_t)n * es;  /* one dim's row of the transposed half */
    int64_t g = SCRATCH_BYTES / dim_bytes;
    if (g < 8 && g < d)
        return 0;
    g = g >= d ? d : g - g % 8;
    for (int64_t c = 0, w; c < d; c += w) {
        w = d - c < g ? d - c : g;
        transpose(k + c * es, ss * es, scratch, dim_bytes, n, w, es, avx2);
        stream_out(plane + c * dim_bytes, scratch, w * dim_bytes, avx2);
    }
    return 1;
}

/* AMX keys of rows row..row+len-1 of a page: a whole 16-row tile (16 * D contiguous elements) put
 * together in scratch and streamed, a tile's part (a run's ragged ends) stored in place */
static void amx_keys_streamed(const char *k, int64_t ss, char *plane, int64_t row, int64_t len, int d, int es,
                              char *scratch, int avx2) {
    const int64_t tile_bytes = 16 * (int64_t)d * es;
    for (int64_t r = row, end = row + len, n; r < end; r += n) {
        const int64_t tile = r / 16, in_tile = r % 16;
        n = 16 - in_tile < end - r ? 16 - in_tile : end - r;
        if (n == 16 && tile_bytes <= SCRATCH_BYTES) {
            transpose(k + (r - row) * ss, ss, scratch, 32 * (int64_t)es, 16, d / 2, 2 * es, avx2);
            stream_out(plane + tile * tile_bytes, scratch, tile_bytes, avx2);
        } else {
            amx_keys(k + (r - row) * ss, ss, plane, r, n, d, es, avx2);
        }
    }
}

/* AMX values of rows row..row+len-1: whole row pairs streamed, by AVX2 straight from the block,
 * else interleaved into scratch one dim block (a contiguous [pairs][16][2] stretch) at a time; a
 * lone row at either end in place */
static void amx_values_streamed(const char *v, int64_t ss, char *plane, int64_t n, int64_t row, int64_t len, int d,
                                int es, char *scratch, int avx2) {
    const int64_t first = row + row % 2, end = row + len, last = end - end % 2;  /* whole pairs: first..last-1 */
    if (row % 2)
        amx_values(v, ss, plane, n, row, 1, d, es);
    if (end % 2 && end - 1 >= first)
        amx_values(v + (end - 1 - row) * ss, ss, plane, n, end - 1, 1, d, es);
    if (last <= first)
        return;
    char *base = plane + n * d * es;
#if defined(__x86_64__)
    if (avx2 && es == 2 && (uintptr_t)base % 32 == 0) {
        amx_value_pairs_avx2(v + (first - row) * ss, ss, base, n, first, last, d);
        return;
    }
#endif
    const int64_t pair_bytes = 32 * (int64_t)es, per_piece = SCRATCH_BYTES / pair_bytes;  /* one pair, 16 dims */
    for (int c = 0; c < d; c += 16)
        for (int64_t r = first, pairs; r < last; r += 2 * pairs) {
            pairs = (last - r) / 2 < per_piece ? (last - r) / 2 : per_piece;
            for (int64_t i = 0; i < pairs; i++) {  /* pair i as at ((r / 2) + i) * 32 in the dim block */
                const char *a = v + (r + 2 * i - row) * ss + c * es, *b = a + ss;
                char *out = scratch + i * pair_bytes;
#if defined(__SSE2__)
                if (es == 2) {
                    const __m128i a0 = _mm_loadu_si128((const __m128i *)a), a1 = _mm_loadu_si128((const __m128i *)(a + 16));
                    const __m128i b0 = _mm_loadu_si128((const __m128i *)b), b1 = _mm_loadu_si128((const __m128i *)(b + 16));
                    _mm_storeu_si128((__m128i *)out, _mm_unpacklo_epi16(a0, b0));
                    _mm_storeu_si128((__m128i *)(out + 16), _mm_unpackhi_epi16(a0, b0));
                    _mm_storeu_si128((__m128i *)(out + 32), _mm_unpacklo_epi16(a1, b1));
                    _mm_storeu_si128((__m128i *)(out + 48), _mm_unpackhi_epi16(a1, b1));
                    continue;
                }
#endif
                for (int j = 0; j < 16; j++) {
                    memcpy(out + (2 * j) * es, a + j * es, es);
                    memcpy(out + (2 * j + 1) * es, b + j * es, es);
                }
            }
            stream_out(base + ((c / 16) * 16 * n + (r / 2) * 32) * es, scratch, pairs * pair_bytes, avx2);
        }
}

static void *run_job(void *arg) {
    const Job *job = (const Job *)arg;
    const int es = job->elem_size, n = job->page_tokens, d = job->head_dim, avx2 = job->avx2;
    const int64_t plane = 2 * (int64_t)n * d;  /* elements of one (page, head) plane */
    _Alignas(64) char scratch[SCRATCH_BYTES];
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
                char *v_rows = p + ((int64_t)n * d + row * d) * es;  /* KT_HALVES' and HALVES' V rows */
                switch (job->layout) {
                case KT_HALVES:
                    if (len < n || !stream_page_keys_t(k, job->s_token, p, n, d, es, scratch, avx2))
                        transpose(k, job->s_token * es, p + row * es, (int64_t)n * es, len, d, es, avx2);
                    stream_rows(v, 0, 1, job->s_token, v_rows, len, d, es, scratch, avx2);
                    break;
                case HALVES:
                    stream_rows(k, 0, 1, job->s_token, p + row * d * es, len, d, es, scratch, avx2);
                    stream_rows(v, 0, 1, job->s_token, v_rows, len, d, es, scratch, avx2);
                    break;
                case AMX:
                    amx_keys_streamed(k, job->s_token * es, p, row, len, d, es, scratch, avx2);
                    amx_values_streamed(v, job->s_token * es, p, n, row, len, d, es, scratch, avx2);
                    break;
                default: /* SPLIT */
                    stream_rows(k, job->s_kind, 2, job->s_token, p + row * 2 * d * es, len, d, es, scratch, avx2);
                }
            }
        }
    }
#if defined(__SSE2__)
    _mm_sfence();  /* the streamed stores visible to whichever thread reads the pages next */
#endif
    return NULL;
}

/* 1 where this CPU runs AVX2; asked once */
static int cpu_avx2;
static pthread_once_t cpu_asked = PTHREAD_ONCE_INIT;
static void ask_cpu(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    cpu_avx2 = __builtin_cpu_supports("avx2") ? 1 : 0;
#endif
}

/* 1 where the AVX2 paths run here (`simd` 1 with an AVX2 CPU), 0 for the SSE2 / plain paths */
int kvstore_page_copy_avx2(void) {
    pthread_once(&cpu_asked, ask_cpu);
    return cpu_avx2;
}

/* Write a block's tokens into the pages of `layers` caches; each cache holds `slot_count` slots.
 * `simd` 1 takes the AVX2 paths where the CPU has them, 0 the paths every x86-64 (or other CPU)
 * runs: the same bytes either way. Returns -1, having written nothing, when a slot is outside
 * 0..slot_count-1; else 0. A thread that cannot start leaves its layers to the calling thread, so
 * the copy is always complete. */
int kvstore_write_pages(int layout, int elem_size, const uint64_t *caches, int layers, int heads, int page_tokens,
                        int head_dim, const char *src, int64_t s_layer, int64_t s_kind, int64_t s_head,
                        int64_t s_token, const int64_t *slots, int64_t tokens, int64_t slot_count, int threads,
                        int simd) {
    Job jobs[64];
    pthread_t ids[64];
    const int avx2 = simd && kvstore_page_copy_avx2();
    for (int64_t i = 0; i < tokens; i++)
        if (slots[i] < 0 || slots[i] >= slot_count)
            return -1;
    if (threads < 1) threads = 1;
    if (threads > 64) threads = 64;
    if (threads > layers) threads = layers;
    for (int t = 0; t < threads; t++) {
        Job job = {layout, elem_size, heads, page_tokens, head_dim, caches, src, s_layer, s_kind, s_head, s_token,
                   slots, tokens, layers * t / threads, layers * (t + 1) / threads, avx2};
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

/* The other way, for a save: read tokens out of the pages of `layers` caches into a block
 * [layers, 2, heads, tokens, head_dim] (contiguous, `dst`), token i from slot slots[i]. `offsets`
 * is the plane layout as kernels/page_copy_ref.py states it ([2][N][D] flat offsets of K and V of
 * row r, dim d in a (page, head) plane), so every layout reads through one loop: a (kind, row)
 * whose D offsets are consecutive (every row of SPLIT and HALVES, V of KT_HALVES) is one memcpy,
 * any other (transposed or interleaved K, AMX's V) is gathered element by element from a plane
 * that stays in L1 while its tokens are read (`runs[kind * n + row]`, 1 where that row's D offsets
 * run on). One thread, no allocation, no streamed stores: the block is read next by the store
 * thread's Put, while it is still in cache. As for the writer, slots are checked here and the rest
 * by kernels/page_copy.py, which derives `offsets` and `runs` once from the named layout (a
 * permutation of the plane: kernels/page_copy_ref.py). Returns -1, having read nothing, when a slot
 * is outside 0..slot_count-1; else 0. */
int kvstore_read_pages(int elem_size, const uint64_t *caches, int layers, int heads, int page_tokens, int head_dim,
                       const int32_t *offsets, const uint8_t *runs, char *dst, const int64_t *slots, int64_t tokens,
                       int64_t slot_count) {
    const int64_t n = page_tokens, d = head_dim, plane = 2 * n * d, es = elem_size;
    if (n <= 0 || d <= 0 || (es != 2 && es != 4))
        return -1;
    for (int64_t i = 0; i < tokens; i++)
        if (slots[i] < 0 || slots[i] >= slot_count)
            return -1;
    for (int layer = 0; layer < layers; layer++) {
        const char *cache = (const char *)(uintptr_t)caches[layer];
        for (int h = 0; h < heads; h++) {
            for (int kind = 0; kind < 2; kind++) {
                char *out = dst + ((((int64_t)layer * 2 + kind) * heads + h) * tokens) * d * es;
                for (int64_t t = 0; t < tokens; t++, out += d * es) {
                    const int64_t page = slots[t] / n, row = slots[t] % n;
                    const char *p = cache + (page * heads + h) * plane * es;
                    const int32_t *o = offsets + (kind * n + row) * d;
                    if (runs[kind * n + row]) {
                        memcpy(out, p + (int64_t)o[0] * es, d * es);
                    } else if (es == 2) {
                        const uint16_t *src = (const uint16_t *)p;
                        uint16_t *to = (uint16_t *)out;
                        for (int64_t j = 0; j < d; j++)
                            to[j] = src[o[j]];
                    } else {
                        const uint32_t *src = (const uint32_t *)p;
                        uint32_t *to = (uint32_t *)out;
                        for (int64_t j = 0; j < d; j++)
                            to[j] = src[o[j]];
                    }
                }
            }
        }
    }
    return 0;
}
