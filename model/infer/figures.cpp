#include "model/infer/figures.h"

#include <cmath>
#include <fstream>
#include <map>

#include <nlohmann/json.hpp>

#include "kernels/base/atomic_file.h"
#include "kernels/base/error.h"
#include "model/infer/plot.h"

namespace retain::infer {

void plot_eval_metrics(const nlohmann::json& m, const std::string& png, const std::string& source) {
  if (!m.is_object() || !m.contains("results") || !m["results"].is_array() || m["results"].empty())
    fail("{}: no results to plot", source);
  const bool recall = m["results"][0].contains("accuracy");
  struct Metric {
    const char* key;
    const char* title;
    const char* ylabel;
  };
  const std::vector<Metric> metrics =
      recall ? std::vector<Metric>{{"accuracy", "recall accuracy (exact match)", "accuracy"},
                                   {"nll", "answer NLL", "nats / token"}}
             : std::vector<Metric>{{"kl", "KL(full cache || bounded cache)", "nats / token"},
                                   {"top1_agreement", "top-1 agreement with the full cache", "fraction"},
                                   {"nll", "NLL of the targets", "nats / token"}};
  double bmin = INFINITY, bmax = -INFINITY;
  for (const auto& r : m["results"])
    if (r.contains("budget") && r["budget"].is_number()) {
      bmin = std::min(bmin, r["budget"].get<double>());
      bmax = std::max(bmax, r["budget"].get<double>());
    }
  if (!std::isfinite(bmin)) bmin = 1, bmax = 2;
  std::vector<LinePanel> panels;
  for (const Metric& mt : metrics) {
    LinePanel p;
    p.title = mt.title, p.xlabel = "budget (entries per KV head)", p.ylabel = mt.ylabel, p.log_x = true;
    if (std::string(mt.key) == "accuracy" || std::string(mt.key) == "top1_agreement") p.y_range = {{0.0, 1.0}};
    std::map<std::string, Series> by_policy;
    std::vector<std::string> order;
    for (const auto& r : m["results"]) {
      if (!r.contains(mt.key) || !r[mt.key].is_number()) fail("{}: a result has no number '{}'", source, mt.key);
      const std::string pol = r.at("policy").get<std::string>();
      if (!by_policy.count(pol)) order.push_back(pol);
      Series& s = by_policy[pol];
      s.label = pol;
      if (r["budget"].is_number()) {
        s.x.push_back(r["budget"].get<double>());
        s.y.push_back(r[mt.key].get<double>());
      } else {  // the full cache: a level across the budgets
        s.label = "full (no eviction)";
        s.dashed = true, s.markers = false;
        s.x = {bmin, bmax};
        s.y = {r[mt.key].get<double>(), r[mt.key].get<double>()};
      }
    }
    for (const std::string& pol : order) p.series.push_back(by_policy[pol]);
    panels.push_back(p);
  }
  std::string title = recall ? "Bounded KV cache: synthetic recall" : "Bounded KV cache: quality vs budget";
  if (m.contains("model") && m["model"].is_string()) title += " — " + m["model"].get<std::string>();
  plot_lines(png, title, panels, static_cast<int>(panels.size()), 520 * static_cast<int>(panels.size()), 480);
}

void plot_training_curves(const std::string& path, const std::string& png) {
  require_regular_file(path);
  std::ifstream f(path);
  if (!f) fail("{}: cannot read", path);
  Series total{"total", {}, {}, false}, kl{"KL", {}, {}, false}, ntp{"NTP", {}, {}, false}, cap{"capacity", {}, {}, false},
      lr{"lr", {}, {}, false};
  std::string line;
  int64_t n = 0;
  while (std::getline(f, line)) {
    ++n;
    if (line.empty()) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      fail("{}:{}: not JSON ({})", path, n, e.what());
    }
    if (!j.contains("step") || !j["step"].is_number()) fail("{}:{}: no step", path, n);
    const double step = j["step"].get<double>();
    auto add = [&](Series& s, const char* key) {
      if (j.contains(key) && j[key].is_number()) s.x.push_back(step), s.y.push_back(j[key].get<double>());
    };
    add(total, "loss"), add(kl, "kl"), add(ntp, "ntp"), add(cap, "cap"), add(lr, "lr");
  }
  if (total.x.empty()) fail("{}: no training steps", path);
  LinePanel a{"loss (total) and KL", "step", "loss", false, {total, kl}, std::nullopt};
  LinePanel b{"next-token NLL", "step", "nats / token", false, {ntp}, std::nullopt};
  LinePanel c{"capacity loss", "step", "L_cap", false, {cap}, std::nullopt};
  LinePanel d{"learning rate", "step", "lr", false, {lr}, std::nullopt};
  plot_lines(png, "Training: " + path, {a, b, c, d}, 2, 1100, 820);
}

}  // namespace retain::infer
