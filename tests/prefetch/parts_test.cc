// The prefetcher's parts on their own: the queue bounds, the window's accounting and shares,
// and a stream's positions.
#include <gtest/gtest.h>

#include "prefetch/queued_paths.h"
#include "prefetch/stream.h"
#include "prefetch/window.h"

namespace cubetorchfs::prefetch {
namespace {

TEST(QueuedPathsTest, EachLimitIsNamedWithWhatWasHeldAndAsked) {
  QueuedPaths q({/*paths_per_uid=*/10, /*bytes_per_uid=*/1000, /*paths=*/30, /*bytes=*/6000});
  EXPECT_FALSE(q.Check(1, 10, 1000).has_value());
  std::optional<QueuedPaths::Refusal> r = q.Check(1, 11, 100);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->limit, QueuedPaths::Limit::kUserPaths);
  EXPECT_EQ(r->asked, 11u);
  r = q.Check(1, 1, 1001);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->limit, QueuedPaths::Limit::kUserBytes);
  EXPECT_EQ(r->asked, 1001u);
  // With two users queuing, one may hold a third of the pool: 10 paths, 2000 bytes.
  q.Add(1, 9, 900);
  q.Add(2, 5, 500);
  EXPECT_EQ(q.users(), 2u);
  EXPECT_EQ(q.paths(), 14u);
  EXPECT_EQ(q.bytes(), 1400u);
  r = q.Check(2, 6, 10);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->limit, QueuedPaths::Limit::kUserPaths);
  // A third user, with nothing queued yet, is counted as a user for the shares: 30 / 4 = 7.
  r = q.Check(3, 8, 10);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->limit, QueuedPaths::Limit::kSharePaths);
  EXPECT_EQ(r->value, 7u);
  EXPECT_EQ(r->users, 3u);
  // Removing the last position of a user forgets it.
  q.Remove(2, 5, 500);
  EXPECT_EQ(q.users(), 1u);
  EXPECT_EQ(q.paths(), 9u);
  EXPECT_EQ(q.bytes(), 900u);
}

TEST(WindowTest, ChargesFollowEntriesAndTheFurthestOverItsShareIsFound) {
  Window w(/*max_files=*/4, /*budget_bytes=*/1000);
  EXPECT_FALSE(w.Full());
  Window::Entry& a = w.Add("a", 1);
  w.Charge(a, 600);
  Window::Entry& b = w.Add("b", 2);
  w.Charge(b, 100);
  EXPECT_EQ(w.bytes(), 700u);
  EXPECT_TRUE(w.Fits(300));
  EXPECT_FALSE(w.Fits(301));
  // Shares of 2 files and 500 bytes: user 1 holds more bytes than its share.
  EXPECT_TRUE(w.AtShare(1, 2, 500));
  EXPECT_FALSE(w.AtShare(2, 2, 500));
  EXPECT_FALSE(w.AtShare(3, 2, 500));
  EXPECT_EQ(w.FurthestOver(2, 500), std::optional<uid_t>(1));
  EXPECT_EQ(w.FurthestOver(2, 1000), std::nullopt);
  w.Charge(w.Add("c", 2), 300);
  EXPECT_TRUE(w.Full());  // the budget is held
  w.Erase(w.find("a"));
  EXPECT_EQ(w.bytes(), 400u);
  EXPECT_EQ(w.size(), 2u);
  EXPECT_FALSE(w.AtShare(1, 1, 1));  // nothing left of user 1
  w.Erase(w.find("b"));
  w.Erase(w.find("c"));
  EXPECT_EQ(w.bytes(), 0u);
  EXPECT_FALSE(w.AtShare(2, 1, 1));
}

TEST(StreamTest, PendingPositionsAreFoundByHashAndConfirmedByPath) {
  Stream s;
  s.Append("d/a", 7);
  s.Append("d/b", 7);  // the same hash: a collision, told apart by the path
  s.Append("d/a", 7);
  EXPECT_EQ(s.end(), 3u);
  EXPECT_EQ(s.FirstPending(7, "d/a"), std::optional<uint64_t>(0));
  EXPECT_EQ(s.FirstPending(7, "d/b"), std::optional<uint64_t>(1));
  EXPECT_EQ(s.FirstPending(8, "d/a"), std::nullopt);
  s.state(0) = kRead;
  s.Unpend(7, 0);
  EXPECT_EQ(s.FirstPending(7, "d/a"), std::optional<uint64_t>(2));
  s.queued_bytes = 3 * QueuedPaths::Cost(3);
  s.low = 1;
  const auto [popped, bytes] = s.PopConsumed();
  EXPECT_EQ(popped, 1u);
  EXPECT_EQ(bytes, QueuedPaths::Cost(3));
  EXPECT_EQ(s.base, 1u);
  EXPECT_EQ(s.path(1), "d/b");
  EXPECT_EQ(s.queued_bytes, 2 * QueuedPaths::Cost(3));
}

}  // namespace
}  // namespace cubetorchfs::prefetch
