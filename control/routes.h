// The control API's route table: every route the control server serves, with its method, its
// target pattern, the threads it runs on and where it may be asked. ServerImpl::Handle
// (control_routes.cc) answers through it; docs/control-api.md documents the same table, and a
// unit test (tests/control/control_routes_test.cc) checks the two agree.
//
// Internal to control/ and its tests.
//
// Thread safety: the table is constant; MatchRoute is a pure function.
#pragma once

#include <boost/beast/http/verb.hpp>
#include <span>
#include <string>
#include <string_view>

namespace cubetorchfs::control::detail {

enum class RouteId {
  kCreateStream,      // POST /v1/streams
  kPublishPaths,      // POST /v1/streams/{id}/paths
  kPublishPositions,  // POST /v1/streams/{id}/positions
  kDeleteStream,      // DELETE /v1/streams/{id}
  kCreateList,        // POST /v1/lists
  kAppendList,        // POST /v1/lists/{id}
  kDeleteList,        // DELETE /v1/lists/{id}
  kStats,             // GET /v1/stats
  kOpenFile,          // POST /v1/files/open
  kWarmup,            // POST /v1/warmup
  kHealth,            // GET /v1/health
  kUpgrade,           // POST /v1/admin/upgrade
  kLegacyPrefetch,    // POST /prefetch/read/path
  kRegisterPid,       // POST /register/pid
  kUnregisterPid,     // POST /unregister/pid
  kBatchDownload,     // POST /batchdownload/path
  kBatchFiles,        // POST /v1/files/batch
};

// The worker threads a route runs on. Opens of big files take long and get their own, so that
// /batchdownload and /v1/warmup never queue behind them, nor they behind those; the rest (JSON
// and path checks) never wait behind file data.
enum class Pool { kApi, kData, kOpen };

struct RouteSpec {
  RouteId id;
  boost::beast::http::verb method;
  std::string_view pattern;  // "{id}" stands for one non-empty segment without '/'
  Pool pool;
  bool unix_only;  // passes a descriptor (SCM_RIGHTS): not over the TCP port
};

// clang-format off
inline constexpr RouteSpec kRoutes[] = {
    {RouteId::kCreateStream,   boost::beast::http::verb::post,    "/v1/streams",            Pool::kApi,  false},
    {RouteId::kPublishPaths,   boost::beast::http::verb::post,    "/v1/streams/{id}/paths", Pool::kApi,  false},
    {RouteId::kPublishPositions, boost::beast::http::verb::post,  "/v1/streams/{id}/positions", Pool::kApi, false},
    {RouteId::kDeleteStream,   boost::beast::http::verb::delete_, "/v1/streams/{id}",       Pool::kApi,  false},
    {RouteId::kCreateList,     boost::beast::http::verb::post,    "/v1/lists",              Pool::kApi,  false},
    {RouteId::kAppendList,     boost::beast::http::verb::post,    "/v1/lists/{id}",         Pool::kApi,  false},
    {RouteId::kDeleteList,     boost::beast::http::verb::delete_, "/v1/lists/{id}",         Pool::kApi,  false},
    {RouteId::kStats,          boost::beast::http::verb::get,     "/v1/stats",              Pool::kApi,  false},
    {RouteId::kOpenFile,       boost::beast::http::verb::post,    "/v1/files/open",         Pool::kOpen, true},
    {RouteId::kWarmup,         boost::beast::http::verb::post,    "/v1/warmup",             Pool::kData, false},
    {RouteId::kHealth,         boost::beast::http::verb::get,     "/v1/health",             Pool::kApi,  false},
    {RouteId::kUpgrade,        boost::beast::http::verb::post,    "/v1/admin/upgrade",      Pool::kApi,  false},
    {RouteId::kLegacyPrefetch, boost::beast::http::verb::post,    "/prefetch/read/path",    Pool::kApi,  false},
    {RouteId::kRegisterPid,    boost::beast::http::verb::post,    "/register/pid",          Pool::kApi,  false},
    {RouteId::kUnregisterPid,  boost::beast::http::verb::post,    "/unregister/pid",        Pool::kApi,  false},
    {RouteId::kBatchDownload,  boost::beast::http::verb::post,    "/batchdownload/path",    Pool::kData, false},
    {RouteId::kBatchFiles,     boost::beast::http::verb::post,    "/v1/files/batch",        Pool::kData, true},
};
// clang-format on

// What a request's method and target name.
struct RouteMatch {
  // The route, or null: no route has this target (404), or none has it with this method (405,
  // `allowed` says which methods it has, e.g. "POST" or "POST, DELETE").
  const RouteSpec* route = nullptr;
  std::string id;       // the "{id}" segment of the target, if its pattern has one
  std::string allowed;  // with no route: the methods the target has; empty for an unknown one
};

// Matches `target` (the request target as sent; a query string is not part of any route, so a
// target with one matches nothing) against `routes`.
RouteMatch MatchRoute(boost::beast::http::verb method, std::string_view target,
                      std::span<const RouteSpec> routes = kRoutes);

}  // namespace cubetorchfs::control::detail
