#include "internal.h"

/* ===========================================================================
 * Gradient codecs: bf16, fp16, top-k and int8 encodings of gradients
 *
 * What DDP's compressed buckets and the parameter server's compressed
 * pushes send: pure functions of the gradients (and, for top-k, the
 * entries chosen), below both.
 * ======================================================================== */

#define DDP_INT8_BLOCK 256

/* Encoded size of a bucket's gradients in bytes (flags not included). */
DT_PRIVATE size_t codec_bytes(dt_compress kind, int64_t numel, int64_t topk)
{
    switch (kind) {
    case DT_COMPRESS_BF16:
    case DT_COMPRESS_FP16: return (size_t)numel * 2;
    case DT_COMPRESS_TOPK: return (size_t)topk * 6;
    case DT_COMPRESS_INT8:
        return (size_t)(numel + DDP_INT8_BLOCK - 1) / DDP_INT8_BLOCK * 4 + (size_t)numel;
    default: return (size_t)numel * 4;
    }
}

/* The k-th smallest of v[0..n) (0-based), reordering v; deterministic. */
static float select_kth(float *v, int64_t n, int64_t k)
{
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        float a = v[lo], b = v[lo + (hi - lo) / 2], c = v[hi];
        float pivot = a < b ? (b < c ? b : (a < c ? c : a)) : (a < c ? a : (b < c ? c : b));
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (v[i] < pivot)
                i++;
            while (v[j] > pivot)
                j--;
            if (i <= j) {
                float t = v[i];
                v[i++] = v[j];
                v[j--] = t;
            }
        }
        if (k <= j)
            hi = j;
        else if (k >= i)
            lo = i;
        else
            return v[k];
    }
    return v[k];
}

/* Encode g[0..n) as `kind` into out; sent[i] gets what the receivers will
 * decode for element i (error feedback keeps g - sent).  TOPK keeps
 * pieces[3p + 2] entries of each piece [pieces[3p], pieces[3p + 1]), k in
 * all; scratch holds n floats; picked (may be NULL) marks what was sent.
 * DDP encodes buckets, a parameter-server push a server's part of
 * one (src/ps.c). */
DT_PRIVATE void codec_encode(dt_compress kind, const float *g, int64_t n, const int64_t *pieces,
                        int npieces, int64_t k, float *scratch, unsigned char *picked, char *out,
                        float *sent)
{
    switch (kind) {
    case DT_COMPRESS_BF16:
    case DT_COMPRESS_FP16:
        for (int64_t i = 0; i < n; i++) {
            int bf = kind == DT_COMPRESS_BF16;
            uint16_t h = bf ? f32_to_bf16(g[i]) : f32_to_f16(g[i]);
            memcpy(out + 2 * i, &h, 2);
            sent[i] = bf ? bf16_to_f32(h) : f16_to_f32(h);
        }
        break;
    case DT_COMPRESS_INT8: {
        int64_t blocks = (n + DDP_INT8_BLOCK - 1) / DDP_INT8_BLOCK;
        for (int64_t k = 0; k < blocks; k++) {
            int64_t lo = k * DDP_INT8_BLOCK, hi = lo + DDP_INT8_BLOCK < n ? lo + DDP_INT8_BLOCK : n;
            float mx = 0;
            for (int64_t i = lo; i < hi; i++)
                mx = !(fabsf(g[i]) <= mx) ? fabsf(g[i]) : mx;   /* NaN wins */
            /* a NaN or infinity makes the block's scale NaN: it reaches every
             * rank, as it would dense */
            float scale = isfinite(mx) ? mx / 127.0f : NAN;
            memcpy(out + 4 * k, &scale, 4);
            for (int64_t i = lo; i < hi; i++) {
                int q = scale > 0 ? (int)lrintf(g[i] / scale) : 0;
                q = q > 127 ? 127 : q < -127 ? -127 : q;
                out[4 * blocks + i] = (char)(signed char)q;
                sent[i] = (float)q * scale;
            }
        }
        break;
    }
    case DT_COMPRESS_TOPK: {
        int64_t taken = 0;
        for (int p = 0; p < npieces; p++) {
            int64_t lo = pieces[3 * p], hi = pieces[3 * p + 1], kp = pieces[3 * p + 2];
            /* threshold: the kp-th largest magnitude; ties taken in index order */
            float *mag = scratch;   /* NaN ranks first: it reaches everyone, as dense */
            for (int64_t i = lo; i < hi; i++)
                mag[i - lo] = isnan(g[i]) ? INFINITY : fabsf(g[i]);
            float t = select_kth(mag, hi - lo, hi - lo - kp);
            int64_t above = 0, got = 0;
            for (int64_t i = lo; i < hi; i++) {
                above += (isnan(g[i]) ? INFINITY : fabsf(g[i])) > t;
                if (picked)
                    picked[i] = 0;
            }
            int64_t ties = kp - above;
            for (int64_t i = lo; i < hi; i++) {
                float a = isnan(g[i]) ? INFINITY : fabsf(g[i]);
                sent[i] = 0;
                if (got < kp && (a > t || (a == t && ties > 0))) {
                    if (!(a > t))
                        ties--;
                    uint32_t idx = (uint32_t)i;
                    uint16_t h = f32_to_bf16(g[i]);
                    memcpy(out + 4 * taken, &idx, 4);
                    memcpy(out + 4 * k + 2 * taken, &h, 2);
                    sent[i] = bf16_to_f32(h);
                    if (picked)
                        picked[i] = 1;
                    taken++;
                    got++;
                }
            }
        }
        for (; taken < k; taken++) {   /* never reached on finite input; no stale slots */
            uint32_t none = UINT32_MAX;
            memset(out + 4 * k + 2 * taken, 0, 2);
            memcpy(out + 4 * taken, &none, 4);
        }
        break;
    }
    default:
        break;
    }
}

/* acc[0..n) += what `code` (n gradients as `kind`, k entries if TOPK)
 * encodes. */
DT_PRIVATE void codec_decode_add(dt_compress kind, const char *code, int64_t n, int64_t k, float *acc)
{
    switch (kind) {
    case DT_COMPRESS_BF16:
    case DT_COMPRESS_FP16:
        for (int64_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, code + 2 * i, 2);
            acc[i] += kind == DT_COMPRESS_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
        }
        break;
    case DT_COMPRESS_INT8: {
        int64_t blocks = (n + DDP_INT8_BLOCK - 1) / DDP_INT8_BLOCK;
        for (int64_t k = 0; k < blocks; k++) {
            float scale;
            memcpy(&scale, code + 4 * k, 4);
            int64_t lo = k * DDP_INT8_BLOCK, hi = lo + DDP_INT8_BLOCK < n ? lo + DDP_INT8_BLOCK : n;
            for (int64_t i = lo; i < hi; i++)
                acc[i] += (float)(signed char)code[4 * blocks + i] * scale;
        }
        break;
    }
    case DT_COMPRESS_TOPK:
        for (int64_t j = 0; j < k; j++) {
            uint32_t idx;
            uint16_t h;
            memcpy(&idx, code + 4 * j, 4);
            memcpy(&h, code + 4 * k + 2 * j, 2);
            if (idx < (uint64_t)n)   /* a corrupt index is dropped, never written */
                acc[idx] += bf16_to_f32(h);
        }
        break;
    default:
        break;
    }
}
