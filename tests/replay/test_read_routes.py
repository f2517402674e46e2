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

    crafted_files(rr)
    return 0


def write_route_file(rr, path, version, experts, layers, k, records, close=False, file_id=0x1234):
    """A route file of `records` [(uid, first_position, tokens, first_layer, num_layers, ids)],
    each record checksummed as the format says; `close`: an index and a tail after them."""
    import struct

    width = 1 if experts <= 256 else 2 if experts <= 65536 else 4
    header = bytearray(64)
    header[0:8] = rr.FILE_MAGIC
    struct.pack_into("<HHB", header, 8, version, 64, width)
    struct.pack_into("<III", header, 16, experts, layers, k)
    struct.pack_into("<Q", header, 32, file_id)
    struct.pack_into("<Q", header, 56, rr.xxh64(bytes(header[:56])))
    out = bytearray(header)
    index_uid = file_id if version >= 3 else 0

    def record(rtype, uid, first_pos, tokens, first_layer, num_layers, body):
        h = bytearray(56)
        h[0:4] = rr.RECORD_MAGIC
        struct.pack_into("<H2xQQqIHH", h, 4, rtype, len(body), uid, first_pos, tokens, first_layer, num_layers)
        struct.pack_into("<Q", h, 40, rr.record_checksum(version, bytes(h[:40]), body))
        struct.pack_into("<I", h, 48, rr.xxh64(bytes(h[:48])) & 0xFFFFFFFF)
        return bytes(h) + body + bytes((-len(body)) % 8)

    entries = []
    for uid, first_pos, tokens, first_layer, num_layers, ids in records:
        body = b"".join(int(i).to_bytes(width, "little") for i in ids)
        entry = struct.pack("<QQqIHH", uid, len(out), first_pos, tokens, first_layer, num_layers)
        entries.append(entry if version >= 2 else entry[:16])  # version 1: {uid, offset}
        out += record(rr.ROUTES, uid, first_pos, tokens, first_layer, num_layers, body)
    if close:
        index_at = len(out)
        out += record(rr.INDEX, index_uid, 0, 0, 0, 0, struct.pack("<Q", len(entries)) + b"".join(entries))
        out += record(rr.TAIL, index_uid, 0, 0, 0, 0, struct.pack("<Q", index_at))
    with open(path, "wb") as f:
        f.write(out)
    return len(header), index_at if close else None


def patch_index_entry(rr, path, i, field, fmt, value):
    """Sets a field of index entry i of a closed version-3 file, and makes the index record's
    checksum and header check right again (the index then passes, whatever it says)."""
    import struct

    with open(path, "rb") as fh:
        data = bytearray(fh.read())
    index_at = struct.unpack_from("<Q", data, len(data) - 8)[0]
    count = struct.unpack_from("<Q", data, index_at + 56)[0]
    struct.pack_into(fmt, data, index_at + 56 + 8 + 32 * i + field, value)
    body = bytes(data[index_at + 56 : index_at + 56 + 8 + 32 * count])
    struct.pack_into("<Q", data, index_at + 40, rr.record_checksum(3, bytes(data[index_at : index_at + 40]), body))
    struct.pack_into("<I", data, index_at + 48, rr.xxh64(bytes(data[index_at : index_at + 48])) & 0xFFFFFFFF)
    with open(path, "wb") as fh:
        fh.write(data)


def expect_error(rr, fn, text):
    try:
        fn()
    except rr.RouteFileError as e:
        assert text in str(e), (text, str(e))
        return
    raise AssertionError(f"no RouteFileError containing {text!r}")


def crafted_files(rr):
    """The C++ reader's rules on files crafted byte by byte (found disagreeing with it before)."""
    import struct
    import tempfile

    tmp = tempfile.mkdtemp()
    path = os.path.join(tmp, "crafted.mrr")

    # Records of a sequence may overlap only with the same ids: a disagreement is damage (the
    # last record's ids were returned before), in every version.
    for version in (1, 2, 3):
        write_route_file(rr, path, version, 64, 1, 2, [(7, 0, 2, 0, 1, [1, 2, 3, 4]), (7, 1, 1, 0, 1, [3, 4])])
        assert rr.RouteFile(path).routes(7).tolist() == [[[1, 2]], [[3, 4]]]
        write_route_file(rr, path, version, 64, 1, 2, [(7, 0, 2, 0, 1, [1, 2, 3, 4]), (7, 1, 1, 0, 1, [63, 62])])
        expect_error(rr, lambda: rr.RouteFile(path).routes(7), "two records of sequence uid 7 disagree at position 1 layer 0")

    # The sparse bound is the C++ reader's: 1 + k * id_width bytes a row, over [first, last).
    # 48 layers, layer 0 at positions 0-9 and 2000-2009: written and read by the library (this
    # reader refused it before).
    ids = list(range(80))
    write_route_file(rr, path, 3, 256, 48, 8, [(5, 0, 10, 0, 1, ids), (5, 2000, 10, 0, 1, ids)])
    r = rr.RouteFile(path).routes(5)
    assert r.shape == (2010, 48, 8) and (r[2009, 0] == ids[72:]).all() and (r[10:2000] == -1).all()
    # 4-byte ids, k = 1, positions 0 and 230000: refused by the library, and here.
    write_route_file(rr, path, 3, 70000, 1, 1, [(6, 0, 1, 0, 1, [9]), (6, 230000, 1, 0, 1, [69999])])
    expect_error(rr, lambda: rr.RouteFile(path).routes(6), "would span positions [0, 230001) but hold 2")
    # One record far from position 0: an array from 0 would allocate the gap; from its first
    # position it is one row.
    write_route_file(rr, path, 3, 8, 1, 1, [(9, 3000000, 1, 0, 1, [5])])
    f = rr.RouteFile(path)
    expect_error(rr, lambda: f.routes(9), "read it with start=3000000")
    assert f.routes(9, start=None).tolist() == [[[5]]]

    # A record of no layers is named as such.
    write_route_file(rr, path, 3, 8, 2, 1, [(4, 0, 0, 0, 0, [])])
    expect_error(rr, lambda: rr.RouteFile(path), "has first_layer 0 and num_layers 0, outside the file's 2 layers")

    # A closed file whose index is damaged (a byte of its payload, or of its header): the index is
    # stepped over and reported, every routes record read (the whole file was refused before).
    records = [(1, 0, 3, 0, 2, list(range(12))), (2, 0, 2, 0, 2, list(range(8)))]
    for version in (1, 2, 3):
        for where in ("intact", "payload", "header"):
            _, index_at = write_route_file(rr, path, version, 64, 2, 2, records, close=True)
            if where != "intact":
                with open(path, "r+b") as fh:
                    at = index_at + (56 + 3 if where == "payload" else 20)
                    fh.seek(at)
                    byte = fh.read(1)
                    fh.seek(at)
                    fh.write(bytes([byte[0] ^ 0x40]))
            f = rr.RouteFile(path)
            assert f.index_damaged == (where != "intact"), (version, where)
            assert f.sequences() == [1, 2] and f.torn_bytes == 0
            assert f.routes(1).reshape(-1).tolist() == list(range(12))
    # A damaged routes record is still an error, naming its type and sequence: the sequence's in a
    # closed file (the C++ reader opens it from its index and reads the others), the whole
    # file's in one that was not closed (both readers scan it).
    for close in (True, False):
        write_route_file(rr, path, 3, 64, 2, 2, records, close=close)
        with open(path, "r+b") as fh:
            fh.seek(64 + 56 + 1)
            fh.write(b"\x3f")
        if close:
            f = rr.RouteFile(path)
            assert f.sequences() == [1, 2] and f.routes(2).reshape(-1).tolist() == list(range(8))
            expect_error(rr, lambda: f.routes(1), "a routes record (sequence uid 1) fails its checksum")
        else:
            expect_error(rr, lambda: rr.RouteFile(path), "a routes record (sequence uid 1) fails its checksum")
    # A damaged record *header* in a closed file is its sequence's damage too: the index says where
    # every record is (the whole file was refused before, where the C++ reader reads the others).
    write_route_file(rr, path, 3, 64, 2, 2, records, close=True)
    with open(path, "r+b") as fh:
        fh.seek(64 + 20)  # the first record's uid field: its header check fails
        fh.write(b"\x7f")
    f = rr.RouteFile(path)
    assert f.sequences() == [1, 2] and f.routes(2).reshape(-1).tolist() == list(range(8))
    expect_error(rr, lambda: f.routes(1), "no valid routes record header where the index puts sequence uid 1")
    # An index listing one record twice is refused at open, as the C++ reader refuses it.
    write_route_file(rr, path, 3, 64, 2, 2, [records[0], records[0]], close=True)
    with open(path, "rb") as fh:
        data = bytearray(fh.read())
    patch_index_entry(rr, path, 1, 8, "<Q", 64)  # the second entry points at the first record
    expect_error(rr, lambda: rr.RouteFile(path), "lists the record at offset 64 twice")
    # An entry outside [header, index) or naming no layer is a damaged index, and the file is
    # rescanned (every sequence read), as the C++ reader does (they were refused before).
    for field, fmt, value in ((8, "<Q", 8), (8, "<Q", None), (8, "<Q", 1 << 40), (30, "<H", 0)):
        CAPTURE = (field, value)
        index_at = write_route_file(rr, path, 3, 64, 2, 2, records, close=True)[1]
        patch_index_entry(rr, path, 0, field, fmt, index_at if value is None else value)
        f = rr.RouteFile(path)
        assert f.index_damaged, CAPTURE
        assert f.sequences() == [1, 2], CAPTURE
        assert f.routes(1).reshape(-1).tolist() == list(range(12)), CAPTURE
        assert f.routes(2).reshape(-1).tolist() == list(range(8)), CAPTURE

    # A file cut short while open (a writer cutting away a torn last record) is an error, not the
    # SIGBUS that reading it through a memory mapping ended the process with.
    write_route_file(rr, path, 3, 64, 2, 2, records, close=False)
    f = rr.RouteFile(path)
    os.truncate(path, 64 + 8)
    expect_error(rr, lambda: f.routes(1), "was truncated or replaced while open")
    # Not a regular file: a FIFO is refused at once (opening it waited for a writer for ever), a
    # directory with the reader's error.
    fifo = os.path.join(tmp, "fifo.mrr")
    os.mkfifo(fifo)
    expect_error(rr, lambda: rr.RouteFile(fifo), "it is a FIFO (named pipe), not a regular file")
    expect_error(rr, lambda: rr.RouteFile(tmp), "it is a directory, not a regular file")
    print("crafted files: overlaps, the sparse bound, start, empty records and damaged indexes as the C++ reader")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..")))
