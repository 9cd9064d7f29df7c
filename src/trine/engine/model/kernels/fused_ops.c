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
 */
#include <math.h>
#include <stdint.h>

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
