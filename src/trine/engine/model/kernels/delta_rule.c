/* One decode step of the gated delta rule over a recurrent state kept in place (delta_rule.py).
 *
 * For each of n (sequence, head) pairs, with S the head's [dk, dv] state:
 *   kS = k^T S, qS = q^T S               (one read of S)
 *   delta = (v - decay kS) beta
 *   o = decay qS + (q . k) delta          (= q^T S' without reading S' again)
 *   S' = decay S + k delta^T              (one read and one write of S, while it is in cache)
 * A pair's state (64 KiB at 128 x 128 fp32) stays in the core's cache between the two passes, so the
 * step reads and writes the state from memory once, where torch's bmm, mul_ and baddbmm_ take three
 * passes. Pairs are independent: OpenMP splits them across threads. */
#include <stdint.h>

void delta_rule_step(float *s, const float *q, const float *k, const float *v, const float *decay,
                     const float *beta, float *o, int64_t n, int64_t dk, int64_t dv, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < n; p++) {
        float *S = s + p * dk * dv;
        const float *qp = q + p * dk, *kp = k + p * dk, *vp = v + p * dv;
        float *op = o + p * dv;
        const float d = decay[p], b = beta[p];
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
}
