// Exceptions thrown by mrr. Every message starts with the function or file it concerns and names
// the offending argument, key or record, so a failure can be acted on without a debugger.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/detail/str.hpp>

#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

MRR_NAMESPACE_BEGIN

// A caller passed a value the function cannot use (shape mismatch, out-of-range id, NaN, ...).
class InvalidArgument : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// A configuration (YAML file or key=value override) is inconsistent or names an unknown value.
class ConfigError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A route store could not answer: missing routes, a conflicting re-record, a shape mismatch.
class RouteStoreError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A route file is missing, damaged, or of another model; never answered with wrong ids.
class RouteFileError : public RouteStoreError {
 public:
  using RouteStoreError::RouteStoreError;
};

// A collective failed: another rank failed or returned early, or the transport (MPI, NCCL)
// reported an error. Thrown on every rank still waiting, so no rank hangs.
class CommunicatorError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Thrown on every other rank when one rank of a group failed in a step the group agrees on
// (mrr/comm/agreement.hpp); the failing rank throws its own error.
class PeerRankError : public std::runtime_error {
 public:
  PeerRankError(int rank, const std::string& what) : std::runtime_error(what), rank_(rank) {}
  int rank() const { return rank_; }

 private:
  int rank_;
};

namespace detail {

template <class... Args>
[[noreturn]] void throw_invalid_argument(std::string_view function, Args&&... message) {
  throw InvalidArgument(str("mrr::", function, ": ", std::forward<Args>(message)...));
}

// Checks a precondition on a caller's argument; the message is only built when it fails.
template <class... Args>
MRR_FORCEINLINE void require(bool condition, std::string_view function, Args&&... message) {
  if (!condition) [[unlikely]]
    throw_invalid_argument(function, std::forward<Args>(message)...);
}

}  // namespace detail

MRR_NAMESPACE_END
