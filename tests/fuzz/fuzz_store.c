/*
 * tests/fuzz/fuzz_store.c - the rendezvous store's server (src/store.c) on
 * any bytes from one client: the frames are parsed as the server's thread
 * parses a connection's (sv_readable, sv_frame), here on a socketpair and
 * on this thread.  The first byte chooses whether a good HELLO goes first
 * (so most inputs reach the requests behind it).  The server's state is new
 * for every input.  It includes dtrain.c to reach the server's functions.
 */
#include "../../dtrain.c"

#include <stdlib.h>

#include <sys/socket.h>

static void *fz_malloc(size_t n, void *u) { (void)u; return malloc(n); }
static void *fz_realloc(void *p, size_t n, void *u) { (void)u; return realloc(p, n); }
static void fz_free(void *p, void *u) { (void)u; free(p); }

static const char fz_token[] = "fuzz-token";

/* A HELLO from rank 1 with the job's token, framed. */
static size_t good_hello(unsigned char *out)
{
    size_t tl = sizeof fz_token - 1, n = 15 + tl;
    put_u32(out, (uint32_t)n);
    unsigned char *r = out + 4;
    r[0] = OP_HELLO;
    put_u16(r + 1, DT_STORE_MAGIC);
    put_u16(r + 3, DT_STORE_VERSION);
    put_u32(r + 5, 1);
    put_u16(r + 9, (uint32_t)tl);
    memcpy(r + 11, fz_token, tl);
    put_u32(r + 11 + tl, 0);   /* incarnation */
    return 4 + n;
}

static void drain(int fd)
{
    unsigned char sink[4096];
    while (recv(fd, sink, sizeof sink, MSG_DONTWAIT) > 0) {
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1 || size > 65536)
        return 0;
    int sp[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sp) != 0)
        abort();
    store_server *sv = calloc(1, sizeof *sv);
    sv->al = (dt_allocator){fz_malloc, fz_realloc, fz_free, NULL};
    sv->listen_fd = -1;
    sv->stop_pipe[0] = sv->stop_pipe[1] = -1;
    sv->world = 4;
    memcpy(sv->token, fz_token, sizeof fz_token);
    sv->token_len = sizeof fz_token - 1;
    sv->cl = calloc(1, sizeof *sv->cl);
    sv->cap_cl = sv->ncl = 1;
    sv->cl[0].fd = sp[0];
    unsigned char hello[64];
    if (data[0] & 1) {
        size_t hl = good_hello(hello);
        if (send(sp[1], hello, hl, 0) != (ssize_t)hl)
            abort();
    }
    size_t off = 1;
    while (off < size) {   /* in pieces the socket takes, parsed as they come */
        ssize_t k = send(sp[1], data + off, size - off, MSG_DONTWAIT);
        if (k > 0)
            off += (size_t)k;
        if (sv->cl[0].fd < 0 || sv_readable(sv, &sv->cl[0]) < 0)
            break;
        drain(sp[1]);
    }
    for (int i = 0; i < 4 && sv->cl[0].fd >= 0; i++) {
        if (sv_readable(sv, &sv->cl[0]) < 0)
            break;
        drain(sp[1]);
    }
    sv_serve_waiters(sv);
    if (sv->cl[0].fd >= 0) {
        close(sv->cl[0].fd);   /* the client goes: a death if it said hello */
        sv->cl[0].fd = -1;
    }
    sv_drop_closed(sv);
    store_server_free(sv);
    close(sp[1]);
    return 0;
}
