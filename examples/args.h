/*
 * examples/args.h - strict numbers for the examples' getopt_long loops: the
 * whole text must be a number (no junk after it, no overflow) within the
 * range the option allows; otherwise a message naming the option goes to
 * stderr and the call returns 0.  (atoi would take "12abc" as 12 and "x"
 * as 0.)  Below them, args_parse: a whole command line from a table of
 * options, so that every example refuses a malformed one the same way.
 */
#ifndef DT_EXAMPLES_ARGS_H
#define DT_EXAMPLES_ARGS_H

#include <errno.h>
#include <getopt.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

/*
 * The examples' command lines as tables: one row an option, parsed by
 * getopt_long (so "--opt=V", "--opt V" and unambiguous prefixes all work)
 * into the row's variable with the checks above.  Each example then keeps
 * only its rows and the checks that involve several options.
 */
typedef enum args_kind {
    ARGS_K_FLAG,     /* no value: the int becomes 1 */
    ARGS_K_INT,      /* an int in [lo, hi] */
    ARGS_K_LLONG,    /* a long long in [lo, hi] */
    ARGS_K_U64,      /* an unsigned long long (seeds: any) */
    ARGS_K_RATE,     /* a float in (lo, hi]: learning rates, where lo (0) would do nothing */
    ARGS_K_STR,      /* any text (paths, addresses the library checks) */
    ARGS_K_CHOICE,   /* one of the words of `choices`, "a|b|c" */
} args_kind;

typedef struct args_opt {
    const char *name;      /* the long name, without "--" */
    int key;               /* its short letter, or 0 */
    args_kind kind;
    void *v;               /* where the value goes: int, long long, ..., const char * */
    double lo, hi;         /* the numbers' range */
    const char *choices;   /* ARGS_K_CHOICE's words */
} args_opt;

/* The rows.  `1 ? (p) : (T *)0` makes the compiler check that p points to
 * what the kind writes (a mismatch is a warning, so an error here). */
#define ARG_FLAG(name, p) {name, 0, ARGS_K_FLAG, 1 ? (p) : (int *)0, 0, 0, NULL}
#define ARG_INT(name, p, lo, hi) {name, 0, ARGS_K_INT, 1 ? (p) : (int *)0, lo, hi, NULL}
#define ARG_LLONG(name, p, lo, hi) {name, 0, ARGS_K_LLONG, 1 ? (p) : (long long *)0, lo, hi, NULL}
#define ARG_U64(name, p) {name, 0, ARGS_K_U64, 1 ? (p) : (unsigned long long *)0, 0, 0, NULL}
#define ARG_RATE(name, p, hi) {name, 0, ARGS_K_RATE, 1 ? (p) : (float *)0, 0, hi, NULL}
#define ARG_STR(name, p) {name, 0, ARGS_K_STR, 1 ? (p) : (const char **)0, 0, 0, NULL}
#define ARG_CHOICE(name, p, words) {name, 0, ARGS_K_CHOICE, 1 ? (p) : (const char **)0, 0, 0, words}

enum {
    ARGS_MAX = 48,     /* rows a table may have */
    ARGS_VAL0 = 256,   /* getopt_long's value for row k: ARGS_VAL0 + k (no letter's) */
};

/* What to do with operands (the arguments that are not options). */
typedef enum args_operands {
    ARGS_NO_OPERANDS,   /* there must be none */
    ARGS_OPERANDS,      /* the caller takes them; options may come after them too */
    ARGS_STOP,          /* options end at the first operand: a launcher's program and
                           its arguments stay as they are, in their order */
} args_operands;

static inline int args_rate(const char *prog, const char *opt, const char *text, double lo,
                            double hi, float *out)
{
    char *end;
    errno = 0;
    double v = strtod(text, &end);
    if (errno || end == text || *end || !(v > lo && v <= hi)) {
        fprintf(stderr, "%s: --%s '%s': expected a number in (%g, %g]\n", prog, opt, text, lo, hi);
        return 0;
    }
    *out = (float)v;
    return 1;
}

/* text is one of the '|'-separated words of choices. */
static inline int args_choice(const char *prog, const char *opt, const char *text,
                              const char *choices, const char **out)
{
    size_t n = strlen(text);
    for (const char *w = choices; n && !strchr(text, '|');) {
        if (strncmp(w, text, n) == 0 && (w[n] == '|' || w[n] == '\0')) {
            *out = text;
            return 1;
        }
        if (!(w = strchr(w, '|')))
            break;
        w++;
    }
    fprintf(stderr, "%s: --%s '%s': expected one of %s\n", prog, opt, text, choices);
    return 0;
}

/* The value of one option into its row's variable; 0 after a message. */
static inline int args_set(const char *prog, const args_opt *o, const char *text)
{
    long l;
    uint64_t u;
    switch (o->kind) {
    case ARGS_K_FLAG: *(int *)o->v = 1; return 1;
    case ARGS_K_INT:
    case ARGS_K_LLONG:
        if (!args_long(prog, o->name, text, (long)o->lo, (long)o->hi, &l))
            return 0;
        if (o->kind == ARGS_K_INT)
            *(int *)o->v = (int)l;
        else
            *(long long *)o->v = l;
        return 1;
    case ARGS_K_U64:
        if (!args_u64(prog, o->name, text, &u))
            return 0;
        *(unsigned long long *)o->v = u;
        return 1;
    case ARGS_K_RATE: return args_rate(prog, o->name, text, o->lo, o->hi, (float *)o->v);
    case ARGS_K_STR: *(const char **)o->v = text; return 1;
    case ARGS_K_CHOICE: return args_choice(prog, o->name, text, o->choices, (const char **)o->v);
    }
    return 0;
}

/* The row getopt_long's value c stands for (a row's value or its letter). */
static inline const args_opt *args_row(const args_opt *opts, int n, int c)
{
    if (c >= ARGS_VAL0 && c < ARGS_VAL0 + n)
        return &opts[c - ARGS_VAL0];
    for (int k = 0; c && k < n; k++)
        if (opts[k].key == c)
            return &opts[k];
    return NULL;
}

/* getopt_long said '?': name what was wrong (optopt: the row, 0 when unknown). */
static inline int args_refuse(const char *prog, const args_opt *opts, int n, const char *arg)
{
    const args_opt *o = args_row(opts, n, optopt);
    if (!o)
        fprintf(stderr, "%s: unknown or ambiguous option '%s' (see --help)\n", prog, arg);
    else if (o->kind == ARGS_K_FLAG)
        fprintf(stderr, "%s: --%s takes no value\n", prog, o->name);
    else
        fprintf(stderr, "%s: --%s needs a value (see --help)\n", prog, o->name);
    return -1;
}

/* getopt_long's tables for the rows, --help and -h; 0 when too many rows. */
static inline int args_tables(const args_opt *opts, int n, args_operands mode,
                              struct option *longs, char *shorts)
{
    if (n > ARGS_MAX)
        return 0;
    char *s = shorts;
    if (mode == ARGS_STOP)
        *s++ = '+';
    *s++ = 'h';
    for (int k = 0; k < n; k++) {
        int has = opts[k].kind == ARGS_K_FLAG ? no_argument : required_argument;
        longs[k] = (struct option){opts[k].name, has, NULL, ARGS_VAL0 + k};
        if (opts[k].key) {
            *s++ = (char)opts[k].key;
            if (has == required_argument)
                *s++ = ':';
        }
    }
    *s = '\0';
    longs[n] = (struct option){"help", no_argument, NULL, 'h'};
    longs[n + 1] = (struct option){NULL, 0, NULL, 0};
    return 1;
}

/*
 * Parse argv by the table: each value into its row's variable, --help (or
 * -h) prints usage to stdout and exits 0.  Returns the index in argv of
 * the first operand (argc when none), or -1 after a message on stderr that
 * names the option (the caller then exits 2).
 */
static inline int args_parse(const char *prog, int argc, char **argv, const args_opt *opts, int n,
                             args_operands mode, void (*usage)(FILE *))
{
    struct option longs[ARGS_MAX + 2];
    char shorts[2 * ARGS_MAX + 3];
    if (!args_tables(opts, n, mode, longs, shorts)) {
        fprintf(stderr, "%s: %d options, more than args.h's %d\n", prog, n, ARGS_MAX);
        return -1;
    }
    int c;
    opterr = 0;   /* the messages below name the option; getopt's would not say the range */
    while ((c = getopt_long(argc, argv, shorts, longs, NULL)) != -1) {
        if (c == 'h') {
            usage(stdout);
            exit(0);
        }
        const args_opt *o = c == '?' || c == ':' ? NULL : args_row(opts, n, c);
        if (!o)
            return args_refuse(prog, opts, n, argv[optind - 1]);
        if (!args_set(prog, o, optarg))
            return -1;
    }
    if (mode == ARGS_NO_OPERANDS && optind < argc) {
        fprintf(stderr, "%s: unexpected argument '%s' (see --help)\n", prog, argv[optind]);
        return -1;
    }
    return optind;
}

#endif
