/*
 * tests/test_main.c - runs every test group in order and prints the
 * totals on the last line, exactly "N passed, N failed".  Exits non-zero
 * when any test failed.
 *
 * Each group exports dt_test_<group>() (runs it, returns its failure
 * count) and dt_test_<group>_count() (its number of tests; test_util.h's
 * DT_TEST_GROUP defines both).  A filter (DT_TEST_GROUPS, DT_TEST_ONLY)
 * that selects no test at all is an error: a typo must not pass as green.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int dt_test_skipped = 0; /* incremented by TU_SKIP in the groups */

#define GROUP(g) int dt_test_##g(void); int dt_test_##g##_count(void);
GROUP(cpu_kernels)
GROUP(core_forward)
GROUP(core_grad)
GROUP(core_optim)
GROUP(core_ckpt)
GROUP(core_data)
GROUP(core_dataset)
GROUP(core_errors)
GROUP(core_memory)
GROUP(core_backend)
GROUP(core_amp)
GROUP(core_dist)
GROUP(core_launch)
GROUP(comm)
GROUP(transport)
GROUP(ddp)
GROUP(cuda)
GROUP(profile)
GROUP(parallel)
#undef GROUP

typedef struct group {
    const char *name;
    int (*run)(void);
    int (*count)(void);
} group;

/* name is one of the comma-separated list's words */
static int group_listed(const char *list, const char *name)
{
    size_t len = strlen(name);
    for (const char *p = strstr(list, name); p; p = strstr(p + 1, name))
        if ((p == list || p[-1] == ',') && (p[len] == ',' || p[len] == '\0'))
            return 1;
    return 0;
}

int main(void)
{
    /* line-buffered, so the summary survives a sanitizer abort at exit */
    setvbuf(stdout, NULL, _IOLBF, 0);
    const group groups[] = {
#define G(g) {#g, dt_test_##g, dt_test_##g##_count},
        G(cpu_kernels) G(core_forward) G(core_grad) G(core_optim) G(core_ckpt) G(core_data) G(core_dataset) G(core_errors)
        G(core_memory) G(core_backend) G(core_amp) G(core_dist) G(core_launch) G(comm)
        G(transport) G(ddp) G(profile) G(parallel) G(cuda)
#undef G
    };
    int total = 0, failed = 0;
    /* DT_TEST_GROUPS=comm,transport runs only those (while developing);
     * DT_TEST_EXCEPT=profile all but those (build.sh runs the groups that
     * measure the machine alone, after the shards) */
    const char *only = getenv("DT_TEST_GROUPS"), *except = getenv("DT_TEST_EXCEPT");
    for (size_t i = 0; i < sizeof groups / sizeof groups[0]; i++) {
        if (only && *only && !group_listed(only, groups[i].name))
            continue;
        if (except && *except && group_listed(except, groups[i].name))
            continue;
        int f = groups[i].run();
        failed += f;
        total += groups[i].count();
    }
    int skipped = dt_test_skipped;
    if (skipped) fprintf(stdout, "%d skipped\n", skipped);
    if (total == 0) {
        fprintf(stdout, "no test matched DT_TEST_GROUPS='%s' DT_TEST_ONLY='%s'\n",
                only ? only : "", getenv("DT_TEST_ONLY") ? getenv("DT_TEST_ONLY") : "");
        failed = 1;
    }
    fprintf(stdout, "%d passed, %d failed\n", total - failed - skipped > 0 ? total - failed - skipped : 0,
            failed);
    fflush(stdout);
    return failed ? 1 : 0;
}
