# tests/checks/makefile.sh - the Makefile as a non-root user.
# Sourced by ./build.sh (cmd_test runs these functions as checks, side by
# side); they use build.sh's variables ($BUILD, the compiler flags) and
# tests/checks/lib.sh.

# The Makefile, as a user who is not root runs it (nobody, when this runs as
# root): `make` on a copy of the tree builds the libraries and every
# example, `make install` a prefix, and a program built against it with
# pkg-config runs.  (`make check` is the unit suite this build already runs
# under the sanitizers.)
makefile_checks() {
    local dir as="" who
    dir=$(mktemp -d) who=$(id -un)
    mkdir "$dir/tree"
    cp -r Makefile dtrain.h dtrain.c src backends examples tests "$dir/tree/"
    if [ "$(id -u)" = 0 ]; then
        chown -R nobody "$dir" && as="setpriv --reuid=nobody --regid=nogroup --clear-groups --" who=nobody
    fi
    (cd "$dir/tree" && $as env HOME="$dir" make -j"$(nproc)" all > "$dir/make.log" 2>&1 &&
        $as make install PREFIX="$dir/prefix" >> "$dir/make.log" 2>&1 &&
        $as env PKG_CONFIG_PATH="$dir/prefix/lib/pkgconfig" sh -c \
            "cc tests/embed/vendored.c \$(pkg-config --cflags --libs dtrain) -o $dir/v_make &&
             LD_LIBRARY_PATH=$dir/prefix/lib $dir/v_make" >> "$dir/make.log" 2>&1) ||
        { tail -20 "$dir/make.log"; echo "makefile check: make, make install or the program failed"; exit 1; }
    echo "makefile checks: make ($(ls "$dir/tree/build/make" | grep -cv '\.\|^dev$') programs and the libraries)" \
         "and make install as $who; $(tail -1 "$dir/make.log")"
    rm -rf "$dir"
}
