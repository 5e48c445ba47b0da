# SPDX-License-Identifier: Apache-2.0
"""stellatrain.torch.compression_hook in DDP over Gloo, 2-4 processes on this machine."""
import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import stellatrain.torch as st
from stellatrain import _native
from stellatrain.torch.ddp_hook import message_bound
from stellatrain.torch.kernels import threads_handle

import world
from toy import batch, make_model


def train(rank, hook, state, steps, bucket_cap_mb=0.01, lr=0.1, model=None):
    """Trains DDP(model) with `hook`; returns the parameters after each step."""
    ddp = torch.nn.parallel.DistributedDataParallel(model or make_model(),
                                                    bucket_cap_mb=bucket_cap_mb)
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    history = []
    for step in range(steps):
        x, y = batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        history.append([p.detach().clone() for p in ddp.parameters()])
    return history


def _density_one(rank, world_size, values):
    dense = train(rank, default_hooks.allreduce_hook, None, 4)
    state = st.CompressionState(density=1.0, values=values)
    ours = train(rank, st.compression_hook, state, 4)
    return dense, ours


@pytest.mark.parametrize("world_size", [2, 4])
def test_density_one_matches_the_allreduce_hook(world_size):
    results = world.run(_density_one, world_size, "fp32")
    for rank, (dense, ours) in enumerate(results):
        for step, (a, b) in enumerate(zip(dense, ours)):
            for i, (p, q) in enumerate(zip(a, b)):
                assert torch.allclose(p, q, rtol=0, atol=1e-6), (rank, step, i)
    # Every rank holds the same bits.
    for dense, ours in results[1:]:
        for p, q in zip(ours[-1], results[0][1][-1]):
            assert torch.equal(p, q)


def _mass(rank, world_size, selector, values):
    """With lr 0 the parameters stay put: every step's local gradient is known, and the hook's
    mean is read from .grad. Returns the sums the conservation law relates."""
    model = make_model()
    local = copy.deepcopy(model)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
    state = st.CompressionState(density=0.05, selector=selector, values=values)
    ddp.register_comm_hook(state, st.compression_hook)
    sent = [torch.zeros_like(p) for p in model.parameters()]
    grads = [torch.zeros_like(p) for p in model.parameters()]
    for step in range(8):
        x, y = batch(rank, step)
        ddp.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        local.zero_grad()
        torch.nn.functional.cross_entropy(local(x), y).backward()
        for s, p in zip(sent, model.parameters()):
            s += p.grad * world_size  # the mean of what the ranks sent, times W
        for g, p in zip(grads, local.parameters()):
            g += p.grad
    residual = [state.residual(p).view(p.shape) for p in model.parameters()]
    for t in grads + residual:
        dist.all_reduce(t)
    return sent, grads, residual


@pytest.mark.parametrize("selector,values", [("exact", "fp32"), ("threshold", "bf16"),
                                             ("block", "fp16")])
def test_error_feedback_conserves_the_gradient_mass(selector, values):
    for sent, grads, residual in world.run(_mass, 2, selector, values):
        for s, g, r in zip(sent, grads, residual):
            # sum of everything sent + what is left == sum of all gradients (fp32 sums)
            assert torch.allclose(s + r, g, rtol=1e-4, atol=1e-5)
            assert r.abs().sum() > 0  # density 0.05 leaves something behind


def _checkpoint(rank, world_size, folder):
    base = dict(density=0.1, selector="exact", values="bf16")
    whole = train(rank, st.compression_hook, st.CompressionState(**base), 6, bucket_cap_mb=25)
    # The same run stopped after 3 steps, saved, and continued by fresh objects.
    state = st.CompressionState(**base)
    model = make_model()
    first = train(rank, st.compression_hook, state, 3, bucket_cap_mb=25, model=model)
    saved = {"model": copy.deepcopy(model.state_dict()), "hook": state.state_dict()}
    torch.save(saved, f"{folder}/ckpt.{rank}")
    loaded = torch.load(f"{folder}/ckpt.{rank}")
    fresh_model = make_model(seed=7)
    fresh_model.load_state_dict(loaded["model"])
    fresh_state = st.CompressionState(**base)
    fresh_state.load_state_dict(loaded["hook"])
    assert fresh_state.iter == 3
    rest = []
    ddp = torch.nn.parallel.DistributedDataParallel(fresh_model, bucket_cap_mb=25)
    ddp.register_comm_hook(fresh_state, st.compression_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(3, 6):
        x, y = batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        rest.append([p.detach().clone() for p in ddp.parameters()])
    return whole, first + rest


def test_a_restored_state_continues_identically(tmp_path):
    for whole, resumed in world.run(_checkpoint, 2, str(tmp_path)):
        for step, (a, b) in enumerate(zip(whole, resumed)):
            for p, q in zip(a, b):
                assert torch.equal(p, q), f"step {step}"


def _warmup(rank, world_size):
    dense = train(rank, default_hooks.allreduce_hook, None, 3)
    ours = train(rank, st.compression_hook, st.CompressionState(density=0.01, start_iter=2), 3)
    return dense, ours


def test_steps_before_start_iter_are_dense():
    for dense, ours in world.run(_warmup, 2):
        for step in range(2):
            for p, q in zip(dense[step], ours[step]):
                assert torch.allclose(p, q, rtol=0, atol=1e-6)
        assert any(not torch.allclose(p, q, atol=1e-6) for p, q in zip(dense[2], ours[2]))


class FakeBucket:
    """What the hook reads of a torch GradBucket, for layouts chosen by the test."""

    def __init__(self, index, params, grads, last):
        self._index, self._params, self._last = index, params, last
        self._buffer = torch.cat([g.reshape(-1) for g in grads])
        self._views, at = [], 0
        for g in grads:
            self._views.append(self._buffer[at:at + g.numel()].view(g.shape))
            at += g.numel()

    def index(self):
        return self._index

    def buffer(self):
        return self._buffer

    def parameters(self):
        return self._params

    def gradients(self):
        return self._views

    def is_last(self):
        return self._last


def _rebuild(rank, world_size):
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (300, 50, 1000, 7)]
    state = st.CompressionState(density=0.02, values="fp32")
    layouts = [[[0, 1], [2, 3]], [[3, 0], [2], [1]], [[1, 2, 3, 0]]]
    sent = [torch.zeros(p.numel()) for p in params]
    total = [torch.zeros(p.numel()) for p in params]
    g = torch.Generator().manual_seed(5)
    for step in range(9):
        layout = layouts[min(step // 3, 2)]  # two rebuilds
        grads = [torch.randn(p.numel(), generator=g) for p in params]
        for t, gr in zip(total, grads):
            t += gr
        for b, members in enumerate(layout):
            bucket = FakeBucket(b, [params[i] for i in members], [grads[i] for i in members],
                                b == len(layout) - 1)
            out = st.compression_hook(state, bucket).wait()
            at = 0
            for i in members:
                sent[i] += out[at:at + params[i].numel()]
                at += params[i].numel()
    return [(s + state.residual(p) - t).abs().max().item()
            for s, p, t in zip(sent, params, total)]


def test_residuals_follow_their_parameters_across_bucket_rebuilds():
    (errors,) = world.run(_rebuild, 1)
    assert max(errors) < 1e-4, errors


def test_message_bound_holds_for_every_selector_and_value_type():
    g = torch.Generator().manual_seed(3)
    for selector in ("exact", "threshold", "sampled_threshold", "block", "random"):
        for values in ("fp32", "fp16", "bf16"):
            codec = _native.Codec(selector, values, 0, threads_handle(1))
            for tid, (n, k) in enumerate([(1, 1), (100, 100), (65536, 50), (65537, 6000),
                                          (300000, 30000)]):
                codec.add(tid, n, 0)
                x = torch.randn(n, generator=g)
                nbytes = codec.compress(tid, x.data_ptr(), n, k, 0)
                assert nbytes <= message_bound(n, k, values), (selector, values, n, k)
                # With the step report an adaptive hook's message carries.
                nbytes = codec.compress(tid, x.data_ptr(), n, k, 1, [_native.StepReport(step=0)])
                assert nbytes <= message_bound(n, k, values, 1), (selector, values, n, k)


def _bad_dtype(rank, world_size):
    ddp = torch.nn.parallel.DistributedDataParallel(make_model().double())
    ddp.register_comm_hook(st.CompressionState(), st.compression_hook)
    x, y = batch(rank, 0)
    try:
        torch.nn.functional.cross_entropy(ddp(x.double()), y).backward()
    except Exception as e:  # DDP's reducer re-raises the hook's error as its own
        return str(e)
    return "no error"


def test_bad_input_is_refused_with_a_clear_error():
    for message in world.run(_bad_dtype, 2):
        assert "bucket 0 must be torch.float32, got torch.float64" in message
    with pytest.raises(ValueError, match="density must be in"):
        st.CompressionState(density=0.0)
    with pytest.raises(ValueError, match="density must be in"):
        st.CompressionState(density=1.5)
    with pytest.raises(ValueError, match="selector must be one of"):
        st.CompressionState(selector="topk")
    with pytest.raises(ValueError, match="values must be one of"):
        st.CompressionState(values="int8")
    with pytest.raises(ValueError, match="start_iter must be"):
        st.CompressionState(start_iter=-1)
    state = st.CompressionState(selector="exact")
    with pytest.raises(ValueError, match="saved with selector='threshold'"):
        state.load_state_dict(dict(st.CompressionState(selector="threshold").state_dict()))


def _adaptive(rank, world_size, folder):
    import random
    import time

    state = st.CompressionState(density=0.001, selector="exact", values="fp32", adaptive=True,
                                min_density=1e-3, max_density=1.0)
    ddp = torch.nn.parallel.DistributedDataParallel(make_model(), bucket_cap_mb=0.01)
    ddp.register_comm_hook(state, st.compression_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    jitter = random.Random(rank)
    densities = []
    for step in range(12):
        x, y = batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        # The ranks' compute differs, step by step: their own times do too.
        time.sleep(0.02 + 0.02 * jitter.random())
        densities.append(state.density)
    saved = state.state_dict()
    torch.save(saved, f"{folder}/hook.{rank}.pt")
    restored = st.CompressionState(density=0.5, selector="exact", values="fp32", adaptive=True,
                                   min_density=1e-3, max_density=1.0)
    restored.load_state_dict(torch.load(f"{folder}/hook.{rank}.pt"))
    return (densities, [p.detach().clone() for p in ddp.parameters()],
            (state.density, state.bandwidth(), state.latency()),
            (restored.density, restored.bandwidth(), restored.latency()))


def test_adaptive_density_is_the_same_on_every_rank_and_checkpointed(tmp_path):
    results = world.run(_adaptive, 3, str(tmp_path))
    densities, params, estimates, restored = results[0]
    # The ranks' own times differ; the density each step is still the same on every rank,
    # and so are the parameters.
    for other in results[1:]:
        assert other[0] == densities
        for p, q in zip(other[1], params):
            assert torch.equal(p, q)
    # The controller acted: loopback carries this model's messages in far less than the
    # 20-40 ms of compute, so it raised the density from its start.
    assert densities[-1] > 0.001
    assert estimates[1] > 0
    # A restored state decides from the same estimates.
    for r in results:
        assert r[3] == r[2]


def test_density_controller_binding_sizes_the_exchange_to_the_compute():
    c = _native.DensityController(min_density=1e-4, max_density=0.5, initial_density=0.01,
                                  target_ratio=0.95, latency_seconds=0.002)
    # 4 ranks, 1M elements, 6 bytes per pair; a 10 MB/s link, 50 ms of compute.
    c.set_model(elements=1_000_000, ranks=4, bytes_per_element=6.0, header_bytes=0.0,
                latency_rounds=3.0)
    for _ in range(30):
        link_bytes = 3 * 1_000_000 * c.density * 6
        c.observe(compute_seconds=0.05, comm_seconds=link_bytes / 1e7 + 3 * 0.002,
                  link_bytes=int(link_bytes))
    # comm = 0.95 * compute: 3 * 6e6 * d / 1e7 + 0.006 = 0.0475.
    assert c.density == pytest.approx((0.0475 - 0.006) * 1e7 / 1.8e7, rel=0.1)
    assert c.bandwidth == pytest.approx(1e7, rel=0.05)
    with pytest.raises(ValueError, match="time"):
        c.observe(compute_seconds=-1.0, comm_seconds=0.01, link_bytes=10)
    with pytest.raises(ValueError):
        c.load_state(b"not a state")
    with pytest.raises(ValueError, match="min_density"):
        st.CompressionState(adaptive=True, min_density=0.5, max_density=0.1)
    with pytest.raises(ValueError, match="max_density"):
        st.CompressionState(adaptive=True, max_density=0.0)
    with pytest.raises(ValueError, match="exchange_ratio"):
        st.CompressionState(adaptive=True, exchange_ratio=0.0)


# ---------------------------------------------------------------- the step reports on the wire

def _aggregate(reports):
    """The C++ pipeline's combination of one step's reports, one per rank, written out as
    pipeline/step_reports.hpp (report_aggregate) and docs/wire-format.md state it."""
    compute = spans = link = per_element = rounds = 0.0
    for r in reports:
        compute = max(compute, r.compute_seconds)
        spans += r.exchange_seconds + r.compute_seconds
        link += float(r.link_bytes)
        per_element += r.bytes_per_element
        rounds += r.latency_rounds
    n = len(reports)
    return _native.StepReport(step=reports[0].step, exchange_seconds=max(0.0, spans / n - compute),
                              compute_seconds=compute, link_bytes=int(math.floor(link / n + 0.5)),
                              bytes_per_element=per_element / n, latency_rounds=rounds / n)


def _decode(buffer, n, tensor=0):
    """(tag, step reports) of the message at the front of a gathered buffer, read by the native
    module's reader (the C++ unpacker and read_step_reports)."""
    u = _native.Unpacker(threads_handle(1))
    length = _native.message_bytes(buffer.data_ptr(), buffer.numel())
    u.parse(tensor, n, buffer.data_ptr(), length)
    return u.tag, u.step_reports()


def _recording_all_gather(recorded):
    real = dist.all_gather

    def all_gather(tensors, tensor, group=None, async_op=False):
        recorded.append(tensors)
        return real(tensors, tensor, group=group, async_op=async_op)

    dist.all_gather = all_gather


def _reports_on_the_wire(rank, world_size):
    import time

    recorded = []
    _recording_all_gather(recorded)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (300, 50)]
    state = st.CompressionState(density=0.05, values="fp32", adaptive=True, min_density=0.01,
                                max_density=1.0)
    g = torch.Generator().manual_seed(rank)
    measurements = []
    for step in range(6):
        grads = [torch.randn(p.numel(), generator=g) for p in params]
        st.compression_hook(state, FakeBucket(0, params, grads, True)).wait()
        measurements.append(state.measurement)
        time.sleep(0.01 * (1 + rank))  # the ranks' compute differs
    return ([[m.clone() for m in gathered] for gathered in recorded], measurements,
            message_bound(350, 0, "fp32", 1), message_bound(350, 1, "fp32", 1))


def test_the_hook_sends_the_pipelines_step_reports_section():
    results = world.run(_reports_on_the_wire, 2)
    steps, measurements, fixed, with_one = results[0]
    pair = with_one - fixed
    for step, gathered in enumerate(steps):
        for r, buffer in enumerate(gathered):
            tag, reports = _decode(buffer, 350)
            assert tag == step
            if step < 2:  # the first complete step with a compute time is step 1
                assert reports == []
                continue
            (report,) = reports
            assert report.step == step - 1
            assert report.compute_seconds > 0 and report.exchange_seconds >= 0
            # The step's one message went to one other rank, padded to its bound.
            assert report.link_bytes == steps[step - 1][r].numel()
            assert report.bytes_per_element == pair
            assert report.latency_rounds == 1.0
        # The measurement every rank observed at this step: all ranks' reports of the step
        # before, combined by the C++ pipeline's rule.
        decoded = [_decode(buffer, 350)[1] for buffer in gathered]
        expected = _aggregate([d[0] for d in decoded]) if step >= 2 else None
        for _, ms, _, _ in results:
            assert ms[step] == expected, (step, ms[step], expected)


def _codec_message(codec, n, step, reports, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    size = codec.compress(0, x.data_ptr(), n, 10, step, reports)
    out = torch.zeros(size + 16, dtype=torch.uint8)  # padded, as the hook's all_gather has them
    codec.write(out.data_ptr(), out.numel())
    return out


def test_the_combined_measurement_is_the_pipelines_rule():
    n = 1000
    codecs = [_native.Codec("exact", "bf16", 0, threads_handle(1)) for _ in range(3)]
    for c in codecs:
        c.add(0, n, 0)
    mine = [_native.StepReport(step=6, exchange_seconds=0.010 * (1 + r), compute_seconds=0.030
                               + 0.007 * r, link_bytes=1000 + 3 * r, bytes_per_element=4.0,
                               latency_rounds=2.0) for r in range(3)]

    def reduce(per_rank):
        msgs = [_codec_message(c, n, 7, reports, seed)
                for seed, (c, reports) in enumerate(zip(codecs, per_rank))]
        out = torch.empty(n)
        return codecs[0].reduce(0, n, [(m.data_ptr(), m.numel()) for m in msgs], out.data_ptr(),
                                True)

    combined = reduce([[r] for r in mine])
    assert combined == _aggregate(mine)
    assert combined.link_bytes == 1003 and combined.compute_seconds == mine[2].compute_seconds
    # The latest reports are what counts; older ones may come before them.
    older = _native.StepReport(step=4, exchange_seconds=1.0, compute_seconds=1.0)
    assert reduce([[older, mine[0]], [mine[1]], [mine[2]]]) == combined
    # No combination while a rank has no report, or the ranks' latest are of other steps.
    assert reduce([[mine[0]], [], [mine[2]]]) is None
    assert reduce([[mine[0]], [older], [mine[2]]]) is None


def test_a_malformed_step_reports_section_is_refused_with_a_clear_error():
    n = 1000
    codec = _native.Codec("exact", "fp32", 0, threads_handle(1))
    codec.add(0, n, 0)
    idx = torch.tensor([3, 17], dtype=torch.int64)
    val = torch.tensor([1.0, 2.0])

    def reduce_with(controls, tag=7):
        bad = _native.pack(0, n, idx.data_ptr(), val.data_ptr(), 2, "fp32", tag,
                           threads_handle(1), controls)
        good = _codec_message(codec, n, 7, [], 1)
        bad = torch.frombuffer(bytearray(bad), dtype=torch.uint8)
        out = torch.empty(n)
        codec.reduce(0, n, [(good.data_ptr(), good.numel()), (bad.data_ptr(), bad.numel())],
                     out.data_ptr(), True, "stellatrain: bucket 3")

    with pytest.raises(ValueError, match=r"^stellatrain: bucket 3: rank 1: unpack: step reports: "
                                         r"layout version 65535"):
        reduce_with([(1, b"\xff" * 56)])
    with pytest.raises(ValueError, match="rank 1: unpack: step reports: 5 bytes, no header"):
        reduce_with([(1, b"\x02\x00\x01\x00\x00")])
    with pytest.raises(ValueError, match="rank 1: unpack: message tag 9223372036854775808 is not "
                                         "a step"):
        reduce_with([(1, b"\x02\x00\x01\x00\x00\x00\x00\x00" + bytes(48))], tag=2**63)
    # The sender checks its reports as a receiver will.
    x = torch.randn(n)
    with pytest.raises(ValueError, match="report of step 7 in a message of step 7"):
        codec.compress(0, x.data_ptr(), n, 10, 7, [_native.StepReport(step=7)])
    with pytest.raises(ValueError, match="exchange seconds -1"):
        codec.compress(0, x.data_ptr(), n, 10, 7, [_native.StepReport(step=3,
                                                                         exchange_seconds=-1.0)])


def _peer_sends_a_bad_section(rank, world_size):
    params = [torch.nn.Parameter(torch.zeros(100))]
    state = st.CompressionState(density=0.1, values="fp32", adaptive=True)
    real = dist.all_gather
    idx = torch.tensor([3, 17], dtype=torch.int64)
    val = torch.tensor([1.0, 2.0])
    bad = _native.pack(0, 100, idx.data_ptr(), val.data_ptr(), 2, "fp32", 0, threads_handle(1),
                       [(1, b"\x03\x00\x01\x00\x00\x00\x00\x00" + bytes(48))])

    def all_gather(tensors, tensor, group=None, async_op=False):
        work = real(tensors, tensor, group=group, async_op=async_op)
        work.wait()
        tensors[1][:len(bad)] = torch.frombuffer(bytearray(bad), dtype=torch.uint8)
        return work

    dist.all_gather = all_gather
    grads = [torch.randn(100)]
    try:
        st.compression_hook(state, FakeBucket(0, params, grads, True)).wait()
    except Exception as e:
        return str(e)
    return "no error"


def test_a_peers_malformed_step_reports_fail_the_hook_naming_bucket_and_rank():
    for message in world.run(_peer_sends_a_bad_section, 2):
        assert "stellatrain: bucket 0: rank 1: unpack: step reports: layout version 3" in message
