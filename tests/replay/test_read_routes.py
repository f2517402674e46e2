#!/usr/bin/env python3
"""examples/python/read_routes.py on its own: its XXH3-64 (format version 2's record checksum,
written in numpy) against the xxHash library itself, for every input length class, and the
version-1 route files an older mrr wrote (tests/replay/data), read with checksums verified.

    python3 tests/replay/test_read_routes.py <repository root>
"""

import ctypes
import ctypes.util
import os
import random
import sys


def main(root):
    sys.path.insert(0, os.path.join(root, "examples", "python"))
    import read_routes as rr

    # The reference: libxxhash (the shared library of libxxhash-dev, whose header mrr compiles in).
    name = ctypes.util.find_library("xxhash") or "libxxhash.so.0"
    lib = ctypes.CDLL(name)
    lib.XXH3_64bits.restype = ctypes.c_uint64
    lib.XXH3_64bits.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    lib.XXH64.restype = ctypes.c_uint64
    lib.XXH64.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint64]

    rnd = random.Random(19)
    # Every length to 1,100 (the 0, 1-3, 4-8, 9-16, 17-128 and 129-240 paths, and long inputs of
    # one block of 1,024 bytes and around it), then lengths across block and stripe edges.
    lengths = list(range(0, 1101)) + [2047, 2048, 2049, 4096 + 40, 16384 + 40, 65536 + 17, 1 << 20]
    wrong = []
    for n in lengths:
        data = rnd.randbytes(n)
        if rr.xxh3_64(data) != lib.XXH3_64bits(data, n):
            wrong.append(("xxh3", n))
        if n <= 300 and rr.xxh64(data) != lib.XXH64(data, n, 0):
            wrong.append(("xxh64", n))
    # Inputs of all-ones bytes: every product and carry at its largest.
    for n in (16, 17, 128, 129, 240, 241, 1024, 1025, 5000):
        data = b"\xff" * n
        if rr.xxh3_64(data) != lib.XXH3_64bits(data, n):
            wrong.append(("xxh3 ones", n))
    assert not wrong, f"read_routes.py's hashes differ from libxxhash at: {wrong[:20]}"
    print(f"xxh3_64 equals libxxhash at {len(lengths) + 9} lengths; xxh64 at 301")

    # Files of format version 1, written by mrr at a2ca4b6: the ids are a formula of
    # (uid, position, layer, slot) (tests/replay/test_route_format_versions.cpp, id_of).
    def id_of(experts, k, uid, pos, layer, slot):
        return ((uid * 131 + pos * 31 + layer * 7 + slot * 13) % (experts - 13 * k) + 13 * slot) % experts

    data_dir = os.path.join(root, "tests", "replay", "data")
    for fname, (experts, layers, k) in {"v1_e64_l3_k4.routes": (64, 3, 4), "v1_e300_l2_k6.routes": (300, 2, 6)}.items():
        f = rr.RouteFile(os.path.join(data_dir, fname))
        assert f.version == 1 and (f.num_experts, f.num_layers, f.topk) == (experts, layers, k), fname
        assert f.sequences() == [3, 9, 1000], (fname, f.sequences())
        assert f.torn_bytes == 0
        for uid, first, end in ((3, 0, 40), (9, 0, 60), (1000, 5, 305)):
            r = f.routes(uid)
            assert r.shape == (end, layers, k), (fname, uid, r.shape)
            assert (r[:first] == -1).all()
            for p in range(first, end):
                for layer in range(layers):
                    want = [id_of(experts, k, uid, p, layer, j) for j in range(k)]
                    assert r[p, layer].tolist() == want, (fname, uid, p, layer)
        print(f"{fname}: version 1, {f.records} records, every id as written")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..")))
