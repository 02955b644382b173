"""Optimizer state between ampx's safetensors files and Python's optimizers.

ampx writes an optimizer's state with ampx::optim::save_optimizer_safetensors
(include/ampx/optim/state_file.h has the layout: per parameter name N,
N.step, N.exp_avg and N.exp_avg_sq as kept, 8-bit or FP8 codes with
N.<moment>.scale per block, N.master, N.compensation). This module, for
the Python of PyTorch's wheel (torch 2.x; torchao for its optimizers):

  from_torch(optimizer, named_parameters) -> (tensors, metadata)
      the state of torchao's AdamW8bit / AdamWFp8 or torch's AdamW in
      that layout: safetensors.torch.save_file(tensors, path, metadata)
      writes a file ampx::optim::load_optimizer_safetensors reads
  to_torch(optimizer, named_parameters, tensors, metadata)
      the file's state into such an optimizer: codes are kept where the
      optimizer keeps codes of the same format and block (torchao
      quantizes only parameters of at least 4096 elements, a whole number
      of blocks), otherwise decoded to float32 and given to it as values
      (torchao quantizes them again in its own format)
  moment(tensors, metadata, name, "exp_avg") -> float32 tensor
      a moment decoded
  masters(tensors) -> {name: float32 tensor}
      the fp32 masters of an O2 model's bf16/fp16 weights: its weights in
      full precision

  from safetensors.torch import load_file, safe_open
  with safe_open(path, "pt") as f: metadata = f.metadata()
  to_torch(opt, model.named_parameters(), load_file(path), metadata)

The 8-bit codes index bitsandbytes' dynamic map: a file carries ampx's
(ampx.map_signed, ampx.map_unsigned), within 2 float32 ulps of torchao's;
to_torch gives torchao its own map with the codes, as torchao would have
them. Masters and compensations are not optimizer state in torch: to_torch
leaves them in the file (masters() reads them).
"""

import torch

FORMAT = "ampx.optimizer_state"
FORMAT_VERSION = "1"
MOMENTS = ("exp_avg", "exp_avg_sq")


def _torchao():
    try:
        from torchao.optim.subclass_8bit import OptimState8bit
        from torchao.optim.subclass_fp8 import OptimStateFp8
    except ImportError:
        return None, None
    return OptimState8bit, OptimStateFp8


def _kind(optimizer):
    """(state_format, block) that `optimizer` keeps its quantized moments in."""
    name = type(optimizer).__name__
    if name in ("AdamW8bit", "Adam8bit"):
        return "8bit", optimizer.block_size
    if name in ("AdamWFp8", "AdamFp8"):
        return "fp8", optimizer.block_size
    if isinstance(optimizer, (torch.optim.AdamW, torch.optim.Adam)):
        return "fp32", 256
    raise TypeError("optim_state_torchao: %s is not torchao's AdamW8bit / AdamWFp8 or torch's "
                    "AdamW" % name)


def _optimizer_name(optimizer):
    return "AdamW"


def _names(named_parameters):
    return {id(p): n for n, p in named_parameters}


def from_torch(optimizer, named_parameters):
    """The state of `optimizer` as (tensors, metadata) in ampx's layout."""
    OptimState8bit, OptimStateFp8 = _torchao()
    state_format, block = _kind(optimizer)
    names = _names(named_parameters)
    tensors = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = optimizer.state.get(p)
            if not st:
                continue
            if id(p) not in names:
                raise KeyError("optim_state_torchao: a parameter of the optimizer is not in "
                               "named_parameters")
            n = names[id(p)]
            tensors[n + ".step"] = torch.tensor(int(st["step"]), dtype=torch.int64)
            for m in MOMENTS:
                v = st[m]
                if OptimState8bit is not None and isinstance(v, OptimState8bit):
                    tensors[n + "." + m] = v.codes.contiguous()
                    tensors[n + "." + m + ".scale"] = v.scale.float().contiguous()
                elif OptimStateFp8 is not None and isinstance(v, OptimStateFp8):
                    tensors[n + "." + m] = v.codes.view(torch.uint8).contiguous()
                    tensors[n + "." + m + ".scale"] = v.scale.float().contiguous()
                else:
                    tensors[n + "." + m] = v.detach().float().contiguous()
    if state_format == "8bit":
        from torchao.optim.subclass_8bit import get_qmap_signed, get_qmap_unsigned
        tensors["ampx.map_signed"] = torch.tensor(get_qmap_signed(), dtype=torch.float32)
        tensors["ampx.map_unsigned"] = torch.tensor(get_qmap_unsigned(), dtype=torch.float32)
    metadata = {"format": FORMAT, "format_version": FORMAT_VERSION,
                "optimizer": _optimizer_name(optimizer), "state_format": state_format,
                "state_block": str(block), "kahan_summation": "0"}
    return tensors, metadata


def _check(metadata):
    if metadata.get("format") != FORMAT:
        raise ValueError("optim_state_torchao: format %r is not %r" % (metadata.get("format"),
                                                                      FORMAT))
    if metadata.get("format_version") != FORMAT_VERSION:
        raise ValueError("optim_state_torchao: format_version %r is not supported (reads %s)"
                         % (metadata.get("format_version"), FORMAT_VERSION))


def moment(tensors, metadata, name, which):
    """Moment `which` ("exp_avg" or "exp_avg_sq") of parameter `name`, float32."""
    _check(metadata)
    t = tensors[name + "." + which]
    if t.dtype != torch.uint8:
        return t.float()
    scale = tensors[name + "." + which + ".scale"].float()
    block = int(metadata["state_block"])
    if metadata["state_format"] == "8bit":
        signed = which == "exp_avg"
        qmap = tensors["ampx.map_signed" if signed else "ampx.map_unsigned"].float()
        values = qmap[t.reshape(-1).long()]
    elif metadata["state_format"] == "fp8":
        values = t.reshape(-1).view(torch.float8_e4m3fn).float()
    else:
        raise ValueError("optim_state_torchao: %s.%s is codes of state_format %r"
                         % (name, which, metadata["state_format"]))
    per_element = scale.repeat_interleave(block)[: values.numel()]
    return (values * per_element).view(t.shape)


def masters(tensors):
    """{parameter name: fp32 master} of the file."""
    return {k[: -len(".master")]: v.float() for k, v in tensors.items() if k.endswith(".master")}


def to_torch(optimizer, named_parameters, tensors, metadata):
    """The file's state (tensors, metadata) into `optimizer`."""
    _check(metadata)
    if metadata.get("optimizer") != "AdamW":
        raise ValueError("optim_state_torchao: the state is of %s, not AdamW"
                         % metadata.get("optimizer"))
    OptimState8bit, OptimStateFp8 = _torchao()
    state_format, block = _kind(optimizer)
    file_format, file_block = metadata["state_format"], int(metadata["state_block"])
    by_name = dict(named_parameters)
    known = set(by_name)
    for key in tensors:
        if key.startswith("ampx.map_"):
            continue
        if not any(key.startswith(n + ".") for n in known):
            raise KeyError("optim_state_torchao: entry %r is of no parameter given" % key)
    for group in optimizer.param_groups:
        for p in group["params"]:
            n = next((k for k, v in by_name.items() if v is p), None)
            if n is None or n + ".step" not in tensors:
                continue
            st = optimizer.state[p]
            st.clear()
            st["step"] = torch.tensor(float(tensors[n + ".step"].item()))
            quantized = state_format != "fp32" and p.numel() >= 4096 and p.numel() % block == 0
            for m in MOMENTS:
                t = tensors[n + "." + m]
                same_codes = (t.dtype == torch.uint8 and file_format == state_format
                              and file_block == block)
                if quantized and same_codes and state_format == "8bit":
                    fresh = OptimState8bit.zeros(p.shape, m == "exp_avg", block, p.device)
                    st[m] = OptimState8bit(t.to(p.device).clone(), tensors[n + "." + m + ".scale"]
                                           .to(p.device).clone(), fresh.qmap, m == "exp_avg")
                elif quantized and same_codes and state_format == "fp8":
                    st[m] = OptimStateFp8(t.to(p.device).view(torch.float8_e4m3fn).clone(),
                                          tensors[n + "." + m + ".scale"].to(p.device).clone())
                elif quantized:
                    zeros = (OptimState8bit.zeros(p.shape, m == "exp_avg", block, p.device)
                             if state_format == "8bit"
                             else OptimStateFp8.zeros(p.shape, block, p.device))
                    zeros.copy_(moment(tensors, metadata, n, m).to(p.device))
                    st[m] = zeros
                else:
                    st[m] = moment(tensors, metadata, n, m).to(p.device).clone()
