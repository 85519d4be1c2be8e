"""Shared helpers for gdn's torch tests: seeded draws on any device, the CUDA skip marker,
docs/semantics.md section 5 on torch tensors (through gdn_testing.assert_matches), and the
bit comparisons of the stochastic-rounding tests. Imported only by test modules that have
already skipped themselves without torch."""

import numpy as np
import pytest
import torch

import gdn
from gdn_testing import assert_matches

HAVE_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(
    not HAVE_CUDA or not gdn.cuda_available(),
    reason="needs a CUDA device and a gdn build with the CUDA backend"
    + ("" if HAVE_CUDA else " (torch sees no CUDA device)")
    + ("" if gdn.cuda_available() else " (gdn was built without CUDA)"),
)
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


class Draw:
    """Seeded draws on the CPU, moved to `device`: the same numbers for every device."""

    def __init__(self, seed, device):
        self.gen = torch.Generator().manual_seed(seed)
        self.device = device

    def normal(self, shape, dtype=F32, std=1.0):
        return (std * torch.randn(shape, generator=self.gen, dtype=torch.float64)).to(dtype).to(self.device)

    def uniform(self, shape, lo, hi, dtype=F32):
        x = lo + (hi - lo) * torch.rand(shape, generator=self.gen, dtype=torch.float64)
        return x.to(dtype).to(self.device)

    def nan(self, shape, dtype):
        return torch.full(shape, float("nan"), dtype=dtype, device=self.device)

    def inputs(self, B, T, H, HV, K, V, dtype=BF16, gate_dtype=None):
        gate_dtype = gate_dtype or dtype
        return dict(
            q=self.normal((B, T, H, K), dtype), k=self.normal((B, T, H, K), dtype),
            v=self.normal((B, T, HV, V), dtype),
            a=self.normal((B, T, HV), gate_dtype), b=self.normal((B, T, HV), gate_dtype),
            A_log=self.uniform((HV,), 1.0, 16.0).log(), dt_bias=self.normal((HV,), F32, 0.1),
        )

    def pool(self, P, HV, K, V, layout="VK", dtype=F32):
        return self.normal((P, HV, V, K) if layout == "VK" else (P, HV, K, V), dtype, 0.1)


def assert_close(got, want, name):
    """docs/semantics.md section 5 on torch tensors (any device), by gdn_testing.assert_matches."""
    got, want = got.detach().cpu(), want.detach().cpu()
    assert got.dtype == want.dtype and got.shape == want.shape, f"{name}: {got.dtype}{tuple(got.shape)} vs {want.dtype}{tuple(want.shape)}"
    if got.dtype in (torch.int32, torch.int64):
        assert torch.equal(got, want), f"{name}: {got} != {want}"
        return
    assert_matches(to_numpy(got), to_numpy(want), name)


def to_numpy(x):
    """A host tensor as numpy; bf16 as uint16 bit patterns (numpy has no bfloat16)."""
    if x.dtype != BF16:
        return x.contiguous().numpy()
    return x.contiguous().view(torch.int16).numpy().view(np.uint16)


def seed_tensor(value, device):
    """A rounding_seed as gdn takes it: int64 [1] on the state's device."""
    return torch.tensor([value], dtype=torch.int64, device=device)


def stored_bits(x):
    """A tensor's stored bit patterns on the host (16- or 32-bit), for exact comparisons."""
    x = x.detach().cpu().contiguous()
    return x.view(torch.int16 if x.element_size() == 2 else torch.int32)


def fraction_differing(x, y):
    """The fraction of elements whose stored bits differ."""
    return (stored_bits(x) != stored_bits(y)).double().mean().item()


def capture_graph(step):
    """Runs `step` once on a side stream (the warm-up outside capture torch's docs advise), then
    captures it into a CUDA graph, returned unreplayed."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def bindings(op):
    """The two bindings of gdn's operation `op` ("decode" or "fused_decode") as pytest params:
    gdn._C's, and gdn._C_torch's where it was built for this torch (both must behave alike)."""
    import gdn._torch as gt

    found = [pytest.param(getattr(gdn._C, op), id="gdn._C")]
    native = getattr(gt.native, op) if gt.native is not None else None
    found.append(pytest.param(native, id="gdn._C_torch", marks=pytest.mark.skipif(
        native is None, reason="gdn._C_torch was not built for this torch (build gdn with --no-build-isolation "
                               "where torch is installed)")))
    return found
