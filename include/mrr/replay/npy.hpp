// Minimal reader for NumPy .npy files of integer arrays (format versions 1-3, C order), enough
// to take routed_experts arrays exported by vLLM or SGLang without a Python dependency. The file
// is untrusted: the header is parsed strictly, and the size its shape declares is checked
// (without overflow) against the file's size before anything is allocated. Every failure is an
// mrr::InvalidArgument naming the file and the field.
#pragma once

#include <mrr/detail/checked.hpp>
#include <mrr/detail/config.hpp>
#include <mrr/detail/regular_file.hpp>
#include <mrr/error.hpp>

#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

MRR_NAMESPACE_BEGIN

struct NpyIntArray {
  std::vector<std::int64_t> shape;
  std::vector<std::int64_t> values;  // row-major
  std::string dtype;                 // the file's descr, e.g. "<i4"
};

namespace detail {

// numpy itself refuses headers over 10,000 bytes unless told otherwise (max_header_size).
inline constexpr std::uint32_t kNpyMaxHeaderBytes = 1u << 16;

// A strict parser of the header dict numpy writes: {'descr': '<i4', 'fortran_order': False,
// 'shape': (3, 2), } followed by spaces and a newline. Nothing else is accepted.
class NpyHeaderParser {
 public:
  NpyHeaderParser(std::string_view text, const std::filesystem::path& path) : text_(text), path_(path) {}

  void parse(NpyIntArray& out) {
    bool have_descr = false, have_order = false, have_shape = false;
    skip_space();
    expect('{', "the header dict");
    for (;;) {
      skip_space();
      if (peek() == '}') break;
      const std::string key = quoted("a key");
      skip_space();
      expect(':', "':' after key '" + key + "'");
      skip_space();
      if (key == "descr" && !have_descr) {
        out.dtype = quoted("'descr'");
        have_descr = true;
      } else if (key == "fortran_order" && !have_order) {
        if (take("False")) {
        } else if (take("True")) {
          fail("is in Fortran order; save it C-contiguous");
        } else {
          fail("has 'fortran_order' that is neither True nor False");
        }
        have_order = true;
      } else if (key == "shape" && !have_shape) {
        parse_shape(out.shape);
        have_shape = true;
      } else {
        fail(str("has an unexpected or repeated header key '", key, "'"));
      }
      skip_space();
      if (peek() == ',') {
        ++at_;
        continue;
      }
      if (peek() != '}') fail(str("has a malformed header: expected ',' or '}' at byte ", at_));
    }
    ++at_;  // '}'
    for (; at_ < text_.size(); ++at_)
      if (text_[at_] != ' ' && text_[at_] != '\n' && text_[at_] != '\t' && text_[at_] != '\r')
        fail(str("has text after its header dict (byte ", at_, ")"));
    if (!have_descr || !have_order || !have_shape)
      fail(str("header lacks the '", !have_descr ? "descr" : !have_order ? "fortran_order" : "shape", "' field"));
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw InvalidArgument(str("mrr::read_npy: ", path_.string(), " ", what));
  }
  char peek() const { return at_ < text_.size() ? text_[at_] : '\0'; }
  void skip_space() {
    while (at_ < text_.size() && (text_[at_] == ' ' || text_[at_] == '\t' || text_[at_] == '\n' || text_[at_] == '\r'))
      ++at_;
  }
  void expect(char c, const std::string& what) {
    if (peek() != c) fail(str("has a malformed header: expected ", what, " at byte ", at_));
    ++at_;
  }
  bool take(std::string_view word) {
    if (text_.substr(at_, word.size()) != word) return false;
    at_ += word.size();
    return true;
  }
  std::string quoted(const std::string& what) {
    const char q = peek();
    if (q != '\'' && q != '"')
      fail(str("has a malformed header: expected a quoted string for ", what, " at byte ", at_));
    const auto end = text_.find(q, at_ + 1);
    if (end == std::string_view::npos) fail(str("has a malformed header: unterminated string for ", what));
    std::string s(text_.substr(at_ + 1, end - at_ - 1));
    at_ = end + 1;
    return s;
  }
  void parse_shape(std::vector<std::int64_t>& shape) {
    expect('(', "'(' for 'shape'");
    for (;;) {
      skip_space();
      if (peek() == ')') break;
      if (peek() == '-') fail(str("has a negative dimension in 'shape' (shape[", shape.size(), "])"));
      if (peek() < '0' || peek() > '9') fail(str("has a malformed 'shape': expected a dimension at byte ", at_));
      std::int64_t v = 0;
      while (peek() >= '0' && peek() <= '9') {
        if (!checked_mul(v, 10, v) || !checked_add(v, peek() - '0', v))
          fail(str("has 'shape'[", shape.size(), "] too large for a 64-bit size"));
        ++at_;
      }
      if (peek() == 'L') ++at_;  // Python 2 longs
      shape.push_back(v);
      skip_space();
      if (peek() == ',') {
        ++at_;
        continue;
      }
      if (peek() != ')') fail(str("has a malformed 'shape': expected ',' or ')' at byte ", at_));
    }
    ++at_;
    if (shape.size() > 32) fail(str("has ", shape.size(), " dimensions in 'shape' (numpy allows 32)"));
  }

  std::string_view text_;
  const std::filesystem::path& path_;
  std::size_t at_ = 0;
};

template <class... Args>
[[noreturn]] void npy_fail(const std::filesystem::path& path, Args&&... what) {
  throw InvalidArgument(str("mrr::read_npy: ", path.string(), " ", std::forward<Args>(what)...));
}

}  // namespace detail

// Reads a .npy integer array and returns visit(std::span<const Int> values, shape, dtype), Int the
// file's own type (int8 ... uint64): the values are held once, in their own width (read_npy below
// widens them to int64: eight times a uint8 file).
template <class Visit>
decltype(auto) visit_npy(const std::filesystem::path& path, Visit&& visit) {
  constexpr const char* fn = "read_npy";
  auto fail = [&](auto&&... what) { detail::npy_fail(path, what...); };
  // A FIFO or device would block the first read (or never end): only regular files are read.
  const detail::RegularFile opened = detail::open_regular_file(path.c_str(), O_RDONLY);
  if (opened.not_regular()) fail("is ", opened.kind, ", not a regular file");
  if (!opened.ok())
    throw InvalidArgument(detail::str("mrr::", fn, ": cannot open ", path.string(), ": ", std::strerror(opened.err)));
  const detail::UniqueFd fd(opened.fd);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0 || st.st_size < 0) fail("cannot be sized");
  const auto size = static_cast<std::uint64_t>(st.st_size);
  std::uint64_t offset = 0;
  // Reads exactly n bytes at the current offset; false at the end of the file.
  auto read = [&](void* out, std::size_t n) {
    auto* p = static_cast<unsigned char*>(out);
    while (n > 0) {
      const ssize_t got = ::pread(fd.get(), p, n, static_cast<off_t>(offset));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) return false;
      p += got;
      n -= static_cast<std::size_t>(got);
      offset += static_cast<std::uint64_t>(got);
    }
    return true;
  };

  char magic[8];
  if (!read(magic, 8) || std::memcmp(magic, "\x93NUMPY", 6) != 0) fail("is not a .npy file (bad magic)");
  const int major = static_cast<unsigned char>(magic[6]);
  std::uint32_t header_len = 0;
  std::uint64_t preamble = 0;
  bool ok = true;
  if (major == 1) {
    unsigned char len[2] = {0, 0};
    ok = read(len, 2);
    header_len = len[0] | (std::uint32_t{len[1]} << 8);
    preamble = 10;
  } else if (major == 2 || major == 3) {
    unsigned char len[4] = {0, 0, 0, 0};
    ok = read(len, 4);
    header_len = len[0] | (std::uint32_t{len[1]} << 8) | (std::uint32_t{len[2]} << 16) | (std::uint32_t{len[3]} << 24);
    preamble = 12;
  } else {
    fail("has unsupported .npy version ", major);
  }
  if (!ok) fail("ends inside its preamble");
  if (header_len > detail::kNpyMaxHeaderBytes || header_len > size - preamble)
    fail("has header_len ", header_len, ", more than ",
         header_len > detail::kNpyMaxHeaderBytes ? "a .npy header may hold" : "the file holds", " (", size,
         " bytes in all)");
  std::string header(header_len, '\0');
  if (!read(header.data(), header_len)) fail("ends inside its header");

  NpyIntArray out;
  detail::NpyHeaderParser(header, path).parse(out);

  // dtype: byte order '<' or '|' (or '=' on a little-endian host), kind i or u, 1/2/4/8 bytes.
  const std::string& t = out.dtype;
  const bool known = t.size() == 3 && (t[0] == '<' || t[0] == '|' || t[0] == '=') && (t[1] == 'i' || t[1] == 'u') &&
                     (t[2] == '1' || t[2] == '2' || t[2] == '4' || t[2] == '8');
  if (!known) fail("has dtype '", t, "'; expected a little-endian integer type such as <i4");
  const char kind = t[1];
  const int bytes = t[2] - '0';

  std::uint64_t count = 1, data_bytes = 0;
  for (std::size_t i = 0; i < out.shape.size(); ++i)
    if (!detail::checked_mul(count, out.shape[i], count)) fail("has a 'shape' whose element count overflows");
  if (!detail::checked_mul(count, bytes, data_bytes)) fail("has a 'shape' whose byte size overflows");
  const std::uint64_t data_offset = preamble + header_len;
  if (data_bytes != size - data_offset)
    fail(data_bytes > size - data_offset ? "holds fewer values than its 'shape' declares"
                                         : "has trailing bytes after the values its 'shape' declares",
         " (", data_bytes, " bytes of values expected, ", size - data_offset, " present)");

  const auto as = [&]<class Int>(std::type_identity<Int>) -> decltype(auto) {
    const auto n = static_cast<std::size_t>(count);
    const auto values = std::make_unique_for_overwrite<Int[]>(n == 0 ? 1 : n);
    if (!read(values.get(), static_cast<std::size_t>(data_bytes))) fail("could not be read to its end");
    if constexpr (std::endian::native == std::endian::big && sizeof(Int) > 1)
      for (std::size_t i = 0; i < n; ++i) {  // the file is little-endian
        auto u = static_cast<std::make_unsigned_t<Int>>(values[i]);
        decltype(u) swapped = 0;
        for (std::size_t b = 0; b < sizeof(Int); ++b, u >>= 8)
          swapped = static_cast<decltype(u)>((swapped << 8) | (u & 0xff));
        values[i] = static_cast<Int>(swapped);
      }
    return visit(std::span<const Int>(values.get(), n), std::as_const(out.shape), std::as_const(out.dtype));
  };
  switch (bytes) {
    case 1:
      return kind == 'i' ? as(std::type_identity<std::int8_t>{}) : as(std::type_identity<std::uint8_t>{});
    case 2:
      return kind == 'i' ? as(std::type_identity<std::int16_t>{}) : as(std::type_identity<std::uint16_t>{});
    case 4:
      return kind == 'i' ? as(std::type_identity<std::int32_t>{}) : as(std::type_identity<std::uint32_t>{});
    default:
      return kind == 'i' ? as(std::type_identity<std::int64_t>{}) : as(std::type_identity<std::uint64_t>{});
  }
}

// The whole array widened to int64 (a uint64 value past int64's range is an error).
inline NpyIntArray read_npy(const std::filesystem::path& path) {
  return visit_npy(path, [&](auto values, const std::vector<std::int64_t>& shape, const std::string& dtype) {
    NpyIntArray out{shape, std::vector<std::int64_t>(values.size()), dtype};
    for (std::size_t i = 0; i < values.size(); ++i) {
      if constexpr (std::is_same_v<typename decltype(values)::value_type, std::uint64_t>)
        if (values[i] > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
          detail::npy_fail(path, "holds value ", values[i], " at flat index ", i, ", beyond int64");
      out.values[i] = static_cast<std::int64_t>(values[i]);
    }
    return out;
  });
}

MRR_NAMESPACE_END
