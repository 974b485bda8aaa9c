/* Attention of a forward's new tokens over a paged KV cache (fp32 or bf16 tensors; the
   arithmetic is fp32 either way), written once over vec.h's vector type.

   Built and loaded by model/kernels/paged_attention.py, which documents the layout and why.
   In short: keys are stored per page dims-major, [KV][pages][HD][PAGE], so a page's 16 keys
   are NV vectors per dim and q.K is a broadcast-FMA per dim; values row-major,
   [KV][pages*PAGE][HD]. Each (row, KV head, tile of up to TILE folded query rows) is one unit
   of work, done by one thread from the first key to the last: a query row's result depends
   only on its own query, its own keys and its own position, never on the rows, heads or
   thread count beside it, nor on the build (vec.h), so a decode step and a verify of the same
   positions give the same bits. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec.h"

#define PAGE W /* a page's keys are the W logical lanes */
#define MAXHD 256

/* s[t][j] = q[t] . K for one page (lanes j*VL ..), N rows at once (a constant per instance,
   so the rows' accumulators stay in registers); q rows are MAXHD apart (fp32, scaled). */
#define QK(N, T)                                                                         \
    static void qk##N##_##T(int hd, const float *q, const void *k, vf (*s)[NV]) {       \
        vf a[N][NV];                                                                     \
        for (int t = 0; t < N; t++)                                                      \
            for (int j = 0; j < NV; j++) a[t][j] = vzero();                              \
        for (int d = 0; d < hd; d++) {                                                   \
            vf kd[NV];                                                                   \
            for (int j = 0; j < NV; j++) kd[j] = ld_##T(k, d * PAGE + j * VL, VL);       \
            for (int t = 0; t < N; t++) {                                                \
                const vf qd = vsplat(q[t * MAXHD + d]);                                  \
                for (int j = 0; j < NV; j++) a[t][j] = vfma(qd, kd[j], a[t][j]);         \
            }                                                                            \
        }                                                                                \
        for (int t = 0; t < N; t++)                                                      \
            for (int j = 0; j < NV; j++) s[t][j] = a[t][j];                              \
    }
/* acc[t] += p[t] . V for one page, N rows at once; acc rows MAXHD apart, p rows PAGE. */
#define PV(N, T)                                                                         \
    static void pv##N##_##T(int hd, const float *p, const void *v, float *acc) {        \
        for (int c = 0; c < hd; c += VL) {                                               \
            vf o[N];                                                                     \
            for (int t = 0; t < N; t++) o[t] = ld_f32(acc, t * MAXHD + c, VL);           \
            for (int j = 0; j < PAGE; j++) {                                             \
                const vf vj = ld_##T(v, j * hd + c, VL);                                 \
                for (int t = 0; t < N; t++)                                              \
                    o[t] = vfma(vsplat(p[t * PAGE + j]), vj, o[t]);                      \
            }                                                                            \
            for (int t = 0; t < N; t++) st_f32(acc, t * MAXHD + c, o[t], VL);            \
        }                                                                                \
    }

typedef void (*qk_fn)(int, const float *, const void *, vf (*)[NV]);
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

#define TILE 8 /* query rows a unit of work takes: each page is read once for all of them */
#define FOR_8(X, T) X(1, T) X(2, T) X(3, T) X(4, T) X(5, T) X(6, T) X(7, T) X(8, T)
#define FNS_8(P, T) {0, P##1_##T, P##2_##T, P##3_##T, P##4_##T, P##5_##T, P##6_##T, P##7_##T, P##8_##T}
#if QK_ROWS == 8
#define FOR_QK(X, T) FOR_8(X, T)
#define FNS_QK(P, T) FNS_8(P, T)
#else
#define FOR_QK(X, T) X(1, T) X(2, T) X(3, T) X(4, T)
#define FNS_QK(P, T) {0, P##1_##T, P##2_##T, P##3_##T, P##4_##T}
#endif

/* Folded rows r0 .. r0+n of KV head `kv` of batch row `b`: row r is the query at the r/g-th
   new position of query head kv*g + r%g. */
#define TILE_FN(T)                                                                       \
    FOR_QK(QK, T) FOR_8(PV, T)                                                           \
    static const qk_fn QKS_##T[QK_ROWS + 1] = FNS_QK(qk, T);                             \
    static const pv_fn PVS_##T[TILE + 1] = FNS_8(pv, T);                                 \
    static void tile_##T(const Args *a, int b, int kv, int r0, int n) {                  \
        float q[TILE][MAXHD] __attribute__((aligned(64)));                              \
        float acc[TILE][MAXHD] __attribute__((aligned(64)));                            \
        float p[TILE][PAGE] __attribute__((aligned(64)));                               \
        float m[TILE];                                                                   \
        vf l[TILE][NV];                                                                  \
        int64_t limit[TILE]; /* keys row t sees: 0 .. limit-1 */                         \
        const int hd = a->hd, g = a->heads / a->kv_heads;                                \
        const vi iota = viota();                                                         \
        for (int t = 0; t < n; t++) {                                                    \
            const int r = r0 + t, i = r / g, h = kv * g + r % g;                         \
            const int64_t at = b * a->q_b + i * a->q_t + h * a->q_h;                     \
            for (int d = 0; d < hd; d++) q[t][d] = one_##T(a->q, at + d) * a->scale;    \
            memset(acc[t], 0, sizeof(float) * hd);                                       \
            m[t] = -INFINITY;                                                            \
            for (int j = 0; j < NV; j++) l[t][j] = vzero();                              \
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
                    __builtin_prefetch(nk + c, 0, 3);                                    \
                    __builtin_prefetch(nv + c, 0, 3);                                    \
                }                                                                        \
            }                                                                            \
            const int64_t key0 = pg * PAGE;                                              \
            int t0 = 0; /* rows before t0 have seen all their keys */                    \
            while (t0 < n && limit[t0] <= key0) t0++;                                    \
            vf s[TILE][NV];                                                              \
            for (int t = t0; t < n; t += QK_ROWS) /* QK_ROWS rows' accumulators at once */ \
                QKS_##T[n - t < QK_ROWS ? n - t : QK_ROWS](hd, q[t], (const T##_t *)a->k + k, \
                                                           s + t);                       \
            for (int t = t0; t < n; t++) {                                               \
                const int64_t valid = limit[t] - key0;                                   \
                float top = -INFINITY;                                                   \
                for (int j = 0; j < NV; j++) {                                           \
                    if (valid < PAGE)                                                    \
                        s[t][j] = vselect(iota + j * VL >= (int32_t)valid,               \
                                          vsplat(-INFINITY), s[t][j]);                   \
                    const float mj = vmax_lanes(s[t][j]);                                \
                    top = mj > top ? mj : top;                                           \
                }                                                                        \
                if (top > m[t]) { /* a new running max: rescale what was summed */       \
                    const vf alpha = vsplat(vexp(vsplat(m[t] - top))[0]);                \
                    m[t] = top;                                                          \
                    for (int j = 0; j < NV; j++) l[t][j] = l[t][j] * alpha;              \
                    for (int c = 0; c < hd; c += VL)                                     \
                        st_f32(acc[t], c, ld_f32(acc[t], c, VL) * alpha, VL);            \
                }                                                                        \
                for (int j = 0; j < NV; j++) {                                           \
                    const vf e = vexp(s[t][j] - m[t]);                                   \
                    l[t][j] = l[t][j] + e;                                               \
                    st_f32(p[t], j * VL, e, VL);                                         \
                }                                                                        \
            }                                                                            \
            PVS_##T[n - t0](hd, p[t0], (const T##_t *)a->v + v, acc[t0]);                \
        }                                                                                \
        for (int t = 0; t < n; t++) {                                                    \
            const int r = r0 + t, i = r / g, h = kv * g + r % g;                         \
            const vf inv = vsplat(1.0f / vsum_wide(l[t]));                               \
            const int64_t at = (((int64_t)b * a->tokens + i) * a->heads + h) * hd;       \
            for (int c = 0; c < hd; c += VL)                                             \
                st_##T(a->out, at + c, ld_f32(acc[t], c, VL) * inv, VL);                 \
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
    if (hd % W || hd > MAXHD || heads % kv_heads || rows < 1 || tokens < 1 || dtype < 0
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
