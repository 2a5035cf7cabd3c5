// What the trainer's loop, the flat optimizer view (trainer/flat_params.h) and the checkpoints
// need from a set of trainable tensors, whatever they parameterize: retention gates
// (model/gates/gates.h) or KVPOP scorers (model/kvpop/scorers.h). One loop trains both.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "kernels/tensor.h"

namespace retain {

// One trainable tensor. A tensor shared by several layers (dbtrimkv's linear3.weight and bias)
// is ONE parameter listed once, with every layer's name in `file_names`; its gradient is the
// sum of every layer's contribution.
struct Parameter {
  std::vector<std::string> file_names;  // names it is stored under; [0] is layer 0's (or its layer's)
  Tensor value;                         // F32, CPU
  Tensor grad;                          // F32, same shape, accumulated by the backward, cleared by zero_grad()
  const std::string& name() const { return file_names.front(); }
  bool shared() const { return file_names.size() > 1; }
};

class ParameterSet {
 public:
  virtual ~ParameterSet() = default;
  // Every parameter once, in file order: the flat optimizer vector follows this order.
  virtual std::vector<Parameter>& parameters() = 0;
  virtual const std::vector<Parameter>& parameters() const = 0;
  // Every tensor under its file name(s), in file order (a shared tensor under every layer's
  // name, sharing one value): what save() writes and what the exporters write.
  virtual std::vector<std::pair<std::string, Tensor>> named_tensors() const = 0;
  // Writes the set as a safetensors file atomically, its own __metadata__ overridden by `extra`.
  virtual void save(const std::string& path, const std::map<std::string, std::string>& extra = {}) const = 0;

  void zero_grad();
  int64_t num_parameters() const;  // scalars, shared ones counted once

 protected:
  ParameterSet() = default;
  ParameterSet(const ParameterSet&) = default;
  ParameterSet(ParameterSet&&) = default;
  ParameterSet& operator=(const ParameterSet&) = default;
  ParameterSet& operator=(ParameterSet&&) = default;
};

}  // namespace retain
