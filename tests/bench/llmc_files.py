#!/usr/bin/env python3
"""tests/bench/llmc_files.py INIT.safetensors TEXT_DIR OUT_DIR LAYERS HEADS MAXT
- the files llm.c's train_gpt2.c reads, from examples/gpt.c's initial weights
(--save-init) and the fortunes text, for tests/bench/gpt.sh:
  OUT_DIR/gpt2_124M.bin   header (magic 20240326, version 3, maxT, V, L, NH, C,
                          padded V) and the parameters in llm.c's order, the
                          vocabulary padded to a multiple of 128 with zero rows
  OUT_DIR/dev/data/tinyshakespeare/tiny_shakespeare_{train,val}.bin
                          header (magic 20240520, version 1, n) and the text's
                          bytes as uint16 tokens, split 90/10 as gpt.c does
The file names are the ones llm.c's main opens."""
import json
import os
import struct
import sys

import numpy as np


def load(path):
    b = open(path, "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    h = json.loads(b[8:8 + n].decode("utf-8"))
    h.pop("__metadata__", None)
    return {k: np.frombuffer(b[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]],
                             "<f4").reshape(v["shape"]) for k, v in h.items()}


def main():
    init, text_dir, out, L, H, maxT = sys.argv[1], sys.argv[2], sys.argv[3], *map(int, sys.argv[4:])
    w = load(init)
    V, C = w["wte.weight"].shape
    Vp = (V + 127) // 128 * 128
    wte = np.zeros((Vp, C), np.float32)
    wte[:V] = w["wte.weight"]
    wpe = np.zeros((maxT, C), np.float32)
    wpe[:w["wpe.weight"].shape[0]] = w["wpe.weight"]
    per = lambda name: np.stack([w["h.%d.%s" % (l, name)] for l in range(L)])
    order = [wte, wpe, per("ln1.weight"), per("ln1.bias"), per("attn.weight"), per("attn.bias"),
             per("proj.weight"), per("proj.bias"), per("ln2.weight"), per("ln2.bias"),
             per("fc.weight"), per("fc.bias"), per("fc2.weight"), per("fc2.bias"),
             w["ln_f.weight"], w["ln_f.bias"]]
    os.makedirs(os.path.join(out, "dev/data/tinyshakespeare"), exist_ok=True)
    with open(os.path.join(out, "gpt2_124M.bin"), "wb") as f:
        hdr = np.zeros(256, np.int32)
        hdr[:8] = [20240326, 3, maxT, V, L, H, C, Vp]
        f.write(hdr.tobytes())
        for a in order:
            f.write(np.ascontiguousarray(a, np.float32).tobytes())
    parts = [np.fromfile(os.path.join(text_dir, n), np.uint8) for n in sorted(os.listdir(text_dir))
             if not n.startswith(".") and not n.endswith((".dat", ".u8"))
             and os.path.isfile(os.path.join(text_dir, n))]
    text = np.concatenate(parts).astype(np.uint16)
    cut = text.size * 9 // 10
    for name, toks in (("train", text[:cut]), ("val", text[cut:])):
        with open(os.path.join(out, "dev/data/tinyshakespeare/tiny_shakespeare_%s.bin" % name),
                  "wb") as f:
            hdr = np.zeros(256, np.int32)
            hdr[:3] = [20240520, 1, toks.size]
            f.write(hdr.tobytes())
            f.write(toks.tobytes())


if __name__ == "__main__":
    main()
