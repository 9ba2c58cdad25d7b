// The control API's routes (control/routes.h, control/control_routes.cc), each answered by a
// real ServerImpl over the world of route_world.h: its status codes and error bodies, as
// docs/control-api.md gives them, for root and for other users. Also the route table itself:
// matching, and that the routes documented are the routes served.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <boost/beast/http.hpp>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <utility>

#include "common/status.h"
#include "control/batch_memory.h"
#include "control/routes.h"
#include "control/server_impl.h"
#include "gtest/gtest.h"
#include "tests/control/route_world.h"

namespace cubetorchfs::control {
namespace {

namespace http = boost::beast::http;
using detail::MatchRoute;
using detail::Reply;
using detail::Request;
using detail::RouteId;
using detail::ServerImpl;
using json = nlohmann::json;
using prefetch::Caller;
using testing::RouteWorld;

// ---------------------------------------------------------------------------- the table

TEST(RouteTable, MatchesEachRouteAndCapturesTheStreamId) {
  for (const auto& r : detail::kRoutes) {
    std::string target(r.pattern);
    const size_t at = target.find("{id}");
    if (at != std::string::npos) target.replace(at, 4, "s42");
    const detail::RouteMatch m = MatchRoute(r.method, target);
    ASSERT_NE(m.route, nullptr) << r.pattern;
    EXPECT_EQ(m.route->id, r.id) << r.pattern;
    EXPECT_EQ(m.id, at != std::string::npos ? "s42" : "") << r.pattern;
  }
}

TEST(RouteTable, WrongMethodNamesTheAllowedOnes) {
  detail::RouteMatch m = MatchRoute(http::verb::get, "/v1/streams");
  EXPECT_EQ(m.route, nullptr);
  EXPECT_EQ(m.allowed, "POST");
  m = MatchRoute(http::verb::put, "/v1/streams/s1");
  EXPECT_EQ(m.route, nullptr);
  EXPECT_EQ(m.allowed, "DELETE");
  m = MatchRoute(http::verb::post, "/v1/stats");
  EXPECT_EQ(m.allowed, "GET");
}

TEST(RouteTable, UnknownTargetsMatchNothing) {
  for (const char* t : {"/", "", "/v1", "/v1/streams/", "/v1/streams//paths", "/v1/streams/a/b",
                        "/v1/streams/a/paths/", "/v1/stats?x=1", "/v1/stats/", "//v1/stats",
                        "/V1/STATS", "/v1/streams/a/b/paths", "/v1/health/x"}) {
    const detail::RouteMatch m = MatchRoute(http::verb::post, t);
    EXPECT_EQ(m.route, nullptr) << t;
    if (std::string(t) != "/v1/streams/" && std::string(t).rfind("/v1/stats", 0) != 0) {
      EXPECT_EQ(m.allowed, "") << t;
    }
  }
  // A segment with a slash is no stream id.
  EXPECT_EQ(MatchRoute(http::verb::delete_, "/v1/streams/a/b").route, nullptr);
}

// The routes of docs/control-api.md's table (rows "| `METHOD /path` | ..."), as the table of
// routes.h serves them: every route documented, every documented route served.
TEST(RouteTable, DocumentedRoutesAreTheServedRoutes) {
  std::ifstream doc(std::string(CTFS_SOURCE_DIR) + "/docs/control-api.md");
  ASSERT_TRUE(doc) << "docs/control-api.md";
  std::set<std::pair<std::string, std::string>> documented, served;
  const std::regex row(R"(^\| `(GET|POST|DELETE|PUT|PATCH|HEAD) (/[^` ]*)`)");
  for (std::string line; std::getline(doc, line);) {
    std::smatch m;
    if (std::regex_search(line, m, row)) documented.insert({m[1], m[2]});
  }
  for (const auto& r : detail::kRoutes)
    served.insert({std::string(http::to_string(r.method)), std::string(r.pattern)});
  EXPECT_EQ(documented, served);
}

// ---------------------------------------------------------------------------- the routes

struct Answer {
  unsigned status = 0;
  std::string text;  // the body as sent
  json body;         // parsed, when it is JSON
  std::string allow;
  int fd = -1;
};

class RoutesTest : public ::testing::Test {
 protected:
  RoutesTest() : world_(/*log_to_file=*/false) { server_ = world_.MakeServer(Options()); }
  ~RoutesTest() override {
    server_.reset();
    for (int fd : fds_) ::close(fd);
  }

  ControlServer::Options Options() { return world_.ServerOptions(); }

  const Caller& Root() { return world_.callers[0]; }
  const Caller& Stranger() { return world_.callers[1]; }
  const Caller& GroupMember() { return world_.callers[2]; }
  const Caller& Other() { return world_.callers[3]; }

  // One request answered by `server` (default: the test's) as the worker would answer it.
  Answer Ask(const Caller& who, http::verb method, const std::string& target,
             const std::string& body = "", bool over_unix = true, ServerImpl* server = nullptr) {
    Request req{method, target, 11};
    req.set(http::field::host, "localhost");
    req.body() = body;
    req.prepare_payload();
    Reply r = (server ? server : server_.get())->Handle(req, who, over_unix, -1);
    EXPECT_FALSE(r.sent) << target;
    Answer a;
    a.status = r.res.result_int();
    a.text = r.res.body();
    a.allow = std::string(r.res[http::field::allow]);
    if (r.res[http::field::content_type] == "application/json")
      a.body = json::parse(a.text, nullptr, false);
    a.fd = r.fd;
    if (r.fd >= 0) fds_.push_back(r.fd);
    return a;
  }
  Answer Post(const Caller& who, const std::string& target, const json& body) {
    return Ask(who, http::verb::post, target, body.dump());
  }

  // A stream of `who`; its id.
  std::string NewStream(const Caller& who) {
    const Answer a = Post(who, "/v1/streams", {{"name", "test"}, {"pid", 7}});
    EXPECT_EQ(a.status, 201u) << a.text;
    return a.body.value("id", "");
  }

  RouteWorld world_;
  std::unique_ptr<ServerImpl> server_;
  std::vector<int> fds_;
};

// An error reply: the status, and the body of docs/errors.md with the code named.
#define EXPECT_ERROR(answer, want_status, want_code)                                           \
  do {                                                                                         \
    const Answer& a_ = (answer);                                                               \
    EXPECT_EQ(a_.status, static_cast<unsigned>(want_status)) << a_.text;                       \
    ASSERT_TRUE(a_.body.is_object()) << a_.text;                                               \
    EXPECT_TRUE(a_.body.contains("error") && a_.body["error"].is_string() &&                   \
                !a_.body["error"].get<std::string>().empty())                                  \
        << a_.text;                                                                            \
    EXPECT_EQ(a_.body.value("code", ""), want_code) << a_.text;                                \
    EXPECT_TRUE(a_.body.contains("errno") && a_.body["errno"].is_number_integer()) << a_.text; \
  } while (0)

std::string ErrorText(const Answer& a) { return a.body.value("error", ""); }

TEST_F(RoutesTest, UnknownRouteIs404NotSupported) {
  const Answer a = Ask(Root(), http::verb::get, "/v2/anything");
  EXPECT_ERROR(a, 404, "not_supported");
  EXPECT_NE(ErrorText(a).find("no route /v2/anything"), std::string::npos);
}

TEST_F(RoutesTest, WrongMethodIs405WithAllow) {
  const Answer a = Ask(Root(), http::verb::get, "/v1/streams");
  EXPECT_ERROR(a, 405, "not_supported");
  EXPECT_EQ(a.allow, "POST");
  EXPECT_EQ(ErrorText(a), "use POST");
  EXPECT_EQ(Ask(Root(), http::verb::post, "/v1/stats").allow, "GET");
  EXPECT_EQ(Ask(Root(), http::verb::get, "/v1/streams/s1").allow, "DELETE");
  EXPECT_EQ(Ask(Root(), http::verb::get, "/batchdownload/path").allow, "POST");
}

TEST_F(RoutesTest, CreateStream) {
  Answer a = Post(Stranger(), "/v1/streams", {{"name", "ImageFolder:1"}, {"pid", 4242}});
  EXPECT_EQ(a.status, 201u);
  EXPECT_TRUE(a.body["id"].is_string());
  a = Post(Stranger(), "/v1/streams", json::object());  // name and pid are optional
  EXPECT_EQ(a.status, 201u) << a.text;
  // 2 streams a user (the world's limit): the third is refused, naming the limit.
  a = Post(Stranger(), "/v1/streams", json::object());
  EXPECT_ERROR(a, 429, "io_error");
  EXPECT_NE(ErrorText(a).find("prefetch.max_streams_per_uid"), std::string::npos);
  // Another user has its own limit.
  EXPECT_EQ(Post(Other(), "/v1/streams", json::object()).status, 201u);

  EXPECT_ERROR(Post(Root(), "/v1/streams", json::array()), 400, "invalid_argument");
  EXPECT_ERROR(Post(Root(), "/v1/streams", {{"name", 5}}), 400, "invalid_argument");
  EXPECT_ERROR(Post(Root(), "/v1/streams", {{"pid", "x"}}), 400, "invalid_argument");
  // A stream's mode: "prefetch" (the default) or "batch".
  EXPECT_EQ(Post(Root(), "/v1/streams", {{"mode", "batch"}}).status, 201u);
  EXPECT_EQ(Post(Root(), "/v1/streams", {{"mode", "prefetch"}}).status, 201u);
  EXPECT_ERROR(Post(Root(), "/v1/streams", {{"mode", "fast"}}), 400, "invalid_argument");
  EXPECT_ERROR(Post(Root(), "/v1/streams", {{"mode", 1}}), 400, "invalid_argument");
  EXPECT_ERROR(Ask(Root(), http::verb::post, "/v1/streams", "{not json"), 400, "invalid_argument");
  // Over the JSON depth limit: refused before it is parsed.
  a = Ask(Root(), http::verb::post, "/v1/streams", std::string(40, '[') + std::string(40, ']'));
  EXPECT_ERROR(a, 400, "invalid_argument");
  EXPECT_NE(ErrorText(a).find("body refused"), std::string::npos);
}

TEST_F(RoutesTest, PublishPaths) {
  const std::string id = NewStream(Stranger());
  const std::string target = "/v1/streams/" + id + "/paths";
  Answer a = Post(Stranger(), target,
                  {{"paths",
                    {std::string(testing::kMount) + "/data/a.jpg", "data/cls/c.jpg",
                     "/elsewhere/x.jpg", "private/inner.bin"}}});
  EXPECT_EQ(a.status, 202u) << a.text;
  EXPECT_EQ(a.body["accepted"], 2);
  EXPECT_EQ(a.body["rejected"], 2);  // outside the mount; in a directory only root may search
  a = Post(Stranger(), target, {{"paths", {"data/a.jpg"}}, {"unread", 1}});
  EXPECT_EQ(a.status, 202u) << a.text;

  // No acceptable path at all: 422, naming why.
  a = Post(Stranger(), target, {{"paths", {"../etc/passwd"}}});
  EXPECT_ERROR(a, 422, "invalid_argument");
  EXPECT_NE(ErrorText(a).find("\"..\""), std::string::npos);
  // Malformed bodies.
  EXPECT_ERROR(Post(Stranger(), target, json::object()), 400, "invalid_argument");
  EXPECT_ERROR(Post(Stranger(), target, {{"paths", "data/a.jpg"}}), 400, "invalid_argument");
  EXPECT_ERROR(Post(Stranger(), target, {{"paths", {1, 2}}}), 400, "invalid_argument");
  EXPECT_ERROR(Post(Stranger(), target, {{"paths", {"data/a.jpg"}}, {"unread", -1}}), 400,
               "invalid_argument");
  // Streams belong to their creator; root may publish to any.
  EXPECT_ERROR(Post(Other(), target, {{"paths", {"data/a.jpg"}}}), 403, "permission_denied");
  EXPECT_EQ(Post(Root(), target, {{"paths", {"data/a.jpg"}}}).status, 202u);
  EXPECT_ERROR(Post(Stranger(), "/v1/streams/nosuch/paths", {{"paths", {"data/a.jpg"}}}), 404,
               "not_found");
  // 8 queued paths a user: a publish past it is refused whole, naming the limit.
  a = Post(Stranger(), target, {{"paths", std::vector<std::string>(9, "data/a.jpg")}});
  EXPECT_ERROR(a, 429, "io_error");
  EXPECT_NE(ErrorText(a).find("prefetch.max_queued_paths_per_uid"), std::string::npos);
}

// NUL-terminated paths: the body of POST /v1/lists.
std::string ListBody(const std::vector<std::string>& paths) {
  std::string body;
  for (const auto& p : paths) body += p + '\0';
  return body;
}

// The body of POST /v1/streams/{id}/positions: `unread` (all ones: none), then the positions.
std::string PositionsBody(const std::vector<uint32_t>& positions, uint64_t unread = UINT64_MAX) {
  std::string body;
  for (int i = 0; i < 8; ++i) body.push_back(static_cast<char>((unread >> (8 * i)) & 0xff));
  for (uint32_t p : positions)
    for (int i = 0; i < 4; ++i) body.push_back(static_cast<char>((p >> (8 * i)) & 0xff));
  return body;
}

TEST_F(RoutesTest, RegisteredListsAndPositions) {
  // Registered once: each path resolved and checked for the caller; a refused one keeps its
  // number, empty.
  Answer a = Ask(Stranger(), http::verb::post, "/v1/lists",
                 ListBody({std::string(testing::kMount) + "/data/a.jpg", "private/inner.bin",
                           "data/cls/c.jpg", "/elsewhere/x.jpg"}));
  ASSERT_EQ(a.status, 201u) << a.text;
  const std::string list = a.body.value("id", "");
  EXPECT_EQ(a.body["first"], 0);
  EXPECT_EQ(a.body["size"], 4);
  EXPECT_EQ(a.body["rejected"], 2);
  EXPECT_NE(a.body.value("error", "").find("permission denied"), std::string::npos) << a.text;
  a = Ask(Stranger(), http::verb::post, "/v1/lists/" + list, ListBody({"data/empty"}));
  ASSERT_EQ(a.status, 200u) << a.text;
  EXPECT_EQ(a.body["first"], 4);
  EXPECT_EQ(a.body["size"], 5);
  // Lists belong to their creator.
  EXPECT_ERROR(Ask(Other(), http::verb::post, "/v1/lists/" + list, ListBody({"data/a.jpg"})), 403,
               "permission_denied");
  EXPECT_ERROR(Post(Other(), "/v1/streams", {{"list", list}}), 403, "permission_denied");
  // A stream made with the list takes positions in it, with `unread` as for paths.
  a = Post(Stranger(), "/v1/streams", {{"name", "ImageFolder:1"}, {"list", list}});
  ASSERT_EQ(a.status, 201u) << a.text;
  const std::string id = a.body.value("id", "");
  const std::string target = "/v1/streams/" + id + "/positions";
  a = Ask(Stranger(), http::verb::post, target, PositionsBody({2, 0, 1, 4}, 4));
  ASSERT_EQ(a.status, 202u) << a.text;
  EXPECT_EQ(a.body["accepted"], 3);
  EXPECT_EQ(a.body["rejected"], 1);  // entry 1: refused at registration
  const json st = Ask(Stranger(), http::verb::get, "/v1/stats").body;
  ASSERT_EQ(st["streams"].size(), 1u);
  EXPECT_EQ(st["streams"][0]["published"], 3);
  EXPECT_EQ(st["global"]["lists"]["lists"], 1);
  EXPECT_EQ(st["global"]["lists"]["entries"], 5);
  world_.prefetcher->RunOneJob();
  EXPECT_GE(world_.prefetcher->GetStats().fetched, 1u);  // data/cls/c.jpg first
  // Malformed: not 8 + 4n bytes; a position past the end; a stream without a list.
  EXPECT_ERROR(Ask(Stranger(), http::verb::post, target, "1234"), 400, "invalid_argument");
  EXPECT_ERROR(Ask(Stranger(), http::verb::post, target, PositionsBody({0}) + "x"), 400,
               "invalid_argument");
  a = Ask(Stranger(), http::verb::post, target, PositionsBody({5}));
  EXPECT_ERROR(a, 400, "invalid_argument");
  EXPECT_NE(ErrorText(a).find("past the end"), std::string::npos) << a.text;
  const std::string plain = NewStream(Stranger());
  EXPECT_ERROR(
      Ask(Stranger(), http::verb::post, "/v1/streams/" + plain + "/positions", PositionsBody({0})),
      400, "invalid_argument");
  EXPECT_ERROR(Ask(Other(), http::verb::post, target, PositionsBody({0})), 403,
               "permission_denied");
  // A body of paths must end each with a NUL.
  EXPECT_ERROR(Ask(Stranger(), http::verb::post, "/v1/lists", "data/a.jpg"), 400,
               "invalid_argument");
  // Deleted: positions and new streams are told the list is gone (410), so the publisher
  // registers it again.
  EXPECT_ERROR(Ask(Other(), http::verb::delete_, "/v1/lists/" + list), 403, "permission_denied");
  EXPECT_EQ(Ask(Stranger(), http::verb::delete_, "/v1/lists/" + list).status, 204u);
  EXPECT_ERROR(Ask(Stranger(), http::verb::delete_, "/v1/lists/" + list), 404, "not_found");
  EXPECT_ERROR(Ask(Stranger(), http::verb::post, target, PositionsBody({0})), 410, "stale");
  EXPECT_ERROR(Post(Stranger(), "/v1/streams", {{"list", list}}), 410, "stale");
  EXPECT_ERROR(Ask(Stranger(), http::verb::post, "/v1/lists/" + list, ListBody({"data/a.jpg"})),
               410, "stale");
}

// The fourth security pass: positions were decoded before the queued-path limits applied, so
// a long path named 131,072 times held 500 MB of paths before the publish was refused.
TEST_F(RoutesTest, PositionsPastWhatOneUserMayQueueAreRefusedBeforeTheyAreDecoded) {
  Answer a = Ask(Stranger(), http::verb::post, "/v1/lists",
                 ListBody({"data/cls/c.jpg", "private/inner.bin"}));
  ASSERT_EQ(a.status, 201u) << a.text;
  const std::string list = a.body.value("id", "");
  a = Post(Stranger(), "/v1/streams", {{"name", "ImageFolder:1"}, {"list", list}});
  ASSERT_EQ(a.status, 201u) << a.text;
  const std::string target = "/v1/streams/" + a.body.value("id", "") + "/positions";
  // Alone, a user may queue half of prefetch.max_queued_paths (12 here): 7 paths never fit.
  a = Ask(Stranger(), http::verb::post, target, PositionsBody(std::vector<uint32_t>(7, 0)));
  EXPECT_ERROR(a, 429, "io_error");
  EXPECT_NE(ErrorText(a).find("half of prefetch.max_queued_paths"), std::string::npos) << a.text;
  // Refused entries are no paths: they count for nothing.
  std::vector<uint32_t> positions(20, 1);
  positions.insert(positions.end(), 6, 0);
  a = Ask(Stranger(), http::verb::post, target, PositionsBody(positions));
  ASSERT_EQ(a.status, 202u) << a.text;
  EXPECT_EQ(a.body["accepted"], 6);
  EXPECT_EQ(a.body["rejected"], 20);
  // The bytes likewise, counted as the queue counts them, before the rest is decoded.
  ControlServer::Options o = Options();
  o.queued = {.paths_per_uid = 1000, .bytes_per_uid = 2000, .paths = 2000, .bytes = 1 << 20};
  auto server = world_.MakeServer(o);
  a = Ask(Stranger(), http::verb::post, "/v1/lists", ListBody({"data/cls/c.jpg"}), true,
          server.get());
  ASSERT_EQ(a.status, 201u) << a.text;
  a = Ask(Stranger(), http::verb::post, "/v1/streams",
          json{{"name", "x"}, {"list", a.body.value("id", "")}}.dump(), true, server.get());
  ASSERT_EQ(a.status, 201u) << a.text;
  const std::string bytes_target = "/v1/streams/" + a.body.value("id", "") + "/positions";
  const uint64_t each = prefetch::Prefetcher::QueuedPathCost(std::string("data/cls/c.jpg").size());
  a = Ask(Stranger(), http::verb::post, bytes_target,
          PositionsBody(std::vector<uint32_t>(2000 / each + 1, 0)), true, server.get());
  EXPECT_ERROR(a, 429, "io_error");
  EXPECT_NE(ErrorText(a).find("prefetch.max_queued_path_bytes_per_uid = 2000 bytes"),
            std::string::npos)
      << a.text;
  EXPECT_EQ(Ask(Stranger(), http::verb::get, "/v1/stats", "", true, server.get())
                .body["global"]["prefetch"]["queued_paths"],
            6);  // the first server's six: nothing of the refused ones
}

TEST_F(RoutesTest, FileListLimits) {
  // More paths in one request than control.max_json_elements (64 here): refused.
  std::vector<std::string> many(65, "data/a.jpg");
  EXPECT_ERROR(Ask(Stranger(), http::verb::post, "/v1/lists", ListBody(many)), 400,
               "invalid_argument");
  // At its count of lists a user loses its least recently used one, not another user's.
  const std::string theirs =
      Ask(Other(), http::verb::post, "/v1/lists", ListBody({"data/a.jpg"})).body.value("id", "");
  std::vector<std::string> mine;
  for (int i = 0; i < 17; ++i) {
    const Answer a = Ask(Stranger(), http::verb::post, "/v1/lists", ListBody({"data/a.jpg"}));
    ASSERT_EQ(a.status, 201u) << a.text;
    mine.push_back(a.body.value("id", ""));
  }
  EXPECT_ERROR(Ask(Stranger(), http::verb::post, "/v1/lists/" + mine[0], ListBody({})), 410,
               "stale");
  EXPECT_EQ(Ask(Stranger(), http::verb::post, "/v1/lists/" + mine[1], ListBody({})).status, 200u);
  EXPECT_EQ(Ask(Other(), http::verb::post, "/v1/lists/" + theirs, ListBody({})).status, 200u);
  EXPECT_EQ(Ask(Stranger(), http::verb::get, "/v1/stats").body["global"]["lists"]["lists"], 16);
}

TEST_F(RoutesTest, DeleteStream) {
  const std::string id = NewStream(Stranger());
  EXPECT_ERROR(Ask(Other(), http::verb::delete_, "/v1/streams/" + id), 403, "permission_denied");
  const Answer a = Ask(Stranger(), http::verb::delete_, "/v1/streams/" + id);
  EXPECT_EQ(a.status, 204u);
  EXPECT_TRUE(a.text.empty());
  EXPECT_ERROR(Ask(Stranger(), http::verb::delete_, "/v1/streams/" + id), 404, "not_found");
  // Root may delete another user's stream.
  const std::string other = NewStream(Other());
  EXPECT_EQ(Ask(Root(), http::verb::delete_, "/v1/streams/" + other).status, 204u);
}

TEST_F(RoutesTest, StatsShowOthersOnlyTheirOwnStreams) {
  const std::string mine = NewStream(Stranger());
  NewStream(Other());
  Answer a = Ask(Stranger(), http::verb::get, "/v1/stats");
  EXPECT_EQ(a.status, 200u);
  ASSERT_EQ(a.body["streams"].size(), 1u) << a.text;
  EXPECT_EQ(a.body["streams"][0]["id"], mine);
  EXPECT_EQ(a.body["streams"][0]["uid"], Stranger().uid);
  for (const char* key : {"reads", "hit_ratio", "prefetch", "cache", "files_open", "control"})
    EXPECT_TRUE(a.body["global"].contains(key)) << key;
  a = Ask(Root(), http::verb::get, "/v1/stats");
  EXPECT_EQ(a.body["streams"].size(), 2u);
}

TEST_F(RoutesTest, StatsCountRejectedPathsByReason) {
  const std::string id = NewStream(Stranger());
  Post(Stranger(), "/v1/streams/" + id + "/paths", {{"paths", {"/elsewhere/x", "data/a.jpg"}}});
  const Answer a = Ask(Root(), http::verb::get, "/v1/stats");
  EXPECT_EQ(a.body["global"]["control"]["rejected_paths"]["outside"], 1) << a.text;
}

TEST_F(RoutesTest, OpenFile) {
  Answer a = Post(Stranger(), "/v1/files/open", {{"path", "data/model.safetensors"}});
  EXPECT_EQ(a.status, 200u) << a.text;
  EXPECT_EQ(a.body["size"], 4096);
  ASSERT_GE(a.fd, 0);
  char c = 0;
  EXPECT_EQ(::pread(a.fd, &c, 1, 0), 1);
  EXPECT_EQ(c, 'm');

  // Only over the unix socket: a descriptor cannot go over TCP.
  a = Ask(Stranger(), http::verb::post, "/v1/files/open", R"({"path": "data/a.jpg"})",
          /*over_unix=*/false);
  EXPECT_ERROR(a, 400, "invalid_argument");
  EXPECT_NE(ErrorText(a).find("unix control socket"), std::string::npos);
  EXPECT_EQ(a.fd, -1);
  EXPECT_ERROR(Post(Stranger(), "/v1/files/open", {{"path", "data/nosuch"}}), 404, "not_found");
  a = Post(Stranger(), "/v1/files/open", {{"path", "data/secret.bin"}});
  EXPECT_ERROR(a, 403, "permission_denied");
  EXPECT_EQ(a.fd, -1);
  EXPECT_ERROR(Post(Stranger(), "/v1/files/open", {{"path", "data/to_secret"}}), 403,
               "permission_denied");
  EXPECT_ERROR(Post(Stranger(), "/v1/files/open", {{"path", "data/abs"}}), 403,
               "permission_denied");
  EXPECT_ERROR(Post(Stranger(), "/v1/files/open", {{"path", "data/cls"}}), 400, "is_directory");
  EXPECT_ERROR(Post(Stranger(), "/v1/files/open", {{"file", "data/a.jpg"}}), 400,
               "invalid_argument");
  // The group may read its file; root may read the secret.
  EXPECT_EQ(Post(GroupMember(), "/v1/files/open", {{"path", "data/group.bin"}}).status, 200u);
  EXPECT_EQ(Post(Root(), "/v1/files/open", {{"path", "data/secret.bin"}}).status, 200u);

  auto no_opener = world_.MakeServer(Options(), /*opener=*/false);
  a = Ask(Root(), http::verb::post, "/v1/files/open", R"({"path": "data/a.jpg"})", true,
          no_opener.get());
  EXPECT_ERROR(a, 501, "not_supported");
}

// POST /v1/files/batch: each file checked for the caller, the readable ones in one sealed,
// read-only memory file, in order; the others named with why.
TEST_F(RoutesTest, BatchFiles) {
  auto paths = [](std::initializer_list<const char*> names) {
    std::string body;
    for (const char* n : names) {
      body += n;
      body += '\0';
    }
    return body;
  };
  Answer a = Ask(Stranger(), http::verb::post, "/v1/files/batch",
                 paths({"data/a.jpg", "data/secret.bin", "data/nosuch", "data/cls",
                        "data/to_secret", "data/abs", "data/model.safetensors", "data/rel.jpg"}));
  ASSERT_EQ(a.status, 200u) << a.text;
  ASSERT_GE(a.fd, 0);
  const json& files = a.body["files"];
  ASSERT_EQ(files.size(), 8u) << a.text;
  EXPECT_EQ(files[0]["offset"], 0);
  EXPECT_EQ(files[0]["size"], 1000);
  // Why each is missing, in the one vocabulary of errors (docs/errors.md): code and errno.
  EXPECT_EQ(files[1].value("code", ""), "permission_denied") << a.text;  // 0600, another user's
  EXPECT_EQ(files[1].value("errno", 0), EACCES) << a.text;
  EXPECT_EQ(files[2].value("code", ""), "not_found") << a.text;
  EXPECT_EQ(files[2].value("errno", 0), ENOENT) << a.text;
  EXPECT_EQ(files[3].value("code", ""), "is_directory") << a.text;
  EXPECT_EQ(files[3].value("errno", 0), EISDIR) << a.text;
  EXPECT_EQ(files[4].value("code", ""), "permission_denied") << a.text;  // to the secret
  EXPECT_EQ(files[5].value("code", ""), "permission_denied") << a.text;  // out of the store
  EXPECT_EQ(files[6]["offset"], 1000);
  EXPECT_EQ(files[6]["size"], 4096);
  EXPECT_EQ(files[7]["offset"], 5096) << a.text;  // a.jpg: a symlink inside the store, resolved
  EXPECT_EQ(a.body["bytes"], 6096);
  std::string got(6096, '\0');
  ASSERT_EQ(::pread(a.fd, got.data(), got.size(), 0), 6096);
  EXPECT_EQ(got, std::string(1000, 'a') + std::string(4096, 'm') + std::string(1000, 'a'));
  // Read-only and sealed: nobody changes what another reader of it sees.
  EXPECT_EQ(::fcntl(a.fd, F_GETFL) & O_ACCMODE, O_RDONLY);
  const int seals = ::fcntl(a.fd, F_GET_SEALS);
  EXPECT_EQ(seals & (F_SEAL_WRITE | F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL),
            F_SEAL_WRITE | F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL);
  // Root may read the secret.
  a = Ask(Root(), http::verb::post, "/v1/files/batch", paths({"data/secret.bin"}));
  ASSERT_EQ(a.status, 200u);
  EXPECT_EQ(a.body["files"][0]["offset"], 0) << a.text;

  // Only over the unix socket; a body of NUL-terminated paths; at most 4,096 of them.
  a = Ask(Stranger(), http::verb::post, "/v1/files/batch", paths({"data/a.jpg"}),
          /*over_unix=*/false);
  EXPECT_ERROR(a, 400, "invalid_argument");
  EXPECT_EQ(a.fd, -1);
  EXPECT_ERROR(Ask(Stranger(), http::verb::post, "/v1/files/batch", "data/a.jpg"), 400,
               "invalid_argument");
  EXPECT_ERROR(Ask(Stranger(), http::verb::post, "/v1/files/batch", ""), 400, "invalid_argument");
  std::string many;
  for (int i = 0; i < 4097; ++i) many += std::string("data/a.jpg") + '\0';
  EXPECT_ERROR(Ask(Stranger(), http::verb::post, "/v1/files/batch", many), 400, "invalid_argument");

  // Past control.batch_max_bytes, files are left to the mount.
  ControlServer::Options small = Options();
  small.batch_max_bytes = 2000;
  auto bounded = world_.MakeServer(small);
  a = Ask(Stranger(), http::verb::post, "/v1/files/batch",
          paths({"data/a.jpg", "data/model.safetensors", "data/a.jpg"}), true, bounded.get());
  ASSERT_EQ(a.status, 200u) << a.text;
  EXPECT_EQ(a.body["files"][0]["offset"], 0);
  EXPECT_EQ(a.body["files"][1].value("code", ""), "invalid_argument") << a.text;
  EXPECT_NE(a.body["files"][1].value("error", "").find("control.batch_max_bytes"),
            std::string::npos)
      << a.text;
  EXPECT_EQ(a.body["files"][2]["offset"], 1000);  // the same file twice: given twice
  EXPECT_EQ(a.body["bytes"], 2000);

  // Many small files go into the memory file in order, past the pieces it is written in, each
  // as the mount's read path (here the world's reader) gave it.
  std::string body;
  for (int i = 0; i < 1100; ++i)
    body += (i % 2 ? std::string("data/a.jpg") : std::string("data/model.safetensors")) + '\0';
  a = Ask(Stranger(), http::verb::post, "/v1/files/batch", body);
  ASSERT_EQ(a.status, 200u) << a.text.substr(0, 300);
  EXPECT_EQ(a.body["bytes"], 550 * (1000 + 4096));
  std::string want;
  for (int i = 0; i < 550; ++i) want += std::string(4096, 'm') + std::string(1000, 'a');
  got.assign(want.size(), '\0');
  ASSERT_EQ(::pread(a.fd, got.data(), got.size(), 0), static_cast<ssize_t>(want.size()));
  EXPECT_TRUE(got == want);
  ::close(a.fd);

  a = Ask(Root(), http::verb::get, "/v1/stats");
  EXPECT_EQ(a.body["global"]["files_batch"]["batches"], 3) << a.text;
  EXPECT_EQ(a.body["global"]["files_batch"]["files"], 4 + 1100);
  EXPECT_EQ(
      a.body["global"]["files_batch"]["bytes"],
      6096 + testing::kSecret.size() + std::string(" in a 0600 file").size() + 550 * (1000 + 4096));
}

// The fourth security pass: memory files handed out were bounded per request only, and a
// mapping outlives the descriptor it was made from.
TEST_F(RoutesTest, BatchMemoryFilesAreChargedUntilTheirPagesAreGone) {
  const std::string body = std::string("data/a.jpg") + '\0' + "data/model.safetensors" + '\0';
  const uint64_t charge = BatchMemory::Charge(1000 + 4096);
  ControlServer::Options o = Options();
  o.batch_memory_bytes_per_uid = 3 * charge;
  auto server = world_.MakeServer(o);
  auto batch = [&](const Caller& who) {
    Answer a = Ask(who, http::verb::post, "/v1/files/batch", body, true, server.get());
    if (a.fd >= 0) fds_.erase(std::find(fds_.begin(), fds_.end(), a.fd));  // closed here
    return a;
  };
  std::vector<int> held;
  for (int i = 0; i < 3; ++i) {
    Answer a = batch(Stranger());
    ASSERT_EQ(a.status, 200u) << a.text;
    held.push_back(a.fd);
  }
  Answer a = batch(Stranger());
  EXPECT_ERROR(a, 429, "io_error");
  EXPECT_NE(ErrorText(a).find("control.batch_memory_bytes_per_uid"), std::string::npos) << a.text;
  EXPECT_EQ(a.fd, -1);
  // Another user has its own bound.
  a = batch(Other());
  ASSERT_EQ(a.status, 200u) << a.text;
  ::close(a.fd);
  // A descriptor closed gives its batch back; a mapping of it keeps it.
  ::close(held.back());
  held.pop_back();
  void* map = ::mmap(nullptr, 5096, PROT_READ, MAP_SHARED, held.back(), 0);
  ASSERT_NE(map, MAP_FAILED);
  ::close(held.back());
  held.pop_back();
  a = batch(Stranger());
  ASSERT_EQ(a.status, 200u) << a.text;
  held.push_back(a.fd);
  EXPECT_ERROR(batch(Stranger()), 429, "io_error");
  // So does a second open of it (through /proc), after the first is closed.
  const int again =
      ::open(("/proc/self/fd/" + std::to_string(held.back())).c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(again, 0);
  ::close(held.back());
  held.pop_back();
  EXPECT_ERROR(batch(Stranger()), 429, "io_error");
  ::close(again);
  a = batch(Stranger());
  ASSERT_EQ(a.status, 200u) << a.text;
  held.push_back(a.fd);
  EXPECT_ERROR(batch(Stranger()), 429, "io_error");
  ::munmap(map, 5096);
  a = batch(Stranger());
  ASSERT_EQ(a.status, 200u) << a.text;
  held.push_back(a.fd);
  for (int fd : held) ::close(fd);

  // Every batch, however small, is checked against the memory left: outstanding batches may
  // take half of what there would be without them.
  ControlServer::Options tight = Options();
  tight.available_memory = [] { return uint64_t{8} << 10; };
  auto short_of_memory = world_.MakeServer(tight);
  a = Ask(Stranger(), http::verb::post, "/v1/files/batch", body, true, short_of_memory.get());
  EXPECT_ERROR(a, 503, "io_error");
  EXPECT_NE(ErrorText(a).find("not enough free memory"), std::string::npos) << a.text;
  EXPECT_EQ(a.fd, -1);
  EXPECT_EQ(Ask(Root(), http::verb::get, "/v1/stats", "", true, short_of_memory.get())
                .body["global"]["files_batch"]["refused"],
            1);
}

TEST(BatchMemory, FollowsTheLastReferenceOfEachFile) {
  uint64_t avail = 64 << 20;
  BatchMemory::Options o;
  o.bytes_per_uid = 16 << 20;
  o.files_per_uid = 3;
  o.available = [&avail] { return avail; };
  o.fresh_above = 0;  // every batch reads the memory left afresh
  BatchMemory memory(o);
  // A memory file as the batch route makes one: a read-only reopen handed out, the original
  // closed.
  auto make = [&](uid_t uid, uint64_t bytes) {
    BatchMemory::Refusal why;
    EXPECT_FALSE(memory.Take(uid, bytes, &why)) << why.message;
    const int mfd = ::memfd_create("test", MFD_CLOEXEC);
    EXPECT_EQ(::ftruncate(mfd, static_cast<off_t>(bytes)), 0);
    const int ro = ::open(("/proc/self/fd/" + std::to_string(mfd)).c_str(), O_RDONLY | O_CLOEXEC);
    EXPECT_TRUE(memory.Follow(uid, bytes, ro).ok());
    ::close(mfd);
    return ro;
  };
  const int a = make(1, 4 << 20);
  const int b = make(1, 4 << 20);
  EXPECT_EQ(memory.bytes(1), 8u << 20);
  EXPECT_EQ(memory.files(), 2u);
  // Past the bytes of the user: refused, naming the key; another user is not.
  BatchMemory::Refusal why;
  EXPECT_TRUE(memory.Take(1, 9 << 20, &why));
  EXPECT_FALSE(why.memory);
  EXPECT_NE(why.message.find("control.batch_memory_bytes_per_uid"), std::string::npos);
  const int c = make(2, 1);
  EXPECT_EQ(memory.bytes(2), 4096u);  // a page at least
  // A dup and a child's copy are the same reference; the charge goes with the last of them.
  const int dup = ::dup(a);
  ::close(a);
  EXPECT_EQ(memory.bytes(1), 8u << 20);
  const pid_t child = ::fork();
  if (child == 0) {
    ::usleep(200'000);
    ::_exit(0);
  }
  ::close(dup);
  EXPECT_EQ(memory.bytes(1), 8u << 20);  // the child holds it
  int status = 0;
  ::waitpid(child, &status, 0);
  EXPECT_EQ(memory.bytes(1), 4u << 20);
  // Had the queue overflowed, the live watches tell what is gone.
  ::close(b);
  EXPECT_EQ(memory.ReconcileForTest(), 4u << 20);  // b's, and nothing live
  EXPECT_EQ(memory.bytes(1), 0u);
  // The number of files is bounded too.
  std::vector<int> many;
  for (int i = 0; i < 3; ++i) many.push_back(make(3, 1));
  EXPECT_TRUE(memory.Take(3, 1, &why));
  EXPECT_NE(why.message.find("too many batch memory files"), std::string::npos) << why.message;
  for (int fd : many) ::close(fd);
  // Outstanding batches together take at most half of the memory there would be without
  // them (what is left is read less what they hold).
  avail = 40 << 20;
  const int big = make(4, 16 << 20);
  avail -= 16 << 20;
  // 16 MiB + 8 MiB would pass half of the 24 MiB left + the 16 MiB held.
  EXPECT_TRUE(memory.Take(5, 8 << 20, &why));
  EXPECT_TRUE(why.memory);
  EXPECT_NE(why.message.find("not enough free memory"), std::string::npos) << why.message;
  EXPECT_FALSE(memory.Take(5, 2 << 20, &why)) << why.message;
  memory.Give(5, 2 << 20);
  ::close(big);
  ::close(c);
  EXPECT_EQ(memory.bytes(), 0u);
  EXPECT_EQ(memory.files(), 0u);
}

TEST_F(RoutesTest, Warmup) {
  Answer a = Post(Stranger(), "/v1/warmup", {{"paths", {"data/a.jpg", "data/secret.bin"}}});
  EXPECT_EQ(a.status, 200u) << a.text;
  EXPECT_EQ(a.body["fetched"], 1);
  EXPECT_EQ(a.body["failed"], 1);  // the secret: rejected, never read
  EXPECT_EQ(a.body["bytes"], 1000);
  EXPECT_EQ(a.body["errors"].size(), 1u);
  a = Post(Stranger(), "/v1/warmup", {{"paths", {"data/a.jpg"}}});
  EXPECT_EQ(a.body["skipped"], 1) << a.text;  // already in the NVMe tier
  EXPECT_ERROR(Post(Stranger(), "/v1/warmup", json::array()), 400, "invalid_argument");

  auto no_tier = world_.MakeServer(Options(), true, /*with_warmer=*/false);
  a = Ask(Root(), http::verb::post, "/v1/warmup", R"({"paths": ["data/a.jpg"]})", true,
          no_tier.get());
  EXPECT_ERROR(a, 422, "invalid_argument");
  EXPECT_NE(ErrorText(a).find("cache.disk_dir"), std::string::npos);
}

TEST_F(RoutesTest, Health) {
  EXPECT_ERROR(Ask(Root(), http::verb::get, "/v1/health"), 501, "not_supported");
  ControlServer::Options o = Options();
  bool healthy = true;
  std::vector<bool> details;
  o.health = [&](bool d) {
    details.push_back(d);
    return json{{"healthy", healthy}, {"error", d ? "the store's words" : ""}};
  };
  auto s = world_.MakeServer(o);
  Answer a = Ask(Root(), http::verb::get, "/v1/health", "", true, s.get());
  EXPECT_EQ(a.status, 200u);
  EXPECT_EQ(a.body["healthy"], true);
  healthy = false;
  a = Ask(Stranger(), http::verb::get, "/v1/health", "", true, s.get());
  EXPECT_EQ(a.status, 503u);
  // The details (texts that may name files) only for root and the daemon's own user.
  EXPECT_EQ(details, (std::vector<bool>{true, ::geteuid() == 4242u}));
}

TEST_F(RoutesTest, Upgrade) {
  EXPECT_ERROR(Ask(Root(), http::verb::post, "/v1/admin/upgrade"), 501, "not_supported");
  ControlServer::Options o = Options();
  Status outcome = Status::OK();
  int asked = 0;
  o.upgrade = [&] {
    ++asked;
    return outcome;
  };
  auto s = world_.MakeServer(o);
  Answer a = Ask(Stranger(), http::verb::post, "/v1/admin/upgrade", "", true, s.get());
  EXPECT_ERROR(a, 403, "permission_denied");
  EXPECT_EQ(asked, 0);
  a = Ask(Root(), http::verb::post, "/v1/admin/upgrade", "", true, s.get());
  EXPECT_EQ(a.status, 202u) << a.text;
  EXPECT_EQ(a.body["handing_over"], true);
  EXPECT_EQ(a.body["pid"], ::getpid());
  outcome = Status::FromErrno(EBUSY, "1 file open for writing");
  a = Ask(Root(), http::verb::post, "/v1/admin/upgrade", "", true, s.get());
  EXPECT_EQ(a.status, 409u);
  EXPECT_EQ(a.body["errno"], EBUSY) << a.text;
  EXPECT_EQ(asked, 2);
}

TEST_F(RoutesTest, LegacyPrefetchMakesOneStreamPerUser) {
  const std::string body = json::array({json::array({std::string(testing::kMount) + "/data/a.jpg"}),
                                        json::array({"data/cls/c.jpg", "/elsewhere/x"})})
                               .dump();
  Answer a = Ask(Stranger(), http::verb::post, "/prefetch/read/path", body);
  EXPECT_EQ(a.status, 200u);
  EXPECT_EQ(a.text, "prefetching.\n");
  EXPECT_EQ(Ask(Stranger(), http::verb::post, "/prefetch/read/path", body).status, 200u);
  // Past the per-user limit of queued paths: still "prefetching." (best effort).
  a = Ask(Stranger(), http::verb::post, "/prefetch/read/path",
          json::array({std::vector<std::string>(20, "data/a.jpg")}).dump());
  EXPECT_EQ(a.text, "prefetching.\n");
  a = Ask(Stranger(), http::verb::get, "/v1/stats");
  ASSERT_EQ(a.body["streams"].size(), 1u) << a.text;
  EXPECT_EQ(a.body["streams"][0]["name"], "cube_torch legacy");
  EXPECT_ERROR(Ask(Stranger(), http::verb::post, "/prefetch/read/path", "{}"), 400,
               "invalid_argument");
  EXPECT_ERROR(Ask(Stranger(), http::verb::post, "/prefetch/read/path", "[[1]]"), 400,
               "invalid_argument");
}

TEST_F(RoutesTest, RegisterPidsOnlyChecksTheBody) {
  for (const char* route : {"/register/pid", "/unregister/pid"}) {
    const Answer a = Ask(Stranger(), http::verb::post, route, "[1, 2, 3]");
    EXPECT_EQ(a.status, 200u) << route;
    EXPECT_EQ(a.text, "ok\n");
    EXPECT_ERROR(Ask(Stranger(), http::verb::post, route, R"(["x"])"), 400, "invalid_argument");
    EXPECT_ERROR(Ask(Stranger(), http::verb::post, route, "{}"), 400, "invalid_argument");
  }
  // Nothing was made of them.
  EXPECT_TRUE(Ask(Root(), http::verb::get, "/v1/stats").body["streams"].empty());
}

// /batchdownload/path streams its reply on the connection: read it from the other end.
TEST_F(RoutesTest, BatchDownloadStreamsFramedFilesAndNothingPrivate) {
  auto ask = [this](const Caller& who, const std::string& body, std::string* wire) {
    int sv[2];
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    std::thread reader([fd = sv[1], wire] {
      char buf[65536];
      for (ssize_t n; (n = ::read(fd, buf, sizeof(buf))) > 0;) wire->append(buf, n);
    });
    Request req{http::verb::post, "/batchdownload/path", 10};  // HTTP/1.0: not chunked
    req.set(http::field::host, "localhost");
    req.body() = body;
    req.prepare_payload();
    Reply r = server_->Handle(req, who, true, sv[0]);
    ::shutdown(sv[0], SHUT_WR);
    reader.join();
    ::close(sv[0]);
    ::close(sv[1]);
    return r;
  };
  std::string wire;
  Reply r = ask(Stranger(), R"([["data/a.jpg", "data/secret.bin", "data/nosuch"]])", &wire);
  EXPECT_TRUE(r.sent);
  ASSERT_EQ(wire.rfind("HTTP/1.0 200 OK\r\n", 0), 0u) << wire.substr(0, 100);
  const std::string body = wire.substr(wire.find("\r\n\r\n") + 4);
  auto u64 = [&body](size_t at) {
    uint64_t v = 0;
    for (size_t i = 0; i < 8; ++i) v = (v << 8) | static_cast<unsigned char>(body[at + i]);
    return v;
  };
  size_t at = 0;
  EXPECT_EQ(u64(at), 0u);  // version
  EXPECT_EQ(u64(at + 8), 3u);
  at += 16;
  const uint64_t want[] = {1000, 0, 0};  // the secret and the missing file: sent empty
  for (uint64_t len : want) {
    const uint64_t path_len = u64(at);
    at += 8 + path_len;
    EXPECT_EQ(u64(at), len);
    at += 8 + u64(at);
  }
  EXPECT_EQ(at, body.size());
  EXPECT_EQ(wire.find(testing::kSecret), std::string::npos);

  // The files that cannot be sent come after all the others (the original client stops at
  // the first empty one), and the readable ones were published to the user's batch stream,
  // whose workers fetch them side by side while they are sent in order.
  wire.clear();
  r = ask(Stranger(), R"([["data/nosuch", "data/a.jpg", "data/secret.bin", "data/rel.jpg"]])",
          &wire);
  EXPECT_TRUE(r.sent);
  const std::string second = wire.substr(wire.find("\r\n\r\n") + 4);
  std::vector<std::pair<std::string, uint64_t>> entries;
  auto get64 = [&second](size_t from) {
    uint64_t v = 0;
    for (size_t i = 0; i < 8; ++i) v = (v << 8) | static_cast<unsigned char>(second[from + i]);
    return v;
  };
  EXPECT_EQ(get64(8), 4u);
  for (at = 16; at < second.size();) {
    const uint64_t path_len = get64(at);
    const std::string name = second.substr(at + 8, path_len);
    at += 8 + path_len;
    entries.emplace_back(name, get64(at));
    at += 8 + get64(at);
  }
  const std::vector<std::pair<std::string, uint64_t>> in_order = {
      {"data/a.jpg", 1000}, {"data/rel.jpg", 1000}, {"data/nosuch", 0}, {"data/secret.bin", 0}};
  EXPECT_EQ(entries, in_order);
  const json streams = Ask(Root(), http::verb::get, "/v1/stats").body["streams"];
  bool published = false;
  for (const json& st : streams)
    if (st.value("name", "") == "cube_torch legacy batch") published = true;
  EXPECT_TRUE(published) << streams.dump();

  // A malformed body gets an ordinary error reply, not a streamed one.
  wire.clear();
  r = ask(Stranger(), R"(["data/a.jpg"])", &wire);
  EXPECT_FALSE(r.sent);
  EXPECT_EQ(r.res.result_int(), 400u);
  EXPECT_TRUE(wire.empty());
}

}  // namespace
}  // namespace cubetorchfs::control
