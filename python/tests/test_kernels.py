# SPDX-License-Identifier: Apache-2.0
"""stellatrain.torch.kernels against torch's own operations, and their errors."""
import pytest
import torch

from stellatrain.torch import kernels as K

N = 100_003


def data(seed, n=N):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("k", [0, 1, 999, N])
@pytest.mark.parametrize("threads", [1, 2])
def test_select_topk_is_torch_topk_of_the_magnitudes(k, threads):
    x = data(1)
    idx, val = K.select_topk(x, k, threads=threads)
    expected = torch.topk(x.abs(), k).indices.sort().values
    assert torch.equal(idx, expected)
    assert torch.equal(val, x[idx])


@pytest.mark.parametrize("values_as,tol", [("fp32", 0.0), ("fp16", 1e-3), ("bf16", 8e-3)])
def test_pack_unpack_round_trip(values_as, tol):
    x = data(2)
    idx, val = K.select_topk(x, 5000)
    msg = K.pack(idx, val, N, values_as=values_as, tensor_id=7)
    assert msg.dtype == torch.uint8
    back_idx, back_val = K.unpack(msg, N, tensor_id=7)
    assert torch.equal(back_idx, idx)
    assert ((back_val - val).abs() <= tol * val.abs()).all()


def test_unpack_refuses_damaged_or_foreign_messages():
    x = data(3)
    idx, val = K.select_topk(x, 100)
    msg = K.pack(idx, val, N)
    for cut in (0, 10, msg.numel() - 1):
        with pytest.raises(ValueError):
            K.unpack(msg[:cut].clone(), N)
    bad = msg.clone()
    bad[msg.numel() // 2] ^= 0x40
    with pytest.raises(ValueError, match="checksum"):
        K.unpack(bad, N)
    with pytest.raises(ValueError):
        K.unpack(msg, N, tensor_id=1)  # another tensor
    with pytest.raises(ValueError):
        K.unpack(msg, 50)  # indices beyond this size


def test_merge_is_the_dense_mean():
    sels = [K.select_topk(data(10 + r), 3000) for r in range(4)]
    dense = torch.zeros(N)
    for idx, val in sels:
        dense.index_add_(0, idx, val)
    assert torch.allclose(K.merge(sels, N), dense / 4, atol=1e-7)
    assert torch.allclose(K.merge(sels, N, mean=False), dense, atol=1e-6)


def test_error_feedback_sends_everything_over_the_steps():
    ef = K.ErrorFeedback(selector="threshold", values="bf16")
    sent, total = torch.zeros(N), torch.zeros(N)
    for step in range(6):
        g = data(20 + step)
        total += g
        idx, val = ef.compress(4, g, 2000)
        assert idx.numel() == 2000 and bool((idx[1:] > idx[:-1]).all())
        sent.index_add_(0, idx, val)
    assert torch.allclose(sent + ef.residual(4), total, atol=1e-5)


def test_bad_tensors_name_the_argument():
    x = data(4)
    with pytest.raises(TypeError, match="x must be torch.float32, got torch.float64"):
        K.select_topk(x.double(), 3)
    with pytest.raises(ValueError, match="x must be contiguous"):
        K.select_topk(x[::2], 3)
    with pytest.raises(TypeError, match="x must be a dense"):
        K.select_topk(x.to_sparse(), 3)
    with pytest.raises(ValueError, match="k must be an int >= 0"):
        K.select_topk(x, -1)
    idx, val = K.select_topk(x, 10)
    with pytest.raises(TypeError, match="indices must be torch.int64, got torch.int32"):
        K.pack(idx.int(), val, N)
    with pytest.raises(ValueError, match="indices has 9 elements, values 10"):
        K.pack(idx[:9].clone(), val, N)
    with pytest.raises(ValueError, match="sorted|ascend"):
        K.pack(idx.flip(0).contiguous(), val, N)
    with pytest.raises(ValueError, match="exceed the tensor size 5"):
        K.pack(idx, val, 5)
    with pytest.raises(IndexError, match="not below|out of range"):
        K.pack(idx, val, int(idx[-1]))  # the last index is the size
    with pytest.raises(ValueError, match="values_as must be one of"):
        K.pack(idx, val, N, values_as="int8")
    with pytest.raises(TypeError, match="message must be torch.uint8"):
        K.unpack(val, N)
    with pytest.raises(TypeError, match=r"selections\[1\] values must be torch.float32"):
        K.merge([(idx, val), (idx, val.half())], N)
    ef = K.ErrorFeedback()
    ef.compress(0, x, 5)
    with pytest.raises(ValueError, match="registered with 100003 elements, grad has 5"):
        ef.compress(0, x[:5].clone(), 1)
    with pytest.raises(ValueError, match="selector must be one of"):
        K.ErrorFeedback(selector="topk")
