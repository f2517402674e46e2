// The communicator test body, written once and run against every communicator (SingleProcess,
// InProcessGroup with P = 2, 3, 4, and MpiCommunicator under mpirun -np 2 and 4): each
// collective against a reference computed from the known per-rank data, several element types,
// zero-length blocks, unequal counts, repeated calls; bitwise rank-order sums; mismatched
// arguments throwing on every rank, after which the communicator still works.
#pragma once

#include <mrr/comm/single_process.hpp>
#include <mrr/concepts.hpp>
#include <mrr/error.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <vector>

namespace mrr::test::comm {

template <class T>
std::span<const T> cspan(const std::vector<T>& v) {
  return std::span<const T>(v);
}
// memcmp of n elements; n == 0 compares nothing (an empty vector's data() may be null, which
// memcmp must not be given).
template <class T>
bool same_bits(const T* a, const T* b, std::size_t n) {
  if constexpr (std::is_same_v<T, long double> && std::numeric_limits<long double>::digits == 64) {
    // x87's 80-bit value in 16 bytes: the 6 bytes of padding are not the value's (a copy of the
    // value through the FPU does not keep them).
    for (std::size_t i = 0; i < n; ++i)
      if (std::memcmp(a + i, b + i, 10) != 0) return false;
    return true;
  } else {
    return n == 0 || std::memcmp(a, b, n * sizeof(T)) == 0;
  }
}
template <class T>
std::span<T> mspan(std::vector<T>& v) {
  return std::span<T>(v);
}

// Element i of the block rank `from` sends to rank `to`: distinct per (from, to, i) modulo the
// type's range, so a block delivered to the wrong place or offset is seen.
template <class T>
T element(int from, int to, std::size_t i) {
  const auto v = static_cast<long long>(from) * 1000 + static_cast<long long>(to) * 37 + static_cast<long long>(i);
  if constexpr (std::is_floating_point_v<T>)
    return static_cast<T>(v) + static_cast<T>(0.25);
  else
    return static_cast<T>(v % 113);
}

// Elements rank `from` sends `to` in round `round`: unequal, with zero-length blocks (self
// included in some rounds).
inline std::size_t block_count(int from, int to, int round) {
  if ((from * 3 + to * 5 + round) % 4 == 0) return 0;
  return static_cast<std::size_t>((from + 2 * to + round) % 7 + 1);
}

template <class T, class Comm>
void check_all_to_all_v(const Comm& comm, int round) {
  const int P = comm.size(), me = comm.rank();
  std::vector<std::size_t> send_counts(static_cast<std::size_t>(P)), recv_counts(static_cast<std::size_t>(P));
  std::vector<T> send, expected;
  for (int p = 0; p < P; ++p) {
    send_counts[static_cast<std::size_t>(p)] = block_count(me, p, round);
    recv_counts[static_cast<std::size_t>(p)] = block_count(p, me, round);
    for (std::size_t i = 0; i < block_count(me, p, round); ++i)
      send.push_back(element<T>(me, p, i));
    for (std::size_t i = 0; i < block_count(p, me, round); ++i)
      expected.push_back(element<T>(p, me, i));
  }
  const T sentinel = static_cast<T>(99);
  std::vector<T> recv(expected.size() + 3, sentinel);  // a larger buffer: the tail stays untouched
  comm.all_to_all_v(cspan(send), cspan(send_counts), mspan(recv), cspan(recv_counts));
  expected.insert(expected.end(), 3, sentinel);
  CHECK(recv == expected);
}

template <class T, class Comm>
void check_all_gather(const Comm& comm, int round) {
  const int P = comm.size(), me = comm.rank();
  const auto n = static_cast<std::size_t>(round % 4);  // round 0: empty contributions
  std::vector<T> send, expected;
  for (std::size_t i = 0; i < n; ++i)
    send.push_back(element<T>(me, 0, i));
  for (int p = 0; p < P; ++p)
    for (std::size_t i = 0; i < n; ++i)
      expected.push_back(element<T>(p, 0, i));
  std::vector<T> recv(expected.size());
  comm.all_gather(cspan(send), mspan(recv));
  CHECK(recv == expected);
}

template <class T, class Comm>
void check_broadcast(const Comm& comm, int round) {
  const int root = round % comm.size();
  const std::size_t n = 5 + static_cast<std::size_t>(round);
  std::vector<T> data(n, static_cast<T>(7)), expected;
  for (std::size_t i = 0; i < n; ++i)
    expected.push_back(element<T>(root, 1, i));
  if (comm.rank() == root) data = expected;
  comm.broadcast(mspan(data), root);
  CHECK(data == expected);
}

// Contributions whose float sum depends on the order they are added in (magnitudes differ by
// rank), so a sum in any other order than 0..P-1 shows up as a bit difference.
template <class T>
T summand(int rank, std::size_t i) {
  if constexpr (std::is_floating_point_v<T>) {
    const double scale = std::pow(10.0, (rank % 3) * 4 - 4);
    return static_cast<T>(scale *
                          (0.1 + 0.37 * static_cast<double>((i * 7 + static_cast<std::size_t>(rank) * 3) % 11)));
  } else {
    return static_cast<T>(static_cast<long long>(rank) * 1000 + static_cast<long long>(i) * 13);  // uint8 wraps
  }
}

template <class T, class Comm>
void check_all_reduce_sum(const Comm& comm, std::size_t n) {
  const int P = comm.size(), me = comm.rank();
  std::vector<T> data(n), expected(n), reversed(n);
  for (std::size_t i = 0; i < n; ++i) {
    data[i] = summand<T>(me, i);
    expected[i] = summand<T>(0, i);
    for (int p = 1; p < P; ++p)
      expected[i] = static_cast<T>(expected[i] + summand<T>(p, i));
    reversed[i] = summand<T>(P - 1, i);
    for (int p = P - 2; p >= 0; --p)
      reversed[i] = static_cast<T>(reversed[i] + summand<T>(p, i));
  }
  comm.all_reduce_sum(mspan(data));
  CHECK(same_bits(data.data(), expected.data(), n));  // bitwise the rank-order sum
  if constexpr (std::is_floating_point_v<T>) {
    // The data does discriminate: for P >= 3 the reverse order gives other bits somewhere.
    if (P >= 3 && n >= 64) CHECK_FALSE(same_bits(expected.data(), reversed.data(), n));
  }
  // And every rank holds the same bits.
  std::vector<T> everyone(n * static_cast<std::size_t>(P));
  comm.all_gather(cspan(data), mspan(everyone));
  for (int p = 0; p < P; ++p)
    CHECK(same_bits(everyone.data() + static_cast<std::size_t>(p) * n, data.data(), n));
}

// all_to_all_rows (mrr/comm/row_blocks.hpp). Row r of rank `from`'s send buffer holds
// from * 1000 + r * 10 + c in column c. Rank `from` sends rank `to` rows picked out of order, some
// twice (rows_sent); the receiver scatters the j-th row from each peer to a position drawn from a
// permutation of its buffer, which has spare rows that must stay untouched.
constexpr std::size_t kRowsPerRank = 9, kRowElems = 5;

inline std::vector<std::int64_t> rows_sent(int from, int to, int round) {
  std::vector<std::int64_t> rows;
  const std::size_t n = block_count(from, to, round);
  for (std::size_t i = 0; i < n; ++i)
    rows.push_back(static_cast<std::int64_t>((static_cast<std::size_t>(from + 3 * to + round) + 4 * i) % kRowsPerRank));
  return rows;
}

template <class T, class Comm>
void check_all_to_all_rows(const Comm& comm, int round) {
  const int P = comm.size(), me = comm.rank();
  auto value = [](int from, std::int64_t row, std::size_t c) {
    return static_cast<T>(from * 1000 + static_cast<int>(row) * 10 + static_cast<int>(c));
  };
  std::vector<T> send(kRowsPerRank * kRowElems);
  for (std::size_t r = 0; r < kRowsPerRank; ++r)
    for (std::size_t c = 0; c < kRowElems; ++c)
      send[r * kRowElems + c] = value(me, static_cast<std::int64_t>(r), c);
  mrr::RowBlocks send_blocks, recv_blocks;
  send_blocks.start(P);
  std::size_t total = 0;
  for (int p = 0; p < P; ++p) {
    for (const auto r : rows_sent(me, p, round))
      send_blocks.add(r, 1);
    send_blocks.next_peer();
    total += rows_sent(p, me, round).size();
  }
  const std::size_t spare = 3, recv_rows = total + spare;
  std::vector<std::int64_t> position(recv_rows);
  for (std::size_t i = 0; i < recv_rows; ++i)
    position[i] = static_cast<std::int64_t>((i * 7 + static_cast<std::size_t>(round)) % recv_rows);
  if (recv_rows % 7 == 0)  // 7 i mod n is a permutation only when gcd(7, n) = 1
    for (std::size_t i = 0; i < recv_rows; ++i)
      position[i] = static_cast<std::int64_t>(recv_rows - 1 - i);
  const T sentinel = static_cast<T>(-1);
  std::vector<T> recv(recv_rows * kRowElems, sentinel);
  std::vector<T> expected = recv;
  recv_blocks.start(P);
  std::size_t at = 0;
  for (int p = 0; p < P; ++p) {
    for (const auto r : rows_sent(p, me, round)) {
      const auto pos = position[at++];
      recv_blocks.add(pos, 1);
      for (std::size_t c = 0; c < kRowElems; ++c)
        expected[static_cast<std::size_t>(pos) * kRowElems + c] = value(p, r, c);
    }
    recv_blocks.next_peer();
  }
  comm.all_to_all_rows(send.data(), kRowsPerRank, send_blocks, recv.data(), recv_rows, recv_blocks, kRowElems);
  CHECK(same_bits(recv.data(), expected.data(), recv.size()));
}

template <class T, class Comm>
void check_collectives_of(const Comm& comm) {
  for (int round = 0; round < 6; ++round) {
    if constexpr (mrr::RowCommunicator<Comm, T>) check_all_to_all_rows<T>(comm, round);
    check_all_to_all_v<T>(comm, round);
    check_all_gather<T>(comm, round);
    check_broadcast<T>(comm, round);
  }
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{3}, std::size_t{257}})
    check_all_reduce_sum<T>(comm, n);
}

template <class Comm>
void check_collectives(const Comm& comm) {
  static_assert(mrr::Communicator<Comm>);
  check_collectives_of<float>(comm);
  check_collectives_of<double>(comm);
  check_collectives_of<std::int32_t>(comm);
  check_collectives_of<std::int64_t>(comm);
  check_collectives_of<std::uint8_t>(comm);
  comm.barrier();
}

// After a collective threw on every rank, the communicator is still in step.
template <class Comm>
void check_still_works(const Comm& comm) {
  check_all_to_all_v<float>(comm, 1);
  check_all_reduce_sum<double>(comm, 17);
}

// all_to_all_rows with bad arguments on one rank: every rank throws InvalidArgument naming it.
template <class Comm>
void check_mismatched_rows(const Comm& comm) {
  const int P = comm.size(), me = comm.rank();
  const std::size_t W = 3, n = static_cast<std::size_t>(P) + 2;
  std::vector<float> send(n * W, 1.f), recv(n * W);
  auto one_row_each = [&](mrr::RowBlocks& b, int extra_for_last) {
    b.start(P);
    for (int p = 0; p < P; ++p) {
      b.add(p, 1 + (p == P - 1 ? extra_for_last : 0));
      b.next_peer();
    }
  };
  mrr::RowBlocks ok_send, ok_recv, bad;
  one_row_each(ok_send, 0);
  one_row_each(ok_recv, 0);
  auto throws_naming = [&](const mrr::RowBlocks& s, const mrr::RowBlocks& r, std::size_t row_elems, const char* what) {
    CAPTURE(what);
    try {
      comm.all_to_all_rows(send.data(), n, s, recv.data(), n, r, row_elems);
      FAIL_CHECK("did not throw");
    } catch (const mrr::InvalidArgument& e) {
      CHECK(std::string(e.what()).find(what) != std::string::npos);
    }
  };
  // Rank 0 expects two rows from rank P - 1, which sends one.
  one_row_each(bad, 1);
  throws_naming(ok_send, me == 0 ? bad : ok_recv, W, "rows to rank 0, which expects");
  // A block past the end of rank P - 1's send buffer.
  bad = ok_send;
  bad.first[0] = static_cast<std::int64_t>(n);
  throws_naming(me == P - 1 ? bad : ok_send, ok_recv, W, "'s row blocks are malformed");
  // Two recv blocks over one row, on rank 0 (with more than one rank).
  bad = ok_recv;
  if (P > 1) bad.first[1] = bad.first[0];
  if (P > 1) throws_naming(ok_send, me == 0 ? bad : ok_recv, W, "'s row blocks are malformed");
  // Rows of different widths.
  if (P > 1) throws_naming(ok_send, ok_recv, me == 1 ? W - 1 : W, "moves rows of");
  // A recv buffer overlapping the send buffer.
  try {
    comm.all_to_all_rows(send.data(), n, ok_send, send.data(), n, ok_recv, W);
    FAIL_CHECK("did not throw");
  } catch (const mrr::InvalidArgument& e) {
    CHECK(std::string(e.what()).find("overlap") != std::string::npos);
  }
}

// Rank r expects one element more from its left neighbour than that neighbour sends: every rank
// throws InvalidArgument (not only the ranks whose own counts disagree).
template <class Comm>
void check_mismatched_counts(const Comm& comm) {
  const int P = comm.size(), me = comm.rank();
  std::vector<std::size_t> send_counts(static_cast<std::size_t>(P), 1), recv_counts(static_cast<std::size_t>(P), 1);
  if (me == 0) recv_counts[static_cast<std::size_t>(P - 1)] = 2;  // rank P-1 sends 1
  std::vector<float> send(static_cast<std::size_t>(P), 1.f), recv(static_cast<std::size_t>(P) + 1);
  CHECK_THROWS_AS(comm.all_to_all_v(cspan(send), cspan(send_counts), mspan(recv), cspan(recv_counts)),
                  mrr::InvalidArgument);
  // A send buffer smaller than its counts, on one rank only.
  send_counts.assign(static_cast<std::size_t>(P), 1);
  recv_counts.assign(static_cast<std::size_t>(P), 1);
  std::vector<float> short_send(static_cast<std::size_t>(me == P - 1 ? P - 1 : P), 1.f);
  CHECK_THROWS_AS(comm.all_to_all_v(cspan(short_send), cspan(send_counts), mspan(recv), cspan(recv_counts)),
                  mrr::InvalidArgument);
  // Wrong number of counts on one rank.
  std::vector<std::size_t> too_few(static_cast<std::size_t>(P) - (me == 0 ? 1 : 0), 1);
  CHECK_THROWS_AS(comm.all_to_all_v(cspan(send), cspan(too_few), mspan(recv), cspan(recv_counts)),
                  mrr::InvalidArgument);
  if constexpr (mrr::RowCommunicator<Comm, float>) check_mismatched_rows(comm);
  check_still_works(comm);
}

template <class Comm>
void check_mismatched_sizes(const Comm& comm) {
  const int P = comm.size(), me = comm.rank();
  if (P == 1) return;  // nothing to disagree with
  std::vector<double> mine(me == 0 ? 3 : 2, 1.0), all(static_cast<std::size_t>(P) * mine.size());
  CHECK_THROWS_AS(comm.all_gather(cspan(mine), mspan(all)), mrr::InvalidArgument);
  CHECK_THROWS_AS(comm.all_reduce_sum(mspan(mine)), mrr::InvalidArgument);
  std::vector<double> same(4, 1.0);
  CHECK_THROWS_AS(comm.broadcast(mspan(same), me == 1 ? 1 : 0), mrr::InvalidArgument);  // roots disagree
  CHECK_THROWS_AS(comm.broadcast(mspan(same), P), mrr::InvalidArgument);                // root out of range
  // Different collectives, or element types, on different ranks.
  std::vector<float> f(4, 1.f);
  std::vector<double> d(4, 1.0);
  if (me == 0)
    CHECK_THROWS_AS(comm.all_reduce_sum(mspan(f)), mrr::CommunicatorError);
  else
    CHECK_THROWS_AS(comm.all_reduce_sum(mspan(d)), mrr::CommunicatorError);
  if (me == 0)
    CHECK_THROWS_AS(comm.broadcast(mspan(d), 0), mrr::CommunicatorError);
  else
    CHECK_THROWS_AS(comm.all_reduce_sum(mspan(d)), mrr::CommunicatorError);
  check_still_works(comm);
}

// A barrier is argument-checked like the other collectives: rank 0 in barrier() while the others
// are in all_to_all_v (or the reverse) throws CommunicatorError on every rank, naming both calls,
// and the communicator stays in step.
template <class Comm>
void check_mismatched_barrier(const Comm& comm) {
  const int P = comm.size(), me = comm.rank();
  if (P == 1) return;
  std::vector<std::size_t> counts(static_cast<std::size_t>(P), 2);
  std::vector<float> send(2 * static_cast<std::size_t>(P), 1.f), recv(send.size());
  for (const int barrier_rank : {0, P - 1}) {
    CAPTURE(barrier_rank);
    std::string message;
    try {
      if (me == barrier_rank)
        comm.barrier();
      else
        comm.all_to_all_v(cspan(send), cspan(counts), mspan(recv), cspan(counts));
    } catch (const mrr::CommunicatorError& e) {
      message = e.what();
    }
    CHECK(message.find("barrier") != std::string::npos);
    CHECK(message.find("all_to_all_v<float>") != std::string::npos);
  }
  check_still_works(comm);
}

// Send and recv buffers that overlap (in-place all_to_all_v or all_gather, or two views of one
// array) are refused with InvalidArgument on every rank, whichever rank passes them: the
// transports read and write the buffers concurrently, so an overlap gives wrong data.
template <class Comm>
void check_overlapping_buffers(const Comm& comm) {
  const int P = comm.size(), me = comm.rank();
  const auto n = static_cast<std::size_t>(P);
  std::vector<std::size_t> counts(n, 1);
  std::vector<float> both(3 * n, 1.f), send(n, 1.f), recv(n);
  const std::span<float> all(both);
  for (const int culprit : {0, P - 1}) {
    CAPTURE(culprit);
    const bool overlap = me == culprit;
    // In place, and a recv buffer starting inside the send buffer.
    for (const std::size_t shift : {std::size_t{0}, n - 1}) {
      CAPTURE(shift);
      const auto s = overlap ? std::span<const float>(all.first(n)) : cspan(send);
      const auto r = overlap ? all.subspan(shift, n) : mspan(recv);
      CHECK_THROWS_WITH_AS(comm.all_to_all_v(s, cspan(counts), r, cspan(counts)),
                           doctest::Contains("send and recv buffers overlap"), mrr::InvalidArgument);
    }
    const auto s = overlap ? std::span<const float>(all.subspan(n, 1)) : std::span<const float>(send).first(1);
    const auto r = overlap ? all.subspan(1, n) : mspan(recv);
    CHECK_THROWS_WITH_AS(comm.all_gather(s, r), doctest::Contains("send and recv buffers overlap"),
                         mrr::InvalidArgument);
  }
  // Adjacent, not overlapping: one array split into a send half and a recv half is fine.
  std::vector<float> halves(2 * n);
  for (std::size_t p = 0; p < n; ++p)
    halves[p] = static_cast<float>(me * 10 + static_cast<int>(p));
  comm.all_to_all_v(std::span<const float>(halves).first(n), cspan(counts), std::span<float>(halves).last(n),
                    cspan(counts));
  for (std::size_t p = 0; p < n; ++p)
    CHECK(halves[n + p] == static_cast<float>(static_cast<int>(p) * 10 + me));
  check_still_works(comm);
}

}  // namespace mrr::test::comm
