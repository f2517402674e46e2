// mrr/error.hpp reaches every translation unit that uses mrr, so it must not bring the iostreams
// (<sstream> alone is tens of thousands of lines). Included first and alone here, so the guards
// seen below are what it brought (libstdc++'s and libc++'s include guards).
#include <mrr/error.hpp>

#if defined(_GLIBCXX_SSTREAM) || defined(_LIBCPP_SSTREAM)
constexpr bool kErrorBringsSstream = true;
#else
constexpr bool kErrorBringsSstream = false;
#endif
#if defined(_GLIBCXX_OSTREAM) || defined(_LIBCPP_OSTREAM)
constexpr bool kErrorBringsOstream = true;
#else
constexpr bool kErrorBringsOstream = false;
#endif

#include <doctest/doctest.h>

TEST_CASE("error.hpp does not bring <sstream> or <ostream>") {
  CHECK_FALSE(kErrorBringsSstream);
  CHECK_FALSE(kErrorBringsOstream);
}
