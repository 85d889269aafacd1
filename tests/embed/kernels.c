/*
 * tests/embed/kernels.c - a program built against an installed libdtrain
 * by tests/install_check.sh.  It prints the instruction-set level this CPU
 * offers by the CPU backend's own rule ("cpu supports: avx512"), then
 * trains a small model for a few steps through every kernel that backend
 * compiles once per level (GELU in both forms, tanh, sigmoid, exp, softmax
 * and log-softmax, layer norm, attention, convolution, cross entropy, the
 * sums of a gradient-norm clip, AdamW and AdaGrad), and prints each step's
 * loss and
 * a hash of the parameters' bits: the lines to compare between levels.
 * Exit 0 when it trained, 1 with the reason otherwise.
 */
#include "dtrain.h"

#include <stdint.h>
#include <stdio.h>
#include <string.h>

#define B 4    /* sequences */
#define T 16   /* positions */
#define D 64   /* channels */
#define H 128  /* hidden */
#define C 10   /* classes */

/* backends/cpu.c's choice: all four AVX-512 subsets, else AVX2, else SSE2 */
static const char *cpu_supports(void)
{
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq"))
        return "avx512";
    if (__builtin_cpu_supports("avx2"))
        return "avx2";
#endif
    return "baseline";
}

typedef struct model {
    dt_tensor *ln_w, *ln_b, *wq, *wk, *wv, *w1, *b1, *w2, *b2, *cw, *cb;
} model;

static int make_model(dt_ctx *ctx, model *m)
{
    return dt_layer_norm_params(ctx, "ln", D, 1, &m->ln_w, &m->ln_b) != DT_OK ||
           dt_linear_params(ctx, "q", D, D, 0, &m->wq, NULL) != DT_OK ||
           dt_linear_params(ctx, "k", D, D, 0, &m->wk, NULL) != DT_OK ||
           dt_linear_params(ctx, "v", D, D, 0, &m->wv, NULL) != DT_OK ||
           dt_linear_params(ctx, "fc1", D, H, 1, &m->w1, &m->b1) != DT_OK ||
           dt_linear_params(ctx, "fc2", H, C, 1, &m->w2, &m->b2) != DT_OK ||
           dt_conv2d_params(ctx, "conv", 1, 4, 3, 1, &m->cw, &m->cb) != DT_OK;
}

/* cross entropy + mean(softmax * log_softmax) + mean(exp(tanh(logits)))
 * + the mean of a convolution of x as one-channel (T, D) images: a loss
 * whose backward runs each kernel's backward too */
static dt_tensor *forward(dt_ctx *ctx, const model *m, dt_tensor *x, dt_tensor *y)
{
    dt_tensor *h = dt_layer_norm(ctx, x, m->ln_w, m->ln_b, 1e-5f);
    dt_tensor *a = dt_attention(ctx, dt_linear(ctx, h, m->wq, NULL),
                                dt_linear(ctx, h, m->wk, NULL),
                                dt_linear(ctx, h, m->wv, NULL), NULL, 1, 0.0f);
    dt_tensor *z = dt_gelu_tanh(ctx, dt_linear(ctx, dt_add(ctx, a, x), m->w1, m->b1));
    z = dt_gelu(ctx, dt_add(ctx, dt_tanh(ctx, z), dt_sigmoid(ctx, z)));
    dt_tensor *logits = dt_linear(ctx, z, m->w2, m->b2);
    dt_tensor *ent = dt_mean(ctx, dt_mul(ctx, dt_softmax(ctx, logits, -1),
                                         dt_log_softmax(ctx, logits, -1)));
    dt_tensor *e = dt_mean(ctx, dt_exp(ctx, dt_tanh(ctx, logits)));
    dt_tensor *img = dt_reshape(ctx, dt_tanh(ctx, h), 4, (int64_t[]){B, 1, T, D});
    dt_tensor *conv = dt_mean(ctx, dt_max_pool2d(ctx, dt_relu(ctx, dt_conv2d(ctx, img, m->cw, m->cb,
                                                                            1, 1)), 2, 0, 0));
    return dt_add(ctx, dt_add(ctx, dt_add(ctx, dt_cross_entropy(ctx, logits, y), ent), e), conv);
}

/* FNV-1a over every parameter's bytes, in creation order */
static int params_hash(dt_ctx *ctx, uint64_t *out)
{
    static float buf[H * D];
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < dt_param_count(ctx); i++) {
        dt_tensor *p = dt_param_at(ctx, i);
        int64_t n = dt_tensor_numel(p);
        if (n > H * D || dt_tensor_get(p, buf, n) != DT_OK) return 1;
        const unsigned char *c = (const unsigned char *)buf;
        for (size_t j = 0; j < (size_t)n * sizeof(float); j++) h = (h ^ c[j]) * 1099511628211ull;
    }
    *out = h;
    return 0;
}

/* inputs from a fixed LCG: the same bits on every machine */
static void fill_batch(float *xs, int32_t *ys)
{
    uint32_t s = 12345;
    for (int i = 0; i < B * T * D; i++) {
        s = s * 1664525u + 1013904223u;
        xs[i] = (float)(s >> 8) / 16777216.0f * 4.0f - 2.0f;
    }
    for (int i = 0; i < B * T; i++) {
        s = s * 1664525u + 1013904223u;
        ys[i] = (int32_t)((s >> 8) % C);
    }
}

static int train(dt_ctx *ctx)
{
    static float xs[B * T * D];
    static int32_t ys[B * T];
    model m;
    fill_batch(xs, ys);
    dt_tensor *x = dt_tensor_new(ctx, DT_F32, 3, (int64_t[]){B, T, D});
    dt_tensor *y = dt_tensor_new(ctx, DT_I32, 2, (int64_t[]){B, T});
    if (make_model(ctx, &m) || !x || !y || dt_tensor_set(x, xs, B * T * D) != DT_OK ||
        dt_tensor_set(y, ys, B * T) != DT_OK)
        return 1;
    dt_optim_config ac, gc;
    dt_optim_config_init(&ac, DT_ADAMW);
    dt_optim_config_init(&gc, DT_ADAGRAD);
    ac.lr = 1e-2f;
    gc.lr = 1e-2f;
    dt_tensor *first[] = {m.ln_w, m.ln_b, m.wq, m.wk, m.wv, m.cw, m.cb};
    dt_tensor *rest[] = {m.w1, m.b1, m.w2, m.b2};
    dt_optim *adamw = dt_optim_new(ctx, &ac, first, 7), *adagrad = dt_optim_new(ctx, &gc, rest, 4);
    int bad = !adamw || !adagrad;
    printf("losses:");
    for (int step = 0; step < 5 && !bad; step++) {
        dt_tensor *loss = forward(ctx, &m, x, y);
        bad = !loss || dt_backward(ctx, loss) != DT_OK ||
              dt_ctx_clip_grad_norm(ctx, 1.0f, NULL) != DT_OK || dt_optim_step(adamw) != DT_OK ||
              dt_optim_step(adagrad) != DT_OK;
        if (!bad) printf(" %a", dt_tensor_item(loss));
        dt_optim_zero_grad(adamw);
        dt_optim_zero_grad(adagrad);
        dt_ctx_step_reset(ctx);
    }
    printf("\n");
    uint64_t hash = 0;
    bad = bad || params_hash(ctx, &hash);
    if (!bad) printf("params: %016llx\n", (unsigned long long)hash);
    dt_optim_free(adamw);
    dt_optim_free(adagrad);
    dt_tensor_free(x);
    dt_tensor_free(y);
    return bad;
}

int main(void)
{
    printf("cpu supports: %s\n", cpu_supports());
    dt_ctx_config cfg;
    dt_ctx_config_init(&cfg);
    cfg.seed = 7;
    cfg.threads = 2;
    dt_ctx *ctx = dt_ctx_new(&cfg);
    if (!ctx || dt_ctx_status(ctx) != DT_OK) {
        fprintf(stderr, "kernels: %s\n", ctx ? dt_last_error(ctx) : "out of memory");
        return 1;
    }
    if (train(ctx)) {
        fprintf(stderr, "kernels: %s\n", dt_last_error(ctx));
        dt_ctx_free(ctx);
        return 1;
    }
    dt_ctx_free(ctx);
    return 0;
}
