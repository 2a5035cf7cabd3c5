#include "trainer/config_file.h"

#include <set>

#include <fmt/format.h>
#include <toml++/toml.h>

#include "kernels/base/error.h"

namespace retain::trainer {

namespace {

std::string option_name(std::string key) {
  for (char& c : key)
    if (c == '_') c = '-';
  return key;
}

// Options a file may not set: what only makes sense for one invocation.
const std::set<std::string> kCommandLineOnly = {"config", "help", "dump-grads", "stray"};

void collect(const toml::table& table, const std::string& path, const boost::program_options::options_description& opts,
             std::set<std::string>& seen, std::vector<std::string>& out) {
  for (auto&& [k, node] : table) {
    const std::string key(k.str());
    const auto line = node.source().begin.line;
    if (const toml::table* sub = node.as_table()) {  // a group: its keys count as top-level ones
      collect(*sub, path, opts, seen, out);
      continue;
    }
    const std::string name = option_name(key);
    const auto* option = opts.find_nothrow(name, false);
    if (!option || kCommandLineOnly.count(name))
      fail("{}:{}: '{}' is not a retain-train option{}", path, line, key,
           kCommandLineOnly.count(name) ? " a file can set" : " (see retain-train --help)");
    if (!seen.insert(name).second) fail("{}:{}: '{}' is set twice", path, line, key);
    const bool is_switch = option->semantic()->max_tokens() == 0;
    if (is_switch) {
      if (!node.is_boolean()) fail("{}:{}: '{}' takes true or false", path, line, key);
      if (node.value<bool>().value_or(false)) out.push_back("--" + name);
    } else if (node.is_string()) {
      out.push_back("--" + name + "=" + *node.value<std::string>());
    } else if (node.is_integer()) {
      out.push_back(fmt::format("--{}={}", name, *node.value<int64_t>()));
    } else if (node.is_floating_point()) {
      out.push_back(fmt::format("--{}={}", name, *node.value<double>()));  // shortest exact form
    } else {
      fail("{}:{}: '{}' must be a string or a number", path, line, key);
    }
  }
}

}  // namespace

std::vector<std::string> config_file_arguments(const std::string& path,
                                               const boost::program_options::options_description& options) {
  toml::table table;
  try {
    table = toml::parse_file(path);
  } catch (const toml::parse_error& e) {
    fail("{}:{}:{}: {}", path, e.source().begin.line, e.source().begin.column, std::string(e.description()));
  }
  std::set<std::string> seen;
  std::vector<std::string> out;
  collect(table, path, options, seen, out);
  return out;
}

std::string config_toml(const nlohmann::json& run_config) {
  // Flat `key = value` lines: strings as JSON strings (valid TOML basic strings), numbers in
  // their shortest exact form (2e-4, not toml++'s 17 digits).
  std::string out = "# retain-train options of this run; reuse with: retain-train --config config.toml --out NEW_RUN\n";
  for (const auto& [key, value] : run_config.items()) {
    // The capacity is an option of gate runs (--capacity); a kvpop run has none.
    if (key == "capacity" && run_config.value("gate", "") == "kvpop") continue;
    if (key == "margin_weight") {     // kvpop runs: the option is the negative switch
      if (!value.get<bool>()) out += "no_margin_weight = true\n";
      continue;
    }
    std::string text;
    if (value.is_string()) {
      if (value.get<std::string>().empty()) continue;
      text = value.dump();
    } else if (value.is_boolean()) {
      text = value.get<bool>() ? "true" : "false";
    } else if (value.is_number_integer() || value.is_number_unsigned()) {
      text = value.dump();
    } else if (value.is_number_float()) {
      text = fmt::format("{}", value.get<double>());
      if (text.find_first_of(".eEni") == std::string::npos) text += ".0";  // stays a TOML float
    } else {
      continue;
    }
    out += key + " = " + text + "\n";
  }
  return out;
}

}  // namespace retain::trainer
