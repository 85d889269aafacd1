/*
 * tests/bench/bench_allreduce_mpi.c - MPI_Allreduce(MPI_FLOAT, MPI_SUM)
 * latency and bus bandwidth, the peer of bench_allreduce.c (same sizes,
 * same method, same output).
 *
 *   mpicc -O2 bench_allreduce_mpi.c -o bench_allreduce_mpi
 *   mpirun -np 2 --mca btl self,vader ./bench_allreduce_mpi          # shared memory
 *   mpirun -np 2 --mca btl self,tcp --mca btl_tcp_if_include lo ./bench_allreduce_mpi
 *
 *   options: [--min-time 0.5] [--min-iters 5] [--max-bytes 67108864] [--label TEXT]
 *
 * For each size every rank checks one allreduce of integer-valued data
 * exactly, warms up, then times single calls until about --min-time seconds
 * have gone (at least --min-iters); rank 0 prints the median time of one
 * call and the bus bandwidth 2 (P-1)/P * bytes / time.
 *   <bytes> <iters> <median_us> <busbw_GBps> <ok|FAIL>
 */
#include <mpi.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const size_t SIZES[] = {4u << 10, 16u << 10, 64u << 10, 256u << 10,
                               1u << 20, 4u << 20, 16u << 20, 64u << 20};
#define NSIZES (sizeof SIZES / sizeof SIZES[0])

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, size_t n)
{
    qsort(v, n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

static float input(int64_t i, int r)
{
    return (float)((i * 7 + (int64_t)r * 131) % 1024) - 512.0f;
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    int rank, P;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &P);
    int min_iters = 5;
    double min_time = 0.5;
    size_t max_bytes = (size_t)64 << 20;
    const char *label = "";
    for (int i = 1; i < argc; i++) {
        if (i + 1 < argc && !strcmp(argv[i], "--min-time"))
            min_time = atof(argv[++i]);
        else if (i + 1 < argc && !strcmp(argv[i], "--min-iters"))
            min_iters = atoi(argv[++i]);
        else if (i + 1 < argc && !strcmp(argv[i], "--max-bytes"))
            max_bytes = (size_t)strtoull(argv[++i], NULL, 10);
        else if (i + 1 < argc && !strcmp(argv[i], "--label"))
            label = argv[++i];
        else {
            if (rank == 0)
                fprintf(stderr, "usage: bench_allreduce_mpi [--min-time S] [--min-iters N] "
                                "[--max-bytes B] [--label TEXT]\n");
            MPI_Finalize();
            return 2;
        }
    }
    if (rank == 0) {
        int len;
        char lib[MPI_MAX_LIBRARY_VERSION_STRING];
        MPI_Get_library_version(lib, &len);
        char *nl = strchr(lib, '\n');
        if (nl)
            *nl = '\0';
        printf("# MPI_Allreduce(MPI_SUM, MPI_FLOAT): ranks=%d %s (%s)\n", P, label, lib);
        printf("# %10s %8s %12s %12s %s\n", "bytes", "iters", "median_us", "busbw_GBps", "check");
        fflush(stdout);
    }
    size_t cap = 0;
    for (size_t k = 0; k < NSIZES; k++)
        if (SIZES[k] <= max_bytes && SIZES[k] > cap)
            cap = SIZES[k];
    float *buf = malloc(cap ? cap : 4);
    double *times = NULL;
    size_t times_cap = 0;
    int rc = 0;
    if (!buf)
        MPI_Abort(MPI_COMM_WORLD, 1);
    for (size_t k = 0; k < NSIZES; k++) {
        size_t bytes = SIZES[k];
        if (bytes > max_bytes)
            continue;
        int n = (int)(bytes / sizeof(float));

        for (int i = 0; i < n; i++)
            buf[i] = input(i, rank);
        MPI_Allreduce(MPI_IN_PLACE, buf, n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        long bad = 0, first_bad = -1;
        for (int i = 0; i < n; i++) {
            float want = 0;
            for (int r = 0; r < P; r++)
                want += input(i, r);
            if (buf[i] != want && bad++ == 0)
                first_bad = i;
        }
        if (bad)
            fprintf(stderr, "bench_allreduce_mpi: rank %d, %zu bytes: %ld wrong elements (first at %ld)\n",
                    rank, bytes, bad, first_bad);
        int mine = bad > 0, nbad = 0;
        MPI_Allreduce(&mine, &nbad, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);

        /* warm-up (first touches, lazy connections), then as many calls
         * again timed: rank 0 picks the iteration count from those */
        int warm = bytes <= (256u << 10) ? 50 : bytes <= (4u << 20) ? 10 : 3;
        for (int i = 0; i < warm; i++)
            MPI_Allreduce(MPI_IN_PLACE, buf, n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = MPI_Wtime();
        for (int i = 0; i < warm; i++)
            MPI_Allreduce(MPI_IN_PLACE, buf, n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        double per = (MPI_Wtime() - t0) / warm;
        double iters_d = per > 0 ? min_time / per : 1e6;
        if (iters_d < min_iters)
            iters_d = min_iters;
        if (iters_d > 1e6)
            iters_d = 1e6;
        long iters = (long)iters_d;
        MPI_Bcast(&iters, 1, MPI_LONG, 0, MPI_COMM_WORLD);
        if ((size_t)iters > times_cap) {
            double *p = realloc(times, (size_t)iters * sizeof *times);
            if (!p)
                MPI_Abort(MPI_COMM_WORLD, 1);
            times = p;
            times_cap = (size_t)iters;
        }

        MPI_Barrier(MPI_COMM_WORLD);
        for (long i = 0; i < iters; i++) {
            double a = MPI_Wtime();
            MPI_Allreduce(MPI_IN_PLACE, buf, n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            times[i] = MPI_Wtime() - a;
        }
        double med = median(times, (size_t)iters);
        double busbw = 2.0 * (P - 1) / P * (double)bytes / med / 1e9;
        if (rank == 0) {
            printf("  %10zu %8ld %12.2f %12.3f %s\n", bytes, iters, med * 1e6, busbw,
                   nbad == 0 ? "ok" : "FAIL");
            fflush(stdout);
        }
        if (nbad)
            rc = 1;
    }
    free(times);
    free(buf);
    MPI_Finalize();
    return rc;
}
