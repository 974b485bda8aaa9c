/* The decoder's element-wise steps, each one pass over memory: RMSNorm, rotary embedding (in
   place) and silu(gate) * up, fp32 or bf16 tensors; written once over vec.h's vector type.

   Built and loaded by model/kernels/elementwise.py, which documents why. Every element's
   (and, for the norm, every row's) arithmetic is the same whatever the number of rows or
   threads, and whatever the build (vec.h), so a decode step and a verify of the same
   positions give the same bits. Rounding follows torch's eager ops step by step where that
   is cheap: rotary rounds each product and the sum (bit for bit torch's in fp32 and bf16),
   RMSNorm rounds the normalized row to the dtype before the weight, as torch's module does. */
#include <stdint.h>

#include "vec.h"

/* Parallel only where the work pays for waking the threads. */
#define WORTH(elements) ((elements) >= 32768)

#define OPS(T)                                                                              \
    /* out[r] = w * T(x[r] / sqrt(mean(x[r]^2) + eps)), rows `stride` elements apart; the   \
       squares summed over W logical lanes (vec.h), so every build sums in one order. */    \
    static void rms_norm_##T(const void *x, int64_t rows, int64_t dim, int64_t stride,      \
                             const void *w, float eps, void *out, int threads) {            \
        _Pragma("omp parallel for schedule(static) num_threads(threads) if(WORTH(rows * dim))") \
        for (int64_t r = 0; r < rows; r++) {                                                \
            vf sq[NV];                                                                      \
            for (int j = 0; j < NV; j++) sq[j] = vzero();                                   \
            for (int64_t c = 0; c < dim; c += W)                                            \
                for (int j = 0; j < NV; j++) {                                              \
                    const int64_t at = c + j * VL;                                          \
                    if (at < dim) {                                                         \
                        const vf v = ld_##T(x, r * stride + at, dim - at);                  \
                        sq[j] = vfma(v, v, sq[j]);                                          \
                    }                                                                       \
                }                                                                           \
            const float mean = vsum_wide(sq) / (float)dim;                                  \
            const vf inv = vsplat(1.0f / __builtin_sqrtf(mean + eps));                      \
            for (int64_t c = 0; c < dim; c += VL) {                                         \
                const vf v = r_##T(ld_##T(x, r * stride + c, dim - c) * inv);               \
                st_##T(out, r * dim + c, ld_##T(w, c, dim - c) * v, dim - c);               \
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
                for (int64_t c = 0; c < half; c += VL) {                                    \
                    const int64_t n = half - c;                                             \
                    const vf x1 = ld_##T(x, o + c, n), x2 = ld_##T(x, o + half + c, n);     \
                    const vf c1 = ld_##T(cos, at + c, n), c2 = ld_##T(cos, at + half + c, n); \
                    const vf s1 = ld_##T(sin, at + c, n), s2 = ld_##T(sin, at + half + c, n); \
                    const vf y1 = r_##T(x1 * c1) - r_##T(x2 * s1);                          \
                    const vf y2 = r_##T(x2 * c2) + r_##T(x1 * s2);                          \
                    st_##T(x, o + c, y1, n);                                                \
                    st_##T(x, o + half + c, y2, n);                                         \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
    }                                                                                       \
    /* out[r] = T(silu(g[r])) * u[r]; g and u rows `gs` and `us` apart, out contiguous. */  \
    static void silu_mul_##T(const void *g, int64_t gs, const void *u, int64_t us,          \
                             int64_t rows, int64_t cols, void *out, int threads) {          \
        _Pragma("omp parallel for schedule(static) num_threads(threads) if(WORTH(rows * cols))") \
        for (int64_t r = 0; r < rows; r++) {                                                \
            for (int64_t c = 0; c < cols; c += VL) {                                        \
                const vf x = ld_##T(g, r * gs + c, cols - c);                               \
                /* sigmoid from exp(-|x|) <= 1: no overflow at either end */                \
                const vf z = vexp(vzero() - vabs(x));                                       \
                const vf one = vsplat(1.0f);                                                \
                const vf num = vselect(x < vzero(), z, one);                                \
                const vf s = r_##T(x * (num / (one + z)));                                  \
                st_##T(out, r * cols + c, s * ld_##T(u, r * us + c, cols - c), cols - c);   \
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
