/*
 * tests/embed/vendored.c - the smallest program a vendoring user writes:
 * build.sh copies dtrain.h, dtrain.c and the chosen backends/ files next
 * to it in an empty directory and compiles the lot with one cc line (and
 * links it against an installed libdtrain through pkg-config).  It fits
 * y = 2x - 1 with a linear layer and SGD; exit 0 when the loss fell below
 * 1e-3, else 1 with the reason.
 */
#include "dtrain.h"

#include <stdio.h>

int main(void)
{
    dt_ctx_config cfg;
    dt_ctx_config_init(&cfg);
    cfg.seed = 3;
    dt_ctx *ctx = dt_ctx_new(&cfg);
    if (!ctx || dt_ctx_status(ctx) != DT_OK) {
        fprintf(stderr, "vendored: %s\n", ctx ? dt_last_error(ctx) : "out of memory");
        return 1;
    }
    float xs[16], ys[16];
    for (int i = 0; i < 16; i++) {
        xs[i] = (float)i / 8.0f - 1.0f;
        ys[i] = 2.0f * xs[i] - 1.0f;
    }
    dt_tensor *w = dt_param_new(ctx, "w", 2, (int64_t[]){1, 1});
    dt_tensor *b = dt_param_new(ctx, "b", 1, (int64_t[]){1});
    dt_tensor *x = dt_tensor_new(ctx, DT_F32, 2, (int64_t[]){16, 1});
    dt_tensor *y = dt_tensor_new(ctx, DT_F32, 2, (int64_t[]){16, 1});
    dt_optim_config oc;
    dt_optim_config_init(&oc, DT_SGD);
    oc.lr = 0.5f;
    dt_optim *opt = dt_optim_new(ctx, &oc, NULL, 0);
    float loss = 1;
    if (!opt || dt_tensor_set(x, xs, 16) != DT_OK || dt_tensor_set(y, ys, 16) != DT_OK) {
        fprintf(stderr, "vendored: %s\n", dt_last_error(ctx));
        return 1;
    }
    for (int step = 0; step < 200; step++) {
        dt_tensor *l = dt_mse(ctx, dt_linear(ctx, x, w, b), y);
        if (!l || dt_backward(ctx, l) != DT_OK || dt_optim_step(opt) != DT_OK) {
            fprintf(stderr, "vendored: step %d: %s\n", step, dt_last_error(ctx));
            return 1;
        }
        loss = dt_tensor_item(l);
        dt_optim_zero_grad(opt);
        dt_ctx_step_reset(ctx);
    }
    printf("vendored: dtrain %s, %s backend, loss %.2e after 200 steps\n", DTRAIN_VERSION_STRING,
           dt_backend_name(ctx), (double)loss);
    dt_optim_free(opt);
    dt_tensor_free(x);
    dt_tensor_free(y);
    dt_ctx_free(ctx);
    return loss < 1e-3f ? 0 : 1;
}
