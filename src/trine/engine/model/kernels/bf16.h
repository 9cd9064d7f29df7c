/* bf16 <-> fp32 for the C kernels (their bits as uint16): as torch converts them.
 * widen: exact. narrow: to nearest, ties to even; NaN stays NaN (quiet). bf16: f rounded to bf16,
 * as fp32. Included by the kernels that take bf16 tensors; cbuild.py hashes it with each source. */
#ifndef TRINE_BF16_H
#define TRINE_BF16_H
#include <stdint.h>

static inline float widen(uint16_t h) {
    union { uint32_t u; float f; } x = {.u = (uint32_t)h << 16};
    return x.f;
}

static inline uint16_t narrow(float f) {
    union { float f; uint32_t u; } x = {.f = f};
    if ((x.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x.u >> 16) | 0x40u);
    return (uint16_t)((x.u + 0x7fffu + ((x.u >> 16) & 1u)) >> 16);
}

static inline float bf16(float f) { return widen(narrow(f)); }
#endif
