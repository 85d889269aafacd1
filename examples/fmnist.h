/*
 * examples/fmnist.h - Fashion-MNIST as Debian's dataset-fashion-mnist
 * installs it, for the examples and benchmarks (the library reads IDX files
 * wherever they are: dt_dataset_load_idx; where a data set lives is the
 * program's business, not the library's).
 */
#ifndef DT_EXAMPLES_FMNIST_H
#define DT_EXAMPLES_FMNIST_H

#include "dtrain.h"

#include <stdio.h>
#include <unistd.h>

#define FMNIST_DEBIAN_DIR "/usr/share/datasets/fashion-mnist"

/* dir/<split>-<name>, the .gz file when it is there (Debian ships both ways) */
static inline void fmnist_path(char *out, size_t cap, const char *dir, const char *split,
                               const char *name)
{
    snprintf(out, cap, "%s/%s-%s.gz", dir, split, name);
    if (access(out, R_OK) != 0)
        snprintf(out, cap, "%s/%s-%s", dir, split, name);
}

/* The train (split 0, 60000 images) or test (1, 10000) split from dir
 * (NULL: Debian's directory).  NULL on failure, with dt_last_error(ctx)
 * saying why; when the files are not there, a line on stderr also says
 * which package to install.  The result is the caller's: dt_dataset_free. */
static inline dt_dataset *fmnist_load(dt_ctx *ctx, const char *dir, int split)
{
    char img[4096], lab[4096];
    const char *pre = split ? "t10k" : "train";
    if (!dir)
        dir = FMNIST_DEBIAN_DIR;
    fmnist_path(img, sizeof img, dir, pre, "images-idx3-ubyte");
    fmnist_path(lab, sizeof lab, dir, pre, "labels-idx1-ubyte");
    if (access(img, R_OK) != 0)
        fprintf(stderr, "Fashion-MNIST not found in %s (install Debian's dataset-fashion-mnist: "
                        "apt-get install dataset-fashion-mnist; or give the directory that holds "
                        "it)\n", dir);
    return dt_dataset_load_idx(ctx, img, lab);
}

#endif
