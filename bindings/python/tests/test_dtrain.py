"""Tests of the Python binding (Debian's python3 + python3-numpy).

    /usr/bin/python3 bindings/python/tests/test_dtrain.py

Environment: DTRAIN_LIB (the shared library; default build/libdtrain.so), DTRUN (the
launcher; default build/dtrun), CC (to compile layout.c; default cc).  Ends with a line
"python: N passed, N failed".
"""
import gc
import inspect
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", "..", ".."))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
# A shell's background job (`cmd &` without job control) starts with SIGINT
# ignored, and Python then installs no handler of its own: install it here,
# before the library loads, so Signals tests what loading the library does.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
import dtrain as dt  # noqa: E402
from ddp_job import mlp_params  # noqa: E402

DTRUN = os.environ.get("DTRUN", os.path.join(ROOT, "build", "dtrun"))
JOB = os.path.join(HERE, "ddp_job.py")
FMNIST = "/usr/share/datasets/fashion-mnist"


def small_mlp(ctx, sizes=(6, 5, 3)):
    return mlp_params(ctx, sizes)


def mlp_forward(layers, x):
    for i, (w, b) in enumerate(layers):
        x = dt.linear(x, w, b)
        if i + 1 < len(layers):
            x = dt.relu(x)
    return x


class Signals(unittest.TestCase):
    def test_ctrl_c_still_raises_keyboard_interrupt(self):
        """Loading the library (libfabric, libinfinipath under it) leaves Python's
        SIGINT handler in place: SIGINT raises KeyboardInterrupt, it does not
        end the interpreter."""
        with self.assertRaises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            signal.sigtimedwait([], 1.0)   # let the handler run
        self.assertIs(signal.getsignal(signal.SIGINT), signal.default_int_handler)


class Layout(unittest.TestCase):
    def test_structs_match_c(self):
        """Every ctypes struct has C's field offsets and sizes and C's sizeof."""
        with tempfile.TemporaryDirectory() as d:
            exe = os.path.join(d, "layout")
            subprocess.run([os.environ.get("CC", "cc"), "-std=c11", "-I", ROOT,
                            os.path.join(HERE, "layout.c"), "-o", exe], check=True)
            lines = subprocess.run([exe], check=True, capture_output=True,
                                   text=True).stdout.split("\n")
        structs = {s.__name__: s for s in dt._STRUCTS}
        seen = set()
        for line in filter(None, lines):
            name, field, *nums = line.split()
            self.assertIn(name, structs, "layout.c prints %s, dtrain.py lacks it" % name)
            s = structs[name]
            seen.add(name)
            if field == "-":
                self.assertEqual(ctypes_sizeof(s), int(nums[0]), "sizeof(%s)" % name)
                continue
            f = getattr(s, field)
            self.assertEqual((f.offset, f.size), (int(nums[0]), int(nums[1])),
                             "%s.%s: (offset, size) differ from C's" % (name, field))
        self.assertEqual(seen, set(structs), "structs layout.c does not check")


def ctypes_sizeof(s):
    import ctypes
    return ctypes.sizeof(s)


class LibraryCheck(unittest.TestCase):
    def test_refuses_another_release_or_layout(self):
        """At import the module compares the library's version and struct sizes with its own
        (dtrain._check_library); here with a made-up library: another minor version, then one
        struct a word longer.  The real one passed at import."""
        real = dt._struct_size
        with self.assertRaisesRegex(ImportError, r"is version 0\.2\.0; this module mirrors the C API of 0\.1"):
            dt._check_library(200, real, "libfake.so")

        def longer(name):
            return real(name) + (8 if name == b"dt_ddp_config" else 0)
        with self.assertRaisesRegex(ImportError, r"libfake.so's dt_ddp_config is \d+ bytes, this module's"):
            dt._check_library(dt._version(), longer, "libfake.so")
        dt._check_library(dt._version(), real)   # the loaded library: accepted
        self.assertGreaterEqual(len(dt._MIRRORED), 19)


class Errors(unittest.TestCase):
    def test_c_message_raised(self):
        with dt.Context() as ctx:
            x = ctx.tensor((4, 3))
            w = ctx.tensor((5, 7))
            with self.assertRaises(dt.InvalidArgument) as cm:
                dt.linear(x, w)
            e = cm.exception
            self.assertIsInstance(e, ValueError)
            self.assertEqual(e.status, 1)
            self.assertIn("linear", str(e))
            self.assertIn("7", str(e))   # the C message names the shapes
            self.assertEqual(str(e), e.message)
            # the context goes on working
            y = dt.linear(x, ctx.tensor((5, 3)))
            self.assertEqual(y.shape, (4, 5))

    def test_bad_backend(self):
        with self.assertRaises(dt.Error) as cm:
            dt.Context(backend="no-such-backend")
        self.assertIn("no-such-backend", str(cm.exception))

    def test_corrupt_and_missing_checkpoint(self):
        with dt.Context(seed=3) as ctx, tempfile.TemporaryDirectory() as d:
            small_mlp(ctx)
            bad = os.path.join(d, "bad.safetensors")
            with open(bad, "wb") as f:
                f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
            before = [p.numpy(copy=True) for p in ctx.params()]
            with self.assertRaises(dt.CorruptFile) as cm:
                dt.checkpoint_load(ctx, bad)
            self.assertIn("bad.safetensors", str(cm.exception))
            for p, b in zip(ctx.params(), before):   # nothing changed
                np.testing.assert_array_equal(p.numpy(), b)
            with self.assertRaises(dt.FileError) as cm:
                dt.checkpoint_load(ctx, os.path.join(d, "missing.safetensors"))
            self.assertIsInstance(cm.exception, OSError)

    def test_settings_checked(self):
        with dt.Context() as ctx:
            with self.assertRaises(dt.InvalidArgument):
                dt.Optimizer(ctx, "adam", lr=1e-3, no_such_thing=1)
            with self.assertRaises(dt.InvalidArgument):
                dt.Optimizer(ctx, "rmsprop")
            with self.assertRaises(dt.InvalidArgument):
                ctx.tensor((2,), np.float64)


class ZeroCopy(unittest.TestCase):
    def test_from_numpy_wraps(self):
        with dt.Context() as ctx:
            a = np.arange(12, dtype=np.float32).reshape(3, 4)
            t = ctx.from_numpy(a)
            v = t.numpy()
            self.assertEqual(v.ctypes.data, a.ctypes.data)   # the same memory
            self.assertTrue(np.shares_memory(v, a))
            self.assertEqual(dt.sum(t).item(), 66.0)
            a[0, 0] = 100                                    # numpy writes, dtrain reads
            self.assertEqual(dt.sum(t).item(), 166.0)
            t.fill(2.0)                                      # dtrain writes, numpy reads
            self.assertTrue((a == 2.0).all())
            del a
            self.assertEqual(dt.sum(t).item(), 24.0)         # the tensor keeps the array

    def test_copies_when_it_must(self):
        with dt.Context() as ctx:
            a = np.arange(12, dtype=np.float64).reshape(3, 4)
            t = ctx.from_numpy(a)                            # float64: converted
            self.assertEqual(t.dtype, np.float32)
            np.testing.assert_array_equal(t.numpy(), a.astype(np.float32))
            b = np.arange(12, dtype=np.float32).reshape(3, 4).T   # not C-contiguous
            t = ctx.from_numpy(b)
            self.assertFalse(np.shares_memory(t.numpy(), b))
            np.testing.assert_array_equal(t.numpy(), b)
            c = np.arange(6, dtype=np.float32)
            t = ctx.from_numpy(c, copy=True)
            self.assertFalse(np.shares_memory(t.numpy(), c))

    def test_views_of_params_and_strides(self):
        with dt.Context(seed=1) as ctx:
            (w, b), = small_mlp(ctx, (4, 3))
            wv = w.numpy()                                   # a live view of the weights
            before = wv.copy()
            x = ctx.from_numpy(np.ones((2, 4), np.float32))
            ctx.backward(dt.mean(dt.linear(x, w, b)))
            g = w.grad.numpy(copy=True)
            opt = dt.Optimizer(ctx, "sgd", lr=0.5)
            opt.step()
            np.testing.assert_allclose(wv, before - 0.5 * g, rtol=1e-6)
            t = dt.transpose(w, 0, 1)                        # a step tensor: copied
            tv = t.numpy()
            self.assertFalse(np.shares_memory(tv, wv))
            np.testing.assert_array_equal(tv, wv.T)

    def test_retain_grad_keeps_an_intermediate(self):
        with dt.Context(seed=1) as ctx:
            (w, b), = small_mlp(ctx, (4, 3))
            x = ctx.from_numpy(np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4))
            y = dt.linear(x, w, b).retain_grad()
            z = dt.tanh(y)                                   # not retained
            ctx.backward(dt.sum(dt.mul(z, z)))
            t = np.tanh(y.numpy())
            np.testing.assert_allclose(y.grad.numpy(), 2 * t * (1 - t * t), rtol=1e-5, atol=1e-7)
            self.assertIsNone(z.grad)                        # given back, as in PyTorch
            self.assertIsNotNone(w.grad)

    def test_dataset_image_is_a_view(self):
        with dt.Context() as ctx:
            ds = dt.Dataset.fashion_mnist(ctx, "test")
            self.assertEqual(len(ds), 10000)
            img = ds.image(0)
            self.assertEqual(img.shape, (1, 28, 28))
            self.assertEqual(img.dtype, np.uint8)
            self.assertFalse(img.flags.writeable)
            self.assertTrue(0 <= ds.label(0) < ds.classes)
            with self.assertRaises(IndexError):
                ds.image(10000)


class Datasets(unittest.TestCase):
    def batches(self, ds, **cfg):
        with_ld = dt.Loader(ds.ctx, ds, **cfg)
        out = []
        for x, y in with_ld.epoch(0):
            out.append((x.numpy(copy=True), y.numpy(copy=True)))
        with_ld.close()
        return out

    def test_numpy_arrays_zero_copy(self):
        with dt.Context() as ctx:
            x = np.arange(40 * 3, dtype=np.float32).reshape(40, 3)
            y = (np.arange(40) % 4).astype(np.int64)          # NumPy's default int: converted
            ds = dt.Dataset.from_numpy(ctx, x, y)
            self.assertEqual(len(ds), 40)
            self.assertEqual(ds.classes, 4)
            x[5, 1] = -7.0                                     # read in place: seen by the loader
            got = self.batches(ds, batch=8, shuffle=True, seed=2)
            rows = np.concatenate([b[0] for b in got])
            labels = np.concatenate([b[1] for b in got])
            order = np.argsort(rows[:, 0])
            np.testing.assert_array_equal(rows[order], x)
            np.testing.assert_array_equal(labels[order], np.arange(40) % 4)
            copied = dt.Dataset.from_numpy(ctx, x, y, copy=True)
            x[5, 1] = 0.0
            first = self.batches(copied, batch=40, shuffle=False)[0][0]
            self.assertEqual(first[5, 1], -7.0)                 # the copy kept the old value

    def test_tokens_subset_and_normalize(self):
        with dt.Context() as ctx:
            text = np.frombuffer(b"hello world, hello dtrain " * 4, dtype=np.uint8)
            ds = dt.Dataset.from_tokens(ctx, text, context=8, stride=1)
            self.assertEqual(len(ds), text.size - 8)
            x, y = self.batches(ds, batch=len(ds), shuffle=False)[0]
            self.assertEqual(x.dtype, np.int32)
            np.testing.assert_array_equal(x[3], text[3:11])
            np.testing.assert_array_equal(y[3], text[4:12])
            val = ds.subset(len(ds) - 10, 10)
            self.assertEqual(len(val), 10)
            feats = np.random.default_rng(0).normal(3.0, 2.0, size=(64, 5)).astype(np.float32)
            fds = dt.Dataset.from_numpy(ctx, feats, np.zeros(64, np.int32))
            m, s = fds.stats(5)
            np.testing.assert_allclose(m, feats.mean(0), rtol=1e-5)
            np.testing.assert_allclose(s, feats.std(0), rtol=1e-4)
            fds.normalize(m, s)
            z = self.batches(fds, batch=64, shuffle=False)[0][0]
            np.testing.assert_allclose(z, (feats - m) / s, rtol=1e-5, atol=1e-6)
            with self.assertRaises(dt.InvalidArgument):
                fds.normalize([1.0, 2.0], [1.0, 1.0])          # 2 fits no axis of 5 features

    def test_csv_and_npy_files(self):
        with dt.Context() as ctx, tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "t.csv")
            with open(p, "w") as f:
                f.write("w,h,kind\n1.5,2,1\n3,4.25,0\n")
            ds = dt.Dataset.load_csv(ctx, p, target="kind")
            x, y = self.batches(ds, batch=2, shuffle=False)[0]
            np.testing.assert_array_equal(x, [[1.5, 2], [3, 4.25]])
            np.testing.assert_array_equal(y, [1, 0])
            with open(p, "w") as f:
                f.write("w,h,kind\n1.5,oops,1\n")
            with self.assertRaises(dt.CorruptFile) as cm:
                dt.Dataset.load_csv(ctx, p, target="kind")
            self.assertIn("line 2, column 2", str(cm.exception))
            # what a spreadsheet writes: a byte-order mark, no header; a constant column
            with open(p, "w", encoding="utf-8-sig") as f:
                f.write("7,1,0\n7,3,1\n")
            bds = dt.Dataset.load_csv(ctx, p)
            self.assertEqual(len(bds), 2)
            m, s = bds.stats(2)
            np.testing.assert_array_equal(m, [7, 2])
            np.testing.assert_allclose(s, [1, 1], rtol=1e-6)    # the constant one: std 1
            bds.normalize(m, s)
            x, _ = self.batches(bds, batch=2, shuffle=False)[0]
            np.testing.assert_allclose(x, [[0, -1], [0, 1]], rtol=1e-6)
            xs = np.arange(12, dtype=np.float32).reshape(4, 3)
            np.save(os.path.join(d, "x.npy"), xs)
            np.save(os.path.join(d, "y.npy"), np.array([0, 1, 1, 0]))
            nds = dt.Dataset.load_npy(ctx, os.path.join(d, "x.npy"), os.path.join(d, "y.npy"))
            x, y = self.batches(nds, batch=4, shuffle=False)[0]
            np.testing.assert_array_equal(x, xs)
            np.testing.assert_array_equal(y, [0, 1, 1, 0])


class Transformer(unittest.TestCase):
    def test_attention_layers_and_loss_against_numpy(self):
        rng = np.random.default_rng(3)
        q, k, v = (rng.standard_normal((2, 2, 5, 3)).astype(np.float32) for _ in range(3))
        with dt.Context() as ctx:
            out = dt.attention(ctx.from_numpy(q), ctx.from_numpy(k), ctx.from_numpy(v),
                               causal=True).numpy(copy=True)
            s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(3.0)
            s[..., np.triu_indices(5, 1)[0], np.triu_indices(5, 1)[1]] = -np.inf
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            np.testing.assert_allclose(out, p @ v, rtol=1e-5, atol=1e-6)
            w, b = ctx.linear_params("fc", 8, 4)
            self.assertEqual((w.shape, b.shape), ((4, 8), (4,)))
            self.assertIsNotNone(ctx.param_find("fc.bias"))
            lw, lb = ctx.layer_norm_params("ln", 8)
            np.testing.assert_array_equal(lw.numpy(), np.ones(8, np.float32))
            emb = ctx.embedding_params("wte", 16, 8)
            self.assertEqual(emb.shape, (16, 8))
            logits = rng.standard_normal((2, 3, 4)).astype(np.float32)
            labels = np.array([[1, -100, 3], [0, 2, -100]], dtype=np.int32)
            loss = dt.cross_entropy_ignore(ctx.from_numpy(logits), ctx.from_numpy(labels)).item()
            keep = labels != -100
            lg = logits[keep]
            lse = np.log(np.exp(lg - lg.max(1, keepdims=True)).sum(1)) + lg.max(1)
            want = np.mean(lse - lg[np.arange(len(lg)), labels[keep]])
            self.assertAlmostEqual(loss, float(want), places=5)
            np.testing.assert_allclose(dt.sqrt(ctx.from_numpy(np.array([4.0, 9.0],
                                       np.float32))).numpy(), [2.0, 3.0])
            a = rng.standard_normal((2, 3, 4)).astype(np.float32)
            np.testing.assert_array_equal(dt.permute(ctx.from_numpy(a), 2, 0, 1).numpy(copy=True),
                                          a.transpose(2, 0, 1))
            m = np.array([1, 0, 0, 1], np.float32)
            got = dt.masked_fill(ctx.from_numpy(a), ctx.from_numpy(m), -np.inf).numpy(copy=True)
            np.testing.assert_array_equal(got, np.where(m != 0, -np.inf, a))
            pa = np.abs(a) + 0.5
            np.testing.assert_allclose(dt.pow(ctx.from_numpy(pa), 1.5).numpy(), pa ** 1.5,
                                       rtol=1e-6)


class PublicNames(unittest.TestCase):
    def test_all_lists_every_public_name(self):
        # help(dtrain) and "from dtrain import *" show what __all__ lists: every
        # public function and class but the ctypes mirrors of C structs (dt_*)
        public = [n for n, v in vars(dt).items() if not n.startswith("_") and
                  getattr(v, "__module__", None) == dt.__name__ and
                  (inspect.isfunction(v) or inspect.isclass(v)) and not n.startswith("dt_")]
        self.assertEqual(sorted(set(public) - set(dt.__all__)), [])
        self.assertEqual(sorted(n for n in dt.__all__ if not hasattr(dt, n)), [])
        undocumented = [n for n in dt.__all__ if not inspect.getdoc(getattr(dt, n))]
        self.assertEqual(undocumented, [])


class Lifetimes(unittest.TestCase):
    def test_forgotten_step_reset(self):
        # a loop without step_reset: warned after a few passes, refused at the cap
        with dt.Context(arena_bytes=256 << 10, arena_max_bytes=8 << 20) as ctx:
            w = ctx.param("w", (64, 64))
            with self.assertRaises(dt.OutOfMemory) as cm:
                for _ in range(1000):
                    ctx.backward(dt.sum(dt.relu(dt.matmul(w, w))))
            self.assertIn("step_reset", str(cm.exception))
            self.assertIn("arena_max_bytes", str(cm.exception))
            self.assertIn("without dt_ctx_step_reset", ctx.last_warning)
            ctx.step_reset()
            ctx.backward(dt.sum(dt.relu(dt.matmul(w, w))))   # and on it goes

    def test_batch_of_a_temporary_loader(self):
        # the PyTorch idiom: the loader is gone once next() returns; its batch keeps it
        with dt.Context() as ctx:
            xs = np.arange(32, dtype=np.float32).reshape(8, 4)
            ds = dt.Dataset.from_numpy(ctx, xs, np.arange(8, dtype=np.int32))
            x, y = next(iter(dt.Loader(ctx, ds, batch=4, shuffle=False)))
            gc.collect()
            np.testing.assert_array_equal(x.numpy(), xs[:4])
            np.testing.assert_array_equal(y.numpy(), [0, 1, 2, 3])

    def test_step_tensor_after_reset(self):
        with dt.Context() as ctx:
            y = dt.relu(ctx.tensor((3,)))
            ctx.step_reset()
            with self.assertRaises(dt.BadState):
                y.numpy()
            self.assertIn("gone", repr(y))

    def test_loader_batch_after_next(self):
        with dt.Context() as ctx:
            ds = dt.Dataset.fashion_mnist(ctx, "test")
            ld = dt.Loader(ctx, ds, batch=32)
            ld.start_epoch(0)
            x, y = ld.next()
            self.assertEqual(x.shape, (32, 1, 28, 28))
            self.assertEqual(y.dtype, np.int32)
            ld.next()
            with self.assertRaises(dt.BadState):
                x.shape

    def test_activity(self):
        # what waiting peers and the monitor see (dt_ctx_set_activity, dt_ctx_activity)
        with dt.Context() as ctx:
            self.assertEqual(ctx.activity, "computing")
            ctx.set_activity("compiling\nthe model")
            self.assertRegex(ctx.activity, r"^compiling the model for \d+ s$")
            ctx.set_activity(None)
            self.assertEqual(ctx.activity, "computing")

    def test_closed_context(self):
        ctx = dt.Context()
        p = ctx.param("w", (2,))
        opt = dt.Optimizer(ctx, "sgd")
        ctx.close()
        with self.assertRaises(dt.BadState):
            p.numpy()
        with self.assertRaises(dt.BadState):
            opt.step()
        ctx.close()   # twice is fine

    # NumPy arrays never read freed memory (issue 35): a view keeps what it views,
    # everything whose memory is reused or moved is copied.  Reads go through .copy()
    # (memcpy), which ASan checks: NumPy's own loops are not instrumented
    def test_param_view_outlives_its_context(self):
        # exporting weights: a = p.numpy(), then the context ends; 64 MiB freed at once
        # gave the pages back (SIGSEGV), small ones were reused (wrong values)
        for shape in ((4096, 4096), (3, 5)):
            with dt.Context(seed=3) as ctx:
                p = ctx.param("w", shape)
                dt.init_normal(p, 0.0, 1.0)
                a = p.numpy()
                want = a.copy()
            with dt.Context(seed=4) as other:         # reuses what a freed context gave back
                q = other.param("w", shape)
                q.fill(-7.0)
                np.testing.assert_array_equal(a.copy(), want)
            np.testing.assert_array_equal(a[1:].copy(), want[1:])   # a slice of it too
            with self.assertRaises(dt.BadState):
                p.numpy()                              # the tensor itself is gone
            del a
            gc.collect()
            self.assertIsNone(ctx._zombie)             # the C context went with the view

    def test_view_of_a_freed_tensor(self):
        with dt.Context() as ctx:
            t = ctx.tensor((1000,))
            t.fill(2.5)
            a = t.numpy()
            t.free()
            ctx.step_reset()                           # where a freed tensor's memory goes
            for _ in range(4):
                ctx.tensor((1000,)).fill(9.0)
                dt.scale(ctx.tensor((1000,)), 3.0)
            ctx.step_reset()
            self.assertTrue((a.copy() == 2.5).all())

    def test_step_tensor_numpy_is_a_copy(self):
        # an accuracy over kept .numpy() arrays of step tensors read the next step's data
        with dt.Context() as ctx:
            x = ctx.from_numpy(np.arange(6, dtype=np.float32))
            y = dt.scale(x, 2.0)
            a = y.numpy()
            ctx.step_reset()
            for _ in range(3):
                dt.scale(x, -5.0)
            np.testing.assert_array_equal(a.copy(), 2.0 * np.arange(6))
            w = ctx.param("w", (2, 3))
            w.fill(1.0)
            t = dt.transpose(w, 0, 1).numpy()          # a step view of a parameter: copied
            self.assertFalse(np.shares_memory(t, w.numpy()))

    def test_batch_and_gradient_numpy_are_copies(self):
        with dt.Context() as ctx:
            xs = np.arange(32, dtype=np.float32).reshape(8, 4)
            ds = dt.Dataset.from_numpy(ctx, xs, np.arange(8, dtype=np.int32), copy=True)
            ld = dt.Loader(ctx, ds, batch=2, shuffle=False)
            ld.start_epoch(0)
            x, _ = ld.next()
            first = x.numpy()
            for _ in range(3):
                ld.next()                              # reuse the first batch's memory
            np.testing.assert_array_equal(first.copy(), xs[:2])
            w = ctx.param("w", (4,))
            ctx.backward(dt.sum(dt.scale(w, 3.0)))
            g = w.grad.numpy()
            ctx.zero_grad()
            ctx.backward(dt.sum(dt.scale(w, 5.0)))    # the next step's gradient
            np.testing.assert_array_equal(g, [3.0] * 4)

    def test_optimizer_state_after_close(self):
        with dt.Context() as ctx:
            w = ctx.param("w", (4,))
            opt = dt.Optimizer(ctx, "adam", lr=0.1)
            ctx.backward(dt.sum(dt.mul(w, w)))
            opt.step()
            state = opt.state
            m = state[0].numpy()
            opt.close()
            ctx.tensor((64,)).fill(5.0)
            self.assertFalse((m.copy() == 5.0).any())
            with self.assertRaises(dt.BadState):
                state[0].numpy()

    def test_image_view_outlives_its_dataset(self):
        ctx = dt.Context()
        ds = dt.Dataset.fashion_mnist(ctx, "test")
        img = ds.image(3)
        want = img.copy()
        ctx.close()                                    # the dataset's memory stays for img
        np.testing.assert_array_equal(img.copy(), want)
        with self.assertRaises(dt.BadState):
            ds.image(3)
        del img
        gc.collect()
        self.assertIsNone(ctx._zombie)

    def test_dataset_closed_while_borrowed(self):
        # a loader or subset reads its dataset in C: closing that dataset waits for them
        with dt.Context() as ctx:
            xs = np.arange(32, dtype=np.float32).reshape(8, 4)
            ds = dt.Dataset.from_numpy(ctx, xs, np.arange(8, dtype=np.int32), copy=True)
            ld = dt.Loader(ctx, ds, batch=4, shuffle=False)
            sub = ds.subset(4, 4)
            ds.close()
            with self.assertRaises(dt.BadState):
                len(ds)                                # closed for Python at once
            ld.start_epoch(0)
            x, _ = ld.next()
            np.testing.assert_array_equal(x.numpy(), xs[:4])
            np.testing.assert_array_equal(sub.sample(0)[0], xs[4])
            ld.close()
            self.assertIsNotNone(ds._pending)          # the subset still reads it
            sub.close()
            self.assertIsNone(ds._pending)             # freed with the last

    def test_kept_callback_arrays(self):
        kept = []

        def fill(i, x, y):
            x[:] = i
            y[...] = i
            kept.append(x)                            # kept past the call

        with dt.Context() as ctx:
            ds = dt.Dataset.from_callback(ctx, 8, fill, (3,), target_shape=())
            ld = dt.Loader(ctx, ds, batch=4, shuffle=False)
            for x, y in ld.epoch(0):
                np.testing.assert_array_equal(y.numpy(), x.numpy()[:, 0])
        got = sorted(int(a[0]) for a in kept)
        self.assertEqual(got, list(range(8)))
        self.assertTrue(all((a == a[0]).all() for a in kept))


class Training(unittest.TestCase):
    def test_gradients_match_numpy(self):
        """linear + relu + linear + mse: dtrain's gradients equal NumPy's by hand."""
        with dt.Context(seed=7) as ctx:
            layers = small_mlp(ctx)
            rng = np.random.default_rng(0)
            xa = rng.standard_normal((8, 6)).astype(np.float32)
            ta = rng.standard_normal((8, 3)).astype(np.float32)
            loss = dt.mse(mlp_forward(layers, ctx.from_numpy(xa)), ctx.from_numpy(ta))
            ctx.backward(loss)
            (w0, b0), (w1, b1) = [(w.numpy(), b.numpy()) for w, b in layers]
            h = xa @ w0.T + b0
            r = np.maximum(h, 0)
            out = r @ w1.T + b1
            self.assertAlmostEqual(loss.item(), float(((out - ta) ** 2).mean()), places=5)
            d_out = 2 * (out - ta) / out.size
            gw1, gb1 = d_out.T @ r, d_out.sum(0)
            d_h = (d_out @ w1) * (h > 0)
            gw0, gb0 = d_h.T @ xa, d_h.sum(0)
            for got, want in [(layers[1][0], gw1), (layers[1][1], gb1), (layers[0][0], gw0),
                              (layers[0][1], gb0)]:
                np.testing.assert_allclose(got.grad.numpy(), want, rtol=1e-4, atol=1e-6)

    def train_fmnist(self, seed, steps=15):
        with dt.Context(seed=seed) as ctx:
            layers = small_mlp(ctx, (784, 32, 10))
            ds = dt.Dataset.fashion_mnist(ctx, "train")
            ld = dt.Loader(ctx, ds, batch=64, seed=seed, mean=0.286, std=0.353, prefetch=1)
            opt = dt.Optimizer(ctx, "adam", lr=1e-3)
            losses = []
            for i, (x, y) in enumerate(ld.epoch(0)):
                loss = dt.cross_entropy(mlp_forward(layers, dt.flatten(x)), y)
                ctx.backward(loss)
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
                ctx.step_reset()
                if i + 1 == steps:
                    break
            return losses, [p.numpy(copy=True) for p in ctx.params()]

    def test_reproducible_and_learning(self):
        l1, p1 = self.train_fmnist(5)
        l2, p2 = self.train_fmnist(5)
        _, p3 = self.train_fmnist(6)
        self.assertEqual(l1, l2)
        for a, b in zip(p1, p2):
            np.testing.assert_array_equal(a, b)        # bit-identical
        self.assertFalse(all(np.array_equal(a, c) for a, c in zip(p1, p3)))
        self.assertLess(np.mean(l1[-5:]), l1[0] - 0.3)   # it learns

    def test_param_groups(self):
        # torch's recipe: decay on matrices, none on biases, a group lr of its own;
        # against a NumPy AdamW here, and torch.optim.AdamW where torch is installed
        xs = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
        with dt.Context(seed=3) as ctx:
            w, b = ctx.linear_params("fc", 4, 3)
            w0, b0 = w.numpy(copy=True), b.numpy(copy=True)
            opt = dt.Optimizer(ctx, "adamw", [{"params": [w]},
                                             {"params": [b], "weight_decay": 0.0, "lr": 0.05}],
                               lr=0.1, weight_decay=0.2, betas=(0.9, 0.99))
            groups = opt.param_groups
            self.assertEqual(len(groups), 2)
            self.assertEqual([p.name for p in groups[1]["params"]], ["fc.bias"])
            self.assertAlmostEqual(groups[0]["weight_decay"], 0.2, places=6)
            self.assertEqual(groups[1]["weight_decay"], 0.0)
            self.assertAlmostEqual(groups[1]["betas"][1], 0.99, places=6)
            grads = []
            for _ in range(3):
                opt.zero_grad()
                y = dt.linear(ctx.from_numpy(xs), w, b)
                ctx.backward(dt.sum(dt.mul(y, y)))
                grads.append((w.grad.numpy(), b.grad.numpy()))
                opt.step()
                ctx.step_reset()
            got = (w.numpy(copy=True), b.numpy(copy=True))
            groups[1]["lr"] = 0.01
            self.assertAlmostEqual(opt.param_groups[1]["lr"], 0.01, places=7)
            self.assertAlmostEqual(opt.param_groups[0]["lr"], 0.1, places=7)
            with self.assertRaises(dt.NotSupported):
                groups[0]["weight_decay"] = 0.0
            with self.assertRaises(dt.InvalidArgument):
                dt.Optimizer(ctx, "adamw", [{"params": [w]}, {"params": [w, b]}])
            with self.assertRaises(dt.InvalidArgument):
                dt.Optimizer(ctx, "adamw", [{"params": [w], "decay": 0.0}])

        def adamw(p, gs, lr, wd):
            m, v, p = np.zeros_like(p), np.zeros_like(p), p.astype(np.float64)
            for t, g in enumerate(gs, 1):
                p *= 1 - lr * wd
                m = 0.9 * m + 0.1 * g
                v = 0.99 * v + 0.01 * g * g
                p -= lr / (1 - 0.9 ** t) * m / (np.sqrt(v / (1 - 0.99 ** t)) + 1e-8)
            return p

        np.testing.assert_allclose(got[0], adamw(w0, [g[0] for g in grads], 0.1, 0.2),
                                   rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got[1], adamw(b0, [g[1] for g in grads], 0.05, 0.0),
                                   rtol=1e-5, atol=1e-6)
        try:
            import torch
        except ImportError:
            print("skipped: the PyTorch half (no torch here)", file=sys.stderr)
            return
        tw, tb = torch.nn.Parameter(torch.from_numpy(w0)), torch.nn.Parameter(torch.from_numpy(b0))
        topt = torch.optim.AdamW([{"params": [tw]}, {"params": [tb], "weight_decay": 0.0,
                                                       "lr": 0.05}],
                                 lr=0.1, weight_decay=0.2, betas=(0.9, 0.99))
        tx = torch.from_numpy(xs)
        for _ in range(3):
            topt.zero_grad()
            y = torch.nn.functional.linear(tx, tw, tb)
            (y * y).sum().backward()
            topt.step()
        np.testing.assert_allclose(got[0], tw.detach().numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got[1], tb.detach().numpy(), rtol=1e-5, atol=1e-6)

    def test_param_groups_checkpoint(self):
        with dt.Context(seed=3) as ctx, tempfile.TemporaryDirectory() as d:
            w, b = ctx.linear_params("fc", 4, 3)
            groups = [{"params": [w]}, {"params": [b], "weight_decay": 0.0}]
            opt = dt.Optimizer(ctx, "adamw", groups, lr=0.1)
            opt.param_groups[1]["lr"] = 0.02
            path = os.path.join(d, "g.safetensors")
            dt.checkpoint_save(ctx, path, opt, 5)
            again = dt.Optimizer(ctx, "adamw", groups, lr=0.1)
            dt.checkpoint_load(ctx, path, again)
            self.assertAlmostEqual(again.param_groups[1]["lr"], 0.02, places=7)
            with self.assertRaises(dt.Mismatch) as cm:
                dt.checkpoint_load(ctx, path, dt.Optimizer(ctx, "adamw", lr=0.1))
            self.assertIn("2 parameter groups, this one 1", str(cm.exception))

    def test_checkpoint_into_pytorch(self):
        # the binding README's snippet: no safetensors package, a strict load_state_dict
        with dt.Context(seed=3) as ctx, tempfile.TemporaryDirectory() as d:
            w, b = ctx.linear_params("fc", 4, 3)
            opt = dt.Optimizer(ctx, "adamw", lr=1e-2)
            xs = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
            ctx.backward(dt.sum(dt.linear(ctx.from_numpy(xs), w, b)))
            opt.step()
            ctx.step_reset()
            p = os.path.join(d, "model.safetensors")
            dt.checkpoint_save(ctx, p, opt, 1)
            arrays = dt.checkpoint_arrays(p)
            self.assertEqual(sorted(arrays), ["fc.bias", "fc.weight"])   # no optimizer state
            np.testing.assert_array_equal(arrays["fc.weight"], w.numpy())
            self.assertEqual(len(dt.checkpoint_arrays(p, optimizer=True)), 6)
            want = dt.linear(ctx.from_numpy(xs), w, b).numpy()
            try:
                import torch
            except ImportError:
                print("skipped: the PyTorch half (no torch here)", file=sys.stderr)
            else:
                model = torch.nn.Sequential()
                model.add_module("fc", torch.nn.Linear(4, 3))
                model.load_state_dict({k: torch.from_numpy(v)
                                       for k, v in dt.checkpoint_arrays(p).items()})
                got = model(torch.from_numpy(xs)).detach().numpy()
                np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
            raw = bytearray(open(p, "rb").read())   # a flipped data byte: refused, named
            raw[-1] ^= 0x10
            open(p, "wb").write(bytes(raw))
            with self.assertRaises(dt.CorruptFile) as cm:
                dt.checkpoint_arrays(p)
            self.assertIn("checksum", str(cm.exception))
            with self.assertRaises(dt.FileError):
                dt.checkpoint_arrays(os.path.join(d, "missing.safetensors"))

    def test_checkpoint_round_trip(self):
        with dt.Context(seed=2) as ctx, tempfile.TemporaryDirectory() as d:
            layers = small_mlp(ctx)
            opt = dt.Optimizer(ctx, "adam", lr=1e-2)
            x = ctx.from_numpy(np.ones((2, 6), np.float32))
            ctx.backward(dt.mean(mlp_forward(layers, x)))
            opt.step()
            path = os.path.join(d, "c.safetensors")
            dt.checkpoint_save(ctx, path, opt, step=42)
            saved = [p.numpy(copy=True) for p in ctx.params()]
            for p in ctx.params():
                p.fill(0.0)
            self.assertEqual(dt.checkpoint_load(ctx, path, opt), 42)
            for p, s in zip(ctx.params(), saved):
                np.testing.assert_array_equal(p.numpy(), s)

    def test_bf16_parameters_with_f32_masters(self):
        """param_dtype="bf16": the parameters hold bf16 values after every step while
        the checkpoint holds the f32 masters, which the steps moved by less than a bf16
        step; state_dtype="bf16" stores the moments in 2 bytes; bad names raise."""
        with dt.Context(seed=2) as ctx, tempfile.TemporaryDirectory() as d:
            layers = small_mlp(ctx)
            opt = dt.Optimizer(ctx, "adamw", lr=1e-5, param_dtype="bf16", state_dtype="bf16")
            x = ctx.from_numpy(np.ones((2, 6), np.float32))
            for _ in range(3):
                ctx.backward(dt.mean(mlp_forward(layers, x)))
                opt.step()
                opt.zero_grad()
                ctx.step_reset()
            bits = [p.numpy(copy=True).view(np.uint32) for p in ctx.params()]
            self.assertTrue(all(not np.any(b & 0xFFFF) for b in bits))   # bf16 values
            self.assertEqual(opt.state[0].dtype, np.uint16)   # bf16 bits
            self.assertEqual(opt.state[0].numpy().nbytes, 2 * opt.state[0].numel())
            path = os.path.join(d, "c.safetensors")
            dt.checkpoint_save(ctx, path, opt, step=3)
            with dt.Context(seed=2) as plain:
                small_mlp(plain)
                dt.checkpoint_load(plain, path)
                masters = [p.numpy(copy=True) for p in plain.params()]
            moved = [m for m, b in zip(masters, bits) if np.any(m.view(np.uint32) & 0xFFFF)]
            self.assertTrue(moved)   # f32 values, finer than bf16
            for m, b in zip(masters, bits):   # and the parameters are them rounded
                self.assertLessEqual(np.abs(m - b.view(np.float32)).max(),
                                     np.abs(m).max() / 128 + 1e-30)
            with self.assertRaises(dt.InvalidArgument):
                dt.Optimizer(ctx, "adam", param_dtype="f64")

    def test_evaluate_and_its_callback_errors(self):
        with dt.Context(seed=1) as ctx:
            layers = small_mlp(ctx, (784, 10))
            ds = dt.Dataset.fashion_mnist(ctx, "test")
            m = dt.evaluate(ctx, ds, lambda x: mlp_forward(layers, dt.flatten(x)), batch=2000)
            self.assertEqual(m.samples, 10000)
            self.assertTrue(0.0 <= m.accuracy <= 1.0 and m.loss > 0)

            # against a direct computation: the logits of all samples at once, in numpy
            # (float64); labels agree with the model on about 60% of them, and 1000 rows
            # in batches of 128 leave a partial last batch
            rng = np.random.default_rng(5)
            x = rng.standard_normal((1000, 784)).astype(np.float32)
            logits = mlp_forward(layers, ctx.from_numpy(x)).numpy().astype(np.float64)
            y = np.where(rng.random(1000) < 0.6, logits.argmax(1),
                         rng.integers(0, 10, 1000)).astype(np.int32)
            z = logits - logits.max(1, keepdims=True)
            ce = np.log(np.exp(z).sum(1)) - z[np.arange(1000), y]
            correct = int((logits.argmax(1) == y).sum())
            m = dt.evaluate(ctx, dt.Dataset.from_numpy(ctx, x.reshape(1000, 1, 28, 28), y),
                            lambda t: mlp_forward(layers, dt.flatten(t)), batch=128)
            self.assertEqual((m.samples, m.correct), (1000, correct))
            self.assertAlmostEqual(m.accuracy, correct / 1000, places=6)
            self.assertLess(abs(m.loss - ce.mean()), 1e-5 * ce.mean())

            def broken(x):
                raise KeyError("from the forward")
            with self.assertRaises(KeyError):
                dt.evaluate(ctx, ds, broken)
            self.assertTrue(ctx.grad_enabled)   # restored


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Distributed(unittest.TestCase):
    def test_model_parallel_under_the_launcher(self):
        """2 ranks under dtrun: a 2-stage pipeline (Pipe) and a 2-way tensor-parallel MLP
        (tp_linear_col/row) each end within 1e-5 of the unsplit model trained alone;
        groups and sendrecv work (parallel_job.py asserts on every rank)."""
        r = subprocess.run([DTRUN, "-n", "2", sys.executable,
                            os.path.join(HERE, "parallel_job.py")],
                           capture_output=True, text=True, timeout=240)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("rank 0: ok", r.stdout)
        self.assertIn("rank 1: ok", r.stdout)

    def test_preemption_under_the_launcher(self):
        """2 ranks under dtrun, rank 1 sent SIGTERM during step 7: both stop after step 8,
        report it, and exit 75, which dtrun passes on (preempt_job.py)."""
        r = subprocess.run([DTRUN, "-n", "2", sys.executable,
                            os.path.join(HERE, "preempt_job.py")],
                           capture_output=True, text=True, timeout=240)
        self.assertEqual(r.returncode, dt.EXIT_PREEMPTED, r.stdout + r.stderr)
        for rank in (0, 1):
            self.assertIn("rank %d: pre-empted at step 8 (SIGTERM), checkpoint saved in 0.25 s"
                          % rank, r.stdout, r.stdout + r.stderr)
        self.assertIn("pre-empted: 2 of 2 ranks", r.stderr)

    def test_ps_preemption_under_the_launcher(self):
        """A parameter-server job under dtrun -n 3 (2 workers, 1 server), worker 1 sent
        SIGTERM during step 6: the vote travels through the server, both workers stop after
        the same step, the server saves that step and serve() raises Preempted; every
        rank and dtrun exit 75 (ps_preempt_job.py)."""
        with tempfile.TemporaryDirectory() as d:
            r = subprocess.run([DTRUN, "-n", "3", sys.executable,
                                os.path.join(HERE, "ps_preempt_job.py"), d],
                               capture_output=True, text=True, timeout=240)
            out = r.stdout + r.stderr
            self.assertEqual(r.returncode, dt.EXIT_PREEMPTED, out)
            steps = {}
            for who in ("worker 0", "worker 1", "server"):
                m = re.search(r"^(\[\d\] )?%s: pre-empted at step (\d+)" % who, r.stdout, re.M)
                self.assertIsNotNone(m, out)
                steps[who] = int(m.group(2))
            self.assertEqual(len(set(steps.values())), 1, out)   # one step, everywhere
            self.assertGreaterEqual(steps["server"], 6, out)   # not before the signal
            self.assertIn("checkpoint saved in", re.search(r"server: .*$", r.stdout, re.M)
                          .group(0), out)
            self.assertTrue(os.path.exists(os.path.join(d, "ps-server-0.safetensors")), out)
            self.assertIn("pre-empted: 3 of 3 ranks", out)

    def test_ddp_under_the_launcher(self):
        """2 ranks under dtrun: DDP's parameters are the same on both ranks and equal one
        process's on the global batch (within 1e-5 relative)."""
        with tempfile.TemporaryDirectory() as d:
            r = subprocess.run([DTRUN, "-n", "2", sys.executable, JOB, "ddp", d],
                               capture_output=True, text=True, timeout=240)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            r = subprocess.run([sys.executable, JOB, "single", d], capture_output=True,
                               text=True, timeout=240)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            p0 = np.load(os.path.join(d, "rank0.npy"))
            p1 = np.load(os.path.join(d, "rank1.npy"))
            one = np.load(os.path.join(d, "single.npy"))
            init = np.load(os.path.join(d, "init.npy"))
        np.testing.assert_array_equal(p0, p1)
        self.assertGreater(np.abs(p0 - init).max(), 1e-3)   # it trained
        rel = np.abs(p0 - one).max() / np.abs(one).max()
        self.assertLess(rel, 1e-5)

    def test_zero_under_the_launcher(self):
        """DDP(zero=1, 2, 3) under dtrun equals one process on the global batch (within
        1e-5 relative); zero=3's parameters read only after full_params(); its sharded
        checkpoint of step 10 resumed in one process ends there too."""
        with tempfile.TemporaryDirectory() as d:
            r = subprocess.run([sys.executable, JOB, "single", d], capture_output=True,
                               text=True, timeout=240)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            one = np.load(os.path.join(d, "single.npy"))
            for zero in (1, 2, 3):
                r = subprocess.run([DTRUN, "-n", "2", sys.executable, JOB, "ddp", d, str(zero)],
                                   capture_output=True, text=True, timeout=240)
                self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
                p0 = np.load(os.path.join(d, "rank0.npy"))
                p1 = np.load(os.path.join(d, "rank1.npy"))
                np.testing.assert_array_equal(p0, p1)
                self.assertLess(np.abs(p0 - one).max() / np.abs(one).max(), 1e-5, zero)
                # its sharded checkpoint of step 10, resumed in one process (and consolidated)
                r = subprocess.run([sys.executable, JOB, "resume", d], capture_output=True,
                                   text=True, timeout=240)
                self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
                back = np.load(os.path.join(d, "resume.npy"))
                self.assertLess(np.abs(back - one).max() / np.abs(one).max(), 1e-5, zero)

    def test_dead_peer_raises_naming_it(self):
        """Rank 1 exits mid-job: rank 0's next step raises a dtrain error naming rank 1."""
        port = free_port()
        procs = []
        for rank in range(2):
            env = dict(os.environ, DTRAIN_RANK=str(rank), DTRAIN_WORLD_SIZE="2",
                       DTRAIN_MASTER="127.0.0.1:%d" % port, DTRAIN_TIMEOUT_MS="20000")
            procs.append(subprocess.Popen([sys.executable, JOB, "die", "-"], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True))
        outs = [p.communicate(timeout=120) for p in procs]
        self.assertEqual(procs[1].returncode, 3, outs[1])
        self.assertEqual(procs[0].returncode, 0, outs[0])
        self.assertIn("rank 1", outs[0][0])
        self.assertRegex(outs[0][0], r"raised (PeerError|Timeout)")


# --- the areas bound last, each against the same run in C (tests/reference.c) ------------

N, IN, HID, OUT = 32, 8, 16, 4
REF_X = np.array([[np.float32((7 * i + 3 * j) % 11 - 5) / np.float32(5) for j in range(IN)]
                  for i in range(N)], np.float32)
REF_Y = np.arange(N, dtype=np.int32) % OUT


def reference_results():
    """reference.c built against the library under test and run: {name: [values]}."""
    lib = dt.library_path
    with tempfile.TemporaryDirectory() as d:
        exe = os.path.join(d, "reference")
        subprocess.run([os.environ.get("CC", "cc"), "-std=c11", "-I", ROOT,
                        os.path.join(HERE, "reference.c"), lib,
                        "-Wl,-rpath," + os.path.dirname(os.path.abspath(lib)), "-o", exe],
                       check=True)
        out = subprocess.run([exe], check=True, capture_output=True, text=True).stdout
    res = {}
    for line in out.splitlines():
        name, *vals = line.split()
        res.setdefault(name, []).append([float.fromhex(v) if "0x" in v else int(v) for v in vals])
    return res


class Mlp:
    def __init__(self, ctx):
        self.l1 = ctx.linear_params("l1", IN, HID)
        self.l2 = ctx.linear_params("l2", HID, OUT)

    def hidden(self, x, w, b):
        return dt.relu(dt.linear(x, w, b))

    def __call__(self, x, recompute=False):
        h = (dt.recompute(self.hidden, x, *self.l1) if recompute else self.hidden(x, *self.l1))
        return dt.linear(h, *self.l2)


def w2_sum(t):
    s = 0.0
    for v in t.numpy().ravel():
        s += float(v)
    return s


class AgainstC(unittest.TestCase):
    """Mixed precision, loss scaling, recompute, replicas, datasets from NumPy and predict
    from Python give C's results bit for bit (the same runs in reference.c)."""

    @classmethod
    def setUpClass(cls):
        cls.ref = reference_results()

    def train(self, precision, recompute, scaled, kind, lr, steps):
        with dt.Context(seed=7) as ctx:
            m = Mlp(ctx)
            opt = dt.Optimizer(ctx, kind, lr=lr)
            sc = dt.LossScaler(ctx) if scaled else None
            x, y = ctx.from_numpy(REF_X), ctx.from_numpy(REF_Y)
            out = []
            for _ in range(steps):
                with ctx.autocast(precision):
                    loss = dt.cross_entropy(m(x, recompute), y)
                self.assertEqual(ctx.autocast_precision, "f32")
                if sc:
                    sc.backward(loss)
                    self.assertTrue(sc.step(opt))
                else:
                    ctx.backward(loss)
                    opt.step()
                out.append(loss.item())
                ctx.zero_grad()
                ctx.step_reset()
            if sc:
                out.append(sc.scale)
            return out, w2_sum(m.l2[0])

    def check(self, name, got, index):
        want = self.ref[name][0], self.ref["w2_sum"][index][0]
        self.assertEqual(got, want, "%s: Python %s, C %s" % (name, got, want))

    def test_mixed_precision(self):
        self.check("f32", self.train("f32", False, False, "adam", 1e-2, 4), 0)
        self.check("bf16", self.train("bf16", False, False, "adam", 1e-2, 4), 1)
        self.assertNotEqual(self.ref["f32"], self.ref["bf16"])   # bf16 rounding did change it

    def test_fp16_loss_scaling(self):
        self.check("fp16_scaled", self.train("fp16", False, True, "sgd", 0.1, 3), 2)

    def test_recompute(self):
        self.check("recompute", self.train("f32", True, False, "sgd", 0.1, 3), 3)

    def test_replicas(self):
        with dt.Context(seed=7) as ctx:
            dp = dt.Replicas(ctx, lambda rc, k: Mlp(rc),
                             lambda rc, m, x, y: dt.cross_entropy(m(x), y),
                             replicas=2, optim="sgd", lr=0.1, seed=7)
            self.assertEqual(len(dp), 2)
            x, y = ctx.from_numpy(REF_X), ctx.from_numpy(REF_Y)
            losses = [dp.step(x, y) for _ in range(3)]
            got = losses, w2_sum(dp.model(1).l2[0])
            self.assertEqual(dp.replica(1).params()[0].name, "l1.weight")
            dp.close()
        self.check("replicas", got, 4)

    def test_numpy_dataset_and_predict(self):
        with dt.Context(seed=7) as ctx:
            m = Mlp(ctx)
            ds = dt.Dataset.from_numpy(ctx, REF_X, REF_Y)   # zero copy: used in place
            self.assertEqual(ds.fields, (((IN,), np.dtype(np.float32)), ((), np.dtype(np.int32))))
            sx, sy = ds[5]
            np.testing.assert_array_equal(sx, REF_X[5])
            self.assertEqual(int(sy), REF_Y[5])
            loader = dt.Loader(ctx, ds, batch=8, seed=3)
            got = []
            for x, y in loader:   # the first epoch
                v, k = x.numpy().ravel(), np.float32(np.arange(8 * IN) % 5 + 1)
                s = 0.0
                for a in v * k:
                    s += float(a)
                got += [s] + [int(c) for c in y.numpy()]
            self.assertEqual(got, self.ref["batches"][0])
            opt = dt.Optimizer(ctx, "sgd", lr=0.5)
            bx, by = ctx.from_numpy(REF_X), ctx.from_numpy(REF_Y)
            for _ in range(3):
                ctx.backward(dt.cross_entropy(m(bx), by))
                opt.step()
                ctx.zero_grad()
                ctx.step_reset()
            pred = dt.predict(ctx, ds, m)
            self.assertEqual(pred.dtype, np.int32)
            self.assertEqual(pred.tolist(), self.ref["predict"][0])


class Operators(unittest.TestCase):
    def test_scalars_and_broadcasting(self):
        with dt.Context() as ctx:
            a = np.arange(6, dtype=np.float32).reshape(2, 3)
            x = ctx.from_numpy(a)
            np.testing.assert_array_equal((x + 1.5).numpy(), a + 1.5)
            np.testing.assert_array_equal((2 - x).numpy(), 2 - a)
            np.testing.assert_array_equal((x * 3).numpy(), a * 3)
            np.testing.assert_array_equal((3 * x).numpy(), a * 3)
            np.testing.assert_allclose((1 / (x + 1)).numpy(), 1 / (a + 1), rtol=1e-6)
            np.testing.assert_array_equal((x ** 2).numpy(), a ** 2)
            col = ctx.from_numpy(np.array([[10], [20]], np.float32))
            np.testing.assert_array_equal((x + col).numpy(), a + [[10], [20]])   # (2,3)+(2,1)
            with self.assertRaises(TypeError):
                x + "1"
            w = ctx.param("w", (3,))
            ctx.backward(dt.sum((w * 2.0 + 1.0) * (w - 3.0)))   # d/dw = 4w - 5 at w = 0
            np.testing.assert_array_equal(w.grad.numpy(), [-5, -5, -5])


class CustomOps(unittest.TestCase):
    def test_custom_op_gradient_and_failures(self):
        """A cube op written in NumPy: its gradient reaches the parameter; an exception in
        backward comes out of ctx.backward; no_grad records nothing."""
        with dt.Context() as ctx:
            w = ctx.param("w", (3,))
            w.copy_from(np.array([1, -2, 3], np.float32))

            def fwd(ins):
                out = ctx.temp(ins[0].shape)
                out.copy_from(ins[0].numpy() ** 3)
                return out

            def bwd(ins, out, dout):
                g = ctx.temp(ins[0].shape)
                g.copy_from(3 * ins[0].numpy() ** 2 * dout.numpy())
                return [g]

            ctx.backward(dt.sum(dt.custom_op("cube", [w], fwd, bwd)))
            np.testing.assert_array_equal(w.grad.numpy(), [3, 12, 27])
            ctx.step_reset()

            def broken(ins, out, dout):
                raise KeyError("no gradient today")
            y = dt.sum(dt.custom_op("cube", [w], fwd, broken))
            with self.assertRaises(KeyError):
                ctx.backward(y)
            ctx.step_reset()
            with ctx.no_grad():
                self.assertFalse(ctx.grad_enabled)
                self.assertFalse(dt.sum(w * 2.0).requires_grad)
            self.assertTrue(ctx.grad_enabled)


class CheckpointsEx(unittest.TestCase):
    def test_dtype_metadata_latest_and_non_strict(self):
        with tempfile.TemporaryDirectory() as d, dt.Context(seed=2) as ctx:
            layers = small_mlp(ctx)
            opt = dt.Optimizer(ctx, "adam")
            for step in (5, 9):
                dt.checkpoint_save(ctx, os.path.join(d, "s%d.safetensors" % step), opt, step,
                                  dtype="bf16", metadata={"note": "step %d" % step})
            path, step = dt.checkpoint_latest(ctx, d)
            self.assertEqual((os.path.basename(path), step), ("s9.safetensors", 9))
            self.assertEqual(dt.checkpoint_metadata(ctx, path, "note"), "step 9")
            with self.assertRaises(dt.Mismatch):
                dt.checkpoint_metadata(ctx, path, "absent")
            with tempfile.TemporaryDirectory() as empty:
                self.assertIsNone(dt.checkpoint_latest(ctx, empty))
            with dt.Context() as other:   # a model with one more layer: non-strict load
                small_mlp(other, (6, 5, 3, 2))
                rep = dt.checkpoint_load(other, path, strict=False)
                self.assertEqual((rep.step, rep.loaded, rep.missing), (9, 4, 2))
                self.assertIn("l2.weight", rep.names)
            self.assertEqual(len(layers), 2)


class MoreData(unittest.TestCase):
    def test_raw_files_callback_and_sample(self):
        with tempfile.TemporaryDirectory() as d, dt.Context() as ctx:
            x = np.arange(40, dtype=np.float32).reshape(10, 2, 2)
            y = np.arange(10, dtype=np.int32) % 3
            x.tofile(os.path.join(d, "x.bin"))
            y.tofile(os.path.join(d, "y.bin"))
            raw = dt.Dataset.load_raw(ctx, os.path.join(d, "x.bin"), (2, 2), np.float32,
                                      os.path.join(d, "y.bin"))
            self.assertEqual(len(raw), 10)
            sx, sy = raw.sample(7)
            np.testing.assert_array_equal(sx, x[7])
            self.assertEqual(int(sy), y[7])

            def fill(i, xs, ys):
                xs[...] = x[i]
                ys[...] = y[i]
            cb = dt.Dataset.from_callback(ctx, 10, fill, (2, 2))
            loader = dt.Loader(ctx, cb, batch=4, shuffle=0, prefetch=1)
            seen = [b[0].numpy().copy() for b in loader]
            np.testing.assert_array_equal(np.concatenate(seen), x)
            np.arange(100, dtype=np.uint16).tofile(os.path.join(d, "t.bin"))
            tok = dt.Dataset.load_tokens(ctx, os.path.join(d, "t.bin"), 2, context=8)
            tx, ty = tok.sample(1)
            np.testing.assert_array_equal(tx, np.arange(8, 16))
            np.testing.assert_array_equal(ty, np.arange(9, 17))
            loader.close()


class Hogwild(unittest.TestCase):
    def test_threads_fit_a_line(self):
        """4 threads step one weight vector without locks (y = x @ [1, -2, 3])."""
        rng = np.random.default_rng(0)
        xs = rng.standard_normal((64, 3)).astype(np.float32)
        ys = (xs @ np.array([1, -2, 3], np.float32)).reshape(64, 1)
        with dt.Context() as ctx:
            w = ctx.param("w", (1, 3))

            def build(tc, k):
                return tc.param("w", (1, 3))

            def loss(tc, tw, k, step):
                i = (step * 8) % 64
                x, y = tc.from_numpy(xs[i:i + 8]), tc.from_numpy(ys[i:i + 8])
                return dt.mse(dt.linear(x, tw), y)

            st = dt.hogwild(ctx, build, loss, threads=4, steps=400, lr=0.05)
            self.assertEqual(st.steps, 400)
            np.testing.assert_allclose(w.numpy(), [[1, -2, 3]], atol=0.05)


class Monitor(unittest.TestCase):
    def test_page_metrics_and_log(self):
        import urllib.request
        with dt.Context() as ctx:
            m = dt.Monitor(ctx, listen="127.0.0.1:0", interval_s=0.2)
            self.assertGreater(m.port, 0)
            m.log("loss", 3, 0.25)
            url, body = "http://127.0.0.1:%d/metrics" % m.port, ""
            for _ in range(50):   # the summary is published within an interval
                body = urllib.request.urlopen(url).read().decode()
                if 'dtrain_loss{rank="0"} 0.25' in body:
                    break
                time.sleep(0.1)
            self.assertIn('dtrain_loss{rank="0"} 0.25', body)
            m.close()
            with self.assertRaises(dt.BadState):
                m.log("loss", 4, 0.5)


class Launching(unittest.TestCase):
    def test_launch_runs_and_names_the_failed_rank(self):
        with dt.Context() as ctx:
            dt.launch(ctx, ["true"], 2)
            with self.assertRaises(dt.PeerError) as cm:
                dt.launch(ctx, ["sh", "-c", 'exit $((DTRAIN_RANK == 1 ? 3 : 0))'], 2)
            self.assertEqual(cm.exception.failed_rank, 1)


class ParameterServerJob(unittest.TestCase):
    def test_store_collectives_and_ps_under_the_launcher(self):
        """3 ranks under the launcher (tests/ps_job.py): the store, a background allreduce,
        reduce_scatter, alltoall; a BSP parameter server's dense weight and sparse rows."""
        import json
        with tempfile.TemporaryDirectory() as d:
            r = subprocess.run([DTRUN, "-n", "3", sys.executable, os.path.join(HERE, "ps_job.py"), d],
                               capture_output=True, text=True, timeout=240)
            self.assertEqual(r.returncode, 0, r.stdout[-3000:] + r.stderr[-3000:])
            seen = []
            for k in range(3):
                with open(os.path.join(d, "rank%d.json" % k)) as f:
                    seen.append(json.load(f))
        self.assertEqual(sorted(s["visits"] for s in seen), [1, 2, 3])
        for k, s in enumerate(seen):
            self.assertEqual(s["greeting"], "hello from 0")
            self.assertEqual(s["allreduce"], [6.0] * 4)
            self.assertEqual(s["reduce_scatter"], [3.0 + 6 * k, 6.0 + 6 * k])
            self.assertEqual(s["alltoall"], [k, 10.0 + k, 20.0 + k])
            self.assertEqual((s["is_server"], s["workers"], s["servers"]), (k == 2, 2, 1))
        # SGD lr 0.5 on the workers' mean gradient w - [1.5, -1.5], 3 BSP steps from 0
        w = np.zeros(2)
        for _ in range(3):
            w -= 0.5 * (w - [1.5, -1.5])
        for s in seen[:2]:
            np.testing.assert_array_equal(s["w"], w)
            self.assertEqual(s["rows"][:2], [[-2.25] * 3] * 2)   # 3 x 0.5 x mean(1, 2)
            self.assertEqual(s["rows"][2], [0.0] * 3)
        self.assertEqual(seen[2]["server_stats"]["rows_updated"], 6)


class Coverage(unittest.TestCase):
    def test_every_c_function_is_bound(self):
        """tests/coverage.py finds no unbound function, and finds one taken out."""
        import coverage as cov
        fns = cov.c_functions(os.path.join(ROOT, "dtrain.h"))
        with open(os.path.join(HERE, "..", "dtrain.py")) as f:
            text = f.read()
        self.assertEqual(cov.unbound(fns, text), [])
        self.assertGreater(len(fns), 250)
        self.assertEqual(cov.unbound(fns, text.replace("_C.ps_sparse_push(", "_C.nothing(")),
                         ["dt_ps_sparse_push"])


class Typed(unittest.TestCase):
    def test_public_api_has_docstrings_and_annotations(self):
        """Every public class, function, method and property of the module has a docstring,
        and every public function and method annotates its parameters and result."""
        import inspect
        undocumented, untyped = [], []
        for name, obj in vars(dt).items():
            if name.startswith("_") or getattr(obj, "__module__", None) != "dtrain":
                continue
            members = [(name, obj)]
            if inspect.isclass(obj):
                members += [(name + "." + k, v) for k, v in vars(obj).items()
                            if (not k.startswith("_") or k == "__init__")
                            and (inspect.isfunction(v) or isinstance(v, (property, classmethod)))]
            for n, o in members:
                fn = o.fget if isinstance(o, property) else getattr(o, "__func__", o)
                if not (o.__doc__ or n.endswith("__init__")):
                    undocumented.append(n)
                if inspect.isfunction(fn) and fn.__name__ != "<lambda>":
                    sig = inspect.signature(fn)
                    if sig.return_annotation is inspect.Signature.empty or any(
                            p.annotation is inspect.Parameter.empty
                            for p in sig.parameters.values() if p.name not in ("self", "cls")):
                        untyped.append(n)
        self.assertEqual(undocumented, [], "without a docstring")
        self.assertEqual(untyped, [], "without annotations")


if __name__ == "__main__":
    result = unittest.main(exit=False, verbosity=2).result
    failed = len(result.failures) + len(result.errors)
    print("python: %d passed, %d failed" % (result.testsRun - failed, failed))
    sys.exit(1 if failed else 0)
