#!/usr/bin/env python3
"""Fails when a ctest test of a build has a program that is not built.

  check-test-programs.py BUILD_DIR [CTEST_ARGS...]

ctest lists each test of BUILD_DIR (narrowed by CTEST_ARGS, e.g. -R REGEX)
with the command it will run. A test whose program is not built has no
command there, and would end "Not Run" ("Could not find executable") after
the whole run; a test that hands a program of the build to a wrapper
(kernels.isa_*: sh -c '... exec "$0"' ampx_tests; example.ddp_torchrun:
run_ranks.sh) names it as an argument, and would fail. So every test needs
a command, and every executable of the build (CMake's file API, codemodel-v2)
that a command names needs to exist. scripts/sanitize.sh calls this after
its build, before its tests: a build that leaves a test program out fails at
once, naming the tests, not after twenty minutes of tests.
"""
import glob
import json
import os
import subprocess
import sys


def executables(build):
    """The paths of every executable target of the build, from CMake's file
    API (asked for and generated here if the last configure was not)."""
    api = os.path.join(build, ".cmake", "api", "v1")
    if not glob.glob(os.path.join(api, "reply", "index-*.json")):
        os.makedirs(os.path.join(api, "query"), exist_ok=True)
        open(os.path.join(api, "query", "codemodel-v2"), "w").close()
        subprocess.run(["cmake", build], check=True, stdout=subprocess.DEVNULL)
    reply = os.path.join(api, "reply")
    index = max(glob.glob(os.path.join(reply, "index-*.json")))
    with open(index) as f:
        model_file = json.load(f)["reply"]["codemodel-v2"]["jsonFile"]
    with open(os.path.join(reply, model_file)) as f:
        model = json.load(f)
    paths = set()
    for config in model["configurations"]:
        for target in config["targets"]:
            with open(os.path.join(reply, target["jsonFile"])) as f:
                t = json.load(f)
            if t["type"] == "EXECUTABLE":
                for a in t.get("artifacts", []):
                    paths.add(os.path.normpath(os.path.join(build, a["path"])))
    return paths


def main(argv):
    if len(argv) < 2:
        sys.exit(__doc__)
    build, ctest_args = os.path.abspath(argv[1]), argv[2:]
    programs = executables(build)
    listed = subprocess.run(["ctest", "--show-only=json-v1", *ctest_args], cwd=build,
                            check=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    tests = json.loads(listed.stdout)["tests"]
    missing = {}  # test name: what it lacks
    for t in tests:
        command = t.get("command")
        if not command:
            missing[t["name"]] = "its program"
            continue
        unbuilt = [a for a in command[1:]
                   if os.path.normpath(a) in programs and not os.path.exists(a)]
        if unbuilt:
            missing[t["name"]] = ", ".join(unbuilt)
    if missing:
        print(f"check-test-programs: {len(missing)} of {len(tests)} tests in {build} "
              "need a program that is not built:", file=sys.stderr)
        for name, what in missing.items():
            print(f"  {name}: {what}", file=sys.stderr)
        return 1
    print(f"check-test-programs: the programs of all {len(tests)} tests are built")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
