# SPDX-License-Identifier: Apache-2.0
"""stellatrain.torch.optim against torch.optim: same steps, same results within fp32 rounding,
and clear errors for what the native kernels do not take."""
import math

import pytest
import torch

import stellatrain.torch.optim as st_optim

# (stellatrain class, torch class, arguments both take)
CASES = [
    ("adam", st_optim.Adam, torch.optim.Adam, dict(lr=1e-2)),
    ("adam-l2", st_optim.Adam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1)),
    ("adam-amsgrad-maximize", st_optim.Adam, torch.optim.Adam,
     dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, amsgrad=True, maximize=True)),
    ("adamw", st_optim.AdamW, torch.optim.AdamW, dict(lr=1e-2)),
    ("adamw-amsgrad", st_optim.AdamW, torch.optim.AdamW,
     dict(lr=1e-2, weight_decay=0.05, amsgrad=True)),
    ("sgd", st_optim.SGD, torch.optim.SGD, dict(lr=0.1)),
    ("sgd-momentum", st_optim.SGD, torch.optim.SGD,
     dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-3)),
    ("sgd-nesterov-maximize", st_optim.SGD, torch.optim.SGD,
     dict(lr=0.05, momentum=0.9, nesterov=True, maximize=True)),
]


def make_params(seed, shapes=((257, 31), (1000,), (3, 5, 7), (1,))):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def assert_close(a, b, what):
    # fp32 rounding of the same equations: FMA contraction and the order of the bias-corrected
    # terms differ from torch's kernels by a few ulps per step.
    err = (a - b).abs().max().item()
    tol = 1e-5 * max(1.0, b.abs().max().item())
    assert err <= tol, f"{what}: max |difference| {err} > {tol}"


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name,ours,theirs,kwargs", CASES, ids=[c[0] for c in CASES])
def test_steps_equal_torch_optim(name, ours, theirs, kwargs, threads):
    ps, qs = make_params(1), make_params(1)
    a, b = ours(ps, threads=threads, **kwargs), theirs(qs, **kwargs)
    g = torch.Generator().manual_seed(2)
    for step in range(12):
        for p, q in zip(ps, qs):
            grad = torch.randn(p.shape, generator=g) * (0.1 + step)
            p.grad, q.grad = grad.clone(), grad.clone()
        a.step()
        b.step()
    for i, (p, q) in enumerate(zip(ps, qs)):
        assert_close(p.detach(), q.detach(), f"{name}, tensor {i}")
        assert a.step_count(0, i) == 12


def test_adam_state_equals_torch_moments():
    ps, qs = make_params(3), make_params(3)
    a, b = st_optim.Adam(ps, lr=1e-2), torch.optim.Adam(qs, lr=1e-2)
    for _ in range(4):
        for p, q in zip(ps, qs):
            p.grad = torch.randn(p.shape)
            q.grad = p.grad.clone()
        a.step()
        b.step()
    for i, q in enumerate(qs):
        assert_close(a.exp_avg(0, i), b.state[q]["exp_avg"].flatten(), f"exp_avg {i}")
        assert_close(a.exp_avg_sq(0, i), b.state[q]["exp_avg_sq"].flatten(), f"exp_avg_sq {i}")


def _cpu_has_fma():
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " fma" in line for line in f)
    except OSError:
        return False


@pytest.mark.skipif(not _cpu_has_fma(), reason="the package fuses a * b + c only where the "
                    "CPU has FMA (it is built for the CPU it runs on); this one has none")
@pytest.mark.parametrize("name,ours,theirs", [("adam", st_optim.Adam, torch.optim.Adam),
                                               ("sgd", st_optim.SGD, torch.optim.SGD)])
def test_l2_decay_nearly_cancelling_the_gradient_rounds_as_torch(name, ours, theirs):
    # g + wd * p is tiny: rounding wd * p before the add (instead of one FMA, as torch's
    # add(alpha) does) leaves an error as large as the result in most elements.
    wd = 0.1
    gen = torch.Generator().manual_seed(11)
    p0 = torch.randn(100_003, generator=gen)
    grad = -(p0 * wd) * (1 + 1e-5 * torch.randn(p0.shape, generator=gen))
    p, q = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    kwargs = dict(lr=1e-3, weight_decay=wd) if name == "adam" else \
        dict(lr=1e-3, weight_decay=wd, momentum=0.9)
    a, b = ours([p], threads=1, **kwargs), theirs([q], **kwargs)
    p.grad, q.grad = grad.clone(), grad.clone()
    a.step()
    b.step()
    if name == "adam":
        mine, theirs_m = a.exp_avg(0, 0), b.state[q]["exp_avg"]
    else:  # the first momentum buffer is the decayed gradient itself
        mine, theirs_m = a.momentum_buffer(0, 0), b.state[q]["momentum_buffer"]
    rel = ((mine - theirs_m).abs() / theirs_m.abs().clamp_min(1e-30)).max().item()
    # Adam's 1 - beta1 is formed from the float 0.9 (torch: from the double): 3e-7 apart.
    assert rel <= 1e-6, f"{name}: max relative difference {rel} from torch's"


def test_param_groups_lr_scheduler_closure_and_zero_grad():
    ps, qs = make_params(4), make_params(4)
    groups = lambda p: [{"params": p[:2]}, {"params": p[2:], "lr": 1e-3, "weight_decay": 0.2}]
    a = st_optim.AdamW(groups(ps), lr=1e-2)
    b = torch.optim.AdamW(groups(qs), lr=1e-2)
    sa = torch.optim.lr_scheduler.StepLR(a, step_size=2, gamma=0.5)
    sb = torch.optim.lr_scheduler.StepLR(b, step_size=2, gamma=0.5)
    x = torch.randn(16)

    def closure_for(params, opt):
        def closure():
            opt.zero_grad()
            loss = sum((p.flatten()[:16] * x).sum() ** 2 for p in params[:3])
            loss.backward()
            return loss
        return closure

    for _ in range(6):
        la = a.step(closure_for(ps, a))
        lb = b.step(closure_for(qs, b))
        assert math.isclose(la.item(), lb.item(), rel_tol=1e-4)
        sa.step()
        sb.step()
    for i, (p, q) in enumerate(zip(ps, qs)):
        assert_close(p.detach(), q.detach(), f"tensor {i}")
    # The last parameter never had a gradient: untouched, as in torch.optim.
    assert a.step_count(1, 1) == 0
    a.zero_grad()
    assert all(p.grad is None or not p.grad.any() for p in ps)


def test_writes_between_steps_are_taken():
    (p,), (q,) = make_params(5, [(300,)]), make_params(5, [(300,)])
    a, b = st_optim.SGD([p], lr=0.1, momentum=0.5), torch.optim.SGD([q], lr=0.1, momentum=0.5)
    for step in range(3):
        with torch.no_grad():  # what loading a model's weights does
            p.copy_(torch.full_like(p, float(step)))
            q.copy_(torch.full_like(q, float(step)))
        p.grad = torch.ones_like(p)
        q.grad = torch.ones_like(q)
        a.step()
        b.step()
    assert_close(p.detach(), q.detach(), "after writes")


def test_steps_update_the_parameter_in_place_and_follow_new_storage():
    (p,), (q,) = make_params(9, [(300,)]), make_params(9, [(300,)])
    a, b = st_optim.Adam([p], lr=1e-2), torch.optim.Adam([q], lr=1e-2)
    for step in range(4):
        if step == 2:  # new storage for the same parameter
            p.data = p.data.clone()
            q.data = q.data.clone()
        storage = p.data_ptr()
        p.grad = torch.full_like(p, 0.5)
        q.grad = torch.full_like(q, 0.5)
        a.step()
        b.step()
        assert p.data_ptr() == storage
    assert_close(p.detach(), q.detach(), "after the storage was replaced")


def test_load_state_dict_leaves_the_weights_alone():
    ps = make_params(10)
    a = st_optim.Adam(ps, lr=1e-2)
    for p in ps:
        p.grad = torch.ones_like(p)
    a.step()
    sd = a.state_dict()
    with torch.no_grad():  # the model moves on; loading an optimizer's state keeps it there
        for p in ps:
            p.add_(1.0)
    kept = [p.detach().clone() for p in ps]
    a.load_state_dict(sd)
    assert all(torch.equal(p.detach(), k) for p, k in zip(ps, kept))


def test_state_dict_round_trip_continues_identically(tmp_path):
    ps = make_params(6)
    a = st_optim.Adam(ps, lr=1e-2, amsgrad=True)
    grads = [[torch.randn(p.shape) for p in ps] for _ in range(6)]
    for k in range(3):
        for p, g in zip(ps, grads[k]):
            p.grad = g.clone()
        a.step()
    path = tmp_path / "opt.pt"
    torch.save({"params": [p.detach().clone() for p in ps], "opt": a.state_dict()}, path)
    for k in range(3, 6):
        for p, g in zip(ps, grads[k]):
            p.grad = g.clone()
        a.step()
    expected = [p.detach().clone() for p in ps]

    saved = torch.load(path)
    qs = [torch.nn.Parameter(t) for t in saved["params"]]
    b = st_optim.Adam(qs, lr=0.5)  # the saved lr replaces this one
    b.load_state_dict(saved["opt"])
    assert b.param_groups[0]["lr"] == 1e-2
    for k in range(3, 6):
        for q, g in zip(qs, grads[k]):
            q.grad = g.clone()
        b.step()
    for i, (q, e) in enumerate(zip(qs, expected)):
        assert torch.equal(q.detach(), e), f"tensor {i} differs after restore"


def test_load_state_dict_rejects_foreign_and_corrupt_state():
    ps = make_params(7)
    a = st_optim.Adam(ps)
    with pytest.raises(ValueError, match="no 'stellatrain' entry"):
        a.load_state_dict(torch.optim.Adam(make_params(7)).state_dict())
    with pytest.raises(ValueError):  # an SGD state is not an Adam state
        a.load_state_dict(st_optim.SGD(make_params(7), lr=0.1, momentum=0.9).state_dict())
    sd = st_optim.Adam(make_params(7)).state_dict()
    sd["stellatrain"][0][len(sd["stellatrain"][0]) // 2] ^= 0xFF
    with pytest.raises(ValueError):
        a.load_state_dict(sd)
    with pytest.raises(ValueError):  # other sizes
        a.load_state_dict(st_optim.Adam(make_params(7, [(4, 4)])).state_dict())
    for p in ps:
        p.grad = torch.ones_like(p)
    a.step()  # still usable, and unchanged by the failed loads
    assert a.step_count(0, 0) == 1


def bad_param_cases():
    base = torch.zeros(8, 4)
    return [
        ("fp16", torch.nn.Parameter(torch.zeros(4, dtype=torch.float16)), TypeError, "float32"),
        ("fp64", torch.nn.Parameter(torch.zeros(4, dtype=torch.float64)), TypeError, "float32"),
        ("strided", torch.nn.Parameter(base.t()), ValueError, "contiguous"),
        ("sparse", torch.nn.Parameter(torch.zeros(4, 4).to_sparse()), TypeError, "dense"),
    ]


@pytest.mark.parametrize("what,param,error,message", bad_param_cases(),
                         ids=[c[0] for c in bad_param_cases()])
def test_bad_parameters_name_the_parameter(what, param, error, message):
    good = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(error, match=f"parameter 1 of group 0 .*{message}"):
        st_optim.Adam([good, param])


def test_bad_gradients_name_the_parameter():
    p = torch.nn.Parameter(torch.zeros(8, 4))
    opt = st_optim.SGD([p], lr=0.1)
    p.grad = torch.zeros(4, 8).t()
    with pytest.raises(ValueError, match="gradient of parameter 0 of group 0 must be contiguous"):
        opt.step()
    p.grad = torch.zeros(8, 4)
    p.grad.data = torch.zeros(8, 4, dtype=torch.float64)  # .grad = refuses another dtype
    with pytest.raises(TypeError, match="gradient of parameter 0 of group 0 must be torch.float32"):
        opt.step()
    p.grad = torch.zeros(8, 4).to_sparse()
    with pytest.raises(TypeError, match="gradient of parameter 0 .* dense"):
        opt.step()
    with torch.no_grad():
        p.data = torch.zeros(5)
    p.grad = torch.zeros(5)
    with pytest.raises(ValueError, match="registered with 32 elements, now has 5"):
        opt.step()


def test_bad_options_are_refused():
    p = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match="lr"):
        st_optim.Adam(p, lr=-1.0)
    with pytest.raises(ValueError, match="beta2"):
        st_optim.Adam(p, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="betas"):
        st_optim.Adam(p, betas=0.9)
    with pytest.raises(ValueError, match="eps"):
        st_optim.AdamW(p, eps=float("nan"))
    with pytest.raises(ValueError, match="nesterov"):
        st_optim.SGD(p, lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="threads"):
        st_optim.SGD(p, lr=0.1, threads=0)
    with pytest.raises(ValueError, match="nonfinite"):
        st_optim.SGD(p, lr=0.1, nonfinite="ignore")
    with pytest.raises(TypeError, match="lr must be a number"):
        st_optim.SGD(p, lr="fast")


def test_only_lr_may_change():
    p = torch.nn.Parameter(torch.zeros(3))
    opt = st_optim.Adam([p])
    p.grad = torch.ones(3)
    opt.param_groups[0]["lr"] = 0.5
    opt.step()
    opt.param_groups[0]["betas"] = (0.5, 0.9)
    with pytest.raises(ValueError, match="group 0: 'betas' changed"):
        opt.step()


def test_nonfinite_gradients():
    p = torch.nn.Parameter(torch.zeros(4))
    opt = st_optim.SGD([p], lr=1.0)
    p.grad = torch.tensor([1.0, float("nan"), float("inf"), 2.0])
    opt.step()
    assert p.detach().tolist() == [-1.0, 0.0, 0.0, -2.0]
    strict = st_optim.SGD([p], lr=1.0, nonfinite="raise")
    with pytest.raises(FloatingPointError):
        strict.step()
    assert p.detach().tolist() == [-1.0, 0.0, 0.0, -2.0]


def test_a_model_trains_as_with_torch_optim():
    torch.manual_seed(8)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))
    twin = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))
    twin.load_state_dict(model.state_dict())
    a = st_optim.AdamW(model.parameters(), lr=1e-2, threads=2)
    b = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    x, y = torch.randn(256, 20), torch.randint(0, 3, (256,))
    for _ in range(20):
        for m, o in ((model, a), (twin, b)):
            o.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            o.step()
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        assert_close(p.detach(), q.detach(), n)
    assert torch.nn.functional.cross_entropy(model(x), y).item() < 0.8
