"""Which oneDNN kernels a program's bf16 products ran, from oneDNN's own verbose output.

A short run (one step) of a benchmark program with ONEDNN_VERBOSE=1 (oneDNN 3.x; 2.x
reads DNNL_VERBOSE) prints, besides the program's output, the ISA oneDNN dispatches for
(`onednn_verbose,...,info,cpu,isa:Intel AVX2`) and one line per primitive executed, naming
its implementation (`brg_matmul:avx512_core_bf16`, `jit:avx2`, `gemm:jit`, ...) and its
tensors' data types. parse_verbose() keeps those; summary() says in one line what the bf16
primitives were, or that none ran (on a CPU without AVX-512 LibTorch runs bf16 products in
its own loop, and ampx routes them through the fp32 BLAS).

Only the standard library: run_all.py imports it under any python3.

    info = parse_verbose(stdout_text)
    info["isa"]                           # "Intel AVX2"
    summary(info)                         # "matmul gemm:jit (bf16)" or "none in bf16"
"""
import json
import os
import re
import subprocess

from e2e import GPT_WORKLOADS, PY_SCRIPT, size_flags
from harness import ROOT, log

# Both spellings: oneDNN 3.x (the wheel's 3.13) reads ONEDNN_VERBOSE, 2.x (Debian's 2.6)
# DNNL_VERBOSE too; "1" prints the ISA and every primitive execution.
VERBOSE_ENV = {"ONEDNN_VERBOSE": "1", "DNNL_VERBOSE": "1"}
# Steps of a probe run: the first already runs every kernel the step has (torch_amp_bench.py
# adds its profiled step), and on a CPU where bf16 products run in LibTorch's own loop a GPT
# step takes minutes.
PROBE_STEPS = "1"

_DTYPE = re.compile(r"(?:^|\s)[a-z_]+?[_:](f32|bf16|f16|s8|u8|s32|f64|f8_e4m3|f8_e5m2)\b")


def parse_verbose(text):
    """{'isa': str or None, 'version': str or None, 'primitives': {key: count}} from a
    program's output; key is 'kind impl (dtypes)', e.g. 'matmul brg_matmul:avx2 (bf16,f32)'."""
    isa = version = None
    primitives = {}
    for line in text.splitlines():
        if not line.startswith(("onednn_verbose,", "dnnl_verbose,")):
            continue
        if isa is None and ",isa:" in line:
            isa = line.split(",isa:", 1)[1].strip()
        m = re.search(r"oneDNN (v[\d.]+)", line)
        if version is None and m:
            version = m.group(1)
        fields = line.split(",")
        if "exec" not in fields:  # v3: "primitive,exec,cpu,..."; v2: "exec,cpu,..."
            continue
        i = fields.index("exec")
        if len(fields) < i + 6:
            continue
        kind, impl, descs = fields[i + 2], fields[i + 3], fields[i + 5]
        dtypes = ",".join(sorted(set(_DTYPE.findall(descs))))
        key = f"{kind} {impl} ({dtypes})"
        primitives[key] = primitives.get(key, 0) + 1
    return {"isa": isa, "version": version, "primitives": primitives}


def bf16_primitives(info):
    """The primitives (kind and implementation) that ran with a bf16 tensor, most runs first;
    reorders (layout and dtype conversions) left out."""
    keys = [k for k in info["primitives"] if "bf16" in k and not k.startswith("reorder ")]
    return sorted(keys, key=lambda k: -info["primitives"][k])


def summary(info):
    """One line for the report: the bf16 products' kernels, or that none went to oneDNN."""
    if not info["primitives"] and info["isa"] is None:
        return "no oneDNN primitive ran"
    bf16 = bf16_primitives(info)
    if not bf16:
        return "none in bf16 (no oneDNN bf16 primitive ran)"
    return "; ".join(re.sub(r" \(.*\)$", "", k) for k in bf16)


# --------------------------------------------------------------------- probe runs
def _probe(cmd, env_extra, label):
    """Runs cmd once with oneDNN's verbose mode (untimed); its stdout, or None if it failed."""
    log("probe: " + " ".join(cmd))
    p = subprocess.run(cmd, cwd=ROOT, text=True, capture_output=True,
                       env=dict(os.environ, **VERBOSE_ENV, **env_extra))
    if p.returncode != 0:
        log(f"probe {label} failed (exit code {p.returncode}): {p.stderr.strip()[-300:]}")
        return None
    return p.stdout


def probe_ampx(exe, args, out, workload, tag, mode="O2", fp32=False):
    """PROBE_STEPS steps of ampx-train in `mode` under oneDNN's verbose mode: (verbose info, its
    compare.json) or None."""
    if fp32:
        mode = "fp32"
    d = os.path.join(out, "probe", f"ampx-{tag}-{workload}-{mode}")
    cmd = [exe, "--workload", workload, "--precision", mode, "--steps", PROBE_STEPS,
           "--threads", str(args.threads), "--out-dir", d, "--progress", "none"]
    cmd += size_flags(args, workload)
    cmd += ["--eval-batches", "1"] if workload in GPT_WORKLOADS else []
    cmd += ["--data-dir", args.data_dir] if args.data_dir else []
    text = _probe(cmd, {}, f"ampx {tag} {workload}")
    if text is None:
        return None
    with open(os.path.join(d, "compare.json")) as f:
        return parse_verbose(text), json.load(f)


def probe_python(python, args, out, workload, tag, env_extra=None, fp32=False):
    """PROBE_STEPS steps of torch_amp_bench.py in torch.autocast bf16 under oneDNN's verbose mode:
    (verbose info, its JSON) or None."""
    precision = "fp32" if fp32 else "autocast-bf16"
    path = os.path.join(out, "probe", f"python-{tag}-{workload}-{precision}.json")
    cmd = [python, PY_SCRIPT, "--workload", workload, "--precision", precision, "--steps",
           PROBE_STEPS, "--threads", str(args.threads), "--json", path] + size_flags(args, workload)
    cmd += ["--data-dir", args.data_dir] if args.data_dir else []
    text = _probe(cmd, env_extra or {}, f"python {tag} {workload}")
    if text is None:
        return None
    with open(path) as f:
        return parse_verbose(text), json.load(f)


# ampx-train's compare.json "cpu_products": how its bf16 products run on this CPU.
AMPX_PRODUCTS = {"wide": "float32 BLAS, rounded once to bf16 (ampx's choice: LibTorch's bf16 "
                         "products slower than its fp32 ones here)",
                 "native": "LibTorch's (oneDNN where LibTorch uses it)"}


def side_of(name, kind, probes):
    """One side's row of "what each side ran" from its probes {workload: (info, result)}:
    the libraries, oneDNN's ISA, where bf16 products go, the oneDNN bf16 kernels seen per
    workload and the GPTs' attention."""
    ok = {w: p for w, p in probes.items() if p}
    row = {"side": name, "kind": kind, "libtorch": None, "fp32_blas": None, "onednn": None,
           "isa": None, "bf16_products": None, "onednn_bf16": {}, "attention": {},
           "failed": sorted(w for w, p in probes.items() if not p)}
    for w, (info, r) in ok.items():
        row["isa"] = row["isa"] or info["isa"]
        row["onednn"] = row["onednn"] or info["version"]
        row["onednn_bf16"][w] = summary(info)
        if kind == "ampx":
            row["libtorch"] = r["machine"]["libtorch"]
            row["fp32_blas"] = r["machine"]["blas"]
            row["bf16_products"] = AMPX_PRODUCTS.get(r["settings"].get("cpu_products"),
                                                     r["settings"].get("cpu_products"))
            if w in GPT_WORKLOADS:
                row["attention"][w] = r["settings"].get("attention")
        else:
            rt = r.get("runtime", {})
            row["libtorch"] = r["torch_version"]
            row["fp32_blas"] = rt.get("fp32_blas")
            row["onednn"] = row["onednn"] or rt.get("onednn")
            row["bf16_products"] = rt.get("bf16_matmuls")
            if w in GPT_WORKLOADS:
                row["attention"][w] = r.get("attention_kernel")
    return row


# The workload whose fp32 step reaches oneDNN on every side (its convolutions): run when no bf16
# probe of a side initialised oneDNN, to learn the ISA oneDNN dispatches for there.
ISA_WORKLOAD = "mnist-cnn"


def what_ran(args, out, sides):
    """Probes every side on every workload (PROBE_STEPS each, untimed), and once in fp32 where
    no bf16 probe reported oneDNN's ISA. sides: dicts with name, kind ("ampx": exe; "python":
    python, env), tag. Returns their rows (side_of)."""
    def probe(s, w, fp32=False):
        if s["kind"] == "ampx":
            return probe_ampx(s["exe"], args, out, w, s["tag"], fp32=fp32)
        return probe_python(s["python"], args, out, w, s["tag"], s.get("env"), fp32=fp32)

    rows = []
    for s in sides:
        row = side_of(s["name"], s["kind"], {w: probe(s, w) for w in args.workloads})
        if row["isa"] is None:
            p = probe(s, ISA_WORKLOAD, fp32=True)
            if p and p[0]["isa"]:
                row["isa"] = p[0]["isa"] + " (from an fp32 step: no bf16 step initialised oneDNN)"
                row["onednn"] = row["onednn"] or p[0]["version"]
        rows.append(row)
    return rows


def report(rows, compiled_attention=None):
    """The report's "what each side ran" section. compiled_attention: {workload: kernel} of
    the wheel's compiled runs (from the timed runs' profiled step), shown as its own row."""
    if not rows:
        return []
    lines = ["## What each side ran", ""]
    w = lines.append
    w("From a one-step run of each side on each workload in bf16 (ampx O2, Python "
      "`torch.autocast`) with oneDNN's verbose mode (`ONEDNN_VERBOSE=1`): the ISA oneDNN "
      "dispatched for and the oneDNN primitives that ran with a bf16 tensor (reorders left "
      "out); the BLAS and the attention path from the programs' own reports (Python: the ops "
      "of one profiled step).")
    w("")
    w("| side | LibTorch | fp32 BLAS | oneDNN, ISA | bf16 products | oneDNN bf16 kernels |")
    w("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        kernels = "; ".join(f"{wl}: {k}" for wl, k in r["onednn_bf16"].items())
        if r["failed"]:
            kernels += ("; " if kernels else "") + "probe failed on " + ", ".join(r["failed"])
        w(f"| {r['side']} | {r['libtorch']} | {r['fp32_blas']} | {r['onednn'] or '-'}, "
          f"{r['isa'] or 'ISA not reported'} | {r['bf16_products']} | {kernels} |")
    w("")
    if not any(r["attention"] for r in rows):
        return lines
    w("| side | gpt's attention | gpt-nn's attention |")
    w("| --- | --- | --- |")
    for r in rows:
        w(f"| {r['side']} | {r['attention'].get('gpt', '-')} | "
          f"{r['attention'].get('gpt-nn', '-')} |")
    if compiled_attention:
        w(f"| PyTorch's wheel, torch.compile'd | {compiled_attention.get('gpt', '-')} | "
          f"{compiled_attention.get('gpt-nn', '-')} |")
    w("")
    return lines
