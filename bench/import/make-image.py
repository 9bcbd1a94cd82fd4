#!/usr/bin/env python3
"""Writes the benchmark image's layer trees (no container tools): DEST/l1..l4, each a directory
to be tarred as one layer. About 1.2 GiB in all:

  l1  busybox root filesystem + 20,000 small text files (0.5-4 KiB)       ~45 MiB
  l2  one 300 MiB file, half random, half repetitive (gzip ~ 55 %)        300 MiB
  l3  one 300 MiB file of the same kind, other content                    300 MiB
  l4  four 100 MiB files of the same kind + 2,000 files of 64 KiB         525 MiB

Content is random (os.urandom), so every run's image differs and nothing deduplicates across
layers; the sizes and shapes are fixed.
Usage: make-image.py DEST BUSYBOX
"""

import os
import shutil
import sys

MIB = 1 << 20


def mixed_file(path, size):
    """Half random, half a repeated text block: compresses partially, like real binaries."""
    pattern = (b"berth benchmark: partially compressible filler line 0123456789\n" * 9000)[: MIB // 2]
    with open(path, "wb") as f:
        written = 0
        while written < size:
            f.write(os.urandom(MIB // 2))
            f.write(pattern)
            written += MIB


def main():
    dest, busybox = sys.argv[1], sys.argv[2]
    l1 = os.path.join(dest, "l1")
    for d in ("bin", "etc", "tmp", "usr/share/small"):
        os.makedirs(os.path.join(l1, d), exist_ok=True)
    shutil.copy(busybox, os.path.join(l1, "bin/busybox"))
    os.chmod(os.path.join(l1, "bin/busybox"), 0o755)
    os.symlink("busybox", os.path.join(l1, "bin/sh"))
    with open(os.path.join(l1, "etc/passwd"), "w") as f:
        f.write("root:x:0:0:root:/root:/bin/sh\n")
    words = [w.encode() for w in "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()]
    for i in range(20000):
        sub = os.path.join(l1, "usr/share/small", "%03d" % (i // 200))
        if i % 200 == 0:
            os.makedirs(sub, exist_ok=True)
        size = 512 + (i * 7919) % 3584
        line = b" ".join(words[(i + k) % len(words)] for k in range(8)) + b" %d\n" % i
        body = (line * (size // len(line) + 1))[:size]
        with open(os.path.join(sub, "f%05d.txt" % i), "wb") as f:
            f.write(body)

    for name in ("l2", "l3"):
        d = os.path.join(dest, name, "data")
        os.makedirs(d, exist_ok=True)
        mixed_file(os.path.join(d, "big-%s.bin" % name), 300 * MIB)

    l4 = os.path.join(dest, "l4", "opt/models")
    os.makedirs(l4, exist_ok=True)
    for i in range(4):
        mixed_file(os.path.join(l4, "shard-%d.bin" % i), 100 * MIB)
    med = os.path.join(dest, "l4", "opt/assets")
    os.makedirs(med, exist_ok=True)
    for i in range(2000):
        with open(os.path.join(med, "a%04d.dat" % i), "wb") as f:
            f.write(os.urandom(32 * 1024) + bytes(32 * 1024))


if __name__ == "__main__":
    main()
