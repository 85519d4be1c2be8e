"""gdn with torch: CUDA tensors against the float64 oracle, the gdn::decode custom op under
torch.compile(fullgraph=True), CUDA-graph capture and replay with new inputs, the
FlashInfer shims, strided pools and packed qkv. Skipped with a reason where torch or a
CUDA device (or gdn's CUDA backend) is missing; the torch-on-CPU tests run wherever torch is
installed."""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the GPU machine's CI has it)")

import gdn  # noqa: E402  (after torch: the integration binds at import)
from gdn import flashinfer as fi  # noqa: E402
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


# --- helpers --------------------------------------------------------------------------------

def run_vs_oracle(build, device, **kwargs):
    """build(device) -> (decode kwargs, observed tensors). Runs gdn.decode on `device` and
    gdn.reference_decode on an identical CPU build; compares every observed tensor."""
    args, got = build(device)
    gdn.decode(**args, **kwargs)
    if device == "cuda":
        torch.cuda.synchronize()
    ref_args, want = build("cpu")
    gdn.reference_decode(**ref_args, **kwargs)
    for name in want:
        assert_close(got[name], want[name], name)
    return got, want


def dense(seed, B=4, T=1, H=2, HV=4, K=128, V=128, dtype=BF16, state_dtype=F32, layout="VK"):
    def build(device):
        d = Draw(seed, device)
        args = d.inputs(B, T, H, HV, K, V, dtype)
        args.update(state=d.pool(B, HV, K, V, layout, state_dtype), o=d.nan((B, T, HV, V), dtype), layout=layout)
        return args, {"o": args["o"], "state": args["state"]}

    return build


# --- torch tensors, any device ----------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,state_dtype", [(BF16, F32), (BF16, BF16), (F16, F16), (F32, F32)], ids=str)
@pytest.mark.parametrize("layout", ["VK", "KV"])
@pytest.mark.parametrize("T", [1, 4])
def test_dense(device, dtype, state_dtype, layout, T):
    run_vs_oracle(dense(100 + T, T=T, dtype=dtype, state_dtype=state_dtype, layout=layout), device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("K,V", [(64, 64), (256, 128), (128, 256)])
def test_head_dims(device, K, V):
    run_vs_oracle(dense(110, B=3, T=2, H=1, HV=2, K=K, V=V), device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("state_dtype", [F32, BF16], ids=str)
def test_pool_padding_split_and_bad_slots(device, state_dtype):
    B, T, H, HV, K, V, P = 6, 1, 2, 4, 128, 128, 16

    def build(dev):
        d = Draw(120, dev)
        args = d.inputs(B, T, H, HV, K, V)
        args.update(state=d.pool(P, HV, K, V, "VK", state_dtype), o=d.nan((B, T, HV, V), BF16), layout="VK")
        args["read_slots"] = torch.tensor([3, -1, 0, 9, 16, 5], dtype=torch.int32, device=dev)
        args["write_slots"] = torch.tensor([4, 7, 0, -1, 1, 6], dtype=torch.int64, device=dev)
        args["error_count"] = torch.zeros(1, dtype=torch.int32, device=dev)
        return args, {"o": args["o"], "state": args["state"], "error_count": args["error_count"]}

    got, _ = run_vs_oracle(build, device)
    assert got["error_count"].item() == 1  # slot 16 == P
    assert (got["o"][[1, 4]] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("state_dtype", [F32, BF16], ids=str)
def test_token_slots_num_accepted_and_cache(device, state_dtype):
    B, T, H, HV, K, V, P = 3, 4, 1, 2, 128, 128, 20

    def build(dev):
        d = Draw(130, dev)
        args = d.inputs(B, T, H, HV, K, V)
        args.update(state=d.pool(P, HV, K, V, "VK", state_dtype), o=d.nan((B, T, HV, V), BF16), layout="VK")
        args["token_slots"] = (1 + torch.arange(B * T, dtype=torch.int32)).reshape(B, T).to(dev)
        args["num_accepted"] = torch.tensor([1, 4, 2], dtype=torch.int32, device=dev)
        args["inter"] = d.nan((B, T, HV, V, K), state_dtype)
        return args, {"o": args["o"], "state": args["state"], "inter": args["inter"]}

    run_vs_oracle(build, device)


@pytest.mark.parametrize("device", DEVICES)
def test_update_state_false(device):
    build = dense(140, T=3)
    got, _ = run_vs_oracle(build, device, update_state=False)
    assert torch.equal(got["state"].cpu(), build("cpu")[0]["state"])


@pytest.mark.parametrize("device", DEVICES)
def test_pool_every_other_head(device):
    # pool[:, ::2]: a strided view of a wider pool; the other heads must stay bit-identical.
    B, T, H, HV, K, V, P = 3, 2, 1, 2, 128, 128, 6

    def build(dev):
        d = Draw(150, dev)
        args = d.inputs(B, T, H, HV, K, V)
        wide = d.pool(P, 2 * HV, K, V)
        args.update(state=wide[:, ::2], o=d.nan((B, T, HV, V), BF16), layout="VK")
        args["read_slots"] = torch.tensor([5, 0, 2], dtype=torch.int64, device=dev)
        return args, {"o": args["o"], "wide": wide}

    got, _ = run_vs_oracle(build, device)
    assert torch.equal(got["wide"][:, 1::2].cpu(), build("cpu")[1]["wide"][:, 1::2])


@pytest.mark.parametrize("device", DEVICES)
def test_packed_qkv(device):
    B, T, H, HV, K, V = 4, 2, 2, 4, 128, 128

    def build(dev):
        d = Draw(160, dev)
        qkv = d.normal((B, T, 2 * H * K + HV * V), BF16)
        ab = d.normal((B, T, 2 * HV), BF16)
        args = dict(
            q=qkv[..., : H * K].view(B, T, H, K), k=qkv[..., H * K: 2 * H * K].view(B, T, H, K),
            v=qkv[..., 2 * H * K:].view(B, T, HV, V), a=ab[..., :HV], b=ab[..., HV:],
            A_log=d.uniform((HV,), 1.0, 16.0).log(), dt_bias=d.normal((HV,), F32, 0.1),
            state=d.pool(B, HV, K, V), o=d.nan((B, T, HV, V), BF16), layout="VK")
        assert args["q"].data_ptr() == qkv.data_ptr() and not args["k"].is_contiguous()
        return args, {"o": args["o"], "state": args["state"]}

    run_vs_oracle(build, device)


@pytest.mark.parametrize("device", DEVICES)
def test_output_allocated_with_torch(device):
    args, _ = dense(170, B=2, T=1)(device)
    del args["o"]
    o = gdn.decode(**args)
    assert isinstance(o, torch.Tensor) and o.device.type == device and o.dtype == BF16
    assert o.shape == (2, 1, 4, 128) and torch.isfinite(o).all()
    assert gdn.decode(**args, o_dtype=torch.float32).dtype == torch.float32
    assert gdn.decode(**args, o_dtype="float16").dtype == torch.float16


def test_errors_name_the_argument():
    args, _ = dense(180, B=2)("cpu")
    with pytest.raises(ValueError, match="state.shape"):
        gdn.decode(**{**args, "state": args["state"][:, :, :64]})
    with pytest.raises(ValueError, match="must be on the CPU or a CUDA device"):
        gdn.decode(**{**args, "q": args["q"].to("meta")})
    with pytest.raises(ValueError, match="q dtype must be"):
        gdn.decode(**{**args, "q": args["q"].double(), "k": args["k"].double(), "v": args["v"].double()})


@pytest.fixture(params=bindings("decode"))
def binding(request, monkeypatch):
    monkeypatch.setattr(gdn, "_run", request.param)
    return request.param


@pytest.mark.parametrize("dtype", [torch.complex64, torch.bool, torch.uint16, torch.float8_e4m3fn, torch.float64],
                         ids=str)
def test_unsupported_torch_dtypes_are_named(binding, dtype):
    args, _ = dense(183, B=2)("cpu")
    with pytest.raises(ValueError) as info:
        gdn.decode(**{**args, "q": args["q"].to(dtype)})
    msg = str(info.value)
    name = str(dtype).removeprefix("torch.")
    assert msg.startswith("q dtype") and name in msg and "code" not in msg and "opaque" not in msg, msg


@pytest.mark.parametrize("name", ["q", "v", "A_log", "dt_bias", "state", "o"])
def test_requires_grad_refused_in_grad_mode(binding, name):
    args, got = dense(184, B=2, dtype=F32)("cpu")
    args[name] = args[name].detach().requires_grad_()
    before = {n: t.detach().clone() for n, t in got.items()}
    with pytest.raises(ValueError, match=f"^{name} requires grad, but gdn is inference-only .*torch.no_grad\\(\\)"):
        gdn.decode(**args)
    for n in got:
        assert torch.equal(got[n].detach().nan_to_num(7.0), before[n].nan_to_num(7.0)), f"{n} written on error"


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_parameters_accepted_without_grad_mode(binding, mode):
    # Models hold A_log and dt_bias as nn.Parameters and call gdn under no_grad / inference_mode.
    build = dense(185, B=3, T=2, dtype=F32)
    args, got = build("cpu")
    args["A_log"] = torch.nn.Parameter(args["A_log"])
    args["dt_bias"] = torch.nn.Parameter(args["dt_bias"])
    with mode():
        gdn.decode(**args)
    ref_args, want = build("cpu")
    gdn.reference_decode(**ref_args)
    for n in want:
        assert_close(got[n], want[n], n)


def test_custom_op_refuses_requires_grad():
    args, _ = dense(186, B=2, dtype=F32)("cpu")
    a_log = torch.nn.Parameter(args.pop("A_log"))
    call = dict(args, A_log=a_log)
    q, k, v, state, o = (call.pop(n) for n in ("q", "k", "v", "state", "o"))
    with pytest.raises(ValueError, match="^A_log requires grad, but gdn is inference-only"):
        torch.ops.gdn.decode(q, k, v, state, o, **call)
    q.requires_grad_()
    with pytest.raises(ValueError, match="^q requires grad, but gdn is inference-only"):
        torch.ops.gdn.decode(q, k, v, state, o, **call)
    with torch.no_grad():
        torch.ops.gdn.decode(q, k, v, state, o, **call)
    assert torch.isfinite(o).all()


def test_compile_refuses_requires_grad():
    # Under torch.compile the op's Autograd kernel refuses while the graph is traced; torch
    # reports it as its own error type, carrying gdn's message.
    torch._dynamo.reset()
    args, _ = dense(187, B=2, dtype=F32)("cpu")
    args["A_log"] = torch.nn.Parameter(args["A_log"])

    def f(args):
        return gdn.decode(**args) + 1

    with pytest.raises(Exception, match="A_log requires grad, but gdn is inference-only"):
        torch.compile(f, fullgraph=True, backend="aot_eager")(args)
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(f, fullgraph=True, backend="aot_eager")(args)
    assert torch.isfinite(out).all()


def test_compile_names_a_missing_layout():
    torch._dynamo.reset()
    args, _ = dense(188, B=2, dtype=F32)("cpu")
    del args["layout"]

    def f(args):
        return gdn.decode(**args) + 1

    with torch.no_grad(), pytest.raises(Exception, match="layout is required"):
        torch.compile(f, fullgraph=True, backend="aot_eager")(args)


def test_compile_refuses_an_int_flag():
    # The op's schema would read update_state=0 as False; an eager call refuses it, and so
    # must compiled code.
    torch._dynamo.reset()
    args, _ = dense(192, B=2, dtype=F32)("cpu")

    def f(args):
        return gdn.decode(**args, update_state=0) + 1

    with torch.no_grad(), pytest.raises(Exception, match="update_state must be a bool"):
        torch.compile(f, fullgraph=True, backend="aot_eager")(args)


@needs_cuda
def test_mixed_devices_rejected():
    args, _ = dense(181, B=2)("cuda")
    with pytest.raises(ValueError, match="device"):
        gdn.decode(**{**args, "a": args["a"].cpu()})


@needs_cuda
def test_side_stream():
    # The launch goes to torch's current stream: work queued before it on that stream
    # (the state written by a copy) must be seen by the kernel.
    build = dense(182, B=8, T=2)
    args, got = build("cuda")
    fresh = args["state"].clone()
    args["state"].zero_()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        args["state"].copy_(fresh)
        gdn.decode(**args)
    s.synchronize()
    ref_args, want = build("cpu")
    gdn.reference_decode(**ref_args)
    assert_close(got["o"], want["o"], "o")
    assert_close(got["state"], want["state"], "state")


@needs_cuda
def test_explicit_stream_object():
    # stream=torch.cuda.Stream: read through .cuda_stream; the call is ordered after work
    # queued on that stream, as with torch's current stream.
    build = dense(189, B=4, T=2)
    args, got = build("cuda")
    fresh = args["state"].clone()
    args["state"].zero_()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        args["state"].copy_(fresh)
    gdn.decode(**args, stream=s)
    s.synchronize()
    ref_args, want = build("cpu")
    gdn.reference_decode(**ref_args)
    assert_close(got["o"], want["o"], "o")
    assert_close(got["state"], want["state"], "state")


# --- the custom op and torch.compile --------------------------------------------------------------

def test_custom_op_registered():
    schema = torch.ops.gdn.decode.default._schema
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert written == {"state", "o", "inter", "error_count"}
    positional = [a.name for a in schema.arguments if not a.kwarg_only]
    assert positional == ["q", "k", "v", "state", "o"]
    kwargs = {a.name: a for a in schema.arguments if a.kwarg_only}
    assert not kwargs["layout"].has_default_value(), "layout is required: no default"
    assert all(a.has_default_value() for n, a in kwargs.items() if n != "layout")
    defaults = {n: a.default_value for n, a in kwargs.items() if n != "layout"}
    assert defaults["use_qk_l2norm"] is True and defaults["update_state"] is True
    assert defaults["check_duplicate_writes"] is False and defaults["scale"] is None and defaults["a"] is None
    assert defaults["rounding_seed"] is None and kwargs["rounding_seed"].type.str() == "Tensor?"
    assert str(schema).startswith("gdn::decode(Tensor q, Tensor k, Tensor v, Tensor(a!) state, Tensor(b!) o, *, ")


def test_custom_op_called_with_defaults():
    # Only the arguments a call needs, by name: the schema's defaults fill the rest.
    build = dense(191, B=2, T=2, K=64, V=64)
    args, got = build("cpu")
    ref_args, want = build("cpu")
    torch.ops.gdn.decode(args["q"], args["k"], args["v"], args["state"], args["o"], a=args["a"], b=args["b"],
                         A_log=args["A_log"], dt_bias=args["dt_bias"], layout="VK")
    gdn.reference_decode(**ref_args)
    for name in want:
        assert_close(got[name], want[name], name)


def test_custom_op_opcheck():
    args, _ = dense(190, B=2, T=2, K=64, V=64)("cpu")
    names = ["q", "k", "v", "state", "o", "a", "b", "A_log", "dt_bias", "g", "beta", "read_slots",
             "write_slots", "token_slots", "num_accepted", "inter", "error_count"]
    positional = [args[n] for n in names[:5]]
    keyword = {n: args.get(n) for n in names[5:]}
    torch.library.opcheck(torch.ops.gdn.decode.default, tuple(positional), dict(keyword, layout="VK"),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration",
                                      "test_aot_dispatch_dynamic"))


class Layer(torch.nn.Module):
    """A serving-shaped layer: fused qkv/ab projections sliced into views, a pool, gdn."""

    def __init__(self, H, HV, K, V, device):
        super().__init__()
        self.H, self.HV, self.K, self.V = H, HV, K, V
        d = Draw(200, device)
        self.register_buffer("A_log", d.uniform((HV,), 1.0, 16.0).log())
        self.register_buffer("dt_bias", d.normal((HV,), F32, 0.1))

    def forward(self, qkv, ab, pool, slots, inter):
        B, T = qkv.shape[:2]
        H, HV, K, V = self.H, self.HV, self.K, self.V
        q = qkv[..., : H * K].view(B, T, H, K)
        k = qkv[..., H * K: 2 * H * K].view(B, T, H, K)
        v = qkv[..., 2 * H * K:].view(B, T, HV, V)
        o = gdn.decode(q, k, v, pool, a=ab[..., :HV], b=ab[..., HV:], A_log=self.A_log,
                       dt_bias=self.dt_bias, read_slots=slots, inter=inter, layout="VK")
        return (o.float() * 2).flatten(2)


def compile_case(device, backend):
    B, T, H, HV, K, V, P = 3, 2, 2, 4, 128, 128, 8
    layer = Layer(H, HV, K, V, device)
    d = Draw(210, device)
    qkv = d.normal((B, T, 2 * H * K + HV * V), BF16)
    ab = d.normal((B, T, 2 * HV), BF16)
    wide = d.pool(P, 2 * HV, K, V)
    slots = torch.tensor([6, -1, 1], dtype=torch.int32, device=device)
    inter_e = d.nan((B, T, HV, V, K), F32)
    wide0, wide_e, inter_c = wide.clone(), wide.clone(), inter_e.clone()
    with torch.no_grad():
        eager = layer(qkv, ab, wide_e[:, ::2], slots, inter_e)
        compiled = torch.compile(layer, fullgraph=True, backend=backend)
        out = compiled(qkv, ab, wide[:, ::2], slots, inter_c)
    # Same computation, same kernels: bit-identical.
    assert torch.equal(out, eager)
    assert torch.equal(wide, wide_e)
    assert torch.equal(inter_c.nan_to_num(7.0), inter_e.nan_to_num(7.0))
    assert not torch.equal(wide, wide0), "the pool must have been updated"


def test_compile_fullgraph_cpu_aot_eager():
    torch._dynamo.reset()
    compile_case("cpu", "aot_eager")


@needs_cuda
def test_compile_fullgraph_cuda_inductor():
    torch._dynamo.reset()
    compile_case("cuda", "inductor")


@needs_cuda
def test_compile_flashinfer_shim():
    torch._dynamo.reset()
    B, T, H, HV, K, V, P = 4, 1, 2, 4, 128, 128, 9
    d = Draw(220, "cuda")
    x = d.inputs(B, T, H, HV, K, V)
    pool = d.pool(P, HV, K, V, "VK", BF16)
    idx = torch.tensor([8, 0, -1, 3], dtype=torch.int32, device="cuda")

    def step(x, pool, idx):
        out, _ = fi.gated_delta_rule_decode_pretranspose(
            x["q"], x["k"], x["v"], None, x["A_log"], x["a"], x["dt_bias"], x["b"],
            initial_state=pool, initial_state_indices=idx)
        return out

    pool_e = pool.clone()
    with torch.no_grad():
        eager = step(x, pool_e, idx)
        out = torch.compile(step, fullgraph=True)(x, pool, idx)
    assert torch.equal(out, eager) and torch.equal(pool, pool_e)


# --- CUDA graphs --------------------------------------------------------------------------------------

@needs_cuda
@pytest.mark.parametrize("T,state_dtype", [(1, F32), (3, BF16)], ids=["T1-fp32", "T3-bf16"])
def test_cuda_graph_replay_with_new_inputs(T, state_dtype):
    B, H, HV, K, V, P = 4, 2, 4, 128, 128, 12
    d = Draw(230, "cuda")
    static = d.inputs(B, T, H, HV, K, V)
    static.update(state=d.pool(P, HV, K, V, "VK", state_dtype), o=d.nan((B, T, HV, V), BF16), layout="VK")
    static["read_slots"] = torch.zeros(B, dtype=torch.int32, device="cuda")
    static["write_slots"] = torch.zeros(B, dtype=torch.int32, device="cuda")
    static["error_count"] = torch.zeros(1, dtype=torch.int32, device="cuda")
    static["inter"] = d.nan((B, T, HV, V, K), state_dtype)
    static["read_slots"].copy_(torch.arange(B))
    static["write_slots"].copy_(torch.arange(B) + B)

    graph = capture_graph(lambda: gdn.decode(**static))

    gen = torch.Generator().manual_seed(231)
    for step in range(3):
        fresh = Draw(232 + step, "cuda").inputs(B, T, H, HV, K, V)
        for name, t in fresh.items():
            static[name].copy_(t)
        perm = torch.randperm(P, generator=gen)[: 2 * B].to(torch.int32)
        read, write = perm[:B].clone(), perm[B:].clone()
        read[step % B] = -1  # a padding row
        static["read_slots"].copy_(read)
        static["write_slots"].copy_(write)
        static["o"].fill_(float("nan"))
        static["inter"].fill_(float("nan"))
        cpu = {n: (t.cpu().clone() if isinstance(t, torch.Tensor) else t) for n, t in static.items()}
        graph.replay()
        torch.cuda.synchronize()
        gdn.reference_decode(**cpu)
        for name in ("o", "state", "inter", "error_count"):
            assert_close(static[name], cpu[name], f"{name} after replay {step}")
        assert (static["o"][step % B] == 0).all()


# --- stochastic rounding of 16-bit state stores (rounding_seed) ------------------------------------

def seeded_pool(seed, value, state_dtype, B=4, T=2, H=2, HV=4, K=128, V=128, P=9, layout="VK"):
    """A pool call (rows read slots other than their index) with the intermediate cache, both
    in state_dtype, and rounding_seed = [value] (None: no seed) on the call's device. Observed:
    o, the pool, inter, and the slots written."""

    def build(dev):
        d = Draw(seed, dev)
        args = d.inputs(B, T, H, HV, K, V)
        args.update(state=d.pool(P, HV, K, V, layout, state_dtype), o=d.nan((B, T, HV, V), BF16), layout=layout)
        args["read_slots"] = torch.randperm(P, generator=d.gen)[:B].to(torch.int32).to(dev)
        args["inter"] = d.nan((B, T) + tuple(args["state"].shape[1:]), state_dtype)
        if value is not None:
            args["rounding_seed"] = seed_tensor(value, dev)
        return args, {"o": args["o"], "state": args["state"], "inter": args["inter"]}

    return build


def stored(args, seen):
    """What a seeded_pool call stored in the state's dtype: the slots it wrote, and inter."""
    slots = args["read_slots"].long()
    return {"state": seen["state"][slots], "inter": seen["inter"]}


SR_STATE_DTYPES = [BF16, F16]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("state_dtype", SR_STATE_DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["VK", "KV"])
def test_rounding_seed_matches_oracle(device, state_dtype, layout):
    build = seeded_pool(600, -(2 ** 62) + 12345, state_dtype, layout=layout)
    args, got = build(device)
    gdn.decode(**args)
    ref_args, want = build("cpu")
    gdn.reference_decode(**ref_args)
    for name in want:
        assert_close(got[name], want[name], name)
    # The backend and the oracle draw the same random bits (src/rounding.h): their stores differ
    # only where their fp32 values straddle a rounding threshold, a few in 10^4; nearest
    # rounding, or other bits, would differ in a quarter to a third of the elements.
    got, want = stored(args, got), stored(ref_args, want)
    for name in want:
        assert fraction_differing(got[name], want[name]) < 0.01, f"{name}: {device} and the oracle drew other bits"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("state_dtype", SR_STATE_DTYPES, ids=str)
def test_rounding_seed_same_bits_other_seed_other_bits(device, state_dtype):
    runs = {}
    for name, value in (("first", 77), ("again", 77), ("other", 78), ("nearest", None)):
        args, seen = seeded_pool(601, value, state_dtype)(device)
        gdn.decode(**args)
        runs[name] = seen
    first = runs["first"]
    for name in ("o", "state", "inter"):
        assert torch.equal(stored_bits(first[name]), stored_bits(runs["again"][name])), f"{name}: same seed, other bits"
    for other in ("other", "nearest"):
        # o comes from the fp32 state before any store: the seed has no effect on it.
        assert torch.equal(stored_bits(first["o"]), stored_bits(runs[other]["o"])), f"{other} changed o"
        # Two stochastic roundings of one value differ with probability 2p(1 - p) (a third on
        # average), stochastic and nearest rounding with probability min(p, 1 - p).
        x, y = stored(args, first), stored(args, runs[other])
        for name in x:
            assert fraction_differing(x[name], y[name]) > 0.1, f"{name}: {other} changed too few bits"


@pytest.mark.parametrize("device", DEVICES)
def test_rounding_seed_leaves_an_fp32_state_alone(device):
    build = seeded_pool(602, 5, F32)
    seeded_args, seeded = build(device)
    gdn.decode(**seeded_args)
    plain_args, plain = seeded_pool(602, None, F32)(device)
    gdn.decode(**plain_args)
    for name in plain:
        assert torch.equal(stored_bits(seeded[name]), stored_bits(plain[name])), f"the seed changed an fp32 {name}"


@pytest.mark.parametrize(
    "seed,error,message",
    [
        (lambda: torch.zeros(1, dtype=torch.int32), ValueError, "^rounding_seed dtype must be int64, got int32"),
        (lambda: torch.zeros(1, dtype=torch.float64), ValueError, "^rounding_seed dtype must be int64, got float64"),
        (lambda: torch.zeros(2, dtype=torch.int64), ValueError, "^rounding_seed must hold exactly one element"),
        (lambda: torch.zeros(1, 1, dtype=torch.int64), ValueError, "^rounding_seed must have rank 1"),
        (lambda: torch.tensor(3), ValueError, "^rounding_seed must have rank >= 1, got a 0-d tensor"),
        (lambda: torch.zeros(1, dtype=torch.int64, device="meta"), ValueError,
         "^rounding_seed must be on the CPU or a CUDA device, got torch device 'meta'"),
        (lambda: 3, TypeError, "^rounding_seed must be an int64 tensor of shape \\[1\\] on the state's device, got int "
                               "\\(3\\): e.g. torch.tensor\\(\\[3\\], device=state.device\\).*seed \\+= 1"),
    ],
    ids=["int32", "float64", "two-elements", "rank-2", "0-d", "meta", "int"],
)
def test_rounding_seed_refused_naming_it(binding, seed, error, message):
    args, got = seeded_pool(603, None, BF16)("cpu")
    before = {n: t.clone() for n, t in got.items()}
    with pytest.raises(error, match=message):
        gdn.decode(**args, rounding_seed=seed())
    for n in got:
        assert torch.equal(stored_bits(got[n]), stored_bits(before[n])), f"{n} written on error"


@needs_cuda
def test_rounding_seed_on_another_device_is_refused():
    args, _ = seeded_pool(604, 1, BF16)("cuda")
    with pytest.raises(ValueError, match="rounding_seed.*device|device.*rounding_seed"):
        gdn.decode(**{**args, "rounding_seed": args["rounding_seed"].cpu()})
    args, _ = seeded_pool(604, 1, BF16)("cpu")
    with pytest.raises(ValueError, match="rounding_seed.*device|device.*rounding_seed"):
        gdn.decode(**{**args, "rounding_seed": args["rounding_seed"].cuda()})


def test_custom_op_opcheck_with_rounding_seed():
    args, _ = seeded_pool(605, 9, BF16, B=2, T=2, H=1, HV=2, K=64, V=64, P=4)("cpu")
    positional = tuple(args.pop(n) for n in ("q", "k", "v", "state", "o"))
    torch.library.opcheck(torch.ops.gdn.decode.default, positional, args,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration",
                                      "test_aot_dispatch_dynamic"))


def compile_with_seed_case(device, backend, state_dtype=BF16):
    # A decode step that advances its seed in place, as a serving loop would: compiled and
    # eager runs of two steps from the same start store the same bits and leave the same seed.
    def step(args, seed):
        o = gdn.decode(**args, rounding_seed=seed)
        seed += 1
        return o.float() * 2

    runs = []
    for compiled in (False, True):
        args, seen = seeded_pool(606, None, state_dtype)(device)
        seed = seed_tensor(2 ** 40, device)
        fn = torch.compile(step, fullgraph=True, backend=backend) if compiled else step
        with torch.no_grad():
            outs = [fn(args, seed), fn(args, seed)]
        runs.append((outs, seen, seed))
    (eager_outs, eager, eager_seed), (outs, got, seed) = runs
    assert seed.item() == eager_seed.item() == 2 ** 40 + 2
    for x, y in zip(outs, eager_outs):
        assert torch.equal(x, y)
    for name in ("state", "inter"):
        assert torch.equal(stored_bits(got[name]), stored_bits(eager[name])), f"compiled {name} differs from eager"


def test_compile_with_rounding_seed_cpu_aot_eager():
    torch._dynamo.reset()
    compile_with_seed_case("cpu", "aot_eager")


@needs_cuda
def test_compile_with_rounding_seed_cuda_inductor():
    torch._dynamo.reset()
    compile_with_seed_case("cuda", "inductor")


def test_compile_refuses_an_int_seed():
    torch._dynamo.reset()
    args, _ = seeded_pool(607, None, BF16)("cpu")

    def f(args):
        return gdn.decode(**args, rounding_seed=7) + 1

    with torch.no_grad(), pytest.raises(Exception, match="rounding_seed must be an int64 tensor of shape \\[1\\]"):
        torch.compile(f, fullgraph=True, backend="aot_eager")(args)


@needs_cuda
@pytest.mark.parametrize("state_dtype", SR_STATE_DTYPES, ids=str)
def test_cuda_graph_replay_advances_the_seed(state_dtype):
    # `seed += 1` captured after the call: each replay reads the value the previous one left,
    # so every step draws new bits, and each matches the oracle given that step's value.
    build = seeded_pool(608, 1000, state_dtype)
    static, _ = build("cuda")
    seed = static["rounding_seed"]

    def step():
        gdn.decode(**static)
        seed.add_(1)

    graph = capture_graph(step)
    assert seed.item() == 1001, "capture must not run the step"

    for i in range(3):
        fresh = Draw(609 + i, "cuda").inputs(4, 2, 2, 4, 128, 128)
        for name, t in fresh.items():
            static[name].copy_(t)
        static["o"].fill_(float("nan"))
        static["inter"].fill_(float("nan"))
        cpu = {n: (t.cpu().clone() if isinstance(t, torch.Tensor) else t) for n, t in static.items()}
        assert cpu["rounding_seed"].item() == 1001 + i
        graph.replay()
        torch.cuda.synchronize()
        assert seed.item() == 1002 + i
        gdn.reference_decode(**cpu)
        for name in ("o", "state", "inter"):
            assert_close(static[name], cpu[name], f"{name} after replay {i}")
        got, want = stored(static, static), stored(cpu, cpu)
        for name in want:
            assert fraction_differing(got[name], want[name]) < 0.01, f"{name} after replay {i}: other bits"


# --- FlashInfer shims on CUDA --------------------------------------------------------------------

@needs_cuda
@pytest.mark.parametrize("state_dtype", [F32, BF16], ids=str)
def test_flashinfer_pretranspose_pool(state_dtype):
    B, T, H, HV, K, V, P = 4, 1, 2, 4, 128, 128, 9

    def build(dev):
        d = Draw(240, dev)
        x = d.inputs(B, T, H, HV, K, V)
        pool = d.pool(P, HV, K, V, "VK", state_dtype)
        idx = torch.tensor([8, 0, -1, 3], dtype=torch.int64, device=dev)
        return x, pool, idx

    x, pool, idx = build("cuda")
    out, ret = fi.gated_delta_rule_decode_pretranspose(
        x["q"], x["k"], x["v"], None, x["A_log"], x["a"], x["dt_bias"], x["b"],
        initial_state=pool, initial_state_indices=idx)
    assert ret is pool and out.dtype == BF16 and (out[2] == 0).all()
    rx, rpool, ridx = build("cpu")
    want = gdn.reference_decode(rx["q"], rx["k"], rx["v"], rpool, a=rx["a"], b=rx["b"], A_log=rx["A_log"],
                                dt_bias=rx["dt_bias"], read_slots=ridx, layout="VK")
    assert_close(out, want, "o")
    assert_close(pool, rpool, "state")


@needs_cuda
def test_flashinfer_nontranspose_and_mtp():
    B, H, HV, K, V = 3, 2, 4, 128, 128
    d = Draw(250, "cuda")
    x = d.inputs(B, 1, H, HV, K, V)
    state = d.pool(B, HV, K, V, "KV")
    cpu = {n: t.cpu() for n, t in x.items()}
    want_state = state.cpu()
    out, ret = fi.gated_delta_rule_decode(x["q"], x["k"], x["v"], state, x["A_log"], x["a"], x["dt_bias"], x["b"])
    want = gdn.reference_decode(cpu["q"], cpu["k"], cpu["v"], want_state, a=cpu["a"], b=cpu["b"],
                                A_log=cpu["A_log"], dt_bias=cpu["dt_bias"], layout="KV")
    assert ret is state
    assert_close(out, want, "o")
    assert_close(state, want_state, "state")

    T, P = 4, 16
    x = d.inputs(B, T, H, HV, K, V)
    pool = d.pool(P, HV, K, V)
    buf = d.nan((B + 1, T, HV, V, K), F32)
    idx = torch.tensor([2, 7, 11], dtype=torch.int32, device="cuda")
    cpu = {n: t.cpu() for n, t in x.items()}
    want_pool, want_buf = pool.cpu(), buf[:B].cpu()
    out, ret = fi.gated_delta_rule_mtp(x["q"], x["k"], x["v"], pool, idx, x["A_log"], x["a"], x["dt_bias"], x["b"],
                                       intermediate_states_buffer=buf, disable_state_update=True)
    want = gdn.reference_decode(cpu["q"], cpu["k"], cpu["v"], want_pool, a=cpu["a"], b=cpu["b"],
                                A_log=cpu["A_log"], dt_bias=cpu["dt_bias"], read_slots=idx.cpu(),
                                inter=want_buf, update_state=False, layout="VK")
    assert ret is pool
    assert_close(out, want, "o")
    assert torch.equal(pool.cpu(), want_pool)
    assert_close(buf[:B], want_buf, "inter")
    assert torch.isnan(buf[B:]).all()


def test_eager_calls_bypass_the_dispatcher():
    # Eager calls go straight to the binding (the op costs tens of microseconds); only
    # compiled code uses torch.ops.gdn.decode. Guard that the switch is the compile flag.
    import gdn._torch as gt

    assert gt.op is torch.ops.gdn.decode.default
    assert gt.compiling() is False


def test_gdn_imported_before_torch_compiles_without_graph_break():
    # `import gdn` before `import torch` (isort's order) must still give a full graph on
    # the first call, which is a compiled one: the import hook binds torch on its import.
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import sys
        import gdn
        assert "torch" not in sys.modules
        import torch
        assert gdn._torch_api is not None, "torch integration not bound by the import hook"
        B, T, H, HV, K, V = 2, 1, 1, 2, 64, 64
        args = dict(q=torch.randn(B, T, H, K), k=torch.randn(B, T, H, K), v=torch.randn(B, T, HV, V),
                    a=torch.randn(B, T, HV), b=torch.randn(B, T, HV), A_log=torch.zeros(HV),
                    dt_bias=torch.zeros(HV), state=torch.zeros(B, HV, V, K))
        def f(args):
            return gdn.decode(**args, layout="VK") + 1
        with torch.no_grad():
            out = torch.compile(f, fullgraph=True, backend="aot_eager")(args)
        assert out.shape == (B, T, HV, V)
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


# --- gdn.fla drop-ins with torch ----------------------------------------------------------------------

def fla_inputs(d, N, T, H, HV, K, V, dtype=BF16, flat=False):
    """FLA-style inputs: precomputed gates (g fp32 as transformers computes it, beta in the inputs' dtype)."""
    x = dict(q=d.normal((N, T, H, K), dtype), k=d.normal((N, T, H, K), dtype), v=d.normal((N, T, HV, V), dtype),
             g=d.uniform((N, T, HV), 0.05, 1.0).log(), beta=d.uniform((N, T, HV), 0.0, 1.0, dtype))
    if flat:
        x = {n: t.reshape((1, N * T) + tuple(t.shape[2:])) for n, t in x.items()}
    return x


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("state_dtype", [F32, BF16], ids=str)
def test_fla_transformers_decode_step(device, state_dtype):
    # transformers' Qwen3-Next decode: q and k repeat_interleave'd to HV heads, v a view of
    # the conv output, the cached state updated through initial_state / output_final_state.
    from gdn import fla

    B, H, HV, K, V = 3, 2, 4, 128, 128
    d = Draw(300, device)
    x = fla_inputs(d, B, 1, H, HV, K, V)
    mixed = d.normal((B, 1, 2 * HV * K + HV * V), BF16)
    v = mixed[..., 2 * HV * K:].reshape(B, 1, HV, V)
    q = x["q"].repeat_interleave(HV // H, dim=2)
    k = x["k"].repeat_interleave(HV // H, dim=2)
    state = d.pool(B, HV, K, V, "KV", state_dtype)
    ref = {n: t.cpu().clone() for n, t in dict(q=q, k=k, v=v, g=x["g"], beta=x["beta"], state=state).items()}
    with torch.no_grad():
        o, final = fla.fused_recurrent_gated_delta_rule(q, k, v, g=x["g"], beta=x["beta"], initial_state=state,
                                                        output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert final is state and o.shape == v.shape and o.dtype == BF16
    want = gdn.reference_decode(ref["q"], ref["k"], ref["v"], ref["state"], g=ref["g"], beta=ref["beta"],
                                layout="KV")
    if device == "cuda":
        torch.cuda.synchronize()
    assert_close(o, want, "o")
    assert_close(state, ref["state"], "final_state")


@pytest.mark.parametrize("device", DEVICES)
def test_fla_vllm_spec_decode(device):
    from gdn import fla

    N, T, H, HV, K, V, P = 3, 3, 2, 4, 128, 128, 16
    d = Draw(310, device)
    x = fla_inputs(d, N, T, H, HV, K, V, flat=True)
    pool = d.pool(P, HV, K, V, "KV")
    idx = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [-1, -1, -1, -1]], dtype=torch.int32, device=device)
    accepted = torch.tensor([2, 1, 1], dtype=torch.int32, device=device)
    cu = torch.arange(0, N * T + 1, T, dtype=torch.int32, device=device)
    ref = {n: t.cpu().clone() for n, t in x.items()}
    want_pool = pool.cpu().clone()
    with torch.no_grad():
        o, final = fla.fused_recurrent_gated_delta_rule_vllm(
            q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], initial_state=pool, inplace_final_state=True,
            cu_seqlens=cu, ssm_state_indices=idx, num_accepted_tokens=accepted, use_qk_l2norm_in_kernel=True)
    assert final is pool and o.shape == (1, N * T, HV, V)
    rows = {n: t.reshape((N, T) + tuple(t.shape[2:])) for n, t in ref.items()}
    want = gdn.reference_decode(rows["q"], rows["k"], rows["v"], want_pool, g=rows["g"], beta=rows["beta"],
                                token_slots=idx[:, :T].cpu(), num_accepted=accepted.cpu(), layout="KV")
    if device == "cuda":
        torch.cuda.synchronize()
    assert_close(o.reshape(N, T, HV, V), want, "o")
    assert_close(pool, want_pool, "pool")
    assert (o.reshape(N, T, HV, V)[2] == 0).all()


def test_fla_vllm_compiles_without_graph_break():
    # vLLM compiles its model with torch.compile: the drop-in (varlen views, allocation of o)
    # must trace as one graph, bit-identical to eager.
    from gdn import fla

    torch._dynamo.reset()
    N, T, H, HV, K, V, P = 4, 1, 2, 4, 64, 64, 9
    d = Draw(320, "cpu")
    x = fla_inputs(d, N, T, H, HV, K, V, flat=True)
    pool = d.pool(P, HV, K, V, "KV")
    pool_e = pool.clone()
    idx = torch.tensor([8, 0, -1, 3], dtype=torch.int32)
    cu = torch.arange(N + 1, dtype=torch.int32)

    def step(x, pool, idx, cu):
        o, _ = fla.fused_recurrent_gated_delta_rule_vllm(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                                         initial_state=pool, cu_seqlens=cu,
                                                         ssm_state_indices=idx, use_qk_l2norm_in_kernel=True)
        return o * 2

    with torch.no_grad():
        eager = step(x, pool_e, idx, cu)
        out = torch.compile(step, fullgraph=True, backend="aot_eager")(x, pool, idx, cu)
    assert torch.equal(out, eager) and torch.equal(pool, pool_e)


@needs_cuda
def test_fla_vllm_cuda_graph_replay():
    # vLLM captures decode in CUDA graphs: cu_seqlens and the slots stay on the device (never
    # read on the host), and new slot values copied in before a replay take effect.
    from gdn import fla

    N, T, H, HV, K, V, P = 4, 1, 2, 4, 128, 128, 12
    d = Draw(330, "cuda")
    static = fla_inputs(d, N, T, H, HV, K, V, flat=True)
    pool = d.pool(P, HV, K, V, "KV")
    idx = torch.arange(N, dtype=torch.int32, device="cuda")
    cu = torch.arange(N + 1, dtype=torch.int32, device="cuda")
    out = {}

    def step():
        out["o"], _ = fla.fused_recurrent_gated_delta_rule_vllm(
            static["q"], static["k"], static["v"], static["g"], static["beta"], initial_state=pool, cu_seqlens=cu,
            ssm_state_indices=idx, use_qk_l2norm_in_kernel=True)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        step()
    fresh = fla_inputs(Draw(331, "cuda"), N, T, H, HV, K, V, flat=True)
    for n, t in fresh.items():
        static[n].copy_(t)
    idx.copy_(torch.tensor([5, -1, 0, 11], dtype=torch.int32))
    cpu = {n: t.cpu().reshape((N, T) + tuple(t.shape[2:])) for n, t in static.items()}
    want_pool = pool.cpu().clone()
    graph.replay()
    torch.cuda.synchronize()
    want = gdn.reference_decode(cpu["q"], cpu["k"], cpu["v"], want_pool, g=cpu["g"], beta=cpu["beta"],
                                read_slots=idx.cpu(), layout="KV")
    assert_close(out["o"].reshape(N, T, HV, V), want, "o")
    assert_close(pool, want_pool, "pool")
