/*
 * examples/csv_regress.c - the smallest useful way to embed dtrain: a
 * command-line tool that fits a regression to a CSV file.
 *
 *   build/csv_regress data.csv                 (last column is the target)
 *   build/csv_regress data.csv --hidden 32     (an MLP instead of a line)
 *
 * The file has a header line and numeric columns.  Features are
 * standardised, the model is trained with Adam on the mean squared error
 * (whole file per step), and the tool prints R^2 and, for the linear model,
 * the coefficients in the original units.  dtrain does the tensors,
 * autograd and optimizer; everything else is ordinary C.
 */
#include "dtrain.h"
#include "args.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_COLS 64

typedef struct table {
    int rows, cols;
    char names[MAX_COLS][64];
    float *v;   /* rows x cols */
} table;

/* Read a header and numeric rows; 0 and a message on malformed input. */
static int read_csv(const char *path, table *t)
{
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "csv_regress: cannot open %s\n", path);
        return 0;
    }
    char line[4096];
    int cap = 1024, ok = 1;
    memset(t, 0, sizeof *t);
    if (!fgets(line, sizeof line, f)) {
        fprintf(stderr, "csv_regress: %s is empty\n", path);
        fclose(f);
        return 0;
    }
    for (char *tok = strtok(line, ",\r\n"); tok && t->cols < MAX_COLS; tok = strtok(NULL, ",\r\n"))
        snprintf(t->names[t->cols++], sizeof t->names[0], "%s", tok);
    t->v = malloc(sizeof(float) * (size_t)cap * (size_t)t->cols);
    for (int ln = 2; ok && t->v && fgets(line, sizeof line, f); ln++) {
        if (line[0] == '\n')
            continue;
        if (t->rows == cap) {
            float *g = realloc(t->v, sizeof(float) * (size_t)(cap *= 2) * (size_t)t->cols);
            if (!g)
                break;
            t->v = g;
        }
        char *p = line;
        for (int c = 0; c < t->cols && ok; c++) {
            char *end;
            t->v[(size_t)t->rows * (size_t)t->cols + (size_t)c] = strtof(p, &end);
            ok = end != p && (*end == ',' ? c < t->cols - 1 : c == t->cols - 1);
            p = end + 1;
        }
        if (!ok)
            fprintf(stderr, "csv_regress: %s line %d: need %d numbers separated by commas\n", path,
                    ln, t->cols);
        t->rows++;
    }
    fclose(f);
    if (ok && (!t->v || t->rows < 2 || t->cols < 2)) {
        fprintf(stderr, "csv_regress: %s: need at least 2 columns and 2 rows\n", path);
        ok = 0;
    }
    if (!ok)
        free(t->v);
    return ok;
}

static int check(dt_ctx *ctx, int ok, const char *what)
{
    if (!ok)
        fprintf(stderr, "csv_regress: %s: %s\n", what, dt_last_error(ctx));
    return ok;
}

static void usage(FILE *f)
{
    fprintf(f, "usage: csv_regress FILE.csv [--hidden N] [--steps N] [--lr X]\n"
               "  --hidden N   an MLP with N hidden units (default 0: a line)\n"
               "  --steps N    Adam steps on the whole file (default 500)\n"
               "  --lr X       learning rate (default 0.05)\n"
               "  --help       this text\n");
}

int main(int argc, char **argv)
{
    int hidden = 0, steps = 500;
    float lr = 0.05f;
    const args_opt opts[] = {
        ARG_INT("hidden", &hidden, 0, 1 << 16),
        ARG_INT("steps", &steps, 1, 1 << 30),
        ARG_RATE("lr", &lr, 1000),
    };
    int file = args_parse("csv_regress", argc, argv, opts, sizeof opts / sizeof opts[0],
                          ARGS_OPERANDS, usage);
    if (file < 0)
        return 2;
    if (file + 1 != argc) {   /* one file, no more */
        if (file < argc)
            fprintf(stderr, "csv_regress: unexpected argument '%s'\n", argv[file + 1]);
        usage(stderr);
        return 2;
    }
    table t;
    if (!read_csv(argv[file], &t))
        return 1;
    int n = t.rows, d = t.cols - 1;
    /* standardise every column (the target too), remembering how */
    double mean[MAX_COLS], sd[MAX_COLS];
    for (int c = 0; c < t.cols; c++) {
        double s = 0, q = 0;
        for (int r = 0; r < n; r++)
            s += t.v[r * t.cols + c];
        mean[c] = s / n;
        for (int r = 0; r < n; r++)
            q += pow(t.v[r * t.cols + c] - mean[c], 2);
        sd[c] = sqrt(q / n) > 0 ? sqrt(q / n) : 1;
    }
    float *xs = malloc(sizeof(float) * (size_t)n * (size_t)d), *ys = malloc(sizeof(float) * (size_t)n);
    for (int r = 0; xs && ys && r < n; r++) {
        for (int c = 0; c < d; c++)
            xs[r * d + c] = (float)((t.v[r * t.cols + c] - mean[c]) / sd[c]);
        ys[r] = (float)((t.v[r * t.cols + d] - mean[d]) / sd[d]);
    }

    dt_ctx_config cfg;
    dt_ctx_config_init(&cfg);
    cfg.seed = 1;
    dt_ctx *ctx = dt_ctx_new(&cfg);
    if (!ctx || !check(ctx, dt_ctx_status(ctx) == DT_OK, "starting"))
        return 1;
    dt_tensor *x = dt_tensor_new(ctx, DT_F32, 2, (int64_t[]){n, d});
    dt_tensor *y = dt_tensor_new(ctx, DT_F32, 2, (int64_t[]){n, 1});
    int width = hidden > 0 ? hidden : 1;
    dt_tensor *w1 = dt_param_new(ctx, "w1", 2, (int64_t[]){width, d});
    dt_tensor *b1 = dt_param_new(ctx, "b1", 1, (int64_t[]){width});
    dt_tensor *w2 = hidden > 0 ? dt_param_new(ctx, "w2", 2, (int64_t[]){1, hidden}) : NULL;
    dt_tensor *b2 = hidden > 0 ? dt_param_new(ctx, "b2", 1, (int64_t[]){1}) : NULL;
    int ok = check(ctx, xs && ys && x && y && w1 && b1 && (!hidden || (w2 && b2)), "allocating") &&
             check(ctx, dt_tensor_set(x, xs, (int64_t)n * d) == DT_OK &&
                        dt_tensor_set(y, ys, n) == DT_OK &&
                        dt_tensor_init_kaiming_uniform(ctx, w1, 2.2360679775f) == DT_OK &&
                        (!hidden || dt_tensor_init_kaiming_uniform(ctx, w2, 2.2360679775f) == DT_OK),
                   "initialising");
    dt_optim_config oc;
    dt_optim_config_init(&oc, DT_ADAM);
    oc.lr = lr;
    dt_optim *opt = ok ? dt_optim_new(ctx, &oc, NULL, 0) : NULL;
    ok = ok && check(ctx, opt != NULL, "optimizer");
    float mse = 1;
    for (int s = 0; ok && s < steps; s++) {
        dt_tensor *h = dt_linear(ctx, x, w1, b1);
        if (hidden)
            h = dt_linear(ctx, dt_relu(ctx, h), w2, b2);
        dt_tensor *loss = dt_mse(ctx, h, y);
        ok = check(ctx, loss && dt_backward(ctx, loss) == DT_OK && dt_optim_step(opt) == DT_OK,
                   "training");
        if (ok)
            mse = dt_tensor_item(loss);
        dt_optim_zero_grad(opt);
        dt_ctx_step_reset(ctx);
    }
    if (ok) {
        /* the target was standardised: the MSE is the unexplained share */
        printf("%d rows, %d features, %s: R^2 %.4f\n", n, d, hidden ? "MLP" : "linear", 1.0 - mse);
        float wv[MAX_COLS], bv;
        if (!hidden && dt_tensor_get(w1, wv, d) == DT_OK && dt_tensor_get(b1, &bv, 1) == DT_OK) {
            double icpt = mean[d] + sd[d] * bv;
            printf("%s =", t.names[d]);
            for (int c = 0; c < d; c++) {   /* back to the original units */
                double coef = sd[d] * wv[c] / sd[c];
                icpt -= coef * mean[c];
                printf(" %+.4f * %s", coef, t.names[c]);
            }
            printf(" %+.4f\n", icpt);
        }
    }
    dt_optim_free(opt);
    dt_tensor_free(x);
    dt_tensor_free(y);
    dt_ctx_free(ctx);
    free(xs);
    free(ys);
    free(t.v);
    return ok ? 0 : 1;
}
