#include "shell.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <filesystem>

namespace ampx::train {

namespace fs = std::filesystem;

std::string shell_quote(const std::string& s) {
  const bool plain = !s.empty() && std::all_of(s.begin(), s.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || std::strchr("/._-+:,=@%", c) != nullptr;
  });
  if (plain) return s;
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

std::string gnuplot_string(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("''") : std::string(1, c);
  return out + "'";
}

std::string run_gnuplot(const std::string& dir, const std::string& script, const std::string& png,
                        std::string& note) {
  const fs::path out = dir;
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) {
    note =
        "gnuplot is not installed (Debian: apt-get install gnuplot-nox); the "
        "plot's data and script are in " +
        out.string();
    return "";
  }
  const std::string log = fs::path(script).stem().string() + ".gnuplot.log";
  const std::string cmd = "cd " + shell_quote(out.string()) + " && gnuplot " + shell_quote(script) +
                          " > " + shell_quote(log) + " 2>&1";
  if (std::system(cmd.c_str()) == 0 && fs::exists(out / png)) return (out / png).string();
  note = "gnuplot failed, see " + (out / log).string();
  return "";
}

}  // namespace ampx::train
