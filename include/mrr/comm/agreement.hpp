// Cross-rank failure agreement: a step that can fail on one rank of a group (bad input, a bad
// replayed id, an expert's error) must end every rank with an error, never leave the others
// waiting in the next collective. Both functions are collectives: every rank calls them.
#pragma once

#include <mrr/concepts.hpp>
#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <span>
#include <string>
#include <vector>

MRR_NAMESPACE_BEGIN

// Runs `step`, then tells every rank whether any rank's step threw: the failing rank rethrows its
// own error, the others throw PeerRankError naming the first failed rank and the start of its
// message (256 bytes travel with the flag, one all_gather in all).
template <Communicator C, class F>
void agree_on_step(const C& comm, const char* fn, F&& step) {
  constexpr std::size_t words = 32;  // 8 bytes of message each
  std::exception_ptr error;
  std::array<std::int64_t, 1 + words> mine{};
  try {
    step();
  } catch (const std::exception& e) {
    error = std::current_exception();
    const std::string what = e.what();
    std::memcpy(mine.data() + 1, what.data(), std::min(what.size(), words * 8 - 1));
    mine[0] = 1;
  } catch (...) {
    error = std::current_exception();
    mine[0] = 1;
  }
  const int p = static_cast<int>(comm.size());
  std::vector<std::int64_t> all(static_cast<std::size_t>(p) * mine.size());
  comm.all_gather(std::span<const std::int64_t>(mine), std::span<std::int64_t>(all));
  if (error) std::rethrow_exception(error);
  for (int s = 0; s < p; ++s) {
    const std::int64_t* theirs = all.data() + static_cast<std::size_t>(s) * mine.size();
    if (theirs[0] == 0) continue;
    char message[words * 8] = {};
    std::memcpy(message, theirs + 1, words * 8 - 1);
    throw PeerRankError(s, detail::str("mrr::", fn, ": rank ", s, " of ", p, " failed: ", message));
  }
}

// One value every rank of a group must hold alike (a model dimension, the group size).
struct AgreedValue {
  const char* name;
  std::int64_t value;
};

// Configuration agreement, for constructors: every rank reports whether its own checks passed
// (`local_error` empty) and its values; then a rank whose checks failed throws InvalidArgument with
// its message, the others PeerRankError naming it, and a value on which ranks differ is an
// InvalidArgument on every rank naming both ranks' values.
template <Communicator C, std::size_t N>
void agree_on_values(const C& comm, const char* fn, const std::string& local_error,
                     const std::array<AgreedValue, N>& values) {
  constexpr std::size_t fields = N + 1;  // the failure flag, then the values
  std::array<std::int64_t, fields> mine{};
  mine[0] = local_error.empty() ? 0 : 1;
  for (std::size_t i = 0; i < N; ++i) mine[i + 1] = values[i].value;
  const int p = static_cast<int>(comm.size()), r = static_cast<int>(comm.rank());
  std::vector<std::int64_t> all(static_cast<std::size_t>(p) * fields);
  comm.all_gather(std::span<const std::int64_t>(mine), std::span<std::int64_t>(all));
  if (!local_error.empty()) throw InvalidArgument(local_error);
  for (int s = 0; s < p; ++s) {
    const std::int64_t* theirs = all.data() + static_cast<std::size_t>(s) * fields;
    if (theirs[0] != 0)
      throw PeerRankError(s, detail::str("mrr::", fn, ": rank ", s, " of ", p,
                                         " rejected its configuration (its own error names the cause)"));
    for (std::size_t i = 0; i < N; ++i)
      if (theirs[i + 1] != values[i].value)
        throw InvalidArgument(detail::str("mrr::", fn, ": ranks disagree on ", values[i].name, ": rank ", r, " has ",
                                          values[i].value, ", rank ", s, " has ", theirs[i + 1]));
  }
}

MRR_NAMESPACE_END
