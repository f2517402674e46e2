#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets (tests/fuzz/corpus/{route_file,npy}/), each file
< 4 KB. Route-file seeds start with the target's mode byte (1 = recompute checksums, 0 = as is).
    /usr/bin/python3 tests/fuzz/make_corpus.py    (needs numpy, for read_routes.xxh64)
"""
import os
import struct
import sys

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "..", "examples", "python"))
from read_routes import xxh64  # noqa: E402


def header(experts, layers, topk, width=None):
    width = width or (1 if experts <= 256 else 2 if experts <= 65536 else 4)
    h = b"MRRROUTE" + struct.pack("<HHB3xIII", 1, 64, width, experts, layers, topk) + bytes(28)
    return h + struct.pack("<Q", xxh64(h))


def record(rtype, payload, uid=0, pos=0, tokens=0, first_layer=0, layers=0):
    h40 = b"MRRR" + struct.pack("<H2xQQqIHH", rtype, len(payload), uid, pos, tokens, first_layer, layers)
    h48 = h40 + struct.pack("<Q", xxh64(h40 + payload))
    h = h48 + struct.pack("<I4x", xxh64(h48) & 0xFFFFFFFF)
    return h + payload + bytes((-len(payload)) % 8)


def routes(uid, pos, tokens, layers, k, width=1, first_layer=0, value=3):
    payload = bytes([value]) * (tokens * layers * k * width)
    return record(1, payload, uid, pos, tokens, first_layer, layers)


def closed(body, offsets):
    index_at = 64 + len(body)
    idx = struct.pack("<Q", len(offsets)) + b"".join(struct.pack("<QQ", u, o) for u, o in offsets)
    body += record(2, idx)
    body += record(3, struct.pack("<Q", index_at))
    return body


def route_files():
    out = {}
    h = header(64, 3, 4)
    out["empty_closed"] = h + closed(b"", [])
    r1 = routes(7, 0, 2, 3, 4)
    r2 = routes(7, 2, 1, 1, 4, first_layer=1)
    r3 = routes(9, 100, 3, 3, 4)
    body = r1 + r2 + r3
    out["three_records_closed"] = h + closed(body, [(7, 64), (7, 64 + len(r1)), (9, 64 + len(r1) + len(r2))])
    out["three_records_no_index"] = h + body
    out["torn_tail"] = h + r1 + r2[:-5]
    out["far_position"] = h + routes(5, 1 << 31, 1, 3, 4)
    out["past_bound"] = h + routes(5, 1 << 40, 1, 3, 4)
    out["sparse_sequence"] = h + routes(5, 0, 1, 3, 4) + routes(5, 1 << 31, 1, 3, 4)
    out["id_out_of_range"] = h + routes(5, 0, 1, 3, 4, value=200)
    out["wide_ids"] = header(1000, 2, 3) + routes(1, 0, 2, 2, 3, width=2)
    out["header_only"] = h
    out["bad_layers_header"] = header(64, 70000, 4)
    # Crafted indexes: one record listed many times (once quadratic to read), entries closer than
    # a record header, an entry hidden inside another record's payload, an unaligned entry.
    out["duplicate_index_entries"] = h + closed(r1, [(7, 64)] * 200)
    out["overlapping_index_entries"] = h + closed(r1, [(7, 64), (7, 80)])
    inner = routes(7, 500, 1, 3, 4)
    outer = routes(7, 0, 20, 3, 4)
    hidden = outer[:56 + 64] + inner + outer[56 + 64 + len(inner):]
    out["index_entry_inside_record"] = h + closed(hidden, [(7, 64), (7, 64 + 56 + 64)])
    out["unaligned_index_entry"] = h + closed(r1 + r3, [(7, 64), (9, 64 + len(r1) + 4)])
    # Huge declared records: a payload size past the end of the file (a torn tail), and the
    # largest token count a record can declare with a matching (huge) payload size.
    big = record(1, bytes(64), 5, 0, 0xFFFFFFFF, 0, 3)
    big = big[:8] + struct.pack("<Q", 0xFFFFFFFF * 3 * 4) + big[16:]
    out["huge_record"] = h + big
    out["huge_record_then_index"] = h + closed(r1 + big, [(7, 64), (5, 64 + len(r1))])
    return {name: bytes([1]) + data for name, data in out.items()}


def npy(header_text, data, version=1):
    pre = 10 if version == 1 else 12
    text = header_text
    while (pre + len(text) + 1) % 64:
        text += " "
    text += "\n"
    n = len(text)
    length = struct.pack("<H", n) if version == 1 else struct.pack("<I", n)
    return b"\x93NUMPY" + bytes([version, 0]) + length + text.encode() + data


def d(descr, shape):
    return "{'descr': '%s', 'fortran_order': False, 'shape': %s, }" % (descr, shape)


def npy_files():
    return {
        "i4_3x2x2": npy(d("<i4", "(3, 2, 2)"), struct.pack("<12i", *range(12))),
        "i8_2x1x2_v2": npy(d("<i8", "(2, 1, 2)"), struct.pack("<4q", 0, 1, 2, 3), version=2),
        "u1_4x2x1_v3": npy(d("|u1", "(4, 2, 1)"), bytes(range(8)), version=3),
        "u2_1x1x1": npy(d("<u2", "(1, 1, 1)"), struct.pack("<H", 9)),
        "empty": npy(d("<i4", "(0, 2, 2)"), b""),
        "scalar": npy(d("<i8", "()"), struct.pack("<q", 5)),
        "negative_id": npy(d("<i4", "(1, 1, 2)"), struct.pack("<2i", -1, 3)),
        "wrapping_shape": npy(d("<i4", "(4611686018427387904, 2, 2)"), bytes(22)),
        "negative_dim": npy(d("<i4", "(-1, 2, 2)"), bytes(16)),
        "trailing": npy(d("<i4", "(1, 1, 1)"), bytes(5)),
        "big_header_len": b"\x93NUMPY\x02\x00\xf0\xff\xff\xff" + b"{}",
        "fortran": npy("{'descr': '<i4', 'fortran_order': True, 'shape': (1, 1, 1), }", bytes(4)),
    }


def write(folder, files):
    path = os.path.join(here, "corpus", folder)
    os.makedirs(path, exist_ok=True)
    for name, data in files.items():
        assert len(data) < 4096, name
        with open(os.path.join(path, name), "wb") as f:
            f.write(data)


if __name__ == "__main__":
    write("route_file", route_files())
    write("npy", npy_files())
