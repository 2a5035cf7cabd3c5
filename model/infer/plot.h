// PNG figures through PLplot (Debian libplplot-dev, cairo driver "pngcairo"): line panels
// (quality vs budget, loss curves) and image panels (retention matrices, eviction decisions).
// Each file is drawn under a temporary name and renamed when complete.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace retain::infer {

struct Series {
  std::string label;
  std::vector<double> x, y;
  bool markers = true;  // points at the data, joined by lines
  bool dashed = false;  // e.g. a reference level (the full cache)
};

struct LinePanel {
  std::string title, xlabel, ylabel;
  bool log_x = false;  // log2 budgets are spaced evenly: the x axis is log10 with labels
  std::vector<Series> series;
  std::optional<std::pair<double, double>> y_range;  // default: the data's, padded
};

// A grid of line panels (`cols` per row), one legend per panel.
void plot_lines(const std::string& png, const std::string& title, const std::vector<LinePanel>& panels, int cols,
                int width_px, int height_px);

struct ImagePanel {
  std::string title, xlabel, ylabel;
  int64_t rows = 0, cols = 0;
  std::vector<double> values;  // row-major [rows, cols]; NaN = not defined (drawn white)
  double vmin = 0, vmax = 1;
};

// A grid of heat maps (`cols` per row) on one colour scale (dark = low, bright = high), with
// a colour bar labelled `scale_label`.
void plot_images(const std::string& png, const std::string& title, const std::vector<ImagePanel>& panels, int cols,
                 int width_px, int height_px, const std::string& scale_label);

}  // namespace retain::infer
