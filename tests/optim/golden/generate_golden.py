#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Writes torch_golden.inc: parameters after every step of torch.optim.SGD / Adam / AdamW /
SparseAdam for fixed initial parameters, gradients and hyper-parameters, as exact hexadecimal
float literals.

The C++ tests (tests/optim/test_golden.cpp) replay the same gradients through the library's
optimizers and compare against this table; they do not need torch. Regenerate with

    python3 tests/optim/golden/generate_golden.py > tests/optim/golden/torch_golden.inc

where PyTorch is installed (Debian: apt-get install python3-torch). Every input is a float32
value (hyper-parameters too, rounded to float32 before torch sees them), so both sides start
from exactly the same numbers; torch computes the bias-correction scalars in double, as the
tests' tolerances account for.

Cases marked "lazy" emulate the library's sparse, per-element-step semantics with PyTorch
itself: every element is its own one-element parameter with its own torch optimizer, stepped
only at the steps where the element is touched. SparseAdam cases are sparse by nature: one
sparse gradient per step holding the touched elements (all of them unless "lazy"), the step
count per tensor.
"""
import math
import struct
import sys

import torch

N = 7          # elements per tensor: one 4-wide and one 3-wide SIMD tail on purpose
STEPS = 12


def f32(x):
    return struct.unpack("<f", struct.pack("<f", float(x)))[0]


def hexf(x):
    x = f32(x)
    if x == 0.0:
        return "-0.0f" if math.copysign(1.0, x) < 0 else "0.0f"
    mantissa, exponent = float.hex(x).split("p")
    return mantissa.rstrip("0").rstrip(".") + "p" + exponent + "f"


def inputs(seed, scale):
    """Deterministic float32 parameters and gradients (no RNG: a formula both sides could
    rebuild; the table stores them anyway). Some gradients are exact zeros or large."""
    init = [f32(math.sin(1.7 * i + seed) * 0.8) for i in range(N)]
    grads = []
    for t in range(STEPS):
        row = []
        for i in range(N):
            g = math.cos(0.9 * t + 2.3 * i + seed) * scale
            if (t + i) % 5 == 0:
                g = 0.0
            if (t * 3 + i) % 11 == 0:
                g *= 40.0
            row.append(f32(g))
        grads.append(row)
    return init, grads


def touched_mask(seed):
    return [[1 if ((t * 5 + i * 3 + seed) % 7) < 3 else 0 for i in range(N)] for t in range(STEPS)]


def make_optimizer(kind, params, hp):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=hp["lr"], momentum=hp["momentum"], dampening=hp["dampening"],
                               weight_decay=hp["weight_decay"], nesterov=hp["nesterov"],
                               maximize=hp["maximize"], foreach=False)
    if kind == "sparse_adam":
        return torch.optim.SparseAdam(params, lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
                                      maximize=hp["maximize"])
    cls = torch.optim.Adam if kind == "adam" else torch.optim.AdamW
    return cls(params, lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
               weight_decay=hp["weight_decay"], amsgrad=hp["amsgrad"], maximize=hp["maximize"],
               foreach=False)


def run_dense(kind, hp, init, grads):
    p = torch.tensor(init, dtype=torch.float32, requires_grad=True)
    opt = make_optimizer(kind, [p], hp)
    out = []
    for row in grads:
        p.grad = torch.tensor(row, dtype=torch.float32)
        opt.step()
        out.append(p.detach().tolist())
    return out


def run_sparse(kind, hp, init, grads, mask):
    p = torch.tensor(init, dtype=torch.float32, requires_grad=True)
    opt = make_optimizer(kind, [p], hp)
    out = []
    for t, row in enumerate(grads):
        idx = [i for i in range(N) if mask[t][i]]
        p.grad = torch.sparse_coo_tensor([idx], [row[i] for i in idx], (N,), dtype=torch.float32)
        opt.step()
        out.append(p.detach().tolist())
    return out


def run_lazy(kind, hp, init, grads, mask):
    elems = [torch.tensor([v], dtype=torch.float32, requires_grad=True) for v in init]
    opts = [make_optimizer(kind, [e], hp) for e in elems]
    out = []
    for t, row in enumerate(grads):
        for i in range(N):
            if mask[t][i]:
                elems[i].grad = torch.tensor([row[i]], dtype=torch.float32)
                opts[i].step()
        out.append([e.item() for e in elems])
    return out


DEFAULTS = dict(lr=0.01, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False,
                beta1=0.9, beta2=0.999, eps=1e-8, amsgrad=False)

CASES = [
    # name, optimizer, hyper-parameters, seed, gradient scale, lazy
    ("sgd_plain", "sgd", dict(lr=0.1), 1, 1.0, False),
    ("sgd_momentum", "sgd", dict(lr=0.05, momentum=0.9), 2, 1.0, False),
    ("sgd_momentum_dampening_wd", "sgd", dict(lr=0.05, momentum=0.8, dampening=0.3, weight_decay=0.01), 3, 1.0, False),
    ("sgd_nesterov_wd", "sgd", dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.05), 4, 1.0, False),
    ("sgd_nesterov_maximize", "sgd", dict(lr=0.03, momentum=0.7, nesterov=True, maximize=True), 5, 1.0, False),
    ("sgd_wd_no_momentum", "sgd", dict(lr=0.1, weight_decay=0.2), 6, 1.0, False),
    ("adam_default", "adam", dict(lr=0.01), 7, 1.0, False),
    ("adam_l2_wd", "adam", dict(lr=0.02, weight_decay=0.1, beta1=0.8, beta2=0.99), 8, 1.0, False),
    ("adam_maximize", "adam", dict(lr=0.01, maximize=True), 9, 1.0, False),
    # eps of the order of sqrt(v): catches a misplaced eps or bias correction of the denominator
    ("adam_large_eps", "adam", dict(lr=0.05, eps=0.01, beta2=0.95), 10, 0.01, False),
    ("adamw_wd", "adamw", dict(lr=0.01, weight_decay=0.1), 11, 1.0, False),
    ("adamw_large_eps_maximize", "adamw", dict(lr=0.03, weight_decay=0.5, eps=0.02, maximize=True), 12, 0.02, False),
    ("amsgrad", "adam", dict(lr=0.02, amsgrad=True, beta2=0.9), 13, 1.0, False),
    ("amsgrad_adamw_wd", "adamw", dict(lr=0.02, amsgrad=True, weight_decay=0.3, beta2=0.9), 14, 1.0, False),
    ("amsgrad_l2_large_eps", "adam", dict(lr=0.02, amsgrad=True, weight_decay=0.05, eps=0.01, beta2=0.9), 15, 0.01, False),
    # lazy (sparse) semantics with per-element steps
    ("lazy_sgd_nesterov_wd", "sgd", dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.05), 16, 1.0, True),
    ("lazy_sgd_momentum_dampening", "sgd", dict(lr=0.05, momentum=0.8, dampening=0.3), 17, 1.0, True),
    ("lazy_adam_l2", "adam", dict(lr=0.02, weight_decay=0.1, eps=0.01), 18, 0.01, True),
    ("lazy_adamw_amsgrad", "adamw", dict(lr=0.02, weight_decay=0.2, amsgrad=True, beta2=0.9), 19, 1.0, True),
    # torch.optim.SparseAdam (eps added to sqrt(v), sqrt(bc2) in the step size): every element,
    # then touched subsets with small, tiny (of the order of eps), large and maximized gradients
    ("sparse_adam_all", "sparse_adam", dict(lr=0.01), 20, 1.0, False),
    ("sparse_adam_small", "sparse_adam", dict(lr=0.01), 21, 1e-3, True),
    ("sparse_adam_tiny", "sparse_adam", dict(lr=0.01), 22, 1e-8, True),
    ("sparse_adam_large", "sparse_adam", dict(lr=0.02, beta1=0.8, beta2=0.99), 23, 100.0, True),
    ("sparse_adam_large_eps_maximize", "sparse_adam", dict(lr=0.05, eps=0.01, beta2=0.95, maximize=True), 24, 0.01, True),
]


def floats(values, indent="    "):
    items = [hexf(v) for v in values]
    lines = []
    for k in range(0, len(items), 4):
        lines.append(indent + ", ".join(items[k:k + 4]) + ",")
    return "\n".join(lines)


def main():
    torch.set_num_threads(1)
    out = sys.stdout
    out.write("// SPDX-License-Identifier: Apache-2.0\n")
    out.write(f"// Generated by generate_golden.py with torch {torch.__version__}; do not edit.\n")
    out.write("// Parameters after every step of torch.optim for the inputs below (hexadecimal float literals).\n")
    out.write(f"// golden_elements = {N}, golden_steps = {STEPS}; every array holds steps x elements values.\n\n")
    for name, kind, overrides, seed, scale, lazy in CASES:
        hp = dict(DEFAULTS)
        hp.update(overrides)
        for k in ("lr", "momentum", "dampening", "weight_decay", "beta1", "beta2", "eps"):
            hp[k] = f32(hp[k])
        init, grads = inputs(seed, scale)
        mask = touched_mask(seed) if lazy else [[1] * N for _ in range(STEPS)]
        if kind == "sparse_adam":
            expected = run_sparse(kind, hp, init, grads, mask)
        else:
            expected = run_lazy(kind, hp, init, grads, mask) if lazy else run_dense(kind, hp, init, grads)
        out.write(f"// {name}\n")
        out.write("golden_case{\n")
        out.write(f"  \"{name}\", golden_kind::{kind}, {'true' if lazy else 'false'},\n")
        out.write("  golden_hyper{" + ", ".join([
            f".lr = {hexf(hp['lr'])}", f".momentum = {hexf(hp['momentum'])}",
            f".dampening = {hexf(hp['dampening'])}", f".weight_decay = {hexf(hp['weight_decay'])}",
            f".beta1 = {hexf(hp['beta1'])}", f".beta2 = {hexf(hp['beta2'])}", f".eps = {hexf(hp['eps'])}",
            f".nesterov = {'true' if hp['nesterov'] else 'false'}",
            f".maximize = {'true' if hp['maximize'] else 'false'}",
            f".amsgrad = {'true' if hp['amsgrad'] else 'false'}"]) + "},\n")
        out.write("  {\n" + floats(init) + "\n  },\n")
        out.write("  {\n" + floats([g for row in grads for g in row]) + "\n  },\n")
        if lazy:
            out.write("  {" + ", ".join(str(m) for row in mask for m in row) + "},\n")
        else:
            out.write("  {},  // dense: every element every step\n")
        out.write("  {\n" + floats([v for row in expected for v in row]) + "\n  },\n")
        out.write("},\n")


if __name__ == "__main__":
    main()
