#!/usr/bin/env python3
"""Read an mrr route file (docs/route-file-format.md) with numpy alone.

    python3 read_routes.py routes.mrr                    # summary of the file
    python3 read_routes.py routes.mrr --uid 7            # one sequence's routes
    python3 read_routes.py routes.mrr --uid 7 --npy r.npy  # save them as [positions, layers, k]

As a module:

    from read_routes import RouteFile
    f = RouteFile("routes.mrr")
    ids = f.routes(7)          # int32 [positions, layers, k], -1 where nothing was recorded

Every record's checksum is verified: XXH3-64 in format versions 3 and 2 (numpy, about 85 MB/s)
and XXH64 in version 1 (pure Python, about 20-30 MB/s); --no-verify skips it (and then an
incomplete last record is not told apart from a whole one). A damaged routes record, or two
records of a sequence that disagree on a (position, layer), raises (in a cleanly closed file
from routes(uid) of that sequence alone, as the C++ reader opens such a file from its index); an incomplete last record (a
writer stopped mid-append) is reported in `torn_bytes` and not used, and a damaged index or tail
record (it holds no routes) is stepped over and reported in `index_damaged`, as the C++ reader
does. A sequence's records must lie as densely as the C++ reader requires (docs/route-file-format.md,
"Bounds"); `routes(uid)` returns an array from position 0, or from `start` when given (a sequence
recorded far from position 0, e.g. a context-parallel shard, is read with start=None: from its
first recorded position).
"""

import argparse
import os
import stat
import struct
import sys

import numpy as np

FILE_MAGIC = b"MRRROUTE"
RECORD_MAGIC = b"MRRR"
HEADER_BYTES = 64
RECORD_HEADER_BYTES = 56
CHECKSUMMED_HEADER_BYTES = 40
HEADER_CHECKED_BYTES = 48
# Format versions read: 1 (records checksummed with XXH64), 2 (XXH3-64) and 3 (as 2; its index and
# tail records carry the file id, which this reader checks as the C++ reader does).
SUPPORTED_VERSIONS = (1, 2, 3)
ROUTES, INDEX, TAIL = 1, 2, 3
MAX_LAYERS = 65535
MAX_TOPK = 4096
MAX_POSITIONS = 1 << 32
# A sequence whose table would exceed this many times the rows its records hold, plus 1 MiB,
# is refused (docs/route-file-format.md, "Bounds").
SPARSE_FACTOR = 32
SPARSE_SLACK = 1 << 20

_P1 = 0x9E3779B185EBCA87
_P2 = 0xC2B2AE3D27D4EB4F
_P3 = 0x165667B19E3779F9
_P4 = 0x85EBCA77C2B2AE63
_P5 = 0x27D4EB2F165667C5
_M = (1 << 64) - 1


def _rotl(x, r):
    return ((x << r) | (x >> (64 - r))) & _M


def _round(acc, lane):
    acc = (acc + lane * _P2) & _M
    return (_rotl(acc, 31) * _P1) & _M


def _merge(acc, val):
    acc ^= _round(0, val)
    return (acc * _P1 + _P4) & _M


def xxh64(data, seed=0):
    """XXH64 of a bytes-like object (the checksum mrr writes)."""
    data = memoryview(data).cast("B")
    n = len(data)
    p = 0
    if n >= 32:
        v1 = (seed + _P1 + _P2) & _M
        v2 = (seed + _P2) & _M
        v3 = seed & _M
        v4 = (seed - _P1) & _M
        stripes = n // 32
        lanes = np.frombuffer(data[: stripes * 32], dtype="<u8").tolist()
        for i in range(0, 4 * stripes, 4):
            v1 = _round(v1, lanes[i])
            v2 = _round(v2, lanes[i + 1])
            v3 = _round(v3, lanes[i + 2])
            v4 = _round(v4, lanes[i + 3])
        h = (_rotl(v1, 1) + _rotl(v2, 7) + _rotl(v3, 12) + _rotl(v4, 18)) & _M
        h = _merge(h, v1)
        h = _merge(h, v2)
        h = _merge(h, v3)
        h = _merge(h, v4)
        p = stripes * 32
    else:
        h = (seed + _P5) & _M
    h = (h + n) & _M
    while p + 8 <= n:
        (lane,) = struct.unpack_from("<Q", data, p)
        h ^= _round(0, lane)
        h = (_rotl(h, 27) * _P1 + _P4) & _M
        p += 8
    if p + 4 <= n:
        (lane,) = struct.unpack_from("<I", data, p)
        h ^= (lane * _P1) & _M
        h = (_rotl(h, 23) * _P2 + _P3) & _M
        p += 4
    while p < n:
        h ^= (data[p] * _P5) & _M
        h = (_rotl(h, 11) * _P1) & _M
        p += 1
    h ^= h >> 33
    h = (h * _P2) & _M
    h ^= h >> 29
    h = (h * _P3) & _M
    h ^= h >> 32
    return h


# XXH3-64 (seed 0), the record checksum of format versions 2 and 3, written from the algorithm's
# specification (xxHash 0.8, https://github.com/Cyan4973/xxHash/blob/dev/doc/xxhash_spec.md).
# Inputs over 240 bytes run on numpy: the stripes of a block are summed as uint64 arrays (numpy
# wraps modulo 2^64), and only the per-block scramble is a Python loop.
_K_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e"
)
_P32_1, _P32_2, _P32_3 = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D
_MX1, _MX2 = 0x165667919E3779F9, 0x9FB21C651E98DF25
_STRIPE, _STRIPES_PER_BLOCK = 64, (len(_K_SECRET) - 64) // 8


def _u64(b, at):
    return int.from_bytes(b[at : at + 8], "little")


def _avalanche64(h):  # XXH64's final mix
    h ^= h >> 33
    h = (h * _P2) & _M
    h ^= h >> 29
    h = (h * _P3) & _M
    return h ^ (h >> 32)


def _avalanche3(h):
    h ^= h >> 37
    h = (h * _MX1) & _M
    return h ^ (h >> 32)


def _fold(a, b):  # the 128-bit product of two 64-bit values, its halves xor-ed
    p = a * b
    return (p ^ (p >> 64)) & _M


def _mix16(d, at, s):
    return _fold(_u64(d, at) ^ _u64(_K_SECRET, s), _u64(d, at + 8) ^ _u64(_K_SECRET, s + 8))


def _stripe_sums(lanes, keys):
    """Sum over stripes of what each adds to the 8 accumulators: lanes [n, 8] uint64, keys [n, 8]."""
    dk = lanes ^ keys
    add = (dk & np.uint64(0xFFFFFFFF)) * (dk >> np.uint64(32)) + lanes[:, [1, 0, 3, 2, 5, 4, 7, 6]]
    return np.add.reduce(add, axis=0, dtype=np.uint64)


def _xxh3_long(d):
    n = len(d)
    acc = np.array([_P32_3, _P1, _P2, _P3, _P4, _P32_2, _P5, _P32_1], dtype=np.uint64)
    keys = np.array([[_u64(_K_SECRET, 8 * (j + i)) for i in range(8)] for j in range(_STRIPES_PER_BLOCK)], dtype=np.uint64)
    scramble = np.frombuffer(_K_SECRET[-_STRIPE:], dtype="<u8").astype(np.uint64)
    block = _STRIPE * _STRIPES_PER_BLOCK
    blocks = (n - 1) // block
    last = ((n - 1) - blocks * block) // _STRIPE  # stripes of the last, partial block
    lanes = np.frombuffer(d, dtype="<u8", count=(blocks * _STRIPES_PER_BLOCK + last) * 8).reshape(-1, 8)
    for b in range(blocks):
        acc += _stripe_sums(lanes[b * _STRIPES_PER_BLOCK : (b + 1) * _STRIPES_PER_BLOCK], keys)
        acc ^= acc >> np.uint64(47)
        acc ^= scramble
        acc *= np.uint64(_P32_1)
    if last:
        acc += _stripe_sums(lanes[blocks * _STRIPES_PER_BLOCK :], keys[:last])
    tail = np.frombuffer(d[n - _STRIPE :], dtype="<u8").reshape(1, 8)
    acc += _stripe_sums(tail, np.frombuffer(_K_SECRET[len(_K_SECRET) - _STRIPE - 7 : -7], dtype="<u8").reshape(1, 8))
    a = [int(x) for x in acc]
    h = (n * _P1) & _M
    for i in range(4):
        h += _fold(a[2 * i] ^ _u64(_K_SECRET, 11 + 16 * i), a[2 * i + 1] ^ _u64(_K_SECRET, 11 + 16 * i + 8))
    return _avalanche3(h & _M)


def xxh3_64(data):
    """XXH3-64 (seed 0) of a bytes-like object: the record checksum of format versions 2 and 3."""
    d = bytes(data)
    n = len(d)
    if n == 0:
        return _avalanche64(_u64(_K_SECRET, 56) ^ _u64(_K_SECRET, 64))
    if n <= 3:
        combined = (d[0] << 16) | (d[n >> 1] << 24) | d[n - 1] | (n << 8)
        flip = int.from_bytes(_K_SECRET[0:4], "little") ^ int.from_bytes(_K_SECRET[4:8], "little")
        return _avalanche64(combined ^ flip)
    if n <= 8:
        x = (int.from_bytes(d[n - 4 :], "little") + (int.from_bytes(d[:4], "little") << 32)) ^ (
            _u64(_K_SECRET, 8) ^ _u64(_K_SECRET, 16)
        )
        x ^= _rotl(x, 49) ^ _rotl(x, 24)
        x = (x * _MX2) & _M
        x ^= (x >> 35) + n
        x = (x * _MX2) & _M
        return x ^ (x >> 28)
    if n <= 16:
        lo = _u64(d, 0) ^ (_u64(_K_SECRET, 24) ^ _u64(_K_SECRET, 32))
        hi = _u64(d, n - 8) ^ (_u64(_K_SECRET, 40) ^ _u64(_K_SECRET, 48))
        swapped = int.from_bytes(lo.to_bytes(8, "little"), "big")
        return _avalanche3((n + swapped + hi + _fold(lo, hi)) & _M)
    if n <= 128:
        acc = n * _P1
        for i in range((n - 1) // 32, -1, -1):  # pairs from the ends inwards: 16 i and n - 16 (i + 1)
            acc += _mix16(d, 16 * i, 32 * i) + _mix16(d, n - 16 * (i + 1), 32 * i + 16)
        return _avalanche3(acc & _M)
    if n <= 240:
        acc = n * _P1
        for i in range(8):
            acc += _mix16(d, 16 * i, 16 * i)
        acc = _avalanche3(acc & _M)
        for i in range(8, n // 16):
            acc += _mix16(d, 16 * i, 16 * (i - 8) + 3)
        acc += _mix16(d, n - 16, 136 - 17)
        return _avalanche3(acc & _M)
    return _xxh3_long(d)


def record_checksum(version, checksummed_header, payload):
    """A record's checksum in a file of format `version`: XXH64 (1) or XXH3-64 (2, 3), seed 0."""
    body = bytes(checksummed_header) + bytes(payload)
    return xxh64(body) if version == 1 else xxh3_64(body)


class RouteFileError(Exception):
    pass


def _seek_and_read(fd, n, offset):
    os.lseek(fd, offset, os.SEEK_SET)  # Windows has no pread (a RouteFile is not shared by threads)
    return os.read(fd, n)


_pread = getattr(os, "pread", _seek_and_read)


class _FileBytes:
    """A regular file's bytes, as long as it was when opened, read with positioned reads. Not a
    memory mapping: a file that shrinks while open (a writer cutting away a torn last record, or a
    failed write) ended the process with SIGBUS through one; here a read past the end raises."""

    def __init__(self, path):
        self._path = path
        try:
            # O_NONBLOCK: opening a FIFO for reading would wait for a writer for ever.
            flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
            self._fd = os.open(path, flags)
        except OSError as e:
            raise RouteFileError(f"cannot open route file {path}: {e.strerror}") from None
        st = os.fstat(self._fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(self._fd)
            self._fd = -1
            kind = (
                "a directory" if stat.S_ISDIR(st.st_mode)
                else "a FIFO (named pipe)" if stat.S_ISFIFO(st.st_mode)
                else "a socket" if stat.S_ISSOCK(st.st_mode)
                else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
                else "not a regular file"
            )
            raise RouteFileError(f"route file {path}: it is {kind}, not a regular file")
        self._size = st.st_size

    def __del__(self):
        if getattr(self, "_fd", -1) >= 0:
            os.close(self._fd)

    def __len__(self):
        return self._size

    def __getitem__(self, key):
        start, stop, step = key.indices(self._size)
        if step != 1:
            raise ValueError("only contiguous byte ranges are read")
        n = stop - start
        if n <= 0:
            return b""
        whole = _pread(self._fd, n, start)
        if len(whole) == n:  # the common case: one read
            return whole
        parts, got = [whole], len(whole)
        while got < n:
            piece = _pread(self._fd, n - got, start + got)
            if not piece:
                raise RouteFileError(
                    f"route file {self._path} was truncated or replaced while open: it ends before offset "
                    f"{start + n}, where it held {self._size} bytes when opened"
                )
            parts.append(piece)
            got += len(piece)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def u64(self, off):
        return struct.unpack("<Q", self[off : off + 8])[0]


class RouteFile:
    """A route file: its shape, and the routes of each sequence it holds."""

    def __init__(self, path, verify=True):
        self.path = str(path)
        self.verify = verify
        self._data = _FileBytes(self.path)
        self._read_header()
        self._records = {}  # uid -> [(offset, header fields)]
        self.records = 0
        self.torn_offset = 0
        self.torn_bytes = 0
        self.index_damaged = False
        self._closed = False  # an intact index and tail end the file
        self._index = None  # (offset, entry bytes, entries) of that index
        self._damaged = {}  # uid -> (offset, what): routes records of a closed file that fail their checksum
        self._scan()

    def _fail(self, offset, what):
        raise RouteFileError(f"route file {self.path} is damaged: {what} at offset {offset}")

    def _read_header(self):
        d = self._data[:HEADER_BYTES]
        if len(d) < HEADER_BYTES or d[:8] != FILE_MAGIC:
            raise RouteFileError(f"{self.path} is not an mrr route file")
        if struct.unpack_from("<Q", d, 56)[0] != xxh64(d[:56]):
            raise RouteFileError(f"{self.path}: its header fails its checksum")
        self.version, header_bytes, self.id_width = struct.unpack_from("<HHB", d, 8)
        if self.version not in SUPPORTED_VERSIONS:
            raise RouteFileError(
                f"{self.path}: it has format version {self.version}, which this reader does not read "
                f"(it reads versions {min(SUPPORTED_VERSIONS)} to {max(SUPPORTED_VERSIONS)})"
            )
        if header_bytes != HEADER_BYTES:
            raise RouteFileError(f"{self.path}: it has an unexpected header size {header_bytes}")
        self.num_experts, self.num_layers, self.topk = struct.unpack_from("<III", d, 16)
        if not 1 <= self.num_experts < 1 << 31:
            raise RouteFileError(f"{self.path}: its header has num_experts = {self.num_experts}")
        if not 1 <= self.num_layers <= MAX_LAYERS:
            raise RouteFileError(f"{self.path}: its header has num_layers = {self.num_layers}")
        if not 1 <= self.topk <= min(self.num_experts, MAX_TOPK):
            raise RouteFileError(f"{self.path}: its header has topk = {self.topk}")
        want = 1 if self.num_experts <= 256 else 2 if self.num_experts <= 65536 else 4
        if self.id_width != want:
            raise RouteFileError(f"{self.path}: its header has id width {self.id_width}")
        self._dtype = {1: np.uint8, 2: np.dtype("<u2"), 4: np.dtype("<u4")}[self.id_width]
        # Index and tail records carry the file id in their uid field from version 3.
        self._index_uid = struct.unpack_from("<Q", d, 32)[0] if self.version >= 3 else 0

    def _record_header(self, off):
        """The fields of the record header at `off` when its magic, type and check are right:
        (type, payload, uid, first_position, tokens, first_layer, layers, checksum), else None."""
        if len(self._data) - off < RECORD_HEADER_BYTES:
            return None
        d = self._data[off : off + RECORD_HEADER_BYTES]
        if d[:4] != RECORD_MAGIC:
            return None
        rtype, payload, uid, first_pos, tokens, first_layer, layers, checksum, check = struct.unpack_from(
            "<H2xQQqIHHQI", d, 4
        )
        if rtype not in (ROUTES, INDEX, TAIL) or check != xxh64(d[:HEADER_CHECKED_BYTES]) & 0xFFFFFFFF:
            return None
        return rtype, payload, uid, first_pos, tokens, first_layer, layers, checksum

    def _checksum_ok(self, off, payload, checksum):
        record = self._data[off : off + RECORD_HEADER_BYTES + payload]  # header and payload in one read
        return (
            record_checksum(self.version, record[:CHECKSUMMED_HEADER_BYTES], record[RECORD_HEADER_BYTES:]) == checksum
        )

    def _damaged_index(self):
        """[start, end) of the index record that an intact tail points at, when that index is
        damaged: the scan steps over it (it holds no routes), as the C++ reader does. None when
        there is no intact tail, or its index is intact (then it is scanned as any record)."""
        n = len(self._data)
        tail_bytes = RECORD_HEADER_BYTES + 8
        if n < HEADER_BYTES + tail_bytes:
            return None
        t = n - tail_bytes
        th = self._record_header(t)
        if th is None or th[0] != TAIL or th[1] != 8 or th[2] != self._index_uid or not self._checksum_ok(t, 8, th[7]):
            return None
        at = self._data.u64(t + RECORD_HEADER_BYTES)
        if at < HEADER_BYTES or at > t - RECORD_HEADER_BYTES:
            self.index_damaged = True
            return None
        ih = self._record_header(at)
        entry = 32 if self.version >= 2 else 16
        intact = (
            ih is not None
            and ih[0] == INDEX
            and ih[2] == self._index_uid
            and 8 <= ih[1] <= t - at
            and at + RECORD_HEADER_BYTES + ((ih[1] + 7) & ~7) == t
            and (ih[1] - 8) % entry == 0
            and self._checksum_ok(at, ih[1], ih[7])
            and self._data.u64(at + RECORD_HEADER_BYTES) == (ih[1] - 8) // entry
        )
        if intact:
            self._closed = True
            self._index = (at, entry, (ih[1] - 8) // entry)
            return None
        self.index_damaged = True
        return at, t

    def _routes_record_problem(self, uid, payload, first_pos, tokens, first_layer, layers):
        """What is wrong with a routes record's header fields for this file, or None."""
        if layers == 0 or first_layer + layers > self.num_layers:
            return (
                f"a record of sequence uid {uid} has first_layer {first_layer} and num_layers {layers}, "
                f"outside the file's {self.num_layers} layers"
            )
        if payload != tokens * layers * self.topk * self.id_width:
            return f"a record of sequence uid {uid} has an inconsistent size"
        if first_pos < 0 or first_pos + tokens > MAX_POSITIONS:
            return f"a record of sequence uid {uid} has first_position {first_pos}, outside [0, 2^32)"
        return None

    def _index_table(self):
        """The entries of the closed file's index, or None when one points outside [header, index)
        or (versions 2 and 3) names no layer: a damaged index, and the file is rescanned, as the
        C++ reader does (route_index.hpp, read_entries)."""
        at, entry, count = self._index
        table = self._data[at + RECORD_HEADER_BYTES + 8 : at + RECORD_HEADER_BYTES + 8 + count * entry]
        for i in range(count):
            off = struct.unpack_from("<Q", table, i * entry + 8)[0]
            if off < HEADER_BYTES or off >= at:
                return None
            if entry == 32 and struct.unpack_from("<H", table, i * entry + 30)[0] == 0:
                return None
        return table

    def _from_index(self, table):
        """A closed file's routes records, found through its index as the C++ reader finds them:
        a record whose header is damaged, disagrees with its entry or fails its checksum is that
        sequence's damage (routes(uid) raises); the other sequences are read, and nothing between
        the records (an old index an earlier close left) is looked at."""
        at, entry, count = self._index
        # As the C++ reader (route_index.hpp, check_entries): the index is trusted only as a list
        # of distinct, non-overlapping, aligned records before it; each record ends by the next.
        offsets = sorted(struct.unpack_from("<Q", table, i * entry + 8)[0] for i in range(count))
        next_of = {}
        for i, o in enumerate(offsets):
            nxt = offsets[i + 1] if i + 1 < len(offsets) else at
            if o % 8 != 0:
                self._fail(at, f"its index lists a record at offset {o}, not 8-byte aligned")
            if nxt == o:
                self._fail(at, f"its index lists the record at offset {o} twice")
            if nxt - o < RECORD_HEADER_BYTES:
                self._fail(
                    at,
                    f"its index lists records at offsets {o} and {nxt}, which overlap "
                    f"(a record header alone is {RECORD_HEADER_BYTES} bytes)",
                )
            next_of[o] = nxt
        for i in range(count):
            if entry == 32:
                uid, off, e_pos, e_tokens, e_layer, e_layers = struct.unpack_from("<QQqIHH", table, i * entry)
            else:
                (uid, off), e_pos = struct.unpack_from("<QQ", table, i * entry), None
            self._records.setdefault(uid, [])

            def damaged(what, off=off, uid=uid):
                self._damaged.setdefault(uid, (off, what))

            h = self._record_header(off) if HEADER_BYTES <= off <= at - RECORD_HEADER_BYTES else None
            if h is None or h[0] != ROUTES:
                damaged(f"no valid routes record header where the index puts sequence uid {uid}")
                continue
            rtype, payload, h_uid, first_pos, tokens, first_layer, layers, checksum = h
            if h_uid != uid or (e_pos is not None and (first_pos, tokens, first_layer, layers) != (e_pos, e_tokens, e_layer, e_layers)):
                damaged(f"the record header disagrees with the index entry of sequence uid {uid}")
                continue
            if off + RECORD_HEADER_BYTES + ((payload + 7) & ~7) > next_of[off]:
                damaged(f"a record of sequence uid {uid} is running into the next record at offset {next_of[off]}")
                continue
            problem = self._routes_record_problem(uid, payload, first_pos, tokens, first_layer, layers)
            if problem is not None:
                damaged(problem)
                continue
            if self.verify and not self._checksum_ok(off, payload, checksum):
                damaged(f"a routes record (sequence uid {uid}) fails its checksum")
                continue
            self._records[uid].append((off, first_pos, tokens, first_layer, layers))
            self.records += 1

    def _scan(self):
        d, n, off = self._data, len(self._data), HEADER_BYTES
        skip = self._damaged_index()
        if self._closed:
            table = self._index_table()
            if table is not None:
                return self._from_index(table)
            self.index_damaged, self._closed, self._index = True, False, None
        while off < n:
            if skip is not None and off == skip[0]:
                off = skip[1]
                continue
            if n - off < RECORD_HEADER_BYTES:
                return self._torn(off)
            h = self._record_header(off)
            if h is None:
                if not any(d[off:n]):
                    return self._torn(off)
                self._fail(off, "no valid record header (bad magic, type or header check)")
            rtype, payload, uid, first_pos, tokens, first_layer, layers, checksum = h
            need = RECORD_HEADER_BYTES + ((payload + 7) & ~7)
            if payload > n - off or need > n - off:
                return self._torn(off)
            if self.verify and not self._checksum_ok(off, payload, checksum):
                if off + need == n:
                    return self._torn(off)
                if rtype != ROUTES:
                    # An index or tail an earlier close left inside the file: no routes in it.
                    self.index_damaged = True
                    off += need
                    continue
                what = f"a routes record (sequence uid {uid}) fails its checksum"
                if not self._closed:
                    self._fail(off, what)
                # A closed file, as the C++ reader opens it from its index: the damage is the
                # sequence's (routes(uid) raises), the other sequences are read.
                self._damaged.setdefault(uid, (off, what))
                self._records.setdefault(uid, [])
                off += need
                continue
            if rtype == ROUTES:
                problem = self._routes_record_problem(uid, payload, first_pos, tokens, first_layer, layers)
                if problem is not None:
                    self._fail(off, problem)
                self._records.setdefault(uid, []).append((off, first_pos, tokens, first_layer, layers))
                self.records += 1
            off += need

    def _torn(self, off):
        self.torn_offset = off
        self.torn_bytes = len(self._data) - off

    def sequences(self):
        return sorted(self._records)

    def routes(self, uid, start=0):
        """int32 array [positions, layers, k] of the sequence, from position `start` (0 by
        default; None: the first position recorded) to the last; -1 where no route was recorded."""
        if uid not in self._records:
            raise KeyError(f"sequence {uid} is not in {self.path}")
        if uid in self._damaged:
            self._fail(*self._damaged[uid])
        parts = self._records[uid]
        first = min(p for _, p, _, _, _ in parts)
        end = max(p + t for _, p, t, _, _ in parts)
        rows = sum(t * n for _, _, t, _, n in parts)
        # The C++ reader's bound (route_table.hpp, sparse_violation): a table over [first, end)
        # and every layer, 1 + k * id_width bytes a row, pays 1/32 of itself per row held.
        per_row = 1 + self.topk * self.id_width
        if (end - first) * self.num_layers * per_row // SPARSE_FACTOR > (
            rows * self.num_layers * per_row + SPARSE_SLACK // SPARSE_FACTOR
        ):
            self._fail(
                parts[0][0],
                f"the routes of sequence uid {uid} would span positions [{first}, {end}) but hold {rows} "
                "(position, layer) rows; a table that sparse is refused",
            )
        if start is None:
            start = first
        if not 0 <= start <= first:
            raise ValueError(f"start must be in [0, {first}] (sequence uid {uid} starts at position {first}), got {start}")
        # The same bound over [start, end): a sequence recorded far from position 0 is read from
        # its first position instead of allocating the gap.
        if (end - start) * self.num_layers * per_row // SPARSE_FACTOR > (
            rows * self.num_layers * per_row + SPARSE_SLACK // SPARSE_FACTOR
        ):
            raise RouteFileError(
                f"{self.path}: sequence uid {uid} holds positions [{first}, {end}) ({rows} rows); an array from "
                f"position {start} would be {(end - start) * self.num_layers * 4 * self.topk} bytes: read it with "
                f"start={first} (start=None)"
            )
        out = np.full((end - start, self.num_layers, self.topk), -1, dtype=np.int32)
        written = np.zeros((end - start, self.num_layers), dtype=bool)
        for off, first_pos, tokens, first_layer, layers in parts:
            count = tokens * layers * self.topk
            at = off + RECORD_HEADER_BYTES
            ids = np.frombuffer(self._data[at : at + count * self.id_width], dtype=self._dtype, count=count)
            block = ids.reshape(tokens, layers, self.topk).astype(np.int32)
            if (block >= self.num_experts).any():
                self._fail(off, f"a record of sequence uid {uid} holds an expert id >= {self.num_experts}")
            rows_at = slice(first_pos - start, first_pos - start + tokens)
            layers_at = slice(first_layer, first_layer + layers)
            # Records may overlap only with the same ids (the format's rule): anything else is damage.
            seen = written[rows_at, layers_at]
            if seen.any():
                differ = seen & (out[rows_at, layers_at] != block).any(axis=2)
                if differ.any():
                    p, layer = (int(i) for i in np.argwhere(differ)[0])
                    self._fail(
                        off,
                        f"two records of sequence uid {uid} disagree at position {first_pos + p} layer {first_layer + layer}",
                    )
            out[rows_at, layers_at] = block
            written[rows_at, layers_at] = True
        return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file")
    ap.add_argument("--uid", type=int, help="print (or save) one sequence's routes")
    ap.add_argument("--npy", help="with --uid: save the routes to this .npy file")
    ap.add_argument("--no-verify", action="store_true", help="skip checksum verification")
    ap.add_argument(
        "--from-first", action="store_true", help="with --uid: from the first recorded position, not from 0"
    )
    args = ap.parse_args(argv)
    try:
        f = RouteFile(args.file, verify=not args.no_verify)
    except RouteFileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"{f.path}: {f.num_experts} experts, {f.num_layers} MoE layers, k={f.topk}, "
        f"{f.id_width}-byte ids, {f.records} route records, {len(f.sequences())} sequences"
    )
    if f.torn_bytes:
        print(f"an incomplete last record of {f.torn_bytes} bytes at offset {f.torn_offset} was not used")
    if f.index_damaged:
        print("a damaged index or tail record (it holds no routes) was stepped over; every record was scanned")
    if args.uid is not None:
        try:
            routes = f.routes(args.uid, start=None if args.from_first else 0)
        except (RouteFileError, KeyError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if args.npy:
            np.save(args.npy, routes)
            print(f"sequence {args.uid}: {routes.shape} saved to {args.npy}")
        else:
            print(f"sequence {args.uid}: {routes.shape}")
            print(routes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
