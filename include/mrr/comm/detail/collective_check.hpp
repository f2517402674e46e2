// What every communicator does before it moves data: each rank describes the collective it is
// entering in a fixed-width record, the records are exchanged (all-gather), and every rank runs
// the same validation over the same table, so a mismatch throws the same error on every rank
// instead of hanging one of them or delivering garbage. Shared by every communicator (the
// single-process one checks its one record the same way); the rank-order sum lives here too so
// all of them add in the same order.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

MRR_NAMESPACE_BEGIN

namespace detail {

// `barrier` is checked like the data collectives (a rank in barrier() facing one in
// all_to_all_v would otherwise pass its barrier on the peer's first synchronisation and leave
// while the peer still reads its buffers). `leave` is posted by an MpiCommunicator being
// destroyed, so peers still calling collectives learn that this rank is gone instead of waiting.
enum class CollectiveOp : std::uint64_t {
  all_to_all_v = 1,
  all_gather = 2,
  broadcast = 3,
  all_reduce_sum = 4,
  barrier = 5,
  leave = 6,
  all_to_all_rows = 7,
};

inline const char* collective_name(std::uint64_t op) {
  switch (static_cast<CollectiveOp>(op)) {
    case CollectiveOp::all_to_all_v:
      return "all_to_all_v";
    case CollectiveOp::all_gather:
      return "all_gather";
    case CollectiveOp::broadcast:
      return "broadcast";
    case CollectiveOp::all_reduce_sum:
      return "all_reduce_sum";
    case CollectiveOp::barrier:
      return "barrier";
    case CollectiveOp::leave:
      return "leave";
    case CollectiveOp::all_to_all_rows:
      return "all_to_all_rows";
  }
  return "an unknown collective";
}

// A tag naming the element type, so ranks that disagree on it are told so (a float sent to a
// rank that receives doubles is garbage, not an error, in MPI and NCCL). 0: no elements.
template <class T>
constexpr std::uint64_t element_tag() {
  if constexpr (std::is_same_v<T, float>)
    return 1;
  else if constexpr (std::is_same_v<T, double>)
    return 2;
  else if constexpr (std::is_integral_v<T> && std::is_signed_v<T>)
    return 100 + sizeof(T);  // ranges wide enough for 16-byte integers (__int128)
  else if constexpr (std::is_integral_v<T>)
    return 200 + sizeof(T);
  else
    return 1000 + sizeof(T);  // any other trivially copyable type: by size
}

inline std::string element_name(std::uint64_t tag) {
  if (tag == 1) return "float";
  if (tag == 2) return "double";
  if (tag > 100 && tag < 200) return str("int", 8 * (tag - 100));
  if (tag > 200 && tag < 300) return str("uint", 8 * (tag - 200));
  if (tag >= 1000) return str("a ", tag - 1000, "-byte type");
  return str("element type ", tag);
}

// What a rank is doing, for messages: "calls all_gather<float>", "calls barrier".
inline std::string describe_call(std::uint64_t op, std::uint64_t tag) {
  if (op == static_cast<std::uint64_t>(CollectiveOp::leave))
    return "has destroyed its MpiCommunicator (it returned or threw, and calls no more collectives)";
  if (tag == 0) return str("calls ", collective_name(op));
  return str("calls ", collective_name(op), "<", element_name(tag), ">");
}

// Record layout, one row per rank: [op, element tag, a, b, c, d, flags, counts[2P]].
// all_to_all_v: a/b = send/recv buffer sizes, c/d = number of send/recv counts, then send counts
// and recv counts; all_gather: a/b = send/recv sizes; broadcast: a = size, b = root;
// all_reduce_sum: a = size; all_to_all_rows: a/b = send/recv buffer rows, c = elements per row,
// d = P, then the rows sent to and received from every rank; barrier and leave: nothing. Flags are local facts every
// rank must learn, so a rank's bad call fails on every rank.
enum RecordField : std::size_t { op_field, type_field, a_field, b_field, c_field, d_field, flags_field, counts_field };
inline constexpr std::uint64_t buffers_overlap_flag = 1;
inline constexpr std::uint64_t malformed_row_blocks_flag = 2;  // all_to_all_rows (comm/row_blocks.hpp)
inline constexpr std::uint64_t host_memory_flag = 4;           // NcclCommunicator: a buffer NCCL cannot read
inline constexpr std::uint64_t scratch_failed_flag = 8;        // NcclCommunicator: its scratch memory could not be had

inline std::size_t collective_record_width(int ranks) {
  return counts_field + 2 * static_cast<std::size_t>(ranks);
}

// Whether two buffers share a byte (empty ones share none). Device pointers of one process live
// in one address space too, so this holds for NCCL's buffers as well.
template <class T>
bool buffers_overlap(std::span<const T> a, std::span<const T> b) {
  if (a.empty() || b.empty()) return false;
  const auto a0 = reinterpret_cast<std::uintptr_t>(a.data()), b0 = reinterpret_cast<std::uintptr_t>(b.data());
  return a0 < b0 + b.size_bytes() && b0 < a0 + a.size_bytes();
}

// Fills one rank's record; `tag` is element_tag<T>() (describe_collective<T>) or 0 (barrier, leave).
inline void describe_collective_tagged(std::span<std::uint64_t> record, CollectiveOp op, std::uint64_t tag,
                                       std::uint64_t a = 0, std::uint64_t b = 0,
                                       std::span<const std::size_t> send_counts = {},
                                       std::span<const std::size_t> recv_counts = {}, std::uint64_t flags = 0) {
  const std::size_t ranks = (record.size() - counts_field) / 2;
  std::fill(record.begin(), record.end(), std::uint64_t{0});
  record[op_field] = static_cast<std::uint64_t>(op);
  record[type_field] = tag;
  record[a_field] = a;
  record[b_field] = b;
  record[c_field] = send_counts.size();
  record[d_field] = recv_counts.size();
  record[flags_field] = flags;
  if (send_counts.size() == ranks)
    std::copy(send_counts.begin(), send_counts.end(), record.begin() + counts_field);
  if (recv_counts.size() == ranks)
    std::copy(recv_counts.begin(), recv_counts.end(), record.begin() + counts_field + ranks);
}

template <class T>
void describe_collective(std::span<std::uint64_t> record, CollectiveOp op, std::uint64_t a, std::uint64_t b = 0,
                         std::span<const std::size_t> send_counts = {}, std::span<const std::size_t> recv_counts = {},
                         std::uint64_t flags = 0) {
  describe_collective_tagged(record, op, element_tag<T>(), a, b, send_counts, recv_counts, flags);
}

// The records of the collectives that take separate send and recv buffers.
template <class T>
void describe_all_to_all_v(std::span<std::uint64_t> record, std::span<const T> send,
                           std::span<const std::size_t> send_counts, std::span<const T> recv,
                           std::span<const std::size_t> recv_counts) {
  describe_collective<T>(record, CollectiveOp::all_to_all_v, send.size(), recv.size(), send_counts, recv_counts,
                         buffers_overlap(send, recv) ? buffers_overlap_flag : 0);
}

template <class T>
void describe_all_gather(std::span<std::uint64_t> record, std::span<const T> send, std::span<const T> recv) {
  describe_collective<T>(record, CollectiveOp::all_gather, send.size(), recv.size(), {}, {},
                         buffers_overlap(send, recv) ? buffers_overlap_flag : 0);
}

// Validates the exchanged table (ranks rows of collective_record_width) and throws on every rank
// alike: CommunicatorError when ranks entered different collectives, InvalidArgument when their
// arguments disagree. `count_limit` bounds every count and offset (INT_MAX for MPI's int API).
inline void check_collective(std::string_view function, int ranks, std::span<const std::uint64_t> table,
                             std::uint64_t count_limit = std::numeric_limits<std::uint64_t>::max()) {
  const std::size_t width = collective_record_width(ranks);
  const auto P = static_cast<std::size_t>(ranks);
  auto at = [&](std::size_t rank, std::size_t field) { return table[rank * width + field]; };
  auto count = [&](std::size_t rank, std::size_t i) { return at(rank, counts_field + i); };
  for (std::size_t r = 1; r < P; ++r) {
    if (at(r, op_field) != at(0, op_field) || at(r, type_field) != at(0, type_field))
      throw CommunicatorError(str("mrr::", function, ": rank ", r, " ",
                                  describe_call(at(r, op_field), at(r, type_field)), " while rank 0 ",
                                  describe_call(at(0, op_field), at(0, type_field)),
                                  " (every rank must call the same collectives in the same order)"));
  }
  for (std::size_t r = 0; r < P; ++r) {
    require((at(r, flags_field) & buffers_overlap_flag) == 0, function, "rank ", r,
            "'s send and recv buffers overlap (in-place ", collective_name(at(r, op_field)),
            " is not supported: the transport reads one while it writes the other; use separate buffers)");
  }
  for (std::size_t r = 0; r < P; ++r) {
    require((at(r, flags_field) & host_memory_flag) == 0, function, "rank ", r, " passed a buffer that is not device ",
            "memory (NCCL reads and writes device or managed memory only; host data goes through another ",
            "communicator or is copied to the device first)");
    if ((at(r, flags_field) & scratch_failed_flag) != 0)
      throw CommunicatorError(
          str("mrr::", function, ": rank ", r, " could not allocate its scratch device memory for the collective"));
  }
  auto within_limit = [&](std::uint64_t n, const char* what, std::size_t rank) {
    require(n <= count_limit, function, "rank ", rank, "'s ", what, " (", n,
            " elements) exceeds this transport's limit of ", count_limit, " elements per call; split the exchange");
  };
  switch (static_cast<CollectiveOp>(at(0, op_field))) {
    case CollectiveOp::all_to_all_v: {
      for (std::size_t r = 0; r < P; ++r) {
        require(at(r, c_field) == P && at(r, d_field) == P, function, "rank ", r, " passes ", at(r, c_field),
                " send counts and ", at(r, d_field), " recv counts; each must have one entry per rank (", P, ")");
      }
      for (std::size_t r = 0; r < P; ++r) {
        std::uint64_t sent = 0, received = 0;
        for (std::size_t p = 0; p < P; ++p) {
          within_limit(count(r, p), "send count", r);
          within_limit(count(r, P + p), "recv count", r);
          // A sum that wraps (a count of SIZE_MAX from an unsigned n - m with m > n, say) would pass
          // the buffer checks below and copy from far outside the buffer.
          require(count(r, p) <= UINT64_MAX - sent && count(r, P + p) <= UINT64_MAX - received, function, "rank ", r,
                  "'s counts overflow a 64-bit sum (send count ", count(r, p), ", recv count ", count(r, P + p),
                  " to/from rank ", p, "): a negative count cast to unsigned?");
          sent += count(r, p);
          received += count(r, P + p);
        }
        within_limit(sent, "total send count", r);
        within_limit(received, "total recv count", r);
        require(sent <= at(r, a_field), function, "rank ", r, "'s send counts add up to ", sent,
                " elements but its send buffer has ", at(r, a_field));
        require(received <= at(r, b_field), function, "rank ", r, "'s recv counts add up to ", received,
                " elements but its recv buffer has ", at(r, b_field));
      }
      for (std::size_t a = 0; a < P; ++a) {
        for (std::size_t b = 0; b < P; ++b) {
          require(count(a, b) == count(b, P + a), function, "rank ", a, " sends ", count(a, b), " elements to rank ", b,
                  ", which expects ", count(b, P + a), " from it");
        }
      }
      return;
    }
    case CollectiveOp::all_to_all_rows: {
      for (std::size_t r = 0; r < P; ++r) {
        require((at(r, flags_field) & malformed_row_blocks_flag) == 0, function, "rank ", r,
                "'s row blocks are malformed: each list needs one entry per rank (", P,
                "), every block inside its buffer, and no row received twice");
        require(at(r, c_field) == at(0, c_field), function, "rank ", r, " moves rows of ", at(r, c_field),
                " elements but rank 0 rows of ", at(0, c_field));
        for (std::size_t p = 0; p < P; ++p) {
          within_limit(count(r, p), "send rows", r);
          within_limit(count(r, P + p), "recv rows", r);
        }
      }
      for (std::size_t a = 0; a < P; ++a) {
        for (std::size_t b = 0; b < P; ++b) {
          require(count(a, b) == count(b, P + a), function, "rank ", a, " sends ", count(a, b), " rows to rank ", b,
                  ", which expects ", count(b, P + a), " from it");
        }
      }
      return;
    }
    case CollectiveOp::all_gather: {
      for (std::size_t r = 0; r < P; ++r) {
        require(at(r, a_field) == at(0, a_field), function, "rank ", r, " sends ", at(r, a_field),
                " elements but rank 0 sends ", at(0, a_field), " (all_gather needs equal sizes on every rank)");
        require(at(r, a_field) <= UINT64_MAX / P && at(r, b_field) == P * at(r, a_field), function, "rank ", r,
                "'s recv buffer has ", at(r, b_field), " elements for ", P, " ranks x ", at(r, a_field));
      }
      within_limit(at(0, b_field), "recv buffer", 0);
      return;
    }
    case CollectiveOp::broadcast: {
      require(at(0, b_field) < P, function, "root ", static_cast<std::int64_t>(at(0, b_field)), " outside [0, ", P,
              ")");
      for (std::size_t r = 0; r < P; ++r) {
        require(at(r, b_field) == at(0, b_field), function, "rank ", r, " names root ",
                static_cast<std::int64_t>(at(r, b_field)), " but rank 0 names ", at(0, b_field));
        require(at(r, a_field) == at(0, a_field), function, "rank ", r, " has ", at(r, a_field),
                " elements but rank 0 has ", at(0, a_field), " (broadcast needs equal sizes on every rank)");
      }
      within_limit(at(0, a_field), "buffer", 0);
      return;
    }
    case CollectiveOp::all_reduce_sum: {
      for (std::size_t r = 0; r < P; ++r) {
        require(at(r, a_field) == at(0, a_field), function, "rank ", r, " has ", at(r, a_field),
                " elements but rank 0 has ", at(0, a_field), " (all_reduce_sum needs equal sizes on every rank)");
      }
      within_limit(at(0, a_field) + P, "buffer", 0);
      return;
    }
    case CollectiveOp::barrier:
    case CollectiveOp::leave:
      return;
  }
  throw CommunicatorError(str("mrr::", function, ": unknown collective ", at(0, op_field)));
}

// One rank's record on the stack, for a group of one (SingleProcess).
using SingleRankRecord = std::array<std::uint64_t, counts_field + 2>;

// Offsets of blocks laid out contiguously in rank order.
inline std::vector<std::size_t> block_offsets(std::span<const std::size_t> counts) {
  std::vector<std::size_t> offsets(counts.size());
  std::size_t offset = 0;
  for (std::size_t p = 0; p < counts.size(); ++p) {
    offsets[p] = offset;
    offset += counts[p];
  }
  return offsets;
}

// out[i] = ((in[0][i] + in[1][i]) + in[2][i]) + ...: the one summation order every communicator
// uses, so the sum is bitwise the same on every rank and for every transport.
template <class T, class Rows>
void sum_in_rank_order(const Rows& rows, std::size_t ranks, std::span<T> out) {
  const T* first = rows(0);
  for (std::size_t i = 0; i < out.size(); ++i)
    out[i] = first[i];
  for (std::size_t p = 1; p < ranks; ++p) {
    const T* row = rows(p);
    for (std::size_t i = 0; i < out.size(); ++i)
      out[i] = static_cast<T>(out[i] + row[i]);
  }
}

template <class T>
constexpr bool summable = std::is_arithmetic_v<T> && !std::is_same_v<T, bool>;

}  // namespace detail

MRR_NAMESPACE_END
