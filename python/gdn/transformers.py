"""Runs the decode steps of transformers' Qwen3-Next and Qwen3.5 GDN layers on gdn.fused_decode.

    import gdn.transformers
    gdn.transformers.enable(model)    # every GDN layer of the model; returns how many
    out = model.generate(...)         # decode steps: one gdn.fused_decode per GDN layer
    gdn.transformers.disable(model)   # transformers' own forward again

``enable`` gives each GDN layer (``Qwen3NextGatedDeltaNet``, ``Qwen3_5GatedDeltaNet``,
``Qwen3_5MoeGatedDeltaNet``) an instance-level ``forward`` that runs the step between the
layer's input projections and its ``out_proj`` as one ``gdn.fused_decode`` call when the
cache already holds the layer's state and the call feeds 1..16 tokens (decode, or several
tokens continuing from a cache); everything else goes to the class's own ``forward``
unchanged: prefill (no previous state yet), more than 16 tokens, no cache, a cache that records
past states for rollback (assisted decoding: its conv state grows instead of staying W
columns), packed sequences (``cu_seq_lens_q``), an accelerate hook on ``conv1d`` or ``norm`` (offloaded
weights, which gdn would read where they are not), grad mode (gdn has no backward), a dtype
gdn does not take, and inputs on another device than the cache. Needs the transformers 5.x
cache with per-layer linear-attention states (``LinearAttentionCacheLayerMixin``; tested with
5.17 and 5.23).

The mapping, per GDN layer and step (B rows, T tokens; D = 2*H*K + HV*V):

=========================  ===================================================================
gdn.fused_decode           transformers
=========================  ===================================================================
mixed_qkv [B, T, D]        Qwen3.5: ``in_proj_qkv(x)`` itself. Qwen3-Next: ``in_proj_qkvz``
                           interleaves q | k | v | z per key head, which no strided view
                           reorders, so one gather (``index_select``) of its output puts q | k |
                           v | z in order and mixed_qkv is its first D columns. The gather's
                           indices come from transformers' own ``fix_query_key_value_ordering``
                           run once on column numbers (``enable``), so the order is its order.
conv_weight [D, W]         ``conv1d.weight`` [D, 1, W] squeezed: a view.
conv_bias [D]              ``conv1d.bias`` (None in both models).
conv_state [B, D, W]       the cache's own conv state tensor of the layer (``conv_states[0]``),
                           updated in place. transformers keeps L = W columns and its conv reads
                           the last W inputs; gdn's window is the same (semantics.md section 6).
state [B, HV, K, V]        the cache's own recurrent state (``recurrent_states[0]``, fp32 as
                           transformers creates it), ``layout="KV"``, dense mode (row n is
                           batch row n), updated in place: transformers' copy of the new state
                           into the cache is not needed.
a, b [B, T, HV]            Qwen3.5: ``in_proj_a(x)``, ``in_proj_b(x)``. Qwen3-Next: views of
                           one gather of ``in_proj_ba(x)`` (b | a), as for mixed_qkv.
A_log [HV]                 ``A_log``, as float32: when the model is not fp32, a float32 copy
                           kept on the layer and made again only when ``A_log`` changes (its
                           version counter or storage), not a conversion per step.
dt_bias [HV]               ``dt_bias``.
norm_weight, z, norm_eps   ``norm.weight``; z: Qwen3.5 a view of ``in_proj_z(x)``; Qwen3-Next
                           the gather's last HV*V columns;
                           ``norm.variance_epsilon``.
o [B, T, HV, V]            new, in the model's dtype; flattened to [B, T, HV*V] for
                           ``out_proj``.
=========================  ===================================================================

The arithmetic is transformers' (softplus with threshold 20, sigmoid, the l2norm of q and k
with eps 1e-6, scale 1/sqrt(K), GVA head ``hv // (HV/H)``, the norm before the gate), with
one difference: transformers rounds to the model's dtype between stages (the conv output, q,
k, v, beta, the recurrence output, the normalised value before the weight), gdn keeps fp32
from the inputs to o. In fp32 the two agree to rounding; in bf16 gdn's step is the fp32 step on
the same projections with o rounded once, and transformers' is further from it.
"""

import types

import torch

import gdn as _gdn

__all__ = ["enable", "disable", "is_enabled"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MAX_T = 16  # gdn's fused step takes 1..16 tokens per row


def _layer_classes():
    """The GDN layer classes of the installed transformers, with their projection style."""
    import importlib

    found = []
    for module, name, style in (
        ("transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3NextGatedDeltaNet", "qkvz"),
        ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5GatedDeltaNet", "qkv"),
        ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeGatedDeltaNet", "qkv"),
    ):
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):  # not in this transformers version
            continue
        found.append((cls, style))
    return found


def _style(layer, classes):
    for cls, style in classes:
        if isinstance(layer, cls):
            return style
    return None


def _check_layer(layer, name):
    """Refuses a layer gdn cannot run at all, naming it (a model-wide setting, not a per-step one)."""
    K, V, W = layer.head_k_dim, layer.head_v_dim, layer.conv_kernel_size
    H, HV = layer.num_k_heads, layer.num_v_heads
    problems = []
    if K not in (64, 128, 256) or V not in (64, 128, 256):
        problems.append(f"head dims K = {K}, V = {V} (gdn takes 64, 128 or 256)")
    if not 2 <= W <= 4:
        problems.append(f"conv kernel {W} (gdn takes 2..4)")
    if HV % H != 0:
        problems.append(f"{HV} value heads for {H} key heads (must divide)")
    if layer.activation not in ("silu", "swish"):
        problems.append(f"conv activation {layer.activation!r} (gdn applies SiLU)")
    if problems:
        raise ValueError(f"gdn.transformers.enable: {name} ({type(layer).__name__}) cannot run on gdn: "
                         + "; ".join(problems))


def _check_cache_api():
    import transformers
    from transformers import cache_utils

    # Older 5.x releases keep the GDN states in a model-specific cache (Qwen3NextDynamicCache)
    # whose methods take other arguments: read through them, _cached_states would misread the cache.
    if not hasattr(cache_utils, "LinearAttentionCacheLayerMixin"):
        raise ValueError(f"gdn.transformers.enable: transformers {transformers.__version__} has no per-layer "
                         "linear-attention cache (cache_utils.LinearAttentionCacheLayerMixin); gdn.transformers "
                         "reads the cache through it (5.17 and 5.23 are tested)")


def enable(model):
    """Routes the cached decode steps of every GDN layer of ``model`` through gdn.fused_decode.

    Returns the number of layers routed. Idempotent. Raises ValueError when the model has no
    GDN layer of a supported class, one whose shape gdn cannot run, or one whose ``forward``
    something else (an accelerate hook) has already replaced; nothing is changed then.
    """
    _check_cache_api()
    classes = _layer_classes()
    layers = [(n or "the layer", m) for n, m in model.named_modules() if _style(m, classes) is not None]
    if not layers:
        raise ValueError("gdn.transformers.enable: the model has no Qwen3-Next or Qwen3.5 GDN layer "
                         f"({', '.join(c.__name__ for c, _ in classes) or 'none of them is in this transformers'})")
    for name, layer in layers:
        _check_layer(layer, name)
        if "forward" in layer.__dict__ and not _routed(layer):
            # Replacing it would drop whatever it does (accelerate moves weights in and out there).
            raise ValueError(f"gdn.transformers.enable: {name} ({type(layer).__name__}) already has an instance "
                             "forward (an accelerate hook of an offloaded model?); gdn cannot route it")
    for _, layer in layers:
        # An instance attribute bound to the layer (not a closure over it): a deepcopy of the
        # model rebinds it to the copy's layer.
        layer.forward = types.MethodType(_forward, layer)
        layer._gdn_style = _style(layer, classes)
        if layer._gdn_style == "qkvz":
            _qkvz_order(layer, layer.in_proj_qkvz.weight.device)
    return len(layers)


def disable(model):
    """Restores transformers' own forward on every layer ``enable`` changed; returns how many."""
    n = 0
    for layer in model.modules():
        if _routed(layer):
            del layer.forward
            for attr in ("_gdn_style", "_gdn_order", "_gdn_A_log"):
                layer.__dict__.pop(attr, None)
            n += 1
    return n


def is_enabled(module):
    """Whether ``module`` (a model, or one GDN layer) has a GDN layer that runs its decode steps on gdn."""
    return any(_routed(m) for m in module.modules())


def _routed(layer):
    return getattr(layer.__dict__.get("forward"), "__func__", None) is _forward


def _cached_states(cache, idx):
    """(conv_state, recurrent_state) of GDN layer idx in the cache, when the step can continue
    from them on gdn; None when transformers must run it (no previous state, or a cache that
    records past conv states for rollback)."""
    layers = getattr(cache, "layers", None)
    if layers is None or idx >= len(layers):
        return None
    recording = getattr(cache, "is_recording_past", None)  # 5.22 on; before, the layer's attribute
    if recording(idx) if recording is not None else getattr(layers[idx], "record_past", False):
        return None
    get_conv = getattr(cache, "get_conv_state", None)
    if get_conv is not None:  # transformers >= 5.22: None until the layer holds a state
        conv, state = get_conv(idx, state_idx=0), cache.get_recurrent_state(idx, state_idx=0)
    else:  # transformers 5.1x
        if not cache.has_previous_state(idx):
            return None
        conv, state = layers[idx].conv_states, layers[idx].recurrent_states
        if isinstance(conv, dict):  # one entry per state index (5.16 on)
            conv, state = conv.get(0), state.get(0)
    if not isinstance(conv, torch.Tensor) or not isinstance(state, torch.Tensor):
        return None
    return conv, state


def _forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
    states = None
    if (cache_params is not None and 1 <= hidden_states.shape[1] <= _MAX_T and not torch.is_grad_enabled()
            and kwargs.get("cu_seq_lens_q") is None and hidden_states.dtype in _DTYPES
            and getattr(self.conv1d, "_hf_hook", None) is None and getattr(self.norm, "_hf_hook", None) is None):
        states = _cached_states(cache_params, self.layer_idx)
        if states is not None and not (states[0].device == states[1].device == hidden_states.device):
            states = None
    if states is None:
        return type(self).forward(self, hidden_states, cache_params=cache_params, attention_mask=attention_mask,
                                  **kwargs)
    return _fused_step(self, hidden_states, attention_mask, *states)


def _qkvz_order(layer, device):
    """The column indices (int64, on ``device``) that gather q | k | v | z out of
    ``in_proj_qkvz``'s output and b | a out of ``in_proj_ba``'s (Qwen3-Next interleaves them per
    key head). Made by transformers' own ``fix_query_key_value_ordering`` on column numbers, so
    the gathered tensors hold what its q, k, v, z, b, a hold. Kept on the layer: made in
    ``enable`` (on the weights' device, outside any graph capture) and again only when the
    model moved."""
    order = layer.__dict__.get("_gdn_order")
    if order is None or order[0].device != device:
        cols = [torch.arange(m.out_features, dtype=torch.float64).view(1, 1, -1)  # exact up to 2^53
                for m in (layer.in_proj_qkvz, layer.in_proj_ba)]
        q, k, v, z, b, a = layer.fix_query_key_value_ordering(*cols)
        order = tuple(torch.cat([t.reshape(-1) for t in parts]).to(device=device, dtype=torch.int64)
                      for parts in ((q, k, v, z), (b, a)))
        layer._gdn_order = order
    return order


def _A_log_f32(layer):
    """``A_log`` in float32, as gdn reads it: the parameter itself when it is float32, else a copy
    kept on the layer until the parameter changes (in place: its version counter; replaced: its
    storage), so a step converts nothing."""
    A_log = layer.A_log
    if A_log.dtype == torch.float32:
        return A_log
    key = (A_log.data_ptr(), A_log._version, A_log.device)
    kept = layer.__dict__.get("_gdn_A_log")
    if kept is None or kept[0] != key:
        kept = (key, A_log.detach().float())
        layer._gdn_A_log = kept
    return kept[1]


def _fused_step(self, hidden_states, attention_mask, conv_state, state):
    if attention_mask is not None:
        # transformers' apply_mask_to_padding_states: padding tokens enter as zeros.
        hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
    B, T, _ = hidden_states.shape
    if self._gdn_style == "qkvz":
        # One gather per projection instead of transformers' reshape copies (v, z, b, a) and
        # concatenation (q, k, v): five small kernels fewer per step.
        qkvz_order, ba_order = _qkvz_order(self, hidden_states.device)
        qkvz = self.in_proj_qkvz(hidden_states).index_select(-1, qkvz_order)  # [B, T, D + HV*V]
        mixed_qkv = qkvz[..., :self.conv_dim]
        z = qkvz[..., self.conv_dim:].unflatten(-1, (-1, self.head_v_dim))
        ba = self.in_proj_ba(hidden_states).index_select(-1, ba_order)  # [B, T, 2 * HV]: b | a
        b, a = ba.chunk(2, dim=-1)
    else:
        mixed_qkv = self.in_proj_qkv(hidden_states)
        z = self.in_proj_z(hidden_states).reshape(B, T, -1, self.head_v_dim)
        b = self.in_proj_b(hidden_states)
        a = self.in_proj_a(hidden_states)
    o = _gdn.fused_decode(mixed_qkv, self.conv1d.weight.squeeze(1), conv_state, state, conv_bias=self.conv1d.bias,
                          norm_weight=self.norm.weight, z=z, norm_eps=self.norm.variance_epsilon, a=a, b=b,
                          A_log=_A_log_f32(self), dt_bias=self.dt_bias, layout="KV")
    return self.out_proj(o.reshape(B, T, -1))
