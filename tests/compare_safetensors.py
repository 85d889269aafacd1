#!/usr/bin/env python3
"""tests/compare_safetensors.py A B TOL - the same tensors in two dtrain
checkpoints, each value within TOL (absolute, plus TOL relative to its
size): the parameters, and the optimizer's state when both hold it (then
the same state).  Prints the largest difference; exits 1 when one is off."""
import json, struct, sys
import numpy as np


def load(path):
    b = open(path, 'rb').read()
    n = struct.unpack('<Q', b[:8])[0]
    h = json.loads(b[8:8 + n].decode('utf-8'))
    h.pop('__metadata__', None)
    buf = b[8 + n:]
    return {k: np.frombuffer(buf[v['data_offsets'][0]:v['data_offsets'][1]], '<f4')
            for k, v in h.items() if v['dtype'] == 'F32'}


a, b, tol = load(sys.argv[1]), load(sys.argv[2]), float(sys.argv[3])
params = sorted(k for k in a if not k.startswith('optim.'))
if set(params) != set(k for k in b if not k.startswith('optim.')) or not params:
    sys.exit("compare: the checkpoints hold different parameters")
state = sorted(k for k in a if k.startswith('optim.'))
if state and any(k.startswith('optim.') for k in b):
    if set(state) != set(k for k in b if k.startswith('optim.')):
        sys.exit("compare: the checkpoints hold different optimizer state")
    params += state
worst, name = 0.0, ''
for k in params:
    d = float(np.max(np.abs(a[k] - b[k]) / (1.0 + np.abs(a[k]))))
    if d > worst:
        worst, name = d, k
print('compare: %d tensors, largest difference %.3g (%s)' % (len(params), worst, name))
sys.exit(0 if worst <= tol else 1)
