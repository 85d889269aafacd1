/*
 * examples/gpt.c - a character-level GPT (as nanoGPT's shakespeare_char) on
 * the text of Debian's `fortunes` package.
 *
 *   build/gpt [--steps 300] [--batch 12] [--context 64] [--layers 4]
 *             [--heads 4] [--embd 128] [--lr 1e-3] [--eval-every 100]
 *             [--eval-batches 20] [--ranks N] [--threads N] [--seed S]
 *             [--save FILE] [--sample N] [--data DIR] [--backend NAME]
 *             [--optim adamw|sgd] [--save-init FILE] [--dump FILE] [--vocab N]
 *             [--seconds S] [--monitor [HOST:]PORT] [--amp bf16|fp16|tf32|off]
 *             [--zero 0|1|2|3] [--recompute 0|1] [--params bf16|fp16|f32]
 *             [--moments bf16|f32]
 *
 * Each report's ms/step is the training steps' time (evaluation left out),
 * from step 6 on once there are more than 5.  --seconds S ends training
 * once its steps (evaluation left out) have taken S seconds, then reports
 * the validation loss: what tests/bench/gpt.sh compares with PyTorch after
 * the same wall-clock budget (one process only).
 *
 * --save-init saves the initial weights, --dump appends every step's batch
 * (x then y, int32) to FILE: what tests/gpt_crosscheck.py feeds PyTorch.
 *
 * Bytes are the tokens (a 256-entry vocabulary; --vocab N makes the
 * embedding and the output N wide, as a benchmark of GPT-2's shape).  The text is split 90/10:
 * training samples are windows at random places of the first 90%, and the
 * validation loss is measured every --eval-every steps on windows of the
 * last 10%.  With --ranks N (or under any launcher) the ranks train
 * data-parallel.  At the end it saves a checkpoint (--save) and prints a
 * sample of --sample generated characters.  --monitor (or DTRAIN_MONITOR)
 * makes rank 0 serve a live page and Prometheus metrics (docs/MONITOR.md),
 * with the training loss, learning rate and validation loss.  --amp runs
 * matmul, linear and attention's products at that precision (autocast; the
 * weights and the optimizer stay f32), fp16 with dynamic loss scaling.
 * --zero shards the training state across the ranks (dt_ddp_config.zero):
 * 1 the optimizer's state, 2 also the gradients, 3 also the parameters;
 * --save PATH then makes PATH a sharded checkpoint's directory, every rank
 * writing its shard (build/consolidate PATH FILE makes it one file).
 * --params bf16 (or fp16) holds the parameters in that precision with f32
 * master weights in the optimizer (sharded with --zero), --moments bf16
 * AdamW's moments (dt_optim_config.param_dtype, state_dtype); use with
 * --amp, which rounds the activations' side of each product.
 * AdamW (lr --lr, betas 0.9/0.99, weight decay 0.1) runs in two parameter
 * groups, as nanoGPT's: the matrices decay, the biases and layer norms do
 * not (make_optim, dt_optim_new_groups).
 * --recompute 1 keeps no block's activations for backward: each block
 * runs again there (dt_recompute), trading a forward for the memory.
 * DTRAIN_PROFILE=1 profiles the run; rank 0 prints the end-of-job report.
 */
#include <dirent.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "dtrain.h"

#include "args.h"

typedef struct options {
    int steps, batch, context, layers, heads, embd, eval_every, eval_batches, ranks, threads;
    int sample, vocab, zero, recompute;
    float lr;
    double seconds;   /* > 0: a training-time budget (--seconds) */
    uint64_t seed;
    const char *save, *data, *backend, *optim, *save_init, *dump, *monitor, *amp;
    dt_dtype params, moments;   /* --params, --moments */
} options;

/* The live monitor (--monitor), when on: training logs its scalars to it. */
static dt_monitor *monitor;

typedef struct block {
    dt_tensor *ln1_w, *ln1_b, *attn_w, *attn_b, *proj_w, *proj_b;
    dt_tensor *ln2_w, *ln2_b, *fc_w, *fc_b, *fc2_w, *fc2_b;
} block;

typedef struct gpt gpt;

/* What a block needs when dt_recompute runs it again in backward (kept
 * in the model: it must outlive the step). */
typedef struct block_run {
    const gpt *m;
    int l;
    int64_t B, T;
} block_run;

struct gpt {
    int layers, heads, embd, context, vocab, recompute;
    dt_tensor *wte, *wpe, *lnf_w, *lnf_b;
    block *h;
    block_run *run;            /* one a layer */
};

/* --- the text ------------------------------------------------------------ */

/* Every plain fortune file in dir (not the .dat indexes or .u8 links),
 * in name order, concatenated. */
static char *read_fortunes(const char *dir, int64_t *len)
{
    struct dirent **names;
    int n = scandir(dir, &names, NULL, alphasort);
    if (n < 0)
        return NULL;
    char *text = NULL;
    *len = 0;
    for (int i = 0; i < n; i++) {
        const char *nm = names[i]->d_name;
        size_t l = strlen(nm);
        char path[4096];
        struct stat st;
        snprintf(path, sizeof path, "%s/%s", dir, nm);
        int plain = nm[0] != '.' && !(l > 4 && strcmp(nm + l - 4, ".dat") == 0) &&
                    !(l > 3 && strcmp(nm + l - 3, ".u8") == 0) && stat(path, &st) == 0 &&
                    S_ISREG(st.st_mode);
        FILE *f = plain ? fopen(path, "rb") : NULL;
        char *more = f ? realloc(text, (size_t)(*len + st.st_size)) : NULL;
        if (more) {
            text = more;
            *len += (int64_t)fread(text + *len, 1, (size_t)st.st_size, f);
        }
        if (f)
            fclose(f);
        free(names[i]);
    }
    free(names);
    return text;
}

/* --- the model ------------------------------------------------------------ */

/* nanoGPT's initialisation: N(0, 0.02) weights and embeddings, zero biases,
 * the residual projections N(0, 0.02/sqrt(2 layers)) */
static int gpt_init(dt_ctx *ctx, gpt *m)
{
    char nm[64];
    int C = m->embd;
    float std = 0.02f, proj_std = 0.02f / sqrtf(2.0f * (float)m->layers);
    if (!(m->wte = dt_embedding_params(ctx, "wte", m->vocab, C)) ||
        !(m->wpe = dt_embedding_params(ctx, "wpe", m->context, C)) ||
        dt_tensor_init_normal(ctx, m->wte, 0, std) != DT_OK || dt_tensor_init_normal(ctx, m->wpe, 0, std) != DT_OK)
        return 0;
    m->h = calloc((size_t)m->layers, sizeof *m->h);
    m->run = calloc((size_t)m->layers, sizeof *m->run);
    for (int l = 0; m->h && m->run && l < m->layers; l++) {
        block *b = &m->h[l];
        struct { const char *name; int in, out; dt_tensor **w, **b; float std; } lin[4] = {
            {"attn", C, 3 * C, &b->attn_w, &b->attn_b, std},
            {"proj", C, C, &b->proj_w, &b->proj_b, proj_std},
            {"fc", C, 4 * C, &b->fc_w, &b->fc_b, std},
            {"fc2", 4 * C, C, &b->fc2_w, &b->fc2_b, proj_std}};
        snprintf(nm, sizeof nm, "h.%d.ln1", l);
        if (dt_layer_norm_params(ctx, nm, C, 1, &b->ln1_w, &b->ln1_b) != DT_OK)
            return 0;
        snprintf(nm, sizeof nm, "h.%d.ln2", l);
        if (dt_layer_norm_params(ctx, nm, C, 1, &b->ln2_w, &b->ln2_b) != DT_OK)
            return 0;
        for (int k = 0; k < 4; k++) {
            snprintf(nm, sizeof nm, "h.%d.%s", l, lin[k].name);
            if (dt_linear_params(ctx, nm, lin[k].in, lin[k].out, 1, lin[k].w, lin[k].b) != DT_OK ||
                dt_tensor_init_normal(ctx, *lin[k].w, 0, lin[k].std) != DT_OK ||
                dt_tensor_fill(*lin[k].b, 0.0f) != DT_OK)
                return 0;
        }
    }
    return m->h && m->run && dt_layer_norm_params(ctx, "ln_f", C, 1, &m->lnf_w, &m->lnf_b) == DT_OK;
}

/* (B, T, C) -> (B, heads, T, C/heads), a copy laid out for attention */
static dt_tensor *heads_of(dt_ctx *ctx, const gpt *m, dt_tensor *x, int64_t B, int64_t T)
{
    int64_t shape[4] = {B, T, m->heads, m->embd / m->heads};
    return dt_contiguous(ctx, dt_transpose(ctx, dt_reshape(ctx, x, 4, shape), 1, 2));
}

static dt_tensor *attention_block(dt_ctx *ctx, const gpt *m, const block *b, dt_tensor *x,
                                  int64_t B, int64_t T)
{
    int64_t C = m->embd;
    dt_tensor *h = dt_layer_norm(ctx, x, b->ln1_w, b->ln1_b, 1e-5f);
    dt_tensor *qkv = dt_linear(ctx, h, b->attn_w, b->attn_b);   /* (B, T, 3C) */
    dt_tensor *q = heads_of(ctx, m, dt_slice(ctx, qkv, 2, 0, C), B, T);
    dt_tensor *k = heads_of(ctx, m, dt_slice(ctx, qkv, 2, C, 2 * C), B, T);
    dt_tensor *v = heads_of(ctx, m, dt_slice(ctx, qkv, 2, 2 * C, 3 * C), B, T);
    dt_tensor *y = dt_attention(ctx, q, k, v, NULL, 1, 0.0f);   /* (B, heads, T, D) */
    int64_t btc[3] = {B, T, C};
    y = dt_reshape(ctx, dt_transpose(ctx, y, 1, 2), 3, btc);
    return dt_add(ctx, x, dt_linear(ctx, y, b->proj_w, b->proj_b));
}

static dt_tensor *mlp_block(dt_ctx *ctx, const block *b, dt_tensor *x)
{
    dt_tensor *h = dt_layer_norm(ctx, x, b->ln2_w, b->ln2_b, 1e-5f);
    h = dt_gelu_tanh(ctx, dt_linear(ctx, h, b->fc_w, b->fc_b));
    return dt_add(ctx, x, dt_linear(ctx, h, b->fc2_w, b->fc2_b));
}

/* A block (a dt_segment_fn): attention, then the MLP, each with its residual. */
static dt_tensor *block_forward(dt_ctx *ctx, dt_tensor *const *in, int n, void *user)
{
    (void)n;
    const block_run *r = user;
    const block *b = &r->m->h[r->l];
    return mlp_block(ctx, b, attention_block(ctx, r->m, b, in[0], r->B, r->T));
}

/* idx (B, T) i32 -> logits (B, T, vocab) */
static dt_tensor *gpt_forward(dt_ctx *ctx, gpt *m, dt_tensor *idx)
{
    int64_t B = dt_tensor_dim(idx, 0), T = dt_tensor_dim(idx, 1);
    int32_t pos[4096];
    for (int64_t t = 0; t < T; t++)
        pos[t] = (int32_t)t;
    int64_t tshape[1] = {T};
    dt_tensor *p = dt_tensor_temp(ctx, DT_I32, 1, tshape);
    if (!p || dt_tensor_set(p, pos, T) != DT_OK)
        return NULL;
    /* (B, T, C) throughout: linear and layer_norm work over the last dim */
    dt_tensor *x = dt_add(ctx, dt_embedding(ctx, m->wte, idx), dt_embedding(ctx, m->wpe, p));
    for (int l = 0; x && l < m->layers; l++) {
        m->run[l] = (block_run){m, l, B, T};
        x = m->recompute ? dt_recompute(ctx, block_forward, &x, 1, &m->run[l])
                         : block_forward(ctx, &x, 1, &m->run[l]);
    }
    x = dt_layer_norm(ctx, x, m->lnf_w, m->lnf_b, 1e-5f);
    return dt_linear(ctx, x, m->wte, NULL);   /* tied: x wte^T, (B, T, vocab) */
}

/* --- training --------------------------------------------------------------- */

static dt_loader *make_loader(dt_ctx *ctx, const dt_dataset *ds, const options *o, int rank,
                              int ranks, int shuffle)
{
    dt_loader_config lc;
    dt_loader_config_init(&lc);
    lc.batch = o->batch;
    lc.shuffle = shuffle;
    lc.drop_last = 1;
    lc.seed = o->seed;
    lc.shard_rank = rank;
    lc.shard_count = ranks;
    lc.global_batches = ranks > 1;   /* the ranks' batches make the one-process batch */
    return dt_loader_new(ctx, ds, &lc);
}

/* The mean loss over the first n batches of the validation windows. */
static double val_loss(dt_ctx *ctx, gpt *m, dt_loader *ld, int n)
{
    dt_ctx_set_grad_enabled(ctx, 0);
    dt_loader_start_epoch(ld, 0);
    double sum = 0;
    int k = 0;
    dt_tensor *x, *y;
    while (k < n && dt_loader_next(ld, &x, &y) == DT_OK) {
        dt_tensor *loss = dt_cross_entropy(ctx, gpt_forward(ctx, m, x), y);
        if (!loss)
            break;
        sum += dt_tensor_item(loss);
        k++;
        dt_ctx_step_reset(ctx);
    }
    dt_ctx_set_grad_enabled(ctx, 1);
    return k ? sum / k : NAN;
}

/* n characters after a newline, each drawn from softmax(logits) of the
 * last position (seeded). */
static void sample(dt_ctx *ctx, gpt *m, int n, uint64_t seed)
{
    int32_t *text = malloc(sizeof *text * (size_t)(n + 1));
    int64_t V = m->vocab;   /* bytes are drawn from the first 256 */
    float *all = malloc(sizeof *all * (size_t)V * (size_t)m->context);
    uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
    int len = 1;
    if (!text || !all)
        goto done;
    text[0] = '\n';
    dt_ctx_set_grad_enabled(ctx, 0);
    for (int i = 0; i < n; i++) {
        int start = len > m->context ? len - m->context : 0, T = len - start;
        int64_t shape[2] = {1, T};
        dt_tensor *idx = dt_tensor_temp(ctx, DT_I32, 2, shape);
        dt_tensor *logits = idx && dt_tensor_set(idx, text + start, T) == DT_OK
                                ? gpt_forward(ctx, m, idx) : NULL;
        if (!logits || dt_tensor_get(logits, all, (int64_t)T * V) != DT_OK)
            break;
        const float *l = all + (size_t)(T - 1) * (size_t)V;
        double mx = -INFINITY, z = 0;
        for (int c = 0; c < 256; c++)
            mx = l[c] > mx ? l[c] : mx;
        for (int c = 0; c < 256; c++)
            z += exp(l[c] - mx);
        s ^= s << 13;   /* xorshift64 */
        s ^= s >> 7;
        s ^= s << 17;
        double u = (double)(s >> 11) / 9007199254740992.0 * z;
        int c = 0;
        while (c < 255 && (u -= exp(l[c] - mx)) > 0)
            c++;
        putchar(c);
        text[len++] = c;
        dt_ctx_step_reset(ctx);
    }
    putchar('\n');
    dt_ctx_set_grad_enabled(ctx, 1);
done:
    free(text);
    free(all);
}

/* x and y of a batch, int32, appended to f */
static int dump_batch(FILE *f, dt_tensor *x, dt_tensor *y)
{
    int64_t n = dt_tensor_numel(x);
    int32_t *buf = malloc(sizeof *buf * (size_t)n);
    int ok = buf && dt_tensor_get(x, buf, n) == DT_OK && fwrite(buf, 4, (size_t)n, f) == (size_t)n &&
             dt_tensor_get(y, buf, n) == DT_OK && fwrite(buf, 4, (size_t)n, f) == (size_t)n;
    free(buf);
    return ok;
}

static int fail(dt_ctx *ctx, const char *what)
{
    fprintf(stderr, "gpt: %s: %s\n", what, dt_last_error(ctx));
    return 0;
}

/* The step after the forward: backward, then the DDP's or the optimizer's
 * step; with a loss scaler (fp16) the gradients are reduced first, so every
 * rank skips the same overflowing steps.  0: failed (said in ctx). */
static int backward_and_step(dt_ctx *ctx, dt_tensor *loss, dt_loss_scaler *scaler, dt_ddp *ddp,
                             dt_optim *opt)
{
    if (scaler)
        return dt_loss_scaler_backward(scaler, loss) == DT_OK &&
               (!ddp || dt_ddp_sync(ddp) == DT_OK) && dt_loss_scaler_step(scaler, opt, NULL) == DT_OK;
    return dt_backward(ctx, loss) == DT_OK &&
           (ddp ? dt_ddp_step(ddp) : dt_optim_step(opt)) == DT_OK;
}

/* The optimizer in two parameter groups, as nanoGPT and torch's recipe
 * have it: weight decay on the matrices (the linears' weights and the
 * embeddings, 2-D), none on the biases and layer norms (1-D). */
static dt_optim *make_optim(dt_ctx *ctx, const dt_optim_config *oc)
{
    int n = dt_param_count(ctx), nd = 0, nn = 0;
    dt_tensor **decay = calloc((size_t)n + 1, sizeof *decay), **none = calloc((size_t)n + 1, sizeof *none);
    dt_optim *opt = NULL;
    if (decay && none) {
        for (int i = 0; i < n; i++) {
            dt_tensor *p = dt_param_at(ctx, i);
            if (dt_tensor_ndim(p) >= 2)
                decay[nd++] = p;
            else
                none[nn++] = p;
        }
        dt_param_group g[2];
        dt_param_group_init(&g[0], decay, nd);
        dt_param_group_init(&g[1], none, nn);
        g[1].weight_decay = 0.0f;
        opt = dt_optim_new_groups(ctx, oc, g, 2);
    }
    free(decay);
    free(none);
    return opt;
}

static int train(const options *o, dt_ctx *ctx, dt_comm *comm)
{
    int rank = comm ? dt_comm_rank(comm) : 0, ranks = comm ? dt_comm_size(comm) : 1;
    int64_t len;
    char *text = read_fortunes(o->data, &len);
    if (!text || len < 1000) {
        fprintf(stderr, "gpt: no text in %s (install Debian's fortunes: apt-get install "
                        "fortunes)\n", o->data);
        free(text);
        return 0;
    }
    int64_t cut = len * 9 / 10;
    dt_token_config tc;
    dt_token_config_init(&tc);
    tc.context = o->context;
    tc.stride = 1;            /* every window of the training text, shuffled */
    tc.count = cut;
    dt_dataset *train_ds = dt_dataset_from_tokens(ctx, text, len, 1, 0, &tc);
    tc.first = cut;
    tc.count = len - cut;
    tc.stride = o->context;   /* validation: windows side by side */
    dt_dataset *val_ds = dt_dataset_from_tokens(ctx, text, len, 1, 0, &tc);
    gpt m = {.layers = o->layers, .heads = o->heads, .embd = o->embd, .context = o->context,
             .vocab = o->vocab, .recompute = o->recompute};
    dt_loader *ld = NULL, *vl = NULL;
    dt_optim *opt = NULL;
    dt_ddp *ddp = NULL;
    dt_loss_scaler *scaler = NULL;
    int ok = 0;
    if (!train_ds || !val_ds || !gpt_init(ctx, &m)) {
        fail(ctx, "building the model");
        goto done;
    }
    /* mixed precision for the whole run (evaluation and sampling too, as
     * torch.autocast around them would); fp16's narrow range needs the loss
     * scaled */
    dt_precision amp = !o->amp                   ? DT_PREC_F32
                       : !strcmp(o->amp, "bf16") ? DT_PREC_BF16
                       : !strcmp(o->amp, "fp16") ? DT_PREC_F16 : DT_PREC_TF32;
    if (dt_ctx_set_autocast(ctx, amp) != DT_OK ||
        (amp == DT_PREC_F16 && !(scaler = dt_loss_scaler_new(ctx, NULL)))) {
        fail(ctx, "setting up mixed precision");
        goto done;
    }
    dt_optim_config oc;
    int sgd = o->optim && strcmp(o->optim, "sgd") == 0;
    dt_optim_config_init(&oc, sgd ? DT_SGD : DT_ADAMW);
    oc.lr = o->lr;
    oc.param_dtype = o->params;
    oc.state_dtype = o->moments;
    if (sgd) {
        oc.momentum = 0.9f;
    } else {
        oc.weight_decay = 0.1f;
        oc.beta2 = 0.99f;   /* nanoGPT's shakespeare_char */
    }
    dt_ddp_config dcfg;
    dt_ddp_config_init(&dcfg);
    dcfg.zero = o->zero;
    if (!(ld = make_loader(ctx, train_ds, o, rank, ranks, 1)) ||
        !(vl = make_loader(ctx, val_ds, o, 0, 1, 0)) || !(opt = make_optim(ctx, &oc)) ||
        (comm && !(ddp = dt_ddp_new(ctx, comm, opt, &dcfg)))) {
        fail(ctx, "setting up training");
        goto done;
    }
    if (rank == 0)
        printf("gpt: %lld bytes of fortunes (%lld train, %lld val), %d layers, %d heads, %d "
               "channels, context %d, batch %d x %d rank(s)%s, %d parameter tensors, %s backend%s%s%s%s\n",
               (long long)len, (long long)cut, (long long)(len - cut), o->layers, o->heads, o->embd,
               o->context, o->batch, ranks,
               o->zero == 1 ? " (zero 1)" : o->zero == 2 ? " (zero 2)" : o->zero ? " (zero 3)" : "",
               dt_param_count(ctx), dt_backend_name(ctx),
               o->amp ? ", autocast " : "", o->amp ? o->amp : "",
               o->params == DT_BF16 ? ", bf16 parameters (f32 masters)"
               : o->params == DT_F16 ? ", fp16 parameters (f32 masters)" : "",
               o->moments == DT_BF16 ? ", bf16 moments" : "");
    if (rank == 0 && o->save_init && dt_checkpoint_save(ctx, NULL, o->save_init, 0, NULL) != DT_OK) {
        fail(ctx, "saving the initial weights");
        goto done;
    }
    FILE *dump = rank == 0 && o->dump ? fopen(o->dump, "wb") : NULL;
    if (rank == 0 && o->dump && !dump) {
        fprintf(stderr, "gpt: cannot write %s\n", o->dump);
        goto done;
    }
    if (o->seconds > 0 && comm) {
        fprintf(stderr, "gpt: --seconds is for one process\n");
        goto done;
    }
    double t0 = dt_now(), t5 = t0, eval_s = 0, eval_all = 0;   /* ms/step leaves out evaluation */
    int64_t epoch = 0;
    int last = o->steps;
    for (int step = 1; step <= last; step++) {
        dt_tensor *x, *y;
        dt_status s = dt_loader_next(ld, &x, &y);
        if (s == DT_EOF) {
            dt_loader_start_epoch(ld, ++epoch);
            s = dt_loader_next(ld, &x, &y);
        }
        if (dump && s == DT_OK && !dump_batch(dump, x, y))
            s = DT_EIO;
        dt_tensor *loss = s == DT_OK ? dt_cross_entropy(ctx, gpt_forward(ctx, &m, x), y) : NULL;
        if (!loss || !backward_and_step(ctx, loss, scaler, ddp, opt)) {
            fail(ctx, "training");
            if (dump)
                fclose(dump);
            goto done;
        }
        float train_loss = dt_tensor_item(loss);
        if (monitor) {
            dt_monitor_log(monitor, "loss", step, train_loss);
            dt_monitor_log(monitor, "lr", step, o->lr);
        }
        dt_optim_zero_grad(opt);
        dt_ctx_step_reset(ctx);
        if (step == 5)   /* the timing starts after 5 warm-up steps */
            t5 = dt_now(), eval_s = 0;
        if (o->seconds > 0 && dt_now() - t0 - eval_all >= o->seconds)
            last = step;   /* the budget is spent: this is the last step */
        int eval_now = step % o->eval_every == 0 || step == last;
        /* zero 3: every rank evaluates the same batches, so the parameters
         * it reads are gathered together as in training; else rank 0 alone */
        if (eval_now && (rank == 0 || (o->zero == 3 && ddp))) {
            double te = dt_now();
            double ms = step > 5 ? (te - t5 - eval_s) * 1e3 / (step - 5) : (te - t0) * 1e3 / step;
            double trained_s = te - t0 - eval_all;
            double vl_loss = val_loss(ctx, &m, vl, o->eval_batches);
            if (monitor)
                dt_monitor_log(monitor, "val_loss", step, vl_loss);
            eval_s += dt_now() - te;
            eval_all += dt_now() - te;
            if (rank == 0)
                printf("step %d: train loss %.4f, val loss %.4f, %.2f ms/step\n", step,
                       train_loss, vl_loss, ms);
            if (rank == 0 && o->seconds > 0 && step == last)
                printf("budget: %d steps in %.1f s of training, val loss %.4f over %d batches\n",
                       step, trained_s, vl_loss, o->eval_batches);
        }
    }
    if (dump)
        fclose(dump);
    /* profiling (DTRAIN_PROFILE=1): every rank joins, rank 0 prints the report */
    if (dt_profile_active(ctx) && dt_profile_stop(ctx, comm, NULL) != DT_OK) {
        fail(ctx, "finishing the profile");
        goto done;
    }
    if (rank == 0 && dt_profile_report(ctx)[0])
        printf("%s", dt_profile_report(ctx));
    if (o->zero && ddp && o->save && dt_ddp_checkpoint_save(ddp, opt, o->save, o->steps) != DT_OK) {
        fail(ctx, "saving the shards");
        goto done;
    }
    if (o->zero == 3 && ddp && o->sample > 0 &&   /* rank 0 reads them alone */
        dt_ddp_full_params(ddp) != DT_OK) {
        fail(ctx, "gathering the parameters");
        goto done;
    }
    if (rank == 0) {   /* the step's memory on the backend's device (tests/bench/gpu.sh) */
        dt_mem_stats ms;
        dt_mem_stats_get(ctx, &ms);
        printf("memory: step arena peak %.1f MiB, persistent %.1f MiB (parameters, gradients, "
               "optimizer state), %s\n", ms.arena_peak / 1048576.0, ms.persistent_bytes / 1048576.0,
               dt_backend_name(ctx));
    }
    if (rank == 0 && scaler)
        printf("loss scale %g, %lld steps skipped for overflow\n",
               (double)dt_loss_scaler_scale(scaler), (long long)dt_loss_scaler_skipped(scaler));
    if (rank == 0 && o->save && !(o->zero && ddp) &&
        dt_checkpoint_save(ctx, opt, o->save, o->steps, NULL) != DT_OK) {
        fail(ctx, "saving");
        goto done;
    }
    if (rank == 0 && o->sample > 0) {
        printf("sample:\n");
        sample(ctx, &m, o->sample, o->seed);
    }
    ok = !comm || dt_comm_barrier(comm) == DT_OK;
done:
    dt_loss_scaler_free(scaler);
    dt_ddp_free(ddp);
    dt_loader_free(ld);
    dt_loader_free(vl);
    dt_dataset_free(train_ds);
    dt_dataset_free(val_ds);
    free(m.h);
    free(m.run);
    free(text);
    return ok;
}

/* --- the command line --------------------------------------------------------- */

static int parse_args(int argc, char **argv, options *o)
{
    *o = (options){.steps = 300, .batch = 12, .context = 64, .layers = 4, .heads = 4,
                   .embd = 128, .eval_every = 100, .eval_batches = 20, .ranks = 1, .threads = 1,
                   .sample = 300, .vocab = 256, .lr = 1e-3f, .seed = 1337,
                   .data = "/usr/share/games/fortunes"};
    /* the integer options: flag, target, range */
    struct { const char *name; int *v; int lo, hi; } ints[] = {
        {"steps", &o->steps, 1, 1 << 30},     {"batch", &o->batch, 1, 1 << 20},
        {"context", &o->context, 1, 1024},    {"layers", &o->layers, 1, 1024},
        {"heads", &o->heads, 1, 1024},        {"embd", &o->embd, 1, 1 << 16},
        {"eval-every", &o->eval_every, 1, 1 << 30}, {"eval-batches", &o->eval_batches, 1, 1 << 20},
        {"ranks", &o->ranks, 1, 1024},        {"threads", &o->threads, 1, 1024},
        {"sample", &o->sample, 0, 1 << 20},   {"vocab", &o->vocab, 256, 1 << 24},
        {"zero", &o->zero, 0, 3},             {"recompute", &o->recompute, 0, 1}};
    enum { NINTS = sizeof ints / sizeof ints[0] };
    static const char *const strs[] = {"lr", "seconds", "seed", "save", "data", "backend",
                                       "save-init", "dump", "optim", "monitor", "amp",
                                       "params", "moments"};
    enum { NSTRS = sizeof strs / sizeof strs[0] };
    struct option longs[NINTS + NSTRS + 2];
    for (int k = 0; k < NINTS; k++)
        longs[k] = (struct option){ints[k].name, required_argument, NULL, 1000 + k};
    for (int k = 0; k < NSTRS; k++)
        longs[NINTS + k] = (struct option){strs[k], required_argument, NULL, 2000 + k};
    longs[NINTS + NSTRS] = (struct option){"help", no_argument, NULL, 'h'};
    longs[NINTS + NSTRS + 1] = (struct option){NULL, 0, NULL, 0};
    int c;
    double d;
    opterr = 0;
    while ((c = getopt_long(argc, argv, "h", longs, NULL)) != -1) {
        if (c >= 1000 && c < 1000 + NINTS) {
            if (!args_int("gpt", ints[c - 1000].name, optarg, ints[c - 1000].lo, ints[c - 1000].hi,
                          ints[c - 1000].v))
                return 0;
            continue;
        }
        switch (c) {
        case 2000: if (!args_double("gpt", "lr", optarg, 1e-9, 10, &d)) return 0;
                   o->lr = (float)d; break;
        case 2001: if (!args_double("gpt", "seconds", optarg, 0, 1e9, &o->seconds)) return 0;
                   break;
        case 2002: if (!args_u64("gpt", "seed", optarg, &o->seed)) return 0; break;
        case 2003: o->save = optarg; break;
        case 2004: o->data = optarg; break;
        case 2005: o->backend = optarg; break;
        case 2006: o->save_init = optarg; break;
        case 2007: o->dump = optarg; break;
        case 2008:
            if (strcmp(optarg, "adamw") != 0 && strcmp(optarg, "sgd") != 0) {
                fprintf(stderr, "gpt: --optim '%s': expected adamw or sgd\n", optarg);
                return 0;
            }
            o->optim = optarg;
            break;
        case 2009: o->monitor = optarg; break;
        case 2010:
            if (strcmp(optarg, "bf16") && strcmp(optarg, "fp16") && strcmp(optarg, "tf32") &&
                strcmp(optarg, "off")) {
                fprintf(stderr, "gpt: --amp '%s': expected bf16, fp16, tf32 or off\n", optarg);
                return 0;
            }
            o->amp = strcmp(optarg, "off") ? optarg : NULL;
            break;
        case 2011:
        case 2012:
            if (strcmp(optarg, "bf16") && strcmp(optarg, "f32") && (c == 2012 || strcmp(optarg, "fp16"))) {
                fprintf(stderr, "gpt: --%s '%s': expected bf16, %sf32\n", strs[c - 2000], optarg,
                        c == 2011 ? "fp16 or " : "");
                return 0;
            }
            *(c == 2011 ? &o->params : &o->moments) = !strcmp(optarg, "bf16") ? DT_BF16
                                                      : !strcmp(optarg, "fp16") ? DT_F16 : DT_F32;
            break;
        case 'h':
            printf("usage: see the comment at the top of examples/gpt.c\n");
            exit(0);
        default:
            fprintf(stderr, "gpt: unknown option or missing value: '%s' (see the comment at the "
                            "top of examples/gpt.c)\n", argv[optind - 1]);
            return 0;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "gpt: unexpected argument '%s'\n", argv[optind]);
        return 0;
    }
    if (o->embd % o->heads != 0 || (o->seconds > 0 && o->ranks > 1)) {
        fprintf(stderr, "gpt: embd must be a multiple of heads, and --seconds is for one rank\n");
        return 0;
    }
    return 1;
}

static int run_rank(const options *o)
{
    dt_ctx_config cfg;
    dt_ctx_config_init(&cfg);
    cfg.threads = o->threads;
    cfg.seed = o->seed;
    if (o->backend)
        cfg.backend = o->backend;
    dt_ctx *ctx = dt_ctx_new(&cfg);
    if (!ctx || dt_ctx_status(ctx) != DT_OK) {
        fprintf(stderr, "gpt: %s\n", ctx ? dt_last_error(ctx) : "out of memory");
        dt_ctx_free(ctx);
        return 0;
    }
    dt_dist_env env;
    dt_comm *comm = NULL;
    int ok = dt_dist_env_detect(ctx, &env) == DT_OK || fail(ctx, "reading the launcher's environment");
    if (ok && env.world_size > 1 && !(comm = dt_comm_new(ctx, &env, NULL)))
        ok = fail(ctx, "joining the job");
    if (ok && (o->monitor || getenv("DTRAIN_MONITOR"))) {
        dt_monitor_config mc;
        dt_monitor_config_init(&mc);
        mc.listen = o->monitor;
        if (!(monitor = dt_monitor_new(ctx, comm, &mc)))
            ok = fail(ctx, "starting the monitor");
        else if (dt_monitor_port(monitor) >= 0)
            printf("monitor: http://127.0.0.1:%d/ (metrics at /metrics)\n", dt_monitor_port(monitor));
        fflush(stdout);
    }
    if (ok)
        ok = train(o, ctx, comm);
    dt_monitor_free(monitor);
    monitor = NULL;
    dt_comm_free(comm);
    dt_ctx_free(ctx);
    return ok;
}

int main(int argc, char **argv)
{
    options o;
    if (!parse_args(argc, argv, &o))
        return 2;
    if (o.ranks > 1 && !getenv("DTRAIN_RANK")) {
        dt_ctx *sup = dt_ctx_new(NULL);
        dt_spawn_config sc;
        dt_spawn_config_init(&sc);
        sc.nranks = o.ranks;
        sc.prefix_output = 0;
        int rank = -1;
        dt_status st = sup ? dt_spawn(sup, &sc, &rank) : DT_ENOMEM;
        if (st == DT_OK && rank >= 0) {
            dt_ctx_free(sup);
            return run_rank(&o) ? 0 : 1;
        }
        if (st != DT_OK)
            fprintf(stderr, "gpt: %s\n", sup ? dt_last_error(sup) : "out of memory");
        dt_ctx_free(sup);
        return st == DT_OK ? 0 : 1;
    }
    return run_rank(&o) ? 0 : 1;
}
