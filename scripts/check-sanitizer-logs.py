#!/usr/bin/env python3
"""Fails a sanitizer run that left a report in its log folder.

  check-sanitizer-logs.py LOG_DIR

scripts/sanitize.sh points every sanitized process of a test run at LOG_DIR
(log_path=LOG_DIR/<tool>, log_exe_name=1: one file per process,
<tool>.<program>.<pid>): the test binaries, and the ampx-train runs, ranks,
data-parallel workers and package consumer that tests start, whose own exit
status a test may not look at, or may expect to be non-zero anyway. This
script prints every report found there and exits 1 if there is one: an
AddressSanitizer or LeakSanitizer error, an UndefinedBehaviorSanitizer
"runtime error", a ThreadSanitizer warning. Files holding only the table of
suppressions a process used (print_suppressions) are summed up, not errors.
"""
import collections
import os
import re
import sys

REPORT = re.compile(r"ERROR: (AddressSanitizer|LeakSanitizer|ThreadSanitizer)|"
                    r"WARNING: ThreadSanitizer|: runtime error: ")
# "  count      bytes template" (LeakSanitizer) or "  count template" rows
SUPPRESSION_ROW = re.compile(r"^\s*(\d+)\s+(?:\d+\s+)?(\S.*?)\s*$")
MAX_LINES = 120  # of each report shown; the file keeps all of it


def main(argv):
    if len(argv) != 2:
        sys.exit(__doc__)
    folder = argv[1]
    names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    failed = []
    used = collections.Counter()
    for name in names:
        path = os.path.join(folder, name)
        with open(path, errors="replace") as f:
            text = f.read()
        if REPORT.search(text):
            failed.append(name)
            lines = text.splitlines()
            print("== %s (%d lines) ==" % (path, len(lines)))
            print("\n".join(lines[:MAX_LINES]))
            if len(lines) > MAX_LINES:
                print("... (%d more lines in %s)" % (len(lines) - MAX_LINES, path))
        in_table = False
        for line in text.splitlines():
            if line.startswith("Suppressions used:"):
                in_table = True
                continue
            m = SUPPRESSION_ROW.match(line) if in_table else None
            if m:
                used[m.group(2)] += int(m.group(1))
            elif in_table and line.strip() and not line.strip().startswith("count"):
                in_table = False
    for template, count in sorted(used.items()):
        print("check-sanitizer-logs: suppressed %d times: %s" % (count, template))
    if failed:
        print("check-sanitizer-logs: %d of %d processes' logs hold a sanitizer report (%s)"
              % (len(failed), len(names), folder))
        return 1
    print("check-sanitizer-logs: no sanitizer report (%d log files, only suppression tables; %s)"
          % (len(names), folder))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
