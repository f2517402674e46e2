// What the reward proxy decides about a request before any I/O, as plain functions of bytes, so a
// fuzzer can call them on anything: worker-URL validation and the host allow-list, admin
// authentication and commands, hop-by-hop header filtering, body framing (Content-Length,
// Transfer-Encoding, size limit) and an incremental chunked-body decoder.
// mrr-requires: mrr_reward_http
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/reward/transport.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

MRR_NAMESPACE_BEGIN
namespace reward {

// ---------------------------------------------------------------------------------------------
// Worker URLs

// A worker address split into its parts: scheme://host[:port][/base/path].
struct WorkerUrl {
  std::string scheme;  // "http" or "https"
  std::string host;    // without the brackets of an IPv6 literal
  int port = 0;
  std::string base_path;  // prefixed to every forwarded target; empty or "/..." without a final '/'

  [[nodiscard]] std::string origin() const {
    const bool ipv6 = host.find(':') != std::string::npos;
    return mrr::detail::str(scheme, "://", ipv6 ? "[" : "", host, ipv6 ? "]" : "", ":", port);
  }
};

// Which workers may be added. Hosts compare case-insensitively with the URL's host as written
// (an IPv6 literal without brackets); no name resolution happens here.
struct WorkerUrlPolicy {
  std::vector<std::string> allowed_hosts;  // empty: any host
};

namespace detail {

inline bool is_digit(char c) noexcept { return c >= '0' && c <= '9'; }
inline bool is_alpha(char c) noexcept { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
inline bool is_hex(char c) noexcept { return is_digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }

// `text` without the optional whitespace (SP, HTAB) around it (RFC 9110 §5.6.3).
inline std::string_view trim_ows(std::string_view text) noexcept {
  while (!text.empty() && (text.front() == ' ' || text.front() == '\t'))
    text.remove_prefix(1);
  while (!text.empty() && (text.back() == ' ' || text.back() == '\t'))
    text.remove_suffix(1);
  return text;
}

// A DNS name or an IPv4 address: labels of letters, digits and '-', separated by single dots.
inline bool is_reg_name(std::string_view host) noexcept {
  if (host.empty() || host.size() > 253 || host.front() == '.' || host.front() == '-') return false;
  char previous = '.';
  for (const char c : host) {
    if (c == '.') {
      if (previous == '.' || previous == '-') return false;
    } else if (!(is_alpha(c) || is_digit(c) || c == '-')) {
      return false;
    }
    previous = c;
  }
  return previous != '-';
}

// The characters of an IPv6 literal (hex digits, ':' and an embedded IPv4's dots), at least one ':'.
inline bool is_ipv6_literal(std::string_view host) noexcept {
  if (host.size() < 2 || host.size() > 45 || host.find(':') == std::string_view::npos) return false;
  return std::all_of(host.begin(), host.end(), [](char c) { return is_hex(c) || c == ':' || c == '.'; });
}

// RFC 3986 path characters (unreserved, sub-delims, ':', '@', '/') and valid %XX escapes.
inline bool is_valid_path(std::string_view path) noexcept {
  for (std::size_t i = 0; i < path.size(); ++i) {
    const char c = path[i];
    if (c == '%') {
      if (i + 2 >= path.size()) return false;
      if (!is_hex(path[i + 1]) || !is_hex(path[i + 2])) return false;
      i += 2;
      continue;
    }
    if (is_alpha(c) || is_digit(c)) continue;
    if (std::string_view("-._~!$&'()*+,;=:@/").find(c) == std::string_view::npos) return false;
  }
  return true;
}

}  // namespace detail

// Parses and checks a worker URL; throws InvalidArgument naming what is wrong. Only http (and https
// where cpp-httplib has TLS), no user info, a host that is a DNS name, an IPv4 or a bracketed IPv6
// literal, a port in 1..65535, and a base path of RFC 3986 path characters: no control characters,
// spaces or other bytes that could end up injected into the request line sent to the worker.
inline WorkerUrl parse_worker_url(std::string_view url) {
  constexpr std::string_view fn = "reward::parse_worker_url";
  // Quote the URL safely in messages: its bytes may be anything.
  const auto shown = [&] {
    std::string out;
    for (const char c : url.substr(0, 200)) {
      const auto u = static_cast<unsigned char>(c);
      if (u < 0x20 || u >= 0x7f)
        out += mrr::detail::str("\\x", "0123456789abcdef"[u >> 4], "0123456789abcdef"[u & 15]);
      else
        out += c;
    }
    return out;
  };
  mrr::detail::require(url.size() <= 2048, fn, "a worker URL of ", url.size(), " bytes is too long");
  for (const char c : url) {
    const auto u = static_cast<unsigned char>(c);
    mrr::detail::require(u > 0x20 && u < 0x7f, fn, "'", shown(),
                         "' contains a control character, a space or a non-ASCII byte");
  }
  WorkerUrl out;
  const auto sep = url.find("://");
  mrr::detail::require(sep != std::string_view::npos, fn, "'", shown(), "' has no scheme (expected http://host:port)");
  out.scheme = std::string(url.substr(0, sep));
#ifdef CPPHTTPLIB_OPENSSL_SUPPORT
  mrr::detail::require(out.scheme == "http" || out.scheme == "https", fn, "'", shown(),
                       "': scheme must be http or https");
#else
  mrr::detail::require(out.scheme == "http", fn, "'", shown(), "': scheme must be http (cpp-httplib lacks TLS here)");
#endif
  std::string_view rest = url.substr(sep + 3);
  const auto slash = rest.find('/');
  std::string_view authority = rest.substr(0, slash);
  std::string_view path = slash == std::string_view::npos ? std::string_view{} : rest.substr(slash);
  mrr::detail::require(authority.find('@') == std::string_view::npos, fn, "'", shown(),
                       "': a worker URL takes no user info");
  std::string_view port_text;
  if (authority.starts_with('[')) {
    const auto close = authority.find(']');
    mrr::detail::require(close != std::string_view::npos, fn, "'", shown(), "': unterminated IPv6 literal");
    out.host = std::string(authority.substr(1, close - 1));
    const std::string_view after = authority.substr(close + 1);
    mrr::detail::require(after.empty() || after.starts_with(':'), fn, "'", shown(), "': junk after the IPv6 literal");
    if (!after.empty()) port_text = after.substr(1);
    mrr::detail::require(detail::is_ipv6_literal(out.host), fn, "'", shown(), "': not an IPv6 address");
  } else {
    const auto colon = authority.find(':');
    out.host = std::string(authority.substr(0, colon));
    if (colon != std::string_view::npos) port_text = authority.substr(colon + 1);
    mrr::detail::require(!out.host.empty(), fn, "'", shown(), "' has no host");
    mrr::detail::require(detail::is_reg_name(out.host), fn, "'", shown(),
                         "': the host must be a DNS name or an IP address");
  }
  if (port_text.empty()) {
    mrr::detail::require(authority.find(':') == std::string_view::npos || authority.starts_with('['), fn, "'",
                         shown(), "': empty port");
    mrr::detail::require(!authority.ends_with(':'), fn, "'", shown(), "': empty port");
    out.port = out.scheme == "https" ? 443 : 80;
  } else {
    mrr::detail::require(port_text.size() <= 5 && std::all_of(port_text.begin(), port_text.end(), detail::is_digit),
                         fn, "'", shown(), "': port '", port_text, "' is not a number");
    out.port = std::stoi(std::string(port_text));
    mrr::detail::require(out.port >= 1 && out.port <= 65535, fn, "'", shown(), "': port ", out.port,
                         " is out of range");
  }
  mrr::detail::require(path.find_first_of("?#") == std::string_view::npos, fn, "'", shown(),
                       "': a worker URL takes no query or fragment");
  mrr::detail::require(detail::is_valid_path(path), fn, "'", shown(), "': invalid character in the path");
  while (path.ends_with('/'))
    path.remove_suffix(1);
  out.base_path = std::string(path);
  return out;
}

// parse_worker_url, then the allow-list.
inline WorkerUrl check_worker_url(std::string_view url, const WorkerUrlPolicy& policy) {
  WorkerUrl parsed = parse_worker_url(url);
  if (!policy.allowed_hosts.empty()) {
    const bool allowed = std::any_of(policy.allowed_hosts.begin(), policy.allowed_hosts.end(),
                                     [&](const std::string& h) { return detail::iequals(h, parsed.host); });
    mrr::detail::require(allowed, "reward::check_worker_url", "host '", parsed.host,
                         "' is not in the worker host allow-list");
  }
  return parsed;
}

// ---------------------------------------------------------------------------------------------
// Admin authentication

// Equal contents, in a time that depends on the lengths only (not on where the bytes differ).
inline bool constant_time_equals(std::string_view presented, std::string_view secret) noexcept {
  unsigned char diff = presented.size() == secret.size() ? 0 : 1;
  for (std::size_t i = 0; i < secret.size(); ++i) {
    const unsigned char p = i < presented.size() ? static_cast<unsigned char>(presented[i]) : 0;
    diff = static_cast<unsigned char>(diff | (p ^ static_cast<unsigned char>(secret[i])));
  }
  return diff == 0;
}

// An `Authorization: Bearer <token>` value against the configured token. An empty token never matches.
inline bool bearer_token_matches(std::string_view authorization, std::string_view token) noexcept {
  if (token.empty()) return false;
  constexpr std::string_view scheme = "Bearer ";
  if (authorization.size() < scheme.size() || !detail::iequals(authorization.substr(0, scheme.size()), scheme))
    return false;
  const std::string_view presented = detail::trim_ows(authorization.substr(scheme.size()));
  return constant_time_equals(presented, token);
}

// ---------------------------------------------------------------------------------------------
// Errors as the proxy answers them

// Why a request is refused before it reaches a worker: an HTTP status and a JSON body
// {"error": error, "detail": detail}.
struct RequestRejection {
  int status = 400;
  std::string error;   // a short machine-readable word
  std::string detail;  // a sentence for people
};

// {"error": ..., "detail": ...}; invalid UTF-8 (the detail may quote a client's bytes) is replaced.
inline std::string json_error_body(std::string_view error, std::string_view detail) {
  return nlohmann::json{{"error", error}, {"detail", detail}}.dump(-1, ' ', false,
                                                                   nlohmann::json::error_handler_t::replace);
}

// ---------------------------------------------------------------------------------------------
// Headers

// Hop-by-hop fields (RFC 9110 §7.6.1), those the sending side recomputes (Host, Content-Length)
// and Expect (the body is already read) are not forwarded; cpp-httplib's server adds REMOTE_ADDR
// and friends as pseudo-headers, which are not real either.
inline bool is_unforwardable_header(std::string_view name) noexcept {
  constexpr std::string_view names[] = {"Connection",
                                        "Keep-Alive",
                                        "Proxy-Connection",
                                        "Proxy-Authenticate",
                                        "Proxy-Authorization",
                                        "TE",
                                        "Trailer",
                                        "Transfer-Encoding",
                                        "Upgrade",
                                        "Host",
                                        "Content-Length",
                                        "Expect",
                                        "REMOTE_ADDR",
                                        "REMOTE_PORT",
                                        "LOCAL_ADDR",
                                        "LOCAL_PORT"};
  for (const std::string_view n : names)
    if (detail::iequals(name, n)) return true;
  return false;
}

// The options of every Connection field of `headers`, collected once (lower case, sorted), so a
// head of many fields is filtered in n log n, not n^2.
class ConnectionOptions {
 public:
  explicit ConnectionOptions(const Headers& headers) {
    for (const auto& [key, value] : headers) {
      if (!detail::iequals(key, "Connection")) continue;
      std::string_view tokens = value;
      while (!tokens.empty()) {
        const auto comma = tokens.find(',');
        const std::string_view token = detail::trim_ows(tokens.substr(0, comma));
        if (!token.empty()) options_.push_back(lower(token));
        tokens = comma == std::string_view::npos ? std::string_view{} : tokens.substr(comma + 1);
      }
    }
    std::sort(options_.begin(), options_.end());
  }
  // Whether `name` is one of them (case-insensitive).
  [[nodiscard]] bool names(std::string_view name) const {
    return !options_.empty() && std::binary_search(options_.begin(), options_.end(), lower(name));
  }

 private:
  static std::string lower(std::string_view s) {
    std::string out(s);
    for (char& c : out)
      if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
    return out;
  }
  std::vector<std::string> options_;
};

// Whether a message's connection ends after it (RFC 9112 §9.3, §9.6, §6.1): the close option in
// any case; HTTP/1.0 without keep-alive, or framed by Transfer-Encoding (faulty framing).
inline bool connection_ends_after(const ConnectionOptions& options, const Headers& headers, bool http11) {
  if (options.names("close")) return true;
  return !http11 && (!options.names("keep-alive") || !header_value(headers, "Transfer-Encoding").empty());
}

// The end-to-end fields of `headers`, in order: not hop-by-hop, not named in their Connection
// field. `keep_length`: Content-Length too, for an answer without a body whose length is what a
// GET's 200 would carry (a HEAD's, a 304's: RFC 9110 §8.6).
inline Headers forwardable(const Headers& headers, bool keep_length = false) {
  const ConnectionOptions options(headers);
  Headers out;
  for (const auto& [name, value] : headers)
    if ((keep_length && detail::iequals(name, "Content-Length")) ||
        (!is_unforwardable_header(name) && !options.names(name)))
      out.emplace_back(name, value);
  return out;
}

// ---------------------------------------------------------------------------------------------
// Request framing

// How the body of a request is delimited (RFC 9112 §6.3).
struct BodyFraming {
  enum class Kind { none, length, chunked };
  Kind kind = Kind::none;
  std::uint64_t length = 0;  // for Kind::length
};

// The verdict on a request's head: its framing, or why it is refused.
struct HeadCheck {
  BodyFraming framing;
  std::optional<RequestRejection> rejection;
};

namespace detail {

// A Content-Length value: 1*DIGIT, at most 19 digits (fits in 63 bits).
inline std::optional<std::uint64_t> parse_content_length(std::string_view text) noexcept {
  text = trim_ows(text);
  if (text.empty() || text.size() > 19) return std::nullopt;
  std::uint64_t value = 0;
  for (const char c : text) {
    if (!is_digit(c)) return std::nullopt;
    value = value * 10 + static_cast<std::uint64_t>(c - '0');
  }
  return value;
}

inline HeadCheck reject(int status, std::string error, std::string detail) {
  HeadCheck out;
  out.rejection = RequestRejection{status, std::move(error), std::move(detail)};
  return out;
}

}  // namespace detail

// A request head as it arrived: the request line's parts and the field lines, names and values
// exactly as sent (nothing percent-decoded), values without their surrounding whitespace.
struct RequestHead {
  std::string method;
  std::string target;
  std::string version;  // "HTTP/1.1" or "HTTP/1.0"
  Headers headers;
};

namespace detail {

// RFC 9110 §5.6.2: the characters of a token (method, field name).
inline bool is_tchar(char c) noexcept {
  return is_alpha(c) || is_digit(c) || std::string_view("!#$%&'*+-.^_`|~").find(c) != std::string_view::npos;
}

// A byte that may appear inside a field value (RFC 9110 §5.5): visible ASCII, SP, HTAB and
// obs-text; no other control character (CR, LF and NUL above all).
inline bool is_field_value_byte(char c) noexcept {
  const auto u = static_cast<unsigned char>(c);
  return u == '\t' || (u >= 0x20 && u != 0x7f);
}

inline std::string byte_name(char c) {
  const auto u = static_cast<unsigned char>(c);
  return mrr::detail::str("0x", "0123456789abcdef"[u >> 4], "0123456789abcdef"[u & 15]);
}

// At most 64 bytes of a client's field name, for an error message.
inline std::string_view quoted_name(std::string_view name) noexcept { return name.substr(0, 64); }

inline std::variant<RequestHead, RequestRejection> bad_head(std::string detail) {
  return RequestRejection{400, "bad_request", std::move(detail)};
}

// "METHOD SP target SP HTTP/x.y" (RFC 9112 §3), one space each.
inline std::optional<RequestRejection> parse_request_line(std::string_view line, RequestHead& out) {
  const auto sp1 = line.find(' ');
  const auto sp2 = sp1 == std::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
  if (sp2 == std::string_view::npos || line.find(' ', sp2 + 1) != std::string_view::npos)
    return RequestRejection{400, "bad_request", "the request line is not 'METHOD target HTTP/1.1'"};
  const std::string_view method = line.substr(0, sp1);
  const std::string_view target = line.substr(sp1 + 1, sp2 - sp1 - 1);
  const std::string_view version = line.substr(sp2 + 1);
  if (method.empty() || !std::all_of(method.begin(), method.end(), is_tchar))
    return RequestRejection{400, "bad_request", "the method is not a token"};
  if (target.empty() || !std::all_of(target.begin(), target.end(), [](char c) { return c > 0x20 && c < 0x7f; }))
    return RequestRejection{400, "bad_request", "the request target has a control, space or non-ASCII byte"};
  if (version.size() != 8 || !version.starts_with("HTTP/") || !is_digit(version[5]) || version[6] != '.' ||
      !is_digit(version[7]))
    return RequestRejection{400, "bad_request", "the request line does not end with an HTTP version"};
  if (version != "HTTP/1.1" && version != "HTTP/1.0")
    return RequestRejection{505, "http_version_not_supported", "only HTTP/1.0 and HTTP/1.1 are served"};
  out.method = std::string(method);
  out.target = std::string(target);
  out.version = std::string(version);
  return std::nullopt;
}

// "name: value" (RFC 9112 §5): the name a token directly followed by ':', OWS around the value.
inline std::optional<RequestRejection> parse_field_line(std::string_view line, std::size_t number, Headers& out) {
  if (line.front() == ' ' || line.front() == '\t')
    return RequestRejection{400, "bad_request",
                            mrr::detail::str("line ", number, " of the head is an obs-fold continuation line ",
                                             "(starts with whitespace; RFC 9112 §5.2)")};
  const auto colon = line.find(':');
  if (colon == std::string_view::npos)
    return RequestRejection{400, "bad_request", mrr::detail::str("line ", number, " of the head has no ':'")};
  std::string_view name = line.substr(0, colon);
  if (name.empty())
    return RequestRejection{400, "bad_request",
                            mrr::detail::str("line ", number, " of the head has an empty field name")};
  if (name.back() == ' ' || name.back() == '\t')
    return RequestRejection{400, "bad_request",
                            mrr::detail::str("header field '", quoted_name(name),
                                             "' has whitespace before its colon (RFC 9112 §5.1)")};
  if (!std::all_of(name.begin(), name.end(), is_tchar))
    return RequestRejection{400, "bad_request",
                            mrr::detail::str("header field name '", quoted_name(name), "' is not a token")};
  std::string_view value = line.substr(colon + 1);
  for (const char c : value)
    if (!is_field_value_byte(c))
      return RequestRejection{400, "bad_request",
                              mrr::detail::str("the value of header field '", quoted_name(name),
                                               "' holds the control byte ", byte_name(c), " (RFC 9110 §5.5)")};
  value = trim_ows(value);
  out.emplace_back(std::string(name), std::string(value));
  return std::nullopt;
}

}  // namespace detail

// Parses a request head, `head` being exactly the bytes up to and including its empty line
// (find_head_end), strictly as RFC 9112 asks of a server: every line ends in CRLF (a bare CR or a
// bare LF is refused, §2.2), a field name is a token directly followed by ':' (whitespace before
// the colon is refused, §5.1), obs-fold continuation lines are refused (§5.2), and a field value
// holds no control byte but HTAB (RFC 9110 §5.5). Such bytes are where a proxy and the server
// behind it can read different requests from the same stream (request smuggling), so they are
// answered 400, never repaired and forwarded. The proxy forwards the fields as parsed here.
inline std::variant<RequestHead, RequestRejection> parse_request_head(std::string_view head) {
  RequestHead out;
  std::size_t number = 0;
  while (!head.empty()) {
    ++number;
    const auto lf = head.find('\n');
    if (lf == std::string_view::npos) return detail::bad_head("the head does not end with an empty line");
    if (lf == 0 || head[lf - 1] != '\r')
      return detail::bad_head(mrr::detail::str("line ", number, " of the head ends with a bare LF (RFC 9112 §2.2)"));
    const std::string_view line = head.substr(0, lf - 1);
    head.remove_prefix(lf + 1);
    if (line.find('\r') != std::string_view::npos)
      return detail::bad_head(mrr::detail::str("line ", number, " of the head holds a bare CR (RFC 9112 §2.2)"));
    std::optional<RequestRejection> rejection;
    if (number == 1) {
      rejection = detail::parse_request_line(line, out);
    } else if (line.empty()) {
      if (!head.empty()) return detail::bad_head("bytes follow the empty line that ends the head");
      return out;
    } else {
      rejection = detail::parse_field_line(line, number, out.headers);
    }
    if (rejection) return *rejection;
  }
  return detail::bad_head("the head does not end with an empty line");
}

// Checks what the body framing of a request says, before reading any of it: Content-Length
// fields must agree (a comma-separated list of equal values counts as one) and be numbers;
// Transfer-Encoding may only be "chunked" and not come with Content-Length (request smuggling);
// a declared length over `max_body_bytes` is 413. The target must be visible ASCII. Any method
// may carry a body: the server reads it whatever the method, so none is left on the connection.
inline HeadCheck check_request_head(std::string_view target, const Headers& headers, std::uint64_t max_body_bytes) {
  for (const char c : target) {
    const auto u = static_cast<unsigned char>(c);
    if (u <= 0x20 || u >= 0x7f) return detail::reject(400, "bad_request", "the request target has a control, space or non-ASCII byte");
  }
  std::optional<std::uint64_t> length;
  bool chunked = false;
  for (const auto& [name, value] : headers) {
    if (detail::iequals(name, "Content-Length")) {
      std::string_view rest = value;
      do {
        const auto comma = rest.find(',');
        const auto parsed = detail::parse_content_length(rest.substr(0, comma));
        if (!parsed) return detail::reject(400, "bad_request", "Content-Length is not a number");
        if (length && *length != *parsed) return detail::reject(400, "bad_request", "conflicting Content-Length values");
        length = parsed;
        rest = comma == std::string_view::npos ? std::string_view{} : rest.substr(comma + 1);
      } while (!rest.empty());
    } else if (detail::iequals(name, "Transfer-Encoding")) {
      const std::string_view v = detail::trim_ows(value);
      if (chunked || !detail::iequals(v, "chunked"))
        return detail::reject(501, "not_implemented", "only a single Transfer-Encoding: chunked is supported");
      chunked = true;
    }
  }
  if (chunked && length)
    return detail::reject(400, "bad_request", "Content-Length together with Transfer-Encoding is refused");
  HeadCheck out;
  if (chunked) {
    out.framing.kind = BodyFraming::Kind::chunked;
  } else if (length && *length > 0) {
    if (*length > max_body_bytes)
      return detail::reject(413, "payload_too_large",
                            mrr::detail::str("the body of ", *length, " bytes is over the limit of ", max_body_bytes,
                                             " bytes"));
    out.framing = {BodyFraming::Kind::length, *length};
  }
  return out;
}

// Decodes a chunked body incrementally (RFC 9112 §7.1): feed() the bytes as they arrive; the
// decoded data is appended to `out`, at most `max_body_bytes` in all. Chunk extensions and
// trailer fields are read and dropped.
class ChunkedDecoder {
 public:
  enum class State { size_line, data, data_end, trailer, done, error };

  explicit ChunkedDecoder(std::uint64_t max_body_bytes) : max_(max_body_bytes) {}

  // Consumes bytes of `in` up to the end of the body; returns how many. Stops at done or error.
  std::size_t feed(std::string_view in, std::string& out) {
    std::size_t used = 0;
    while (used < in.size() && state_ != State::done && state_ != State::error) {
      if (state_ == State::data) {
        const auto take = static_cast<std::size_t>(std::min<std::uint64_t>(remaining_, in.size() - used));
        out.append(in.data() + used, take);
        used += take;
        remaining_ -= take;
        if (remaining_ == 0) state_ = State::data_end;
        continue;
      }
      const char c = in[used++];
      if (line_.size() >= 4096) return fail(used, "a chunk-size or trailer line is too long");
      line_ += c;
      if (c != '\n') continue;
      if (line_.size() < 2 || line_[line_.size() - 2] != '\r') return fail(used, "a line does not end with CRLF");
      const std::string_view line(line_.data(), line_.size() - 2);
      if (state_ == State::size_line) {
        const std::string_view digits = line.substr(0, line.find_first_of("; \t"));
        if (digits.empty() || digits.size() > 15 || !std::all_of(digits.begin(), digits.end(), detail::is_hex))
          return fail(used, "a chunk size is not a hexadecimal number");
        // After the size only extensions: "1 2" is no size of 1 (RFC 9112 §7.1.1: BWS, then ';').
        const std::string_view rest = detail::trim_ows(line.substr(digits.size()));
        if (!rest.empty() && rest.front() != ';')
          return fail(used, "a chunk-size line holds more than a size and extensions");
        std::uint64_t size = 0;
        for (const char d : digits)
          size = size * 16 + static_cast<std::uint64_t>(detail::is_digit(d) ? d - '0' : (d | 0x20) - 'a' + 10);
        if (size > max_ - std::min(max_, decoded_)) {
          too_large_ = true;
          return fail(used, "the body is over the limit");
        }
        decoded_ += size;
        remaining_ = size;
        state_ = size == 0 ? State::trailer : State::data;
      } else if (state_ == State::data_end) {
        if (!line.empty()) return fail(used, "chunk data is not followed by CRLF");
        state_ = State::size_line;
      } else if (state_ == State::trailer) {
        if (line.empty()) state_ = State::done;
        else if (++trailers_ > 64) return fail(used, "too many trailer fields");
      }
      line_.clear();
    }
    return used;
  }

  [[nodiscard]] State state() const noexcept { return state_; }
  [[nodiscard]] bool done() const noexcept { return state_ == State::done; }
  [[nodiscard]] bool failed() const noexcept { return state_ == State::error; }
  [[nodiscard]] bool too_large() const noexcept { return too_large_; }  // failed because of the limit
  [[nodiscard]] const std::string& error() const noexcept { return error_; }

 private:
  std::size_t fail(std::size_t used, std::string why) {
    state_ = State::error;
    error_ = std::move(why);
    return used;
  }

  std::uint64_t max_;
  std::uint64_t decoded_ = 0;
  std::uint64_t remaining_ = 0;
  int trailers_ = 0;
  State state_ = State::size_line;
  bool too_large_ = false;
  std::string line_;
  std::string error_;
};

// Where a request head ends: the offset just past "\r\n\r\n", or npos while it is incomplete.
inline std::size_t find_head_end(std::string_view buffer) noexcept {
  const auto at = buffer.find("\r\n\r\n");
  return at == std::string_view::npos ? at : at + 4;
}

// ---------------------------------------------------------------------------------------------
// Admin API

// One admin request, parsed: GET <prefix>/health, GET <prefix>/workers,
// POST <prefix>/workers?url=U (or a JSON body {"url": U}), DELETE <prefix>/workers?url=U.
struct AdminCommand {
  enum class Kind { health, list, add, remove };
  Kind kind = Kind::health;
  std::string url;  // for add and remove, validated by check_worker_url for add

  [[nodiscard]] bool needs_token() const noexcept { return kind != Kind::health; }
};

// Parses an admin request (`path` is after the prefix, `url_param` the decoded query parameter
// "url" if any). Returns the command or why it is refused (404, 405, 400 with a JSON reason).
// Authentication is separate (bearer_token_matches); the URL policy applies to add.
inline std::variant<AdminCommand, RequestRejection> parse_admin_command(std::string_view method, std::string_view path,
                                                                        std::optional<std::string_view> url_param,
                                                                        std::string_view body,
                                                                        const WorkerUrlPolicy& policy) {
  AdminCommand out;
  if (path == "/health") {
    if (method != "GET" && method != "HEAD")
      return RequestRejection{405, "method_not_allowed", mrr::detail::str("use GET for /health")};
    return out;
  }
  if (path != "/workers") return RequestRejection{404, "not_found", "unknown admin path"};
  if (method == "GET" || method == "HEAD") {
    out.kind = AdminCommand::Kind::list;
    return out;
  }
  if (method != "POST" && method != "DELETE")
    return RequestRejection{405, "method_not_allowed", "use GET, POST or DELETE on /workers"};
  out.kind = method == "POST" ? AdminCommand::Kind::add : AdminCommand::Kind::remove;
  if (url_param) {
    out.url = std::string(*url_param);
  } else if (!body.empty()) {
    const auto parsed = nlohmann::json::parse(body, nullptr, /*allow_exceptions=*/false);
    if (!parsed.is_object() || !parsed.contains("url") || !parsed["url"].is_string())
      return RequestRejection{400, "bad_request", "the body must be a JSON object {\"url\": \"http://host:port\"}"};
    out.url = parsed["url"].get<std::string>();
  }
  if (out.url.empty())
    return RequestRejection{400, "bad_request",
                            "name the worker: query parameter 'url' or a JSON body {\"url\": \"http://host:port\"}"};
  if (out.kind == AdminCommand::Kind::add) {
    try {
      check_worker_url(out.url, policy);
    } catch (const InvalidArgument& e) {
      return RequestRejection{400, "bad_request", e.what()};
    }
  }
  return out;
}

}  // namespace reward
MRR_NAMESPACE_END
