#include "model/infer/plot.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>

#include <plplot.h>

#include "kernels/base/atomic_file.h"
#include "kernels/base/error.h"

namespace retain::infer {

namespace {

// Series colours (colour map 0 indices 2..): a qualitative palette that stays apart in print.
constexpr int kPalette[][3] = {{0, 0, 0},     {31, 119, 180}, {214, 39, 40}, {44, 160, 44},
                               {255, 127, 14}, {148, 103, 189}, {140, 86, 75}, {227, 119, 194}};
constexpr int kColors = sizeof(kPalette) / sizeof(kPalette[0]);

// Whether `path` holds a PNG from its 8-byte signature to its closing IEND chunk (length 0,
// "IEND", CRC AE 42 60 82): what a writer cut short by a full disk never leaves.
bool whole_png(const std::string& path) {
  std::error_code ec;
  const auto size = std::filesystem::file_size(path, ec);
  if (ec || size < 8 + 12) return false;
  std::ifstream f(path, std::ios::binary);
  char head[8], tail[12];
  f.read(head, 8);
  f.seekg(static_cast<std::streamoff>(size - 12));
  f.read(tail, 12);
  return f && std::memcmp(head, "\x89PNG\r\n\x1a\n", 8) == 0 &&
         std::memcmp(tail, "\0\0\0\0IEND\xae\x42\x60\x82", 12) == 0;
}

// One PLplot session writing a PNG under a temporary name; published on finish().
class Session {
 public:
  Session(const std::string& png, int w, int h) : png_(png), tmp_(png + ".tmp." + std::to_string(::getpid())) {
    const std::filesystem::path parent = std::filesystem::path(png).parent_path();
    if (!parent.empty() && !std::filesystem::is_directory(parent))
      fail("{}: folder {} does not exist", png, parent.string());
    plsdev("pngcairo");
    plsfnam(tmp_.c_str());
    plspage(0, 0, w, h, 0, 0);
    plscolbg(255, 255, 255);
    plinit();
    plscol0(1, 0, 0, 0);  // axes and text black
    for (int i = 0; i < kColors; ++i) plscol0(2 + i, kPalette[i][0], kPalette[i][1], kPalette[i][2]);
    plscol0(15, 170, 170, 170);
    plfontld(1);
  }
  // PLplot reports no write errors (a full disk leaves an empty or cut PNG and a zero exit), so
  // the file is checked to be a whole PNG — its signature first, the IEND chunk last — before it
  // replaces anything at png_.
  void finish() {
    plend();
    ended_ = true;
    if (!whole_png(tmp_))
      fail("{}: the PNG was not written completely (is the disk full?); nothing was replaced", png_);
    publish_file(tmp_, png_);
  }
  ~Session() {
    if (!ended_) plend();
    std::error_code ec;
    std::filesystem::remove(tmp_, ec);
  }

 private:
  std::string png_, tmp_;
  bool ended_ = false;
};

// The viewport of panel i in a grid, in normalized page coordinates, below a title band.
void panel_viewport(size_t i, size_t n, int cols, double left, double right, double bottom = 0.18,
                    double top_margin = 0.11, double area = 0.93) {
  const int rows = static_cast<int>((n + static_cast<size_t>(cols) - 1) / static_cast<size_t>(cols));
  const int r = static_cast<int>(i) / cols, c = static_cast<int>(i) % cols;
  const double top = 0.9, w = area / cols, h = top / rows;
  // Room below for the x label, above for the panel title, left for the y label.
  plvpor(c * w + left * w, (c + 1) * w - right * w, top - (r + 1) * h + bottom * h, top - r * h - top_margin * h);
}

void page_title(const std::string& title, double scale = 1.0) {
  plvpor(0.0, 1.0, 0.91, 0.97);
  plwind(0, 1, 0, 1);
  plcol0(1);
  plschr(0, scale);
  plptex(0.5, 0.5, 1, 0, 0.5, title.c_str());
  plschr(0, 0.8);
}

// x labels of a log2 axis: the value 2^v (budgets are powers of two or near them).
void log2_labels(PLINT axis, PLFLT value, char* label, PLINT length, PLPointer) {
  if (axis == PL_X_AXIS)
    std::snprintf(label, static_cast<size_t>(length), "%.0f", std::exp2(value));
  else
    std::snprintf(label, static_cast<size_t>(length), "%g", value);
}

}  // namespace

void plot_lines(const std::string& png, const std::string& title, const std::vector<LinePanel>& panels, int cols,
                int width_px, int height_px) {
  // Panels that show the same series share one legend in a 320 px column on the right; otherwise
  // each panel with several series gets its own legend inside it.
  bool shared = true;
  for (const LinePanel& pan : panels) {
    if (pan.series.size() != panels[0].series.size()) shared = false;
    for (size_t k = 0; shared && k < pan.series.size(); ++k) shared = pan.series[k].label == panels[0].series[k].label;
  }
  const int legend_px = shared ? 320 : 0;
  Session s(png, width_px + legend_px, height_px);
  const double area = static_cast<double>(width_px) / (width_px + legend_px);
  pladv(0);
  page_title(title, 0.85);
  for (size_t p = 0; p < panels.size(); ++p) {
    const LinePanel& pan = panels[p];
    double x0 = INFINITY, x1 = -INFINITY, y0 = INFINITY, y1 = -INFINITY;
    auto tx = [&](double x) { return pan.log_x ? std::log2(x) : x; };
    for (const Series& se : pan.series)
      for (size_t i = 0; i < se.x.size(); ++i) {
        if (!std::isfinite(se.y[i])) continue;
        x0 = std::min(x0, tx(se.x[i])), x1 = std::max(x1, tx(se.x[i]));
        y0 = std::min(y0, se.y[i]), y1 = std::max(y1, se.y[i]);
      }
    if (!std::isfinite(x0)) x0 = 0, x1 = 1, y0 = 0, y1 = 1;
    if (x1 - x0 < 1e-12) x0 -= 0.5, x1 += 0.5;
    if (pan.y_range) y0 = pan.y_range->first, y1 = pan.y_range->second;
    if (y1 - y0 < 1e-12) y0 -= 0.5, y1 += 0.5;
    const double padx = 0.04 * (x1 - x0), pady = 0.06 * (y1 - y0);
    const bool last = p + 1 == panels.size();
    panel_viewport(p, panels.size(), cols, 0.2, 0.05, 0.18, 0.11, area);
    plwind(x0 - padx, x1 + padx, y0 - pady, y1 + pady);
    plcol0(1);
    plwidth(1);
    if (pan.log_x) plslabelfunc(log2_labels, nullptr);
    plbox(pan.log_x ? "bcnsto" : "bcnst", pan.log_x ? 1.0 : 0.0, 0, "bcnstv", 0, 0);
    plslabelfunc(nullptr, nullptr);
    plcol0(15);
    pllsty(2);
    plbox("g", pan.log_x ? 1.0 : 0.0, 0, "g", 0, 0);  // light grid
    pllsty(1);
    plcol0(1);
    pllab(pan.xlabel.c_str(), pan.ylabel.c_str(), pan.title.c_str());
    std::vector<PLINT> opt, lcol, lsty, scol, snum;
    std::vector<PLFLT> lwid, sscale;
    std::vector<const char*> text, symbols;
    for (size_t k = 0; k < pan.series.size(); ++k) {
      const Series& se = pan.series[k];
      std::vector<PLFLT> x, y;
      for (size_t i = 0; i < se.x.size(); ++i)
        if (std::isfinite(se.y[i])) x.push_back(tx(se.x[i])), y.push_back(se.y[i]);
      const PLINT color = 2 + static_cast<PLINT>(k % kColors);
      plcol0(color);
      plwidth(2.0);
      pllsty(se.dashed ? 2 : 1);
      if (x.size() > 1) plline(static_cast<PLINT>(x.size()), x.data(), y.data());
      if (se.markers && !x.empty()) {
        plschr(0, 0.8);
        plstring(static_cast<PLINT>(x.size()), x.data(), y.data(), "#(840)");
      }
      pllsty(1);
      opt.push_back(PL_LEGEND_LINE | (se.markers ? PL_LEGEND_SYMBOL : 0));
      lcol.push_back(color), lsty.push_back(se.dashed ? 2 : 1), lwid.push_back(2.0);
      scol.push_back(color), sscale.push_back(0.8), snum.push_back(2);
      text.push_back(se.label.c_str()), symbols.push_back("#(840)");
    }
    if (!text.empty() && (shared ? last : text.size() > 1)) {
      PLFLT lw, lh;
      std::vector<PLINT> tcol(text.size(), 1);
      pllegend(&lw, &lh, PL_LEGEND_BACKGROUND | PL_LEGEND_BOUNDING_BOX,
               shared ? PL_POSITION_RIGHT | PL_POSITION_OUTSIDE : PL_POSITION_TOP | PL_POSITION_RIGHT | PL_POSITION_INSIDE,
               0.02, 0.0, 0.06, 0, 1, 1, 0, 0, static_cast<PLINT>(text.size()), opt.data(), 0.8, 0.7, 1.6, 0.0,
               tcol.data(), text.data(), nullptr, nullptr, nullptr, nullptr, lcol.data(), lsty.data(), lwid.data(),
               scol.data(), sscale.data(), snum.data(), symbols.data());
    }
  }
  s.finish();
}

void plot_images(const std::string& png, const std::string& title, const std::vector<ImagePanel>& panels, int cols,
                 int width_px, int height_px, const std::string& scale_label) {
  Session s(png, width_px, height_px);
  // Colour map 1: dark blue → teal → yellow (viridis-like), readable in grey too.
  const PLFLT pos[] = {0.0, 0.35, 0.7, 1.0}, r[] = {0.27, 0.19, 0.35, 0.99}, g[] = {0.0, 0.41, 0.76, 0.91},
              b[] = {0.33, 0.56, 0.38, 0.14};
  plscmap1l(1, 4, pos, r, g, b, nullptr);
  pladv(0);
  page_title(title, 0.7);
  double vmin = 0, vmax = 1;
  for (size_t p = 0; p < panels.size(); ++p) {
    const ImagePanel& im = panels[p];
    vmin = im.vmin, vmax = im.vmax;
    panel_viewport(p, panels.size(), cols, 0.25, 0.02, 0.2, 0.13);
    plwind(0, static_cast<PLFLT>(im.cols), static_cast<PLFLT>(im.rows), 0);  // row 0 at the top
    // plimagefr takes z[x][y]; cells outside [vmin, vmax] (NaN → below) are not drawn, so the
    // background shows where a value is undefined; colours span exactly [vmin, vmax].
    std::vector<std::vector<PLFLT>> z(static_cast<size_t>(im.cols), std::vector<PLFLT>(static_cast<size_t>(im.rows)));
    std::vector<PLFLT*> zp(static_cast<size_t>(im.cols));
    for (int64_t c = 0; c < im.cols; ++c) {
      for (int64_t rr = 0; rr < im.rows; ++rr) {
        const double v = im.values[static_cast<size_t>(rr * im.cols + c)];
        z[c][rr] = std::isfinite(v) ? v : im.vmin - 1.0 - std::fabs(im.vmax - im.vmin);
      }
      zp[c] = z[c].data();
    }
    plimagefr(zp.data(), static_cast<PLINT>(im.cols), static_cast<PLINT>(im.rows), 0, static_cast<PLFLT>(im.cols), 0,
              static_cast<PLFLT>(im.rows), im.vmin, im.vmax, im.vmin, im.vmax, nullptr, nullptr);
    plschr(0, 0.55);
    plcol0(1);
    plwidth(1);
    plbox("bcnst", 0, 0, "bcnstv", 0, 0);
    pllab(im.xlabel.c_str(), im.ylabel.c_str(), im.title.c_str());
  }
  // The colour bar, right of the last panel row.
  if (!panels.empty()) {
    plvpor(0.94, 0.955, 0.1, 0.85);
    plwind(0, 1, vmin, vmax);
    const int steps = 64;
    for (int i = 0; i < steps; ++i) {
      const PLFLT a = vmin + (vmax - vmin) * i / steps, bb = vmin + (vmax - vmin) * (i + 1) / steps;
      const PLFLT xs[] = {0, 1, 1, 0}, ys[] = {a, a, bb, bb};
      plcol1((i + 0.5) / steps);
      plfill(4, xs, ys);
    }
    plcol0(1);
    plbox("bc", 0, 0, "bcmstv", 0, 0);
    plmtex("t", 1.5, 0.5, 0.5, scale_label.c_str());
  }
  s.finish();
}

}  // namespace retain::infer
