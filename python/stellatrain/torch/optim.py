# SPDX-License-Identifier: Apache-2.0
"""CPU optimizers on stellatrain's SIMD kernels, as `torch.optim.Optimizer` subclasses.

For parameters that live in CPU memory with their optimizer state (the role of DeepSpeed's CPU
Adam): `Adam`, `AdamW` and `SGD` take the arguments of their torch.optim namesakes and compute
the same update in fp32 (PyTorch's equations and order; results agree within fp32 rounding).
One fused pass per tensor reads the parameter, gradient and state once, on `threads` threads.

    model = torch.nn.Linear(1024, 1024)
    opt = stellatrain.torch.optim.AdamW(model.parameters(), lr=1e-3, threads=2)
    loss = model(x).square().mean(); loss.backward()
    opt.step(); opt.zero_grad()

What differs from torch.optim:
- Parameters and gradients must be contiguous torch.float32 tensors in CPU memory; anything
  else raises an error that names the parameter (nothing is copied behind the caller's back).
- The optimizer keeps its own fp32 copy of each parameter and its state in native memory. Each
  `step()` first reads the parameter as the tensor holds it, so weights loaded or changed
  between steps count, then writes the result back into the tensor.
- `optimizer.state` stays empty: `state_dict()` carries the native state (moments, step counts,
  hyper-parameters; checksummed) as byte tensors under the key "stellatrain", and
  `load_state_dict()` takes only such a dict.
- Only 'lr' may change after construction (what learning-rate schedulers do); a change of any
  other hyper-parameter of a group raises an error at the next step.
- A NaN or infinite gradient value leaves its element unchanged (`nonfinite="skip_elements"`,
  the default), skips the tensor's step (`"skip_tensor"`) or raises FloatingPointError
  (`"raise"`); torch.optim would write NaN into the parameter.
"""
import torch

from .. import _native
from . import _checks
from ._checks import fp32_cpu_buffer

__all__ = ["Adam", "AdamW", "SGD"]

_NONFINITE = ("skip_elements", "skip_tensor", "raise")


class _NativeOptimizer(torch.optim.Optimizer):
    """Base: one native optimizer per parameter group, on threads shared by the groups."""

    # Hyper-parameters fixed at construction (all but 'lr').
    _fixed = ()

    def __init__(self, params, defaults, threads, nonfinite):
        if threads is None:
            threads = torch.get_num_threads()
        _checks.threads(threads)
        _checks.choice(nonfinite, "nonfinite", _NONFINITE)
        self._threads = _native.Threads(threads)
        self._nonfinite = nonfinite
        self._groups = []  # (native optimizer, the fixed hyper-parameters it was made with)
        super().__init__(params, defaults)

    def _make_native(self, group):
        raise NotImplementedError

    def _fixed_values(self, group):
        return {k: group[k] for k in self._fixed}

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        index = len(self.param_groups) - 1
        for i, p in enumerate(group["params"]):
            fp32_cpu_buffer(p, f"parameter {i} of group {index}")
        native = self._make_native(group)
        for p in group["params"]:
            native.add(p.data_ptr(), p.numel())
        self._groups.append((native, self._fixed_values(group)))

    @property
    def threads(self):
        """The number of threads a step runs on."""
        return self._threads.threads

    @torch.no_grad()
    def step(self, closure=None):
        """Applies one step to every parameter that has a gradient; returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for g, group in enumerate(self.param_groups):
            native, fixed = self._groups[g]
            now = self._fixed_values(group)
            if now != fixed:
                changed = sorted(k for k in fixed if now[k] != fixed[k])
                raise ValueError(f"group {g}: {', '.join(repr(k) for k in changed)} changed "
                                 f"after construction ({fixed} -> {now}); only 'lr' may change")
            native.set_lr(float(group["lr"]))
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                fp32_cpu_buffer(p, f"parameter {i} of group {g}")
                grad = _checks.gradient_of(p, f"parameter {i} of group {g}")
                native.step(i, p.data_ptr(), grad.data_ptr(), p.numel())
        return loss

    def state_dict(self):
        """torch's dict (param_groups; an empty 'state') plus the native state of every group,
        as uint8 tensors under 'stellatrain' (torch.save stores it as it is)."""
        sd = super().state_dict()
        sd["stellatrain"] = [torch.frombuffer(bytearray(native.save_state()), dtype=torch.uint8)
                             for native, _ in self._groups]
        return sd

    def load_state_dict(self, state_dict):
        """Restores a dict from `state_dict()` of the same kind of optimizer over parameters of
        the same sizes. A dict from another optimizer, or a corrupted one, raises ValueError and
        changes nothing."""
        _checks.optimizer_state(state_dict, "load_state_dict")
        blobs = state_dict["stellatrain"]
        if len(blobs) != len(self._groups):
            raise ValueError(f"load_state_dict: the dict has {len(blobs)} native states, this "
                             f"optimizer {len(self._groups)} parameter groups")
        # Every native state is checked (checksums, sizes, options) into a new optimizer
        # first, so that a failure leaves this one unchanged.
        saved_groups = state_dict.get("param_groups", [])
        if len(saved_groups) != len(self._groups):
            raise ValueError(f"load_state_dict: the dict has {len(saved_groups)} parameter "
                             f"groups, this optimizer {len(self._groups)}")
        restored = []
        for g, ((native, _), blob) in enumerate(zip(self._groups, blobs)):
            _checks.byte_tensor(blob, f"native state {g}", "load_state_dict")
            # The saved hyper-parameters replace this optimizer's (as torch.optim does), so
            # the native optimizer is made with them.
            group = dict(self.param_groups[g])
            group.update({k: v for k, v in saved_groups[g].items() if k != "params"})
            fresh = self._make_native(group)
            for p in group["params"]:
                fresh.add(p.data_ptr(), p.numel())
            fresh.load_state(blob.contiguous().numpy().tobytes())
            restored.append(fresh)
        torch_part = {k: v for k, v in state_dict.items() if k != "stellatrain"}
        super().load_state_dict(torch_part)
        self._groups = [(fresh, self._fixed_values(group))
                        for fresh, group in zip(restored, self.param_groups)]

    # Inspection (tests, debugging): copies of the native state of one parameter.
    def _native_state(self, group, index, name):
        native, _ = self._groups[group]
        return torch.frombuffer(bytearray(getattr(native, name)(index)), dtype=torch.float32)

    def step_count(self, group, index):
        """Steps applied to parameter `index` of group `group`."""
        return self._groups[group][0].step_count(index)


class Adam(_NativeOptimizer):
    """torch.optim.Adam's update (L2 weight decay added to the gradient) on native kernels.

    Args as torch.optim.Adam: lr, betas, eps, weight_decay, amsgrad, maximize; plus `threads`
    (default: torch.get_num_threads()) and `nonfinite` (see the module's documentation).
    """

    _fixed = ("betas", "eps", "weight_decay", "amsgrad", "maximize")
    _decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, maximize=False, *, threads=None, nonfinite="skip_elements"):
        defaults = dict(lr=lr, betas=tuple(betas) if isinstance(betas, list) else betas,
                        eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize)
        super().__init__(params, defaults, threads, nonfinite)

    def _make_native(self, group):
        beta1, beta2 = _checks.betas(group["betas"])
        return _native.AdamGroup(
            lr=_checks.number(group["lr"], "lr"), beta1=beta1, beta2=beta2,
            eps=_checks.number(group["eps"], "eps"),
            weight_decay=_checks.number(group["weight_decay"], "weight_decay"),
            decoupled=self._decoupled, amsgrad=bool(group["amsgrad"]),
            maximize=bool(group["maximize"]), nonfinite=self._nonfinite, threads=self._threads)

    def exp_avg(self, group, index):
        """A copy of the first moment of parameter `index` of group `group` (flat)."""
        return self._native_state(group, index, "exp_avg")

    def exp_avg_sq(self, group, index):
        """A copy of the second moment of parameter `index` of group `group` (flat)."""
        return self._native_state(group, index, "exp_avg_sq")


class AdamW(Adam):
    """torch.optim.AdamW's update (decoupled weight decay, default 1e-2) on native kernels."""

    _decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, maximize=False, *, threads=None, nonfinite="skip_elements"):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize,
                         threads=threads, nonfinite=nonfinite)


class SGD(_NativeOptimizer):
    """torch.optim.SGD's update (momentum, dampening, Nesterov, L2 weight decay) on native
    kernels. Args as torch.optim.SGD, plus `threads` and `nonfinite`."""

    _fixed = ("momentum", "dampening", "weight_decay", "nesterov", "maximize")

    def __init__(self, params, lr, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False, maximize=False, *, threads=None, nonfinite="skip_elements"):
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening,
                        weight_decay=weight_decay, nesterov=nesterov, maximize=maximize)
        super().__init__(params, defaults, threads, nonfinite)

    def _make_native(self, group):
        return _native.SGDGroup(
            lr=_checks.number(group["lr"], "lr"),
            momentum=_checks.number(group["momentum"], "momentum"),
            dampening=_checks.number(group["dampening"], "dampening"),
            weight_decay=_checks.number(group["weight_decay"], "weight_decay"),
            nesterov=bool(group["nesterov"]), maximize=bool(group["maximize"]),
            nonfinite=self._nonfinite, threads=self._threads)

    def momentum_buffer(self, group, index):
        """A copy of the momentum buffer of parameter `index` of group `group` (flat)."""
        return self._native_state(group, index, "momentum_buffer")
