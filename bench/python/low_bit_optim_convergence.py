#!/usr/bin/env python3
"""The anchor of ampx's low-bit optimizer state in training (issue 65, "against the anchor"):
ampx-train's gpt trained in the wheel's Python with torchao's AdamW8bit or AdamWFp8 (or torch's
AdamW, the Python side's own fp32-state reference), and its final test loss as ampx-train
evaluates it.

The model, its initial weights (from --seed), the batches and the hyper-parameters are
ampx-train's, through the machinery torch_amp_bench.py and fsdp2_bench.py share
(ampx_models.build_model after torch.manual_seed(seed), torch_amp_bench.GptBatches; lr 1e-3,
betas 0.9/0.999, eps 1e-8, weight decay 0.01 on every parameter, one group, no clipping).
Precision: fp32 parameters under torch.autocast("cpu", bfloat16) around forward and loss
(torch_amp_bench.forward_loss), the optimizer stepping the fp32 parameters: torchao's 8-bit or
FP8 moments (block 256; tensors under 4096 elements, or not a multiple of 256, keep fp32
moments), no stochastic rounding (the parameters are fp32). Its counterpart in ampx-train is
--precision O2 --masters fp32 --optimizer-state 8bit|fp8: bf16 weights whose products see the
same bf16 values, fp32 masters stepped by AdamW with the 8-bit / FP8 moments.

The test loss is ampx-train's evaluation of gpt (workloads.cpp GptWorkload::evaluate): the
first min((held-out chars - 1) / T, --eval-batches * B) consecutive non-overlapping windows of
T + 1 characters from the start of the held-out split (the last 10% of the text), in batches
of B, the mean cross-entropy over every position, in eval mode under the same autocast.

    ~/.cache/ampx/wheel-venv/bin/python bench/python/low_bit_optim_convergence.py \\
        --optimizer torchao-adamw8bit --steps 1000 --seed 1 --threads 1 \\
        --json runs/optim-convergence/anchor/torchao-adamw8bit-seed1.json

JSON keys: tool, optimizer, torch_version, torchao_version, precision, seed, steps,
batch_size, eval_batches, threads, model {vocab, block_size, layers, heads, d_model},
test_loss, train_loss (mean of the last tenth of the steps), losses (every step), wall_s.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
from ampx_models import GPT_DEFAULTS, build_model
from torch_amp_bench import (DEFAULT_LR, DEFAULT_WEIGHT_DECAY, GptBatches, default_data_dir,
                             forward_loss, load_text_split, make_optimizer)

PRECISION = "autocast-bf16"  # torch_amp_bench's: fp32 parameters, bf16 autocast
OPTIMIZERS = ("torchao-adamw8bit", "torchao-adamwfp8", "torch-adamw")


def make(name, model, lr, weight_decay):
    """The optimizer `name` over the model's parameters, ampx-train's hyper-parameters."""
    if name == "torch-adamw":
        return make_optimizer(model, lr, weight_decay, "fused")[0]
    from torchao.optim import AdamW8bit, AdamWFp8
    cls = AdamW8bit if name == "torchao-adamw8bit" else AdamWFp8
    return cls(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8,
               weight_decay=weight_decay, block_size=256, bf16_stochastic_round=False)


@torch.no_grad()
def evaluate(model, val, batch, block, eval_batches):
    """workloads.cpp's GptWorkload::evaluate: consecutive windows from the held-out split's start."""
    model.eval()
    windows = min((val.numel() - 1) // block, max(1, eval_batches) * batch)
    total, count = 0.0, 0
    for w0 in range(0, windows, batch):
        n = min(batch, windows - w0)
        starts = (torch.arange(w0, w0 + n) * block).unsqueeze(1)
        win = val[starts + torch.arange(block + 1)]
        loss, _ = forward_loss(model, win[:, :block], win[:, 1:], PRECISION)
        total += loss.item() * n * block
        count += n * block
    model.train()
    return total / count


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--optimizer", choices=OPTIMIZERS, required=True)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32, help="ampx-train's gpt default")
    p.add_argument("--eval-batches", type=int, default=32, help="ampx-train's gpt default")
    p.add_argument("--lr", type=float, default=DEFAULT_LR)
    p.add_argument("--weight-decay", type=float, default=DEFAULT_WEIGHT_DECAY)
    p.add_argument("--block-size", type=int, default=GPT_DEFAULTS["block_size"])
    p.add_argument("--layers", type=int, default=GPT_DEFAULTS["layers"])
    p.add_argument("--d-model", type=int, default=GPT_DEFAULTS["d_model"])
    p.add_argument("--heads", type=int, default=GPT_DEFAULTS["heads"])
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--data-dir", default=default_data_dir())
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    train, val, vocab = load_text_split(args.data_dir)
    batches = GptBatches(train, args.batch_size, args.block_size, args.seed)
    torch.manual_seed(args.seed)  # as trainer.cpp before Workload::build
    model = build_model("gpt", vocab=vocab, block_size=args.block_size, layers=args.layers,
                        heads=args.heads, d_model=args.d_model).train()
    opt = make(args.optimizer, model, args.lr, args.weight_decay)

    losses, start = [], time.perf_counter()
    for step in range(args.steps):
        inputs, target = batches(step)
        opt.zero_grad()
        loss, _ = forward_loss(model, inputs, target, PRECISION)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if args.log_every and (step + 1) % args.log_every == 0:
            print(f"[{args.optimizer}] step {step + 1}/{args.steps} loss {losses[-1]:.4f} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
    test_loss = evaluate(model, val, args.batch_size, args.block_size, args.eval_batches)
    wall = time.perf_counter() - start

    try:
        import torchao
        torchao_version = torchao.__version__
    except ImportError:
        torchao_version = None
    tail = losses[-max(1, len(losses) // 10):]
    result = {"tool": "bench/python/low_bit_optim_convergence.py", "optimizer": args.optimizer,
              "torch_version": torch.__version__, "torchao_version": torchao_version,
              "precision": PRECISION, "seed": args.seed, "steps": args.steps,
              "batch_size": args.batch_size, "eval_batches": args.eval_batches,
              "threads": args.threads,
              "model": {"vocab": vocab, "block_size": args.block_size, "layers": args.layers,
                        "heads": args.heads, "d_model": args.d_model},
              "test_loss": test_loss, "train_loss": statistics.fmean(tail), "losses": losses,
              "wall_s": wall}
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(f"[{args.optimizer}] seed {args.seed}, {args.steps} steps: test loss {test_loss:.4f}, "
          f"train loss {result['train_loss']:.4f} ({wall:.0f} s)")


if __name__ == "__main__":
    main()
