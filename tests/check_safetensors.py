#!/usr/bin/env python3
# tests/check_safetensors.py FILE - read a dtrain checkpoint the way the
# safetensors library does (Debian 12 ships no python3-safetensors, so this
# follows the format's spec, and what the Rust crate validates):
# u64 LE header size, UTF-8 JSON, tensors contiguous and in order covering the
# whole byte buffer, metadata values strings.
import json, struct, sys, numpy as np
b = open(sys.argv[1], 'rb').read()
n = struct.unpack('<Q', b[:8])[0]
h = json.loads(b[8:8+n].decode('utf-8'))
meta = h.pop('__metadata__', {})
assert all(isinstance(v, str) for v in meta.values()), meta
buf = b[8+n:]
spans = sorted((v['data_offsets'][0], v['data_offsets'][1], k) for k, v in h.items())
pos = 0
for s, e, k in spans:
    assert s == pos, (k, s, pos); pos = e
assert pos == len(buf), (pos, len(buf))
for k, v in h.items():
    s, e = v['data_offsets']
    a = np.frombuffer(buf[s:e], dtype='<f4').reshape(v['shape'])
    assert v['dtype'] == 'F32' and np.isfinite(a).all()
print(len(h), 'tensors ok; metadata', meta)
