/* Attention of a forward's new tokens over a paged KV cache, on a CPU with AVX-512 (fp32 or
   bf16 tensors; the arithmetic is fp32 either way).

   Built and loaded by model/cpu_attention.py, which documents the layout and why. In short:
   keys are stored per page dims-major, [KV][pages][HD][PAGE], so a page's 16 keys are one
   vector per dim and q.K is a broadcast-FMA per dim; values row-major, [KV][pages*PAGE][HD].
   Each (row, KV head, tile of up to TILE folded query rows) is one unit of work, done by one
   thread from the first key to the last: a query row's result depends only on its own
   query, its own keys and its own position, never on the rows, heads or thread count
   beside it, so a decode step and a verify of the same positions give the same bits. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define PAGE 16
#define TILE 8
#define MAXHD 256

#include "vexp.h"

/* Loads and stores of 16 elements (or one) at element offset i, per element type: fp32, or
   bf16 (uint16_t) widened exactly to fp32 and stored back rounded to nearest even. */
static inline __m512 ld_f32(const void *p, int64_t i) { return _mm512_loadu_ps((const float *)p + i); }
static inline __m512 ld_bf16(const void *p, int64_t i) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline float one_f32(const void *p, int64_t i) { return ((const float *)p)[i]; }
static inline float one_bf16(const void *p, int64_t i) {
    const uint32_t b = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}
static inline void st_f32(void *p, int64_t i, __m512 x) { _mm512_storeu_ps((float *)p + i, x); }
static inline void st_bf16(void *p, int64_t i, __m512 x) {
    __m512i b = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    b = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    _mm256_storeu_si256((__m256i *)((uint16_t *)p + i), _mm512_cvtepi32_epi16(b));
}

/* s[t] = q[t] . K for one page, N rows at once (a constant per instance, so the rows'
   accumulators stay in registers); q rows are MAXHD apart (fp32, already scaled). */
#define QK(N, T)                                                                         \
    static void qk##N##_##T(int hd, const float *q, const void *k, __m512 *s) {         \
        __m512 a[N];                                                                     \
        for (int t = 0; t < N; t++) a[t] = _mm512_setzero_ps();                         \
        for (int d = 0; d < hd; d++) {                                                   \
            const __m512 kd = ld_##T(k, d * PAGE);                                       \
            for (int t = 0; t < N; t++)                                                  \
                a[t] = _mm512_fmadd_ps(_mm512_set1_ps(q[t * MAXHD + d]), kd, a[t]);     \
        }                                                                                \
        for (int t = 0; t < N; t++) s[t] = a[t];                                         \
    }
/* acc[t] += p[t] . V for one page, N rows at once; acc rows MAXHD apart, p rows PAGE. */
#define PV(N, T)                                                                         \
    static void pv##N##_##T(int hd, const float *p, const void *v, float *acc) {        \
        for (int c = 0; c < hd; c += 16) {                                               \
            __m512 o[N];                                                                 \
            for (int t = 0; t < N; t++) o[t] = _mm512_load_ps(acc + t * MAXHD + c);     \
            for (int j = 0; j < PAGE; j++) {                                             \
                const __m512 vj = ld_##T(v, j * hd + c);                                 \
                for (int t = 0; t < N; t++)                                              \
                    o[t] = _mm512_fmadd_ps(_mm512_set1_ps(p[t * PAGE + j]), vj, o[t]);   \
            }                                                                            \
            for (int t = 0; t < N; t++) _mm512_store_ps(acc + t * MAXHD + c, o[t]);     \
        }                                                                                \
    }

typedef void (*qk_fn)(int, const float *, const void *, __m512 *);
typedef void (*pv_fn)(int, const float *, const void *, float *);

typedef struct {
    const void *q;
    int64_t q_b, q_t, q_h;                /* strides of q[b][t][h][:] (dims contiguous) */
    const void *k, *v;                    /* the layer's pools */
    const int64_t *table;                 /* [B][blocks]: each row's pages */
    int64_t blocks;
    const int64_t *starts;                /* [B]: the first new token's position */
    int64_t pages;                        /* pages in the pool */
    int rows, heads, kv_heads, hd;        /* rows = B */
    int tokens;                           /* T */
    float scale;
    void *out;                            /* [B][T][H][HD], contiguous */
} Args;

/* Folded rows r0 .. r0+n of KV head `kv` of batch row `b`: row r is the query at the r/g-th
   new position of query head kv*g + r%g. */
#define TILE_FN(T)                                                                       \
    QK(1, T) QK(2, T) QK(3, T) QK(4, T) QK(5, T) QK(6, T) QK(7, T) QK(8, T)             \
    PV(1, T) PV(2, T) PV(3, T) PV(4, T) PV(5, T) PV(6, T) PV(7, T) PV(8, T)             \
    static const qk_fn QKS_##T[TILE + 1] = {0, qk1_##T, qk2_##T, qk3_##T, qk4_##T,      \
                                            qk5_##T, qk6_##T, qk7_##T, qk8_##T};        \
    static const pv_fn PVS_##T[TILE + 1] = {0, pv1_##T, pv2_##T, pv3_##T, pv4_##T,      \
                                            pv5_##T, pv6_##T, pv7_##T, pv8_##T};        \
    static void tile_##T(const Args *a, int b, int kv, int r0, int n) {                  \
        float q[TILE][MAXHD] __attribute__((aligned(64)));                              \
        float acc[TILE][MAXHD] __attribute__((aligned(64)));                            \
        float p[TILE][PAGE] __attribute__((aligned(64)));                               \
        float m[TILE];                                                                   \
        __m512 l[TILE];                                                                  \
        int64_t limit[TILE]; /* keys row t sees: 0 .. limit-1 */                         \
        const int hd = a->hd, g = a->heads / a->kv_heads;                                \
        for (int t = 0; t < n; t++) {                                                    \
            const int r = r0 + t, i = r / g, h = kv * g + r % g;                         \
            const int64_t at = b * a->q_b + i * a->q_t + h * a->q_h;                     \
            for (int d = 0; d < hd; d++) q[t][d] = one_##T(a->q, at + d) * a->scale;    \
            memset(acc[t], 0, sizeof(float) * hd);                                       \
            m[t] = -INFINITY;                                                            \
            l[t] = _mm512_setzero_ps();                                                  \
            limit[t] = a->starts[b] + i + 1;                                             \
        }                                                                                \
        const int64_t pages = (limit[n - 1] + PAGE - 1) / PAGE; /* rows in position order */ \
        const int64_t *table = a->table + b * a->blocks;                                 \
        const int64_t head = (int64_t)kv * a->pages;                                     \
        const int size = (int)sizeof(T##_t);                                             \
        for (int64_t pg = 0; pg < pages; pg++) {                                         \
            const int64_t k = (head + table[pg]) * hd * PAGE; /* element offsets */      \
            const int64_t v = (head + table[pg]) * PAGE * hd;                            \
            if (pg + 1 < pages) { /* the next page, fetched while this one is used */     \
                const char *nk = (const char *)a->k + (head + table[pg + 1]) * hd * PAGE * size; \
                const char *nv = (const char *)a->v + (head + table[pg + 1]) * PAGE * hd * size; \
                for (int c = 0; c < hd * PAGE * size; c += 64) {                         \
                    _mm_prefetch(nk + c, _MM_HINT_T0);                                   \
                    _mm_prefetch(nv + c, _MM_HINT_T0);                                   \
                }                                                                        \
            }                                                                            \
            const int64_t key0 = pg * PAGE;                                              \
            int t0 = 0; /* rows before t0 have seen all their keys */                    \
            while (t0 < n && limit[t0] <= key0) t0++;                                    \
            __m512 s[TILE];                                                              \
            QKS_##T[n - t0](hd, q[t0], (const T##_t *)a->k + k, s + t0);                 \
            for (int t = t0; t < n; t++) {                                               \
                const int64_t valid = limit[t] - key0;                                   \
                if (valid < PAGE)                                                        \
                    s[t] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY),                 \
                                              (__mmask16)((1u << valid) - 1u), s[t]);    \
                const float top = _mm512_reduce_max_ps(s[t]);                            \
                if (top > m[t]) { /* a new running max: rescale what was summed */       \
                    const __m512 alpha = _mm512_set1_ps(                                 \
                        _mm512_cvtss_f32(vexp(_mm512_set1_ps(m[t] - top))));             \
                    m[t] = top;                                                          \
                    l[t] = _mm512_mul_ps(l[t], alpha);                                   \
                    for (int c = 0; c < hd; c += 16)                                     \
                        _mm512_store_ps(acc[t] + c,                                      \
                                        _mm512_mul_ps(_mm512_load_ps(acc[t] + c), alpha)); \
                }                                                                        \
                const __m512 e = vexp(_mm512_sub_ps(s[t], _mm512_set1_ps(m[t])));        \
                l[t] = _mm512_add_ps(l[t], e);                                           \
                _mm512_store_ps(p[t], e);                                                \
            }                                                                            \
            PVS_##T[n - t0](hd, p[t0], (const T##_t *)a->v + v, acc[t0]);                \
        }                                                                                \
        for (int t = 0; t < n; t++) {                                                    \
            const int r = r0 + t, i = r / g, h = kv * g + r % g;                         \
            const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(l[t]));        \
            const int64_t at = (((int64_t)b * a->tokens + i) * a->heads + h) * hd;       \
            for (int c = 0; c < hd; c += 16)                                             \
                st_##T(a->out, at + c, _mm512_mul_ps(_mm512_load_ps(acc[t] + c), inv)); \
        }                                                                                \
    }

typedef float f32_t;
typedef uint16_t bf16_t;
TILE_FN(f32)
TILE_FN(bf16)

/* dtype: 0 fp32, 1 bf16 (q, pools and output alike). Returns nonzero for shapes it cannot
   run. */
int paged_attention(const void *q, int64_t q_b, int64_t q_t, int64_t q_h, const void *k,
                    const void *v, const int64_t *table, int64_t blocks, const int64_t *starts,
                    int64_t pages, int rows, int tokens, int heads, int kv_heads, int hd,
                    float scale, void *out, int threads, int dtype) {
    if (hd % 16 || hd > MAXHD || heads % kv_heads || rows < 1 || tokens < 1 || dtype < 0
        || dtype > 1)
        return 1;
    const Args a = {q, q_b, q_t, q_h, k, v, table, blocks, starts, pages, rows, heads,
                    kv_heads, hd, tokens, scale, out};
    const int folded = heads / kv_heads * tokens, tiles = (folded + TILE - 1) / TILE;
    const int64_t units = (int64_t)rows * kv_heads * tiles;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t u = 0; u < units; u++) {
        /* a row's last tiles first: in a prefill they see the most keys */
        const int tl = tiles - 1 - (int)(u % tiles);
        const int kv = (int)(u / tiles % kv_heads), b = (int)(u / tiles / kv_heads);
        const int r0 = tl * TILE, n = folded - r0 < TILE ? folded - r0 : TILE;
        if (dtype == 0)
            tile_f32(&a, b, kv, r0, n);
        else
            tile_bf16(&a, b, kv, r0, n);
    }
    return 0;
}
