# SPDX-License-Identifier: Apache-2.0
"""stellatrain.torch.LocalSteps over Gloo, 2-4 processes on this machine: the same bits on every
rank, flat and between clusters (with and without DDP inside a cluster), the H = 1 match with
the per-step mean, checkpoints, the choice of H, and bad input."""
import copy

import pytest
import torch
import torch.distributed as dist

import stellatrain.torch as st
from stellatrain import _native

import world
from toy import batch, make_model


def loss_of(model, rank, step):
    x, y = batch(rank, step)
    return torch.nn.functional.cross_entropy(model(x), y)


def train(model, opt, rank, first, last):
    for step in range(first, last):
        opt.zero_grad()
        loss_of(model, rank, step).backward()
        opt.step()


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# ------------------------------------------------------------------- the same bits everywhere
def _identical(rank, world_size):
    out = {}
    groups = st.clusters([[0, 1], [2, 3]])
    for name, kwargs, ddp in [
            ("flat", {}, False),
            ("clusters", {"clusters": groups}, False),
            ("clusters+ddp", {"clusters": groups, "replicas_in_sync": True}, True),
            ("flat fp32", {"codec": "fp32"}, False),
            ("clusters fp32", {"codec": "fp32", "clusters": groups}, False)]:
        model = make_model()
        net = torch.nn.parallel.DistributedDataParallel(model, process_group=groups.cluster) \
            if ddp else model
        opt = st.LocalSteps(net, torch.optim.AdamW(net.parameters(), lr=1e-2), inner_steps=3,
                            chunk_bits=8, per_chunk=16, threads=1, **kwargs)
        start = flat(model).clone()
        train(net, opt, rank, 0, 6)  # two outer steps
        out[name] = {"params": flat(model).clone(), "outer": opt.outer_parameters,
                     "start": start, "wire_bytes": opt.wire_bytes,
                     "bits": opt.bits_per_parameter_and_step(), "elements": opt.elements}
    return out


def test_every_rank_holds_the_same_bits_after_each_outer_step():
    results = world.run(_identical, 4)
    for name in results[0]:
        first = results[0][name]
        assert not torch.equal(first["params"], first["start"]), name
        for rank, r in enumerate(r[name] for r in results):
            assert torch.equal(r["params"], first["params"]), (name, rank)
            # The replica is the outer parameters right after an outer step.
            assert torch.equal(r["params"], r["outer"]), (name, rank)
            assert r["wire_bytes"] == first["wire_bytes"], (name, rank)
    # The mean inside each cluster, then between the clusters, is the mean of all four.
    for r in results:
        torch.testing.assert_close(r["clusters fp32"]["params"], r["flat fp32"]["params"],
                                   rtol=1e-5, atol=1e-6)
    n = results[0]["flat"]["elements"]
    # 16 of every 256 elements at 2 bits + 8-bit indices, headers and scales: far below fp32.
    assert 0 < results[0]["flat"]["bits"] < 32 * 16 / 256 / 3
    # Between clusters each rank sends one shard: half the flat message's payload, about.
    assert results[0]["clusters"]["wire_bytes"] < 0.75 * results[0]["flat"]["wire_bytes"]
    assert results[0]["flat"]["wire_bytes"] > 2 * (n // 256) * 16 * 10 / 8


# --------------------------------------------------------------------------- H = 1 is per-step
def _h1(rank, world_size):
    lr = 0.1
    model = make_model()
    opt = st.LocalSteps(model, torch.optim.SGD(model.parameters(), lr=lr), inner_steps=1,
                        codec="fp32", outer_lr=1.0, outer_momentum=0.0, nesterov=False,
                        threads=1)
    reference = make_model()
    ours, theirs = [], []
    for step in range(4):
        train(model, opt, rank, step, step + 1)
        ours.append(flat(model).clone())
        reference.zero_grad()
        loss_of(reference, rank, step).backward()
        with torch.no_grad():
            for p in reference.parameters():
                dist.all_reduce(p.grad)
                p.sub_(lr * p.grad / world_size)
        theirs.append(flat(reference).clone())
    return ours, theirs


def test_one_inner_step_with_a_plain_outer_sgd_is_the_per_step_mean():
    for ours, theirs in world.run(_h1, 2):
        for step, (a, b) in enumerate(zip(ours, theirs)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"step {step}")


# ------------------------------------------------------------------------------- checkpoints
def _resume(rank, world_size):
    def make(seed):
        model = make_model(seed)
        opt = st.LocalSteps(model, torch.optim.Adam(model.parameters(), lr=1e-2), inner_steps=2,
                            chunk_bits=8, per_chunk=8, values="1bit", decay=0.95, threads=1)
        return model, opt

    model, opt = make(0)
    train(model, opt, rank, 0, 9)
    straight = flat(model).clone()

    model, opt = make(0)
    train(model, opt, rank, 0, 5)  # stops one inner step after an outer step
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    model, opt = make(1)  # other initial weights: everything must come from the checkpoint
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    train(model, opt, rank, 5, 9)
    return straight, flat(model).clone(), opt.steps, opt.outer_steps


def test_a_resumed_run_computes_the_same_bits():
    for straight, resumed, steps, outer_steps in world.run(_resume, 2):
        assert torch.equal(straight, resumed)
        assert (steps, outer_steps) == (9, 4)


# ------------------------------------------------------------------------------- choosing H
def _controlled(rank, world_size):
    import time
    model = make_model()
    opt = st.LocalSteps(model, torch.optim.SGD(model.parameters(), lr=0.05), inner_steps=2,
                        min_inner_steps=1, max_inner_steps=40, exchange_share=0.2, threads=1)
    history = []
    step = 0
    while opt.outer_steps < 4:
        if rank == 1:
            time.sleep(0.002)  # a slower rank: every rank must still pick the same H
        train(model, opt, rank, step, step + 1)
        step += 1
        if opt._since_outer == 0:
            history.append(opt.inner_steps)
    return history


def test_every_rank_chooses_the_same_inner_steps_within_the_bounds():
    a, b = world.run(_controlled, 2)
    assert a == b
    assert all(1 <= h <= 40 for h in a)


def test_inner_steps_for_is_the_outer_loops_rule():
    # An exchange of 1 s beside inner steps of 10 ms takes 10% of the time at H = 900.
    assert _native.inner_steps_for(1.0, 0.01, 0.1, 1, 1000, 5) == 900
    assert _native.inner_steps_for(1.0, 0.01, 0.1, 1, 100, 5) == 100
    assert _native.inner_steps_for(1.0, 0.0, 0.1, 1, 100, 5) == 5  # no compute measured


# ------------------------------------------------------------------------------- bad input
@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def test_without_a_process_group_it_says_so():
    model = make_model()
    with pytest.raises(RuntimeError, match="not initialised"):
        st.LocalSteps(model, torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize("kwargs, error, match", [
    ({"inner_steps": 0}, ValueError, "inner_steps"),
    ({"codec": "int8"}, ValueError, "codec"),
    ({"values": "3bit"}, ValueError, "values"),
    ({"chunk_bits": 17}, ValueError, "chunk_bits"),
    ({"per_chunk": 300, "chunk_bits": 8}, ValueError, "per_chunk"),
    ({"decay": 0.0}, ValueError, "decay"),
    ({"min_inner_steps": 8, "max_inner_steps": 4}, ValueError, "min_inner_steps"),
    ({"exchange_share": 1.0}, ValueError, "exchange_share"),
    ({"clusters": [[0]]}, TypeError, "clusters"),
])
def test_bad_options_are_refused_naming_them(one_rank, kwargs, error, match):
    model = make_model()
    with pytest.raises(error, match=match):
        st.LocalSteps(model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)


def test_bad_models_and_layouts_are_refused(one_rank):
    model = make_model().double()
    with pytest.raises(TypeError, match="parameter '0.weight' must be torch.float32"):
        st.LocalSteps(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        st.LocalSteps(make_model(), object())
    with pytest.raises(ValueError, match="every rank 0..0 once"):
        st.clusters([[0], [1]])
    with pytest.raises(ValueError, match="one size"):
        st.clusters([[0], []])


def test_a_mismatched_checkpoint_is_refused_and_changes_nothing(one_rank):
    model = make_model()
    opt = st.LocalSteps(model, torch.optim.SGD(model.parameters(), lr=0.1), inner_steps=2,
                        chunk_bits=8, per_chunk=16, threads=1)
    train(model, opt, 0, 0, 4)
    before = opt.state_dict()
    other = make_model()
    wrong = st.LocalSteps(other, torch.optim.SGD(other.parameters(), lr=0.1), inner_steps=2,
                          chunk_bits=8, per_chunk=32, threads=1).state_dict()
    with pytest.raises(ValueError, match="per_chunk"):
        opt.load_state_dict(wrong)
    broken = dict(before, codec=before["codec"][:-3].clone())
    with pytest.raises(Exception):
        opt.load_state_dict(broken)
    with pytest.raises(ValueError, match="not a state saved"):
        opt.load_state_dict({"outer": before["outer"]})
    after = opt.state_dict()
    assert torch.equal(after["codec"], before["codec"])
    assert torch.equal(after["outer"], before["outer"])
    assert (after["steps"], after["outer_steps"]) == (4, 2)
