#include "data/formats/hf_config.h"

#include <cmath>

#include "kernels/base/atomic_file.h"
#include "kernels/base/error.h"

namespace retain::formats {

// Not an out-of-range conversion: every rejected value is an error naming the key.
int64_t json_integer(const nlohmann::json& v, const std::string& key, const std::string& source) {
  if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))
    fail("{}: '{}' is too large, got {}", source, key, v.dump());
  if (v.is_number_integer()) return v.get<int64_t>();
  if (v.is_number_float()) {
    const double d = v.get<double>();
    // [−2^63, 2^63): both bounds are exact doubles, and every integral double inside converts.
    if (d >= -9223372036854775808.0 && d < 9223372036854775808.0 && std::trunc(d) == d) return static_cast<int64_t>(d);
  }
  fail("{}: '{}' must be an integer, got {}", source, key, v.dump());
}

std::optional<int64_t> token_id_field(const nlohmann::json& config, const std::string& key, const std::string& source) {
  if (!config.is_object() || !config.contains(key) || config.at(key).is_null()) return std::nullopt;
  const nlohmann::json& v = config.at(key);
  if (v.is_array()) {
    if (v.empty()) return std::nullopt;
    return json_integer(v.at(0), key, source);
  }
  return json_integer(v, key, source);
}

std::optional<int64_t> read_config_token_id(const std::string& path, const std::string& key) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_file(path));
  } catch (const nlohmann::json::exception& e) {
    fail("{}: not valid JSON ({})", path, e.what());
  }
  if (!j.is_object()) fail("{}: not a JSON object", path);
  return token_id_field(j, key, path);
}

}  // namespace retain::formats
