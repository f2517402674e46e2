// Tests that a FIFO where a file is expected is refused at once, never waited on: the call runs on
// another thread, and if it is still running after `limit` (blocked opening or reading the FIFO),
// the FIFO is opened for writing and closed, so the blocked reader sees its end and the test ends
// with "(blocked)" instead of hanging.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <exception>
#include <filesystem>
#include <future>
#include <string>

namespace mrr::test {

// What `call` threw (its what()), "(no error)" when it returned, or "(blocked)".
template <class Call>
std::string error_or_blocked(const std::filesystem::path& fifo, Call call,
                             std::chrono::seconds limit = std::chrono::seconds(10)) {
  auto result = std::async(std::launch::async, [&]() -> std::string {
    try {
      call();
    } catch (const std::exception& e) {
      return e.what();
    }
    return "(no error)";
  });
  if (result.wait_for(limit) == std::future_status::ready) return result.get();
  const int writer = ::open(fifo.c_str(), O_RDWR | O_NONBLOCK);  // never blocks, unlike O_WRONLY
  if (writer >= 0) ::close(writer);
  result.wait();
  return "(blocked)";
}

}  // namespace mrr::test
