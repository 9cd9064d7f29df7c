/* RMSNorm and SwiGLU of training forwards, and their backward, each one pass over its rows
 * (fused_train.py says when).
 *
 * torch's autograd runs RMSNorm as six ops forward and about eight backward, and SwiGLU
 * (silu(g) * u) as two forward and three backward, each a full read and write of its tensors.
 * Here each forward reads its inputs once and writes its output once, and each backward reads
 * what it needs once and writes each gradient once.
 *
 * rms_norm_fwd: out = (x * r) * w per row, r = 1 / sqrt(mean(x^2) + eps), saved in rstd[row].
 *   bf16 (x, out bf16; w fp32): out = bf16(w * bf16(x * r)) when `round_first` (Hugging Face's
 *   order: normalise, round, scale by the bf16 weight), else bf16((x * r) * w) (Qwen3.5's
 *   zero-centred norm: scaled in fp32, then rounded).
 * rms_norm_bwd: g = dy * w; dx = r * (g - x * r^2 * mean(g * x)); the weight's gradient
 *   sum over rows of dy * x * r, one partial row per thread in dw[thread][:] (the caller sums them;
 *   NULL: not wanted). bf16 forms read bf16 dy and x and write bf16 dx, computing in fp32.
 * swiglu_fwd: h = silu(g) * u = g / (1 + exp(-g)) * u.
 * swiglu_bwd: s = sigmoid(g); du = dh * g * s; dg = dh * u * s * (1 + g * (1 - s)).
 *
 * Sums over a row run in SIMD lanes (`omp simd reduction`): equal to torch's up to fp32 rounding.
 * Rows of x, g and u are `*_stride` elements apart (views of a GEMM's output); outputs are
 * contiguous rows. exp is `exp_approx` (Cephes' polynomial, within 2 ulp of expf over the
 * clamped range): it vectorises where libm's expf does not without -ffast-math (cbuild.py).
 */
#include <math.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>

#include "bf16.h"

#define PARALLEL_FLOATS 32768 /* below this, one thread: a parallel region costs more */


/* e^x for x clamped to [-87, 88] (so 2^n stays a normal float): n = round(x / ln 2), x - n ln 2
 * in two parts (Cody-Waite), a degree-6 polynomial, then the exponent bits. NaN in gives NaN. */
static inline float exp_approx(float x) {
    const float c = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = floorf(c * 1.44269504088896341f + 0.5f);
    float r = c - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } s = {.i = ((int32_t)n + 127) << 23};
    return x != x ? x : p * s.f;
}

static inline float sigmoid(float g) { return 1.0f / (1.0f + exp_approx(-g)); }

/* ------------------------------------------------------------------------------ RMSNorm */
static inline float row_rstd(float ss, int64_t d, float eps) { return 1.0f / sqrtf(ss / (float)d + eps); }

void rms_norm_fwd(const float *x, int64_t xs, const float *w, float *out, float *rstd, int64_t n, int64_t d,
                  float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (n * d >= PARALLEL_FLOATS)
    for (int64_t i = 0; i < n; i++) {
        const float *xi = x + i * xs;
        float *oi = out + i * d;
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t j = 0; j < d; j++)
            ss += xi[j] * xi[j];
        const float r = row_rstd(ss, d, eps);
        rstd[i] = r;
        for (int64_t j = 0; j < d; j++)
            oi[j] = (xi[j] * r) * w[j];
    }
}

void rms_norm_fwd_bf16(const uint16_t *x, int64_t xs, const float *w, uint16_t *out, float *rstd, int64_t n,
                       int64_t d, float eps, int round_first, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (n * d >= PARALLEL_FLOATS)
    for (int64_t i = 0; i < n; i++) {
        const uint16_t *xi = x + i * xs;
        uint16_t *oi = out + i * d;
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t j = 0; j < d; j++) {
            const float v = widen(xi[j]);
            ss += v * v;
        }
        const float r = row_rstd(ss, d, eps);
        rstd[i] = r;
        if (round_first)
            for (int64_t j = 0; j < d; j++)
                oi[j] = narrow(w[j] * bf16(widen(xi[j]) * r));
        else
            for (int64_t j = 0; j < d; j++)
                oi[j] = narrow((widen(xi[j]) * r) * w[j]);
    }
}

/* One row's backward from fp32 values: writes dx (fp32 scratch), adds to this thread's dw. */
static inline void rms_norm_row_bwd(const float *dy, const float *x, const float *w, float r, float *dx,
                                    float *dw, int64_t d) {
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t j = 0; j < d; j++)
        dot += dy[j] * w[j] * x[j];
    const float k = r * r * r * dot / (float)d;
    for (int64_t j = 0; j < d; j++)
        dx[j] = r * dy[j] * w[j] - k * x[j];
    if (dw)
        for (int64_t j = 0; j < d; j++)
            dw[j] += dy[j] * x[j] * r;
}

void rms_norm_bwd(const float *dy, int64_t dys, const float *x, int64_t xs, const float *w, const float *rstd,
                  float *dx, float *dw, int64_t n, int64_t d, int threads) {
    const int nt = n * d >= PARALLEL_FLOATS ? threads : 1;
#pragma omp parallel num_threads(nt)
    {
        float *mine = dw ? dw + (int64_t)omp_get_thread_num() * d : NULL;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i++)
            rms_norm_row_bwd(dy + i * dys, x + i * xs, w, rstd[i], dx + i * d, mine, d);
    }
}

void rms_norm_bwd_bf16(const uint16_t *dy, int64_t dys, const uint16_t *x, int64_t xs, const float *w,
                       const float *rstd, uint16_t *dx, float *dw, float *scratch, int64_t n, int64_t d,
                       int threads) {
    /* scratch: 3 rows of d floats a thread (dy, x and dx widened) */
    const int nt = n * d >= PARALLEL_FLOATS ? threads : 1;
#pragma omp parallel num_threads(nt)
    {
        const int t = omp_get_thread_num();
        float *mine = dw ? dw + (int64_t)t * d : NULL;
        float *dyf = scratch + (int64_t)t * 3 * d, *xf = dyf + d, *dxf = xf + d;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i++) {
            for (int64_t j = 0; j < d; j++) {
                dyf[j] = widen(dy[i * dys + j]);
                xf[j] = widen(x[i * xs + j]);
            }
            rms_norm_row_bwd(dyf, xf, w, rstd[i], dxf, mine, d);
            for (int64_t j = 0; j < d; j++)
                dx[i * d + j] = narrow(dxf[j]);
        }
    }
}

/* ------------------------------------------------------------------------------ SwiGLU */
void swiglu_fwd(const float *g, int64_t gs, const float *u, int64_t us, float *h, int64_t n, int64_t d,
                int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (n * d >= PARALLEL_FLOATS)
    for (int64_t i = 0; i < n; i++) {
        const float *gi = g + i * gs, *ui = u + i * us;
        float *hi = h + i * d;
        for (int64_t j = 0; j < d; j++)
            hi[j] = gi[j] * sigmoid(gi[j]) * ui[j];
    }
}

void swiglu_bwd(const float *dh, int64_t dhs, const float *g, int64_t gs, const float *u, int64_t us, float *dg,
                float *du, int64_t n, int64_t d, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (n * d >= PARALLEL_FLOATS)
    for (int64_t i = 0; i < n; i++) {
        const float *dhi = dh + i * dhs, *gi = g + i * gs, *ui = u + i * us;
        float *dgi = dg + i * d, *dui = du + i * d;
        for (int64_t j = 0; j < d; j++) {
            const float s = sigmoid(gi[j]);
            dui[j] = dhi[j] * gi[j] * s;
            dgi[j] = dhi[j] * ui[j] * s * (1.0f + gi[j] * (1.0f - s));
        }
    }
}

void swiglu_fwd_bf16(const uint16_t *g, int64_t gs, const uint16_t *u, int64_t us, uint16_t *h, int64_t n,
                     int64_t d, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (n * d >= PARALLEL_FLOATS)
    for (int64_t i = 0; i < n; i++) {
        const uint16_t *gi = g + i * gs, *ui = u + i * us;
        uint16_t *hi = h + i * d;
        for (int64_t j = 0; j < d; j++) {
            const float gv = widen(gi[j]);
            hi[j] = narrow(gv * sigmoid(gv) * widen(ui[j]));
        }
    }
}

void swiglu_bwd_bf16(const uint16_t *dh, int64_t dhs, const uint16_t *g, int64_t gs, const uint16_t *u,
                     int64_t us, uint16_t *dg, uint16_t *du, int64_t n, int64_t d, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (n * d >= PARALLEL_FLOATS)
    for (int64_t i = 0; i < n; i++) {
        const uint16_t *dhi = dh + i * dhs, *gi = g + i * gs, *ui = u + i * us;
        uint16_t *dgi = dg + i * d, *dui = du + i * d;
        for (int64_t j = 0; j < d; j++) {
            const float gv = widen(gi[j]), dv = widen(dhi[j]), s = sigmoid(gv);
            dui[j] = narrow(dv * gv * s);
            dgi[j] = narrow(dv * widen(ui[j]) * s * (1.0f + gv * (1.0f - s)));
        }
    }
}
