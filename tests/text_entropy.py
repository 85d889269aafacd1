#!/usr/bin/env python3
"""The floors a byte model must beat on examples/gpt.c's text: Debian's
fortunes, every plain file in name order (as read_fortunes reads them),
split 9:1.  Prints, in nats a byte on the held-out tenth, the cross entropy
of the best model that sees no context (the training part's byte counts)
and of the best that sees only the previous byte (the training part's
pair counts), both add-one smoothed.  A model whose validation loss is
below the second uses more than the byte before it: its attention works
(gpt_checks, tests/checks/gpt.sh).

usage: tests/text_entropy.py [DIR]   (default /usr/share/games/fortunes)
"""
import math
import os
import sys


def read_fortunes(d):
    out = bytearray()
    for nm in sorted(os.listdir(d)):   # alphasort of plain ASCII names = byte order
        p = os.path.join(d, nm)
        if nm.startswith('.') or nm.endswith('.dat') or nm.endswith('.u8'):
            continue
        if os.path.isfile(p):   # (stat: a link to a file counts, as in C)
            with open(p, 'rb') as f:
                out += f.read()
    return bytes(out)


def main():
    d = sys.argv[1] if len(sys.argv) > 1 else '/usr/share/games/fortunes'
    text = read_fortunes(d)
    cut = len(text) * 9 // 10
    train, val = text[:cut], text[cut:]
    uni = [1] * 256
    for b in train:
        uni[b] += 1
    tot = sum(uni)
    h0 = -sum(math.log(uni[b] / tot) for b in val) / len(val)
    pair = [[1] * 256 for _ in range(256)]
    for a, b in zip(train, train[1:]):
        pair[a][b] += 1
    rows = [sum(r) for r in pair]
    h1 = -sum(math.log(pair[a][b] / rows[a]) for a, b in zip(val, val[1:])) / (len(val) - 1)
    print(f"no context {h0:.3f} previous byte {h1:.3f} nats/byte ({len(train)} train, {len(val)} val bytes)")


if __name__ == '__main__':
    main()
