/* Elementwise steps of an inference forward, each one pass over its rows (fused.py says when).
 *
 * torch runs RMSNorm as five ops (pow, mean, add, rsqrt, two muls) and RoPE as four over a strided
 * view; each op reads and writes the whole tensor. Here each row is read once and written once.
 *
 * rms_norm: out[i] = (x[i] * 1/sqrt(mean(x[i]^2) + eps)) * w, rows of x `x_stride` floats apart.
 *   The mean is summed in another order than torch's: equal up to float32 rounding.
 * rope: in place, for each of `heads` heads of d floats in each row (rows `stride` floats apart):
 *   x[j] = x[j] * cos[j] + x[(j + d/2) % d] * sin[j], cos/sin rows of d floats (sin's first half
 *   negated: model.py's rope_tables). Each product and the sum rounded as torch does (built with
 *   -ffp-contract=off: no fused multiply-add), so the result is torch's bit for bit.
 * The _bf16 forms take bf16 tensors (their bits, uint16) and compute as model.py's bf16 path does
 * with torch's bf16 ops, each op in fp32 and its result rounded to bf16 (to nearest, ties to even):
 *   rms_norm_bf16: out = w * bf16(x * r), r from x widened to fp32 (the mean in another order);
 *   rope_bf16: bf16(bf16(x * cos) + bf16(roll(x) * sin)), torch's bit for bit.
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"

#define PARALLEL_FLOATS 32768 /* below this, one thread: a parallel region costs more */


void rms_norm(const float *x, int64_t x_stride, const float *w, float *out, int64_t n, int64_t d,
              float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (n * d >= PARALLEL_FLOATS)
    for (int64_t i = 0; i < n; i++) {
        const float *xi = x + i * x_stride;
        float *oi = out + i * d;
        float ss = 0.0f;
        for (int64_t j = 0; j < d; j++)
            ss += xi[j] * xi[j];
        const float r = 1.0f / sqrtf(ss / (float)d + eps);
        for (int64_t j = 0; j < d; j++)
            oi[j] = (xi[j] * r) * w[j];
    }
}

void rope(float *x, int64_t stride, int64_t heads, int64_t d, const float *cos, const float *sin,
          int64_t n, int threads) {
    const int64_t half = d / 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (n * heads * d >= PARALLEL_FLOATS)
    for (int64_t i = 0; i < n; i++) {
        const float *c = cos + i * d, *s = sin + i * d;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + i * stride + h * d;
            for (int64_t j = 0; j < half; j++) {
                const float a = v[j], b = v[j + half];
                v[j] = a * c[j] + b * s[j];
                v[j + half] = b * c[j + half] + a * s[j + half];
            }
        }
    }
}

void rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, uint16_t *out, int64_t n,
                   int64_t d, float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (n * d >= PARALLEL_FLOATS)
    for (int64_t i = 0; i < n; i++) {
        const uint16_t *xi = x + i * x_stride;
        uint16_t *oi = out + i * d;
        float ss = 0.0f;
        for (int64_t j = 0; j < d; j++) {
            const float v = widen(xi[j]);
            ss += v * v;
        }
        const float r = 1.0f / sqrtf(ss / (float)d + eps);
        for (int64_t j = 0; j < d; j++)
            oi[j] = narrow(widen(w[j]) * bf16(widen(xi[j]) * r));
    }
}

void rope_bf16(uint16_t *x, int64_t stride, int64_t heads, int64_t d, const uint16_t *cos,
               const uint16_t *sin, int64_t n, int threads) {
    const int64_t half = d / 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (n * heads * d >= PARALLEL_FLOATS)
    for (int64_t i = 0; i < n; i++) {
        const uint16_t *c = cos + i * d, *s = sin + i * d;
        for (int64_t h = 0; h < heads; h++) {
            uint16_t *v = x + i * stride + h * d;
            for (int64_t j = 0; j < half; j++) {
                const float a = widen(v[j]), b = widen(v[j + half]);
                v[j] = narrow(bf16(a * widen(c[j])) + bf16(b * widen(s[j])));
                v[j + half] = narrow(bf16(b * widen(c[j + half])) + bf16(a * widen(s[j + half])));
            }
        }
    }
}
