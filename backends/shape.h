/*
 * backends/shape.h - index-space helpers the backends share (private).
 *
 * Host code only, plain C that also compiles as C++ (backends/cuda.cu), so
 * the CPU and CUDA backends walk strided shapes the same way.
 */
#ifndef DTRAIN_BACKEND_SHAPE_H
#define DTRAIN_BACKEND_SHAPE_H

#include <stdint.h>

static inline int64_t shape_numel(int nd, const int64_t *shape)
{
    int64_t n = 1;
    for (int d = 0; d < nd; d++) n *= shape[d];
    return n;
}

/* Drop size-1 dims and merge dim d into its outer neighbour when both
 * operands step over the pair as one dim.  Returns nd >= 1. */
static inline int coalesce2(int ndim, const int64_t *shape, const int64_t *s0, const int64_t *s1,
                            int64_t *oshape, int64_t *o0, int64_t *o1)
{
    int nd = 0;
    for (int d = 0; d < ndim; d++) {
        if (shape[d] == 1) continue;
        if (nd > 0 && o0[nd - 1] == s0[d] * shape[d] && o1[nd - 1] == s1[d] * shape[d]) {
            oshape[nd - 1] *= shape[d];
            o0[nd - 1] = s0[d];
            o1[nd - 1] = s1[d];
        } else {
            oshape[nd] = shape[d];
            o0[nd] = s0[d];
            o1[nd] = s1[d];
            nd++;
        }
    }
    if (nd == 0) {
        oshape[0] = 1;
        o0[0] = o1[0] = 0;
        nd = 1;
    }
    return nd;
}

static inline void contiguous_strides(int nd, const int64_t *shape, int64_t *st)
{
    int64_t s = 1;
    for (int d = nd - 1; d >= 0; d--) {
        st[d] = s;
        s *= shape[d];
    }
}

#endif /* DTRAIN_BACKEND_SHAPE_H */
