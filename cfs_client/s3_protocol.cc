#include "cfs_client/s3_protocol.h"

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <ctime>

namespace cubetorchfs::cfs_client::s3 {
namespace {

bool IsUnreserved(unsigned char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' ||
         c == '_' || c == '.' || c == '~';
}

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

bool StartsWith(std::string_view s, std::string_view p) { return s.substr(0, p.size()) == p; }

void AppendUtf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

Status BadXml(const std::string& why) { return Status::IOError("malformed XML reply: " + why); }

// The position of the '>' ending the start tag at `i` of `xml` (attribute values are quoted
// and may hold '>'), or xml.size() if it is not terminated.
size_t StartTagEnd(std::string_view xml, size_t i) {
  char quote = 0;
  for (size_t j = i + 1; j < xml.size(); ++j) {
    if (quote) {
      if (xml[j] == quote) quote = 0;
    } else if (xml[j] == '"' || xml[j] == '\'') {
      quote = xml[j];
    } else if (xml[j] == '>') {
      return j;
    }
  }
  return xml.size();
}

// Walks `xml` and calls on_close(path, text) as each element closes: `path` holds the element
// names from the root down to it, `text` its own character data, unescaped. Skips the XML
// declaration, comments and DOCTYPE; keeps CDATA as text. Attributes are ignored.
template <typename Fn>
Status WalkXml(std::string_view xml, Fn&& on_close) {
  std::vector<std::string> names;
  std::vector<std::string> texts;
  bool seen_root = false;
  size_t i = 0;
  while (i < xml.size()) {
    if (xml[i] != '<') {
      size_t end = std::min(xml.find('<', i), xml.size());
      std::string_view raw = xml.substr(i, end - i);
      if (names.empty()) {
        if (raw.find_first_not_of(" \t\r\n") != std::string_view::npos)
          return BadXml("text outside the root element");
      } else {
        CTFS_ASSIGN_OR_RETURN(std::string text, XmlUnescape(raw));
        texts.back() += text;
      }
      i = end;
      continue;
    }
    std::string_view rest = xml.substr(i);
    auto skip_past = [&](std::string_view close) -> bool {
      size_t end = xml.find(close, i);
      if (end == std::string_view::npos) return false;
      i = end + close.size();
      return true;
    };
    if (StartsWith(rest, "<?")) {
      if (!skip_past("?>")) return BadXml("unterminated declaration");
    } else if (StartsWith(rest, "<!--")) {
      if (!skip_past("-->")) return BadXml("unterminated comment");
    } else if (StartsWith(rest, "<![CDATA[")) {
      size_t end = xml.find("]]>", i);
      if (end == std::string_view::npos || names.empty()) return BadXml("stray CDATA");
      texts.back() += xml.substr(i + 9, end - i - 9);
      i = end + 3;
    } else if (StartsWith(rest, "<!")) {
      if (!skip_past(">")) return BadXml("unterminated DOCTYPE");
    } else if (StartsWith(rest, "</")) {
      size_t end = xml.find('>', i);
      if (end == std::string_view::npos) return BadXml("unterminated end tag");
      std::string_view name = xml.substr(i + 2, end - i - 2);
      while (!name.empty() && std::strchr(" \t\r\n", name.back())) name.remove_suffix(1);
      if (names.empty() || name != names.back())
        return BadXml("end tag </" + std::string(name) + "> does not match");
      CTFS_RETURN_IF_ERROR(on_close(names, texts.back()));
      names.pop_back();
      texts.pop_back();
      i = end + 1;
    } else {
      const size_t j = StartTagEnd(xml, i);
      if (j >= xml.size()) return BadXml("unterminated start tag");
      std::string_view tag = xml.substr(i + 1, j - i - 1);
      const bool self_closing = !tag.empty() && tag.back() == '/';
      size_t name_end = tag.find_first_of(" \t\r\n/");
      std::string_view name = tag.substr(0, name_end);
      if (name.empty()) return BadXml("empty element name");
      if (names.empty() && seen_root) return BadXml("more than one root element");
      seen_root = true;
      names.emplace_back(name);
      texts.emplace_back();
      if (self_closing) {
        CTFS_RETURN_IF_ERROR(on_close(names, texts.back()));
        names.pop_back();
        texts.pop_back();
      }
      i = j + 1;
    }
  }
  if (!names.empty()) return BadXml("element <" + names.back() + "> is not closed");
  if (!seen_root) return BadXml("no element");
  return Status::OK();
}

Result<uint64_t> ParseUint(std::string_view s) {
  uint64_t v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || p != s.data() + s.size() || s.empty())
    return Status::IOError("not a number: \"" + std::string(s) + "\"");
  return v;
}

bool Is(const std::vector<std::string>& path, std::initializer_list<std::string_view> want) {
  if (path.size() != want.size()) return false;
  return std::equal(want.begin(), want.end(), path.begin());
}

}  // namespace

std::string UriEncode(std::string_view s, bool keep_slash) {
  static const char kHex[] = "0123456789ABCDEF";
  std::string out;
  out.reserve(s.size() * 3 / 2);
  for (char ch : s) {
    unsigned char c = static_cast<unsigned char>(ch);
    if (IsUnreserved(c) || (keep_slash && c == '/')) {
      out.push_back(ch);
    } else {
      out.push_back('%');
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    }
  }
  return out;
}

std::string UrlDecode(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '+') {
      out.push_back(' ');
    } else if (s[i] == '%' && i + 2 < s.size() && HexValue(s[i + 1]) >= 0 &&
               HexValue(s[i + 2]) >= 0) {
      out.push_back(static_cast<char>(HexValue(s[i + 1]) * 16 + HexValue(s[i + 2])));
      i += 2;
    } else {
      out.push_back(s[i]);
    }
  }
  return out;
}

std::string ObjectKey(std::string_view prefix, std::string_view path) {
  if (prefix.empty()) return std::string(path);
  std::string key(prefix);
  if (!path.empty()) key.append("/").append(path);
  return key;
}

std::string DirKeyPrefix(std::string_view prefix, std::string_view path) {
  std::string key = ObjectKey(prefix, path);
  if (!key.empty()) key.push_back('/');
  return key;
}

std::string EntryName(std::string_view dir_prefix, std::string_view key_or_prefix) {
  if (!StartsWith(key_or_prefix, dir_prefix)) return "";
  std::string_view name = key_or_prefix.substr(dir_prefix.size());
  if (!name.empty() && name.back() == '/') name.remove_suffix(1);  // a common prefix
  if (name.empty() || name == "." || name == ".." || name.find('/') != std::string_view::npos)
    return "";
  return std::string(name);
}

Result<Endpoint> ParseEndpoint(std::string_view url) {
  Endpoint e;
  size_t sep = url.find("://");
  if (sep == std::string_view::npos) return Status::InvalidArgument("no scheme in endpoint");
  e.scheme = std::string(url.substr(0, sep));
  if (e.scheme != "http" && e.scheme != "https")
    return Status::InvalidArgument("endpoint scheme must be http or https");
  std::string_view rest = url.substr(sep + 3);
  size_t slash = rest.find('/');
  e.authority = std::string(rest.substr(0, slash));
  if (e.authority.empty()) return Status::InvalidArgument("endpoint names no host");
  if (slash != std::string_view::npos) {
    std::string_view base = rest.substr(slash);
    while (!base.empty() && base.back() == '/') base.remove_suffix(1);
    e.base_path = std::string(base);
  }
  return e;
}

std::string ObjectUrl(const Endpoint& e, std::string_view bucket, bool path_style,
                      std::string_view key) {
  std::string url = e.scheme + "://";
  if (path_style) {
    url += e.authority + e.base_path + "/" + UriEncode(bucket, false);
    if (!key.empty()) url += "/" + UriEncode(key, true);
  } else {
    url += std::string(bucket) + "." + e.authority + e.base_path + "/" + UriEncode(key, true);
  }
  return url;
}

std::string ListQuery(std::string_view prefix, std::string_view continuation_token, int max_keys,
                      bool url_encoding) {
  // Sorted by parameter name: continuation-token < delimiter < encoding-type < list-type <
  // max-keys < prefix.
  std::string q;
  if (!continuation_token.empty())
    q += "continuation-token=" + UriEncode(continuation_token, false) + "&";
  q += url_encoding ? "delimiter=%2F&encoding-type=url&" : "delimiter=%2F&";
  q += "list-type=2&max-keys=" + std::to_string(max_keys) + "&prefix=" + UriEncode(prefix, false);
  return q;
}

Result<std::string> XmlUnescape(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '&') {
      out.push_back(s[i]);
      continue;
    }
    size_t end = s.find(';', i);
    if (end == std::string_view::npos || end - i > 12)
      return BadXml("unterminated entity in \"" + std::string(s.substr(i, 16)) + "\"");
    std::string_view ent = s.substr(i + 1, end - i - 1);
    if (ent == "lt") {
      out.push_back('<');
    } else if (ent == "gt") {
      out.push_back('>');
    } else if (ent == "amp") {
      out.push_back('&');
    } else if (ent == "quot") {
      out.push_back('"');
    } else if (ent == "apos") {
      out.push_back('\'');
    } else if (ent.size() >= 2 && ent[0] == '#') {
      const bool hex = ent[1] == 'x' || ent[1] == 'X';
      std::string_view digits = ent.substr(hex ? 2 : 1);
      uint32_t cp = 0;
      auto [p, ec] =
          std::from_chars(digits.data(), digits.data() + digits.size(), cp, hex ? 16 : 10);
      if (ec != std::errc() || p != digits.data() + digits.size() || digits.empty() || cp == 0 ||
          cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
        return BadXml("bad character reference &" + std::string(ent) + ";");
      AppendUtf8(cp, &out);
    } else {
      return BadXml("unknown entity &" + std::string(ent) + ";");
    }
    i = end;
  }
  return out;
}

Result<ListPage> ParseListObjectsV2(std::string_view xml) {
  ListPage page;
  ListedObject cur;
  bool url_encoded = false;
  bool root_ok = false;
  Status walk =
      WalkXml(xml, [&](const std::vector<std::string>& path, const std::string& text) -> Status {
        if (path.size() == 1) {
          root_ok = path[0] == "ListBucketResult";
          return Status::OK();
        }
        if (path[0] != "ListBucketResult") return Status::OK();
        if (Is(path, {"ListBucketResult", "IsTruncated"})) {
          page.truncated = text == "true";
        } else if (Is(path, {"ListBucketResult", "NextContinuationToken"})) {
          page.next_token = text;
        } else if (Is(path, {"ListBucketResult", "EncodingType"})) {
          url_encoded = text == "url";
        } else if (Is(path, {"ListBucketResult", "CommonPrefixes", "Prefix"})) {
          page.common_prefixes.push_back(text);
        } else if (Is(path, {"ListBucketResult", "Contents", "Key"})) {
          cur.key = text;
        } else if (Is(path, {"ListBucketResult", "Contents", "Size"})) {
          Result<uint64_t> size = ParseUint(text);
          if (!size.ok()) return BadXml("<Size> " + size.status().message());
          cur.size = size.value();
        } else if (Is(path, {"ListBucketResult", "Contents", "LastModified"})) {
          Result<int64_t> t = ParseIsoTime(text);
          if (!t.ok()) return BadXml("<LastModified> " + t.status().message());
          cur.last_modified_s = t.value();
        } else if (Is(path, {"ListBucketResult", "Contents", "ETag"})) {
          cur.etag = text;
        } else if (Is(path, {"ListBucketResult", "Contents"})) {
          page.objects.push_back(std::move(cur));
          cur = ListedObject();
        }
        return Status::OK();
      });
  if (!walk.ok()) return walk;
  if (!root_ok) return BadXml("not a ListBucketResult");
  page.url_encoded = url_encoded;
  if (url_encoded) {  // <EncodingType> comes after the keys: decode at the end
    for (auto& o : page.objects) o.key = UrlDecode(o.key);
    for (auto& p : page.common_prefixes) p = UrlDecode(p);
  }
  if (page.truncated && page.next_token.empty())
    return BadXml("truncated listing without a NextContinuationToken");
  return page;
}

std::string ErrorCode(std::string_view xml) {
  std::string code;
  Status ignored = WalkXml(xml, [&](const std::vector<std::string>& path, const std::string& text) {
    if (Is(path, {"Error", "Code"})) code = text;
    return Status::OK();
  });
  (void)ignored;  // a body that is not XML has no code
  return code;
}

std::string ErrorSummary(std::string_view xml) {
  std::string code, message;
  Status ignored = WalkXml(xml, [&](const std::vector<std::string>& path, const std::string& text) {
    if (Is(path, {"Error", "Code"})) code = text;
    if (Is(path, {"Error", "Message"})) message = text;
    return Status::OK();
  });
  (void)ignored;
  if (code.empty()) return "";
  if (message.size() > 200) message = message.substr(0, 200) + "...";
  return message.empty() ? code : code + ": " + message;
}

Result<int64_t> ParseHttpDate(std::string_view s) {
  // IMF-fixdate: "Sun, 06 Nov 1994 08:49:37 GMT".
  static const char* const kMonths[] = {"Jan", "Feb", "Mar", "Apr", "May", "Jun",
                                        "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"};
  std::string str(s);
  char wday[4] = {}, mon[4] = {}, zone[4] = {};
  int day = 0, year = 0, h = 0, m = 0, sec = 0, used = 0;
  if (std::sscanf(str.c_str(), "%3[A-Za-z], %d %3[A-Za-z] %d %d:%d:%d %3s%n", wday, &day, mon,
                  &year, &h, &m, &sec, zone, &used) != 8 ||
      static_cast<size_t>(used) != str.size() || std::strcmp(zone, "GMT") != 0)
    return Status::IOError("not an HTTP date: \"" + str + "\"");
  int month = -1;
  for (int i = 0; i < 12; ++i)
    if (std::strcmp(mon, kMonths[i]) == 0) month = i;
  if (month < 0 || day < 1 || day > 31 || h > 23 || m > 59 || sec > 60 || year < 1970)
    return Status::IOError("not an HTTP date: \"" + str + "\"");
  struct tm tm = {};
  tm.tm_year = year - 1900;
  tm.tm_mon = month;
  tm.tm_mday = day;
  tm.tm_hour = h;
  tm.tm_min = m;
  tm.tm_sec = sec;
  return static_cast<int64_t>(::timegm(&tm));
}

Result<int64_t> ParseIsoTime(std::string_view s) {
  // "2009-10-12T17:50:30.000Z"; the fraction is dropped (HEAD's Last-Modified has none).
  std::string str(s);
  int year = 0, mon = 0, day = 0, h = 0, m = 0, sec = 0, used = 0;
  if (std::sscanf(str.c_str(), "%4d-%2d-%2dT%2d:%2d:%2d%n", &year, &mon, &day, &h, &m, &sec,
                  &used) != 6 ||
      mon < 1 || mon > 12 || day < 1 || day > 31 || h > 23 || m > 59 || sec > 60 || year < 1970)
    return Status::IOError("not an ISO 8601 time: \"" + str + "\"");
  std::string_view tail = s.substr(static_cast<size_t>(used));
  if (!tail.empty() && tail[0] == '.') {
    size_t digits = tail.find_first_not_of("0123456789", 1);
    tail = tail.substr(digits == std::string_view::npos ? tail.size() : digits);
  }
  if (!(tail.empty() || tail == "Z" || tail == "+00:00"))
    return Status::IOError("not a UTC ISO 8601 time: \"" + str + "\"");
  struct tm tm = {};
  tm.tm_year = year - 1900;
  tm.tm_mon = mon - 1;
  tm.tm_mday = day;
  tm.tm_hour = h;
  tm.tm_min = m;
  tm.tm_sec = sec;
  return static_cast<int64_t>(::timegm(&tm));
}

std::string_view NormalizeEtag(std::string_view etag) {
  if (StartsWith(etag, "W/")) etag.remove_prefix(2);
  if (etag.size() >= 2 && etag.front() == '"' && etag.back() == '"')
    etag = etag.substr(1, etag.size() - 2);
  return etag;
}

int64_t ObjectMtimeNs(int64_t last_modified_s, std::string_view etag) {
  uint64_t h = 14695981039346656037ull;  // FNV-1a, 64 bits
  for (char c : NormalizeEtag(etag)) {
    h ^= static_cast<unsigned char>(c);
    h *= 1099511628211ull;
  }
  return last_modified_s * 1'000'000'000 + static_cast<int64_t>(h % 1'000'000'000);
}

Result<ContentRange> ParseContentRange(std::string_view v) {
  auto bad = [&] { return Status::IOError("bad Content-Range \"" + std::string(v) + "\""); };
  if (!StartsWith(v, "bytes ")) return bad();
  v.remove_prefix(6);
  size_t slash = v.find('/');
  if (slash == std::string_view::npos) return bad();
  ContentRange r;
  Result<uint64_t> total = ParseUint(v.substr(slash + 1));
  if (!total.ok()) return bad();
  r.total = total.value();
  std::string_view range = v.substr(0, slash);
  if (range == "*") return r;
  size_t dash = range.find('-');
  if (dash == std::string_view::npos) return bad();
  Result<uint64_t> first = ParseUint(range.substr(0, dash));
  Result<uint64_t> last = ParseUint(range.substr(dash + 1));
  if (!first.ok() || !last.ok() || first.value() > last.value() || last.value() >= r.total)
    return bad();
  r.has_range = true;
  r.first = first.value();
  r.last = last.value();
  return r;
}

Status HttpError(std::string_view op, std::string_view bucket, std::string_view key,
                 long http_status, std::string_view body) {
  std::string msg = "s3 ";
  msg.append(op).append(" ").append(bucket);
  if (!key.empty()) msg.append("/").append(key);
  msg.append(": HTTP ").append(std::to_string(http_status));
  std::string summary = ErrorSummary(body);
  if (!summary.empty()) msg += " (" + summary + ")";
  switch (http_status) {
    case 404:
      return Status::NotFound(msg);
    case 403:
      return Status::PermissionDenied(msg);
    case 412:
      return Status::Stale(msg + ": the object changed");
    default:
      return Status::IOError(msg);
  }
}

bool RetryableHttp(long http_status, std::string_view error_code) {
  if (http_status >= 500 || http_status == 429) return true;
  return error_code == "RequestTimeout" || error_code == "SlowDown" ||
         error_code == "InternalError" || error_code == "ServiceUnavailable";
}

uint64_t BackoffMs(uint32_t attempt, uint64_t base_ms, uint64_t max_ms, double jitter) {
  uint64_t d = base_ms;
  for (uint32_t i = 1; i < attempt && d < max_ms; ++i) d *= 2;
  d = std::min(d, max_ms);
  jitter = std::clamp(jitter, 0.0, 1.0);
  return d / 2 + static_cast<uint64_t>(static_cast<double>(d / 2) * jitter);
}

}  // namespace cubetorchfs::cfs_client::s3
