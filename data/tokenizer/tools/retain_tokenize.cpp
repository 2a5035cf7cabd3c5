// retain-tokenize: token ids of a text with a Hugging Face tokenizer.json, or the reverse.
#include <chrono>
#include <iostream>
#include <iterator>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "data/tokenizer/tokenizer.h"
#include "data/tokenizer/utf8.h"
#include "kernels/base/cli.h"
#include "kernels/base/error.h"

using namespace retain;

namespace {

constexpr const char* kUsage =
    "Usage: retain-tokenize --tokenizer PATH [--text TEXT | --decode \"IDS\" | --jsonl] [--stats]\n\n"
    "Prints the token ids (space-separated, one line) of TEXT, or of standard input when\n"
    "neither --text nor --decode is given. PATH is a tokenizer.json or a directory holding one.\n"
    "--decode prints the text of the ids instead. --jsonl reads lines {\"text_b64\": ...}\n"
    "(base64 of the UTF-8 bytes) from standard input and prints one id line per input line.\n"
    "--stats reports on stderr the encode time and throughput (tokens/s, one thread).";

std::string base64_decode(const std::string& in, size_t line) {
  static const auto table = [] {
    std::array<int, 256> t{};
    t.fill(-1);
    const char* a = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    for (int i = 0; i < 64; ++i) t[static_cast<unsigned char>(a[i])] = i;
    return t;
  }();
  std::string out;
  uint32_t acc = 0;
  int bits = 0;
  for (const char c : in) {
    if (c == '=') break;
    const int v = table[static_cast<unsigned char>(c)];
    if (v < 0) fail("stdin line {}: text_b64 is not base64", line);
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out += static_cast<char>((acc >> bits) & 0xFF);
    }
  }
  return out;
}

std::string join(const std::vector<int32_t>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) s += ' ';
    s += std::to_string(ids[i]);
  }
  return s;
}

int run(int argc, char** argv) {
  cli::po::options_description opts("Options");
  std::string path, text, decode;
  opts.add_options()
      ("tokenizer", cli::po::value(&path)->required(), "tokenizer.json, or a directory holding one")
      ("text", cli::po::value(&text), "text to encode (default: standard input)")
      ("decode", cli::po::value(&decode), "token ids to decode, separated by spaces or commas")
      ("jsonl", "read {\"text_b64\": ...} lines from stdin, print one id line each")
      ("lossy", "read invalid UTF-8 in --text or stdin as U+FFFD (default: an error)")
      ("stats", "print encode time and tokens/s on stderr");
  cli::po::variables_map vm;
  if (!cli::parse(argc, argv, kUsage, opts, vm)) return 0;
  const int modes = int(vm.count("text")) + int(vm.count("decode")) + int(vm.count("jsonl"));
  if (modes > 1) throw cli::UsageError("give at most one of --text, --decode, --jsonl");

  const auto t_load = std::chrono::steady_clock::now();
  const data::Tokenizer tok = data::Tokenizer::load(path);
  const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_load).count();

  if (vm.count("decode")) {
    std::vector<int32_t> ids;
    for (const int64_t v : cli::parse_int_list(decode, "--decode")) {
      if (v < 0 || v > INT32_MAX) throw cli::UsageError(fmt::format("--decode: {} is not a token id", v));
      ids.push_back(static_cast<int32_t>(v));
    }
    std::cout << tok.decode(ids) << "\n";  // a line, like every other output of the tool
    return 0;
  }

  std::vector<std::string> inputs;
  if (vm.count("text")) {
    inputs.push_back(text);
  } else if (vm.count("jsonl")) {
    std::string line;
    for (size_t n = 1; std::getline(std::cin, line); ++n) {
      if (line.empty()) continue;
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(line);
      } catch (const nlohmann::json::exception& e) {
        fail("stdin line {}: invalid JSON: {}", n, e.what());
      }
      if (!j.is_object() || !j.contains("text_b64") || !j.at("text_b64").is_string())
        fail("stdin line {}: expected {{\"text_b64\": \"...\"}}", n);
      inputs.push_back(base64_decode(j.at("text_b64").get<std::string>(), n));
    }
  } else {
    inputs.emplace_back(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
  }
  // Text given directly must be UTF-8 (the jsonl mode carries raw bytes on purpose: there each
  // maximal invalid subsequence becomes one U+FFFD, as in Hugging Face's tokenizers).
  if (!vm.count("jsonl") && !vm.count("lossy")) {
    const std::string& in = inputs.front();
    for (size_t i = 0; i < in.size();) {
      const size_t n = data::utf8::valid_sequence_length(in, i);
      if (n == 0)
        fail("{}: invalid UTF-8 at byte {} (0x{:02x}); pass --lossy to read each invalid sequence as U+FFFD",
             vm.count("text") ? "--text" : "stdin", i, static_cast<unsigned char>(in[i]));
      i += n;
    }
  }

  std::vector<std::vector<int32_t>> outputs(inputs.size());
  const auto t0 = std::chrono::steady_clock::now();
  size_t tokens = 0, bytes = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    outputs[i] = tok.encode(inputs[i]);
    tokens += outputs[i].size();
    bytes += inputs[i].size();
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::string out;
  for (const auto& ids : outputs) out += join(ids) + '\n';
  std::cout << out;
  if (vm.count("stats"))
    std::cerr << fmt::format("load {:.3f} s; encoded {} bytes into {} tokens in {:.3f} s: {:.0f} tokens/s, {:.1f} MB/s\n",
                             load_s, bytes, tokens, s, tokens / s, bytes / s / 1e6);
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return cli::run_tool("retain-tokenize", [&] { return run(argc, argv); }); }
