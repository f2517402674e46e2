// Binary layout of route files (docs/route-file-format.md): a 64-byte header, then append-only
// records, each checksummed (XXH3-64 from format version 2, XXH64 in version 1); a cleanly closed
// file ends with an index record and a tail record pointing at it. Little-endian throughout.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/detail/xxhash.hpp>
#include <mrr/error.hpp>
#include <mrr/replay/shape.hpp>

#include <bit>
#include <cstdint>
#include <cstring>
#include <string>

MRR_NAMESPACE_BEGIN
namespace route_file {

static_assert(std::endian::native == std::endian::little,
              "mrr route files are little-endian and this implementation writes host order; "
              "a big-endian port needs byte swapping in route_file::put/get");

inline constexpr char kFileMagic[8] = {'M', 'R', 'R', 'R', 'O', 'U', 'T', 'E'};
inline constexpr char kRecordMagic[4] = {'M', 'R', 'R', 'R'};
// New files are written in kVersion; files of every version from kOldestVersion are read, and
// appended to in their own version. Version 2 changed the records' checksum (XXH64 -> XXH3-64: a
// first read of a record hashes it, and XXH3 does so 1.7-3.4x faster) and the index entries
// (they carry each record's rows, so a first read needs no header reads). Version 3 binds the index
// and tail records to their file: their headers carry the file id, so ids that a routes record
// holds can never pass for the tail of a file that was not closed (nothing else changed).
inline constexpr std::uint16_t kVersion = 3;
inline constexpr std::uint16_t kOldestVersion = 1;
inline constexpr bool version_supported(unsigned v) {
  return v >= kOldestVersion && v <= kVersion;
}
// An index entry: {uid, offset} in version 1; version 2 adds what the record's header says of its
// rows {first_position, num_tokens, first_layer, num_layers}, so a reader finds a sequence's rows
// without reading its records' headers first.
inline constexpr std::size_t index_entry_bytes(unsigned version) {
  return version >= 2 ? 32 : 16;
}
// The sequence uid field of index and tail record headers: the file id from version 3, else 0.
inline constexpr std::uint64_t index_and_tail_uid(unsigned version, std::uint64_t file_id) {
  return version >= 3 ? file_id : 0;
}
inline constexpr std::size_t kHeaderBytes = 64;
inline constexpr std::size_t kRecordHeaderBytes = 56;
inline constexpr std::size_t kChecksummedHeaderBytes = 40;  // record header bytes covered by its checksum
inline constexpr std::size_t kHeaderCheckedBytes = 48;      // ... and by the header check of its own

enum class RecordType : std::uint16_t { routes = 1, index = 2, tail = 3 };

struct FileHeader {
  std::uint16_t version = kVersion;
  std::uint8_t id_width = 1;
  RouteShape shape;
  // Chosen at random when the file is created (0 in files written before it existed): a reader
  // compares the header it opened with the file's current one before trusting what it read, so
  // another route file copied over an open one is an error, not its ids.
  std::uint64_t file_id = 0;
};

struct RecordHeader {
  RecordType type = RecordType::routes;
  std::uint64_t payload_bytes = 0;
  std::uint64_t uid = 0;
  std::int64_t first_position = 0;
  std::uint32_t num_tokens = 0;
  std::uint16_t first_layer = 0;
  std::uint16_t num_layers = 0;
  std::uint64_t checksum = 0;
};

inline constexpr std::uint64_t padded(std::uint64_t n) { return (n + 7) & ~std::uint64_t{7}; }
inline constexpr std::uint64_t record_bytes(std::uint64_t payload) { return kRecordHeaderBytes + padded(payload); }

namespace detail {
template <class T>
void put(unsigned char* p, T v) {
  std::memcpy(p, &v, sizeof v);
}
template <class T>
T get(const unsigned char* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
}  // namespace detail

inline void encode(const FileHeader& h, unsigned char* out /* kHeaderBytes */) {
  std::memset(out, 0, kHeaderBytes);
  std::memcpy(out, kFileMagic, 8);
  detail::put<std::uint16_t>(out + 8, h.version);
  detail::put<std::uint16_t>(out + 10, static_cast<std::uint16_t>(kHeaderBytes));
  out[12] = h.id_width;
  detail::put<std::uint32_t>(out + 16, static_cast<std::uint32_t>(h.shape.num_experts));
  detail::put<std::uint32_t>(out + 20, static_cast<std::uint32_t>(h.shape.num_layers));
  detail::put<std::uint32_t>(out + 24, static_cast<std::uint32_t>(h.shape.topk));
  detail::put<std::uint64_t>(out + 32, h.file_id);
  detail::put<std::uint64_t>(out + 56, XXH64(out, 56, 0));
}

// Empty string when valid, else what is wrong, naming the field. Every shape field is checked
// against RouteShape's bounds here, before anything is sized from it.
inline std::string decode(const unsigned char* in, FileHeader& h) {
  if (std::memcmp(in, kFileMagic, 8) != 0) return "it is not an mrr route file (bad magic)";
  if (detail::get<std::uint64_t>(in + 56) != XXH64(in, 56, 0)) return "its header fails its checksum";
  h.version = detail::get<std::uint16_t>(in + 8);
  if (!version_supported(h.version))
    return mrr::detail::str("it has format version ", h.version, ", which this mrr does not read (it reads versions ",
                            kOldestVersion, " to ", kVersion, "; a newer mrr wrote it)");
  if (detail::get<std::uint16_t>(in + 10) != kHeaderBytes)
    return mrr::detail::str("it has an unexpected header size ", detail::get<std::uint16_t>(in + 10));
  const auto experts = detail::get<std::uint32_t>(in + 16);
  const auto layers = detail::get<std::uint32_t>(in + 20);
  const auto topk = detail::get<std::uint32_t>(in + 24);
  if (experts == 0 || experts > 0x7fffffffu)
    return mrr::detail::str("its header has num_experts = ", experts, " (must be in [1, 2^31))");
  if (layers == 0 || layers > static_cast<std::uint32_t>(RouteShape::kMaxLayers))
    return mrr::detail::str("its header has num_layers = ", layers, " (must be in [1, ", RouteShape::kMaxLayers, "])");
  if (topk == 0 || topk > experts || topk > static_cast<std::uint32_t>(RouteShape::kMaxTopk))
    return mrr::detail::str("its header has topk = ", topk, " (must be in [1, min(num_experts = ", experts, ", ",
                            RouteShape::kMaxTopk, ")])");
  h.id_width = in[12];
  h.shape.num_experts = static_cast<std::int32_t>(experts);
  h.shape.num_layers = static_cast<std::int32_t>(layers);
  h.shape.topk = static_cast<std::int32_t>(topk);
  h.file_id = detail::get<std::uint64_t>(in + 32);
  if (h.id_width != id_width_for(h.shape.num_experts))
    return mrr::detail::str("its header has id width ", int{h.id_width}, " where num_experts = ", experts, " needs ",
                            id_width_for(h.shape.num_experts));
  return "";
}

// A record's checksum, computed as its payload streams past in pieces of any size (a reader
// verifies records far larger than its buffers): a hash of the first kChecksummedHeaderBytes
// header bytes followed by the payload, XXH3-64 (seed 0) from format version 2 and XXH64 (seed 0)
// in version 1. `version` is the file's (a supported one: the header was checked).
class RecordChecksum {
 public:
  RecordChecksum(std::uint16_t version, const unsigned char* header /* kRecordHeaderBytes */) : xxh3_(version >= 2) {
    if (xxh3_) {
      XXH3_64bits_reset(&state_.xxh3);
      mrr::detail::xxh3_update(&state_.xxh3, header, kChecksummedHeaderBytes);
    } else {
      XXH64_reset(&state_.xxh64, 0);
      XXH64_update(&state_.xxh64, header, kChecksummedHeaderBytes);
    }
  }
  void update(const void* payload, std::size_t bytes) {
    if (bytes == 0) return;
    if (xxh3_)
      mrr::detail::xxh3_update(&state_.xxh3, payload, bytes);
    else
      XXH64_update(&state_.xxh64, payload, bytes);
  }
  std::uint64_t digest() const { return xxh3_ ? XXH3_64bits_digest(&state_.xxh3) : XXH64_digest(&state_.xxh64); }

 private:
  union State {
    XXH64_state_t xxh64;
    XXH3_state_t xxh3;
  } state_;
  bool xxh3_;
};

inline std::uint64_t checksum(std::uint16_t version, const unsigned char* header /* kRecordHeaderBytes */,
                              const void* payload, std::size_t payload_bytes) {
  RecordChecksum c(version, header);
  c.update(payload, payload_bytes);
  return c.digest();
}

// The header check, in every version: the low 32 bits of XXH64 of the first 48 header bytes. It
// lets a reader trust a record's size before it has the payload, so a torn write (a valid header
// whose payload runs past the end of the file) is told apart from damage (a header that is not
// what was written).
inline std::uint32_t header_check(const unsigned char* header) {
  return static_cast<std::uint32_t>(XXH64(header, kHeaderCheckedBytes, 0));
}

// Writes the record header for `h` (checksum computed over it and the payload, as format
// `version` defines it) to out.
inline void encode(std::uint16_t version, RecordHeader& h, const void* payload,
                   unsigned char* out /* kRecordHeaderBytes */) {
  std::memset(out, 0, kRecordHeaderBytes);
  std::memcpy(out, kRecordMagic, 4);
  detail::put<std::uint16_t>(out + 4, static_cast<std::uint16_t>(h.type));
  detail::put<std::uint64_t>(out + 8, h.payload_bytes);
  detail::put<std::uint64_t>(out + 16, h.uid);
  detail::put<std::int64_t>(out + 24, h.first_position);
  detail::put<std::uint32_t>(out + 32, h.num_tokens);
  detail::put<std::uint16_t>(out + 36, h.first_layer);
  detail::put<std::uint16_t>(out + 38, h.num_layers);
  h.checksum = checksum(version, out, payload, static_cast<std::size_t>(h.payload_bytes));
  detail::put<std::uint64_t>(out + 40, h.checksum);
  detail::put<std::uint32_t>(out + 48, header_check(out));
}

// Parses a record header; false when the magic, the type or the header check is wrong (the
// checksum over header and payload is checked with the payload, by the caller).
inline bool decode(const unsigned char* in, RecordHeader& h) {
  if (std::memcmp(in, kRecordMagic, 4) != 0) return false;
  if (detail::get<std::uint32_t>(in + 48) != header_check(in)) return false;
  const auto type = detail::get<std::uint16_t>(in + 4);
  if (type < 1 || type > 3) return false;
  h.type = static_cast<RecordType>(type);
  h.payload_bytes = detail::get<std::uint64_t>(in + 8);
  h.uid = detail::get<std::uint64_t>(in + 16);
  h.first_position = detail::get<std::int64_t>(in + 24);
  h.num_tokens = detail::get<std::uint32_t>(in + 32);
  h.first_layer = detail::get<std::uint16_t>(in + 36);
  h.num_layers = detail::get<std::uint16_t>(in + 38);
  h.checksum = detail::get<std::uint64_t>(in + 40);
  return true;
}

}  // namespace route_file
MRR_NAMESPACE_END
