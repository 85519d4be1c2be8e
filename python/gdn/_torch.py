"""torch integration: the ``gdn::decode`` custom op and torch-side helpers.

Imported by gdn only after the caller has imported torch. Eager calls never go through
the op: torch's dispatcher would add tens of microseconds to a call whose budget is ten,
and the direct binding already reads torch tensors and launches on torch's current
stream (so CUDA-graph capture works). Under torch.compile, gdn.decode calls the op
instead, which the graph can hold: the op declares what it mutates (state, o, inter,
error_count) and has a fake implementation, so tracing needs no data and no graph break.

The op is defined with torch.library's low-level API rather than ``torch.library.custom_op``:
custom_op takes no keyword-only tensor arguments (so the schema would be 22 positionals
without defaults) and refuses an autograd formula for an op that mutates its arguments.
Here the schema has keyword-only arguments with defaults, and the op's Autograd kernel
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

SCHEMA = (
    "decode(Tensor q, Tensor k, Tensor v, Tensor(a!) state, Tensor(b!) o, *, "
    "Tensor? a=None, Tensor? b=None, Tensor? A_log=None, Tensor? dt_bias=None, "
    "Tensor? g=None, Tensor? beta=None, "
    "Tensor? read_slots=None, Tensor? write_slots=None, Tensor? token_slots=None, Tensor? num_accepted=None, "
    "Tensor(c!)? inter=None, Tensor(d!)? error_count=None, "
    "str layout, float? scale=None, bool use_qk_l2norm=True, bool update_state=True, "
    "bool check_duplicate_writes=False) -> ()"
)
_POSITIONAL = ("q", "k", "v", "state", "o")
_KEYWORD_TENSORS = ("a", "b", "A_log", "dt_bias", "g", "beta", "read_slots", "write_slots", "token_slots",
                    "num_accepted", "inter", "error_count")


def _decode_impl(q, k, v, state, o, *, a=None, b=None, A_log=None, dt_bias=None, g=None, beta=None,
                 read_slots=None, write_slots=None, token_slots=None, num_accepted=None, inter=None,
                 error_count=None, layout, scale=None, use_qk_l2norm=True, update_state=True,
                 check_duplicate_writes=False):
    """gdn.decode as a torch op: writes o (and state, inter, error_count) in place."""
    _run(q, k, v, state, o, a, b, A_log, dt_bias, g, beta, read_slots, write_slots, token_slots,
         num_accepted, inter, error_count, layout, scale, use_qk_l2norm, update_state,
         check_duplicate_writes, None)


def _decode_fake(q, k, v, state, o, *, a=None, b=None, A_log=None, dt_bias=None, g=None, beta=None,
                 read_slots=None, write_slots=None, token_slots=None, num_accepted=None, inter=None,
                 error_count=None, layout, scale=None, use_qk_l2norm=True, update_state=True,
                 check_duplicate_writes=False):
    # Everything is written in place: nothing to allocate, nothing to return. The scalars
    # are checked here so that a bad one fails while tracing, with the eager message.
    _C._check_step_scalars(layout, scale, use_qk_l2norm, update_state, check_duplicate_writes, None)
    return None


def _requires_grad_error(name):
    return ValueError(f"{name} requires grad, but gdn is inference-only (it has no backward): call it under "
                      f"torch.no_grad() or torch.inference_mode(), or pass {name}.detach()")


def _refuse_grad(args, kwargs):
    for name, t in zip(_POSITIONAL, args):
        if isinstance(t, Tensor) and t.requires_grad:
            raise _requires_grad_error(name)
    for name in _KEYWORD_TENSORS:
        t = kwargs.get(name)
        if t is not None and t.requires_grad:
            raise _requires_grad_error(name)


op = None
_lib = None
try:
    _after_autograd = torch._C._after_autograd_keyset
    _after_inplace_or_view = torch._C._after_ADInplaceOrView_keyset
    _below_autograd = torch._C._AutoDispatchBelowAutograd
    _below_inplace_or_view = torch._C._AutoDispatchBelowADInplaceOrView
    _increment_version = torch.autograd.graph.increment_version
    _register_fake = torch.library.register_fake
except AttributeError:  # torch < 2.4: eager only
    def compiling():  # noqa: F811 - without the op, compiled code must not be routed to it
        return False
else:
    _lib = torch.library.Library("gdn", "DEF")  # kept alive here: the registrations live as long as it does
    _lib.define(SCHEMA)
    _lib.impl("decode", _decode_impl, "CompositeExplicitAutograd")
    _register_fake("gdn::decode", _decode_fake, lib=_lib)
    op = torch.ops.gdn.decode.default

    def _decode_autograd(keyset, *args, **kwargs):
        if torch.is_grad_enabled():
            _refuse_grad(args, kwargs)
        with _below_autograd():
            return op.redispatch(keyset & _after_autograd, *args, **kwargs)

    def _decode_inplace_or_view(keyset, *args, **kwargs):
        # What torch does for its own in-place ops: bump the version of every mutated tensor,
        # so that autograd notices a tensor saved for backward being overwritten.
        _increment_version(args[3])
        _increment_version(args[4])
        for name in ("inter", "error_count"):
            t = kwargs.get(name)
            if t is not None:
                _increment_version(t)
        with _below_inplace_or_view():
            return op.redispatch(keyset & _after_inplace_or_view, *args, **kwargs)

    _lib.impl("decode", _decode_autograd, "Autograd", with_keyset=True)
    _lib.impl("decode", _decode_inplace_or_view, "ADInplaceOrView", with_keyset=True)


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
