// `cubetorchfs warmup`: fills the NVMe tier ahead of training. See warmup.cc.
#pragma once

#include <string>
#include <vector>

namespace cubetorchfs::daemon {

// Runs the subcommand with the arguments after "warmup"; returns the exit status.
int RunWarmup(const std::vector<std::string>& args);

}  // namespace cubetorchfs::daemon
