#!/usr/bin/env python3
"""Trains one ampx-train workload in Python with PyTorch's own AMP, for comparing ampx with it.

The models are ampx-train's (ampx_models.py, checked against models.h by
parity_check.py), the data are the files ampx-train reads, batched as
workloads.cpp batches them (the same per-step generators: the same samples in
the same order, and from the same --seed the same initial weights), and the
optimizer is torch.optim.AdamW with ampx-train's hyper-parameters (betas
0.9/0.999, eps 1e-8, --weight-decay 0.01, one group, no clipping).

  --precision fp32           plain fp32 training (ampx-train --precision fp32)
  --precision autocast-bf16  torch.autocast(device, dtype=torch.bfloat16) around
                             forward + loss, backward outside, fp32 params, no
                             GradScaler (bf16 has fp32's range) (ampx-train O1)
  --precision autocast-fp16  the same in float16 with torch.amp.GradScaler
                             (--device cuda; ampx-train O1 --dtype fp16)

--device cuda runs on the GPU (the GPT's attention: PyTorch's fused causal
scaled_dot_product_attention, as ampx-train's on CUDA; --tf32 allows TF32 in
fp32 products and convolutions; --adamw-impl fused is Python's
AdamW(fused=True)); peak_bytes is torch.cuda.max_memory_allocated(). On the CPU
peak_bytes is the CPU allocator's peak of live bytes from the model's construction
through the first --memory-steps steps (default 2; the profiler's memory events,
torch_runtime.MemoryProbe: the allocations ampx-train's tracking allocator counts;
those steps are warm-up, never timed; Debian's torch 1.13 records no memory events:
None there); memory_method names which.

Each step is timed as trainer.cpp times ampx-train's: batch fetch, zero_grad,
forward, loss, backward, optimizer step and loss.item(). median_step_ms and
items_per_s are over the steps after --warmup (default: ampx-train's rule,
min(10, max(1, steps // 10))); train_loss is the mean of the last tenth of the
steps' losses, as in ampx-train's report.

--compile runs forward and loss through torch.compile (inductor; torch >= 2.0): the
backward is compiled with it (AOTAutograd), the optimizer step stays eager, as in
PyTorch's own tutorial. Compilation happens in the first step, which the timing
leaves out with the warm-up; compile_s reports it (the first step's time less the
median step's), graph_breaks what dynamo could not trace.

After the timed steps one more step runs under LibTorch's profiler (not timed,
not in the losses): attention names the kernel it called (nn.MultiheadAttention
calls the fused SDPA on torch 2.x), and --op-profile PATH writes its per-op table
(key_averages by self CPU time). runtime names the fp32 BLAS, oneDNN's version,
ATen's vector ISA and where bf16 products go (torch_runtime.py).

--linear torch (default) runs nn.Linear, what Python users write; --linear
libtorch runs the ops of LibTorch's C++ torch::nn::Linear (see ampx_models.py),
which makes the bf16 forward bit-identical to ampx-train's O1.
--adamw-impl default takes torch's own choice on CPU (the for-loop on 1.13, 2.6
and 2.15); fused is AdamW(fused=True) (torch >= 2.4 on the CPU; make bench runs
it beside the default on the wheel); the JSON records which one ran.
--adamw-impls prints the choices this torch runs on --device as a JSON list
(["default", "for-loop", "foreach"] on Debian's 1.13, "fused" too from 2.4) and
exits; an --adamw-impl it lacks is refused before training.

  LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu/openblas-openmp \\
  /usr/bin/python3 bench/python/torch_amp_bench.py --workload gpt --precision autocast-bf16 \\
      --threads 2 --steps 30 --json runs/python/gpt-bf16.json

JSON keys: tool, workload, precision, compiled, dtype, torch_version, python_version,
threads, batch_size, steps, warmup, timed_steps, seed, linear, optimizer {name,
impl, lr, betas, eps, weight_decay, zero_grad_set_to_none}, unit ("tokens" or
"samples", as ampx-train), items_per_step, median_step_ms, items_per_s (and the
same under tokens_per_s or samples_per_s), train_loss, wall_s, parameters,
ld_library_path, losses (every step), step_ms (every step), model (gpt: vocab,
block_size, layers, heads, d_model), attention (gpt workloads), attention_ops,
runtime {fp32_blas, onednn, aten_cpu_capability, bf16_matmuls}, op_self_ms
(the profiled step's 20 ops with the most self CPU time: [name, calls, ms]), compile
{backend, first_step_ms, compile_s, graph_breaks} (--compile only).
"""
import argparse
import gzip
import inspect
import json
import math
import os
import platform
import statistics
import sys
import time

import torch

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
from ampx_models import (GPT_DEFAULTS, GPT_WORKLOADS, LINEARS, WORKLOADS, attention_on, build_model,
                         cross_entropy)
from torch_runtime import (MEMORY_METHOD, MemoryProbe, attention_path, bf16_matmuls, profile_step,
                           runtime)

PRECISIONS = ("fp32", "autocast-bf16", "autocast-fp16")

# apps/ampx-train/cli/config.cpp defaults_of(): batch size and lr per workload.
DEFAULT_BATCH = {"gpt": 32, "gpt-nn": 32, "mnist-cnn": 128, "fashion-mlp": 256}
DEFAULT_LR = 1e-3
DEFAULT_STEPS = 200
DEFAULT_SEED = 1337
DEFAULT_WEIGHT_DECAY = 0.01  # ampx-train's --weight-decay; betas and eps are AdamW's defaults

MASK64 = (1 << 64) - 1


# ------------------------------------------------------------------ data (data.cpp)
def default_data_dir():
    """--data-dir's fallback, as resolve_data_dir(): $AMPX_DATA_DIR, $XDG_CACHE_HOME/ampx/data, ~/.cache/ampx/data."""
    if os.environ.get("AMPX_DATA_DIR"):
        return os.environ["AMPX_DATA_DIR"]
    if os.environ.get("XDG_CACHE_HOME"):
        return os.path.join(os.environ["XDG_CACHE_HOME"], "ampx", "data")
    return os.path.join(os.path.expanduser("~"), ".cache", "ampx", "data")


def read_bytes(path):
    """A file's bytes, gunzipped when it is gzip-compressed (as zlib's gzread reads both)."""
    if not os.path.isfile(path):
        sys.exit(f"torch_amp_bench: '{path}' not found; install the data with: "
                 f"scripts/install-data.sh {os.path.dirname(os.path.dirname(path))}")
    with open(path, "rb") as f:
        data = f.read()
    return gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data


def read_idx(path, magic, ndims):
    """An IDX file as a uint8 tensor of the dimensions its big-endian header gives."""
    data = read_bytes(path)
    header = 4 + 4 * ndims
    found = int.from_bytes(data[:4], "big")
    if found != magic:
        sys.exit(f"torch_amp_bench: '{path}': IDX magic 0x{found:08x}, expected 0x{magic:08x}")
    dims = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndims)]
    if len(data) != header + math.prod(dims):
        sys.exit(f"torch_amp_bench: '{path}' holds {len(data) - header} bytes, header says {math.prod(dims)}")
    return torch.frombuffer(bytearray(data[header:]), dtype=torch.uint8).reshape(dims)


def load_images(data_dir, workload):
    """(train images uint8 [N, 28, 28], train labels int64 [N]): MNIST plain, Fashion-MNIST gzipped."""
    sub, suffix = ("mnist", "") if workload == "mnist-cnn" else ("fashion-mnist", ".gz")
    path = lambda stem: os.path.join(data_dir, sub, f"{stem}-ubyte{suffix}")
    images = read_idx(path("train-images-idx3"), 0x00000803, 3)
    labels = read_idx(path("train-labels-idx1"), 0x00000801, 1).long()
    return images, labels


def load_text_split(data_dir, val_fraction=0.1):
    """(train ids int64, held-out ids int64, vocab size): Moby Dick by bytes, vocab = sorted
    distinct bytes, the first 90% for training, the rest held out (data.cpp's load_text)."""
    text = read_bytes(os.path.join(data_dir, "moby-dick", "data.txt"))
    byte_ids = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    vocab = torch.unique(byte_ids)  # sorted
    lut = torch.zeros(256, dtype=torch.long)
    lut[vocab] = torch.arange(vocab.numel())
    n = len(text)
    n_val = int(math.floor(n * val_fraction + 0.5))  # std::llround: halves away from zero
    ids = lut[byte_ids]
    return ids[: n - n_val], ids[n - n_val:], vocab.numel()


def load_text(data_dir, val_fraction=0.1):
    """(train ids int64, vocab size): load_text_split's training split."""
    train, _, vocab = load_text_split(data_dir, val_fraction)
    return train, vocab


def generator_for(seed, stream, index):
    """workloads.cpp's generator_for: a CPU generator per (seed, stream, index), splitmix64-mixed."""
    x = ((seed * 0x9E3779B97F4A7C15) & MASK64) ^ (((stream + 1) * 0xBF58476D1CE4E5B9) & MASK64) \
        ^ (((index + 1) * 0x94D049BB133111EB) & MASK64)
    x ^= x >> 31
    x = (x * 0xD6E8FEB86763A9D5) & MASK64
    x ^= x >> 29
    g = torch.Generator()
    g.manual_seed(x)
    return g


class GptBatches:
    """B windows of T + 1 characters at random offsets of the training split, step by step."""

    unit = "tokens"

    def __init__(self, train, batch, block, seed):
        if train.numel() <= block + 1:
            sys.exit(f"torch_amp_bench: the text is too short for --block-size {block}")
        self.train, self.batch, self.block, self.seed = train, batch, block, seed
        self.items_per_step = batch * block

    def __call__(self, step):
        gen = generator_for(self.seed, 0, step)
        T = self.block
        starts = torch.randint(self.train.numel() - T - 1, (self.batch, 1), generator=gen, dtype=torch.long)
        windows = self.train[starts + torch.arange(T + 1)]  # [B, T + 1]
        return windows[:, :T], windows[:, 1:]


class ImageBatches:
    """Pixels in [0, 1] standardised by the training split; a permutation per epoch, last partial batch dropped."""

    unit = "samples"

    def __init__(self, images, labels, batch, seed, workload):
        x = images.float().div_(255)
        mean, std = x.mean().item(), x.std().item()
        self.x, self.y = x.sub_(mean).div_(std), labels
        if self.x.size(0) < batch:
            sys.exit(f"torch_amp_bench: --batch-size {batch} is larger than the training split")
        self.batch, self.seed, self.workload = batch, seed, workload
        self.steps_per_epoch = self.x.size(0) // batch
        self.items_per_step = batch
        self.perm, self.perm_epoch = None, -1

    def __call__(self, step):
        epoch, pos = divmod(step, self.steps_per_epoch)
        if epoch != self.perm_epoch:
            self.perm = torch.randperm(self.x.size(0), generator=generator_for(self.seed, 1, epoch), dtype=torch.long)
            self.perm_epoch = epoch
        idx = self.perm[pos * self.batch: (pos + 1) * self.batch]
        images = self.x.index_select(0, idx)
        images = images.unsqueeze(1) if self.workload == "mnist-cnn" else images.flatten(1)
        return images, self.y.index_select(0, idx)


def make_batches(args):
    """The workload's batch function (step -> (input, target)) and its vocab (gpt) or None."""
    if args.workload in GPT_WORKLOADS:
        train, vocab = load_text(args.data_dir)
        return GptBatches(train, args.batch_size, args.block_size, args.seed), vocab
    images, labels = load_images(args.data_dir, args.workload)
    return ImageBatches(images, labels, args.batch_size, args.seed, args.workload), None


# ------------------------------------------------------------------ training (trainer.cpp)
AUTOCAST_DTYPES = {"autocast-bf16": torch.bfloat16, "autocast-fp16": torch.float16}


def forward_loss(model, inputs, target, precision, device="cpu"):
    """One forward pass and its loss as the precision runs them: under
    torch.autocast(device, bfloat16 / float16) for autocast-* (output cast to
    fp32, as ampx-train's cast_model_outputs(kFloat) does), plainly for fp32.
    Returns (loss, output), both fp32."""
    dtype = AUTOCAST_DTYPES.get(precision, torch.bfloat16)
    with torch.autocast(device, dtype=dtype, enabled=precision in AUTOCAST_DTYPES):
        output = model(inputs).float()
        return cross_entropy(output, target), output


ADAMW_IMPLS = ("default", "for-loop", "foreach", "fused")


def adamw_kwargs(impl):
    """torch.optim.AdamW's arguments that pick the implementation `impl` (ADAMW_IMPLS)."""
    return {"default": {}, "for-loop": {"foreach": False}, "foreach": {"foreach": True},
            "fused": {"fused": True}}[impl]


def make_optimizer(model, lr, weight_decay=DEFAULT_WEIGHT_DECAY, impl="default"):
    """torch.optim.AdamW with ampx-train's settings; impl picks the implementation
    (default: whatever this torch picks) and is returned resolved."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=weight_decay, **adamw_kwargs(impl))
    return opt, resolved_adamw_impl(opt)


def adamw_impls(device="cpu"):
    """The ADAMW_IMPLS this torch runs on `device`: each that builds an AdamW and steps a
    tensor. fused: torch >= 2.4 on the CPU (2.0-2.3 refuse CPU tensors; 1.13's AdamW has no
    fused argument)."""
    found = ["default"]
    for impl in ADAMW_IMPLS[1:]:
        p = torch.zeros(4, device=device, requires_grad=True)
        p.grad = torch.ones_like(p)
        try:
            torch.optim.AdamW([p], lr=1e-3, **adamw_kwargs(impl)).step()
        except (TypeError, RuntimeError, ValueError):
            continue
        found.append(impl)
    return found


def resolved_adamw_impl(opt):
    """'fused', 'foreach' or 'for-loop': what opt.step() runs."""
    group = opt.param_groups[0]
    if group.get("fused"):
        return "fused"
    foreach = group.get("foreach")
    if foreach is None:  # the default: torch decides at step time
        try:  # torch 2.x
            from torch.optim.optimizer import _default_to_fused_or_foreach
            _, foreach = _default_to_fused_or_foreach(list(group["params"]), False, use_fused=False)
        except ImportError:  # torch 1.13: AdamW's default is the for-loop
            foreach = False
    return "foreach" if foreach else "for-loop"


def zero_grad_sets_none(opt):
    """Whether opt.zero_grad() frees the grads (the default since torch 2.0) or zeroes them (1.13)."""
    return bool(inspect.signature(opt.zero_grad).parameters["set_to_none"].default)


def default_warmup(steps):
    """trainer.cpp: min(10, max(1, steps / 10)) steps left out of the timing."""
    return min(10, max(1, steps // 10))


def make_grad_scaler(precision, device):
    """torch.amp.GradScaler for fp16 (torch 2.3+; torch.cuda.amp's before), None otherwise."""
    if precision != "autocast-fp16":
        return None
    if hasattr(torch, "amp") and hasattr(torch.amp, "GradScaler"):
        return torch.amp.GradScaler(device)
    return torch.cuda.amp.GradScaler()


def train(args):
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = args.tf32
        torch.backends.cudnn.allow_tf32 = args.tf32
    batches, vocab = make_batches(args)
    # CPU peak memory as ampx-train counts its own: from the model's construction on.
    probe = MemoryProbe(args.device == "cpu" and args.memory_steps > 0)
    torch.manual_seed(args.seed)  # as trainer.cpp before Workload::build
    model = build_model(args.workload, vocab=vocab or 0, block_size=args.block_size,
                        layers=args.layers, heads=args.heads, d_model=args.d_model, linear=args.linear)
    model.to(device).train()
    opt, impl = make_optimizer(model, args.lr, args.weight_decay, args.adamw_impl)
    scaler = make_grad_scaler(args.precision, args.device)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()

    step_fn = make_forward_loss(model, args.precision, args.device, args.compile)

    def one_step(step):
        """One training step on batch `step`, as trainer.cpp's; returns the loss's value."""
        inputs, target = batches(step)
        inputs, target = inputs.to(device, non_blocking=True), target.to(device, non_blocking=True)
        opt.zero_grad()
        loss, _ = step_fn(inputs, target)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        return loss.item()

    losses, step_ms = [], []
    run_start = time.perf_counter()
    probe.steps_begin()
    for step in range(args.steps):
        if step == args.memory_steps:
            probe.stop()  # the steps it profiled are warm-up steps
        t0 = time.perf_counter()
        loss_value = one_step(step)
        step_ms.append((time.perf_counter() - t0) * 1000.0)
        losses.append(loss_value)
        if args.log_every and ((step + 1) % args.log_every == 0 or step + 1 == args.steps):
            print(f"[{args.precision}] step {step + 1}/{args.steps}  loss {loss_value:.4f}  "
                  f"{step_ms[-1]:.1f} ms", flush=True)
    wall_s = time.perf_counter() - run_start
    probe.stop()
    cpu_peak, _ = probe.peaks()
    # One more step, profiled: which kernels ran (not timed, not in the losses).
    op_names, op_table, op_self_ms = profile_step(lambda: one_step(args.steps))
    if args.op_profile:
        os.makedirs(os.path.dirname(os.path.abspath(args.op_profile)), exist_ok=True)
        with open(args.op_profile, "w") as f:
            f.write(f"torch_amp_bench {args.workload} {args.precision}"
                    f"{' compiled' if args.compile else ''}, torch {torch.__version__}, "
                    f"{args.threads} threads: one training step (batch {args.steps}, after the timed ones)\n{op_table}\n")

    warm = args.warmup
    timed = step_ms[warm:]
    tail = max(1, len(losses) // 10)
    result = {
        "tool": "bench/python/torch_amp_bench.py",
        "workload": args.workload,
        "precision": args.precision,
        "compiled": args.compile,
        "dtype": {"autocast-bf16": "bf16", "autocast-fp16": "fp16"}.get(args.precision, "fp32"),
        "device": args.device,
        "tf32": bool(args.tf32 and args.device == "cuda"),
        "grad_scaler": scaler is not None,
        "peak_bytes": torch.cuda.max_memory_allocated() if args.device == "cuda" else cpu_peak or None,
        "memory_method": ("torch.cuda.max_memory_allocated()" if args.device == "cuda" else
                          MEMORY_METHOD if cpu_peak else None),
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "threads": torch.get_num_threads(),
        "batch_size": args.batch_size,
        "steps": args.steps,
        "warmup": warm,
        "timed_steps": len(timed),
        "seed": args.seed,
        "linear": args.linear,
        "optimizer": {"name": "torch.optim.AdamW", "impl": impl, "lr": args.lr, "betas": [0.9, 0.999],
                      "eps": 1e-8, "weight_decay": args.weight_decay,
                      "zero_grad_set_to_none": zero_grad_sets_none(opt)},
        "unit": batches.unit,
        "items_per_step": batches.items_per_step,
        "median_step_ms": statistics.median(timed) if timed else None,
        "items_per_s": batches.items_per_step * 1000.0 * len(timed) / sum(timed) if timed else None,
        "train_loss": sum(losses[-tail:]) / tail,
        "wall_s": wall_s,
        "parameters": sum(p.numel() for p in model.parameters()),
        "ld_library_path": os.environ.get("LD_LIBRARY_PATH", ""),
        "losses": losses,
        "step_ms": step_ms,
    }
    result[batches.unit + "_per_s"] = result["items_per_s"]
    if args.workload in GPT_WORKLOADS:
        result["model"] = {"vocab": vocab, "block_size": args.block_size, "layers": args.layers,
                           "heads": args.heads, "d_model": args.d_model}
        result["attention"] = attention_on(args.device, args.workload)
        result["attention_kernel"] = attention_path(op_names, args.compile)
    result["attention_ops"] = sorted(n for n in op_names if "attention" in n or "bmm" in n
                                     or ("softmax" in n and "log_softmax" not in n))
    result["runtime"] = runtime()
    result["op_self_ms"] = op_self_ms[:20]  # the profiled step's ops, most self time first
    if args.precision == "autocast-bf16" and args.device == "cpu":
        result["matmuls"] = result["runtime"]["bf16_matmuls"]
    if args.compile:
        median = result["median_step_ms"]
        result["compile"] = {
            "backend": "inductor", "scope": "forward and loss (backward via AOTAutograd); "
                                            "the optimizer step eager",
            "first_step_ms": step_ms[0],
            "compile_s": (step_ms[0] - median) / 1000.0 if median is not None else None,
            "graph_breaks": graph_breaks()}
    return result


def make_forward_loss(model, precision, device, compile_):
    """forward_loss for this model and precision as a function of (inputs, target), through
    torch.compile (inductor, default mode) when compile_ is set."""
    def fn(inputs, target):
        return forward_loss(model, inputs, target, precision, device)
    return torch.compile(fn) if compile_ else fn


def graph_breaks():
    """How often dynamo broke the compiled graph (its counters), or None if unknown."""
    try:
        from torch._dynamo.utils import counters
        return sum(counters["graph_break"].values())
    except (ImportError, KeyError, AttributeError):
        return None


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Train an ampx-train workload with PyTorch (fp32 or torch.autocast bf16) "
                    "and report ampx-train's timing numbers as JSON.")
    p.add_argument("--workload", choices=WORKLOADS, default="gpt")
    p.add_argument("--precision", choices=PRECISIONS, default="autocast-bf16")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile forward and loss (inductor; torch >= 2.0); compile time "
                        "is excluded from the step timing and reported")
    p.add_argument("--op-profile", default=None,
                   help="write the per-op table of one profiled extra step to this file")
    p.add_argument("--tf32", action="store_true", help="cuda: TF32 in fp32 products and convolutions")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="intra-op threads (torch.set_num_threads) [default: all cores]")
    p.add_argument("--batch-size", type=int, default=None,
                   help="samples (gpt: sequences) per step [default: gpt 32, mnist-cnn 128, fashion-mlp 256]")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="optimizer steps")
    p.add_argument("--warmup", type=int, default=None,
                   help="steps left out of the timing [default: ampx-train's min(10, max(1, steps/10))]")
    p.add_argument("--memory-steps", type=int, default=2,
                   help="CPU: steps measured for peak memory with the profiler (left out of the "
                        "timing; 0: no memory measured)")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="seed of the weights and the data order")
    p.add_argument("--lr", type=float, default=DEFAULT_LR, help="AdamW learning rate")
    p.add_argument("--weight-decay", type=float, default=DEFAULT_WEIGHT_DECAY,
                   help="AdamW decoupled weight decay")
    p.add_argument("--adamw-impl", choices=ADAMW_IMPLS, default="default",
                   help="AdamW implementation [default: what this torch picks on CPU]; fused: "
                        "AdamW(fused=True), torch >= 2.4 on the CPU")
    p.add_argument("--adamw-impls", action="store_true",
                   help="print the --adamw-impl choices this torch runs on --device (a JSON "
                        "list) and exit")
    p.add_argument("--linear", choices=LINEARS, default="torch",
                   help="torch: nn.Linear (aten::linear, what Python users run); libtorch: the ops "
                        "LibTorch's C++ torch::nn::Linear runs (matmul + in-place bias add on 3-D inputs)")
    p.add_argument("--data-dir", default=None,
                   help="datasets folder [default: $AMPX_DATA_DIR, else ~/.cache/ampx/data]")
    p.add_argument("--json", default=None, help="write the result as JSON to this file")
    p.add_argument("--log-every", type=int, default=0, help="print the loss every N steps (0: never)")
    # gpt model shape, ampx-train's flags and defaults (apps/ampx-train/cli/config.cpp)
    p.add_argument("--block-size", type=int, default=GPT_DEFAULTS["block_size"], help="gpt: context length")
    p.add_argument("--layers", type=int, default=GPT_DEFAULTS["layers"], help="gpt: transformer blocks")
    p.add_argument("--d-model", type=int, default=GPT_DEFAULTS["d_model"], help="gpt: width")
    p.add_argument("--heads", type=int, default=GPT_DEFAULTS["heads"], help="gpt: attention heads")
    args = p.parse_args(argv)
    if args.batch_size is None:
        args.batch_size = DEFAULT_BATCH[args.workload]
    if args.data_dir is None:
        args.data_dir = default_data_dir()
    for name in ("threads", "batch_size", "steps", "lr", "block_size", "layers", "d_model", "heads"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.weight_decay < 0:
        p.error(f"--weight-decay must be >= 0, got {args.weight_decay}")
    if args.warmup is not None and not 0 <= args.warmup < args.steps:
        p.error(f"--warmup must be in [0, --steps), got {args.warmup}")
    if args.memory_steps < 0:
        p.error(f"--memory-steps must be >= 0, got {args.memory_steps}")
    if args.warmup is None:  # the profiled steps are never timed
        args.warmup = max(default_warmup(args.steps),
                          args.memory_steps if args.device == "cpu" else 0)
        args.warmup = min(args.warmup, args.steps - 1)
    if args.workload in GPT_WORKLOADS and args.d_model % args.heads:
        p.error(f"--d-model {args.d_model} is not a multiple of --heads {args.heads}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error(f"--device cuda, but this torch ({torch.__version__}) sees no CUDA device")
    if args.compile and not hasattr(torch, "compile"):
        p.error(f"--compile needs torch.compile (torch >= 2.0); this is torch {torch.__version__}")
    if args.compile and args.warmup == 0:
        p.error("--compile compiles in the first step: --warmup must be >= 1")
    if args.adamw_impl != "default" and not args.adamw_impls \
            and args.adamw_impl not in adamw_impls(args.device):
        p.error(f"--adamw-impl {args.adamw_impl}: this torch ({torch.__version__}) has no such "
                f"AdamW on {args.device} (fused on the CPU: torch >= 2.4)")
    if args.tf32 and args.device != "cuda":
        p.error("--tf32 is for --device cuda")
    if args.precision == "autocast-fp16" and args.device != "cuda" and not torch.__version__.startswith("2."):
        p.error(f"--precision autocast-fp16 on the CPU needs torch 2.x; this is {torch.__version__}")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.adamw_impls:
        print(json.dumps(adamw_impls(args.device)))
        return
    settings = [("workload", args.workload),
                ("precision", args.precision + (", torch.compile (inductor)" if args.compile else "")),
                ("threads", args.threads),
                ("batch size", args.batch_size), ("steps", args.steps), ("lr (AdamW)", args.lr),
                ("seed", args.seed), ("data", args.data_dir), ("torch", torch.__version__)]
    if args.workload in GPT_WORKLOADS:
        settings.insert(5, ("model", f"{args.layers} layers, d {args.d_model}, {args.heads} heads, "
                                     f"block {args.block_size}"))
        settings.insert(6, ("attention", attention_on(args.device, args.workload)))
    settings.insert(2, ("device", args.device))
    if args.precision == "autocast-bf16" and args.device == "cpu":
        settings.append(("bf16 matmuls", bf16_matmuls()))
    width = max(len(k) for k, _ in settings)
    print("torch_amp_bench\n" + "".join(f"  {k:<{width}}  {v}\n" for k, v in settings), flush=True)
    r = train(args)
    if r["timed_steps"]:
        print(f"[{r['precision']}] done: {r['items_per_s']:.0f} {r['unit']}/s, median step "
              f"{r['median_step_ms']:.1f} ms, train loss {r['train_loss']:.4f} (AdamW {r['optimizer']['impl']})")
    else:
        print(f"[{r['precision']}] done: no step after warm-up was timed; train loss {r['train_loss']:.4f}")
    if r.get("compile"):
        c = r["compile"]
        print(f"[{r['precision']}] torch.compile: first step {c['first_step_ms']:.0f} ms"
              + (f", compile ~{c['compile_s']:.1f} s" if c["compile_s"] is not None else "")
              + f", graph breaks {c['graph_breaks']}")
    if r.get("attention_kernel"):
        print(f"[{r['precision']}] attention ran: {r['attention_kernel']}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
            f.write("\n")
        print(f"json: {args.json}")


if __name__ == "__main__":
    main()
