# tests/checks/docs.sh - the README's and docs/API.md's promises.
# Sourced by ./build.sh (cmd_test runs these functions as checks, side by
# side); they use build.sh's variables ($BUILD, the compiler flags) and
# tests/checks/lib.sh.

# docs/API.md stays true: every DT_API function of dtrain.h has exactly one
# row there, and every ```c block compiles warning-free (whole programs and
# whole functions, each with its own includes); the programs link and run.
api_doc_checks() {
    local dir f n missing="" b ran=0
    dir=$(mktemp -d)
    for f in $(grep '^DT_API' dtrain.h | grep -o 'dt_[a-z0-9_]*(' | tr -d '(' | sort -u); do
        n=$(grep -c "^| \`$f(" docs/API.md || true)
        [ "$n" = 1 ] || missing="$missing $f($n rows)"
    done
    [ -z "$missing" ] || { echo "api doc checks: not documented once in docs/API.md:$missing"; exit 1; }
    awk -v d="$dir" '/^```c$/ { n++; f = 1; next } /^```$/ { f = 0 }
        f { print > sprintf("%s/blk_%02d.c", d, n) }' docs/API.md
    for b in "$dir"/blk_*.c; do
        if grep -q 'int main(' "$b"; then
            $CC $WARN -O1 -I. "$b" $BUILD/libdtrain.a $LIBS -o "${b%.c}" &&
                (cd "$dir" && timeout -k 5 120 "${b%.c}" > "${b%.c}.out") ||
                { echo "api doc checks: $(basename "$b") ($(head -c 300 "$b" | head -3)) failed"; exit 1; }
            ran=$((ran + 1))
        else
            $CC $WARN -fsyntax-only -I. "$b" ||
                { echo "api doc checks: $(basename "$b") does not compile"; exit 1; }
        fi
    done
    echo "api doc checks: $(ls "$dir"/blk_*.c | wc -l) examples compile, $ran programs run: ok"
    rm -rf "$dir"
}

# The README's vendoring recipe, exactly as written: its ```sh block names
# the files ("# one process: FILES", which must be dtrain.h and dtrain.c),
# and for each cc line only those files are copied into an empty directory
# with tests/embed/vendored.c as prog.c; the line must build a program that
# runs.
readme_vendoring_checks() {
    local block files="" line dir n=0
    block=$(awk '/^- \*\*Vendoring\.\*\*/ {v = 1} v && /^  ```sh$/ {f = 1; next}
                 f && /^  ```$/ {exit} f {sub(/^  /, ""); print}' README.md)
    [ -n "$block" ] || { echo "readme vendoring check: no \`\`\`sh block under Vendoring"; exit 1; }
    while IFS= read -r line; do
        case "$line" in
            "# one process: "*) files=${line#*: } ;;
            cc\ *)
                [ "$files" = "dtrain.h dtrain.c" ] ||
                    { echo "readme vendoring check: the recipe vendors '$files', not dtrain.h dtrain.c"; exit 1; }
                dir=$(mktemp -d)
                for f in $files; do cp "$f" "$dir/$f"; done
                cp tests/embed/vendored.c "$dir/prog.c"
                (cd "$dir" && eval "$line" && ./a.out) > "$dir/out" 2>&1 ||
                    { cat "$dir/out"; echo "readme vendoring check: failed: $line (files: $files)"; exit 1; }
                rm -rf "$dir"
                n=$((n + 1)) ;;
        esac
    done <<< "$block"
    [ $n = 2 ] || { echo "readme vendoring check: $n cc lines, expected 2"; exit 1; }
    echo "readme vendoring checks: both of the README's recipes build and run from $files alone"
}
