/*
 * examples/args.h - strict numbers for the examples' getopt_long loops: the
 * whole text must be a number (no junk after it, no overflow) within the
 * range the option allows; otherwise a message naming the option goes to
 * stderr and the call returns 0.  (atoi would take "12abc" as 12 and "x"
 * as 0.)
 */
#ifndef DT_EXAMPLES_ARGS_H
#define DT_EXAMPLES_ARGS_H

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

static inline int args_long(const char *prog, const char *opt, const char *text, long lo, long hi,
                            long *out)
{
    char *end;
    errno = 0;
    long v = strtol(text, &end, 10);
    if (errno || end == text || *end || v < lo || v > hi) {
        fprintf(stderr, "%s: --%s '%s': expected a whole number in [%ld, %ld]\n", prog, opt, text,
                lo, hi);
        return 0;
    }
    *out = v;
    return 1;
}

static inline int args_int(const char *prog, const char *opt, const char *text, int lo, int hi,
                           int *out)
{
    long v;
    if (!args_long(prog, opt, text, lo, hi, &v))
        return 0;
    *out = (int)v;
    return 1;
}

static inline int args_u64(const char *prog, const char *opt, const char *text, uint64_t *out)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(text, &end, 10);
    if (errno || end == text || *end || text[0] == '-') {
        fprintf(stderr, "%s: --%s '%s': expected a whole number >= 0\n", prog, opt, text);
        return 0;
    }
    *out = (uint64_t)v;
    return 1;
}

static inline int args_double(const char *prog, const char *opt, const char *text, double lo,
                              double hi, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(text, &end);
    if (errno || end == text || *end || !(v >= lo && v <= hi)) {
        fprintf(stderr, "%s: --%s '%s': expected a number in [%g, %g]\n", prog, opt, text, lo, hi);
        return 0;
    }
    *out = v;
    return 1;
}

#endif
