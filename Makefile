# Makefile - dtrain built the way a C library is: on any Linux where the
# dependencies are installed (OpenBLAS and zlib; libfabric and libmicrohttpd
# are compiled in when pkg-config finds them; cmocka for `make check`), as
# any user, with no package manager.  ./build.sh (README.md) is the entry
# point that also installs Debian's packages and runs the end-to-end checks.
#
#   make                          build/make/: libdtrain.a, libdtrain.so, the examples
#   make check                    the layer check and the unit suite (make -j4 check: 4 shards at once)
#   make install PREFIX=~/.local  dtrain.h, both libraries and lib/pkgconfig/dtrain.pc
#   make clean
#
# Variables: CC, CFLAGS (default -O2 -g), PREFIX (/usr/local), O (build/make),
# FABRIC=0 / HTTP=0 to leave the transport or the monitor's server out.

CC      ?= cc
CFLAGS  ?= -O2 -g
PREFIX  ?= /usr/local
O       ?= build/make
PYTHON  ?= python3

VERSION := $(shell sed -n 's/^\#define DTRAIN_VERSION_STRING "\(.*\)"$$/\1/p' dtrain.h)
MAJOR   := $(firstword $(subst ., ,$(VERSION)))
MODULES := $(shell awk '$$1 ~ /^[0-9]+$$/ { print $$2 }' src/modules.txt)

FABRIC ?= $(shell pkg-config --exists libfabric 2>/dev/null && echo 1 || echo 0)
HTTP   ?= $(shell pkg-config --exists libmicrohttpd 2>/dev/null && echo 1 || echo 0)
BLAS_CFLAGS ?= $(shell pkg-config --cflags openblas 2>/dev/null)
BLAS_LIBS   ?= $(shell pkg-config --libs openblas 2>/dev/null || echo -lopenblas)

# -ffp-contract=off and the rest: the same bits as ./build.sh's builds (its FPFLAGS)
DT_CFLAGS = -std=c11 -D_GNU_SOURCE -Wall -Wextra -pthread -fno-math-errno -ffp-contract=off -fno-trapping-math \
            $(BLAS_CFLAGS) -I.
DEFS = -DDT_WITH_CPU $(if $(filter 1,$(FABRIC)),-DDT_WITH_FABRIC) $(if $(filter 1,$(HTTP)),-DDT_WITH_HTTP)
LIBS = $(BLAS_LIBS) $(if $(filter 1,$(FABRIC)),-lfabric) $(if $(filter 1,$(HTTP)),-lmicrohttpd) \
       -lz -lm -lpthread

EXAMPLES = $(patsubst examples/%.c,$(O)/%,$(wildcard examples/*.c))
BACKENDS = backends/cpu.c $(if $(filter 1,$(FABRIC)),backends/fabric.c) \
           $(if $(filter 1,$(HTTP)),backends/http.c)
# The suite reaches internal functions: it links the modules, not dtrain.c.
DEV_OBJS = $(patsubst %,$(O)/dev/src_%.o,$(MODULES)) \
           $(patsubst backends/%.c,$(O)/dev/%.o,$(BACKENDS)) \
           $(patsubst tests/%.c,$(O)/dev/%.o,$(wildcard tests/test_*.c))
SHARDS = 0 1 2 3

all: $(O)/libdtrain.a $(O)/libdtrain.so $(EXAMPLES)

$(O)/dtrain.o: dtrain.c dtrain.h | $(O)/dev
	$(CC) $(CFLAGS) $(DT_CFLAGS) -fPIC $(DEFS) -c dtrain.c -o $@

$(O)/libdtrain.a: $(O)/dtrain.o
	rm -f $@ && ar rcs $@ $^

# only dt_ symbols leave it; the soname carries the API's major version
$(O)/libdtrain.so: $(O)/dtrain.o
	printf 'DTRAIN_%s {\n  global: dt_*;\n  local: *;\n};\n' $(MAJOR) > $(O)/dtrain.map
	$(CC) -shared -Wl,-soname,libdtrain.so.$(MAJOR) -Wl,--version-script=$(O)/dtrain.map \
	    $^ $(LIBS) -o $(O)/libdtrain.so.$(VERSION)
	ln -sf libdtrain.so.$(VERSION) $(O)/libdtrain.so.$(MAJOR)
	ln -sf libdtrain.so.$(MAJOR) $@

$(O)/%: examples/%.c examples/args.h dtrain.h $(O)/libdtrain.a
	$(CC) $(CFLAGS) $(DT_CFLAGS) $< $(O)/libdtrain.a $(LIBS) -o $@

$(O)/dev:
	mkdir -p $@

$(O)/dev/src_%.o: src/%.c src/internal.h src/dist.h dtrain.h $(wildcard backends/*.h) | $(O)/dev
	$(CC) $(CFLAGS) $(DT_CFLAGS) $(DEFS) -c $< -o $@

$(O)/dev/%.o: backends/%.c $(wildcard backends/*.h) dtrain.h | $(O)/dev
	$(CC) $(CFLAGS) $(DT_CFLAGS) $(DEFS) -c $< -o $@

$(O)/dev/%.o: tests/%.c $(wildcard tests/*.h) src/internal.h src/dist.h dtrain.h | $(O)/dev
	$(CC) $(CFLAGS) $(DT_CFLAGS) $(DEFS) -c $< -o $@

$(O)/dtrain_tests: $(DEV_OBJS)
	$(CC) $(CFLAGS) -pthread $^ $(LIBS) -lcmocka -o $@

# The suite in shards (tests/test_main.c, DT_TEST_SHARD); the profiler's
# tests time the machine, so they run last, alone.
check: check-layers check-serial

check-layers:
	$(PYTHON) tests/layers.py

check-unit-%: $(O)/dtrain_tests all
	OPENBLAS_NUM_THREADS=1 DT_TEST_EXCEPT=profile DT_TEST_SHARD=$*/$(words $(SHARDS)) \
	    $(O)/dtrain_tests > $(O)/unit-$*.log 2>&1 || { tail -40 $(O)/unit-$*.log; exit 1; }
	@echo "unit shard $*: $$(tail -1 $(O)/unit-$*.log)"

check-serial: $(patsubst %,check-unit-%,$(SHARDS))
	OPENBLAS_NUM_THREADS=1 DT_TEST_GROUPS=profile $(O)/dtrain_tests > $(O)/unit-serial.log 2>&1 || \
	    { tail -40 $(O)/unit-serial.log; exit 1; }
	@echo "unit shard serial: $$(tail -1 $(O)/unit-serial.log)"

install: $(O)/libdtrain.a $(O)/libdtrain.so
	mkdir -p $(DESTDIR)$(PREFIX)/include $(DESTDIR)$(PREFIX)/lib/pkgconfig
	cp dtrain.h $(DESTDIR)$(PREFIX)/include/
	cp $(O)/libdtrain.a $(O)/libdtrain.so.$(VERSION) $(DESTDIR)$(PREFIX)/lib/
	ln -sf libdtrain.so.$(VERSION) $(DESTDIR)$(PREFIX)/lib/libdtrain.so.$(MAJOR)
	ln -sf libdtrain.so.$(MAJOR) $(DESTDIR)$(PREFIX)/lib/libdtrain.so
	printf 'prefix=%s\nlibdir=$${prefix}/lib\nincludedir=$${prefix}/include\n\nName: dtrain\nDescription: distributed deep-learning training in C\nVersion: %s\nCflags: -I$${includedir}\nLibs: -L$${libdir} -ldtrain\nLibs.private: %s\n' \
	    '$(PREFIX)' '$(VERSION)' '$(LIBS)' > $(DESTDIR)$(PREFIX)/lib/pkgconfig/dtrain.pc

clean:
	rm -rf $(O)

.PHONY: all check check-layers check-serial install clean
.SECONDARY:
