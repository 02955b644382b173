"""Reads ampx-train checkpoints (AMPXCKPT header + LibTorch archive) and measures the FP8 moments."""
import struct, sys, torch, warnings
sys.path.insert(0, __file__.rsplit('/', 1)[0])
from codecs_fp8 import *
warnings.filterwarnings("ignore")
torch.set_num_threads(1)
NAMES = {4: "conv2.weight", 8: "fc1.weight"}


def load(path):
    b = open(path, 'rb').read()
    ver, ml, pl, crc = struct.unpack('<IQQI', b[8:32])
    tmp = '/tmp/ckpt_%d.pt' % abs(hash(path))
    open(tmp, 'wb').write(b[32 + ml:32 + ml + pl])
    return {n: t for n, t in torch.jit.load(tmp).named_buffers()}


def decode(codes, scale, bs=256):
    t = e4m3_table()
    v = t[codes.reshape(-1).long()].view(-1, bs) * scale.view(-1, 1)
    return v.reshape(codes.shape)


fp8 = load(sys.argv[1])
f32 = load(sys.argv[2])
bc2 = 1 - 0.999 ** 1000
print("== ampx fp8 run, state after step 1000 (as stored) ==")
for i, name in NAMES.items():
    k = f"optimizer.group0.param{i}."
    mc, vc = fp8[k + "exp_avg"], fp8[k + "exp_avg_sq"]
    m, v = decode(mc, fp8[k + "exp_avg_scale"]), decode(vc, fp8[k + "exp_avg_sq_scale"])
    vzero = (vc == 0)
    vsub = ((vc & 0x78) == 0) & ~vzero  # E4M3 exponent field 0: subnormal
    mnz = (mc & 0x7F) != 0
    r = m.abs() / ((v / bc2).sqrt() + 1e-8)
    print(f"{name}: n={v.numel()} v==0 {vzero.float().mean():.2%}  v subnormal {vsub.float().mean():.2%}  "
          f"m!=0 & v==0 {(mnz & vzero).float().mean():.2%}  |m|/sqrt(v_hat)>1: {(r > 1).float().mean():.3%}  max {r.max():.3g}")
print("== ampx fp32 run, state after step 1000, passed through the codecs ==")
for i, name in NAMES.items():
    k = f"optimizer.group0.param{i}."
    m, v = f32[k + "exp_avg"], f32[k + "exp_avg_sq"]
    b, _ = blocks(v, 256)
    nzb = torch.where(b > 0, b, torch.full_like(b, float('inf')))
    rng = (b.amax(1) / nzb.amin(1)).log2()
    print(f"{name}: v==0 in fp32 {(v == 0).float().mean():.2%}; per-block log2(max/min nonzero v): "
          f"median {rng.median():.1f} p90 {rng.quantile(0.9):.1f} max {rng[rng.isfinite()].max():.1f} (E4M3 holds 17.8)")
    ratio0 = m.abs() / ((v / bc2).sqrt() + 1e-8)
    for label, fm, fv in [("e4m3 m,v (ampx/torchao)", fp8_roundtrip(m), fp8_roundtrip(v)),
                          ("e4m3 m, sqrt(v) in e4m3", fp8_roundtrip(m), sqrt_fp8_roundtrip(v)),
                          ("e4m3 m, v in e5m2", fp8_roundtrip(m), fp8_roundtrip(v, fmt=E5M2)),
                          ("e4m3 m,v block 32", fp8_roundtrip(m, 32), fp8_roundtrip(v, 32)),
                          ("e4m3 m, v nonzero floor", fp8_roundtrip(m), fp8_roundtrip_nonzero(v))]:
        flushed = ((fv == 0) & (v > 0)).float().mean()
        mflushed = ((fm == 0) & (m != 0)).float().mean()
        nz = v > 0
        rel = ((fv - v).abs() / v)[nz]
        rsq = ((fv.sqrt() - v.sqrt()).abs() / v.sqrt())[nz]
        ratio = fm.abs() / ((fv / bc2).sqrt() + 1e-8)
        print(f"   {label:26s} v->0 {flushed:.2%}  m->0 {mflushed:.2%}  |dv|/v median {rel.median():.3f} p99 {rel.quantile(0.99):.3f}; "
              f"|d sqrt v|/sqrt v p99 {rsq.quantile(0.99):.3f}; |m|/sqrt(v_hat)>1: {(ratio > 1).float().mean():.3%} (fp32 {(ratio0 > 1).float().mean():.3%}); "
              f"max ratio {ratio.max():.3g} (fp32 {ratio0.max():.3g})")
