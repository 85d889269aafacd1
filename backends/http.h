/*
 * backends/http.h - the HTTP server interface (private to dtrain).
 *
 * The monitor (src/monitor.c) makes every page, document and event stream;
 * a server only moves them.  It listens on one IPv4 address, takes GET and
 * HEAD requests (anything else: 405 without asking the handler), bounds a
 * request's size and the number of connections, closes idle ones, and asks
 * the handler for each request.  backends/http.c implements it on
 * libmicrohttpd; the core compiles without it and says so when asked to
 * serve.
 *
 * Threads: the server calls the handler from its own threads, several at
 * once; the handler does its own locking.  A stream (Server-Sent Events)
 * runs on its connection's thread until it ends or the server stops.
 *
 * Errors: start() returns a dt_status and writes a message into err; the
 * server never prints.
 */
#ifndef DTRAIN_HTTP_H
#define DTRAIN_HTTP_H

#include "../dtrain.h"

#include <stddef.h>

#define DT_HTTP_IFACE_VERSION 1

typedef struct dt_http_server dt_http_server;   /* an instance, opaque to the core */

/* What the handler answers.  body: a whole document of len bytes, owned
 * by the handler until free_body; or stream: an endless one (body NULL),
 * read with stream_next until it ends, then given to stream_close. */
typedef struct dt_http_reply {
    int status;               /* 200, 401, 404, ... */
    const char *type;         /* Content-Type (static text) */
    char *body;
    size_t len;
    void *stream;
} dt_http_reply;

typedef struct dt_http_handler {
    void *user;
    /* A GET (or HEAD) of path (without the query); token: the request's
     * "Authorization: Bearer" value or its ?token= argument, NULL if none. */
    void (*request)(void *user, const char *path, const char *token, dt_http_reply *out);
    void (*free_body)(void *user, char *body);
    /* The stream's next bytes into buf (at most cap): > 0 bytes, < 0 the
     * end.  May block for about a second, never return 0. */
    long (*stream_next)(void *user, void *stream, char *buf, size_t cap);
    void (*stream_close)(void *user, void *stream);
} dt_http_handler;

typedef struct dt_http_params {
    const char *host;         /* IPv4 address to bind ("127.0.0.1", "0.0.0.0") */
    int port;                 /* 0: any free port (port() says which) */
    int max_connections;      /* at once; more are refused */
    size_t max_request;       /* bytes of a request line and headers; more: an error status */
    int idle_timeout_s;       /* a connection that moves nothing this long is closed */
} dt_http_params;

typedef struct dt_http_iface {
    int version;              /* DT_HTTP_IFACE_VERSION */
    const char *name;         /* "libmicrohttpd" */
    dt_status (*start)(const dt_http_params *p, const dt_http_handler *h, dt_http_server **out,
                       char *err, size_t err_len);
    int (*port)(const dt_http_server *s);
    /* Stop listening, end the streams (the handler's stream_next must
     * return soon), wait for the server's threads, free s. */
    void (*stop)(dt_http_server *s);
} dt_http_iface;

/* backends/http.c, compiled in with -DDT_WITH_HTTP and -lmicrohttpd */
const dt_http_iface *dt_http_mhd_iface(void);

#endif
