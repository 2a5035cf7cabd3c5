// Run options from a TOML file (`retain-train --config run.toml`), as torchtitan and Megatron
// users keep them (toml++ parses it). Keys are the long option names, with '-' or '_'
// (`lr = 3e-3`, `global_batch = 8`, `gate = "trimkv"`, `resume = true`); tables only group
// keys and their names are ignored ([optimizer] lr = … is lr). The command line wins over
// the file. Every run writes RUN/config.toml, which is such a file.
#pragma once
#include <string>
#include <vector>

#include <boost/program_options.hpp>
#include <nlohmann/json.hpp>

namespace retain::trainer {

// The file's options as command-line tokens ("--lr=0.003", "--resume"), to be stored after
// the real command line (program_options keeps the first value stored). An unknown key, a
// value of the wrong kind, a key given twice or a syntax error is one retain::Error naming
// the file, line and key.
std::vector<std::string> config_file_arguments(const std::string& path,
                                               const boost::program_options::options_description& options);

// A run's configuration (trainer/train_config.h to_json) as a TOML file that --config reads
// back: every option the run used, empty strings left out.
std::string config_toml(const nlohmann::json& run_config);

}  // namespace retain::trainer
