/* One vector type per instruction set, and the few operations our CPU kernels use, so that
   each kernel is written once (the idea of vLLM's csrc/cpu/cpu_types.hpp), on GCC/Clang
   vector extensions: the compiler lowers `+`, `*`, comparisons, shifts and conversions to the
   target's own instructions. The build (model/kernels/build.py) defines one of:

     KNAPSPEC_AVX512  16 lanes, zmm; fused multiply-add by intrinsic
     KNAPSPEC_AVX2     8 lanes, ymm; fused multiply-add by intrinsic
     KNAPSPEC_NEON     4 lanes, Arm's q registers; fmaf per lane (one fmla / fmadd each)
     (none: generic)   4 lanes, whatever the target has; fmaf per lane (a library call
                       where the target has no fused multiply-add: correct, slow)

   The same bits from every build: each operation is one IEEE operation per lane (a fused
   multiply-add wherever the kernels write vfma, never a contraction: -ffp-contract=off),
   and a sum across lanes is taken over W = 16 logical lanes in one fixed tree (the halves
   added, then their halves...), whatever VL is. So a kernel's result does not depend on the
   machine's vector unit: an AVX2 and an AVX-512 node of one cluster compute the same. */
#ifndef KNAPSPEC_VEC_H
#define KNAPSPEC_VEC_H
#include <stdint.h>
#include <string.h>

/* QK_ROWS: the query rows whose q.K accumulators (W / VL vectors a row) stay in registers. */
#if defined(KNAPSPEC_AVX512)
#include <immintrin.h>
#define VL 16
#define QK_ROWS 8 /* 32 zmm: 8 accumulators, a key vector, a broadcast */
#elif defined(KNAPSPEC_AVX2)
#include <immintrin.h>
#define VL 8
#define QK_ROWS 4 /* 16 ymm: 2 accumulators a row, 2 key vectors, a broadcast */
#else
#define VL 4
#define QK_ROWS 4
#endif
#define W 16        /* the logical width of every sum across lanes */
#define NV (W / VL) /* vectors per logical width */

typedef float vf __attribute__((vector_size(VL * 4)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));
typedef uint16_t vh __attribute__((vector_size(VL * 2)));

static inline vf vsplat(float x) {
#if VL == 16
    return (vf){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
#elif VL == 8
    return (vf){x, x, x, x, x, x, x, x};
#else
    return (vf){x, x, x, x};
#endif
}
static inline vf vzero(void) { return vsplat(0.0f); }
static inline vi viota(void) {
    vi r;
    for (int i = 0; i < VL; i++) r[i] = i;
    return r;
}
/* a where m (all ones), else b */
static inline vf vselect(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); }
static inline vf vabs(vf x) { return (vf)((vu)x & 0x7fffffffu); }

/* a * b + c rounded once */
static inline vf vfma(vf a, vf b, vf c) {
#if defined(KNAPSPEC_AVX512)
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(KNAPSPEC_AVX2)
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    vf r;
    for (int i = 0; i < VL; i++) r[i] = __builtin_fmaf(a[i], b[i], c[i]);
    return r;
#endif
}

/* The sum of W logical lanes held in v[0 .. NV-1] (lane i of v[j] is logical lane j*VL+i),
   halves added first: the same tree on every width. Folds v in place. */
static inline float vsum_wide(vf *v) {
    for (int w = NV / 2; w >= 1; w /= 2)
        for (int j = 0; j < w; j++) v[j] = v[j] + v[j + w];
    vf x = v[0];
    for (int w = VL / 2; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) x[i] = x[i] + x[i + w];
    return x[0];
}
static inline float vmax_lanes(vf x) {
    for (int w = VL / 2; w >= 1; w /= 2) {
        const vf y = __builtin_shuffle(x, viota() ^ w);
        x = vselect(y > x, y, x);
    }
    return x[0];
}

/* Element types: fp32, or bf16 (uint16_t) widened exactly to fp32 and rounded back to nearest
   even. ld_T / st_T move lanes i .. i+n-1 (n < VL at a row's end: the other lanes load 0). */
static inline vf ld_f32(const void *p, int64_t i, int64_t n) {
    vf r = vzero();
    memcpy(&r, (const float *)p + i, (n < VL ? n : VL) * sizeof(float));
    return r;
}
static inline vf ld_bf16(const void *p, int64_t i, int64_t n) {
    vh h = {0};
    memcpy(&h, (const uint16_t *)p + i, (n < VL ? n : VL) * sizeof(uint16_t));
    return (vf)(__builtin_convertvector(h, vu) << 16);
}
/* fp32 rounded to the nearest bf16 (ties to even), kept as fp32 bits; NaN stays NaN. */
static inline vf round_bf16(vf x) {
    vu b = (vu)x;
    b = (b + (((b >> 16) & 1u) + 0x7fffu)) & 0xffff0000u;
    return vselect(x != x, x, (vf)b);
}
static inline vf r_f32(vf x) { return x; }
static inline vf r_bf16(vf x) { return round_bf16(x); }
static inline void st_f32(void *p, int64_t i, vf x, int64_t n) {
    memcpy((float *)p + i, &x, (n < VL ? n : VL) * sizeof(float));
}
static inline void st_bf16(void *p, int64_t i, vf x, int64_t n) {
    const vh h = __builtin_convertvector((vu)round_bf16(x) >> 16, vh);
    memcpy((uint16_t *)p + i, &h, (n < VL ? n : VL) * sizeof(uint16_t));
}
static inline float one_f32(const void *p, int64_t i) { return ((const float *)p)[i]; }
static inline float one_bf16(const void *p, int64_t i) {
    const uint32_t b = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

/* exp(x) for x <= 0, Cephes' polynomial; lanes below -87 (and -inf, and NaN) give 0. */
static inline vf vexp(vf x) {
    const vf lo = vsplat(-87.0f);
    const vi keep = x >= lo;
    x = vselect(x < lo, lo, x);
    vf fx = x * 1.44269504088896341f;
    fx = (fx + 12582912.0f) - 12582912.0f; /* to the nearest integer, ties to even (|fx| < 2^22) */
    vf r = vfma(-fx, vsplat(0.693359375f), x);
    r = vfma(-fx, vsplat(-2.12194440e-4f), r);
    vf y = vsplat(1.9875691500E-4f);
    y = vfma(y, r, vsplat(1.3981999507E-3f));
    y = vfma(y, r, vsplat(8.3334519073E-3f));
    y = vfma(y, r, vsplat(4.1665795894E-2f));
    y = vfma(y, r, vsplat(1.6666665459E-1f));
    y = vfma(y, r, vsplat(5.0000001201E-1f));
    y = vfma(y * r, r, r + 1.0f);
    const vi n = __builtin_convertvector(fx, vi);
    const vf e = (vf)((n + 127) << 23);
    return (vf)((vi)(y * e) & keep);
}

#endif
