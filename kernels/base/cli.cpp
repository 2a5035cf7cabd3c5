#include "kernels/base/cli.h"

#include <unistd.h>

#include <charconv>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <typeinfo>

#include <fmt/format.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "kernels/base/error.h"

namespace retain::cli {

int run_tool(const char* tool, const std::function<int()>& body) {
  try {
    return body();
  } catch (const UsageError& e) {
    std::cerr << tool << ": error: " << e.what() << " (see --help)\n";
    return 2;
  } catch (const po::error& e) {
    std::cerr << tool << ": error: " << e.what() << " (see --help)\n";
    return 2;
  } catch (const std::bad_alloc&) {
    std::cerr << tool << ": error: out of memory\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << tool << ": error: " << e.what() << "\n";
    return 1;
  }
}

void setup_logging() {
  const bool under_mpi = std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMIX_RANK") || std::getenv("PMI_RANK");
  const auto mode = under_mpi || !isatty(STDOUT_FILENO) ? spdlog::color_mode::never : spdlog::color_mode::automatic;
  auto logger = std::make_shared<spdlog::logger>("retain", std::make_shared<spdlog::sinks::stdout_color_sink_mt>(mode));
  logger->set_pattern("[%Y-%m-%d %H:%M:%S] %^[%l]%$ %v");
  spdlog::set_default_logger(logger);
}

bool parse(int argc, char** argv, const std::string& usage, po::options_description& opts,
           po::variables_map& vm) {
  opts.add_options()("help,h", "print this help and exit");
  po::store(po::command_line_parser(argc, argv).options(opts).run(), vm);
  if (vm.count("help")) {
    std::cout << usage << "\n\n" << opts << "\n";
    return false;
  }
  po::notify(vm);  // reports missing required options as po::error
  check_finite_numbers(vm);
  return true;
}

void check_output(const char* flag, const std::string& path, const std::vector<std::string>& inputs) {
  namespace fs = std::filesystem;
  const fs::path target = fs::absolute(path).lexically_normal();
  const fs::path parent = target.parent_path();
  if (!fs::is_directory(parent)) fail("{} {}: the folder {} does not exist", flag, path, parent.string());
  if (::access(parent.c_str(), W_OK) != 0) fail("{} {}: the folder {} is not writable", flag, path, parent.string());
  std::error_code ec;
  for (const std::string& in : inputs) {
    if (in.empty() || !fs::exists(in, ec)) continue;
    if (fs::exists(target, ec) && fs::equivalent(target, in, ec))
      fail("{} {}: is also an input ({}); writing it would destroy it", flag, path, in);
    if (fs::is_directory(in, ec) && fs::equivalent(parent, in, ec) && fs::exists(target, ec))
      fail("{} {}: would replace a file inside the input folder {}; write it elsewhere", flag, path, in);
  }
}

void check_finite_numbers(const po::variables_map& vm) {
  for (const auto& [name, value] : vm) {
    double x = 0;
    if (value.value().type() == typeid(double))
      x = value.as<double>();
    else if (value.value().type() == typeid(float))
      x = value.as<float>();
    else
      continue;
    if (!std::isfinite(x)) throw UsageError(fmt::format("--{} must be a finite number, got {}", name, x));
  }
}

std::vector<int64_t> parse_int_list(const std::string& text, const char* option) {
  std::vector<int64_t> out;
  size_t i = 0;
  auto separator = [](char c) { return c == ' ' || c == ',' || c == '\t' || c == '\n'; };
  while (i < text.size()) {
    if (separator(text[i])) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < text.size() && !separator(text[j])) ++j;
    int64_t v = 0;
    auto [end, ec] = std::from_chars(text.data() + i, text.data() + j, v);
    if (ec != std::errc() || end != text.data() + j)
      throw UsageError(fmt::format("{}: '{}' is not an integer", option, text.substr(i, j - i)));
    out.push_back(v);
    i = j;
  }
  return out;
}

}  // namespace retain::cli
