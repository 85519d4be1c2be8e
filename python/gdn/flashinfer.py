"""Drop-in replacements for FlashInfer's GDN decode API (``flashinfer.gdn_decode``).

Same names, parameter order, defaults and return values as FlashInfer's
``gated_delta_rule_decode_pretranspose``, ``gated_delta_rule_decode`` and
``gated_delta_rule_mtp``, all routed to :func:`gdn.decode`. Pretranspose is state layout
"VK" ([.., V, K], K contiguous), nontranspose is "KV" ([.., K, V]). Where FlashInfer's own
paths disagree (padding slots on its bf16 path, which dtypes and T each path takes), these
follow gdn's contract; docs/python.md lists every deviation. Errors are TypeError (a wrong
Python type) or ValueError (a bad value) naming FlashInfer's argument, where FlashInfer
asserts or fails deeper down.
"""

from . import _flag, _shape_of, _translated
from . import decode as _decode

__all__ = [
    "gated_delta_rule_decode_pretranspose",
    "gated_delta_rule_decode",
    "gated_delta_rule_mtp",
]

# gdn.decode's argument names in its messages, as FlashInfer's caller knows them.
_DENSE_NAMES = (("o", "output"),)
_POOL_NAMES = (("state", "initial_state"), ("read_slots", "initial_state_indices"),
               ("write_slots", "output_state_indices"), ("token_slots", "ssm_state_indices"),
               ("inter", "intermediate_states_buffer"), ("o", "output"))


def _inter_view(buf, q):
    # FlashInfer indexes the buffer by batch row and token and allows it to be larger
    # than [B, T]; gdn wants exactly [B, T, ...], which a slice gives without a copy.
    if buf is None:
        return None
    B, T = _shape_of(q, "q", 4, "[B, T, H, K]")[:2]
    shape = _shape_of(buf, "intermediate_states_buffer", 5, "[>= B, >= T, HV, V, K]")
    if shape[0] == B and shape[1] == T:
        return buf
    if shape[0] < B or shape[1] < T:
        raise ValueError(
            f"intermediate_states_buffer must be at least [B={B}, T={T}, ...], got {tuple(shape)}"
        )
    return buf[:B, :T]


def gated_delta_rule_decode_pretranspose(
    q,
    k,
    v,
    state,
    A_log,
    a,
    dt_bias,
    b,
    scale=None,
    output=None,
    use_qk_l2norm=True,
    initial_state=None,
    initial_state_indices=None,
    output_state_indices=None,
    *,
    intermediate_states_buffer=None,
    disable_state_update=False,
):
    """FlashInfer's pretranspose decode: state [B, HV, V, K] or pool ``initial_state``
    [pool_size, HV, V, K] with ``initial_state_indices`` [B] (read) and optional
    ``output_state_indices`` [B] (write). Returns ``(output, state_or_initial_state)``."""
    update_state = not _flag(disable_state_update, "disable_state_update")
    if initial_state is not None:
        if initial_state_indices is None:
            raise ValueError("initial_state and initial_state_indices must be provided together")
        pool, names = initial_state, _POOL_NAMES
    else:
        if initial_state_indices is not None:
            raise ValueError("initial_state and initial_state_indices must be provided together")
        if output_state_indices is not None:
            raise ValueError("output_state_indices can only be used with initial_state (pool mode)")
        if state is None:
            raise ValueError("Either state or initial_state must be provided")
        pool, names = state, _POOL_NAMES[3:]
    inter = _inter_view(intermediate_states_buffer, q)
    try:
        out = _decode(q, k, v, pool, output, a=a, b=b, A_log=A_log, dt_bias=dt_bias, layout="VK",
                      read_slots=initial_state_indices, write_slots=output_state_indices, inter=inter,
                      scale=scale, use_qk_l2norm=use_qk_l2norm, update_state=update_state)
    except (TypeError, ValueError) as e:
        raise _translated(e, names) from None
    return out, pool


def gated_delta_rule_decode(
    q,
    k,
    v,
    state,
    A_log,
    a,
    dt_bias,
    b,
    scale=None,
    output=None,
    use_qk_l2norm=True,
):
    """FlashInfer's nontranspose decode: dense state [B, HV, K, V] (V contiguous), updated
    in place. Returns ``(output, state)``."""
    try:
        out = _decode(q, k, v, state, output, a=a, b=b, A_log=A_log, dt_bias=dt_bias, layout="KV",
                      scale=scale, use_qk_l2norm=use_qk_l2norm)
    except (TypeError, ValueError) as e:
        raise _translated(e, _DENSE_NAMES) from None
    return out, state


def gated_delta_rule_mtp(
    q,
    k,
    v,
    initial_state,
    initial_state_indices,
    A_log,
    a,
    dt_bias,
    b,
    scale=None,
    output=None,
    intermediate_states_buffer=None,
    ssm_state_indices=None,
    disable_state_update=None,
    use_qk_l2norm=True,
    output_state_indices=None,
):
    """FlashInfer's multi-token (speculative verify) decode over the pool ``initial_state``
    [pool_size, HV, V, K]. ``disable_state_update=None`` means True, FlashInfer's current
    default. ``ssm_state_indices`` [B, T] writes the state after token t to its own slot.
    Returns ``(output, initial_state)``."""
    disable = True if disable_state_update is None else _flag(disable_state_update, "disable_state_update")
    if ssm_state_indices is not None:
        if disable:
            raise ValueError("ssm_state_indices requires state writes; disable_state_update must be False")
        # FlashInfer ignores output_state_indices here: every write, the last included,
        # goes to ssm_state_indices[n, t].
        output_state_indices = None
    inter = _inter_view(intermediate_states_buffer, q)
    try:
        out = _decode(q, k, v, initial_state, output, a=a, b=b, A_log=A_log, dt_bias=dt_bias,
                      layout="VK", read_slots=initial_state_indices, write_slots=output_state_indices,
                      token_slots=ssm_state_indices, inter=inter, scale=scale,
                      use_qk_l2norm=use_qk_l2norm, update_state=not disable)
    except (TypeError, ValueError) as e:
        raise _translated(e, _POOL_NAMES) from None
    return out, initial_state
