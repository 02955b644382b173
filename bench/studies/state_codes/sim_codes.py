"""ampx-train's gpt or mnist-cnn (its model, initial weights, batches and AdamW hyper-parameters)
in the wheel's torch, fp32 parameters under bf16 autocast, stepped by AdamW whose moments pass
through an 8-bit block code (codecs_8bit.py) after every step, as ampx's fused step stores them:
the update uses this step's fp32 moments, the decoded codes feed the next step.

    $(scripts/wheel-env.sh --python) bench/studies/state_codes/sim_codes.py \\
        --workload gpt --code linear --seed 1 --json runs/state-codes/gpt-linear-seed1.json

Coded: parameters of at least 4096 elements and a multiple of 256 (torchao's rule; ampx also
codes a short last block). Per step, over the coded parameters: elements whose update exceeds
3 lr (fp32 AdamW's |m_hat| / sqrt(v_hat) stays near 1-3) and the largest update in lr; stored
pairs with v decoded to 0 and m not. Every 100 steps, before the codes are written: what the code
does to this step's fp32 moments (nonzero m or v decoded to 0; sqrt(v)'s relative error; the
next update's error, |m_q / sqrt(v_q) - m / sqrt(v)|, in lr).
"""
import argparse
import json
import os
import sys
import time

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
sys.path.insert(0, HERE)
import torch
from ampx_models import GPT_DEFAULTS, build_model, cross_entropy
from codecs_8bit import CODES, maps, roundtrip
from low_bit_optim_convergence import PRECISION, evaluate
from torch_amp_bench import (DEFAULT_LR, DEFAULT_WEIGHT_DECAY, GptBatches, ImageBatches,
                             default_data_dir, forward_loss, load_images, load_text_split,
                             read_idx)

B1, B2, EPS = 0.9, 0.999, 1e-8


def gpt_setup(seed, data_dir):
    train, val, vocab = load_text_split(data_dir)
    batches = GptBatches(train, 32, GPT_DEFAULTS["block_size"], seed)
    torch.manual_seed(seed)
    model = build_model("gpt", vocab=vocab, **GPT_DEFAULTS).train()
    return model, batches, lambda: evaluate(model, val, 32, GPT_DEFAULTS["block_size"], 32)


def mnist_setup(seed, data_dir):
    images, labels = load_images(data_dir, "mnist-cnn")
    batches = ImageBatches(images, labels, 128, seed, "mnist-cnn")
    torch.manual_seed(seed)
    model = build_model("mnist-cnn").train()
    d = os.path.join(data_dir, "mnist")
    x = read_idx(os.path.join(d, "t10k-images-idx3-ubyte"), 0x803, 3).float().div_(255)
    train_x = images.float().div(255)
    x = x.sub_(train_x.mean().item()).div_(train_x.std().item()).unsqueeze(1)
    y = read_idx(os.path.join(d, "t10k-labels-idx1-ubyte"), 0x801, 1).long()

    @torch.no_grad()
    def test_loss():
        model.eval()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            total = sum(cross_entropy(model(x[i:i + 1000]).float(), y[i:i + 1000]).item() * 1000
                        for i in range(0, 10000, 1000))
        model.train()
        return total / 10000

    return model, batches, test_loss


def code_errors(m, v, m_q, v_q, bc2):
    """What the code did to one parameter's fresh moments (sums and samples for the report)."""
    nz_v, nz_m = v > 0, m != 0
    rel_sqrt = ((v_q.sqrt() - v.sqrt()).abs() / v.sqrt())[nz_v]
    u = m / ((v / bc2).sqrt() + EPS)
    u_q = m_q / ((v_q / bc2).sqrt() + EPS)
    return {"v_flushed": int((nz_v & (v_q == 0)).sum()), "v_nonzero": int(nz_v.sum()),
            "m_flushed": int((nz_m & (m_q == 0)).sum()), "m_nonzero": int(nz_m.sum()),
            "rel_sqrt_v": rel_sqrt, "update_error": (u_q - u).abs().reshape(-1)}


def summarize_errors(errors):
    cat = lambda k: torch.cat([e[k] for e in errors])
    q = lambda t, p: float(t.quantile(p)) if t.numel() <= 16_000_000 else float("nan")
    rel, du = cat("rel_sqrt_v"), cat("update_error")
    rel = rel[torch.randperm(rel.numel())[:4_000_000]] if rel.numel() > 4_000_000 else rel
    du = du[torch.randperm(du.numel())[:4_000_000]] if du.numel() > 4_000_000 else du
    total = lambda k: sum(e[k] for e in errors)
    return {"v_flushed_share": total("v_flushed") / max(1, total("v_nonzero")),
            "m_flushed_share": total("m_flushed") / max(1, total("m_nonzero")),
            "rel_sqrt_v_median": q(rel, 0.5), "rel_sqrt_v_p99": q(rel, 0.99),
            "update_error_median": q(du, 0.5), "update_error_p99": q(du, 0.99),
            "update_error_max": float(du.max())}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=("gpt", "mnist-cnn"), required=True)
    p.add_argument("--code", choices=("fp32",) + CODES, required=True)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--data-dir", default=default_data_dir())
    p.add_argument("--json", required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    setup = gpt_setup if a.workload == "gpt" else mnist_setup
    model, batches, test_loss = setup(a.seed, a.data_dir)
    params = list(model.parameters())
    coded = {id(q) for q in params if q.numel() >= 4096 and q.numel() % 256 == 0}
    state = {id(q): [torch.zeros_like(q), torch.zeros_like(q)] for q in params}
    signed, unsigned = maps(a.code) if a.code != "fp32" else (None, None)
    lr, wd = DEFAULT_LR, DEFAULT_WEIGHT_DECAY
    losses, big, max_update, flushed_pairs, probes = [], [], [], [], []
    start = time.time()
    for step in range(a.steps):
        inputs, target = batches(step)
        model.zero_grad(set_to_none=True)
        loss, _ = forward_loss(model, inputs, target, PRECISION)
        loss.backward()
        t = step + 1
        bc1, bc2 = 1 - B1 ** t, 1 - B2 ** t
        n_big, top, pairs, errors = 0, 0.0, 0, []
        with torch.no_grad():
            for q in params:
                m, v = state[id(q)]
                g = q.grad
                q.mul_(1 - lr * wd)
                m.mul_(B1).add_(g, alpha=1 - B1)
                v.mul_(B2).addcmul_(g, g, value=1 - B2)
                u = (m / bc1) / ((v / bc2).sqrt() + EPS)
                q.add_(u, alpha=-lr)
                if id(q) not in coded:
                    continue
                r = u.abs()
                n_big += int((r > 3).sum())
                top = max(top, float(r.max()))
                if signed is None:
                    continue
                m_q, v_q = roundtrip(m, signed), roundtrip(v, unsigned, a.code == "dynamic-floor")
                if t % 100 == 0 or t == 1:
                    errors.append(code_errors(m, v, m_q, v_q, bc2))
                m.copy_(m_q)
                v.copy_(v_q)
                pairs += int(((v == 0) & (m != 0)).sum())
        big.append(n_big)
        max_update.append(top)
        flushed_pairs.append(pairs)
        if errors:
            probes.append({"step": t, **summarize_errors(errors)})
        losses.append(loss.item())
        if t % 100 == 0:
            print(f"[{a.workload} {a.code} seed {a.seed}] step {t} loss {losses[-1]:.4f} "
                  f"({time.time() - start:.0f} s)", flush=True)
    result = {"workload": a.workload, "code": a.code, "seed": a.seed, "steps": a.steps,
              "torch_version": torch.__version__, "test_loss": test_loss(),
              "train_loss_0_199": sum(losses[:200]) / len(losses[:200]),
              "train_loss_last100": sum(losses[-100:]) / len(losses[-100:]),
              "wall_s": time.time() - start, "losses": losses, "big_updates": big,
              "max_update": max_update, "flushed_pairs": flushed_pairs, "probes": probes}
    os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump(result, f)
    print(f"[{a.workload} {a.code} seed {a.seed}] test loss {result['test_loss']:.4f}, "
          f"update > 3 lr: {sum(big)}, max {max(max_update):.3g} lr ({result['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
