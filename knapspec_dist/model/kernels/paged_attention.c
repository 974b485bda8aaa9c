/* Attention of a forward's new tokens over a paged KV cache, on a CPU with AVX-512 (fp32).

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

/* exp(x) for x <= 0, Cephes' polynomial; lanes below -87 (and the masked -inf) give 0. */
static inline __m512 vexp(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.0f);
    const __mmask16 keep = _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ);
    x = _mm512_max_ps(x, lo);
    __m512 fx = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    fx = _mm512_roundscale_ps(fx, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500E-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507E-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073E-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894E-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459E-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201E-1f));
    y = _mm512_fmadd_ps(_mm512_mul_ps(y, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512i n = _mm512_cvtps_epi32(fx);
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mov_ps(keep, _mm512_mul_ps(y, _mm512_castsi512_ps(e)));
}

/* s[t] = q[t] . K for one page, N rows at once (a constant per instance, so the rows'
   accumulators stay in registers); q rows are MAXHD apart. */
#define QK(N)                                                                            \
    static void qk##N(int hd, const float *q, const float *k, __m512 *s) {              \
        __m512 a[N];                                                                     \
        for (int t = 0; t < N; t++) a[t] = _mm512_setzero_ps();                         \
        for (int d = 0; d < hd; d++) {                                                   \
            const __m512 kd = _mm512_load_ps(k + d * PAGE);                              \
            for (int t = 0; t < N; t++)                                                  \
                a[t] = _mm512_fmadd_ps(_mm512_set1_ps(q[t * MAXHD + d]), kd, a[t]);     \
        }                                                                                \
        for (int t = 0; t < N; t++) s[t] = a[t];                                         \
    }
/* acc[t] += p[t] . V for one page, N rows at once; acc rows MAXHD apart, p rows PAGE. */
#define PV(N)                                                                            \
    static void pv##N(int hd, const float *p, const float *v, float *acc) {             \
        for (int c = 0; c < hd; c += 16) {                                               \
            __m512 o[N];                                                                 \
            for (int t = 0; t < N; t++) o[t] = _mm512_load_ps(acc + t * MAXHD + c);     \
            for (int j = 0; j < PAGE; j++) {                                             \
                const __m512 vj = _mm512_loadu_ps(v + j * hd + c);                       \
                for (int t = 0; t < N; t++)                                              \
                    o[t] = _mm512_fmadd_ps(_mm512_set1_ps(p[t * PAGE + j]), vj, o[t]);   \
            }                                                                            \
            for (int t = 0; t < N; t++) _mm512_store_ps(acc + t * MAXHD + c, o[t]);     \
        }                                                                                \
    }
QK(1) QK(2) QK(3) QK(4) QK(5) QK(6) QK(7) QK(8)
PV(1) PV(2) PV(3) PV(4) PV(5) PV(6) PV(7) PV(8)

typedef void (*qk_fn)(int, const float *, const float *, __m512 *);
typedef void (*pv_fn)(int, const float *, const float *, float *);
static const qk_fn QKS[TILE + 1] = {0, qk1, qk2, qk3, qk4, qk5, qk6, qk7, qk8};
static const pv_fn PVS[TILE + 1] = {0, pv1, pv2, pv3, pv4, pv5, pv6, pv7, pv8};

typedef struct {
    const float *q;
    int64_t q_b, q_t, q_h;                /* strides of q[b][t][h][:] (dims contiguous) */
    const float *k, *v;                   /* the layer's pools */
    const int64_t *table;                 /* [B][blocks]: each row's pages */
    int64_t blocks;
    const int64_t *starts;                /* [B]: the first new token's position */
    int64_t pages;                        /* pages in the pool */
    int rows, heads, kv_heads, hd;        /* rows = B; T = tokens */
    int tokens;
    float scale;
    float *out;                           /* [B][T][H][HD], contiguous */
} Args;

/* Folded rows r0 .. r0+n of KV head `kv` of batch row `b`: row r is the query at the r/g-th
   new position of query head kv*g + r%g. */
static void tile(const Args *a, int b, int kv, int r0, int n) {
    float q[TILE][MAXHD] __attribute__((aligned(64)));
    float acc[TILE][MAXHD] __attribute__((aligned(64)));
    float p[TILE][PAGE] __attribute__((aligned(64)));
    float m[TILE];
    __m512 l[TILE];
    int64_t limit[TILE];  /* keys row t sees: 0 .. limit-1 */
    const int hd = a->hd, g = a->heads / a->kv_heads;
    for (int t = 0; t < n; t++) {
        const int r = r0 + t, i = r / g, h = kv * g + r % g;
        const float *src = a->q + b * a->q_b + i * a->q_t + h * a->q_h;
        for (int d = 0; d < hd; d++) q[t][d] = src[d] * a->scale;
        memset(acc[t], 0, sizeof(float) * hd);
        m[t] = -INFINITY;
        l[t] = _mm512_setzero_ps();
        limit[t] = a->starts[b] + i + 1;
    }
    const int64_t pages = (limit[n - 1] + PAGE - 1) / PAGE;  /* rows are in position order */
    const int64_t *table = a->table + b * a->blocks;
    const int64_t head = (int64_t)kv * a->pages;
    for (int64_t pg = 0; pg < pages; pg++) {
        const float *k = a->k + (head + table[pg]) * hd * PAGE;
        const float *v = a->v + (head + table[pg]) * PAGE * hd;
        if (pg + 1 < pages) {  /* the next page, fetched while this one is used */
            const char *nk = (const char *)(a->k + (head + table[pg + 1]) * hd * PAGE);
            const char *nv = (const char *)(a->v + (head + table[pg + 1]) * PAGE * hd);
            for (int c = 0; c < hd * PAGE * 4; c += 64) {
                _mm_prefetch(nk + c, _MM_HINT_T0);
                _mm_prefetch(nv + c, _MM_HINT_T0);
            }
        }
        const int64_t key0 = pg * PAGE;
        int t0 = 0;  /* rows before t0 have seen all their keys */
        while (t0 < n && limit[t0] <= key0) t0++;
        __m512 s[TILE];
        QKS[n - t0](hd, q[t0], k, s + t0);
        for (int t = t0; t < n; t++) {
            const int64_t valid = limit[t] - key0;
            if (valid < PAGE)
                s[t] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY),
                                          (__mmask16)((1u << valid) - 1u), s[t]);
            const float top = _mm512_reduce_max_ps(s[t]);
            if (top > m[t]) {  /* a new running max: rescale what was summed (else x 1) */
                const __m512 alpha = _mm512_set1_ps(
                    _mm512_cvtss_f32(vexp(_mm512_set1_ps(m[t] - top))));
                m[t] = top;
                l[t] = _mm512_mul_ps(l[t], alpha);
                for (int c = 0; c < hd; c += 16)
                    _mm512_store_ps(acc[t] + c, _mm512_mul_ps(_mm512_load_ps(acc[t] + c), alpha));
            }
            const __m512 e = vexp(_mm512_sub_ps(s[t], _mm512_set1_ps(m[t])));
            l[t] = _mm512_add_ps(l[t], e);
            _mm512_store_ps(p[t], e);
        }
        PVS[n - t0](hd, p[t0], v, acc[t0]);
    }
    for (int t = 0; t < n; t++) {
        const int r = r0 + t, i = r / g, h = kv * g + r % g;
        const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(l[t]));
        float *dst = a->out + (((int64_t)b * a->tokens + i) * a->heads + h) * hd;
        for (int c = 0; c < hd; c += 16)
            _mm512_storeu_ps(dst + c, _mm512_mul_ps(_mm512_load_ps(acc[t] + c), inv));
    }
}

int paged_attention(const float *q, int64_t q_b, int64_t q_t, int64_t q_h, const float *k,
                    const float *v, const int64_t *table, int64_t blocks, const int64_t *starts,
                    int64_t pages, int rows, int tokens, int heads, int kv_heads, int hd,
                    float scale, float *out, int threads) {
    if (hd % 16 || hd > MAXHD || heads % kv_heads || rows < 1 || tokens < 1) return 1;
    const Args a = {q, q_b, q_t, q_h, k, v, table, blocks, starts, pages, rows, heads,
                    kv_heads, hd, tokens, scale, out};
    const int folded = heads / kv_heads * tokens, tiles = (folded + TILE - 1) / TILE;
    const int64_t units = (int64_t)rows * kv_heads * tiles;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t u = 0; u < units; u++) {
        /* a row's last tiles first: in a prefill they see the most keys */
        const int tl = tiles - 1 - (int)(u % tiles);
        const int kv = (int)(u / tiles % kv_heads), b = (int)(u / tiles / kv_heads);
        const int r0 = tl * TILE;
        tile(&a, b, kv, r0, folded - r0 < TILE ? folded - r0 : TILE);
    }
    return 0;
}
