// The record codec of route files (docs/route-file-format.md): expert ids to and from their
// little-endian encoding of the file's id width, the checks of a routes record's header against
// the file's shape, routes records built in memory for one write, and the index and tail
// records that end a cleanly closed file. No I/O: FileRouteStore reads and writes the bytes.
#pragma once

#include <mrr/detail/checked.hpp>
#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/replay/file_format.hpp>
#include <mrr/replay/layout.hpp>
#include <mrr/replay/shape.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__SSE2__) && !defined(__AVX2__)
#include <emmintrin.h>
#endif

MRR_NAMESPACE_BEGIN
namespace detail {

// Rows of k expert ids, each id `id_width` bytes (the narrowest holding num_experts - 1).
class RouteCodec {
 public:
  RouteCodec() = default;
  explicit RouteCodec(const route_file::FileHeader& h)
      : k_(static_cast<std::size_t>(h.shape.topk)),
        num_experts_(h.shape.num_experts),
        width_(h.id_width),
        version_(h.version) {}

  int id_width() const { return width_; }
  // The file's format version: it says which checksum its records carry.
  std::uint16_t version() const { return version_; }
  std::size_t row_bytes() const { return k_ * static_cast<std::size_t>(width_); }
  // Whether a decoded id can be >= num_experts at all (not when every value of the width is an expert).
  bool ids_need_range_check() const { return num_experts_ < (std::int64_t{1} << (8 * width_)); }

  // The payload size of a routes record of num_tokens x num_layers rows (< 2^62: no overflow).
  std::uint64_t payload_bytes(std::uint32_t num_tokens, int num_layers) const {
    return std::uint64_t{num_tokens} * static_cast<std::uint64_t>(num_layers) * k_ * static_cast<std::uint64_t>(width_);
  }

  // The header of a routes record of these rows (its checksum is set when it is encoded).
  route_file::RecordHeader routes_header(SequenceId uid, std::int64_t first_position, std::uint32_t num_tokens,
                                         int first_layer, int num_layers) const {
    route_file::RecordHeader h;
    h.type = route_file::RecordType::routes;
    h.payload_bytes = payload_bytes(num_tokens, num_layers);
    h.uid = uid;
    h.first_position = first_position;
    h.num_tokens = num_tokens;
    h.first_layer = static_cast<std::uint16_t>(first_layer);
    h.num_layers = static_cast<std::uint16_t>(num_layers);
    return h;
  }

  // The largest id among n bytes of encoded ids (n a multiple of the id width).
  std::uint32_t max_id(const unsigned char* p, std::size_t n) const {
    std::uint32_t top = 0;
    if (width_ == 1) return max_byte(p, n);
    if (width_ == 2) {
      std::uint16_t top16 = 0;  // the id's own width, as max_byte
      for (std::size_t i = 0; i < n; i += 2) {
        const auto v = route_file::detail::get<std::uint16_t>(p + i);
        top16 = v > top16 ? v : top16;
      }
      top = top16;
    } else {
      for (std::size_t i = 0; i < n; i += 4) top = std::max(top, route_file::detail::get<std::uint32_t>(p + i));
    }
    return top;
  }

  // Ids to their little-endian encoding, range-checked in the same pass (one loop per width;
  // __restrict lets it vectorise, since a byte store may otherwise alias the ids): false when one
  // is outside [0, num_experts). Id: int32 (the router's), or uint8 / uint16 as rollout engines
  // return them (vLLM's routed_experts): a 1-byte file takes 1-byte ids with a copy and a max.
  template <class Id>
  [[nodiscard]] bool encode_ids(const Id* __restrict ids, std::size_t n, unsigned char* __restrict out) const {
    static_assert(
        std::is_same_v<Id, std::int32_t> || std::is_same_v<Id, std::uint16_t> || std::is_same_v<Id, std::uint8_t>,
        "RouteCodec::encode_ids: ids are int32, uint16 or uint8");
    if constexpr (std::is_same_v<Id, std::uint8_t>) {
      if (width_ == 1) {
        if (n != 0) std::memcpy(out, ids, n);
        return ids_in_range(ids, n);
      }
    }
#if defined(__SSE2__) && !defined(__AVX2__)
    if constexpr (std::is_same_v<Id, std::int32_t>) {
      if (width_ == 1) return encode_bytes_sse2(ids, n, out);
    }
#endif
    return encode_ids_portable(ids, n, out);
  }

  // Whether all n ids are in [0, num_experts), without encoding them: the check of encode_ids.
  template <class Id>
  [[nodiscard]] bool ids_in_range(const Id* __restrict ids, std::size_t n) const {
    if constexpr (std::is_same_v<Id, std::uint8_t>)  // every byte is an expert id when there are 256 or more
      return num_experts_ >= 256 || max_byte(ids, n) < static_cast<std::uint32_t>(num_experts_);
    const auto last = static_cast<std::uint32_t>(num_experts_ - 1);
    std::uint32_t any = 0;  // as encode_ids_portable
    for (std::size_t i = 0; i < n; ++i) {
      const auto v = static_cast<std::uint32_t>(ids[i]);
      any |= v | (last - v);
    }
    return (any >> 31) == 0;
  }

  // encode_ids without its instruction-set forms: the loops every other build runs (public so
  // that tests hold both to the same cases on any machine).
  template <class Id>
  [[nodiscard]] bool encode_ids_portable(const Id* __restrict ids, std::size_t n, unsigned char* __restrict out) const {
    // An id u (as unsigned: a negative id is huge) is outside [0, num_experts) exactly when
    // u | (last - u) has its top bit set (modulo 2^32; num_experts <= 2^31): an OR and a subtract
    // per id, where a 32-bit unsigned max has no SSE2 instruction and made the loop 2.5x slower.
    const auto last = static_cast<std::uint32_t>(num_experts_ - 1);
    std::uint32_t any = 0;
    switch (width_) {
      case 1:
        for (std::size_t i = 0; i < n; ++i) {
          const auto v = static_cast<std::uint32_t>(ids[i]);
          out[i] = static_cast<unsigned char>(v);
          any |= v | (last - v);
        }
        break;
      case 2:
        for (std::size_t i = 0; i < n; ++i) {
          const auto v = static_cast<std::uint32_t>(ids[i]);
          out[2 * i] = static_cast<unsigned char>(v);
          out[2 * i + 1] = static_cast<unsigned char>(v >> 8);
          any |= v | (last - v);
        }
        break;
      default:
        for (std::size_t i = 0; i < n; ++i) {
          const auto v = static_cast<std::uint32_t>(ids[i]);
          store_id(out + 4 * i, 4, v);
          any |= v | (last - v);
        }
    }
    return (any >> 31) == 0;
  }

  // `count` rows of k ids, `stride` ids apart, to their encoding (contiguous rows in one loop);
  // false when an id is out of range.
  [[nodiscard]] bool encode_rows(const std::int32_t* __restrict ids, std::size_t stride, std::size_t count,
                                 unsigned char* __restrict out) const {
    if (stride == k_) return encode_ids(ids, count * k_, out);
    bool ok = true;
    for (std::size_t r = 0; r < count; ++r) ok &= encode_ids(ids + r * stride, k_, out + r * row_bytes());
    return ok;
  }

  // `rows` stored rows, `stride` bytes apart, to ids (already range-checked when verified; Id holds
  // every id of the file: the caller checked). 1-byte ids into 1-byte ids are copies.
  template <class Id>
  void decode_rows(const unsigned char* __restrict src, std::uint32_t stride, std::size_t rows,
                   Id* __restrict out) const {
    if (stride == row_bytes()) {  // a contiguous block: one copy or widening loop
      decode_ids(src, width_, rows * k_, out);
      return;
    }
    if (width_ == 1) {  // one layer's rows strided through a record of several layers
      switch (k_) {     // the usual top-k as constants: each row a fixed-size load and store
        case 2:
          return gather_byte_rows<2>(src, stride, rows, out);
        case 4:
          return gather_byte_rows<4>(src, stride, rows, out);
        case 6:
          return gather_byte_rows<6>(src, stride, rows, out);
        case 8:
          return gather_byte_rows<8>(src, stride, rows, out);
        default:
          break;
      }
    }
    for (std::size_t r = 0; r < rows; ++r, src += stride, out += k_) {
      if (width_ == 1) {
        if constexpr (sizeof(Id) == 1) {
          std::memcpy(out, src, k_);
        } else {
          for (std::size_t j = 0; j < k_; ++j)
            out[j] = static_cast<Id>(src[j]);
        }
      } else if (width_ == 2) {
        for (std::size_t j = 0; j < k_; ++j)
          out[j] = static_cast<Id>(route_file::detail::get<std::uint16_t>(src + 2 * j));
      } else {
        for (std::size_t j = 0; j < k_; ++j)
          out[j] = static_cast<Id>(route_file::detail::get<std::uint32_t>(src + 4 * j));
      }
    }
  }

  // A record's payload, rows of [tokens, layers] (position-major, as written), to the same rows
  // layer-major, [layers, tokens]: each layer's rows then contiguous (HeldRecords).
  void split_layers(const unsigned char* __restrict payload, std::size_t tokens, std::size_t layers,
                    unsigned char* __restrict out) const {
    const std::size_t rb = row_bytes();
    switch (rb) {  // the usual rows as constants: one load and one store each
      case 4:
        return split_layers_rows<4>(payload, tokens, layers, out, rb);
      case 6:
        return split_layers_rows<6>(payload, tokens, layers, out, rb);
      case 8:
        return split_layers_rows<8>(payload, tokens, layers, out, rb);
      case 12:
        return split_layers_rows<12>(payload, tokens, layers, out, rb);
      case 16:
        return split_layers_rows<16>(payload, tokens, layers, out, rb);
      default:
        return split_layers_rows<0>(payload, tokens, layers, out, rb);
    }
  }

  // Whether the encoded row at p holds exactly these k ids (int32, uint16 or uint8).
  template <class Id>
  bool same_row(const unsigned char* p, const Id* ids) const {
    for (std::size_t j = 0; j < k_; ++j)
      if (load_id(p + j * static_cast<std::size_t>(width_), width_) != static_cast<std::uint32_t>(ids[j])) return false;
    return true;
  }

 private:
#if defined(__SSE2__) && !defined(__AVX2__)
  // int32 ids to 1-byte ids on x86-64's baseline (SSE2, which has no 32-bit max or narrowing
  // store: the compiler's loop took ~45 instructions per 16 ids). Signed saturation to int16
  // keeps every id of [0, num_experts) (at most 256) and maps every other id outside it, so the
  // range check is an int16 min and max; the bytes are then exact for every id in range (a batch
  // with one out of range is refused). AVX2 builds keep the plain loop, which the compiler widens.
  [[nodiscard]] bool encode_bytes_sse2(const std::int32_t* __restrict ids, std::size_t n,
                                       unsigned char* __restrict out) const {
    __m128i lo = _mm_setzero_si128(), hi = _mm_setzero_si128();
    std::size_t i = 0;
    for (; i + 16 <= n; i += 16) {
      const auto* p = reinterpret_cast<const __m128i*>(ids + i);
      const __m128i ab = _mm_packs_epi32(_mm_loadu_si128(p), _mm_loadu_si128(p + 1));
      const __m128i cd = _mm_packs_epi32(_mm_loadu_si128(p + 2), _mm_loadu_si128(p + 3));
      lo = _mm_min_epi16(lo, _mm_min_epi16(ab, cd));
      hi = _mm_max_epi16(hi, _mm_max_epi16(ab, cd));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm_packus_epi16(ab, cd));
    }
    alignas(16) std::int16_t lows[8], highs[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(lows), lo);
    _mm_store_si128(reinterpret_cast<__m128i*>(highs), hi);
    const auto last = static_cast<std::uint32_t>(num_experts_ - 1);
    std::uint32_t any = 0;  // the tail as encode_ids' loop
    for (; i < n; ++i) {
      const auto v = static_cast<std::uint32_t>(ids[i]);
      out[i] = static_cast<unsigned char>(v);
      any |= v | (last - v);
    }
    return (any >> 31) == 0 && *std::min_element(lows, lows + 8) >= 0 &&
           *std::max_element(highs, highs + 8) <= static_cast<std::int32_t>(last);
  }
#endif

  // `rows` rows of K 1-byte ids, `stride` bytes apart, to contiguous rows of ids. With K a constant
  // a row is one load and one store (a memcpy of k_ bytes was a libc call per row: 82% of a
  // replay of records of several layers).
  template <std::size_t K, class Id>
  static void gather_byte_rows(const unsigned char* __restrict src, std::size_t stride, std::size_t rows,
                               Id* __restrict out) {
    for (std::size_t r = 0; r < rows; ++r, src += stride, out += K) {
      unsigned char row[K];
      std::memcpy(row, src, K);
      if constexpr (sizeof(Id) == 1) {
        std::memcpy(out, row, K);
      } else {
        for (std::size_t j = 0; j < K; ++j)
          out[j] = static_cast<Id>(row[j]);
      }
    }
  }

  // RowBytes: the row's bytes as a constant (one load and store a row), or 0 for `row_bytes`.
  template <std::size_t RowBytes>
  static void split_layers_rows(const unsigned char* __restrict payload, std::size_t tokens, std::size_t layers,
                                unsigned char* __restrict out, std::size_t row_bytes) {
    const std::size_t rb = RowBytes != 0 ? RowBytes : row_bytes;
    // In blocks of tokens small enough that a block's rows of every layer stay in L1 while each
    // layer's rows are gathered: a layer's strided rows read straight through the whole record
    // stalled on every row, and a store stream per layer (16 KiB apart) was slower still.
    const std::size_t block = std::max<std::size_t>(8, (std::size_t{24} << 10) / (layers * rb));  // 64 at 48 x 8
    for (std::size_t t0 = 0; t0 < tokens; t0 += block) {
      const std::size_t t1 = t0 + block < tokens ? t0 + block : tokens;
      std::size_t l = 0;
#if defined(__SSE2__)
      // 8-byte rows (top-8 of 1-byte ids, top-4 of 2-byte ones) in 2 x 2 blocks, two tokens of two
      // layers: two 16-byte loads, two unpacks and two stores where rows took four of each. A third
      // less time splitting an R3 record (perf, 64 records of 2,048 tokens x 48 layers).
      if constexpr (RowBytes == 8) {
        for (; l + 2 <= layers; l += 2) {
          std::size_t t = t0;
          for (; t + 2 <= t1; t += 2) {
            const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(payload + (t * layers + l) * 8));
            const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(payload + ((t + 1) * layers + l) * 8));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(out + (l * tokens + t) * 8), _mm_unpacklo_epi64(a, b));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(out + ((l + 1) * tokens + t) * 8), _mm_unpackhi_epi64(a, b));
          }
          for (; t < t1; ++t) {
            std::memcpy(out + (l * tokens + t) * 8, payload + (t * layers + l) * 8, 8);
            std::memcpy(out + ((l + 1) * tokens + t) * 8, payload + (t * layers + l + 1) * 8, 8);
          }
        }
      }
#endif
      for (; l < layers; ++l)
        for (std::size_t t = t0; t < t1; ++t)
          std::memcpy(out + (l * tokens + t) * rb, payload + (t * layers + l) * rb, rb);
    }
  }

  // The largest of n bytes. A byte accumulator, so that it vectorises to byte maxima (16 or more
  // bytes an instruction); a 32-bit one made it a scalar loop, 2.5x the cost of the XXH64 beside it.
  static std::uint32_t max_byte(const unsigned char* __restrict p, std::size_t n) {
    unsigned char top = 0;
    for (std::size_t i = 0; i < n; ++i)
      top = p[i] > top ? p[i] : top;
    return top;
  }

  std::size_t k_ = 1;
  std::int64_t num_experts_ = 1;
  int width_ = 1;
  std::uint16_t version_ = route_file::kVersion;
};

// What is wrong with a routes record's header (empty when nothing): every field against the
// file's header, the position bound and `limit` (where the record must end: the next record, or
// `file_end`), checked before anything is sized from it.
inline std::string route_record_problem(const route_file::RecordHeader& h, const route_file::FileHeader& file,
                                        std::uint64_t offset, std::uint64_t limit, std::uint64_t file_end) {
  const RouteShape& s = file.shape;
  if (h.num_layers == 0 || h.first_layer + h.num_layers > s.num_layers)
    return str("a record of sequence uid ", h.uid, " has first_layer ", h.first_layer, " and num_layers ", h.num_layers,
               ", outside the file's ", s.num_layers, " layers");
  if (h.first_position < 0 || h.first_position > kMaxPositions - std::int64_t{h.num_tokens})
    return str("a record of sequence uid ", h.uid, " has first_position ", h.first_position, " and num_tokens ",
               h.num_tokens, "; positions must be in [0, 2^32)");
  std::uint64_t expect = 0;
  if (!checked_product(expect, std::uint64_t{h.num_tokens}, h.num_layers, s.topk, file.id_width) ||
      h.payload_bytes != expect)
    return str("a record of sequence uid ", h.uid, " has payload_bytes ", h.payload_bytes,
               " where num_tokens x num_layers x topk x id width = ", h.num_tokens, " x ", h.num_layers, " x ", s.topk,
               " x ", int{file.id_width});
  const std::uint64_t room = offset <= limit && limit - offset >= route_file::kRecordHeaderBytes
                                 ? limit - offset - route_file::kRecordHeaderBytes
                                 : 0;
  if (offset > limit || limit - offset < route_file::kRecordHeaderBytes || h.payload_bytes > room ||
      route_file::padded(h.payload_bytes) > room)
    return str("a record of sequence uid ", h.uid, " has payload_bytes ", h.payload_bytes,
               limit == file_end ? str(", past the end of the file (", file_end, " bytes)")
                                 : str(", running into the next record at offset ", limit));
  return {};
}

// An allocator whose value-less construct leaves bytes uninitialised: RecordBatch grows its buffer
// by the record's size and writes every byte itself (header, payload, padding), so zeroing it
// first was a memset of every record, 4% of a write's time in perf.
template <class T>
struct UninitializedAllocator : std::allocator<T> {
  template <class U>
  struct rebind {
    using other = UninitializedAllocator<U>;
  };
  UninitializedAllocator() = default;
  template <class U>
  UninitializedAllocator(const UninitializedAllocator<U>&) noexcept {}
  template <class U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};

// Routes records encoded in memory, header and checksum included, so that one record call
// reaches the file in one write.
class RecordBatch {
 public:
  struct Record {
    route_file::RecordHeader header;
    std::size_t at;  // its offset in bytes()
  };

  void clear() {
    bytes_.clear();
    records_.clear();
  }
  using Bytes = std::vector<unsigned char, UninitializedAllocator<unsigned char>>;

  bool empty() const { return bytes_.empty(); }
  const Bytes& bytes() const { return bytes_; }
  const std::vector<Record>& records() const { return records_; }

  // Reserves a routes record and returns where its payload goes (the caller encodes the ids
  // there, then calls finish()).
  unsigned char* begin(const RouteCodec& codec, SequenceId uid, std::int64_t first_position, std::uint32_t num_tokens,
                       int first_layer, int num_layers) {
    const route_file::RecordHeader h = codec.routes_header(uid, first_position, num_tokens, first_layer, num_layers);
    version_ = codec.version();
    const std::size_t at = bytes_.size();
    const auto bytes = static_cast<std::size_t>(route_file::record_bytes(h.payload_bytes));
    if (bytes_.capacity() < at + bytes) bytes_.reserve(std::max(at + bytes, 2 * bytes_.capacity()));
    bytes_.resize(at +
                  bytes);  // not zeroed: the header is written by finish, the padding below, the payload by the caller
    std::memset(bytes_.data() + at + route_file::kRecordHeaderBytes + h.payload_bytes, 0,
                bytes - route_file::kRecordHeaderBytes - static_cast<std::size_t>(h.payload_bytes));
    records_.push_back({h, at});
    return bytes_.data() + at + route_file::kRecordHeaderBytes;
  }

  // Writes the header (with its checksum over the payload now in place) of the record begun last.
  void finish() {
    Record& r = records_.back();
    route_file::encode(version_, r.header, bytes_.data() + r.at + route_file::kRecordHeaderBytes, bytes_.data() + r.at);
  }

 private:
  Bytes bytes_;
  std::vector<Record> records_;
  std::uint16_t version_ = route_file::kVersion;  // the file's, from the codec of begin()
};

// The bytes of an index record holding `index_payload` followed by the tail record pointing at it,
// for a file of format `version` and id `file_id` whose records end (and whose index starts) at
// `index_offset`.
inline std::vector<unsigned char> encode_index_and_tail(std::uint16_t version, std::uint64_t file_id,
                                                        std::span<const unsigned char> index_payload,
                                                        std::uint64_t index_offset) {
  const auto tail_at = static_cast<std::size_t>(route_file::record_bytes(index_payload.size()));
  std::vector<unsigned char> buffer(tail_at + static_cast<std::size_t>(route_file::record_bytes(8)), 0);
  route_file::RecordHeader ih;
  ih.type = route_file::RecordType::index;
  ih.uid = route_file::index_and_tail_uid(version, file_id);
  ih.payload_bytes = index_payload.size();
  if (!index_payload.empty())
    std::memcpy(buffer.data() + route_file::kRecordHeaderBytes, index_payload.data(), index_payload.size());
  route_file::encode(version, ih, index_payload.data(), buffer.data());
  unsigned char tail_payload[8];
  route_file::detail::put<std::uint64_t>(tail_payload, index_offset);
  route_file::RecordHeader th;
  th.type = route_file::RecordType::tail;
  th.uid = route_file::index_and_tail_uid(version, file_id);
  th.payload_bytes = 8;
  std::memcpy(buffer.data() + tail_at + route_file::kRecordHeaderBytes, tail_payload, 8);
  route_file::encode(version, th, tail_payload, buffer.data() + tail_at);
  return buffer;
}

// The index offset a tail record (its kRecordHeaderBytes + 8 bytes) points at, or nothing when
// those bytes are not an intact tail record of the file of format `version` and id `file_id`
// (from version 3 a tail names its file: bytes that a routes record holds cannot pass for one).
inline std::optional<std::uint64_t> decode_tail(std::uint16_t version, std::uint64_t file_id,
                                                const unsigned char* tail) {
  route_file::RecordHeader th;
  if (!route_file::decode(tail, th) || th.type != route_file::RecordType::tail || th.payload_bytes != 8 ||
      th.uid != route_file::index_and_tail_uid(version, file_id) ||
      route_file::checksum(version, tail, tail + route_file::kRecordHeaderBytes, 8) != th.checksum)
    return std::nullopt;
  return route_file::detail::get<std::uint64_t>(tail + route_file::kRecordHeaderBytes);
}

}  // namespace detail
MRR_NAMESPACE_END
