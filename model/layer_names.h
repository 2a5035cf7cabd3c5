// Per-layer tensor names: "<prefix><layer><middle><rest>", as in
// "model.layers.3.self_attn.retention_gate.linear1.weight" or "blk.3.kvpop.q_proj.weight".
// One splitter for the gate files, the KVPOP scorer files and the GGUF name mappings.
#pragma once
#include <optional>
#include <string_view>
#include <utility>

namespace retain {

// (layer, rest) when `name` is prefix + a non-empty segment without '.' + middle + rest;
// nullopt otherwise. The layer segment is returned as written (callers decide what a valid
// layer index is); the views point into `name`.
inline std::optional<std::pair<std::string_view, std::string_view>> split_layer_name(std::string_view name,
                                                                                   std::string_view prefix,
                                                                                   std::string_view middle) {
  if (!name.starts_with(prefix)) return std::nullopt;
  const size_t begin = prefix.size(), dot = name.find('.', begin);
  if (dot == std::string_view::npos || dot == begin || name.substr(dot, middle.size()) != middle) return std::nullopt;
  return std::make_pair(name.substr(begin, dot - begin), name.substr(dot + middle.size()));
}

// True when `s` is one or more decimal digits.
inline bool all_digits(std::string_view s) {
  if (s.empty()) return false;
  for (char c : s)
    if (c < '0' || c > '9') return false;
  return true;
}

}  // namespace retain
