/*
 * backends/backend.h - the compute-backend interface (private to dtrain).
 *
 * The core reaches tensor memory only through this struct of function
 * pointers, so a backend is one file: backends/cpu.c (OpenBLAS + pthreads),
 * backends/cuda.cu (cuBLAS + kernels).  Pointers named like x, y, dx are
 * device pointers from alloc(); host pointers are named host*.  Sizes are
 * element counts (int64_t) unless named *_bytes.  All float data is f32 and
 * contiguous (row-major) unless strides are passed.
 *
 * Kernels never fail on valid arguments: the core validates shapes before it
 * calls.  Functions returning dt_status can fail for resource reasons only.
 * A device can still fail underneath (a launch refused, a cuBLAS error, an
 * illegal address that poisons the context): such a backend records the
 * first failure and reports it through fault(), which the core polls where
 * it hands results to the user (section "faults" below); the value-returning
 * entries then return their documented "failed" values, never a plausible
 * result.
 *
 * Determinism contract: for a fixed thread count every kernel gives
 * bit-identical results run to run.  Reductions (sum, sumsq, bias_grad,
 * reduce_axis) sum in fixed-size blocks whose partials are added in order,
 * so their results do not depend on the thread count either.
 *
 * Entries marked (optional) may be NULL; the core then composes them.
 */
#ifndef DTRAIN_BACKEND_H
#define DTRAIN_BACKEND_H

#include "../dtrain.h"

#ifdef __cplusplus   /* backends/cuda.cu is compiled as C++ */
extern "C" {
#endif

#define DT_BACKEND_IFACE_VERSION 8

typedef struct dt_backend dt_backend;   /* a backend instance, opaque to the core */

typedef struct dt_backend_params {
    int threads;
    int device;
    dt_allocator allocator;   /* host allocation hooks, already defaulted */
} dt_backend_params;

typedef enum dt_unary_op {
    DT_UNARY_RELU = 0,
    DT_UNARY_GELU,      /* exact: 0.5 x (1 + erf(x / sqrt 2)) */
    DT_UNARY_TANH,
    DT_UNARY_SIGMOID,
    DT_UNARY_GELU_TANH, /* GPT-2's: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) */
    DT_UNARY_EXP,
    DT_UNARY_LOG,       /* log(x): -inf at 0, NaN below */
    DT_UNARY_SQRT
} dt_unary_op;

/* xent_forward / xent_backward's `ignore` when no label is ignored */
#define DT_XENT_KEEP_ALL INT64_MIN

/* KEEP: a where b != 0, else 0; DROP: 0 where b != 0, else a (selects, not
 * products: an infinite a never turns into NaN); POW: a to the power b. */
typedef enum dt_binary_op {
    DT_BIN_ADD = 0, DT_BIN_SUB, DT_BIN_MUL, DT_BIN_DIV, DT_BIN_KEEP, DT_BIN_DROP, DT_BIN_POW
} dt_binary_op;

enum { DT_COPY_H2D = 0, DT_COPY_D2H = 1 };

typedef enum dt_axis_op { DT_RED_SUM = 0, DT_RED_MAX } dt_axis_op;

/* conv / pool geometry, NCHW */
typedef struct dt_conv_geom {
    int64_t n, c, h, w;      /* input */
    int64_t kh, kw;          /* kernel */
    int64_t stride, pad;
    int64_t oh, ow;          /* output spatial size */
} dt_conv_geom;

typedef struct dt_backend_iface {
    int version;             /* DT_BACKEND_IFACE_VERSION */
    const char *name;        /* "cpu" */

    /* --- lifetime -------------------------------------------------------- */
    /* Start an instance.  On failure write a message into err. */
    dt_status (*init)(const dt_backend_params *p, dt_backend **out, char *err, size_t err_len);
    void (*shutdown)(dt_backend *be);

    /* --- memory ----------------------------------------------------------- */
    /* alloc returns memory aligned to 64 bytes, or NULL.  Not zeroed. */
    void *(*alloc)(dt_backend *be, size_t bytes);
    void (*free)(dt_backend *be, void *ptr);
    void (*to_device)(dt_backend *be, void *dst, const void *host_src, size_t bytes);
    void (*to_host)(dt_backend *be, void *host_dst, const void *src, size_t bytes);
    void (*copy)(dt_backend *be, void *dst, const void *src, size_t bytes);
    void (*memset0)(dt_backend *be, void *dst, size_t bytes);
    /* Wait for queued work (no-op on synchronous backends). */
    void (*sync)(dt_backend *be);
    /* 1 when device pointers are host pointers (the CPU backend). */
    int host_visible;

    /* --- staging between host and device (optional; NULL when
     * host_visible, where the core reads tensor memory directly) ----------
     * host_alloc: page-locked host memory (cudaHostAlloc), so copies from and
     * to it are truly asynchronous; NULL if it cannot be had (the core then
     * uses its allocator).  Free with host_free.
     *
     * copy_async: copy bytes on the backend's copy stream, which first waits
     * for everything already queued on the compute stream (a device-to-host
     * copy sees what backward wrote; a host-to-device copy cannot overwrite
     * memory a queued kernel still reads).  dir: DT_COPY_H2D (dst device,
     * src host) or DT_COPY_D2H.  Returns a ticket for copy_wait / copy_join,
     * 0 if the copy is already done.  The host memory must stay valid, and
     * unchanged for H2D, until the ticket is waited for.
     * copy_wait: block the calling thread until ticket (and every ticket
     * before it) is done.  copy_join: later compute-stream work waits for it
     * (the host does not block).  All three may be called from any thread. */
    void *(*host_alloc)(dt_backend *be, size_t bytes);
    void (*host_free)(dt_backend *be, void *ptr);
    uint64_t (*copy_async)(dt_backend *be, void *dst, const void *src, size_t bytes, int dir);
    void (*copy_wait)(dt_backend *be, uint64_t ticket);
    void (*copy_join)(dt_backend *be, uint64_t ticket);

    /* --- dense linear algebra ------------------------------------------- */
    /* C (M,N) = alpha * op(A) op(B) + beta * C, row-major; op(A) is (M,K):
     * A is (M,K) with lda, or (K,M) when ta.  Like cblas_sgemm(RowMajor). */
    void (*gemm)(dt_backend *be, int ta, int tb, int64_t m, int64_t n, int64_t k,
                 float alpha, const float *a, int64_t lda, const float *b, int64_t ldb,
                 float beta, float *c, int64_t ldc);
    /* batch independent gemms; operand i starts at a + i*stride_a etc.
     * stride_b may be 0 (one shared B). */
    void (*gemm_batched)(dt_backend *be, int64_t batch, int ta, int tb, int64_t m, int64_t n,
                         int64_t k, float alpha, const float *a, int64_t lda, int64_t stride_a,
                         const float *b, int64_t ldb, int64_t stride_b, float beta, float *c,
                         int64_t ldc, int64_t stride_c);

    /* (optional) Mixed precision: gemm_batched with every element of A and
     * B first rounded to prec (DT_PREC_TF32: 10 mantissa bits; BF16: 7;
     * F16: IEEE half, out of range to +-inf), products summed in f32, C f32
     * (cublasGemmEx with f32 compute).  batch 1 is a single gemm.  NULL:
     * the core rounds the operands with round_prec and calls gemm. */
    void (*gemm_ex)(dt_backend *be, dt_precision prec, int64_t batch, int ta, int tb, int64_t m,
                    int64_t n, int64_t k, float alpha, const float *a, int64_t lda,
                    int64_t stride_a, const float *b, int64_t ldb, int64_t stride_b, float beta,
                    float *c, int64_t ldc, int64_t stride_c);
    /* y = x rounded to nearest even at prec (kept as f32); y may be x. */
    void (*round_prec)(dt_backend *be, dt_precision prec, int64_t n, const float *x, float *y);

    /* --- elementwise ---------------------------------------------------- */
    void (*fill)(dt_backend *be, int64_t n, float value, float *y);
    /* y = alpha * x + beta * y   (beta = 0 means y is not read) */
    void (*axpby)(dt_backend *be, int64_t n, float alpha, const float *x, float beta, float *y);
    /* y = op(x) */
    void (*unary)(dt_backend *be, dt_unary_op op, int64_t n, const float *x, float *y);
    /* dx (+)= dy * op'(x); y = op(x) is passed too (relu/tanh/sigmoid use it).
     * accumulate: 0 writes dx, 1 adds to it. */
    void (*unary_backward)(dt_backend *be, dt_unary_op op, int64_t n, const float *x,
                           const float *y, const float *dy, float *dx, int accumulate);
    /* out[i] = a[ia] op b[ib] over an ndim index space of shape `shape`
     * (out contiguous); a_strides / b_strides in elements, 0 on broadcast
     * dims. ndim <= DT_MAX_DIMS. */
    void (*binary)(dt_backend *be, dt_binary_op op, int ndim, const int64_t *shape,
                   const float *a, const int64_t *a_strides, const float *b,
                   const int64_t *b_strides, float *out);
    /* Strided copy over an ndim index space: dst[dst_idx] (+)= src[src_idx].
     * Used for contiguous(), transposes, slices and concat.  Element size
     * elem_bytes (4 for f32/i32, 1 for u8); accumulate only for f32. */
    void (*copy_strided)(dt_backend *be, int ndim, const int64_t *shape, size_t elem_bytes,
                         void *dst, const int64_t *dst_strides, const void *src,
                         const int64_t *src_strides, int accumulate);
    /* Reduce src (contiguous, shape `shape`) into dst with dst_strides that
     * are 0 on the dims being summed: dst (+)= sum.  Backward of broadcasting. */
    void (*sum_to)(dt_backend *be, int ndim, const int64_t *shape, const float *src,
                   float *dst, const int64_t *dst_strides, int accumulate);

    /* --- reductions ----------------------------------------------------- */
    /* x viewed as (outer, len, inner); y (outer, inner) = op over len. */
    void (*reduce_axis)(dt_backend *be, dt_axis_op op, int64_t outer, int64_t len,
                        int64_t inner, const float *x, float *y);
    /* Deterministic sums over all n, written to a device scalar *y. */
    void (*sum)(dt_backend *be, int64_t n, const float *x, float *y);
    /* Sum of squares returned to the host (gradient clipping). */
    double (*sumsq)(dt_backend *be, int64_t n, const float *x);

    /* --- softmax family, along an axis of x viewed as (outer, len, inner) - */
    void (*softmax)(dt_backend *be, int64_t outer, int64_t len, int64_t inner,
                    const float *x, float *y, int log);
    /* dx (+)= softmax/log_softmax backward from y (the forward output). */
    void (*softmax_backward)(dt_backend *be, int64_t outer, int64_t len, int64_t inner,
                             const float *y, const float *dy, float *dx, int log, int accumulate);
    /* Cross entropy: logits (n,c), labels (n) i32.  Rows whose label equals
     * ignore are skipped (no loss, no gradient); DT_XENT_KEEP_ALL skips none.
     * Writes rows (2n): each row's max m and 1/sum(exp(logit - m)), every
     * row's, so that backward rebuilds softmax = exp(logit - m) * (1/sum)
     * without an (n,c) buffer; and loss (device scalar) = the sum over the
     * other rows of -log p[label], divided by `kept` (their count, which the
     * core knows).  Returns the first index of a label that is neither in
     * range nor ignored, or -1 if there is none. */
    int64_t (*xent_forward)(dt_backend *be, int64_t n, int64_t c, const float *logits,
                            const int32_t *labels, int64_t ignore, int64_t kept, float *rows,
                            float *loss);
    /* dlogits (+)= (softmax(logits) - onehot(labels)) * (*dloss) / kept on
     * the rows not ignored, softmax from the forward's rows; ignored rows
     * get 0 (or keep their value when accumulating).  dloss is a device
     * scalar. */
    void (*xent_backward)(dt_backend *be, int64_t n, int64_t c, const float *logits,
                          const float *rows, const int32_t *labels, int64_t ignore, int64_t kept,
                          const float *dloss, float *dlogits, int accumulate);

    /* --- convolution helpers, NCHW ------------------------------------- */
    /* x (N,C,H,W) -> col (C*KH*KW, N*OH*OW): column j = n*OH*OW + p. */
    void (*im2col)(dt_backend *be, const dt_conv_geom *g, const float *x, float *col);
    /* dx (N,C,H,W) (+)= fold of col (C*KH*KW, N*OH*OW). */
    void (*col2im)(dt_backend *be, const dt_conv_geom *g, const float *col, float *dx,
                   int accumulate);
    /* y (N,C,inner) (+)= bias (C) broadcast; used by conv and linear (inner=1). */
    void (*bias_add)(dt_backend *be, int64_t n, int64_t c, int64_t inner, const float *bias,
                     float *y);
    /* dbias (C) (+)= sum over n and inner of dy (N,C,inner). */
    void (*bias_grad)(dt_backend *be, int64_t n, int64_t c, int64_t inner, const float *dy,
                      float *dbias, int accumulate);
    /* y (O, N*P) -> out (N, O, P): the GEMM layout of conv back to NCHW. */
    void (*cnp_to_ncp)(dt_backend *be, int64_t c, int64_t n, int64_t p, const float *src,
                       float *dst);
    /* (N, O, P) -> (O, N*P) */
    void (*ncp_to_cnp)(dt_backend *be, int64_t n, int64_t c, int64_t p, const float *src,
                       float *dst);

    /* --- fused convolution (optional) --------------------------------------
     * NULL: the core composes im2col + one GEMM over the batch + a permute.
     * A backend can do better (the CPU one lowers one image at a time so the
     * column buffer stays in cache and needs no permute).  Both return
     * DT_ENOMEM if scratch memory cannot be had, before touching outputs. */
    /* y (N,O,OH,OW) = conv(x (N,C,H,W), w (O,C,KH,KW)) + b (O), b may be NULL */
    dt_status (*conv2d_forward)(dt_backend *be, const dt_conv_geom *g, int64_t o, const float *x,
                                const float *w, const float *b, float *y);
    /* From dy (N,O,OH,OW): dx (N,C,H,W), dw (O,C,KH,KW), db (O); each may be
     * NULL (not wanted) and is written (acc 0) or added to (acc 1). */
    dt_status (*conv2d_backward)(dt_backend *be, const dt_conv_geom *g, int64_t o, const float *x,
                                 const float *w, const float *dy, float *dx, int acc_dx,
                                 float *dw, int acc_dw, float *db, int acc_db);

    /* --- pooling, NCHW, g->c channels, kernel kh=kw ------------------------ */
    /* y (N,C,OH,OW); argmax (N,C,OH,OW) i32 = flat h*W+w index in the input plane
     * (-1 if the window is all padding). */
    void (*maxpool_forward)(dt_backend *be, const dt_conv_geom *g, const float *x, float *y,
                            int32_t *argmax);
    void (*maxpool_backward)(dt_backend *be, const dt_conv_geom *g, const float *dy,
                             const int32_t *argmax, float *dx, int accumulate);
    /* average over the window, padding counted (count_include_pad=True) */
    void (*avgpool_forward)(dt_backend *be, const dt_conv_geom *g, const float *x, float *y);
    void (*avgpool_backward)(dt_backend *be, const dt_conv_geom *g, const float *dy, float *dx,
                             int accumulate);

    /* --- embedding ------------------------------------------------------ */
    /* y (n, d) = weight[idx[i]] rows.  idx validated by the core. */
    void (*embedding_forward)(dt_backend *be, int64_t n, int64_t d, const float *weight,
                              const int32_t *idx, float *y);
    /* dweight[idx[i]] += dy[i] for i in order (rows not in idx untouched). */
    void (*embedding_backward)(dt_backend *be, int64_t n, int64_t d, const int32_t *idx,
                               const float *dy, float *dweight);
    /* Index range check on device data: returns first i with idx[i] outside
     * [0, limit), or -1. */
    int64_t (*index_check)(dt_backend *be, int64_t n, const int32_t *idx, int64_t limit);

    /* --- layer norm over rows of length d ------------------------------ */
    /* y = (x - mean) * rstd * w + b; w, b may be NULL; mean, rstd (rows) saved. */
    void (*layernorm_forward)(dt_backend *be, int64_t rows, int64_t d, const float *x,
                              const float *w, const float *b, float eps, float *y, float *mean,
                              float *rstd);
    /* dx (+)=, dw +=, db += (dw/db may be NULL). */
    void (*layernorm_backward)(dt_backend *be, int64_t rows, int64_t d, const float *x,
                               const float *w, const float *mean, const float *rstd,
                               const float *dy, float *dx, float *dw, float *db, int accumulate);

    /* --- dropout -------------------------------------------------------- */
    /* mask[i] = (hash(seed, i) >= p) ? 1/(1-p) : 0 (counter-based: the same
     * seed gives the same mask whatever the thread count); y = x * mask. */
    void (*dropout_forward)(dt_backend *be, int64_t n, float p, uint64_t seed, const float *x,
                            float *y, float *mask);

    /* --- optimizers (in place over n elements) ------------------------- */
    /* PyTorch's SGD: g' = g + wd*w; buf = first ? g' : momentum*buf +
     * (1-dampening)*g'; step = nesterov ? g' + momentum*buf : buf (or g' when
     * momentum == 0, buf may be NULL); w -= lr*step. */
    void (*sgd_update)(dt_backend *be, int64_t n, float *w, const float *g, float *buf,
                       float lr, float momentum, float dampening, int nesterov,
                       float weight_decay, int first);
    /* PyTorch's Adam/AdamW at step t (1-based): decoupled=1 is AdamW
     * (w *= 1 - lr*wd), else L2 (g += wd*w).  bc1 = 1-beta1^t, bc2 = 1-beta2^t.
     * w -= lr * (m/bc1) / (sqrt(v/bc2) + eps). */
    void (*adam_update)(dt_backend *be, int64_t n, float *w, const float *g, float *m,
                        float *v, float lr, float beta1, float beta2, float eps,
                        float weight_decay, int decoupled, float bc1, float bc2);
    /* PyTorch's Adagrad (lr_decay 0, initial accumulator 0): g' = g + wd*w;
     * sum += g'*g'; w -= lr * g' / (sqrt(sum) + eps).  May be NULL: the
     * backend has no AdaGrad (dt_optim_new says so). */
    void (*adagrad_update)(dt_backend *be, int64_t n, float *w, const float *g, float *sum,
                           float lr, float eps, float weight_decay);

    /* --- metrics -------------------------------------------------------- */
    /* number of rows of logits (n,c) whose argmax (first max) equals label */
    int64_t (*count_correct)(dt_backend *be, int64_t n, int64_t c, const float *logits,
                             const int32_t *labels);

    /* --- faults (optional; NULL: the backend cannot fail underneath) -------
     * The first failure since init (a kernel launch, a cuBLAS call, a copy,
     * an asynchronous fault found at a sync), sticky: once set, every later
     * call reports it again, and the instance computes nothing trustworthy
     * any more (a CUDA context that saw an illegal address is lost for
     * good).  Returns DT_OK, or the failure's status with its message in
     * err.  Cheap: reads a flag; it does not synchronize.  After a fault
     * the value-returning entries return: sumsq NaN, xent_forward and
     * index_check -1 (the caller must ask fault() before trusting "all
     * valid"), count_correct -1. */
    dt_status (*fault)(dt_backend *be, char *err, size_t err_len);

    /* --- attention (optional; NULL: dt_attention says the backend has none)
     * bh independent heads, each q, k, v, o (t, d) contiguous at h * t * d.
     * Scores s = scale q k^T (t, t), plus mask (t, t) when not NULL (added,
     * -inf blocks), with s[i][j] = -inf for j > i when causal; o = softmax(s)
     * v; lse (bh, t) = the log-sum-exp of each score row, all that backward
     * keeps (it recomputes the scores).  Backward writes dq, dk, dv (no
     * accumulation).  Both return DT_ENOMEM if scratch memory cannot be had,
     * before touching outputs. */
    dt_status (*attention_forward)(dt_backend *be, int64_t bh, int64_t t, int64_t d, float scale,
                                   int causal, const float *mask, const float *q, const float *k,
                                   const float *v, float *o, float *lse);
    dt_status (*attention_backward)(dt_backend *be, int64_t bh, int64_t t, int64_t d, float scale,
                                    int causal, const float *mask, const float *q, const float *k,
                                    const float *v, const float *o, const float *lse,
                                    const float *dout, float *dq, float *dk, float *dv);

    /* --- memory given back (optional; NULL: sharded parameters, zero 3,
     * are refused) -----------------------------------------------------
     * The contents of [ptr, ptr + bytes) of an allocation may be dropped:
     * the physical memory of the whole pages inside goes back to the system
     * until written again, and those bytes read as anything meanwhile
     * (zeros on Linux).  The allocation stays valid at the same address.
     * A backend with commit (device memory) gives the pages back unmapped:
     * reading or writing them before commit is a fault. */
    void (*discard)(dt_backend *be, void *ptr, size_t bytes);

    /* --- 16-bit storage (optional; NULL: 16-bit optimizer state,
     * dt_optim_config.state_dtype, is refused) -----------------------------
     * to_half: y (n 16-bit words) = x rounded to nearest even at prec
     * (DT_PREC_BF16 or DT_PREC_F16; bits as half.h's f32_to_bf16 and
     * f32_to_f16).  from_half: y (n floats) = x widened, exactly. */
    void (*to_half)(dt_backend *be, dt_precision prec, int64_t n, const float *x, uint16_t *y);
    void (*from_half)(dt_backend *be, dt_precision prec, int64_t n, const uint16_t *x, float *y);

    /* --- memory asked back after a discard (optional; NULL: discarded
     * memory comes back when it is written, as the CPU's pages do) -------
     * Memory discarded from [ptr, ptr + bytes) is there again, writable
     * (its contents anything), before anything writes it: device memory
     * gives physical pages back by unmapping them, and a write into an
     * unmapped page is a fault, not a page coming back.  DT_ENOMEM when the
     * device has none left (nothing else changes). */
    dt_status (*commit)(dt_backend *be, void *ptr, size_t bytes);
} dt_backend_iface;

/* Backends compiled in expose their interface through these. */
const dt_backend_iface *dt_backend_cpu_iface(void);
const dt_backend_iface *dt_backend_cuda_iface(void);
/* The CPU backend behind the device-memory code paths (host_visible 0,
 * copies queued until waited for): how CI tests staging without a GPU. */
const dt_backend_iface *dt_backend_cpu_staged_iface(void);

#ifdef __cplusplus
}
#endif

#endif /* DTRAIN_BACKEND_H */
