"""torch integration: the ``gdn::decode`` and ``gdn::fused_decode`` custom ops and torch-side helpers.

Imported by gdn only after the caller has imported torch. Eager calls never go through
the op: torch's dispatcher would add tens of microseconds to a call whose budget is ten,
and the direct binding already reads torch tensors and launches on torch's current
stream (so CUDA-graph capture works). Under torch.compile, gdn.decode and gdn.fused_decode
call the ops instead, which the graph can hold: each op declares what it mutates (state, o,
inter, error_count; fused_decode also conv_state and conv_inter) and has a fake
implementation, so tracing needs no data and no graph break.

The ops are defined with torch.library's low-level API rather than ``torch.library.custom_op``:
custom_op takes no keyword-only tensor arguments (so decode's schema would be 22 positionals
without defaults) and refuses an autograd formula for an op that mutates its arguments.
Here the schemas have keyword-only arguments with defaults, and each op's Autograd kernel
refuses inputs that require grad while grad mode is on: gdn has no backward, and an op
that returns nothing gives autograd no output a backward formula could ever run on, so
the refusal happens when the graph is traced or the op is called, not at backward time.
"""

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
_run_fused = (native or _C).fused_decode

SCHEMA = (
    "decode(Tensor q, Tensor k, Tensor v, Tensor(a!) state, Tensor(b!) o, *, "
    "Tensor? a=None, Tensor? b=None, Tensor? A_log=None, Tensor? dt_bias=None, "
    "Tensor? g=None, Tensor? beta=None, "
    "Tensor? read_slots=None, Tensor? write_slots=None, Tensor? token_slots=None, Tensor? num_accepted=None, "
    "Tensor(c!)? inter=None, Tensor(d!)? error_count=None, Tensor? rounding_seed=None, "
    "str layout, float? scale=None, bool use_qk_l2norm=True, bool update_state=True, "
    "bool check_duplicate_writes=False) -> ()"
)
FUSED_SCHEMA = (
    "fused_decode(Tensor mixed_qkv, Tensor conv_weight, Tensor(a!) conv_state, Tensor(b!) state, Tensor(c!) o, *, "
    "Tensor? conv_bias=None, Tensor(d!)? conv_inter=None, Tensor? norm_weight=None, Tensor? z=None, "
    "float norm_eps=1e-06, "
    "Tensor? a=None, Tensor? b=None, Tensor? A_log=None, Tensor? dt_bias=None, "
    "Tensor? g=None, Tensor? beta=None, "
    "Tensor? read_slots=None, Tensor? write_slots=None, Tensor? token_slots=None, Tensor? num_accepted=None, "
    "Tensor(e!)? inter=None, Tensor(f!)? error_count=None, Tensor? rounding_seed=None, "
    "str layout, float? scale=None, bool use_qk_l2norm=True, bool update_state=True, "
    "bool check_duplicate_writes=False) -> ()"
)
_STEP_KEYWORD_TENSORS = ("a", "b", "A_log", "dt_bias", "g", "beta", "read_slots", "write_slots", "token_slots",
                         "num_accepted", "inter", "error_count", "rounding_seed")
_POSITIONAL = ("q", "k", "v", "state", "o")
_KEYWORD_TENSORS = _STEP_KEYWORD_TENSORS
_FUSED_POSITIONAL = ("mixed_qkv", "conv_weight", "conv_state", "state", "o")
_FUSED_KEYWORD_TENSORS = ("conv_bias", "conv_inter", "norm_weight", "z") + _STEP_KEYWORD_TENSORS


def _decode_impl(q, k, v, state, o, *, a=None, b=None, A_log=None, dt_bias=None, g=None, beta=None,
                 read_slots=None, write_slots=None, token_slots=None, num_accepted=None, inter=None,
                 error_count=None, rounding_seed=None, layout, scale=None, use_qk_l2norm=True,
                 update_state=True, check_duplicate_writes=False):
    """gdn.decode as a torch op: writes o (and state, inter, error_count) in place."""
    _run(q, k, v, state, o, a, b, A_log, dt_bias, g, beta, read_slots, write_slots, token_slots,
         num_accepted, inter, error_count, rounding_seed, layout, scale, use_qk_l2norm, update_state,
         check_duplicate_writes, None)


def _decode_fake(q, k, v, state, o, *, a=None, b=None, A_log=None, dt_bias=None, g=None, beta=None,
                 read_slots=None, write_slots=None, token_slots=None, num_accepted=None, inter=None,
                 error_count=None, rounding_seed=None, layout, scale=None, use_qk_l2norm=True,
                 update_state=True, check_duplicate_writes=False):
    # Everything is written in place: nothing to allocate, nothing to return. The scalars
    # are checked here so that a bad one fails while tracing, with the eager message.
    _C._check_step_scalars(layout, scale, use_qk_l2norm, update_state, check_duplicate_writes, None)
    return None


def _fused_impl(mixed_qkv, conv_weight, conv_state, state, o, *, conv_bias=None, conv_inter=None, norm_weight=None,
                z=None, norm_eps=1e-6, a=None, b=None, A_log=None, dt_bias=None, g=None, beta=None, read_slots=None,
                write_slots=None, token_slots=None, num_accepted=None, inter=None, error_count=None,
                rounding_seed=None, layout, scale=None, use_qk_l2norm=True, update_state=True,
                check_duplicate_writes=False):
    """gdn.fused_decode as a torch op: writes o (and both pools, both caches, error_count) in place."""
    _run_fused(mixed_qkv, conv_weight, conv_state, conv_bias, conv_inter, norm_weight, z, state, o, a, b, A_log,
               dt_bias, g, beta, read_slots, write_slots, token_slots, num_accepted, inter, error_count,
               rounding_seed, layout, scale, use_qk_l2norm, update_state, check_duplicate_writes, None, norm_eps)


def _fused_fake(mixed_qkv, conv_weight, conv_state, state, o, *, conv_bias=None, conv_inter=None, norm_weight=None,
                z=None, norm_eps=1e-6, a=None, b=None, A_log=None, dt_bias=None, g=None, beta=None, read_slots=None,
                write_slots=None, token_slots=None, num_accepted=None, inter=None, error_count=None,
                rounding_seed=None, layout, scale=None, use_qk_l2norm=True, update_state=True,
                check_duplicate_writes=False):
    _C._check_fused_scalars(layout, scale, use_qk_l2norm, update_state, check_duplicate_writes, None, norm_eps)
    return None


def _requires_grad_error(name):
    return ValueError(f"{name} requires grad, but gdn is inference-only (it has no backward): call it under "
                      f"torch.no_grad() or torch.inference_mode(), or pass {name}.detach()")


def _refuse_grad(args, kwargs, positional=_POSITIONAL, keyword=_KEYWORD_TENSORS):
    for name, t in zip(positional, args):
        if isinstance(t, Tensor) and t.requires_grad:
            raise _requires_grad_error(name)
    for name in keyword:
        t = kwargs.get(name)
        if t is not None and t.requires_grad:
            raise _requires_grad_error(name)


op = None
fused_op = None
_lib = None
try:
    _after_autograd = torch._C._after_autograd_keyset
    _after_inplace_or_view = torch._C._after_ADInplaceOrView_keyset
    _below_autograd = torch._C._AutoDispatchBelowAutograd
    _below_inplace_or_view = torch._C._AutoDispatchBelowADInplaceOrView
    _increment_version = torch.autograd.graph.increment_version
    _register_fake = torch.library.register_fake
except AttributeError:  # torch < 2.4: eager only
    def compiling():  # noqa: F811 - without the ops, compiled code must not be routed to them
        return False
else:
    _lib = torch.library.Library("gdn", "DEF")  # kept alive here: the registrations live as long as it does

    def _define(name, schema, impl, fake, positional, keyword_tensors, written_positions, written_keywords):
        """Defines gdn::<name>: the impl, the fake, an Autograd kernel that refuses inputs
        requiring grad, and the version-counter bumps of the tensors it writes."""
        _lib.define(schema)
        _lib.impl(name, impl, "CompositeExplicitAutograd")
        _register_fake(f"gdn::{name}", fake, lib=_lib)
        handle = getattr(torch.ops.gdn, name).default

        def autograd(keyset, *args, **kwargs):
            if torch.is_grad_enabled():
                _refuse_grad(args, kwargs, positional, keyword_tensors)
            with _below_autograd():
                return handle.redispatch(keyset & _after_autograd, *args, **kwargs)

        def inplace_or_view(keyset, *args, **kwargs):
            # What torch does for its own in-place ops: bump the version of every mutated tensor,
            # so that autograd notices a tensor saved for backward being overwritten.
            for i in written_positions:
                _increment_version(args[i])
            for n in written_keywords:
                t = kwargs.get(n)
                if t is not None:
                    _increment_version(t)
            with _below_inplace_or_view():
                return handle.redispatch(keyset & _after_inplace_or_view, *args, **kwargs)

        _lib.impl(name, autograd, "Autograd", with_keyset=True)
        _lib.impl(name, inplace_or_view, "ADInplaceOrView", with_keyset=True)
        return handle

    op = _define("decode", SCHEMA, _decode_impl, _decode_fake, _POSITIONAL, _KEYWORD_TENSORS, (3, 4),
                 ("inter", "error_count"))
    fused_op = _define("fused_decode", FUSED_SCHEMA, _fused_impl, _fused_fake, _FUSED_POSITIONAL,
                       _FUSED_KEYWORD_TENSORS, (2, 3, 4), ("conv_inter", "inter", "error_count"))


def dtype_of(o_dtype):
    """o_dtype as a torch.dtype: a torch.dtype, or the name of one ("float32", "bfloat16")."""
    if isinstance(o_dtype, torch.dtype):
        return o_dtype
    if isinstance(o_dtype, str):
        d = getattr(torch, o_dtype, None)
        if isinstance(d, torch.dtype):
            return d
        raise ValueError(f"o_dtype {o_dtype!r} is not the name of a torch dtype "
                         "(use 'float32', 'float16' or 'bfloat16')")
    raise TypeError(f"o_dtype must be a torch.dtype or a dtype name such as 'float32', got {type(o_dtype).__name__}")


def new_output(shape, q, o_dtype):
    return torch.empty(shape, dtype=q.dtype if o_dtype is None else o_dtype, device=q.device)
