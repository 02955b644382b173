#include "progress.h"

#include "output_file.h"

#include <c10/util/Exception.h>

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>

namespace ampx::train {
namespace {

std::string human_rate(double v) {
  char buf[32];
  if (v >= 1e6) {
    std::snprintf(buf, sizeof(buf), "%.2fM", v / 1e6);
  } else if (v >= 1e4) {
    std::snprintf(buf, sizeof(buf), "%.1fk", v / 1e3);
  } else {
    std::snprintf(buf, sizeof(buf), "%.0f", v);
  }
  return buf;
}

std::string clock_text(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "-";
  const auto s = static_cast<int64_t>(seconds + 0.5);
  char buf[32];
  if (s >= 3600) {
    std::snprintf(buf, sizeof(buf), "%lld:%02lld:%02lld", (long long)(s / 3600),
                  (long long)(s / 60 % 60), (long long)(s % 60));
  } else {
    std::snprintf(buf, sizeof(buf), "%lld:%02lld", (long long)(s / 60), (long long)(s % 60));
  }
  return buf;
}

}  // namespace

Progress::Style Progress::style_for(const std::string& requested) {
  if (requested == "bar") return Style::kBar;
  if (requested == "lines") return Style::kLines;
  if (requested == "none") return Style::kNone;
  return ::isatty(STDOUT_FILENO) ? Style::kBar : Style::kLines;
}

Progress::Progress(std::string mode, int64_t first_step, int64_t total_steps, std::string rate_unit,
                   Style style, int64_t log_every)
    : mode_(std::move(mode)),
      unit_(std::move(rate_unit)),
      first_(first_step),
      total_(total_steps),
      log_every_(log_every > 0 ? log_every : std::max<int64_t>(1, total_steps / 20)),
      style_(style),
      start_(std::chrono::steady_clock::now()) {}

std::string Progress::line(int64_t step, double loss, double scale, double items_per_s) const {
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const int64_t done = step + 1 - first_;
  const double eta = done > 0 ? elapsed / done * static_cast<double>(total_ - step - 1) : NAN;
  char buf[200];
  std::snprintf(buf, sizeof(buf), "[%s] step %lld/%lld  loss %.4f  scale %g  %s %s  ETA %s",
                mode_.c_str(), (long long)(step + 1), (long long)total_, loss, scale,
                human_rate(items_per_s).c_str(), unit_.c_str(), clock_text(eta).c_str());
  return buf;
}

void Progress::update(int64_t step, double loss, double scale, double items_per_s) {
  if (style_ == Style::kNone) return;
  const bool last = step + 1 == total_;
  if (style_ == Style::kBar) {
    const auto now = std::chrono::steady_clock::now();
    // Redraw at most 10 times a second: a terminal is slower than a small model.
    if (!last && now - last_draw_ < std::chrono::milliseconds(100)) return;
    last_draw_ = now;
    std::cout << "\r\033[K" << line(step, loss, scale, items_per_s) << std::flush;
    return;
  }
  if ((step + 1) % log_every_ == 0 || last || step == first_) {
    std::cout << line(step, loss, scale, items_per_s) << std::endl;
  }
}

void Progress::finish() {
  if (style_ == Style::kBar) std::cout << "\n" << std::flush;
}

MetricsWriter::MetricsWriter(std::filesystem::path path, bool csv, int64_t keep_through_step)
    : path_(std::move(path)), csv_(csv) {
  std::string kept;
  if (keep_through_step >= 0 && std::filesystem::exists(path_)) {
    std::ifstream in(path_);
    std::string text;
    bool header = csv_;
    while (std::getline(in, text)) {
      if (header) {  // CSV: keep the header, remember its columns
        header = false;
        kept += text + "\n";
        std::stringstream cols(text);
        for (std::string col; std::getline(cols, col, ',');) columns_.push_back(col);
        continue;
      }
      int64_t step = -1;
      try {
        step = csv_ ? std::stoll(text.substr(0, text.find(',')))
                    : nlohmann::json::parse(text).at("step").get<int64_t>();
      } catch (const std::exception&) {
        break;  // a line cut short by a crash: everything from here on is dropped
      }
      if (step > keep_through_step) break;
      kept += text + "\n";
    }
  }
  // The kept records replace the file whole: a full disk cannot cut them short.
  write_output_file(path_, kept);
  fd_ = ::open(path_.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
  TORCH_CHECK(fd_ >= 0, "ampx-train: cannot write metrics file '", path_.string(),
              "': ", std::strerror(errno));
}

MetricsWriter::~MetricsWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void MetricsWriter::write(const nlohmann::ordered_json& record) {
  std::string text;
  if (!csv_) {
    text = record.dump() + "\n";
  } else {
    if (columns_.empty()) {
      for (const auto& [k, v] : record.items()) columns_.push_back(k);
      for (size_t i = 0; i < columns_.size(); ++i) text += (i ? "," : "") + columns_[i];
      text += "\n";
    }
    for (size_t i = 0; i < columns_.size(); ++i) {
      const auto it = record.find(columns_[i]);
      text += (i ? "," : "") + (it == record.end() ? std::string() : it->dump());
    }
    text += "\n";
  }
  const off_t end = ::lseek(fd_, 0, SEEK_END);
  for (size_t done = 0; done < text.size();) {
    const ssize_t n = ::write(fd_, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const std::string why = n < 0 ? std::strerror(errno) : "nothing written";
      // No half line: the file ends with the last whole record.
      const bool whole = end >= 0 && ::ftruncate(fd_, end) == 0;
      TORCH_CHECK(false, "ampx-train: cannot write metrics file '", path_.string(), "': ", why,
                  whole ? " (it holds the steps before step " : " (at step ",
                  record.value("step", int64_t{-1}), ")");
    }
    done += static_cast<size_t>(n);
  }
}

}  // namespace ampx::train
