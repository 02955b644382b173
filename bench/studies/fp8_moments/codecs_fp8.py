"""Block codecs of AdamW moments: ampx's --optimizer-state fp8 (= torchao OptimStateFp8) and candidates."""
import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2


def e4m3_table():
    return torch.arange(256, dtype=torch.uint8).view(E4M3).float()


def blocks(x, bs):
    n = x.numel()
    pad = (-n) % bs
    f = torch.cat([x.reshape(-1).float(), x.new_zeros(pad, dtype=torch.float32)])
    return f.view(-1, bs), n


def fp8_roundtrip(x, bs=256, fmt=E4M3):
    """ampx state_codes.h / torchao quantize_fp8: s = max(absmax,1e-12)/fmax, code = RNE(x/s)."""
    b, n = blocks(x, bs)
    fmax = torch.finfo(fmt).max
    s = b.abs().amax(1, keepdim=True).clamp_min(1e-12) / fmax
    q = (b / s).to(fmt).float() * s
    return q.reshape(-1)[:n].view_as(x)


def sqrt_fp8_roundtrip(v, bs=256, fmt=E4M3):
    """Second moment stored as sqrt(v) in FP8 (block scale on sqrt(v)); decoded squared."""
    return fp8_roundtrip(v.clamp_min(0).sqrt(), bs, fmt).square()


def fp8_roundtrip_sr(x, bs=256, gen=None):
    """E4M3 with stochastic rounding between the two neighbouring codes (unbiased)."""
    b, n = blocks(x, bs)
    s = b.abs().amax(1, keepdim=True).clamp_min(1e-12) / 448.0
    q = b / s
    lo = q.to(E4M3).float()
    # neighbour on the other side of q
    codes = q.to(E4M3).view(torch.uint8).to(torch.int16)
    up = torch.where((lo < q) ^ (q < 0), codes + 1, codes - 1).clamp(0, 255).to(torch.uint8)
    hi = up.view(E4M3).float()
    hi = torch.where(hi.isnan(), lo, hi)
    span = (hi - lo)
    p = torch.where(span != 0, (q - lo) / span, torch.zeros_like(q))
    r = torch.rand(q.shape, generator=gen)
    out = torch.where(r < p, hi, lo) * s
    return out.reshape(-1)[:n].view_as(x)


def fp8_roundtrip_nonzero(x, bs=256):
    """E4M3 as ampx/torchao, but a nonzero entry never decodes to zero: code 0 becomes the smallest
    subnormal (2^-9 times the block scale). For the unsigned second moment."""
    b, n = blocks(x, bs)
    s = b.abs().amax(1, keepdim=True).clamp_min(1e-12) / 448.0
    q = (b / s).to(E4M3).float()
    q = torch.where((q == 0) & (b != 0), torch.full_like(q, 2.0 ** -9), q) * s
    return q.reshape(-1)[:n].view_as(x)
