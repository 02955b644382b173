#pragma once

// What ampx-train says in the shell's and gnuplot's syntax, and how it draws:
//
//   shell_quote("runs/my data")      // 'runs/my data'   (runs/gpt: as is)
//   gnuplot_string("loss-O2.dat")    // 'loss-O2.dat'    (a gnuplot string)
//   run_gnuplot(dir, "compare.gp", "compare.png", note);  // the PNG's path, or ""

#include <string>

namespace ampx::train {

/// `s` as one shell word: as is when it has no special characters, else
/// single-quoted.
std::string shell_quote(const std::string& s);

/// `s` as a gnuplot single-quoted string ('' inside for ').
std::string gnuplot_string(const std::string& s);

/// Runs the gnuplot script `script` (a file name in `dir`) in `dir`, which
/// draws `png` there. Returns the picture's path, or "" with `note` saying
/// why there is none (gnuplot missing, or failed: its log is <script>.log).
std::string run_gnuplot(const std::string& dir, const std::string& script, const std::string& png,
                        std::string& note);

}  // namespace ampx::train
