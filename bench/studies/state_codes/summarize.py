"""The tables of docs/studies/8bit-state-codes.md from run_all.sh's runs (argv[1], default
runs/state-codes): per workload and code, each seed's test loss, its mean against fp32 moments,
the mean training loss of steps 0-199 and of the last 100 against the same seed's fp32 run,
updates over 3 lr and the largest; then what each code did to the moments at steps 1, 100 and
1000 (seed 1). Only the standard library."""
import glob
import json
import os
import statistics as st
import sys

ORDER = ("fp32", "dynamic", "dynamic-floor", "linear", "linear0")


def main():
    d = sys.argv[1] if len(sys.argv) > 1 else "runs/state-codes"
    runs = {}
    for path in glob.glob(os.path.join(d, "*.json")):
        with open(path) as f:
            r = json.load(f)
        runs[(r["workload"], r["code"], r["seed"])] = r
    for workload in ("mnist-cnn", "gpt"):
        seeds = sorted({s for (w, _, s) in runs if w == workload})
        base = {s: runs[(workload, "fp32", s)] for s in seeds if (workload, "fp32", s) in runs}
        if not base:
            continue
        b_mean = st.mean(r["test_loss"] for r in base.values())
        spread = max(r["test_loss"] for r in base.values()) - min(r["test_loss"] for r in base.values())
        print(f"\n{workload}, 1000 steps, seeds {' '.join(map(str, seeds))} (fp32's spread {spread:.4f}):\n")
        print("| code | test loss by seed | mean | vs fp32 | train 0-199 vs fp32 | last 100 vs fp32 "
              "| updates > 3 lr | largest (lr) |")
        print("|---|---|---|---|---|---|---|---|")
        for code in ORDER:
            rs = [runs[(workload, code, s)] for s in seeds if (workload, code, s) in runs]
            if not rs:
                continue
            t = [r["test_loss"] for r in rs]
            early = [r["train_loss_0_199"] - base[r["seed"]]["train_loss_0_199"] for r in rs if r["seed"] in base]
            late = [r["train_loss_last100"] - base[r["seed"]]["train_loss_last100"] for r in rs if r["seed"] in base]
            big = " ".join(str(sum(r["big_updates"])) for r in rs)
            top = " ".join(f"{max(r['max_update']):.3g}" for r in rs)
            print(f"| {code} | {' '.join(f'{x:.4f}' for x in t)} | {st.mean(t):.4f} | "
                  f"{100 * (st.mean(t) / b_mean - 1):+.1f}% | {' '.join(f'{x:+.4f}' for x in early)} | "
                  f"{' '.join(f'{x:+.4f}' for x in late)} | {big} | {top} |")
        print(f"\nWhat each code did to the fresh moments of {workload}'s coded parameters (seed 1):\n")
        print("| code | step | v > 0 decoded 0 | m != 0 decoded 0 | sqrt(v) rel. error median / p99 "
              "| update error (lr) median / p99 / max |")
        print("|---|---|---|---|---|---|")
        for code in ORDER[1:]:
            r = runs.get((workload, code, 1))
            if not r:
                continue
            for p in r["probes"]:
                if p["step"] not in (1, 100, 1000):
                    continue
                print(f"| {code} | {p['step']} | {100 * p['v_flushed_share']:.3f}% | "
                      f"{100 * p['m_flushed_share']:.3f}% | {p['rel_sqrt_v_median']:.2e} / "
                      f"{p['rel_sqrt_v_p99']:.2e} | {p['update_error_median']:.2e} / "
                      f"{p['update_error_p99']:.2e} / {p['update_error_max']:.3g} |")


if __name__ == "__main__":
    main()
