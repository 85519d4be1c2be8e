"""gdn.fused_decode with torch: torch tensors on the CPU and CUDA against the float64 oracle,
the gdn::fused_decode custom op (schema, opcheck, the refusal of tensors that require grad),
torch.compile(fullgraph=True) over a layer that calls gdn.fused_decode, and CUDA-graph
capture and replay with new inputs. Skipped with a reason where torch or a CUDA device (or
gdn's CUDA backend) is missing; the torch-on-CPU tests run wherever torch is installed."""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the GPU machine's CI has it)")

import gdn  # noqa: E402  (after torch: the integration binds at import)
from torch_testing import (  # noqa: E402
    BF16,
    DEVICES,
    F16,
    F32,
    Draw,
    assert_close,
    bindings,
    capture_graph,
    fraction_differing,
    needs_cuda,
    seed_tensor,
    stored_bits,
)

# Tensors fused_decode writes that hold copies of inputs (the conv pool, conv_inter): exact.
EXACT = ("conv_state", "conv_pool", "conv_inter", "error_count")


def fused_args(d, B, T, H, HV, K, V, P, layout="KV", dtype=BF16, state_dtype=F32, conv_dtype=None, W=4, L=None,
               vllm_pool=False, norm=True):
    """One call's arguments in the shapes serving code has: the conv weight a [D, 1, W] Conv1d
    weight squeezed to [D, W]; the conv pool [P, D, L] (transformers, L = W) or vLLM's
    [P, L, D] memory (L = W - 1) as a transposed view; raw gates; the gated norm."""
    D = 2 * H * K + HV * V
    conv_dtype = conv_dtype or dtype
    if L is None:
        L = W - 1 if vllm_pool else W
    conv_pool = d.normal((P, L, D) if vllm_pool else (P, D, L), conv_dtype)
    args = dict(
        mixed_qkv=d.normal((B, T, D), dtype),
        conv_weight=d.normal((D, 1, W), dtype, W ** -0.5).squeeze(1),
        conv_state=conv_pool.transpose(1, 2) if vllm_pool else conv_pool,
        state=d.pool(P, HV, K, V, layout, state_dtype),
        o=d.nan((B, T, HV, V), dtype),
        a=d.normal((B, T, HV), dtype), b=d.normal((B, T, HV), dtype),
        A_log=d.uniform((HV,), 1.0, 16.0).log(), dt_bias=d.normal((HV,), F32, 0.1),
        layout=layout,
    )
    if norm:
        args["norm_weight"] = 1.0 + d.normal((V,), dtype, 0.5)
        args["z"] = d.normal((B, T, HV, V), dtype)
    return args, dict(o=args["o"], state=args["state"], conv_pool=conv_pool)


def compare(got, want):
    for name in want:
        if name in EXACT:
            g, w = got[name].cpu(), want[name].cpu()
            assert torch.equal(g.nan_to_num(7.0), w.nan_to_num(7.0)), f"{name} differs from the oracle's"
        else:
            assert_close(got[name], want[name], name)


def run_vs_oracle(build, device, **kwargs):
    """build(device) -> (fused_decode kwargs, observed tensors). Runs gdn.fused_decode on
    `device` and gdn.reference_fused_decode on an identical CPU build; compares them."""
    args, got = build(device)
    gdn.fused_decode(**args, **kwargs)
    if device == "cuda":
        torch.cuda.synchronize()
    ref_args, want = build("cpu")
    gdn.reference_fused_decode(**ref_args, **kwargs)
    compare(got, want)
    return got, want


def dense(seed, B=3, T=1, H=2, HV=4, K=128, V=128, **kw):
    def build(device):
        return fused_args(Draw(seed, device), B, T, H, HV, K, V, B, **kw)

    return build


# --- torch tensors, any device -----------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,state_dtype", [(BF16, F32), (BF16, BF16), (F16, F16), (F32, F32)], ids=str)
@pytest.mark.parametrize("layout", ["VK", "KV"])
@pytest.mark.parametrize("T", [1, 4])
def test_dense(device, dtype, state_dtype, layout, T):
    run_vs_oracle(dense(400 + T, T=T, dtype=dtype, state_dtype=state_dtype, layout=layout), device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "raw"])
def test_gva_and_head_dims(device, norm):
    run_vs_oracle(dense(410, B=2, T=2, H=1, HV=4, K=64, V=256, norm=norm), device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("state_dtype", [F32, BF16], ids=str)
def test_vllm_pool_padding_split_and_bad_slots(device, state_dtype):
    # vLLM's layout: a [P, L, D] conv pool (L = W - 1) seen as [P, D, L], a KV state pool, slots
    # with CUDA-graph padding (-1), one slot == P (counted, treated as padding), split writes.
    B, T, P = 5, 1, 12

    def build(dev):
        args, seen = fused_args(Draw(420, dev), B, T, 2, 4, 128, 128, P, state_dtype=state_dtype, vllm_pool=True)
        args["read_slots"] = torch.tensor([3, -1, 0, 12, 5], dtype=torch.int32, device=dev)
        args["write_slots"] = torch.tensor([4, 7, 0, 1, 6], dtype=torch.int64, device=dev)
        args["error_count"] = torch.zeros(1, dtype=torch.int32, device=dev)
        return args, dict(seen, error_count=args["error_count"])

    got, _ = run_vs_oracle(build, device)
    assert got["error_count"].item() == 1
    assert (got["o"][[1, 3]] == 0).all()
    before = build("cpu")[1]
    untouched = [s for s in range(P) if s not in (4, 0, 6)]
    assert torch.equal(got["conv_pool"][untouched].cpu(), before["conv_pool"][untouched])
    assert torch.equal(got["state"][untouched].cpu(), before["state"][untouched])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("state_dtype", [F32, BF16], ids=str)
def test_token_slots_num_accepted_and_caches(device, state_dtype):
    B, T, H, HV, K, V, P = 3, 4, 1, 2, 128, 128, 20

    def build(dev):
        d = Draw(430, dev)
        args, seen = fused_args(d, B, T, H, HV, K, V, P, state_dtype=state_dtype, vllm_pool=True)
        D, L = args["mixed_qkv"].shape[2], args["conv_state"].shape[2]
        args["token_slots"] = (1 + torch.arange(B * T, dtype=torch.int32)).reshape(B, T).to(dev)
        args["num_accepted"] = torch.tensor([1, 4, 2], dtype=torch.int32, device=dev)
        args["inter"] = d.nan((B, T, HV, K, V), state_dtype)
        args["conv_inter"] = d.nan((B, T, D, L), BF16)
        return args, dict(seen, inter=args["inter"], conv_inter=args["conv_inter"])

    run_vs_oracle(build, device)


@pytest.mark.parametrize("device", DEVICES)
def test_update_state_false(device):
    build = dense(440, T=3)
    got, _ = run_vs_oracle(build, device, update_state=False)
    before = build("cpu")[1]
    assert torch.equal(got["state"].cpu(), before["state"])
    assert torch.equal(got["conv_pool"].cpu(), before["conv_pool"])


@pytest.mark.parametrize("device", DEVICES)
def test_output_allocated_with_torch(device):
    args, _ = dense(450, B=2, T=3, K=64, V=128)(device)
    del args["o"]
    o = gdn.fused_decode(**args)
    assert isinstance(o, torch.Tensor) and o.device.type == device and o.dtype == BF16
    assert o.shape == (2, 3, 4, 128) and torch.isfinite(o).all()
    assert gdn.fused_decode(**args, o_dtype=torch.float32).dtype == torch.float32
    assert gdn.fused_decode(**args, o_dtype="float16").dtype == torch.float16


def test_errors_name_the_argument():
    args, _ = dense(460, B=2)("cpu")
    with pytest.raises(ValueError, match=r"conv_state.shape\[2\] \(L\) must be in W - 1 = 3 .. 16"):
        gdn.fused_decode(**{**args, "conv_state": args["conv_state"][..., :2]})
    with pytest.raises(ValueError, match="^mixed_qkv must be on the CPU or a CUDA device"):
        gdn.fused_decode(**{**args, "mixed_qkv": args["mixed_qkv"].to("meta")})
    with pytest.raises(ValueError, match="^z needs norm_weight"):
        gdn.fused_decode(**{**args, "norm_weight": None})
    with pytest.raises(TypeError, match="^norm_eps must be a real number"):
        gdn.fused_decode(**args, norm_eps=torch.tensor(1e-6))


@needs_cuda
def test_mixed_devices_rejected():
    args, _ = dense(461, B=2)("cuda")
    with pytest.raises(ValueError, match="device"):
        gdn.fused_decode(**{**args, "conv_state": args["conv_state"].cpu()})


# --- grad mode ---------------------------------------------------------------------------------

@pytest.fixture(params=bindings("fused_decode"))
def binding(request, monkeypatch):
    monkeypatch.setattr(gdn, "_run_fused", request.param)
    return request.param


@pytest.mark.parametrize("name", ["mixed_qkv", "conv_weight", "conv_state", "state", "norm_weight", "A_log"])
def test_requires_grad_refused_in_grad_mode(binding, name):
    args, seen = dense(470, B=2, dtype=F32)("cpu")
    args[name] = args[name].detach().requires_grad_()
    before = {n: t.detach().clone() for n, t in seen.items()}
    with pytest.raises(ValueError, match=f"^{name} requires grad, but gdn is inference-only .*torch.no_grad\\(\\)"):
        gdn.fused_decode(**args)
    for n in seen:
        assert torch.equal(seen[n].detach().nan_to_num(7.0), before[n].nan_to_num(7.0)), f"{n} written on error"


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_parameters_accepted_without_grad_mode(binding, mode):
    # A model's conv1d weight, A_log, dt_bias and norm weight are nn.Parameters.
    build = dense(471, B=3, T=2, dtype=F32)
    args, got = build("cpu")
    for name in ("conv_weight", "A_log", "dt_bias", "norm_weight"):
        args[name] = torch.nn.Parameter(args[name])
    with mode():
        gdn.fused_decode(**args)
    ref_args, want = build("cpu")
    gdn.reference_fused_decode(**ref_args)
    compare(got, want)


# --- the custom op -----------------------------------------------------------------------------

POSITIONAL = ["mixed_qkv", "conv_weight", "conv_state", "state", "o"]


def op_call(args):
    """(positional, keyword) arguments of torch.ops.gdn.fused_decode for fused_decode's kwargs."""
    kw = dict(args)
    return tuple(kw.pop(n) for n in POSITIONAL), kw


def test_custom_op_registered():
    schema = torch.ops.gdn.fused_decode.default._schema
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert written == {"conv_state", "state", "o", "conv_inter", "inter", "error_count"}
    assert [a.name for a in schema.arguments if not a.kwarg_only] == POSITIONAL
    kwargs = {a.name: a for a in schema.arguments if a.kwarg_only}
    assert not kwargs["layout"].has_default_value(), "layout is required: no default"
    assert all(a.has_default_value() for n, a in kwargs.items() if n != "layout")
    defaults = {n: a.default_value for n, a in kwargs.items() if n != "layout"}
    assert defaults["norm_eps"] == pytest.approx(1e-6) and defaults["use_qk_l2norm"] is True
    assert defaults["update_state"] is True and defaults["check_duplicate_writes"] is False
    assert defaults["scale"] is None and defaults["z"] is None and defaults["conv_bias"] is None
    assert defaults["rounding_seed"] is None and kwargs["rounding_seed"].type.str() == "Tensor?"
    assert str(schema).startswith("gdn::fused_decode(Tensor mixed_qkv, Tensor conv_weight, Tensor(a!) conv_state, "
                                  "Tensor(b!) state, Tensor(c!) o, *, ")
    import gdn._torch as gt

    assert gt.fused_op is torch.ops.gdn.fused_decode.default


def test_custom_op_called_with_defaults():
    build = dense(480, B=2, T=2, K=64, V=64)
    args, got = build("cpu")
    ref_args, want = build("cpu")
    pos, kw = op_call(args)
    torch.ops.gdn.fused_decode(*pos, a=kw["a"], b=kw["b"], A_log=kw["A_log"], dt_bias=kw["dt_bias"],
                               norm_weight=kw["norm_weight"], z=kw["z"], layout="KV")
    gdn.reference_fused_decode(**ref_args)
    compare(got, want)


def test_custom_op_refuses_requires_grad():
    args, seen = dense(481, B=2, dtype=F32)("cpu")
    args["norm_weight"] = torch.nn.Parameter(args["norm_weight"])
    pos, kw = op_call(args)
    with pytest.raises(ValueError, match="^norm_weight requires grad, but gdn is inference-only"):
        torch.ops.gdn.fused_decode(*pos, **kw)
    with torch.no_grad():
        torch.ops.gdn.fused_decode(*pos, **kw)
    assert torch.isfinite(seen["o"]).all()


def test_custom_op_opcheck():
    B, T, P = 2, 2, 5

    def build():
        d = Draw(482, "cpu")
        args, _ = fused_args(d, B, T, 1, 2, 64, 64, P, vllm_pool=True)
        D, L = args["mixed_qkv"].shape[2], args["conv_state"].shape[2]
        args["read_slots"] = torch.tensor([4, 1], dtype=torch.int32)
        args["inter"] = d.nan((B, T, 2, 64, 64), F32)
        args["conv_inter"] = d.nan((B, T, D, L), BF16)
        args["error_count"] = torch.zeros(1, dtype=torch.int32)
        return args

    pos, kw = op_call(build())
    torch.library.opcheck(torch.ops.gdn.fused_decode.default, pos, kw,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration",
                                      "test_aot_dispatch_dynamic"))


# --- torch.compile -----------------------------------------------------------------------------

class Layer(torch.nn.Module):
    """A GDN layer's decode path as vLLM runs it: one projection into [mixed_qkv | z | b | a]
    sliced into views, the conv weight as an nn.Conv1d weight, pools and slots, gdn, out_proj."""

    def __init__(self, hidden, H, HV, K, V, device):
        super().__init__()
        self.H, self.HV, self.K, self.V = H, HV, K, V
        self.D = 2 * H * K + HV * V
        d = Draw(500, device)
        self.in_proj = torch.nn.Linear(hidden, self.D + HV * V + 2 * HV, bias=False, device=device)
        self.conv1d = torch.nn.Conv1d(self.D, self.D, 4, groups=self.D, bias=False, device=device)
        self.out_proj = torch.nn.Linear(HV * V, hidden, bias=False, device=device)
        self.A_log = torch.nn.Parameter(d.uniform((HV,), 1.0, 16.0).log())
        self.dt_bias = torch.nn.Parameter(d.normal((HV,), F32, 0.1))
        self.norm_weight = torch.nn.Parameter(1.0 + d.normal((V,), F32, 0.2))

    def forward(self, x, conv_pool, pool, slots, conv_inter):
        B, T, _ = x.shape
        D, HV, V = self.D, self.HV, self.V
        proj = self.in_proj(x)
        o = gdn.fused_decode(proj[..., :D], self.conv1d.weight.squeeze(1), conv_pool.transpose(1, 2), pool,
                             z=proj[..., D:D + HV * V].unflatten(-1, (HV, V)), norm_weight=self.norm_weight,
                             a=proj[..., D + HV * V + HV:], b=proj[..., D + HV * V:D + HV * V + HV],
                             A_log=self.A_log, dt_bias=self.dt_bias, read_slots=slots, conv_inter=conv_inter,
                             layout="KV")
        return self.out_proj(o.flatten(2))


def compile_case(device, backend):
    B, T, H, HV, K, V, P, hidden = 3, 2, 1, 2, 128, 128, 8, 64
    layer = Layer(hidden, H, HV, K, V, device)
    d = Draw(510, device)
    x = d.normal((B, T, hidden))
    conv_pool = d.normal((P, 3, layer.D))
    pool = d.pool(P, HV, K, V, "KV")
    slots = torch.tensor([6, -1, 1], dtype=torch.int32, device=device)
    inter = d.nan((B, T, layer.D, 3), F32)
    conv0, pool0 = conv_pool.clone(), pool.clone()
    conv_e, pool_e, inter_e = conv_pool.clone(), pool.clone(), inter.clone()
    with torch.no_grad():
        eager = layer(x, conv_e, pool_e, slots, inter_e)
        out = torch.compile(layer, fullgraph=True, backend=backend)(x, conv_pool, pool, slots, inter)
    # Same computation, same kernels: bit-identical.
    assert torch.equal(out, eager)
    assert torch.equal(pool, pool_e) and torch.equal(conv_pool, conv_e)
    assert torch.equal(inter.nan_to_num(7.0), inter_e.nan_to_num(7.0))
    assert not torch.equal(pool, pool0) and not torch.equal(conv_pool, conv0), "the pools must have been updated"


def test_compile_fullgraph_cpu_aot_eager():
    torch._dynamo.reset()
    compile_case("cpu", "aot_eager")


@needs_cuda
def test_compile_fullgraph_cuda_inductor():
    torch._dynamo.reset()
    compile_case("cuda", "inductor")


def test_compile_allocates_o_and_matches_the_oracle():
    # o=None inside the graph becomes a torch.empty of [B, T, HV, V]; the result is the oracle's.
    torch._dynamo.reset()
    build = dense(520, B=2, T=3, K=64, V=64)
    args, got = build("cpu")
    del args["o"]

    def f(args):
        return gdn.fused_decode(**args) * 2

    with torch.no_grad():
        out = torch.compile(f, fullgraph=True, backend="aot_eager")(args)
    ref_args, want = build("cpu")
    gdn.reference_fused_decode(**ref_args)
    assert_close(out / 2, want["o"], "o")
    compare({n: got[n] for n in ("state", "conv_pool")}, {n: want[n] for n in ("state", "conv_pool")})


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda a: a.pop("layout"), "layout is required"),
        (lambda a: a.update(norm_eps=-1.0), "norm_eps must be finite and >= 0, got -1.0"),
        (lambda a: a.update(update_state=1), "update_state must be a bool"),
    ],
    ids=["layout", "norm_eps", "flag"],
)
def test_compile_refuses_bad_scalars_with_the_eager_message(change, message):
    torch._dynamo.reset()
    args, _ = dense(530, B=2, dtype=F32)("cpu")
    change(args)

    def f(args):
        return gdn.fused_decode(**args) + 1

    with torch.no_grad(), pytest.raises(Exception, match=message):
        torch.compile(f, fullgraph=True, backend="aot_eager")(args)


def test_compile_refuses_requires_grad():
    torch._dynamo.reset()
    args, _ = dense(531, B=2, dtype=F32)("cpu")
    args["conv_weight"] = torch.nn.Parameter(args["conv_weight"])

    def f(args):
        return gdn.fused_decode(**args) + 1

    with pytest.raises(Exception, match="conv_weight requires grad, but gdn is inference-only"):
        torch.compile(f, fullgraph=True, backend="aot_eager")(args)


# --- CUDA graphs -------------------------------------------------------------------------------

@needs_cuda
@pytest.mark.parametrize("T,state_dtype", [(1, F32), (3, BF16)], ids=["T1-fp32", "T3-bf16"])
def test_cuda_graph_replay_with_new_inputs(T, state_dtype):
    B, H, HV, K, V, P = 4, 2, 4, 128, 128, 12
    static, _ = fused_args(Draw(540, "cuda"), B, T, H, HV, K, V, P, state_dtype=state_dtype, vllm_pool=True)
    D, L = static["mixed_qkv"].shape[2], static["conv_state"].shape[2]
    static["read_slots"] = torch.arange(B, dtype=torch.int32, device="cuda")
    static["write_slots"] = torch.arange(B, dtype=torch.int32, device="cuda") + B
    static["error_count"] = torch.zeros(1, dtype=torch.int32, device="cuda")
    static["inter"] = torch.full((B, T, HV, K, V), float("nan"), dtype=state_dtype, device="cuda")
    static["conv_inter"] = torch.full((B, T, D, L), float("nan"), dtype=BF16, device="cuda")

    graph = capture_graph(lambda: gdn.fused_decode(**static))

    gen = torch.Generator().manual_seed(541)
    for step in range(3):
        fresh, _ = fused_args(Draw(542 + step, "cuda"), B, T, H, HV, K, V, P, state_dtype=state_dtype,
                              vllm_pool=True)
        for name in ("mixed_qkv", "a", "b", "z"):
            static[name].copy_(fresh[name])
        perm = torch.randperm(P, generator=gen)[: 2 * B].to(torch.int32)
        read, write = perm[:B].clone(), perm[B:].clone()
        read[step % B] = -1  # a padding row
        static["read_slots"].copy_(read)
        static["write_slots"].copy_(write)
        for name in ("o", "inter", "conv_inter"):
            static[name].fill_(float("nan"))
        cpu = {n: (t.cpu().clone() if isinstance(t, torch.Tensor) else t) for n, t in static.items()}
        graph.replay()
        torch.cuda.synchronize()
        gdn.reference_fused_decode(**cpu)
        for name in ("o", "state", "inter", "error_count"):
            assert_close(static[name], cpu[name], f"{name} after replay {step}")
        for name in ("conv_state", "conv_inter"):
            assert torch.equal(static[name].cpu().nan_to_num(7.0), cpu[name].nan_to_num(7.0)), \
                f"{name} after replay {step}"
        assert (static["o"][step % B] == 0).all()


# --- stochastic rounding of 16-bit state stores (rounding_seed) ------------------------------------

def seeded(seed, value, state_dtype, B=3, T=2, H=2, HV=4, K=128, V=128, layout="KV"):
    """A dense fused call with the intermediate cache, both in state_dtype, an fp16 conv pool
    (never rounded stochastically), and rounding_seed = [value] (None: no seed) on the device."""

    def build(device):
        d = Draw(seed, device)
        args, seen = fused_args(d, B, T, H, HV, K, V, B, layout=layout, state_dtype=state_dtype, conv_dtype=F16)
        args["inter"] = d.nan((B, T) + tuple(args["state"].shape[1:]), state_dtype)
        if value is not None:
            args["rounding_seed"] = seed_tensor(value, device)
        return args, dict(seen, inter=args["inter"])

    return build


SR_STATE_DTYPES = [BF16, F16]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("state_dtype", SR_STATE_DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["VK", "KV"])
def test_rounding_seed_matches_oracle(device, state_dtype, layout):
    got, want = run_vs_oracle(seeded(700, 2 ** 63 - 1, state_dtype, layout=layout), device)
    # The kernel and the oracle draw the same random bits (src/rounding.h); see test_torch.py.
    for name in ("state", "inter"):
        assert fraction_differing(got[name], want[name]) < 0.01, f"{name}: {device} and the oracle drew other bits"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("state_dtype", SR_STATE_DTYPES, ids=str)
def test_rounding_seed_same_bits_other_seed_other_bits(device, state_dtype):
    runs = {}
    for name, value in (("first", -5), ("again", -5), ("other", -6), ("nearest", None)):
        args, seen = seeded(701, value, state_dtype)(device)
        gdn.fused_decode(**args)
        runs[name] = seen
    first = runs["first"]
    for name in ("o", "state", "inter", "conv_pool"):
        assert torch.equal(stored_bits(first[name]), stored_bits(runs["again"][name])), f"{name}: same seed, other bits"
    for other in ("other", "nearest"):
        # Neither o nor the conv pool is rounded stochastically.
        for name in ("o", "conv_pool"):
            assert torch.equal(stored_bits(first[name]), stored_bits(runs[other][name])), f"{other} changed {name}"
        for name in ("state", "inter"):
            assert fraction_differing(first[name], runs[other][name]) > 0.1, f"{name}: {other} changed too few bits"


@pytest.mark.parametrize("device", DEVICES)
def test_rounding_seed_leaves_an_fp32_state_alone(device):
    args, seeded_run = seeded(702, 11, F32)(device)
    gdn.fused_decode(**args)
    args, plain = seeded(702, None, F32)(device)
    gdn.fused_decode(**args)
    for name in plain:
        assert torch.equal(stored_bits(seeded_run[name]), stored_bits(plain[name])), f"the seed changed {name}"


@pytest.mark.parametrize(
    "seed,error,message",
    [
        (lambda: torch.zeros(1, dtype=torch.int32), ValueError, "^rounding_seed dtype must be int64, got int32"),
        (lambda: torch.zeros(3, dtype=torch.int64), ValueError, "^rounding_seed must hold exactly one element"),
        (lambda: torch.zeros(1, dtype=torch.int64, device="meta"), ValueError,
         "^rounding_seed must be on the CPU or a CUDA device"),
        (lambda: 3, TypeError, "^rounding_seed must be an int64 tensor of shape \\[1\\] on the state's device"),
    ],
    ids=["int32", "three-elements", "meta", "int"],
)
def test_rounding_seed_refused_naming_it(binding, seed, error, message):
    args, seen = seeded(703, None, BF16)("cpu")
    before = {n: t.clone() for n, t in seen.items()}
    with pytest.raises(error, match=message):
        gdn.fused_decode(**args, rounding_seed=seed())
    for n in seen:
        assert torch.equal(stored_bits(seen[n]), stored_bits(before[n])), f"{n} written on error"


@needs_cuda
def test_rounding_seed_on_another_device_is_refused():
    args, _ = seeded(704, 1, BF16)("cuda")
    with pytest.raises(ValueError, match="rounding_seed.*device|device.*rounding_seed"):
        gdn.fused_decode(**{**args, "rounding_seed": args["rounding_seed"].cpu()})


def test_custom_op_opcheck_with_rounding_seed():
    args, _ = seeded(705, 3, BF16, B=2, H=1, HV=2, K=64, V=64)("cpu")
    pos, kw = op_call(args)
    torch.library.opcheck(torch.ops.gdn.fused_decode.default, pos, kw,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration",
                                      "test_aot_dispatch_dynamic"))


def compile_with_seed_case(device, backend):
    # Two fused steps that advance their seed in place: compiled and eager runs from the same
    # start store the same bits and leave the same seed.
    def step(args, seed):
        o = gdn.fused_decode(**args, rounding_seed=seed)
        seed += 1
        return o.float() * 2

    runs = []
    for compiled in (False, True):
        args, seen = seeded(706, None, BF16)(device)
        seed = seed_tensor(-(2 ** 50), device)
        fn = torch.compile(step, fullgraph=True, backend=backend) if compiled else step
        with torch.no_grad():
            outs = [fn(args, seed), fn(args, seed)]
        runs.append((outs, seen, seed))
    (eager_outs, eager, eager_seed), (outs, got, seed) = runs
    assert seed.item() == eager_seed.item() == -(2 ** 50) + 2
    for x, y in zip(outs, eager_outs):
        assert torch.equal(x, y)
    for name in ("state", "inter", "conv_pool"):
        assert torch.equal(stored_bits(got[name]), stored_bits(eager[name])), f"compiled {name} differs from eager"


def test_compile_with_rounding_seed_cpu_aot_eager():
    torch._dynamo.reset()
    compile_with_seed_case("cpu", "aot_eager")


@needs_cuda
def test_compile_with_rounding_seed_cuda_inductor():
    torch._dynamo.reset()
    compile_with_seed_case("cuda", "inductor")


@needs_cuda
@pytest.mark.parametrize("state_dtype", SR_STATE_DTYPES, ids=str)
def test_cuda_graph_replay_advances_the_seed(state_dtype):
    # `seed += 1` captured after the call: each replay matches the oracle given the value the
    # previous replay left.
    static, _ = seeded(707, 0, state_dtype)("cuda")
    seed = static["rounding_seed"]

    def step():
        gdn.fused_decode(**static)
        seed.add_(1)

    graph = capture_graph(step)
    assert seed.item() == 1, "capture must not run the step"

    for i in range(3):
        fresh, _ = seeded(708 + i, None, state_dtype)("cuda")
        for name in ("mixed_qkv", "a", "b", "z"):
            static[name].copy_(fresh[name])
        static["o"].fill_(float("nan"))
        static["inter"].fill_(float("nan"))
        cpu = {n: (t.cpu().clone() if isinstance(t, torch.Tensor) else t) for n, t in static.items()}
        assert cpu["rounding_seed"].item() == 1 + i
        graph.replay()
        torch.cuda.synchronize()
        assert seed.item() == 2 + i
        gdn.reference_fused_decode(**cpu)
        for name in ("o", "state", "inter"):
            assert_close(static[name], cpu[name], f"{name} after replay {i}")
            if name != "o":
                assert fraction_differing(static[name], cpu[name]) < 0.01, f"{name} after replay {i}: other bits"
        assert torch.equal(static["conv_state"].cpu(), cpu["conv_state"]), f"conv_state after replay {i}"
