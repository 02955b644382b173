"""mnist-cnn (ampx-train's model, batches, hyper-parameters) in the wheel's torch with AdamW whose
moments pass through a block codec after every step, as ampx's tiled step does (the update uses the
fp32 moments of this step; the stored, decoded ones feed the next). Per-step diagnostics of the
coded params. Usage: sim_mnist.py --codec fp32|fp8|fp8-sqrtv|fp8-e5m2v|torchao-fp8 --seed S --json F"""
import argparse, json, os, sys, time
sys.dont_write_bytecode = True
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
from ampx_models import build_model, cross_entropy
from torch_amp_bench import ImageBatches, load_images, read_idx, default_data_dir, forward_loss
from codecs_fp8 import fp8_roundtrip, sqrt_fp8_roundtrip, fp8_roundtrip_nonzero, E5M2

p = argparse.ArgumentParser()
p.add_argument("--codec", required=True)
p.add_argument("--seed", type=int, default=1)
p.add_argument("--steps", type=int, default=1000)
p.add_argument("--json", required=True)
a = p.parse_args()
torch.set_num_threads(1)
PREC = "autocast-bf16"
LR, B1, B2, EPS, WD = 1e-3, 0.9, 0.999, 1e-8, 0.01

torch.manual_seed(a.seed)
model = build_model("mnist-cnn")
images, labels = load_images(default_data_dir(), "mnist-cnn")
batches = ImageBatches(images, labels, 128, a.seed, "mnist-cnn")
d = os.path.join(default_data_dir(), "mnist")
tx = read_idx(os.path.join(d, "t10k-images-idx3-ubyte"), 0x803, 3).float().div_(255)
mean, std = images.float().div(255).mean().item(), images.float().div(255).std().item()
tx = tx.sub_(mean).div_(std).unsqueeze(1)
ty = read_idx(os.path.join(d, "t10k-labels-idx1-ubyte"), 0x801, 1).long()
names = {id(q): n for n, q in model.named_parameters()}
coded = [q for q in model.parameters() if q.numel() >= 4096 and q.numel() % 256 == 0]

if a.codec == "torchao-fp8":
    torch.compile = lambda f, **kw: f  # torchao's single_param_adam, eagerly (no inductor build)
    from torchao.optim import AdamWFp8
    opt = AdamWFp8(model.parameters(), lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD, block_size=256)
else:
    enc_m = {"fp32": None, "fp8": fp8_roundtrip, "fp8-sqrtv": fp8_roundtrip, "fp8-e5m2v": fp8_roundtrip,
             "fp8-v-only": None, "fp8-m-only": fp8_roundtrip, "fp8-vfloor": fp8_roundtrip}[a.codec]
    enc_v = {"fp32": None, "fp8": fp8_roundtrip, "fp8-sqrtv": sqrt_fp8_roundtrip,
             "fp8-e5m2v": lambda v: fp8_roundtrip(v, fmt=E5M2), "fp8-v-only": fp8_roundtrip,
             "fp8-m-only": None, "fp8-vfloor": fp8_roundtrip_nonzero}[a.codec]
    state = {id(q): [torch.zeros_like(q), torch.zeros_like(q)] for q in model.parameters()}

diag = {names[id(q)]: {"pairs": [], "big": [], "maxr": []} for q in coded}


@torch.no_grad()
def adamw_step(t):
    bc1, bc2s = 1 - B1 ** t, (1 - B2 ** t) ** 0.5
    for q in model.parameters():
        m, v = state[id(q)]
        g = q.grad
        q.mul_(1 - LR * WD)
        m.mul_(B1).add_(g, alpha=1 - B1)
        v.mul_(B2).addcmul_(g, g, value=1 - B2)
        denom = v.sqrt() / bc2s + EPS
        u = (m / bc1) / denom
        q.add_(u, alpha=-LR)
        if q in coded_set:
            dg = diag[names[id(q)]]
            r = u.abs()
            dg["big"].append(int((r > 3).sum()))  # |update| > 3 lr (fp32 Adam: almost never)
            dg["maxr"].append(float(r.max()))
            if enc_m: m.copy_(enc_m(m))
            if enc_v: v.copy_(enc_v(v))
            dg["pairs"].append(int(((v == 0) & (m != 0)).sum()))  # stored v flushed, m kept


coded_set = set(coded)
losses = []
t0 = time.time()
model.train()
for step in range(a.steps):
    x, y = batches(step)
    model.zero_grad(set_to_none=True)
    loss, _ = forward_loss(model, x, y, PREC)
    loss.backward()
    if a.codec == "torchao-fp8":
        opt.step()
    else:
        adamw_step(step + 1)
    losses.append(loss.item())
    if step % 100 == 0:
        print(f"step {step} loss {loss.item():.4f} {time.time() - t0:.0f}s", flush=True)
model.eval()
with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
    tot, corr = 0.0, 0
    for i in range(0, 10000, 1000):
        o = model(tx[i:i + 1000]).float()
        tot += cross_entropy(o, ty[i:i + 1000]).item() * o.size(0)
        corr += int((o.argmax(1) == ty[i:i + 1000]).sum())
res = {"codec": a.codec, "seed": a.seed, "steps": a.steps, "test_loss": tot / 10000, "accuracy": corr / 100,
       "train_loss_last100": sum(losses[-100:]) / 100, "train_loss_0_199": sum(losses[:200]) / 200,
       "wall_s": time.time() - t0, "losses": losses, "diag": diag}
print({k: v for k, v in res.items() if k not in ("losses", "diag")})
for n, dg in diag.items():
    if dg["big"]:
        print(f"  {n}: steps with any |u|>3lr: {sum(1 for b in dg['big'] if b)}; total elems {sum(dg['big'])}; "
              f"max |u|/lr {max(dg['maxr']):.3g}; mean flushed pairs/step {sum(dg['pairs']) / len(dg['pairs']):.1f}")
json.dump(res, open(a.json, "w"))
