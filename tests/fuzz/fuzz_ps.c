/*
 * tests/fuzz/fuzz_ps.c - what the parameter server believes of a peer's
 * bytes: worker 0's model layout (ps_plan, src/ps.c), a worker's request
 * header on a server (ps_check_request, src/ps_server.c) and a server's
 * answer header on a worker (ps_answer_check, src/ps.c).  The first byte
 * picks which; the server's layout for the headers is a fixed model of
 * three parameters and two sparse tables, split over 1-4 servers.
 * Checked, not only run: an accepted layout tiles its keys in range; an
 * accepted request (a pull: one the server answers) names only keys and
 * rows this server holds, in at most
 * PS_MAX_PIECES pieces; an accepted answer is well formed; every refusal
 * leaves a non-empty message.  It includes dtrain.c to reach the internal
 * functions.
 */
#include "../../dtrain.c"

#include <stdlib.h>

static void fz_quiet(void *user, const char *msg) { (void)user; (void)msg; }

static dt_ctx *fz_ps_ctx(void)
{
    static dt_ctx *ctx;
    if (!ctx) {
        dt_ctx_config cfg;
        dt_ctx_config_init(&cfg);
        cfg.threads = 1;
        if (!(ctx = dt_ctx_new(&cfg)) || dt_ctx_status(ctx) != DT_OK)
            abort();
        dt_ctx_set_log(ctx, fz_quiet, NULL);
    }
    dt_clear_error(ctx);
    return ctx;
}

typedef struct fz_ps {
    dt_ps ps;
    dt_comm comm;
    ps_peer peers[4];
} fz_ps;

static void fz_ps_init(fz_ps *f, int servers, int shard)
{
    memset(f, 0, sizeof *f);
    f->ps.ctx = fz_ps_ctx();
    f->ps.comm = &f->comm;
    f->comm.max_msg = 1 << 20;
    f->ps.W = 4;
    f->ps.S = f->ps.L = servers;
    f->ps.shard = f->ps.server = shard;
    f->ps.peers = f->peers;
}

static void fz_ps_clear(fz_ps *f)
{
    dt_ctx *ctx = f->ps.ctx;
    for (int t = 0; f->ps.tabs && t < f->ps.ntables; t++)
        host_free(ctx, f->ps.tabs[t].name);
    host_free(ctx, f->ps.numel);
    host_free(ctx, f->ps.offset);
    host_free(ctx, f->ps.range);
    host_free(ctx, f->ps.tabs);
}

static void refused(const fz_ps *f, dt_status s)
{
    if (s == DT_OK || f->ps.ctx->last_status != s || !dt_last_error(f->ps.ctx)[0])
        abort();
}

static void fuzz_layout(const uint8_t *data, size_t size)
{
    fz_ps f;
    fz_ps_init(&f, 1 + data[0] % 4, 0);
    char *text = malloc(size);
    if (!text)
        abort();
    memcpy(text, data + 1, size - 1);
    text[size - 1] = '\0';
    dt_status s = ps_plan(&f.ps, text);
    if (s != DT_OK) {
        refused(&f, s);
    } else {   /* offsets tile [0, G) in reverse order; ranges split it in order */
        int64_t off = 0;
        for (int i = f.ps.nparams - 1; i >= 0; i--) {
            if (f.ps.offset[i] != off || f.ps.numel[i] < 0)
                abort();
            off += f.ps.numel[i];
        }
        if (off != f.ps.G || f.ps.G > PS_MAX_KEYS || f.ps.range[0] != 0 || f.ps.range[f.ps.L] != f.ps.G)
            abort();
        for (int t = 0; t < f.ps.ntables; t++)
            if (f.ps.tabs[t].rows < 1 || f.ps.tabs[t].dim < 1 || !isfinite(f.ps.tabs[t].scale))
                abort();
    }
    free(text);
    fz_ps_clear(&f);
}

static const char fz_layout[] = "dtrain-ps 3 2 %d 0 0\nfc.weight 1000\nfc.bias 10\nout.weight 5000\n"
                                "100 16 0x1p-3 7 emb\n1000000 64 0x1p-4 9 big\n";

static void fuzz_request(const uint8_t *data, size_t size)
{
    fz_ps f;
    int servers = 1 + data[1] % 4;
    fz_ps_init(&f, servers, data[2] % servers);
    char text[sizeof fz_layout + 8];
    snprintf(text, sizeof text, fz_layout, servers);
    if (ps_plan(&f.ps, text) != DT_OK)
        abort();
    for (int t = 0; t < f.ps.ntables; t++)   /* rows i * S + shard */
        f.ps.tabs[t].count = (f.ps.tabs[t].rows - f.ps.shard + servers - 1) / servers;
    int w = data[3] % 4;
    f.peers[w].clock = (data[4] & 1) ? -1 : 5;
    ps_msg h;
    size_t len = size - 8;
    memset(&h, 0, sizeof h);
    memcpy(&h, data + 8, len < sizeof h ? len : sizeof h);
    if (data[4] & 2) {   /* mostly well-framed: the fields past the framing get reached */
        h.magic = PS_MAGIC;
        h.seq = f.peers[w].seq;
        h.op = PS_INIT + data[5] % (PS_CPUSH - PS_INIT + 1);
        h.chunk = (uint32_t)PS_MIN_CHUNK << (data[6] % 15);
        len = sizeof h;
    }
    dt_status s = ps_check_request(&f.ps, w, &h, len);
    if (s != DT_OK) {
        refused(&f, s);
    } else if (h.op == PS_SPUSH || h.op == PS_SPULL) {
        if (h.lo < 0 || h.lo >= f.ps.ntables || h.n < 1 || h.n > f.ps.tabs[h.lo].count)
            abort();
    } else if (h.op == PS_PULL) {   /* answered (not refused) only for this server's keys */
        int flags;
        __int128 lo = f.ps.range[f.ps.shard], hi = f.ps.range[f.ps.shard + 1], end = (__int128)h.lo + h.n;
        if (ps_dense_in_range(&f.ps, &h, &flags) && !flags && (h.n < 0 || h.lo < lo || end > hi))
            abort();
    } else if (h.op == PS_PUSH || h.op == PS_INIT || h.op == PS_CPUSH) {
        __int128 lo = f.ps.range[f.ps.shard], hi = f.ps.range[f.ps.shard + 1], end = (__int128)h.lo + h.n;
        int flags = h.op != PS_CPUSH && h.lo >= f.ps.G;
        if (h.n < 0 || (flags ? end > f.ps.G + f.ps.P : h.lo < lo || end > hi))
            abort();
    }
    if (s == DT_OK && ps_pieces(ps_request_bytes(&f.ps, &h), h.chunk) > PS_MAX_PIECES)
        abort();
    fz_ps_clear(&f);
}

static void fuzz_answer(const uint8_t *data, size_t size)
{
    ps_msg in;
    memset(&in, 0, sizeof in);
    memcpy(&in, data, size < sizeof in ? size : sizeof in);
    dt_work w;
    memset(&w, 0, sizeof w);
    dt_status s = ps_answer_check(&w, &in);
    if (s != w.status || memchr(in.err, '\0', sizeof in.err) == NULL)
        abort();
    if (s == DT_OK ? in.magic != PS_MAGIC || in.status != DT_OK
                   : s < DT_EINVAL || s > DT_EPEER || !w.msg[0])
        abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 2 || size > 65536)
        return 0;
    switch (data[0] % 3) {
    case 0: fuzz_layout(data + 1, size - 1); break;
    case 1: if (size >= 8) fuzz_request(data, size); break;
    default: fuzz_answer(data + 1, size - 1); break;
    }
    return 0;
}
