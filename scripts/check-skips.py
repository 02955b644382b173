#!/usr/bin/env python3
"""Fails a test run whose skipped tests differ from the leg's expected list.

  check-skips.py EXPECTED_LIST [EXPECTED_LIST...] CTEST_JUNIT_XML [--gtest-xml DIR]

A feature probe that breaks (fp16 CPU autocast, ATen's CPU unscale kernel,
the trainer binary...) turns its tests into skips, and a run that only counts
failures stays green while coverage shrinks. Each leg of `make test` keeps the
exact list of tests that may skip on it (tests/skips/<leg>.txt, one ctest name
per line, `#` comments giving the reason; `NAME if-cpu-lacks FLAG` for a test
that skips only on CPUs without a feature); this script compares the list with
the skips ctest recorded (`ctest --output-junit FILE`) and exits 1 on any
difference in either direction: a test skipped that is not listed, or a
listed test that ran (the list is stale: remove the line). Several lists are
joined: the sanitizer runs add tests/skips/sanitizers.txt to their leg's.

With --gtest-xml DIR (a build with AMPX_TEST_SHARDS, whose GoogleTest
binaries run as a few ctest shards: cmake/AmpxGTest.cmake), the GoogleTest
tests are read from the XML reports the shards wrote to DIR, under the
names ctest would give them one by one (Suite.Test, Prefix/Suite.Test/param);
the shards' own ctest entries are not tests.
"""
import glob
import os
import re
import sys
import xml.etree.ElementTree as ET


def cpu_flags():
    """The CPU's feature flags (/proc/cpuinfo's first 'flags' line), empty where unreadable."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def expected_skips(path):
    """The names a list expects to skip. A line `NAME if-cpu-lacks FLAG` expects NAME to
    skip exactly where the CPU lacks FLAG (/proc/cpuinfo), and to run elsewhere: the
    machines of one kind differ (AMD Zen 3 without AVX-512, Intel with AVX512-BF16)."""
    names = set()
    with open(path) as f:
        for number, line in enumerate(f, 1):
            words = line.split("#", 1)[0].split()
            if not words:
                continue
            if len(words) == 1:
                names.add(words[0])
            elif len(words) == 3 and words[1] == "if-cpu-lacks":
                if words[2] not in cpu_flags():
                    names.add(words[0])
            else:
                sys.exit("check-skips: %s:%d: expected 'NAME' or 'NAME if-cpu-lacks FLAG', got %r"
                         % (path, number, line.strip()))
    return names


def recorded(path):
    """(all test names, skipped test names) from ctest's JUnit file."""
    root = ET.parse(path).getroot()
    ran, skipped = set(), set()
    for case in root.iter("testcase"):
        # gtest_discover_tests appends "  # GetParam() = ..." to parameterised
        # tests' names, and a binary registered twice prefixes its second
        # registration's ("ampx_tests_native:Suite.Test", cmake/AmpxGTest.cmake);
        # the lists name them without either.
        name = case.get("name").split("  # ", 1)[0].strip().rsplit(":", 1)[-1]
        ran.add(name)
        if case.find("skipped") is not None or case.get("status") in ("notrun", "disabled"):
            skipped.add(name)
    return ran, skipped


SHARD = re.compile(r"\.shard\d+of\d+$")


def recorded_gtest(directory):
    """(all test names, skipped test names) from GoogleTest's XML reports."""
    ran, skipped = set(), set()
    files = sorted(glob.glob(os.path.join(directory, "*.xml")))
    if not files:
        sys.exit("check-skips: no GoogleTest XML report in %s" % directory)
    for path in files:
        for case in ET.parse(path).getroot().iter("testcase"):
            name = "%s.%s" % (case.get("classname"), case.get("name"))
            ran.add(name)
            if (case.get("result") == "skipped" or case.find("skipped") is not None
                    or case.get("status") == "notrun"):
                skipped.add(name)
    return ran, skipped


def main(argv):
    args = argv[1:]
    gtest_dir = None
    if "--gtest-xml" in args:
        i = args.index("--gtest-xml")
        if i + 1 >= len(args):
            sys.exit(__doc__)
        gtest_dir = args[i + 1]
        del args[i:i + 2]
    if len(args) < 2:
        sys.exit(__doc__)
    lists, junit = args[:-1], args[-1]
    expected = set().union(*(expected_skips(path) for path in lists))
    ran, skipped = recorded(junit)
    if gtest_dir is not None:
        ran = {name for name in ran if not SHARD.search(name)}
        skipped = {name for name in skipped if not SHARD.search(name)}
        gtest_ran, gtest_skipped = recorded_gtest(gtest_dir)
        ran |= gtest_ran
        skipped |= gtest_skipped
    if not ran:
        sys.exit("check-skips: %s lists no test at all" % junit)
    unexpected = sorted(skipped - expected)
    stale = sorted(expected - skipped)
    for name in unexpected:
        print("check-skips: %s skipped, but it is not expected to skip on this leg (%s)"
              % (name, ", ".join(lists)))
    for name in stale:
        state = "ran" if name in ran else "does not exist"
        print("check-skips: %s is listed as skipping in %s but %s: remove it from the list"
              % (name, ", ".join(lists), state))
    if unexpected or stale:
        return 1
    print("check-skips: %d tests, %d skipped, exactly those expected on this leg (%s)"
          % (len(ran), len(skipped), ", ".join(lists)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
