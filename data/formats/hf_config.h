// Fields of a Hugging Face config.json that layers below the model read (retain-pack's document
// separator): the token-id rule transformers applies, shared with model/config.h's reader.
#pragma once
#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

namespace retain::formats {

// A JSON integer, or a float with an integral value (8.0), in int64 range; anything else (a
// string, 1e30, 2^64 − 1, a fraction) is a retain::Error "<source>: '<key>' must be an integer, got …".
int64_t json_integer(const nlohmann::json& v, const std::string& key, const std::string& source);

// The token id under `key` (eos_token_id, bos_token_id): an integer, an integral float (8.0), or
// a list whose first entry is one (transformers allows a list of eos ids; the first is the
// document separator); nullopt when absent, null or an empty list. Anything else — a string,
// 1e30, a fraction — is a retain::Error "<source>: '<key>' must be an integer, got …".
std::optional<int64_t> token_id_field(const nlohmann::json& config, const std::string& key, const std::string& source);

// token_id_field of the config.json at `path`; a missing or unreadable file, or one that is not
// a JSON object, is a retain::Error naming it.
std::optional<int64_t> read_config_token_id(const std::string& path, const std::string& key);

}  // namespace retain::formats
