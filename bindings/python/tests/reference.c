/* The C side of the binding's comparisons (tests/test_dtrain.py, class
 * AgainstC): small deterministic runs of the areas the binding reaches, their
 * results printed as hex floats ("name v v v ...") for the Python twins of
 * these runs to match bit for bit.  Built and run by the test against the
 * library the test loads.
 *
 * Every run: a context seeded 7, 1 thread; an MLP 8-16-4 (linear, ReLU,
 * linear, dt_linear_params' init); the batch X (32, 8) with
 * X[i][j] = ((7i + 3j) % 11 - 5) / 5 and labels i % 4. */
#include <stdio.h>
#include <stdlib.h>

#include "dtrain.h"

enum { N = 32, IN = 8, HID = 16, OUT = 4 };

typedef struct mlp {
    dt_tensor *w1, *b1, *w2, *b2;
} mlp;

static float X[N * IN];
static int32_t Y[N];

static void fail(dt_ctx *ctx, const char *what)
{
    fprintf(stderr, "reference: %s: %s\n", what, dt_last_error(ctx));
    exit(1);
}

static void make_data(void)
{
    for (int i = 0; i < N; i++) {
        for (int j = 0; j < IN; j++)
            X[i * IN + j] = (float)((7 * i + 3 * j) % 11 - 5) / 5.0f;
        Y[i] = i % OUT;
    }
}

static dt_ctx *new_ctx(void)
{
    dt_ctx_config cfg;
    dt_ctx_config_init(&cfg);
    cfg.seed = 7;
    return dt_ctx_new(&cfg);
}

static mlp build(dt_ctx *ctx)
{
    mlp m;
    if (dt_linear_params(ctx, "l1", IN, HID, 1, &m.w1, &m.b1) != DT_OK ||
        dt_linear_params(ctx, "l2", HID, OUT, 1, &m.w2, &m.b2) != DT_OK)
        fail(ctx, "build");
    return m;
}

static dt_tensor *hidden(dt_ctx *ctx, dt_tensor *const *in, int n, void *user)
{
    (void)n, (void)user;
    return dt_relu(ctx, dt_linear(ctx, in[0], in[1], in[2]));
}

/* the MLP's logits; recompute: the hidden layer through dt_recompute */
static dt_tensor *forward(dt_ctx *ctx, const mlp *m, dt_tensor *x, int recompute)
{
    dt_tensor *in[3] = {x, m->w1, m->b1};
    dt_tensor *h = recompute ? dt_recompute(ctx, hidden, in, 3, NULL) : hidden(ctx, in, 3, NULL);
    return dt_linear(ctx, h, m->w2, m->b2);
}

static void batch(dt_ctx *ctx, dt_tensor **x, dt_tensor **y)
{
    int64_t xs[2] = {N, IN}, ys[1] = {N};
    *x = dt_tensor_new(ctx, DT_F32, 2, xs);
    *y = dt_tensor_new(ctx, DT_I32, 1, ys);
    if (!*x || !*y || dt_tensor_set(*x, X, N * IN) != DT_OK || dt_tensor_set(*y, Y, N) != DT_OK)
        fail(ctx, "batch");
}

static dt_optim *optimizer(dt_ctx *ctx, dt_optim_kind kind, float lr)
{
    dt_optim_config oc;
    dt_optim_config_init(&oc, kind);
    oc.lr = lr;
    dt_optim *o = dt_optim_new(ctx, &oc, NULL, 0);
    if (!o)
        fail(ctx, "optimizer");
    return o;
}

static void print_sum(const char *name, const dt_tensor *t)
{
    float v[HID * IN];
    int64_t n = dt_tensor_numel(t);
    dt_tensor_get(t, v, n);
    double s = 0;
    for (int64_t i = 0; i < n; i++)
        s += v[i];
    printf("%s %a\n", name, s);
}

/* steps of kind at lr on the batch: autocast p, recompute, loss scaling */
static void train(const char *name, dt_precision p, int recompute, int scaled, dt_optim_kind kind,
                  float lr, int steps)
{
    dt_ctx *ctx = new_ctx();
    mlp m = build(ctx);
    dt_optim *o = optimizer(ctx, kind, lr);
    dt_loss_scaler *sc = scaled ? dt_loss_scaler_new(ctx, NULL) : NULL;
    dt_tensor *x, *y;
    batch(ctx, &x, &y);
    printf("%s", name);
    for (int s = 0; s < steps; s++) {
        if (dt_ctx_set_autocast(ctx, p) != DT_OK)
            fail(ctx, "autocast");
        dt_tensor *loss = dt_cross_entropy(ctx, forward(ctx, &m, x, recompute), y);
        dt_ctx_set_autocast(ctx, DT_PREC_F32);
        if (!loss || (sc ? dt_loss_scaler_backward(sc, loss) : dt_backward(ctx, loss)) != DT_OK ||
            (sc ? dt_loss_scaler_step(sc, o, NULL) : dt_optim_step(o)) != DT_OK)
            fail(ctx, name);
        printf(" %a", (double)dt_tensor_item(loss));
        dt_ctx_zero_grad(ctx);
        dt_ctx_step_reset(ctx);
    }
    if (sc)
        printf(" %a", (double)dt_loss_scaler_scale(sc));
    printf("\n");
    print_sum("w2_sum", m.w2);
    dt_loss_scaler_free(sc);
    dt_optim_free(o);
    dt_ctx_free(ctx);
}

static void *dp_build(dt_ctx *ctx, int k, void *user)
{
    (void)k, (void)user;
    mlp *m = malloc(sizeof *m);
    if (m)
        *m = build(ctx);
    return m;
}

static dt_tensor *dp_loss(dt_ctx *ctx, void *model, dt_tensor *x, dt_tensor *y, void *user)
{
    (void)user;
    return dt_cross_entropy(ctx, forward(ctx, model, x, 0), y);
}

static void dp_free(void *model, void *user)
{
    (void)user;
    free(model);
}

/* 2 in-process replicas, SGD lr 0.1, 3 steps */
static void replicas(void)
{
    dt_ctx *ctx = new_ctx();
    dt_dp_config c;
    dt_dp_config_init(&c);
    c.replicas = 2;
    c.replica.seed = 7;
    c.optim.lr = 0.1f;
    dt_dp *dp = dt_dp_new(ctx, &c, dp_build, dp_loss, dp_free, NULL);
    if (!dp)
        fail(ctx, "dp_new");
    dt_tensor *x, *y;
    batch(ctx, &x, &y);
    printf("replicas");
    for (int s = 0; s < 3; s++) {
        float loss;
        if (dt_dp_step(dp, x, y, &loss) != DT_OK)
            fail(ctx, "dp_step");
        printf(" %a", (double)loss);
    }
    printf("\n");
    print_sum("w2_sum", ((mlp *)dt_dp_model(dp, 1))->w2);
    dt_dp_free(dp);
    dt_ctx_free(ctx);
}

static dt_tensor *eval_forward(dt_ctx *ctx, dt_tensor *x, void *user)
{
    return forward(ctx, user, x, 0);
}

/* The batch as a dataset: a shuffled loader's batches (the first epoch's
 * input sums and labels), then 3 SGD steps and dt_predict over it. */
static void dataset_and_predict(void)
{
    dt_ctx *ctx = new_ctx();
    mlp m = build(ctx);
    dt_sample_field in = {DT_F32, 1, {IN}}, tg = {DT_I32, 0, {0}};
    dt_dataset *ds = dt_dataset_from_memory(ctx, N, &in, X, &tg, Y, 0);
    dt_loader_config lc;
    dt_loader_config_init(&lc);
    lc.batch = 8;
    lc.seed = 3;
    dt_loader *ld = ds ? dt_loader_new(ctx, ds, &lc) : NULL;
    if (!ld || dt_loader_start_epoch(ld, 0) != DT_OK)
        fail(ctx, "loader");
    dt_tensor *x, *y;
    printf("batches");
    while (dt_loader_next(ld, &x, &y) == DT_OK) {
        float v[8 * IN];
        int32_t l[8];
        dt_tensor_get(x, v, 8 * IN);
        dt_tensor_get(y, l, 8);
        double s = 0;
        for (int i = 0; i < 8 * IN; i++)
            s += v[i] * (float)(i % 5 + 1);
        printf(" %a", s);
        for (int i = 0; i < 8; i++)
            printf(" %d", l[i]);
    }
    printf("\n");
    dt_optim *o = optimizer(ctx, DT_SGD, 0.5f);
    dt_tensor *bx, *by;
    batch(ctx, &bx, &by);
    for (int s = 0; s < 3; s++) {
        dt_tensor *loss = dt_cross_entropy(ctx, forward(ctx, &m, bx, 0), by);
        if (!loss || dt_backward(ctx, loss) != DT_OK || dt_optim_step(o) != DT_OK)
            fail(ctx, "train");
        dt_ctx_zero_grad(ctx);
        dt_ctx_step_reset(ctx);
    }
    int32_t pred[N];
    if (dt_predict(ctx, NULL, ds, NULL, eval_forward, &m, pred) != DT_OK)
        fail(ctx, "predict");
    printf("predict");
    for (int i = 0; i < N; i++)
        printf(" %d", pred[i]);
    printf("\n");
    dt_optim_free(o);
    dt_loader_free(ld);
    dt_dataset_free(ds);
    dt_ctx_free(ctx);
}

int main(void)
{
    make_data();
    train("f32", DT_PREC_F32, 0, 0, DT_ADAM, 1e-2f, 4);
    train("bf16", DT_PREC_BF16, 0, 0, DT_ADAM, 1e-2f, 4);
    train("fp16_scaled", DT_PREC_F16, 0, 1, DT_SGD, 0.1f, 3);
    train("recompute", DT_PREC_F32, 1, 0, DT_SGD, 0.1f, 3);
    replicas();
    dataset_and_predict();
    return 0;
}
