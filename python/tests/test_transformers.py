"""gdn.transformers on tiny random-initialised transformers models of the three GDN families
(Qwen3-Next, Qwen3.5, Qwen3.5-MoE): 32 greedy tokens with and without gdn, a multi-token step
(T = 2..4) continuing from the cache, a bf16 step against the same step in fp32, and what
enable routes and what it leaves to transformers. The models are small (hidden 64, 4 layers of
which 3 GDN) but their GDN heads are real: K = V = 128, conv W = 4, H = 2 key heads for HV = 4
value heads (GVA, which Qwen3-Next's per-key-head interleaving of q | k | v | z depends on).
Runs on the CPU (gdn's CPU backend) and on CUDA (skipped with a reason without a GPU or gdn's
CUDA backend). Skipped with a reason without torch, transformers or the model classes.

The seed is fresh each run (GDN_TEST_SEED fixes it) and printed on failure.

Tolerance (fp32 models): RTOL = 1e-4, relative Frobenius error per vector (a logits row, a GDN
layer's output row, a conv-state column, a recurrent state per (row, head)) against max(its
norm, 1/16 of the tensor's RMS vector norm), section 5's cancellation floor. Both paths compute
in fp32 and differ only in rounding: gdn is held to 1e-5 per vector against the float64 oracle
(semantics.md section 5), transformers' torch path rounds the same operations in another order
(for T > 1 by its chunked algorithm), and the model feeds the difference back through 3 GDN
layers, the attention layer and up to 31 decode steps through the states (the decays are slow on
purpose, so a state remembers those steps): 10x the one-call bound. Observed: below 1e-5 on
every vector (all tests pass at RTOL = 1e-5). A bug in what gdn.transformers wires (a head
order, a gate, A_log off by 0.1%, the norm's eps, the mask, a stale state) fails by far more.
Greedy tokens may differ only where the reference's two logits are within the logits'
tolerance of each other (both choices are then right); the runs are compared up to there.
The bf16 test has its own yardsticks (its docstring).
"""

import copy
import importlib
import inspect
import os
import random

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the GPU machine's CI has it)")
pytest.importorskip("transformers", reason="transformers is not installed (python3 -m pip install transformers)")

import gdn  # noqa: E402
import gdn.transformers as gdn_tf  # noqa: E402
import torch_testing  # noqa: E402
from torch_testing import DEVICES  # noqa: E402

RTOL = 1e-4
B, PROMPT, NEW_TOKENS, VOCAB = 2, 7, 32, 128
GDN_LAYERS = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)

# (family, modeling module, config class, model class, family-specific config, conv bias):
# the conv bias is None in the real models; one family gets one so that gdn's bias path is
# wired through a model too.
FAMILIES = {
    "qwen3_next": ("transformers.models.qwen3_next", "Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(intermediate_size=128, **MOE), False),
    "qwen3_5": ("transformers.models.qwen3_5", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM",
                dict(intermediate_size=128), False),
    "qwen3_5_moe": ("transformers.models.qwen3_5_moe", "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
                    dict(MOE), True),
}


@pytest.fixture
def seed():
    """A fresh seed per test (GDN_TEST_SEED fixes it); pytest shows the line when the test fails."""
    s = int(os.environ.get("GDN_TEST_SEED", random.SystemRandom().randrange(1 << 30)))
    print(f"seed {s} (GDN_TEST_SEED={s} repeats this run)")
    torch.manual_seed(s)
    return s


@pytest.fixture(autouse=True)
def no_tf32():
    """fp32 means fp32 on CUDA too: cuDNN's default TF32 convolutions (transformers' conv path)
    would put 1e-3 errors into the reference side."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def any_family():
    family = next((f for f in FAMILIES if _has(f)), None)
    if family is None:
        pytest.skip("this transformers has none of " + ", ".join(m for _, _, m, _, _ in FAMILIES.values()))
    return family


@pytest.fixture(autouse=True)
def torch_reference(monkeypatch):
    """transformers' PyTorch path as the reference, also where FLA or causal-conv1d is installed
    (transformers then calls their kernels, whose fp32 matrix products may run in TF32): the
    modeling modules' conv and recurrence functions unwrapped to the torch functions they wrap."""
    for module, _, _, _, _ in FAMILIES.values():
        try:
            m = importlib.import_module(module + ".modeling_" + module.rsplit(".", 1)[1])
        except ImportError:
            continue
        for name in ("causal_conv1d_fn", "causal_conv1d_update", "torch_chunk_gated_delta_rule",
                     "torch_recurrent_gated_delta_rule"):
            if hasattr(m, name):
                monkeypatch.setattr(m, name, inspect.unwrap(getattr(m, name)))


def model_classes(family):
    module, config_name, model_name, extra, bias = FAMILIES[family]
    try:
        m = importlib.import_module(module)
        return getattr(m, config_name), getattr(m, model_name), extra, bias
    except (ImportError, AttributeError) as e:
        pytest.skip(f"this transformers has no {model_name} ({type(e).__name__}: {e})")


def make_model(family, device, dtype=torch.float32, layer_types=GDN_LAYERS, **config):
    """A tiny random model of `family` with real GDN head shapes. initializer_range 0.1 makes a
    GDN layer's output about 0.6 of the residual it is added to (at transformers' 0.02 it is
    1e-3 of it, and the logits would hardly see the layer). The GDN parameters are redrawn:
    A = exp(A_log) in U(0.01, 1) so that a state remembers tens of steps (transformers' init
    draws A up to 16, which forgets within a step or two), dt_bias and the norm weight
    random instead of ones."""
    Config, Model, extra, bias = model_classes(family)
    shape = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=len(layer_types), num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32, initializer_range=0.1, linear_key_head_dim=128,
                 linear_value_head_dim=128, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_conv_kernel_dim=4, layer_types=list(layer_types))
    model = Model(Config(**{**shape, **extra, **config})).eval()
    with torch.no_grad():
        for layer in gdn_layers(model):
            layer.A_log.copy_(torch.empty_like(layer.A_log).uniform_(0.01, 1.0).log())
            layer.dt_bias.copy_(0.5 * torch.randn_like(layer.dt_bias))
            layer.norm.weight.copy_(1.0 + 0.5 * torch.randn_like(layer.norm.weight))
            if bias:
                layer.conv1d.bias = torch.nn.Parameter(0.1 * torch.randn(layer.conv_dim))
    return model.to(device=device, dtype=dtype)


def gdn_layers(model):
    return [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]


def ids(n, device):
    return torch.randint(0, VOCAB, (B, n)).to(device)


class Recorder:
    """Records every GDN layer's output (forward hooks) and counts gdn.fused_decode calls."""

    def __init__(self, model):
        self.outputs, self.calls = [], 0
        self.hooks = [m.register_forward_hook(lambda m, args, out: self.outputs.append(out.detach().clone()))
                      for m in gdn_layers(model)]
        self.patch = pytest.MonkeyPatch()
        fused = gdn.fused_decode

        def counted(*args, **kwargs):
            self.calls += 1
            return fused(*args, **kwargs)

        self.patch.setattr(gdn, "fused_decode", counted)

    def close(self):
        for h in self.hooks:
            h.remove()
        self.patch.undo()


def record(model, fn):
    rec = Recorder(model)
    try:
        with torch.no_grad():
            out = fn()
    finally:
        rec.close()
    return out, rec


def rel_errors(got, want, dim=-1):
    """Relative Frobenius error of every vector along `dim`, against max(its norm, 1/16 of the
    tensor's RMS vector norm): section 5's cancellation floor, since a vector far below the
    tensor's scale carries the absolute rounding error of that scale."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    assert got.shape == want.shape, f"{tuple(got.shape)} vs {tuple(want.shape)}"
    norms = want.norm(dim=dim)
    floor = norms.square().mean().sqrt() / 16
    return (got - want).norm(dim=dim) / torch.maximum(norms, floor).clamp_min(1e-30)


def assert_close(got, want, name, dim=-1):
    err = rel_errors(got, want, dim)
    assert err.max() <= RTOL, (f"{name}: relative error per vector up to {err.max():.3g} > {RTOL} "
                               f"(median {err.median():.3g})")


def gdn_states(cache, model):
    """(conv_state, recurrent_state) of every GDN layer of the model in the cache."""
    out = []
    for layer in gdn_layers(model):
        cl = cache.layers[layer.layer_idx]
        conv, rec = cl.conv_states, cl.recurrent_states
        out.append((conv[0], rec[0]) if isinstance(conv, dict) else (conv, rec))
    return out


def upcast_gdn_states(cache, model):
    """The GDN layers' states in the cache replaced by fp32 copies."""
    for layer in gdn_layers(model):
        cl = cache.layers[layer.layer_idx]
        if isinstance(cl.conv_states, dict):
            cl.conv_states[0], cl.recurrent_states[0] = cl.conv_states[0].float(), cl.recurrent_states[0].float()
        else:
            cl.conv_states, cl.recurrent_states = cl.conv_states.float(), cl.recurrent_states.float()


def assert_caches_close(got, want, model):
    """Conv states per column (one input vector), recurrent states per (row, head) matrix: a
    single state row can be ill-conditioned (delta = v - S^T k cancels), and amplifies the
    rounding-level differences of its inputs to 2-5e-5 in either fp32 implementation against
    a float64 run of the same model."""
    for i, ((gc, gr), (wc, wr)) in enumerate(zip(gdn_states(got, model), gdn_states(want, model))):
        assert gc.dtype == wc.dtype and gr.dtype == wr.dtype
        assert_close(gc, wc, f"GDN layer {i}: conv state [B, D, W] per column", dim=1)
        assert_close(gr.flatten(2), wr.flatten(2), f"GDN layer {i}: recurrent state [B, HV, K, V] per (row, head)")


# --- generation -------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_generate(family, device, seed):
    """32 greedy tokens with and without gdn: identical tokens; logits, every GDN layer output
    and the final caches within RTOL; every decode step of every GDN layer on gdn, prefill on
    transformers (bit-identical)."""
    model = make_model(family, device)
    prompt = ids(PROMPT, device)

    def generate():
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
                              do_sample=False, output_logits=True,
                              return_dict_in_generate=True, pad_token_id=0)

    want, stock = record(model, generate)
    n = gdn_tf.enable(model)
    assert n == 3 and gdn_tf.is_enabled(model)
    try:
        got, fused = record(model, generate)
    finally:
        assert gdn_tf.disable(model) == 3
    assert stock.calls == 0
    assert fused.calls == 3 * (NEW_TOKENS - 1), "every decode step of every GDN layer runs on gdn"

    # Greedy tokens can differ only where two logits of the reference are within the logits'
    # tolerance of each other: then both choices are right, and the runs are compared up to there.
    got_tokens, want_tokens = got.sequences[:, PROMPT:], want.sequences[:, PROMPT:]
    steps = NEW_TOKENS
    differ = (got_tokens != want_tokens).any(dim=0).nonzero()
    if len(differ):
        s = int(differ[0])
        logits = want.logits[s].double()
        for row in range(B):
            tg, tw = int(got_tokens[row, s]), int(want_tokens[row, s])
            if tg != tw:
                gap = float(logits[row, tw] - logits[row, tg])
                assert gap <= 2 * RTOL * float(logits[row].norm()), (
                    f"step {s}, row {row}: gdn chose token {tg}, transformers {tw}, whose logit is {gap:.3g} "
                    f"higher: more than the logits' tolerance allows")
        steps = s + 1

    for s in range(steps):
        assert_close(got.logits[s], want.logits[s], f"logits of step {s}")
    # Per GDN layer: the prefill call, then one call per decode step (3 layers per forward).
    assert len(fused.outputs) == len(stock.outputs) == 3 * NEW_TOKENS
    for i in range(3):
        assert torch.equal(fused.outputs[i], stock.outputs[i]), "prefill runs on transformers in both"
    for i in range(3, 3 * steps):
        assert_close(fused.outputs[i], stock.outputs[i], f"GDN layer {i % 3} output at step {i // 3}")
    if steps == NEW_TOKENS:
        assert_caches_close(got.past_key_values, want.past_key_values, model)


# --- several tokens continuing from a cache ---------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T", [2, 3, 4])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_multi_token_step(family, T, device, seed):
    """T new tokens after a prefill (chunked prefill, speculative verify): transformers runs its
    chunked rule over the cache; gdn one fused call per layer. Row 1's first new token is
    padding (attention mask 0), which both enter as zeros. Logits at all T positions, the
    layer outputs and both caches within RTOL."""
    model = make_model(family, device)
    prompt, new = ids(PROMPT, device), ids(T, device)
    mask = torch.ones(B, PROMPT + T, dtype=torch.long, device=device)
    mask[1, PROMPT] = 0
    with torch.no_grad():
        cache = model(prompt, attention_mask=mask[:, :PROMPT], use_cache=True).past_key_values
    cache_gdn = copy.deepcopy(cache)

    want, stock = record(model,
                         lambda: model(new, attention_mask=mask, past_key_values=cache, use_cache=True))
    gdn_tf.enable(model)
    try:
        got, fused = record(model,
                            lambda: model(new, attention_mask=mask, past_key_values=cache_gdn, use_cache=True))
    finally:
        gdn_tf.disable(model)
    assert fused.calls == 3
    assert_close(got.logits, want.logits, "logits")
    for i, (g, w) in enumerate(zip(fused.outputs, stock.outputs)):
        assert_close(g, w, f"GDN layer {i} output")
    assert_caches_close(cache_gdn, cache, model)


# --- bf16 -------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_bf16_step(family, device, seed):
    """A bf16 model's decode step, per GDN layer, against the same step in fp32 on the same
    values: the layer's fp32 copy (its bf16 weights, exactly), the cache upcast, and the bf16
    layer's own projections (a bf16 GEMM's rounding is not an fp32 GEMM's rounded to bf16).
    Everything after the projections is then the fp32 computation gdn does: its new state
    matches to fp32 precision (RTOL per (row, head)), its o (out_proj's input) is that step's
    o rounded to bf16 (section 5's one-call bf16 bound), and the conv state holds the same
    inputs exactly. transformers' bf16 step rounds between stages (the one numerical
    difference): its new state is further off."""
    model = make_model(family, device, torch.bfloat16)
    prompt = ids(PROMPT, device)
    with torch.no_grad():
        cache = model(prompt, use_cache=True).past_key_values
    model32 = copy.deepcopy(model).float()
    for li, (layer, layer32) in enumerate(zip(gdn_layers(model), gdn_layers(model32))):
        x = torch.randn(B, 1, 64, device=device).to(torch.bfloat16)
        cache_tf, cache_gdn, cache32 = copy.deepcopy(cache), copy.deepcopy(cache), copy.deepcopy(cache)
        upcast_gdn_states(cache32, model32)
        seen = {}  # the bf16 layer's projections, and o of both layers
        hooks = [m.register_forward_hook(lambda m, args, out, name=name: seen.__setitem__(name, out.clone()))
                 for name, m in layer.named_children() if name.startswith("in_proj")]
        hooks += [m.out_proj.register_forward_pre_hook(lambda m, args, key=key: seen.__setitem__(key, args[0].clone()))
                  for m, key in ((layer, "o"), (layer32, "o32"))]
        with torch.no_grad():
            layer(x, cache_params=cache_tf)
            gdn_tf.enable(model)
            try:
                _, fused = record(model, lambda: layer(x, cache_params=cache_gdn))
            finally:
                gdn_tf.disable(model)
            hooks += [m.register_forward_hook(lambda m, args, out, name=name: seen[name].float())
                      for name, m in layer32.named_children() if name.startswith("in_proj")]
            layer32(x.float(), cache_params=cache32)
        for h in hooks:
            h.remove()
        assert fused.calls == 1
        assert seen["o"].dtype == torch.bfloat16
        torch_testing.assert_close(seen["o"].unflatten(-1, (-1, 128)),
                                   seen["o32"].unflatten(-1, (-1, 128)).to(torch.bfloat16), f"GDN layer {li}: o")
        (conv32, state32), (conv_g, state_g), (_, state_tf) = (gdn_states(c, model)[li]
                                                                for c in (cache32, cache_gdn, cache_tf))
        assert torch.equal(conv_g, conv32.to(torch.bfloat16)), f"GDN layer {li}: conv state"
        assert_close(state_g.flatten(2), state32.flatten(2), f"GDN layer {li}: new state")
        err_g, err_tf = (float(rel_errors(st.flatten(1), state32.flatten(1)).max()) for st in (state_g, state_tf))
        assert err_tf > err_g, f"GDN layer {li}: transformers' bf16 state is {err_tf:.3g} off, gdn's {err_g:.3g}"


# --- what enable routes and what it leaves ----------------------------------------------------

def test_enable_disable(seed):
    """enable/disable/is_enabled: counts, idempotence, deepcopy, and the refusals."""
    family = any_family()
    model = make_model(family, "cpu")
    layers = gdn_layers(model)
    assert not gdn_tf.is_enabled(model)
    assert gdn_tf.enable(model) == 3 and gdn_tf.enable(model) == 3
    assert all(gdn_tf.is_enabled(layer) for layer in layers) and gdn_tf.is_enabled(model)
    twin = copy.deepcopy(model)  # the routed forward is bound to the copy's own layers
    assert all(layer.forward.__self__ is layer for layer in gdn_layers(twin))
    assert gdn_tf.disable(model) == 3 and gdn_tf.disable(model) == 0
    assert not gdn_tf.is_enabled(model) and "forward" not in layers[0].__dict__
    assert gdn_tf.is_enabled(twin) and gdn_tf.disable(twin) == 3

    with pytest.raises(ValueError, match="no Qwen3-Next or Qwen3.5 GDN layer"):
        gdn_tf.enable(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    # A forward something else installed (accelerate's hooks do) is not overwritten.
    layers[1].forward = lambda *a, **k: None
    with pytest.raises(ValueError, match="already has an instance forward"):
        gdn_tf.enable(model)
    assert not gdn_tf.is_enabled(model), "a refused enable changes nothing"
    del layers[1].forward
    odd = make_model(family, "cpu", layer_types=["linear_attention"], linear_key_head_dim=96)
    with pytest.raises(ValueError, match=r"K = 96, V = 128 \(gdn takes 64, 128 or 256\)"):
        gdn_tf.enable(odd)


def test_kept_A_log_follows_the_parameter(seed):
    """A bf16 model's A_log, kept in float32 on the layer between steps, is converted again after
    it changes in place (its version counter) or is replaced: each step equals a fresh enable's."""
    family = any_family()
    model = make_model(family, "cpu", torch.bfloat16)
    layer = gdn_layers(model)[0]
    with torch.no_grad():
        cache = model(ids(PROMPT, "cpu"), use_cache=True).past_key_values
    x = torch.randn(B, 1, 64).to(torch.bfloat16)

    def step(fresh=False):
        if fresh:
            gdn_tf.disable(model)
        gdn_tf.enable(model)
        _, rec = record(model, lambda: layer(x, cache_params=copy.deepcopy(cache)))
        assert rec.calls == 1
        return rec.outputs[0]

    try:
        before = step()
        with torch.no_grad():
            layer.A_log.add_(0.5)
        changed = step()
        assert not torch.equal(changed, before), "the step read the old A_log"
        assert torch.equal(changed, step(fresh=True))
        layer.A_log = torch.nn.Parameter(layer.A_log.detach() - 1.0)
        replaced = step()
        assert not torch.equal(replaced, changed), "the step read the replaced A_log"
        assert torch.equal(replaced, step(fresh=True))
    finally:
        gdn_tf.disable(model)


def test_left_to_transformers(seed):
    """The steps enable leaves to transformers run its code unchanged (bit-identical, no gdn
    call): prefill, more than 16 tokens from a cache, no cache, grad mode."""
    family = any_family()
    model = make_model(family, "cpu")
    prompt = ids(PROMPT, "cpu")
    with torch.no_grad():
        cache = model(prompt, use_cache=True).past_key_values

    def both(fn, no_grad=True):
        outs = []
        for on in (False, True):
            if on:
                gdn_tf.enable(model)
            try:
                rec = Recorder(model)
                try:
                    with torch.set_grad_enabled(not no_grad):
                        outs.append(fn(copy.deepcopy(cache)).logits.detach())
                finally:
                    rec.close()
            finally:
                gdn_tf.disable(model)
            assert rec.calls == 0
        assert torch.equal(outs[0], outs[1])

    fresh = ids(PROMPT, "cpu")
    both(lambda c: model(fresh, use_cache=True))  # prefill, a new cache
    long = ids(17, "cpu")
    both(lambda c: model(long, past_key_values=c, use_cache=True))  # T = 17 > 16
    one = ids(1, "cpu")
    both(lambda c: model(one, use_cache=False))  # no cache
    both(lambda c: model(one, past_key_values=c, use_cache=True), no_grad=False)  # grad mode


def _has(family):
    module, config_name, model_name, _, _ = FAMILIES[family]
    try:
        m = importlib.import_module(module)
        return hasattr(m, config_name) and hasattr(m, model_name)
    except ImportError:
        return False
