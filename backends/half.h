/*
 * backends/half.h - 16-bit and TF32 number formats, one home for the core
 * and both backends (private).
 *
 * The core converts to and from bf16/f16 for compressed gradients,
 * parameter-server messages and checkpoints; the backends round f32 values
 * to TF32, bf16 or f16 for mixed precision (dt_backend_iface.round_prec).
 * Every one of them must give the same bits, so all use these functions:
 * plain C that also compiles as CUDA, where they run on the host and the
 * device alike.
 *
 * Round to nearest even on the bits: adding 0x7fff (bf16) or 0xfff (f16,
 * TF32) plus the lowest kept bit carries into the kept bits exactly when the
 * dropped part is above half, or half with the kept part odd; a carry out
 * of the mantissa bumps the exponent (up to infinity), which is the right
 * answer.  f16 keeps subnormals (spacing 2^-24) and overflows to infinity
 * from 65520 on, as IEEE half and CUDA's __float2half_rn do.
 */
#ifndef DTRAIN_BACKEND_HALF_H
#define DTRAIN_BACKEND_HALF_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define DT_HALF_FN static inline __host__ __device__
#else
#define DT_HALF_FN static inline
#endif

DT_HALF_FN uint32_t half_bits_of(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

DT_HALF_FN float half_float_of(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* bfloat16 (7 explicit mantissa bits); a NaN stays a (quiet) NaN */
DT_HALF_FN uint16_t f32_to_bf16(float f)
{
    uint32_t u = half_bits_of(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

DT_HALF_FN float bf16_to_f32(uint16_t h)
{
    return half_float_of((uint32_t)h << 16);
}

/* IEEE half (10 explicit mantissa bits) */
DT_HALF_FN uint16_t f32_to_f16(float f)
{
    uint32_t x = half_bits_of(f);
    uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u)
        return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0));
    if (ax >= 0x477ff000u)   /* 65520 and up round to infinity */
        return (uint16_t)(sign | 0x7c00u);
    if (ax < 0x38800000u)    /* below 2^-14: a subnormal half (or zero) */
        return (uint16_t)(sign | (uint32_t)lrintf(half_float_of(ax) * 16777216.0f));
    uint32_t r = ax + 0xfffu + ((ax >> 13) & 1) - 0x38000000u;
    return (uint16_t)(sign | (r >> 13));
}

DT_HALF_FN float f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) {
        float v = (float)m * (1.0f / 16777216.0f);
        return sign ? -v : v;
    }
    return half_float_of(sign | (e == 31 ? 0x7f800000u : (e + 112) << 23) | (m << 13));
}

/* f32 rounded to each format and kept as f32 (mixed precision: GEMM
 * operands rounded so that a CPU run has a GPU's numerics).  NaN and
 * infinities pass through; bf16 quiets a NaN. */
DT_HALF_FN float round_tf32(float x)
{
    uint32_t u = half_bits_of(x);
    if ((u & 0x7f800000u) == 0x7f800000u)
        return x;
    u += 0xfffu + ((u >> 13) & 1);
    return half_float_of(u & ~0x1fffu);
}

DT_HALF_FN float round_bf16(float x)
{
    uint32_t u = half_bits_of(x);
    if ((u & 0x7f800000u) == 0x7f800000u)
        return (u & 0x7fffffu) ? half_float_of(u | 0x400000u) : x;
    u += 0x7fffu + ((u >> 16) & 1);
    return half_float_of(u & 0xffff0000u);
}

DT_HALF_FN float round_f16(float x)
{
    return x != x ? x : f16_to_f32(f32_to_f16(x));
}

#endif
