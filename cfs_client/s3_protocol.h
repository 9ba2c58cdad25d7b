// The S3 protocol without the network: object keys for paths, URLs and their encoding, the
// ListObjectsV2 reply, HTTP dates, how an object's Last-Modified and ETag become a FileVersion,
// and which HTTP replies are errors or worth a retry.
//
// Used by s3_backend.cc and s3_transport.cc (only the transport includes curl); kept apart
// so unit tests cover it without a server. Thread-safe: every function depends on its arguments
// only.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace cubetorchfs::cfs_client::s3 {

// ---------------------------------------------------------------------------- keys and URLs

// Percent-encodes every byte except the unreserved characters (A-Z a-z 0-9 - _ . ~) and, when
// `keep_slash`, '/'. This is the encoding both S3 and SigV4's canonical request expect of a
// path and of query values, so the URL we send is already in canonical form.
std::string UriEncode(std::string_view s, bool keep_slash);

// Decodes %XX escapes and '+' as a space (S3 answers `encoding-type=url` listings in
// form encoding). A malformed escape is kept as it is.
std::string UrlDecode(std::string_view s);

// Key of file `path` (relative, no leading '/'): "prefix/path", or "path" without a prefix.
std::string ObjectKey(std::string_view prefix, std::string_view path);

// Key prefix shared by the entries of directory `path`: "prefix/path/", "prefix/" for the
// root, or "" for the root of a bucket served without a prefix.
std::string DirKeyPrefix(std::string_view prefix, std::string_view path);

// The entry name that a listed key or common prefix gives under `dir_prefix`, or "" when it
// gives none: the directory's own marker object ("dir/"), an empty path segment ("dir//x"),
// "." or "..", or something outside `dir_prefix`.
std::string EntryName(std::string_view dir_prefix, std::string_view key_or_prefix);

// Where a bucket lives: `scheme://host[:port][/base]`, split.
struct Endpoint {
  std::string scheme;     // "http" or "https"
  std::string authority;  // "host[:port]"
  std::string base_path;  // "" or "/base", no trailing '/'
};
Result<Endpoint> ParseEndpoint(std::string_view url);

// URL of object `key` of `bucket`; of the bucket itself when `key` is empty. Path-style:
// scheme://host/base/bucket/key; virtual-hosted: scheme://bucket.host/base/key. `key` is
// URI-encoded here, segment by segment.
std::string ObjectUrl(const Endpoint& e, std::string_view bucket, bool path_style,
                      std::string_view key);

// Query string of a ListObjectsV2 request (delimiter "/", url-encoded keys in the reply):
// parameters sorted by name and values URI-encoded, the canonical form SigV4 signs, so it
// needs no rewriting by libcurl (7.88 signs the query exactly as given).
// `url_encoding`: ask for encoding-type=url (keys any byte string may be, carried safely in
// XML); without it the keys come as they are, XML-escaped.
std::string ListQuery(std::string_view prefix, std::string_view continuation_token, int max_keys,
                      bool url_encoding = true);

// ---------------------------------------------------------------------------- XML replies

// Replaces the five named XML entities and numeric character references. Fails on an unknown
// or malformed entity.
Result<std::string> XmlUnescape(std::string_view s);

struct ListedObject {
  std::string key;  // decoded
  uint64_t size = 0;
  int64_t last_modified_s = 0;  // whole seconds since the epoch
  std::string etag;             // as sent, quotes included
};

struct ListPage {
  std::vector<ListedObject> objects;
  std::vector<std::string> common_prefixes;  // decoded, ending in the delimiter
  bool truncated = false;
  std::string next_token;    // NextContinuationToken; never url-encoded
  bool url_encoded = false;  // the reply said <EncodingType>url</EncodingType>
};

// Parses a ListBucketResult (ListObjectsV2). Keys and prefixes are url-decoded when the reply
// says <EncodingType>url</EncodingType> (servers that ignore the request send them plain).
// Fails on malformed XML, a different root element, or a truncated page without a token.
Result<ListPage> ParseListObjectsV2(std::string_view xml);

// "NoSuchKey: The specified key does not exist." from an S3 <Error> reply; "" when the body
// is not one (HEAD replies have no body).
std::string ErrorSummary(std::string_view xml);
// Just the <Code> of an S3 <Error> reply, or "".
std::string ErrorCode(std::string_view xml);

// ---------------------------------------------------------------------------- attributes

// Parses an HTTP date ("Sun, 06 Nov 1994 08:49:37 GMT", RFC 7231 IMF-fixdate).
Result<int64_t> ParseHttpDate(std::string_view s);
// Parses an ISO 8601 UTC time ("2009-10-12T17:50:30.000Z") to whole seconds.
Result<int64_t> ParseIsoTime(std::string_view s);

// The ETag without a weak marker and quotes: W/"abc" and "abc" both give abc.
std::string_view NormalizeEtag(std::string_view etag);

// The mtime_ns an object shows, and so its FileVersion. S3 gives Last-Modified in whole seconds,
// so an overwrite within the same second would keep the version; the nanosecond part therefore
// holds a hash of the ETag (FNV-1a modulo 10^9): the version changes whenever the ETag does,
// and a listing and a HEAD of the same object agree. The seconds are the real Last-Modified.
int64_t ObjectMtimeNs(int64_t last_modified_s, std::string_view etag);

// "bytes FIRST-LAST/TOTAL" (or "bytes */TOTAL"); TOTAL "*" (unknown) is rejected.
struct ContentRange {
  bool has_range = false;
  uint64_t first = 0, last = 0, total = 0;
};
Result<ContentRange> ParseContentRange(std::string_view v);

// ---------------------------------------------------------------------------- errors, retries

// The Status of a failed request: 404 NotFound, 403 PermissionDenied, 412 Stale, anything else
// IOError. The message names the operation, the bucket and key, the HTTP status and the S3
// error from `body` when there is one; never credentials.
Status HttpError(std::string_view op, std::string_view bucket, std::string_view key,
                 long http_status, std::string_view body);

// Whether a reply is worth another try: 5xx, 429, and S3's RequestTimeout / SlowDown codes.
bool RetryableHttp(long http_status, std::string_view error_code);

// Milliseconds to wait before retry number `attempt` (1, 2, ...): exponential from `base_ms`,
// capped at `max_ms`, with "equal jitter": half fixed, half scaled by `jitter` in [0, 1).
uint64_t BackoffMs(uint32_t attempt, uint64_t base_ms, uint64_t max_ms, double jitter);

}  // namespace cubetorchfs::cfs_client::s3
