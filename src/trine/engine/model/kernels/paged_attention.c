/* Decode attention over the paged KV pool, read in place (see paged_attention.py).
 *
 * q    [P, Q, H, D]   fp32, contiguous: packed row p, its query j, head h
 * kp   [slots, KVH, D] fp32 or (kv_bf16) bf16, contiguous: the layer's K pool (vp: its V pool);
 *                     bf16 rows are widened to fp32 a tile at a time, exactly, as they are read
 * read [P, L]         int64: the pool slot of key l of row p
 * mask [P, Q, L]      uint8: 1 where query j of row p may attend key l (each query sees >= 1 key)
 * out  [P, Q, H, D]   fp32
 *
 * One task per (row, kv head), keys in tiles of TILE in position order, an online softmax per
 * query head: a key's K/V rows are read from the pool once per task, whatever the number of
 * queries that see them. A query's result depends on its own keys and their positions, and in the
 * last bits on how many of its row's query heads see each tile (which of two sums scores it);
 * never on the other rows of the batch.
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

/* n bf16 values (their bits) widened to fp32, exactly: a bf16 is an fp32's upper half. */
static inline __attribute__((always_inline)) void widen(const uint16_t *src, float *dst, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        union { uint32_t u; float f; } x = {.u = (uint32_t)src[i] << 16};
        dst[i] = x.f;
    }
}

/* 16 floats as one value: GCC/Clang vector extensions, lowered to whatever the CPU has (one
 * AVX-512 register, two AVX ones, four SSE ones). v16u is the same at float alignment: a load or a
 * store through it may be unaligned. */
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
#define LOAD(p) (*(const v16u *)(p))
#define STORE(p, x) (*(v16u *)(p) = (x))
#define SHARED_HEADS 6 /* query heads seeing a tile from which its keys are scored as a GEMM */
#define BLOCK 4        /* query heads taken together through a tile */

/* Scores of a block of BLOCK query heads (qs[i] their vectors; padding heads point at a real one)
 * against a tile stored transposed (kt[d * TILE + t]): sc[i * TILE + t]. The heads share each
 * load of kt; 8 accumulators in registers. */
static inline __attribute__((always_inline)) void scores_gemm(
    const float *const *qs, const float *kt, float *sc, const int64_t D) {
    const float *q0 = qs[0], *q1 = qs[1], *q2 = qs[2], *q3 = qs[3];
    v16 a0 = {0}, a1 = {0}, b0 = {0}, b1 = {0}, c0 = {0}, c1 = {0}, d0 = {0}, d1 = {0};
    for (int64_t d = 0; d < D; d++) {
        const v16 k0 = LOAD(kt + d * TILE), k1 = LOAD(kt + d * TILE + 16);
        a0 += q0[d] * k0, a1 += q0[d] * k1, b0 += q1[d] * k0, b1 += q1[d] * k1;
        c0 += q2[d] * k0, c1 += q2[d] * k1, d0 += q3[d] * k0, d1 += q3[d] * k1;
    }
    STORE(sc, a0), STORE(sc + 16, a1), STORE(sc + TILE, b0), STORE(sc + TILE + 16, b1);
    STORE(sc + 2 * TILE, c0), STORE(sc + 2 * TILE + 16, c1);
    STORE(sc + 3 * TILE, d0), STORE(sc + 3 * TILE + 16, d1);
}

/* Scores of one query head against n keys (krow[t] their rows), one dot product each. */
static inline __attribute__((always_inline)) void scores_dot(
    const float *qv, const float *const *krow, int64_t n, float *sc, const int64_t D) {
    for (int64_t t = 0; t < n; t++) {
        const float *k = krow[t];
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; d++) dot += qv[d] * k[d];
        sc[t] = dot;
    }
}

/* One query head's online-softmax step over a tile: its scores sc [TILE] (unscaled) become
 * weights e^(s - m), 0 for masked keys and past n; the running max m and denominator den move
 * on. Returns the factor its accumulator is multiplied by before this tile's values are added. */
static inline __attribute__((always_inline)) float softmax_tile(
    float *sc, const uint8_t *mk, int64_t n, float scale, float *m, float *den) {
    float tmax = -INFINITY;
    for (int64_t t = 0; t < TILE; t++) {
        const float x = t < n && mk[t] ? sc[t] * scale : -INFINITY;
        sc[t] = x;
        tmax = x > tmax ? x : tmax;
    }
    const float mnew = tmax > *m ? tmax : *m;
    const float corr = *m == -INFINITY ? 0.0f : exp_neg(*m - mnew);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < TILE; t++) {
        const float e = sc[t] == -INFINITY ? 0.0f : exp_neg(sc[t] - mnew);
        sc[t] = e;
        sum += e;
    }
    *den = *den * corr + sum;
    *m = mnew;
    return corr;
}

/* a[i] = a[i] * corr[i] + sum_t w[i][t] v[t] for a block of BLOCK query heads (weights
 * w[i] = sc + i * TILE; accumulators a[i] of D floats): each value row is loaded once for the
 * block. With D a multiple of 64, 64 columns at a time in 16 registers. A key no head of the
 * block sees is never read: its slot may hold anything (NaN included; 0 * NaN is NaN). */
static inline __attribute__((always_inline)) void values(
    float *const *a, const float *sc, const float *corr, const float *const *vrow, int64_t n,
    const int64_t D) {
    if (D % 64 == 0) {
        for (int64_t c = 0; c < D; c += 64) {
            v16 r[BLOCK][4];
            for (int i = 0; i < BLOCK; i++)
                for (int k = 0; k < 4; k++) r[i][k] = LOAD(a[i] + c + 16 * k) * corr[i];
            for (int64_t t = 0; t < n; t++) {
                if (!(sc[t] != 0.0f || sc[TILE + t] != 0.0f || sc[2 * TILE + t] != 0.0f ||
                      sc[3 * TILE + t] != 0.0f))
                    continue; /* seen by none of the block: maybe a slot never written */
                const float *vv = vrow[t] + c;
                const v16 v0 = LOAD(vv), v1 = LOAD(vv + 16), v2 = LOAD(vv + 32), v3 = LOAD(vv + 48);
                for (int i = 0; i < BLOCK; i++) {
                    const float w = sc[i * TILE + t];
                    r[i][0] += w * v0, r[i][1] += w * v1, r[i][2] += w * v2, r[i][3] += w * v3;
                }
            }
            for (int i = 0; i < BLOCK; i++)
                for (int k = 0; k < 4; k++) STORE(a[i] + c + 16 * k, r[i][k]);
        }
        return;
    }
    for (int i = 0; i < BLOCK; i++) {
        float *ai = a[i];
#pragma omp simd
        for (int64_t d = 0; d < D; d++) ai[d] *= corr[i];
        for (int64_t t = 0; t < n; t++) {
            const float w = sc[i * TILE + t], *vv = vrow[t];
            if (w == 0.0f) continue; /* a key this head does not see: maybe a slot never written */
#pragma omp simd
            for (int64_t d = 0; d < D; d++) ai[d] += w * vv[d];
        }
    }
}

/* One task: row p, kv head h. Scratch: m, den [NQ + BLOCK]; acc [(NQ + BLOCK) * D]; kt [D * TILE];
 * sc [BLOCK * TILE]; heads [NQ]; wide [2 * TILE * D] (a bf16 tile's K and V rows in fp32). Entries
 * NQ.. are where a partial block's padding heads write.
 *
 * Keys go in tiles of TILE, in position order; the query heads that see a key of the tile go
 * through it BLOCK at a time: scores, softmax step, values. A tile seen by at least SHARED_HEADS
 * heads (a group's samples reading their shared prompt) is copied transposed once and scored as
 * a small GEMM; one seen by fewer (a sequence's own keys) is scored with dot products, which need
 * no copy. Either way a key's rows are read from the pool once per task. */
static inline __attribute__((always_inline)) void task(
    const float *q, const void *kp, const void *vp, const int64_t *read, const uint8_t *mask,
    float *out, int64_t p, int64_t h, int64_t Q, int64_t L, int64_t H, int64_t KVH, float scale,
    float *m, float *den, float *acc, float *kt, float *sc, int64_t *heads, int kv_bf16, float *wide,
    const int64_t D) {
    const int64_t esize = kv_bf16 ? 2 : 4;
    const int64_t G = H / KVH, NQ = Q * G;
    const float *krow[TILE], *vrow[TILE];
    for (int64_t i = 0; i < NQ + BLOCK; i++) m[i] = -INFINITY, den[i] = 0.0f;
    memset(acc, 0, sizeof(float) * (NQ + BLOCK) * D);
    const int64_t *slots = read + p * L;
    for (int64_t l0 = 0; l0 < L; l0 += TILE) {
        const int64_t n = L - l0 < TILE ? L - l0 : TILE;
        for (int64_t t = 0; t < n; t++) {
            const int64_t at = (slots[l0 + t] * KVH + h) * D;
            if (kv_bf16) {
                float *kw = wide + t * D, *vw = wide + (TILE + t) * D;
                widen((const uint16_t *)kp + at, kw, D), widen((const uint16_t *)vp + at, vw, D);
                krow[t] = kw, vrow[t] = vw;
            } else {
                krow[t] = (const float *)kp + at, vrow[t] = (const float *)vp + at;
            }
        }
        /* The next tile's rows are asked for now, so they arrive while this one is computed: the
         * pool comes from memory, not cache, inside the engine (GRPO 15 %, decode 7 % less kernel
         * time; two tiles ahead was slower). */
        for (int64_t t = l0 + TILE; t < L && t < l0 + 2 * TILE; t++) {
            const char *kn = (const char *)kp + (slots[t] * KVH + h) * D * esize;
            const char *vn = (const char *)vp + (slots[t] * KVH + h) * D * esize;
            for (int64_t b = 0; b < D * esize; b += 64) __builtin_prefetch(kn + b), __builtin_prefetch(vn + b);
        }
        int64_t nh = 0; /* the query heads (j * G + g) that see a key of this tile */
        for (int64_t j = 0; j < Q; j++) {
            const uint8_t *mk = mask + (p * Q + j) * L + l0;
            int seen = 0;
            for (int64_t t = 0; t < n; t++) seen |= mk[t];
            if (seen)
                for (int64_t g = 0; g < G; g++) heads[nh++] = j * G + g;
        }
        const int gemm = nh >= SHARED_HEADS;
        if (gemm)
            for (int64_t t = 0; t < TILE; t++)
                for (int64_t d = 0; d < D; d++) kt[d * TILE + t] = t < n ? krow[t][d] : 0.0f;
        for (int64_t b = 0; b < nh; b += BLOCK) {
            const float *qs[BLOCK];
            const uint8_t *mks[BLOCK];
            float *a[BLOCK], corr[BLOCK];
            int64_t slot[BLOCK];
            for (int i = 0; i < BLOCK; i++) {
                const int real = b + i < nh;
                const int64_t qi = heads[real ? b + i : b]; /* padding: a real head's query */
                slot[i] = real ? qi : NQ + i;               /* ... and its own scratch entry */
                qs[i] = q + ((p * Q + qi / G) * H + h * G + qi % G) * D;
                mks[i] = mask + (p * Q + qi / G) * L + l0;
                a[i] = acc + slot[i] * D;
                if (!gemm) scores_dot(qs[i], krow, n, sc + i * TILE, D);
            }
            if (gemm) scores_gemm(qs, kt, sc, D);
            for (int i = 0; i < BLOCK; i++)
                corr[i] = softmax_tile(sc + i * TILE, mks[i], n, scale, m + slot[i], den + slot[i]);
            values(a, sc, corr, vrow, n, D);
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
    const float *q, const void *kp, const void *vp, const int64_t *read, const uint8_t *mask,      \
        float *out, int64_t p, int64_t h, int64_t Q, int64_t L, int64_t H, int64_t KVH,           \
        float scale, float *m, float *den, float *acc, float *kt, float *sc, int64_t *heads,       \
        int kv_bf16, float *wide, int64_t D
#define TASK_PASS                                                                                  \
    q, kp, vp, read, mask, out, p, h, Q, L, H, KVH, scale, m, den, acc, kt, sc, heads, kv_bf16, wide
static void task_64(TASK_ARGS) { task(TASK_PASS, 64); }
static void task_128(TASK_ARGS) { task(TASK_PASS, 128); }
static void task_any(TASK_ARGS) { task(TASK_PASS, D); }

void paged_attention(const float *q, const void *kp, const void *vp, const int64_t *read,
                     const uint8_t *mask, float *out, int64_t P, int64_t Q, int64_t L, int64_t H,
                     int64_t KVH, int64_t D, float scale, int threads, int kv_bf16) {
    const int64_t NQ = Q * (H / KVH);
    void (*run)(TASK_ARGS) = D == 64 ? task_64 : D == 128 ? task_128 : task_any;
#pragma omp parallel num_threads(threads)
    {
        float *m = malloc(sizeof(float) * (NQ + BLOCK)), *den = malloc(sizeof(float) * (NQ + BLOCK));
        float *acc = malloc(sizeof(float) * (NQ + BLOCK) * D), *kt = malloc(sizeof(float) * D * TILE);
        float *sc = malloc(sizeof(float) * BLOCK * TILE);
        int64_t *heads = malloc(sizeof(int64_t) * NQ);
        float *wide = kv_bf16 ? malloc(sizeof(float) * 2 * TILE * D) : NULL;
        /* With rows enough to keep every thread busy, a row's KV heads go in one task: the
         * heads of a slot are adjacent in the pool, so its rows are read whole and in order (7-9 %
         * faster per call inside the engine, where the pool comes from memory, not cache). With
         * few rows, (row, head) tasks keep the threads busy. The tasks compute the same either way. */
        const int64_t per = P >= 2 * threads ? KVH : 1; /* KV heads per task */
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < P * KVH / per; i++)
            for (int64_t h = i * per % KVH, end = h + per; h < end; h++)
                run(q, kp, vp, read, mask, out, i * per / KVH, h, Q, L, H, KVH, scale, m, den, acc, kt,
                    sc, heads, kv_bf16, wide, D);
        free(m), free(den), free(acc), free(kt), free(sc), free(heads), free(wide);
    }
}
