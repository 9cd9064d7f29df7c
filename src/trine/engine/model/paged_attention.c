/* Decode attention over the paged KV pool, read in place (see paged_attention.py).
 *
 * q    [P, Q, H, D]   fp32, contiguous: packed row p, its query j, head h
 * kp   [slots, KVH, D] fp32, contiguous: the layer's K pool (vp: its V pool)
 * read [P, L]         int64: the pool slot of key l of row p
 * mask [P, Q, L]      uint8: 1 where query j of row p may attend key l (each query sees >= 1 key)
 * out  [P, Q, H, D]   fp32
 *
 * One task per (row, kv head), keys in tiles of TILE in position order, an online softmax per
 * query head: a key's K/V rows are read from the pool once per task, whatever the number of
 * queries that see them. A query's result depends on its own keys and their positions only, not
 * on the other rows of the batch.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE 32

/* exp(x) for x <= 0, about 1 ulp, in a form the compiler vectorizes (Cephes' expf). */
static inline float exp_neg(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    x = x - n * 0.693359375f + n * 2.12194440e-4f;
    float z = x * x;
    float y = ((((1.9875691500e-4f * x + 1.3981999507e-3f) * x + 8.3334519073e-3f) * x +
                4.1665795894e-2f) * x + 1.6666665459e-1f) * x + 5.0000001201e-1f;
    y = y * z + x + 1.0f;
    union { int32_t i; float f; } scale = {.i = ((int32_t)n + 127) << 23};
    return y * scale.f;
}

/* One task: row p, kv head h. Scratch: m, den [NQ]; acc [NQ * D]. */
static inline __attribute__((always_inline)) void task(
    const float *q, const float *kp, const float *vp, const int64_t *read, const uint8_t *mask,
    float *out, int64_t p, int64_t h, int64_t Q, int64_t L, int64_t H, int64_t KVH, float scale,
    float *m, float *den, float *acc, const int64_t D) {
    const int64_t G = H / KVH, NQ = Q * G;
    float s[TILE], e[TILE];
    const float *krow[TILE], *vrow[TILE];
    for (int64_t i = 0; i < NQ; i++) m[i] = -INFINITY, den[i] = 0.0f;
    memset(acc, 0, sizeof(float) * NQ * D);
    const int64_t *slots = read + p * L;
    for (int64_t l0 = 0; l0 < L; l0 += TILE) {
        const int64_t n = L - l0 < TILE ? L - l0 : TILE;
        for (int64_t t = 0; t < n; t++) {
            krow[t] = kp + (slots[l0 + t] * KVH + h) * D;
            vrow[t] = vp + (slots[l0 + t] * KVH + h) * D;
        }
        for (int64_t j = 0; j < Q; j++) {
            const uint8_t *mk = mask + (p * Q + j) * L + l0;
            int seen = 0;
            for (int64_t t = 0; t < n; t++) seen |= mk[t];
            if (!seen) continue; /* no key of this tile for query j: nothing read */
            for (int64_t g = 0; g < G; g++) {
                const int64_t qi = j * G + g;
                const float *qv = q + ((p * Q + j) * H + h * G + g) * D;
                float tmax = -INFINITY;
                for (int64_t t = 0; t < n; t++) {
                    const float *k = krow[t];
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t d = 0; d < D; d++) dot += qv[d] * k[d];
                    s[t] = dot * scale;
                    if (mk[t] && s[t] > tmax) tmax = s[t];
                }
                const float mnew = tmax > m[qi] ? tmax : m[qi];
                const float corr = m[qi] == -INFINITY ? 0.0f : exp_neg(m[qi] - mnew);
                float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                for (int64_t t = 0; t < n; t++) {
                    e[t] = mk[t] ? exp_neg(s[t] - mnew) : 0.0f;
                    sum += e[t];
                }
                float *a = acc + qi * D;
                if (corr != 1.0f) {
#pragma omp simd
                    for (int64_t d = 0; d < D; d++) a[d] *= corr;
                }
                for (int64_t t = 0; t < n; t++) {
                    if (e[t] == 0.0f) continue;
                    const float w = e[t], *vv = vrow[t];
#pragma omp simd
                    for (int64_t d = 0; d < D; d++) a[d] += w * vv[d];
                }
                den[qi] = den[qi] * corr + sum;
                m[qi] = mnew;
            }
        }
    }
    for (int64_t j = 0; j < Q; j++) {
        for (int64_t g = 0; g < G; g++) {
            const int64_t qi = j * G + g;
            float *o = out + ((p * Q + j) * H + h * G + g) * D;
            const float inv = 1.0f / den[qi];
            for (int64_t d = 0; d < D; d++) o[d] = acc[qi * D + d] * inv;
        }
    }
}

/* The task with its head size a constant where it is a common one (the loops unroll). */
#define TASK_ARGS                                                                                  \
    const float *q, const float *kp, const float *vp, const int64_t *read, const uint8_t *mask,    \
        float *out, int64_t p, int64_t h, int64_t Q, int64_t L, int64_t H, int64_t KVH,           \
        float scale, float *m, float *den, float *acc, int64_t D
#define TASK_PASS q, kp, vp, read, mask, out, p, h, Q, L, H, KVH, scale, m, den, acc
static void task_64(TASK_ARGS) { task(TASK_PASS, 64); }
static void task_128(TASK_ARGS) { task(TASK_PASS, 128); }
static void task_any(TASK_ARGS) { task(TASK_PASS, D); }

void paged_attention(const float *q, const float *kp, const float *vp, const int64_t *read,
                     const uint8_t *mask, float *out, int64_t P, int64_t Q, int64_t L, int64_t H,
                     int64_t KVH, int64_t D, float scale, int threads) {
    const int64_t NQ = Q * (H / KVH);
    void (*run)(TASK_ARGS) = D == 64 ? task_64 : D == 128 ? task_128 : task_any;
#pragma omp parallel num_threads(threads)
    {
        float *m = malloc(sizeof(float) * NQ), *den = malloc(sizeof(float) * NQ);
        float *acc = malloc(sizeof(float) * NQ * D);
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t p = 0; p < P; p++)
            for (int64_t h = 0; h < KVH; h++)
                run(q, kp, vp, read, mask, out, p, h, Q, L, H, KVH, scale, m, den, acc, D);
        free(m), free(den), free(acc);
    }
}
