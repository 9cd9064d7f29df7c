/* The decode step of a Gated DeltaNet layer over states kept in place (delta_rule.py).
 *
 * `pair_step`, for one (sequence, value head) pair with S the head's [dk, dv] state:
 *   kS = k^T S, qS = q^T S               (one read of S)
 *   delta = (v - decay kS) beta
 *   o = decay qS + (q . k) delta          (= q^T S' without reading S' again)
 *   S' = decay S + k delta^T              (one read and one write of S, while it is in cache)
 * A pair's state (64 KiB at 128 x 128 fp32) stays in the core's cache between the two passes, so the
 * step reads and writes the state from memory once, where torch's bmm, mul_ and baddbmm_ take three
 * passes. Pairs are independent: OpenMP splits them across threads.
 *
 * `delta_rule_step` is the rule alone (q, k, v, decay, beta given); `linear_attention_step` is the
 * whole layer between its input projections and out_proj, for one token of each sequence: the
 * causal conv's step (its state shifted in place) and SiLU, the q/k L2 norms, the gates, the rule
 * and the gated RMSNorm, in two passes (channels, then pairs) where torch runs about forty ops. */
#include <math.h>
#include <stdint.h>

static inline void pair_step(float *S, const float *qp, const float *kp, const float *vp, float d, float b,
                             float *op, int64_t dk, int64_t dv) {
    float ks[dv], qs[dv], delta[dv];
    for (int64_t j = 0; j < dv; j++) ks[j] = qs[j] = 0.0f;
    float qk = 0.0f;
    for (int64_t i = 0; i < dk; i++) {
        const float ki = kp[i], qi = qp[i];
        const float *row = S + i * dv;
        qk += qi * ki;
        for (int64_t j = 0; j < dv; j++) {
            ks[j] += ki * row[j];
            qs[j] += qi * row[j];
        }
    }
    for (int64_t j = 0; j < dv; j++) {
        delta[j] = (vp[j] - d * ks[j]) * b;
        op[j] = d * qs[j] + qk * delta[j];
    }
    for (int64_t i = 0; i < dk; i++) {
        const float ki = kp[i];
        float *row = S + i * dv;
        for (int64_t j = 0; j < dv; j++) row[j] = d * row[j] + ki * delta[j];
    }
}

void delta_rule_step(float *s, const float *q, const float *k, const float *v, const float *decay,
                     const float *beta, float *o, int64_t n, int64_t dk, int64_t dv, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < n; p++)
        pair_step(s + p * dk * dv, q + p * dk, k + p * dk, v + p * dv, decay[p], beta[p], o + p * dv, dk, dv);
}

static inline float silu(float x) { return x / (1.0f + expf(-x)); }

/* x * rsqrt(sum x^2 + eps) * scale into out: gated_deltanet._prepare's L2 norm of q (scale
 * dk^-1/2) and of k (scale 1). */
static inline void l2_normalised(const float *x, float *out, int64_t n, float eps, float scale) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    const float r = 1.0f / sqrtf(ss + eps);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * r * scale;
}

/* qkv [B, C] (row stride qkv_rs), C = 2 hk dk + hv dv: the step's conv inputs; z [B, hv dv] (row
 * stride z_rs); bp, ap [B, hv] (row stride ab_rs): in_proj_b and in_proj_a's outputs.
 * conv [B, C, K - 1] and S [B, hv, dk, dv]: the states, updated in place. conv_w [C, K]; A_log,
 * dt_bias [hv]; norm_w [dv]. mixed [B, C]: scratch for the conv's outputs. o [B, hv dv]: out. */
void linear_attention_step(const float *qkv, int64_t qkv_rs, const float *z, int64_t z_rs, const float *bp,
                           const float *ap, int64_t ab_rs, float *conv, const float *conv_w, float *S,
                           const float *A_log, const float *dt_bias, const float *norm_w, float norm_eps,
                           float l2_eps, float *mixed, float *o, int64_t B, int64_t hk, int64_t hv, int64_t dk,
                           int64_t dv, int64_t K, int threads) {
    const int64_t C = 2 * hk * dk + hv * dv, keep = K - 1, groups = hv / hk;
    const float q_scale = 1.0f / sqrtf((float)dk);
#pragma omp parallel num_threads(threads)
    {
        /* the conv: sum over its K taps in order (the torch form's order), then SiLU */
#pragma omp for schedule(static)
        for (int64_t r = 0; r < B * C; r++) {
            const int64_t b = r / C, c = r % C;
            float *st = conv + r * keep;
            const float *w = conv_w + c * K;
            const float x = qkv[b * qkv_rs + c];
            float acc = keep ? st[0] * w[0] : x * w[0];
            for (int64_t i = 1; i < keep; i++) acc += st[i] * w[i];
            if (keep) acc += x * w[keep];
            for (int64_t i = 0; i + 1 < keep; i++) st[i] = st[i + 1];
            if (keep) st[keep - 1] = x;
            mixed[r] = silu(acc);
        }
        /* each (sequence, value head): its key head's q and k normalised, the gates, the rule, then
         * the gated RMSNorm of its output */
#pragma omp for schedule(static)
        for (int64_t p = 0; p < B * hv; p++) {
            const int64_t b = p / hv, h = p % hv, kh = h / groups;
            const float *m = mixed + b * C;
            float qn[dk], kn[dk];
            l2_normalised(m + kh * dk, qn, dk, l2_eps, q_scale);
            l2_normalised(m + hk * dk + kh * dk, kn, dk, l2_eps, 1.0f);
            const float x = ap[b * ab_rs + h] + dt_bias[h];
            const float softplus = x > 20.0f ? x : log1pf(expf(x));
            const float decay = expf(-expf(A_log[h]) * softplus);
            const float beta = 1.0f / (1.0f + expf(-bp[b * ab_rs + h]));
            float *op = o + b * hv * dv + h * dv;
            pair_step(S + p * dk * dv, qn, kn, m + 2 * hk * dk + h * dv, decay, beta, op, dk, dv);
            float ss = 0.0f;
            for (int64_t j = 0; j < dv; j++) ss += op[j] * op[j];
            const float r = 1.0f / sqrtf(ss / (float)dv + norm_eps);
            const float *zp = z + b * z_rs + h * dv;
            for (int64_t j = 0; j < dv; j++) op[j] = norm_w[j] * (op[j] * r) * silu(zp[j]);
        }
    }
}
