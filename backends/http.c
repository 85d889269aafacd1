/*
 * backends/http.c - the HTTP server interface (backends/http.h) on
 * libmicrohttpd: one thread per connection (a Server-Sent Events stream
 * may then block in its reader), a connection limit, a per-connection
 * memory limit (a request whose line and headers do not fit gets an error
 * status from the library), an idle timeout, GET and HEAD only.  The
 * library's own error log is off: nothing is printed.
 */
#include "http.h"

#include <microhttpd.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct dt_http_server {
    struct MHD_Daemon *d;
    dt_http_handler h;
    int port;
};

/* A stream's state for the library's reader. */
typedef struct http_stream {
    dt_http_server *s;
    void *stream;
} http_stream;

static ssize_t http_read(void *cls, uint64_t pos, char *buf, size_t max)
{
    (void)pos;
    http_stream *st = cls;
    long n = st->s->h.stream_next(st->s->h.user, st->stream, buf, max);
    return n > 0 ? (ssize_t)n : MHD_CONTENT_READER_END_OF_STREAM;
}

static void http_stream_free(void *cls)
{
    http_stream *st = cls;
    st->s->h.stream_close(st->s->h.user, st->stream);
    free(st);
}

static enum MHD_Result http_queue(struct MHD_Connection *conn, unsigned status, const char *type,
                                  struct MHD_Response *r)
{
    if (!r)
        return MHD_NO;
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, type);
    MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-store");
    MHD_add_response_header(r, "X-Content-Type-Options", "nosniff");
    enum MHD_Result ret = MHD_queue_response(conn, status, r);
    MHD_destroy_response(r);
    return ret;
}

static enum MHD_Result http_text(struct MHD_Connection *conn, unsigned status, const char *text)
{
    return http_queue(conn, status, "text/plain; charset=utf-8",
                      MHD_create_response_from_buffer(strlen(text), (void *)text,
                                                      MHD_RESPMEM_PERSISTENT));
}

/* "Authorization: Bearer T" or ?token=T */
static const char *http_token(struct MHD_Connection *conn)
{
    const char *a = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    if (a && strncmp(a, "Bearer ", 7) == 0)
        return a + 7;
    return MHD_lookup_connection_value(conn, MHD_GET_ARGUMENT_KIND, "token");
}

static enum MHD_Result http_answer(void *cls, struct MHD_Connection *conn, const char *url,
                                   const char *method, const char *version, const char *upload,
                                   size_t *upload_size, void **state)
{
    (void)version;
    (void)upload;
    dt_http_server *s = cls;
    if (*state == NULL) {   /* the headers are in; a body, if any, would come next */
        *state = s;
        if (strcmp(method, MHD_HTTP_METHOD_GET) != 0 && strcmp(method, MHD_HTTP_METHOD_HEAD) != 0)
            return http_text(conn, MHD_HTTP_METHOD_NOT_ALLOWED, "read-only: GET and HEAD only\n");
        return MHD_YES;
    }
    if (*upload_size != 0)   /* a GET with a body: refused, not read */
        return http_text(conn, MHD_HTTP_BAD_REQUEST, "a GET has no body\n");
    dt_http_reply rep = {0};
    s->h.request(s->h.user, url, http_token(conn), &rep);
    if (rep.stream) {
        http_stream *st = malloc(sizeof *st);
        if (!st) {
            s->h.stream_close(s->h.user, rep.stream);
            return http_text(conn, MHD_HTTP_SERVICE_UNAVAILABLE, "out of memory\n");
        }
        st->s = s;
        st->stream = rep.stream;
        struct MHD_Response *r =
            MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, http_read, st, http_stream_free);
        if (!r) {
            http_stream_free(st);
            return MHD_NO;
        }
        return http_queue(conn, (unsigned)rep.status, rep.type, r);
    }
    struct MHD_Response *r =
        MHD_create_response_from_buffer(rep.len, rep.body ? rep.body : (void *)"",
                                        MHD_RESPMEM_MUST_COPY);
    s->h.free_body(s->h.user, rep.body);
    return http_queue(conn, (unsigned)rep.status, rep.type ? rep.type : "text/plain", r);
}

static void http_quiet(void *cls, const char *fmt, va_list ap)
{
    (void)cls;
    (void)fmt;
    (void)ap;
}

static dt_status http_start(const dt_http_params *p, const dt_http_handler *h, dt_http_server **out,
                            char *err, size_t err_len)
{
    struct sockaddr_in addr;
    memset(&addr, 0, sizeof addr);
    addr.sin_family = AF_INET;
    addr.sin_port = htons((uint16_t)p->port);
    if (inet_pton(AF_INET, p->host, &addr.sin_addr) != 1) {
        snprintf(err, err_len, "'%s' is not an IPv4 address", p->host);
        return DT_EINVAL;
    }
    dt_http_server *s = calloc(1, sizeof *s);
    if (!s) {
        snprintf(err, err_len, "out of memory");
        return DT_ENOMEM;
    }
    s->h = *h;
    s->d = MHD_start_daemon(MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_THREAD_PER_CONNECTION |
                                MHD_USE_POLL | MHD_USE_ITC,
                            (uint16_t)p->port, NULL, NULL, http_answer, s,
                            MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&addr,
                            MHD_OPTION_CONNECTION_LIMIT, (unsigned)p->max_connections,
                            MHD_OPTION_PER_IP_CONNECTION_LIMIT, (unsigned)p->max_connections,
                            MHD_OPTION_CONNECTION_MEMORY_LIMIT, p->max_request,
                            MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)p->idle_timeout_s,
                            MHD_OPTION_EXTERNAL_LOGGER, http_quiet, NULL,
                            MHD_OPTION_END);
    if (!s->d) {
        snprintf(err, err_len, "cannot listen on %s:%d (in use, or not an address of this host?)",
                 p->host, p->port);
        free(s);
        return DT_EIO;
    }
    const union MHD_DaemonInfo *info = MHD_get_daemon_info(s->d, MHD_DAEMON_INFO_BIND_PORT);
    s->port = info ? info->port : p->port;
    *out = s;
    return DT_OK;
}

static int http_port(const dt_http_server *s) { return s ? s->port : -1; }

static void http_stop(dt_http_server *s)
{
    if (!s)
        return;
    MHD_stop_daemon(s->d);
    free(s);
}

static const dt_http_iface http_iface = {DT_HTTP_IFACE_VERSION, "libmicrohttpd", http_start,
                                         http_port, http_stop};

const dt_http_iface *dt_http_mhd_iface(void) { return &http_iface; }
