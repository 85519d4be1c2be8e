"""torch integration: the ``gdn::decode`` custom op and torch-side helpers.

Imported by gdn only after the caller has imported torch. Eager calls never go through
the op: torch's dispatcher would add tens of microseconds to a call whose budget is ten,
and the direct binding already reads torch tensors and launches on torch's current
stream (so CUDA-graph capture works). Under torch.compile, gdn.decode calls the op
instead, which the graph can hold: the op declares what it mutates (state, o, inter,
error_count) and has a fake implementation, so tracing needs no data and no graph break.
"""

from typing import Optional

import torch

from . import _C

Tensor = torch.Tensor

try:
    compiling = torch.compiler.is_compiling
except AttributeError:  # torch < 2.3
    def compiling():
        return False

# gdn._C_torch reads torch tensors through torch's C++ API; it exists where torch was
# importable at build time, and is used only under that same torch version (its view of
# torch's tensor object layout is compiled in).
native = None
try:
    from . import _C_torch

    if _C_torch.TORCH_VERSION == torch.__version__:
        native = _C_torch
except ImportError:
    pass
_run = (native or _C).decode

op = None
if hasattr(torch, "library") and hasattr(torch.library, "custom_op"):

    @torch.library.custom_op("gdn::decode", mutates_args=("state", "o", "inter", "error_count"))
    def _decode_op(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        state: Tensor,
        o: Tensor,
        a: Optional[Tensor],
        b: Optional[Tensor],
        A_log: Optional[Tensor],
        dt_bias: Optional[Tensor],
        g: Optional[Tensor],
        beta: Optional[Tensor],
        read_slots: Optional[Tensor],
        write_slots: Optional[Tensor],
        token_slots: Optional[Tensor],
        num_accepted: Optional[Tensor],
        inter: Optional[Tensor],
        error_count: Optional[Tensor],
        layout: str,
        scale: Optional[float],
        use_qk_l2norm: bool,
        update_state: bool,
        check_duplicate_writes: bool,
    ) -> None:
        """gdn.decode as a torch op: writes o (and state, inter, error_count) in place."""
        _run(q, k, v, state, o, a, b, A_log, dt_bias, g, beta, read_slots, write_slots, token_slots,
             num_accepted, inter, error_count, layout, scale, use_qk_l2norm, update_state,
             check_duplicate_writes, None)

    @_decode_op.register_fake
    def _decode_fake(q, k, v, state, o, a, b, A_log, dt_bias, g, beta, read_slots, write_slots,
                     token_slots, num_accepted, inter, error_count, layout, scale, use_qk_l2norm,
                     update_state, check_duplicate_writes):
        # Everything is written in place: nothing to allocate, nothing to return.
        return None

    op = torch.ops.gdn.decode.default
else:  # torch without torch.library.custom_op: eager only
    def compiling():
        return False


def _dtype(o_dtype):
    return getattr(torch, o_dtype) if isinstance(o_dtype, str) else o_dtype


def new_output(shape, q, o_dtype):
    return torch.empty(shape, dtype=q.dtype if o_dtype is None else _dtype(o_dtype), device=q.device)
