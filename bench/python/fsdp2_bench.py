#!/usr/bin/env python3
"""ampx-train's gpt trained by PyTorch's FSDP2 on the CPU: the anchor of `--shard full|grad`.

What a Python user writes for sharded mixed-precision training (PyTorch's own
recipe): `fully_shard` on each transformer block, then on the root, with
`MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`: fp32
sharded parameters, each unit all-gathered in bf16 for its forward and
backward, gradients reduce-scattered in fp32, `torch.optim.AdamW(fused=True)`
stepping the fp32 shards (DTensors). `--reshard-after-forward false` keeps the
gathered units from forward to backward (ZeRO-2, ampx's `--shard grad`);
true (the default) frees them (ZeRO-3, `--shard full`).

The model, its initial weights (from --seed), the batches and each rank's rows
are ampx-train's (ampx_models.py, torch_amp_bench.py: rank r trains rows
[r * B / N, (r + 1) * B / N) of each global batch of --batch-size), the
hyper-parameters too (lr 1e-3, betas 0.9/0.999, eps 1e-8, weight decay 0.01,
no clipping); the loss of a step is the mean of the ranks' losses.

Peak memory per rank, measured as ampx-train measures its own: the bytes of
live tensors allocated through c10's CPU allocator, from before the model is
built to the end of the profiled steps, less those live before (the dataset).
Here it is PyTorch's profiler with profile_memory=True, whose "[memory]"
events carry the CPU allocator's running total; ampx-train counts the same
allocations with its tracking allocator. The profiler covers the model's
construction and the first --memory-steps steps (the optimizer's state exists
from the first step on); the steps after it run without the profiler and
only those after --warmup are timed.

    LD_LIBRARY_PATH= $(scripts/wheel-env.sh --python) bench/python/fsdp2_bench.py \\
        --world 2 --layers 4 --d-model 768 --heads 12 --block-size 64 --batch-size 4 \\
        --steps 10 --threads 1 --json runs/fsdp2-2.json

JSON keys: tool, torch_version, world, threads, reshard_after_forward,
param_dtype, reduce_dtype, optimizer {name, impl, lr, betas, eps, weight_decay},
model {vocab, block_size, layers, heads, d_model}, parameters, batch_size,
steps, warmup, seed, losses (every step, mean over ranks), train_loss (mean of
the last tenth), median_step_ms (the slowest rank's median), rank_step_ms,
rank_peak_bytes, peak_bytes (the largest rank's), memory_method (these None with
--memory-steps 0),
rank_steps_peak_bytes (each rank's peak within the profiled steps alone: the
same count, construction left out), runtime.
"""
import argparse
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
from ampx_models import GPT_DEFAULTS, build_model, cross_entropy
from torch_amp_bench import (DEFAULT_LR, DEFAULT_SEED, DEFAULT_WEIGHT_DECAY, GptBatches,
                             default_data_dir, default_warmup, load_text, make_optimizer)
from torch_runtime import MEMORY_METHOD, MemoryProbe, runtime


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shard_model(model, reshard_after_forward):
    """FSDP2's recipe: each block a unit, then the root (embedding, positions, ln_f, head)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    return model


def rank_main(rank, args, port, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    torch.set_num_threads(args.threads)
    train, vocab = load_text(args.data_dir)
    batches = GptBatches(train, args.batch_size, args.block_size, args.seed)
    rows = args.batch_size // args.world

    probe = MemoryProbe(args.memory_steps > 0)
    torch.manual_seed(args.seed)  # as trainer.cpp before Workload::build
    model = build_model("gpt", vocab=vocab, block_size=args.block_size, layers=args.layers,
                        heads=args.heads, d_model=args.d_model)
    parameters = sum(p.numel() for p in model.parameters())
    shard_model(model, args.reshard_after_forward).train()
    opt, impl = make_optimizer(model, args.lr, args.weight_decay, "fused")

    losses, step_ms = [], []
    probe.steps_begin()
    for step in range(args.steps):
        if step == args.memory_steps:
            probe.stop()
        start = time.perf_counter()
        inputs, target = batches(step)
        inputs, target = inputs[rank * rows:(rank + 1) * rows], target[rank * rows:(rank + 1) * rows]
        opt.zero_grad()
        loss = cross_entropy(model(inputs).float(), target)
        loss.backward()
        opt.step()
        value = loss.detach().clone()
        step_ms.append((time.perf_counter() - start) * 1e3)
        dist.all_reduce(value)  # the report's mean over ranks, outside the timing
        losses.append(value.item() / args.world)
    probe.stop()
    peak, steps_peak = probe.peaks()

    median = statistics.median(step_ms[args.warmup:]) if args.steps > args.warmup else None
    gathered = [None] * args.world
    dist.all_gather_object(gathered, {"peak": peak, "steps_peak": steps_peak, "median": median})
    if rank == 0:
        tail = losses[-max(1, len(losses) // 10):]
        result = {
            "tool": "fsdp2_bench.py", "torch_version": torch.__version__, "world": args.world,
            "threads": args.threads, "reshard_after_forward": args.reshard_after_forward,
            "param_dtype": "bfloat16", "reduce_dtype": "float32",
            "optimizer": {"name": "AdamW", "impl": impl, "lr": args.lr, "betas": [0.9, 0.999],
                          "eps": 1e-8, "weight_decay": args.weight_decay},
            "model": {"vocab": vocab, "block_size": args.block_size, "layers": args.layers,
                      "heads": args.heads, "d_model": args.d_model},
            "parameters": parameters, "batch_size": args.batch_size, "steps": args.steps,
            "warmup": args.warmup, "seed": args.seed, "losses": losses,
            "train_loss": statistics.fmean(tail),
            "rank_step_ms": [g["median"] for g in gathered],
            "median_step_ms": max(g["median"] for g in gathered) if median is not None else None,
            "rank_peak_bytes": [g["peak"] for g in gathered] if peak is not None else None,
            "peak_bytes": max(g["peak"] for g in gathered) if peak is not None else None,
            "memory_method": MEMORY_METHOD if peak is not None else None,
            "rank_steps_peak_bytes": [g["steps_peak"] for g in gathered],
            "runtime": runtime(),
        }
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)
    dist.destroy_process_group()
    # torch 2.15's CPU FSDP2 aborts about one process exit in eight ("terminate called without
    # an active exception", after the group is destroyed and everything is written): leave
    # without running the C++ teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2, help="ranks (processes), Gloo on this machine")
    p.add_argument("--layers", type=int, default=GPT_DEFAULTS["layers"])
    p.add_argument("--d-model", type=int, default=GPT_DEFAULTS["d_model"])
    p.add_argument("--heads", type=int, default=GPT_DEFAULTS["heads"])
    p.add_argument("--block-size", type=int, default=GPT_DEFAULTS["block_size"])
    p.add_argument("--batch-size", type=int, default=4, help="the global batch, split among ranks")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=None, help="steps left out of the timing")
    p.add_argument("--memory-steps", type=int, default=2,
                   help="steps under the memory profiler (0: no profiler, no memory measured)")
    p.add_argument("--lr", type=float, default=DEFAULT_LR)
    p.add_argument("--weight-decay", type=float, default=DEFAULT_WEIGHT_DECAY)
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--reshard-after-forward", type=lambda s: s == "true", default=True,
                   metavar="true|false", help="free the gathered units after forward (ZeRO-3)")
    p.add_argument("--data-dir", default=default_data_dir())
    p.add_argument("--json", required=True, help="where rank 0 writes the result")
    args = p.parse_args(argv)
    if args.world < 1 or args.batch_size % args.world:
        p.error(f"--batch-size {args.batch_size} is not a multiple of --world {args.world}")
    if args.warmup is None:
        args.warmup = max(default_warmup(args.steps), args.memory_steps)
    return args


def fsdp2_missing():
    """Why this torch cannot run FSDP2 on the CPU ("" when it can)."""
    if not dist.is_available() or not dist.is_gloo_available():
        return f"torch {torch.__version__} has no Gloo process group"
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: F401
    except Exception as e:  # ImportError; 1.13's fsdp package fails on newer Pythons
        return (f"torch {torch.__version__} has no FSDP2 (torch.distributed.fsdp.fully_shard): "
                f"{type(e).__name__}: {e}")
    return ""


def main(argv=None):
    args = parse_args(argv)
    missing = fsdp2_missing()
    if missing:
        print(f"fsdp2_bench: {missing}")
        sys.exit(77)  # ctest's skip code: the tests that compare with FSDP2 skip
    out = os.path.abspath(args.json)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    mp.spawn(rank_main, args=(args, free_port(), out), nprocs=args.world)
    with open(out) as f:
        r = json.load(f)
    memory = ""
    if r["peak_bytes"] is not None:
        memory = (f", peak {[round(b / 2**20, 1) for b in r['rank_peak_bytes']]} MiB "
                  f"(in the steps {[round(b / 2**20, 1) for b in r['rank_steps_peak_bytes']]}), "
                  f"{r['peak_bytes'] / r['parameters']:.2f} bytes/param")
    print(f"fsdp2 world {r['world']} reshard_after_forward {r['reshard_after_forward']}: "
          f"loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}, median step "
          f"{r['median_step_ms']:.1f} ms" + memory)


if __name__ == "__main__":
    main()
