// What every communicator does before it moves data: each rank describes the collective it is
// entering in a fixed-width record, the records are exchanged (all-gather), and every rank runs
// the same validation over the same table, so a mismatch throws the same error on every rank
// instead of hanging one of them or delivering garbage. Shared by the in-process, MPI and NCCL
// communicators; the rank-order sum lives here too so all of them add in the same order.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>

#include <algorithm>
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

enum class CollectiveOp : std::uint64_t { all_to_all_v = 1, all_gather = 2, broadcast = 3, all_reduce_sum = 4 };

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
  }
  return "an unknown collective";
}

// A tag naming the element type, so ranks that disagree on it are told so (a float sent to a
// rank that receives doubles is garbage, not an error, in MPI and NCCL).
template <class T>
constexpr std::uint64_t element_tag() {
  if constexpr (std::is_same_v<T, float>)
    return 1;
  else if constexpr (std::is_same_v<T, double>)
    return 2;
  else if constexpr (std::is_integral_v<T> && std::is_signed_v<T>)
    return 10 + sizeof(T);
  else if constexpr (std::is_integral_v<T>)
    return 20 + sizeof(T);
  else
    return 1000 + sizeof(T);  // any other trivially copyable type: by size
}

inline std::string element_name(std::uint64_t tag) {
  if (tag == 1) return "float";
  if (tag == 2) return "double";
  if (tag > 10 && tag <= 18) return str("int", 8 * (tag - 10));
  if (tag > 20 && tag <= 28) return str("uint", 8 * (tag - 20));
  return str("a ", tag - 1000, "-byte type");
}

// Record layout, one row per rank: [op, element tag, a, b, c, d, counts[2P]]. all_to_all_v:
// a/b = send/recv buffer sizes, c/d = number of send/recv counts, then send counts and recv
// counts; all_gather: a/b = send/recv sizes; broadcast: a = size, b = root; all_reduce_sum:
// a = size.
inline std::size_t collective_record_width(int ranks) {
  return 6 + 2 * static_cast<std::size_t>(ranks);
}

template <class T>
void describe_collective(std::span<std::uint64_t> record, CollectiveOp op, std::uint64_t a, std::uint64_t b = 0,
                         std::span<const std::size_t> send_counts = {}, std::span<const std::size_t> recv_counts = {}) {
  const std::size_t ranks = (record.size() - 6) / 2;
  std::fill(record.begin(), record.end(), std::uint64_t{0});
  record[0] = static_cast<std::uint64_t>(op);
  record[1] = element_tag<T>();
  record[2] = a;
  record[3] = b;
  record[4] = send_counts.size();
  record[5] = recv_counts.size();
  if (send_counts.size() == ranks)
    for (std::size_t p = 0; p < ranks; ++p)
      record[6 + p] = send_counts[p];
  if (recv_counts.size() == ranks)
    for (std::size_t p = 0; p < ranks; ++p)
      record[6 + ranks + p] = recv_counts[p];
}

// Validates the exchanged table (ranks rows of collective_record_width) and throws on every rank
// alike: CommunicatorError when ranks entered different collectives, InvalidArgument when their
// arguments disagree. `count_limit` bounds every count and offset (INT_MAX for MPI's int API).
inline void check_collective(std::string_view function, int ranks, std::span<const std::uint64_t> table,
                             std::uint64_t count_limit = std::numeric_limits<std::uint64_t>::max()) {
  const std::size_t width = collective_record_width(ranks);
  const auto P = static_cast<std::size_t>(ranks);
  auto at = [&](std::size_t rank, std::size_t field) { return table[rank * width + field]; };
  for (std::size_t r = 1; r < P; ++r) {
    if (at(r, 0) != at(0, 0) || at(r, 1) != at(0, 1))
      throw CommunicatorError(str("mrr::", function, ": rank ", r, " calls ", collective_name(at(r, 0)), "<",
                                  element_name(at(r, 1)), "> while rank 0 calls ", collective_name(at(0, 0)), "<",
                                  element_name(at(0, 1)), "> (every rank must call the same collectives in order)"));
  }
  auto within_limit = [&](std::uint64_t n, const char* what, std::size_t rank) {
    require(n <= count_limit, function, "rank ", rank, "'s ", what, " (", n,
            " elements) exceeds this transport's limit of ", count_limit, " elements per call; split the exchange");
  };
  switch (static_cast<CollectiveOp>(at(0, 0))) {
    case CollectiveOp::all_to_all_v: {
      for (std::size_t r = 0; r < P; ++r) {
        require(at(r, 4) == P && at(r, 5) == P, function, "rank ", r, " passes ", at(r, 4), " send counts and ",
                at(r, 5), " recv counts; each must have one entry per rank (", P, ")");
      }
      for (std::size_t r = 0; r < P; ++r) {
        std::uint64_t sent = 0, received = 0;
        for (std::size_t p = 0; p < P; ++p) {
          within_limit(at(r, 6 + p), "send count", r);
          within_limit(at(r, 6 + P + p), "recv count", r);
          sent += at(r, 6 + p);
          received += at(r, 6 + P + p);
        }
        within_limit(sent, "total send count", r);
        within_limit(received, "total recv count", r);
        require(sent <= at(r, 2), function, "rank ", r, "'s send counts add up to ", sent,
                " elements but its send buffer has ", at(r, 2));
        require(received <= at(r, 3), function, "rank ", r, "'s recv counts add up to ", received,
                " elements but its recv buffer has ", at(r, 3));
      }
      for (std::size_t a = 0; a < P; ++a) {
        for (std::size_t b = 0; b < P; ++b) {
          require(at(a, 6 + b) == at(b, 6 + P + a), function, "rank ", a, " sends ", at(a, 6 + b), " elements to rank ",
                  b, ", which expects ", at(b, 6 + P + a), " from it");
        }
      }
      return;
    }
    case CollectiveOp::all_gather: {
      for (std::size_t r = 0; r < P; ++r) {
        require(at(r, 2) == at(0, 2), function, "rank ", r, " sends ", at(r, 2), " elements but rank 0 sends ",
                at(0, 2), " (all_gather needs equal sizes on every rank)");
        require(at(r, 3) == P * at(r, 2), function, "rank ", r, "'s recv buffer has ", at(r, 3), " elements for ", P,
                " ranks x ", at(r, 2));
      }
      within_limit(at(0, 3), "recv buffer", 0);
      return;
    }
    case CollectiveOp::broadcast: {
      require(at(0, 3) < P, function, "root ", static_cast<std::int64_t>(at(0, 3)), " outside [0, ", P, ")");
      for (std::size_t r = 0; r < P; ++r) {
        require(at(r, 3) == at(0, 3), function, "rank ", r, " names root ", static_cast<std::int64_t>(at(r, 3)),
                " but rank 0 names ", at(0, 3));
        require(at(r, 2) == at(0, 2), function, "rank ", r, " has ", at(r, 2), " elements but rank 0 has ", at(0, 2),
                " (broadcast needs equal sizes on every rank)");
      }
      within_limit(at(0, 2), "buffer", 0);
      return;
    }
    case CollectiveOp::all_reduce_sum: {
      for (std::size_t r = 0; r < P; ++r) {
        require(at(r, 2) == at(0, 2), function, "rank ", r, " has ", at(r, 2), " elements but rank 0 has ", at(0, 2),
                " (all_reduce_sum needs equal sizes on every rank)");
      }
      within_limit(at(0, 2) + P, "buffer", 0);
      return;
    }
  }
  throw CommunicatorError(str("mrr::", function, ": unknown collective ", at(0, 0)));
}

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
