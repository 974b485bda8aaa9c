/* The decoder's element-wise steps, each one pass over memory, on a CPU with AVX-512: RMSNorm,
   rotary embedding (in place) and silu(gate) * up. fp32 or bf16 tensors.

   Built and loaded by model/cpu_ops.py, which documents why. Every element's (and, for the
   norm, every row's) arithmetic is the same whatever the number of rows or threads, so a
   decode step and a verify of the same positions give the same bits. Rounding follows
   torch's eager ops step by step where that is cheap: rotary rounds each product and the
   sum (bit for bit torch's in fp32 and bf16: built with -ffp-contract=off), RMSNorm rounds
   the normalized row to the dtype before the weight, as torch's module does. */
#include <immintrin.h>
#include <stdint.h>

#include "vexp.h"

/* Lanes 0 .. n-1 of a 16-lane step (n < 16 at a row's end). */
static inline __mmask16 lanes(int64_t n) { return n >= 16 ? 0xffff : (__mmask16)((1u << n) - 1u); }

static inline __m512 ld_f32(const void *p, int64_t i, __mmask16 m) {
    return _mm512_maskz_loadu_ps(m, (const float *)p + i);
}
static inline __m512 ld_bf16(const void *p, int64_t i, __mmask16 m) {
    const __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
/* fp32 rounded to the nearest bf16 (ties to even), kept as fp32 bits; NaN stays NaN. */
static inline __m512 rb(__m512 x) {
    __m512i b = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    b = _mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    b = _mm512_and_si512(b, _mm512_set1_epi32((int)0xffff0000u));
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_mask_mov_ps(_mm512_castsi512_ps(b), nan, x);
}
static inline __m512 r_f32(__m512 x) { return x; }
static inline __m512 r_bf16(__m512 x) { return rb(x); }
static inline void st_f32(void *p, int64_t i, __m512 x, __mmask16 m) {
    _mm512_mask_storeu_ps((float *)p + i, m, x);
}
static inline void st_bf16(void *p, int64_t i, __m512 x, __mmask16 m) {
    const __m512i b = _mm512_srli_epi32(_mm512_castps_si512(rb(x)), 16);
    _mm256_mask_storeu_epi16((uint16_t *)p + i, m, _mm512_cvtepi32_epi16(b));
}

/* Parallel only where the work pays for waking the threads. */
#define WORTH(elements) ((elements) >= 32768)

#define OPS(T)                                                                              \
    /* out[r] = w * T(x[r] / sqrt(mean(x[r]^2) + eps)), rows `stride` elements apart. */    \
    static void rms_norm_##T(const void *x, int64_t rows, int64_t dim, int64_t stride,      \
                             const void *w, float eps, void *out, int threads) {            \
        _Pragma("omp parallel for schedule(static) num_threads(threads) if(WORTH(rows * dim))") \
        for (int64_t r = 0; r < rows; r++) {                                                \
            __m512 sq = _mm512_setzero_ps();                                                \
            for (int64_t c = 0; c < dim; c += 16) {                                         \
                const __m512 v = ld_##T(x, r * stride + c, lanes(dim - c));                 \
                sq = _mm512_fmadd_ps(v, v, sq);                                             \
            }                                                                               \
            const float mean = _mm512_reduce_add_ps(sq) / (float)dim;                       \
            const __m512 inv = _mm512_set1_ps(1.0f / __builtin_sqrtf(mean + eps));          \
            for (int64_t c = 0; c < dim; c += 16) {                                         \
                const __mmask16 m = lanes(dim - c);                                         \
                const __m512 v = r_##T(_mm512_mul_ps(ld_##T(x, r * stride + c, m), inv));   \
                st_##T(out, r * dim + c, _mm512_mul_ps(ld_##T(w, c, m), v), m);             \
            }                                                                               \
        }                                                                                   \
    }                                                                                       \
    /* x[b][t][h] = x * cos + rotate_half(x) * sin, in place; cos, sin [B][T][hd], rows     \
       cb elements apart (0: one row's tables for every row). */                            \
    static void rotary_##T(void *x, int64_t rows, int64_t tokens, int64_t heads, int64_t hd, \
                           int64_t sb, int64_t st, int64_t sh, const void *cos,             \
                           const void *sin, int64_t cb, int threads) {                      \
        const int64_t half = hd / 2;                                                        \
        _Pragma("omp parallel for schedule(static) num_threads(threads) if(WORTH(rows * tokens * heads * hd))") \
        for (int64_t bt = 0; bt < rows * tokens; bt++) {                                    \
            const int64_t b = bt / tokens, t = bt % tokens, at = b * cb + t * hd;           \
            for (int64_t h = 0; h < heads; h++) {                                           \
                const int64_t o = b * sb + t * st + h * sh;                                 \
                for (int64_t c = 0; c < half; c += 16) {                                    \
                    const __mmask16 m = lanes(half - c);                                    \
                    const __m512 x1 = ld_##T(x, o + c, m), x2 = ld_##T(x, o + half + c, m); \
                    const __m512 c1 = ld_##T(cos, at + c, m), c2 = ld_##T(cos, at + half + c, m); \
                    const __m512 s1 = ld_##T(sin, at + c, m), s2 = ld_##T(sin, at + half + c, m); \
                    const __m512 y1 = _mm512_sub_ps(r_##T(_mm512_mul_ps(x1, c1)),           \
                                                    r_##T(_mm512_mul_ps(x2, s1)));          \
                    const __m512 y2 = _mm512_add_ps(r_##T(_mm512_mul_ps(x2, c2)),           \
                                                    r_##T(_mm512_mul_ps(x1, s2)));          \
                    st_##T(x, o + c, y1, m);                                                \
                    st_##T(x, o + half + c, y2, m);                                         \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
    }                                                                                       \
    /* out[r] = T(silu(g[r])) * u[r]; g and u rows `gs` and `us` apart, out contiguous. */  \
    static void silu_mul_##T(const void *g, int64_t gs, const void *u, int64_t us,          \
                             int64_t rows, int64_t cols, void *out, int threads) {          \
        _Pragma("omp parallel for schedule(static) num_threads(threads) if(WORTH(rows * cols))") \
        for (int64_t r = 0; r < rows; r++) {                                                \
            for (int64_t c = 0; c < cols; c += 16) {                                        \
                const __mmask16 m = lanes(cols - c);                                        \
                const __m512 x = ld_##T(g, r * gs + c, m);                                  \
                /* sigmoid from exp(-|x|) <= 1: no overflow at either end */                \
                const __m512 z = vexp(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x))); \
                const __m512 one = _mm512_set1_ps(1.0f);                                    \
                const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ); \
                const __m512 num = _mm512_mask_mov_ps(one, neg, z);                         \
                const __m512 s = r_##T(_mm512_mul_ps(x, _mm512_div_ps(num, _mm512_add_ps(one, z)))); \
                st_##T(out, r * cols + c, _mm512_mul_ps(s, ld_##T(u, r * us + c, m)), m);   \
            }                                                                               \
        }                                                                                   \
    }

OPS(f32)
OPS(bf16)

/* dtype: 0 fp32, 1 bf16. */
void rms_norm(const void *x, int64_t rows, int64_t dim, int64_t stride, const void *w,
              float eps, void *out, int threads, int dtype) {
    (dtype ? rms_norm_bf16 : rms_norm_f32)(x, rows, dim, stride, w, eps, out, threads);
}

void rotary(void *x, int64_t rows, int64_t tokens, int64_t heads, int64_t hd, int64_t sb,
            int64_t st, int64_t sh, const void *cos, const void *sin, int64_t cb, int threads,
            int dtype) {
    (dtype ? rotary_bf16 : rotary_f32)(x, rows, tokens, heads, hd, sb, st, sh, cos, sin, cb,
                                       threads);
}

void silu_mul(const void *g, int64_t gs, const void *u, int64_t us, int64_t rows,
              int64_t cols, void *out, int threads, int dtype) {
    (dtype ? silu_mul_bf16 : silu_mul_f32)(g, gs, u, us, rows, cols, out, threads);
}
