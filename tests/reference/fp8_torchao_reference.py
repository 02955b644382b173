#!/usr/bin/env python3
"""torchao's float8 training as the reference for ampx's FP8 Linear
(tests/fp8/fp8_torchao_test.cpp).

  fp8_torchao_reference.py generate OUT_DIR

Run by the leg's own interpreter (AMPX_PYTHON): the wheel leg's virtual
environment has torch 2.15 and torchao 0.18 (scripts/wheel-env.sh). Where
torchao, float8 dtypes or safetensors are missing (the Debian legs), the
script writes fp8_torchao.json saying why and nothing else, and exits 0:
the C++ tests skip with that reason (tests/skips/*.txt list them there).

The recipe is torchao's default, Float8LinearConfig() ("tensorwise"):
dynamic per-tensor scaling, input and weight E4M3, output gradient E5M2,
scale = fp8_max / amax: ampx's CurrentScaling with HYBRID. torchao 0.18
has no delayed scaling (ScalingType is DYNAMIC or DISABLED; it was deleted in
2025), so ampx's DelayedScaling has no torchao counterpart; the JSON lists
ScalingType's values so that the C++ test notices if one comes back. A
second case turns on round_scales_to_power_of_2 (ampx's power_2_scale).
Products are emulated in float32 on the CPU (config.emulate = True,
torchao/float8/float8_ops.py: torch.mm(codes.float() / scale, ...)).

Files, in OUT_DIR:
  fp8_torchao.json          torch and torchao versions, the threads the
                            products ran on, shapes, the optimizer's settings
                            and torchao's ScalingType values; or
                            {"torchao": null, "reason": ...}
  fp8_torchao.safetensors   every tensor below, all from a seeded generator:
    layer.x, layer.weight, layer.bias, layer.grad_output   [4, 12, 64], [32, 64], [32], [4, 12, 32]
    <case>.<role>.codes     uint8 FP8 bytes that Float8Linear multiplied
                            (role input [48, 64] E4M3, weight [32, 64] E4M3,
                            grad_output [48, 32] E5M2), recorded from inside
                            its forward and backward
    <case>.<role>.scale     float32 []: torchao's scale, what the tensor was
                            multiplied by before the cast (ampx: the scale,
                            not scale_inv)
    <case>.output, .grad_input, .grad_weight, .grad_bias   float32
    scales.amax             float32 [n]: amaxes (random and edge values)
    scales.<fmt>[_pow2]     torchao's amax_to_scale of each, fmt e4m3 / e5m2
    train.x, train.y        [steps, 32, 32] / [steps, 32, 8]: one batch a step
    train.init.<param>      the initial weights of an MLP 32 -> 64 -> 64 -> 8
                            (fc1, fc2, fc3; ReLU between), nn.Linear's init
    train.<case>.loss       float32 [steps]: MSE loss of each step, before its
                            SGD update (lr 0.1, momentum 0.9)
    train.<case>.<param>    the weights after the last step
  <case>: tensorwise (Float8LinearConfig(emulate=True)) or pow2 (the same with
  round_scales_to_power_of_2=True).
"""
import contextlib
import json
import math
import os
import struct
import sys

import torch

import torchao_available

SEED = 39
THREADS = 2  # the C++ test runs its products on as many
STEPS = 16
LR = 0.1
MOMENTUM = 0.9
MLP = (("fc1", 32, 64), ("fc2", 64, 64), ("fc3", 64, 8))
FLT_MAX = struct.unpack("<f", struct.pack("<I", 0x7F7FFFFF))[0]


def unavailable():
    """Why this interpreter cannot give the reference, or None."""
    return torchao_available.why_not("torchao.float8", ["float8_e4m3fn"], "float8")


@contextlib.contextmanager
def recorded_casts(calls):
    """Records every cast Float8Linear makes (role, Float8TrainingTensor): the
    codes and scales it multiplies, taken from inside its autograd function."""
    import torchao.float8.float8_linear as float8_linear
    original = float8_linear.hp_tensor_to_float8_dynamic

    def recording(hp_tensor, float8_dtype, linear_mm_config, **kwargs):
        t = original(hp_tensor, float8_dtype, linear_mm_config, **kwargs)
        calls.append((kwargs["gemm_input_role"].value, t))
        return t

    float8_linear.hp_tensor_to_float8_dynamic = recording
    try:
        yield
    finally:
        float8_linear.hp_tensor_to_float8_dynamic = original


def configs():
    from torchao.float8.config import Float8LinearConfig
    return {"tensorwise": Float8LinearConfig(emulate=True),
            "pow2": Float8LinearConfig(emulate=True, round_scales_to_power_of_2=True)}


def float8_linear(weight, bias, config):
    from torchao.float8.float8_linear import Float8Linear
    out_features, in_features = weight.shape
    plain = torch.nn.Linear(in_features, out_features)
    with torch.no_grad():
        plain.weight.copy_(weight)
        plain.bias.copy_(bias)
    return Float8Linear.from_float(plain, config=config)


def layer_case(name, config, x, weight, bias, grad_output):
    """One forward and backward of a Float8Linear: its casts, output and gradients."""
    layer = float8_linear(weight, bias, config)
    xr = x.clone().requires_grad_(True)
    calls = []
    with recorded_casts(calls):
        y = layer(xr)
        y.backward(grad_output)
    # Forward casts input and weight^T, backward grad_output and weight^T
    # (for grad_input), then grad_output and input (for grad_weight): with
    # tensorwise scaling each role's casts are the same bytes.
    roles = {}
    for role, t in calls:
        data = t._data
        if role == "weight":
            data = data.t()  # Float8Linear casts weight.t(): back to [out, in]
        codes = data.reshape(-1, data.shape[-1]).contiguous().view(torch.uint8)
        scale = t._scale.reshape(()).to(torch.float32)
        if role in roles:
            assert torch.equal(roles[role][0], codes) and torch.equal(roles[role][1], scale), \
                "torchao cast %s twice with different results" % role
        roles[role] = (codes, scale)
    assert sorted(roles) == ["grad_output", "input", "weight"], sorted(roles)
    out = {}
    for role, (codes, scale) in roles.items():
        out["%s.%s.codes" % (name, role)] = codes
        out["%s.%s.scale" % (name, role)] = scale
    out[name + ".output"] = y.detach()
    out[name + ".grad_input"] = xr.grad
    out[name + ".grad_weight"] = layer.weight.grad
    out[name + ".grad_bias"] = layer.bias.grad
    return out


def scale_table():
    """torchao's amax_to_scale over random amaxes and the edges where it and
    TE's rule (ampx) part: below its EPS 1e-12, zero, inf, NaN, and a scale a
    float32 ulp below a power of two (64 - 2^-18 for E4M3, 8192 - 2^-10 for
    E5M2, from amax 7 + 2^-21), where log2 rounds up to the integer."""
    from torchao.float8.float8_utils import amax_to_scale
    g = torch.Generator().manual_seed(SEED + 1)
    exponents = torch.empty(400).uniform_(-40.0, 40.0, generator=g)
    amaxes = torch.pow(10.0, exponents.to(torch.float64)).to(torch.float32).tolist()
    amaxes += [0.0, 1e-45, 1e-38, 1e-20, 1e-13, 9.99e-13, 1e-12, 1.0000001e-12, 2e-12,
               1.0, 448.0, 57344.0, 7.0 + 2.0**-21, 3e38, FLT_MAX, math.inf, math.nan]
    amax = torch.tensor(amaxes, dtype=torch.float32)
    out = {"scales.amax": amax}
    for fmt, dtype in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
        out["scales." + fmt] = torch.stack(
            [amax_to_scale(a, dtype).reshape(()) for a in amax])
        out["scales.%s_pow2" % fmt] = torch.stack(
            [amax_to_scale(a, dtype, round_scales_to_power_of_2=True).reshape(()) for a in amax])
    return out


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        for name, fan_in, fan_out in MLP:
            setattr(self, name, torch.nn.Linear(fan_in, fan_out))

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def train(name, config, init, xs, ys):
    """STEPS steps of SGD on an MLP whose layers are Float8Linear."""
    from torchao.float8.float8_linear import Float8Linear
    model = Mlp()
    model.load_state_dict(init)
    for layer, _, _ in MLP:
        setattr(model, layer, Float8Linear.from_float(getattr(model, layer), config=config))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses = []
    for x, y in zip(xs, ys):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    out = {"train.%s.loss" % name: torch.stack(losses)}
    for key, value in model.state_dict().items():
        out["train.%s.%s" % (name, key)] = value.detach().clone()
    return out


def reference():
    g = torch.Generator().manual_seed(SEED)
    torch.manual_seed(SEED)
    tensors = {}
    # One layer: activations with an outlier (its amax sets the scale),
    # nn.Linear's weights, gradients of a loss's size (E5M2 subnormals too).
    x = torch.randn(4, 12, 64, generator=g) * 2.0
    x[1, 5, 17] = -37.25
    plain = torch.nn.Linear(64, 32)
    weight, bias = plain.weight.detach().clone(), plain.bias.detach().clone()
    grad_output = torch.randn(4, 12, 32, generator=g) * 1e-3
    tensors.update({"layer.x": x, "layer.weight": weight, "layer.bias": bias,
                    "layer.grad_output": grad_output})
    for name, config in configs().items():
        tensors.update(layer_case(name, config, x, weight, bias, grad_output))
    tensors.update(scale_table())
    # Training: a regression target the MLP can fit, one fresh batch a step.
    xs = torch.randn(STEPS, 32, 32, generator=g)
    proj = torch.randn(32, 8, generator=g) / math.sqrt(32.0)
    ys = torch.sin(2.0 * xs @ proj)
    init = Mlp().state_dict()
    tensors.update({"train.x": xs, "train.y": ys})
    tensors.update({"train.init." + k: v.clone() for k, v in init.items()})
    for name, config in configs().items():
        tensors.update(train(name, config, init, xs, ys))
    return tensors


def main():
    if len(sys.argv) != 3 or sys.argv[1] != "generate":
        sys.exit(__doc__)
    out = sys.argv[2]
    os.makedirs(out, exist_ok=True)
    manifest = os.path.join(out, "fp8_torchao.json")
    tensors_path = os.path.join(out, "fp8_torchao.safetensors")
    reason = unavailable()
    if reason is not None:
        if os.path.exists(tensors_path):
            os.remove(tensors_path)  # a stale file must not pass for this leg's
        with open(manifest, "w") as f:
            json.dump({"torchao": None, "reason": reason}, f)
        print("fp8_torchao_reference: " + reason + ": no torchao reference written"
              " (the torchao conformance tests skip)")
        return
    import torchao
    from safetensors.torch import save_file
    from torchao.float8.config import ScalingType
    torch.set_num_threads(THREADS)
    tensors = reference()
    save_file({k: v.contiguous() for k, v in tensors.items()}, tensors_path)
    with open(manifest, "w") as f:
        json.dump({"torchao": torchao.__version__, "torch": torch.__version__,
                   "threads": THREADS, "steps": STEPS, "lr": LR, "momentum": MOMENTUM,
                   "mlp": [list(layer) for layer in MLP],
                   "scaling_types": [t.value for t in ScalingType]}, f, indent=1)
    print("fp8_torchao_reference: torchao %s on torch %s, %d tensors"
          % (torchao.__version__, torch.__version__, len(tensors)))


if __name__ == "__main__":
    main()
