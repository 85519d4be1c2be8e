"""Drop-in replacements for the FLA-style recurrent GDN functions that serving code calls.

- :func:`fused_recurrent_gated_delta_rule`: FLA's ``fla.ops.gated_delta_rule.
  fused_recurrent_gated_delta_rule`` (names, parameter order and defaults of current FLA),
  as HF transformers' Qwen3-Next decode path calls it.
- :func:`fused_recurrent_gated_delta_rule_vllm`: vLLM's copy with continuous batching
  (``vllm.model_executor.layers.fla.ops.fused_recurrent_gated_delta_rule``: ``cu_seqlens``,
  ``ssm_state_indices``, ``num_accepted_tokens``, ``inplace_final_state``), as vLLM's
  Qwen3-Next layer calls it for decode and speculative verify.

Both take FLA's state layout [.., HV, K, V] (V contiguous: gdn layout "KV") and the
precomputed gates (g, the log decay, and beta), and run :func:`gdn.decode` on views of the
caller's tensors: the flattened varlen inputs [1, N*T, ...] become [N, T, ...] views, never
copies. Where FLA or vLLM semantics cannot be met without a copy, or differ from gdn's
contract, these do what a serving engine needs and docs/python.md says so: sequences in
``cu_seqlens`` must have one length; FLA's final state is the initial state updated in place
(no fp32 copy); negative slot indices are padding. Errors are TypeError or ValueError naming
the caller's argument.
"""

import sys as _sys

from . import _flag, _modules, _new_output, _shape_of, _translated, _type_name
from . import decode as _decode

__all__ = [
    "fused_recurrent_gated_delta_rule",
    "fused_recurrent_gated_delta_rule_vllm",
]

_pkg = _sys.modules[__package__]

# gdn.decode's argument names in its messages, as the caller of each drop-in knows them.
_FLA_NAMES = (("state", "initial_state"), ("use_qk_l2norm", "use_qk_l2norm_in_kernel"))
_VLLM_NAMES = (("state", "initial_state"), ("read_slots", "ssm_state_indices"), ("token_slots", "ssm_state_indices"),
               ("num_accepted", "num_accepted_tokens"), ("inter", "final_state"),
               ("use_qk_l2norm", "use_qk_l2norm_in_kernel"))


def _torch_module(x):
    t = _pkg._torch_api if _pkg._torch_api is not None else _pkg._load_torch()
    return t if t is not None and isinstance(x, t.Tensor) else None


def _compiling(x):
    t = _torch_module(x)
    return t is not None and t.compiling()


def _alloc(like, shape, dtype=None, fill=None):
    """A tensor of like's framework and device; dtype None means like's, else a name such as
    "float32"; fill None leaves it uninitialised."""
    t = _torch_module(like)
    if t is not None:
        torch = t.torch
        dt = like.dtype if dtype is None else getattr(torch, dtype)
        if fill is None:
            return torch.empty(shape, dtype=dt, device=like.device)
        return torch.full(shape, fill, dtype=dt, device=like.device)
    np = _modules.get("numpy")
    if np is not None and isinstance(like, np.ndarray):
        dt = like.dtype if dtype is None else np.dtype(dtype)
        return np.empty(shape, dt) if fill is None else np.full(shape, fill, dt)
    namespace = getattr(like, "__array_namespace__", None)
    if namespace is not None:
        xp = namespace()
        dt = like.dtype if dtype is None else getattr(xp, dtype)
        if fill is None:
            return xp.empty(shape, dtype=dt, device=like.device)
        return xp.full(shape, fill, dtype=dt, device=like.device)
    mod = _modules.get(type(like).__module__.partition(".")[0])
    if mod is not None and hasattr(mod, "empty") and hasattr(mod, "full"):
        dt = like.dtype if dtype is None else dtype
        return mod.empty(shape, dtype=dt) if fill is None else mod.full(shape, fill, dtype=dt)
    raise TypeError(f"cannot allocate a tensor like {type(like).__name__}")


def _host_values(x):
    """x's values as a list when they are in host memory (numpy, a CPU torch tensor), else
    None: reading a device tensor would synchronise the stream (and break CUDA-graph capture)."""
    np = _modules.get("numpy")
    if np is not None and isinstance(x, np.ndarray):
        return x.tolist()
    t = _torch_module(x)
    if t is not None and x.device.type == "cpu" and not t.compiling():
        return x.tolist()
    return None


def _sequences(q, cu_seqlens):
    """(N, T) of a call: [B, T] from q, or with cu_seqlens [N + 1] over q [1, N*T, H, K] the
    equal-length split gdn runs (one T for every sequence)."""
    B, T = _shape_of(q, "q", 4, "[B, T, H, K]")[:2]
    if cu_seqlens is None:
        return B, T
    n1 = _shape_of(cu_seqlens, "cu_seqlens", 1, "[N + 1]")[0]
    if B != 1:
        raise ValueError(f"q.shape[0] must be 1 with cu_seqlens (sequences flattened into one row), got {B}")
    N = n1 - 1
    if N < 1:
        raise ValueError(f"cu_seqlens must have N + 1 >= 2 entries, got {n1}")
    if T % N != 0:
        raise ValueError(f"cu_seqlens: gdn runs sequences of one length T, but q's {T} tokens do not split "
                         f"into {N} equal sequences")
    seq = T // N
    values = _host_values(cu_seqlens)
    if values is not None and values != list(range(0, T + 1, seq)):
        raise ValueError(f"cu_seqlens must be [0, T, 2T, ..., N*T] with T = {seq} (gdn runs sequences of one "
                         f"length), got {values if len(values) <= 12 else values[:12] + ['...']}")
    return N, seq


def _rows(x, N, T):
    """[1, N*T, ...] (or [B, T, ...]) as [N, T, ...]; a view, never a copy. Anything else
    (None, a non-tensor, a wrong rank) is passed on for decode to name."""
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) < 2 or tuple(shape[:2]) == (N, T) or shape[0] * shape[1] != N * T:
        return x
    return x.reshape((N, T) + tuple(shape[2:]))


def _gates(q, v, g, beta, N, T):
    # FLA's defaults: no g means no decay (g = 0), no beta means beta = 1.
    HV = v.shape[2]
    g = _alloc(q, (N, T, HV), "float32", 0.0) if g is None else _rows(g, N, T)
    beta = _alloc(q, (N, T, HV), "float32", 1.0) if beta is None else _rows(beta, N, T)
    return g, beta


def fused_recurrent_gated_delta_rule(
    q,
    k,
    v,
    g=None,
    gk=None,
    gv=None,
    beta=None,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    cu_seqlens=None,
):
    """FLA's fused_recurrent_gated_delta_rule on gdn; returns ``(o, final_state)``.

    q, k [B, T, H, K], v [B, T, HV, V], g and beta [B, T, HV] (or flattened [1, N*T, ...]
    with ``cu_seqlens`` [N + 1] of equal-length sequences). ``initial_state`` [N, HV, K, V]
    (FLA's layout, gdn "KV"). ``final_state`` is None unless ``output_final_state``; then it
    is ``initial_state`` itself, updated in place (FLA returns a new fp32 tensor), or a new
    fp32 tensor when there is no ``initial_state``. ``gk``/``gv`` (per-key/per-value decay)
    are not supported.
    """
    if gk is not None or gv is not None:
        name = "gk" if gk is not None else "gv"
        raise ValueError(f"{name} (a per-{'key' if name == 'gk' else 'value'} decay) is not supported by gdn, "
                         "whose decay g is one scalar per head; if you passed beta as the 5th positional argument "
                         "(FLA's older order q, k, v, g, beta), pass it as beta=")
    output_final_state = _flag(output_final_state, "output_final_state")
    N, T = _sequences(q, cu_seqlens)
    q4, k4, v4 = _rows(q, N, T), _rows(k, N, T), _rows(v, N, T)
    _shape_of(v4, "v", 4, "[B, T, HV, V]")
    g4, beta4 = _gates(q, v4, g, beta, N, T)
    if initial_state is None:
        # FLA starts from zeros and returns an fp32 final state: the zeros are that buffer.
        state = _alloc(q, (N, v4.shape[2], q4.shape[3], v4.shape[3]), "float32", 0.0)
    else:
        state = initial_state
    o = _new_output(q, v, None)
    try:
        _decode(q4, k4, v4, state, _rows(o, N, T), g=g4, beta=beta4, layout="KV", scale=scale,
                use_qk_l2norm=use_qk_l2norm_in_kernel, update_state=output_final_state)
    except (TypeError, ValueError) as e:
        raise _translated(e, _FLA_NAMES) from None
    return o, (state if output_final_state else None)


def fused_recurrent_gated_delta_rule_vllm(
    q,
    k,
    v,
    g,
    beta=None,
    scale=None,
    initial_state=None,
    inplace_final_state=True,
    cu_seqlens=None,
    ssm_state_indices=None,
    num_accepted_tokens=None,
    retrieve_parent_token=None,
    use_qk_l2norm_in_kernel=False,
):
    """vLLM's fused_recurrent_gated_delta_rule on gdn; returns ``(o, final_state)``.

    q, k [1, N*T, H, K], v [1, N*T, HV, V], g, beta [1, N*T, HV] with ``cu_seqlens`` [N + 1]
    of equal-length sequences (or [N, T, ...] without it). ``initial_state`` is the state
    pool [num_slots, HV, K, V] (gdn "KV"). ``ssm_state_indices`` [N] reads and writes slot
    ``[n]`` (T = 1); [N, >= T] reads ``[n, 0]`` (or ``[n, num_accepted_tokens[n] - 1]``) and
    writes the state after token t to ``[n, t]``; a negative index is padding. With
    ``inplace_final_state`` the pool is updated and returned; without, the pool is only read
    and the state after every token is returned in a new [N*T, HV, K, V] tensor.
    """
    if retrieve_parent_token is not None:
        raise ValueError("retrieve_parent_token (EAGLE tree verification) is not supported by gdn: its tokens "
                         "form a chain, token t continuing from token t - 1")
    inplace = _flag(inplace_final_state, "inplace_final_state")
    if initial_state is None:
        raise ValueError("initial_state is required: the state pool [num_slots, HV, K, V] that "
                         "ssm_state_indices index (vLLM reads it unconditionally too)")
    N, T = _sequences(q, cu_seqlens)
    q4, k4, v4 = _rows(q, N, T), _rows(k, N, T), _rows(v, N, T)
    _shape_of(v4, "v", 4, "[B, T, HV, V]")
    g4, beta4 = _gates(q, v4, g, beta, N, T)
    read_slots = token_slots = None
    if ssm_state_indices is not None:
        shape = getattr(ssm_state_indices, "shape", None)
        if shape is not None and len(shape) == 1:
            if T != 1:
                raise ValueError(f"ssm_state_indices [N] names one slot per sequence, which needs one token per "
                                 f"sequence, but T = {T}: pass [N, >= T] (the slot of each token's state)")
            read_slots = ssm_state_indices
        else:
            shape = _shape_of(ssm_state_indices, "ssm_state_indices", 2, "[N] or [N, >= T]")
            if shape[1] < T:
                raise ValueError(f"ssm_state_indices must be [N, >= T] with T = {T}, got {tuple(shape)}")
            token_slots = ssm_state_indices if shape[1] == T else ssm_state_indices[:, :T]
    if num_accepted_tokens is not None and token_slots is None:
        raise ValueError("num_accepted_tokens needs ssm_state_indices [N, T]: row n starts from the slot of its "
                         "last accepted token, ssm_state_indices[n, num_accepted_tokens[n] - 1]")
    o = _new_output(q, v, None)
    if inplace:
        final_state, inter = initial_state, None
    else:
        _shape_of(initial_state, "initial_state", 4, "[num_slots, HV, K, V]")
        HV, V, K = v4.shape[2], v4.shape[3], q4.shape[3]
        final_state = _alloc(initial_state, (N * T, HV, K, V))
        inter = final_state.reshape(N, T, HV, K, V)
    try:
        _decode(q4, k4, v4, initial_state, _rows(o, N, T), g=g4, beta=beta4, layout="KV",
                read_slots=read_slots, token_slots=token_slots, num_accepted=num_accepted_tokens, inter=inter,
                scale=scale, use_qk_l2norm=use_qk_l2norm_in_kernel, update_state=inplace)
    except (TypeError, ValueError) as e:
        raise _translated(e, _VLLM_NAMES) from None
    return o, final_state
