// What every retain tool shares: --help from Boost.Program_options, and one line on
// stderr ("retain-forward: error: ...") with a non-zero exit for any bad input.
#pragma once
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include <boost/program_options.hpp>

namespace retain::cli {

namespace po = boost::program_options;

// Runs body() and turns every exception into "<tool>: error: <message>" + exit code 1
// (2 for command-line usage errors). Returns the process exit code.
int run_tool(const char* tool, const std::function<int()>& body);

// Parses argv (adding --help); prints usage and the options and returns false when
// --help was given. Missing ->required() options throw po::error (a usage error).
bool parse(int argc, char** argv, const std::string& usage, po::options_description& opts,
           po::variables_map& vm);

// spdlog's default logger for a tool: "[YYYY-MM-DD HH:MM:SS] [level] message" on stdout, the
// level coloured only on a terminal of the user's own — never under mpirun, whose ranks write
// to pseudo-terminals that usually end in a log file.
void setup_logging();

// An output path, checked before any work: its folder must exist and be writable (no tool
// creates parents), and it must neither be one of `inputs` (the files and folders the tool
// reads) nor replace a file inside an input folder — `retain-forward --out M/model.safetensors`
// would overwrite the weights it reads with logits. A retain::Error "FLAG PATH: ..." otherwise.
void check_output(const char* flag, const std::string& path, const std::vector<std::string>& inputs = {});

// Every floating-point option in vm must be finite: "--lr inf" or "--bias-init nan" (which
// Boost parses as numbers) is a UsageError naming the option. parse() calls it; tools that
// store their own options (a config file, positionals) call it after po::notify.
void check_finite_numbers(const po::variables_map& vm);

// Thrown for command-line misuse; run_tool maps it to exit code 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The integer lists tools take on the command line ("5 10 7" or "5,10,7"; spaces, commas, tabs
// and newlines separate); a malformed entry is a UsageError naming `option` and the entry.
std::vector<int64_t> parse_int_list(const std::string& text, const char* option);

}  // namespace retain::cli
