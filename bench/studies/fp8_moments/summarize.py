"""Table of run_all.sh's runs (argv[1], default runs/fp8-moments/sim): per codec, each seed's test loss, mean train loss of steps 0-199
and 900-999, and fc1.weight's big updates (|u| > 3 lr) and flushed pairs (stored v 0, m not)."""
import glob, json, os, statistics as st, sys
R = {}
for f in glob.glob(os.path.join(sys.argv[1] if len(sys.argv) > 1 else "runs/fp8-moments/sim", "*.json")):
    r = json.load(open(f)); R[(r["codec"], r["seed"])] = r
base = {s: R[("fp32", s)] for s in (1, 2, 3)}
order = ["fp32", "fp8", "torchao-fp8", "fp8-v-only", "fp8-sqrtv", "fp8-e5m2v", "fp8-vfloor"]
print("| codec | seeds | test loss s1 s2 s3 | mean | vs fp32 | train 0-199 vs fp32 | train 900-999 vs fp32 | fc1 |u|>3lr elems | fc1 max |u|/lr |")
print("|---|---|---|---|---|---|---|---|---|")
for c in order:
    rs = [R[(c, s)] for s in (1, 2, 3) if (c, s) in R]
    t = [r["test_loss"] for r in rs]
    d0 = [st.mean(r["losses"][:200]) - st.mean(base[r["seed"]]["losses"][:200]) for r in rs]
    d1 = [st.mean(r["losses"][900:]) - st.mean(base[r["seed"]]["losses"][900:]) for r in rs]
    fc = [r["diag"].get("fc1.weight") for r in rs]
    big = " ".join(str(sum(f["big"])) for f in fc if f and f["big"]) or "n/a"
    mx = " ".join(f"{max(f['maxr']):.3g}" for f in fc if f and f["maxr"]) or "n/a"
    bm = st.mean(base[s]["test_loss"] for s in (1, 2, 3))
    print(f"| {c} | {len(rs)} | {' '.join(f'{x:.4f}' for x in t)} | {st.mean(t):.4f} | {100*(st.mean(t)/bm-1):+.1f}% | "
          f"{' '.join(f'{x:+.4f}' for x in d0)} | {' '.join(f'{x:+.4f}' for x in d1)} | {big} | {mx} |")
r = R[("fp8", 1)]["diag"]["fc1.weight"]
print("fp8 seed1 fc1: flushed pairs after step", {k: r["pairs"][k - 1] for k in (1, 2, 5, 10, 50, 100, 300, 600, 1000)})
print("fp8 seed1 fc1: big updates in steps", {f"{a}-{a+99}": sum(r["big"][a:a + 100]) for a in range(0, 1000, 100)})
print("fp8 seed1 fc1: max |u|/lr in steps", {f"{a}-{a+99}": round(max(r["maxr"][a:a + 100]), 1) for a in range(0, 1000, 100)})
