#include "daemon/health.h"

#include <gtest/gtest.h>

#include <chrono>

#include "common/clock.h"
#include "common/logging.h"
#include "tests/test_util.h"

namespace cubetorchfs::daemon {
namespace {

Health::Options Opts(double every_s = 2, double wait_s = 3) {
  Health::Options o;
  o.store = "mem://test";
  o.generation = 2;
  o.probe_every_s = every_s;
  o.probe_wait_s = wait_s;
  return o;
}

TEST(HealthTest, ReachableStoreIsHealthyAndProbedAtMostOncePerInterval) {
  testing::MemBackend store;
  Health h(Opts(), &store, [] { return nlohmann::json{{"hit_ratio", 0.5}}; });
  nlohmann::json r = h.Report(true);
  EXPECT_TRUE(r["healthy"].get<bool>()) << r.dump();
  EXPECT_TRUE(r["store"]["reachable"].get<bool>());
  EXPECT_EQ(r["store"]["name"], "mem://test");
  EXPECT_EQ(r["generation"], 2);
  EXPECT_EQ(r["hit_ratio"], 0.5);
  EXPECT_TRUE(r.contains("last_error") && r.contains("uptime_s") && r.contains("version"));
  h.Report(true);
  EXPECT_EQ(store.stats(), 1);  // the second report reused the probe
}

TEST(HealthTest, FailingStoreIsUnhealthyWithItsError) {
  conf::InjectOptions inject;
  inject.enabled = true;
  inject.error_rate = 1.0;
  auto store =
      cfs_client::NewInjectBackend(std::make_unique<testing::MemBackend>(), inject, SystemClock());
  Health h(Opts(), store.get(), nullptr);
  nlohmann::json r = h.Report(true);
  EXPECT_FALSE(r["healthy"].get<bool>());
  EXPECT_FALSE(r["store"]["reachable"].get<bool>());
  EXPECT_FALSE(r["store"]["error"].get<std::string>().empty());
}

TEST(HealthTest, WithoutDetailsNoErrorTextIsShown) {
  conf::InjectOptions inject;
  inject.enabled = true;
  inject.error_rate = 1.0;
  auto store =
      cfs_client::NewInjectBackend(std::make_unique<testing::MemBackend>(), inject, SystemClock());
  CTFS_LOG(kWarn) << "a problem naming /home/alice/secret";
  Health h(Opts(), store.get(), nullptr);
  const std::string brief = h.Report(false).dump();
  EXPECT_EQ(brief.find("alice"), std::string::npos) << brief;
  EXPECT_EQ(brief.find("inject"), std::string::npos) << brief;
  EXPECT_NE(h.Report(true).dump().find("alice"), std::string::npos);
}

TEST(HealthTest, HungStoreIsUnhealthyWithinTheProbeWait) {
  conf::InjectOptions inject;
  inject.enabled = true;
  inject.latency_us = 2'000'000;
  auto store =
      cfs_client::NewInjectBackend(std::make_unique<testing::MemBackend>(), inject, SystemClock());
  Health h(Opts(2, 0.2), store.get(), nullptr);
  const auto start = std::chrono::steady_clock::now();
  nlohmann::json r = h.Report(true);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(1));
  EXPECT_FALSE(r["healthy"].get<bool>());
  EXPECT_NE(r["store"]["error"].get<std::string>().find("no answer"), std::string::npos);
}

}  // namespace
}  // namespace cubetorchfs::daemon
