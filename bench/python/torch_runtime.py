"""What the running torch computes with: its fp32 BLAS, its oneDNN, ATen's vector ISA, the
kernels its bf16 products reach, and the attention ops one profiled training step called.

torch_amp_bench.py records these beside its timings, so that a comparison names what each
side ran rather than assuming it. Works under Debian's torch 1.13 and the wheel's 2.x alike.

    blas = fp32_blas()                      # "MKL 2024.2 (in LibTorch)" / "OpenBLAS (openmp)"
    ops, table, top = profile_step(run_step)  # op names of one step, its table, top self times
    attention_path(ops, compiled=False)     # "SDPA: _scaled_dot_product_flash_attention_for_cpu"
    probe = MemoryProbe(True); ...; probe.steps_begin(); ...; probe.stop(); probe.peaks()
                                            # the CPU allocator's peak live bytes (MEMORY_METHOD)

The oneDNN ISA its products ran is not knowable from inside the process without
parsing oneDNN's verbose output; bench/kernel_probe.py runs a short step with
ONEDNN_VERBOSE=1 for that.
"""
import json
import os
import re
import tempfile

import torch


def _config():
    try:
        return torch.__config__.show()
    except Exception:  # noqa: BLE001 - a build without it: say so below
        return ""


def _mapped_libraries():
    try:
        with open("/proc/self/maps") as f:
            return {line.split()[-1] for line in f if "/" in line}
    except OSError:
        return set()


def fp32_blas():
    """The library this torch's fp32 matrix products call: MKL (the wheel links it into
    libtorch_cpu), or the shared BLAS the process mapped (Debian: OpenBLAS, one of its
    builds chosen by LD_LIBRARY_PATH)."""
    config = _config()
    info = re.search(r"BLAS_INFO=(\w+)", config)
    if info and info.group(1) == "mkl":
        version = re.search(r"Math Kernel Library Version ([\d.]+)", config)
        return "MKL" + (f" {version.group(1)}" if version else "") + " (in LibTorch)"
    libs = _mapped_libraries()
    for lib in sorted(libs):
        if "libopenblas" in lib:
            kind = ("openmp" if "openblas-openmp/" in lib else
                    "pthread" if "openblas-pthread/" in lib else None)
            return "OpenBLAS" + (f" ({kind})" if kind else "")
    for lib in sorted(libs):
        if re.search(r"/lib(blas|mkl_rt|blis)[^/]*\.so", lib):
            return lib.rsplit("/", 1)[-1]
    return "unknown (BLAS_INFO=" + (info.group(1) if info else "?") + ")"


def onednn_version():
    """oneDNN's version as torch.__config__ reports it ("v3.13.3"), or None."""
    m = re.search(r"MKL-DNN (v[\d.]+)", _config())
    return m.group(1) if m else None


def cpu_capability():
    """The ISA of ATen's own vectorized kernels (AVX2, AVX512, ...): torch 2.x says it."""
    try:
        return torch.backends.cpu.get_cpu_capability()
    except AttributeError:
        m = re.search(r"CPU capability usage: (\w+)", _config())
        return m.group(1) if m else None


def _cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def bf16_matmuls():
    """Where torch.autocast's bf16 matrix products go on this CPU: LibTorch hands them to
    oneDNN only where it deems the CPU able (torch 2.x asks oneDNN; 1.13 needs AVX-512 F,
    BW, VL, DQ) and runs its own loop elsewhere (ampx-train's settings name its own path)."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    try:
        native = bool(check()) if check is not None else None
    except (RuntimeError, AttributeError):
        native = None
    if native is None:  # torch 1.13: its own test, mkldnn_bf16_device_check
        native = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= _cpu_flags()
    return ("LibTorch's (oneDNN)" if native else
            "LibTorch's own loop (oneDNN bf16 not supported on this CPU)")


def runtime():
    """The fields above as one dict, for the JSON."""
    return {"fp32_blas": fp32_blas(), "onednn": onednn_version(),
            "aten_cpu_capability": cpu_capability(), "bf16_matmuls": bf16_matmuls()}


def profile_step(run_step, row_limit=60):
    """Runs run_step() once under LibTorch's profiler (CPU only). Returns the set of op
    names it recorded, the key_averages table by self CPU time (text) and the ops with the
    most self time as [name, calls, self ms] (the first row_limit)."""
    try:
        from torch.profiler import ProfilerActivity, profile
        ctx = profile(activities=[ProfilerActivity.CPU])
    except ImportError:  # torch 1.13 has torch.profiler too; older ones only this
        ctx = torch.autograd.profiler.profile()
    with ctx as prof:
        run_step()
    names = {e.name for e in prof.events()}
    averages = prof.key_averages()
    table = averages.table(sort_by="self_cpu_time_total", row_limit=row_limit)
    top = sorted(([a.key, a.count, a.self_cpu_time_total / 1000.0] for a in averages),
                 key=lambda r: -r[2])[:row_limit]
    return names, table, top


def attention_path(op_names, compiled=False):
    """The attention a step ran, from its profiled op names: LibTorch's fused SDPA kernel
    when one was called (nn.MultiheadAttention calls it on torch 2.x), else the explicit
    batched products and softmax (and whether the softmax was ATen's or inductor's)."""
    sdpa = sorted(n[len("aten::"):] for n in op_names
                  if n.startswith("aten::_scaled_dot_product_") and not n.endswith("_backward"))
    if sdpa:
        return "SDPA: " + ", ".join(sdpa)
    products = [p for p in ("baddbmm", "bmm") if f"aten::{p}" in op_names]
    if not products:
        return "no attention products seen"
    softmax = ("ATen's softmax" if "aten::_softmax" in op_names else
               "softmax in inductor's generated code" if compiled else "no softmax op seen")
    return f"explicit: {' / '.join(products)} products, {softmax}"


MEMORY_METHOD = ("peak of the CPU allocator's live bytes (PyTorch profiler, profile_memory=True) "
                 "from the model's construction on, less the bytes live before it")


class MemoryProbe:
    """PyTorch's memory profiler around the model's construction and the first
    steps; does nothing when `enabled` is false (--memory-steps 0)."""

    def __init__(self, enabled):
        self.profiler = self.steps = None
        self.stopped = False
        if enabled:
            from torch.profiler import ProfilerActivity, profile
            self.profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self.profiler.start()

    def steps_begin(self):
        if self.profiler:
            self.steps = torch.profiler.record_function("training steps")
            self.steps.__enter__()

    def stop(self):
        """Ends the measurement (once; later calls do nothing)."""
        if self.profiler and not self.stopped:
            if self.steps:
                self.steps.__exit__(None, None, None)
            self.profiler.stop()
            self.stopped = True

    def peaks(self):
        """(the largest "Total Allocated" of the memory events, the largest within
        the "training steps" range); None, None without the profiler."""
        if not self.profiler:
            return None, None
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            self.profiler.export_chrome_trace(path)
            with open(path) as f:
                trace = json.load(f)
        # torch 2.x writes {"traceEvents": [...]}, 1.13 the list alone
        events = trace["traceEvents"] if isinstance(trace, dict) else trace
        steps = [e for e in events if e.get("name") == "training steps" and e.get("ph") == "X"]
        memory = [(e["ts"], e["args"]["Total Allocated"]) for e in events
                  if e.get("name") == "[memory]" and "Total Allocated" in e.get("args", {})]
        in_steps = [t for ts, t in memory for r in steps if r["ts"] <= ts <= r["ts"] + r["dur"]]
        return max((t for _, t in memory), default=0), max(in_steps, default=0)
