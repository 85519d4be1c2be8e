"""gdn: Gated DeltaNet decode steps over a pool of recurrent states, on the CPU or CUDA.

One entry point, :func:`decode`, runs every addressing mode (dense, pool, split pool,
per-token slots, accepted-token continuation) on any DLPack tensors (torch, numpy,
cupy, jax) without copying them. :func:`reference_decode` runs the float64 oracle with
the same signature; :func:`can_implement` runs only the checks. :func:`fused_decode` runs
a whole GDN layer step (conv update, SiLU, the recurrence, the gated RMSNorm) with the same
addressing, next to :func:`reference_fused_decode` and :func:`can_implement_fused`.
``gdn.flashinfer`` has drop-in functions with FlashInfer's names and parameters,
``gdn.fla`` with FLA's and vLLM's; ``gdn.transformers`` routes transformers' Qwen3-Next
and Qwen3.5 GDN layers through :func:`fused_decode`. See docs/python.md.

torch is optional and never imported by gdn: once the caller has imported it, torch
tensors take a fast path, ``torch.ops.gdn.decode`` and ``torch.ops.gdn.fused_decode`` are
registered, and calls made under ``torch.compile`` go through those custom ops.
"""

import re as _re
import sys as _sys

try:
    from . import _C
except ImportError as e:  # pragma: no cover - a packaging mistake, not a runtime path
    raise ImportError(
        "gdn's extension module gdn._C is missing: install gdn with `pip install .` from the "
        "repository root (a source checkout's python/ directory on sys.path shadows the "
        f"installed package). Original error: {e}"
    ) from e

__all__ = [
    "decode",
    "reference_decode",
    "can_implement",
    "fused_decode",
    "reference_fused_decode",
    "can_implement_fused",
    "cuda_available",
    "Status",
    "__version__",
]
__version__ = "0.1.0"

cuda_available = _C.cuda_available

_modules = _sys.modules
_run = _C.decode
_run_reference = _C.reference_decode
_check = _C.can_implement
_run_fused = _C.fused_decode
_run_reference_fused = _C.reference_fused_decode
_check_fused = _C.can_implement_fused

# The module gdn._torch once the caller has imported torch; None until then. (Not named
# _torch: `from . import _torch` would find this attribute instead of the submodule.)
_torch_api = None


def _load_torch():
    """Binds the torch integration if the caller has imported torch; else returns None."""
    global _torch_api, _run, _run_fused
    if "torch" not in _modules:
        return None
    from . import _torch as t  # registers torch.ops.gdn.decode and torch.ops.gdn.fused_decode

    _run = t._run  # gdn._C_torch where available: it reads torch tensors natively
    _run_fused = t._run_fused
    _torch_api = t
    return t


def _type_name(x):
    return "None" if x is None else type(x).__name__


def _shape_of(x, name, rank, dims):
    """x.shape for an argument gdn reads a shape from in Python, or the error naming it."""
    shape = getattr(x, "shape", None)
    if shape is None or isinstance(x, type):
        raise TypeError(f"{name} must be a tensor that supports DLPack or the buffer protocol (torch, numpy, "
                        f"cupy, jax, ...), got {_type_name(x)}")
    if len(shape) != rank:
        raise ValueError(f"{name} must have rank {rank} {dims}, got shape {tuple(shape)}")
    return shape


def _flag(x, name):
    """A Python-level bool argument of a drop-in function (the binding checks decode's own)."""
    if x is True or x is False:
        return x
    if type(x).__module__ == "numpy" and type(x).__name__ in ("bool", "bool_"):
        return bool(x)
    raise TypeError(f"{name} must be a bool (True or False), got {_type_name(x)}"
                    + ("" if x is None else f" ({x!r})"))


def _flags(use_qk_l2norm, update_state, check_duplicate_writes):
    # For the torch.compile path: the ops' schemas read an int as a bool, so without this
    # update_state=0 would be accepted there and refused by an eager call.
    return (_flag(use_qk_l2norm, "use_qk_l2norm"), _flag(update_state, "update_state"),
            _flag(check_duplicate_writes, "check_duplicate_writes"))


def _translated(e, names):
    """e (a TypeError or ValueError from decode) with decode's argument names replaced by the
    caller's: a drop-in's caller never saw gdn's names."""
    msg = str(e)
    for gdn_name, name in names:
        msg = _re.sub(rf"(?<![\w.]){gdn_name}(?!\w)", name, msg)
    return type(e)(msg)


def _seed_error(seed):
    # The binding's message for a Python int seed (throw_not_a_tensor in gdn_ext.cpp), for the
    # torch.compile path, where the op's schema would refuse it with a message about types.
    return TypeError(f"rounding_seed must be an int64 tensor of shape [1] on the state's device, got int ({seed!r}): "
                     f"e.g. torch.tensor([{seed!r}], device=state.device), advanced in place between steps "
                     "(seed += 1), which a CUDA graph can capture")


def _seed_tensor(t, seed):
    """rounding_seed for the torch op under torch.compile: None or a torch tensor."""
    if seed is None or isinstance(seed, t.Tensor):
        return seed
    if isinstance(seed, int) and not isinstance(seed, bool):
        raise _seed_error(seed)
    raise TypeError("rounding_seed must be a tensor that supports DLPack or the buffer protocol (torch, numpy, "
                    f"cupy, jax, ...), got {_type_name(seed)}")


def _is_layout(layout):
    # isinstance first: `!=` against an array argument compares elementwise.
    return isinstance(layout, str) and (layout == "VK" or layout == "KV")


def _layout_error(layout):
    # The messages of the binding's parse_layout, for the torch.compile path, which never reaches it.
    if layout is None:
        return TypeError("layout is required (it has no default: the two layouts have the same shape when K == V): "
                         "'VK' = [P, HV, V, K], K contiguous (FlashInfer pretranspose, FLA state_v_first), or "
                         "'KV' = [P, HV, K, V], V contiguous (FLA, HF transformers, vLLM)")
    if isinstance(layout, str):
        return ValueError("layout must be 'VK' ([P, HV, V, K], K contiguous) or 'KV' ([P, HV, K, V], V contiguous), "
                          f"got {layout!r}")
    return TypeError(f"layout must be a str, 'VK' or 'KV', got {type(layout).__name__} ({layout!r})")


_O_DTYPES = ("bfloat16", "float16", "float32")


def _check_o_dtype(dtype):
    # Named here, where o_dtype is known: the C++ checks would blame o, which the caller never saw.
    name = getattr(dtype, "name", None)
    if not isinstance(name, str):
        name = str(dtype).rpartition(".")[2]
    if name not in _O_DTYPES:
        raise ValueError(f"o_dtype must be bfloat16, float16 or float32, got {dtype}")
    return dtype


def _numpy_dtype(np, o_dtype):
    try:
        return np.dtype(o_dtype)
    except TypeError:
        if isinstance(o_dtype, str):
            raise ValueError(f"o_dtype {o_dtype!r} is not a dtype name numpy knows "
                             "(use 'float32' or 'float16', or an ml_dtypes.bfloat16)") from None
        raise TypeError(f"o_dtype must be a dtype or a dtype name such as 'float32', got {_type_name(o_dtype)}") from None


def _new_output(q, v, o_dtype):
    """Allocates o [B, T, HV, V] with q's framework and device (dtype: o_dtype or q's)."""
    qs = _shape_of(q, "q", 4, "[B, T, H, K]")
    vs = _shape_of(v, "v", 4, "[B, T, HV, V]")
    return _allocate((qs[0], qs[1], vs[2], vs[3]), q, o_dtype)


def _new_fused_output(mixed_qkv, state, layout, o_dtype):
    """Allocates fused_decode's o [B, T, HV, V]: B, T from mixed_qkv, HV and V from the state
    (V's place in it depends on the layout), with mixed_qkv's framework, device and dtype."""
    if not _is_layout(layout):
        raise _layout_error(layout)
    xs = _shape_of(mixed_qkv, "mixed_qkv", 3, "[B, T, D]")
    ss = _shape_of(state, "state", 4, "[P, HV, V, K] (VK) or [P, HV, K, V] (KV)")
    return _allocate((xs[0], xs[1], ss[1], ss[2] if layout == "VK" else ss[3]), mixed_qkv, o_dtype, "mixed_qkv")


def _allocate(shape, q, o_dtype, name="q"):
    """An uninitialised array of `shape` with the framework and device of `q` (the argument
    called `name`), dtype o_dtype or q's."""
    t = _torch_api if _torch_api is not None else _load_torch()
    if t is not None and isinstance(q, t.Tensor):
        return t.new_output(shape, q, None if o_dtype is None else _check_o_dtype(t.dtype_of(o_dtype)))
    np = _modules.get("numpy")
    if np is not None and isinstance(q, np.ndarray):
        dtype = q.dtype if o_dtype is None else _check_o_dtype(_numpy_dtype(np, o_dtype))
        return np.empty(shape, dtype=dtype)
    if o_dtype is None:
        dtype = q.dtype
    elif isinstance(o_dtype, str):
        namespace = getattr(q, "__array_namespace__", None)
        dtype = getattr(namespace(), o_dtype, None) if namespace is not None else o_dtype
        if dtype is None:
            raise ValueError(f"o_dtype {o_dtype!r} is not a dtype of {name}'s framework")
        _check_o_dtype(dtype)
    else:
        dtype = _check_o_dtype(o_dtype)
    namespace = getattr(q, "__array_namespace__", None)
    if namespace is not None:
        return namespace().empty(shape, dtype=dtype, device=q.device)
    # Frameworks without the array API (cupy): their own empty() allocates on the
    # current device, the convention those frameworks use.
    mod = _modules.get(type(q).__module__.partition(".")[0])
    empty = getattr(mod, "empty", None)
    if empty is None:
        raise TypeError(f"o: cannot allocate an output for {name} of type {type(q).__name__}; pass o")
    return empty(shape, dtype=dtype)


def decode(
    q,
    k,
    v,
    state,
    o=None,
    *,
    a=None,
    b=None,
    A_log=None,
    dt_bias=None,
    g=None,
    beta=None,
    layout=None,
    read_slots=None,
    write_slots=None,
    token_slots=None,
    num_accepted=None,
    inter=None,
    error_count=None,
    rounding_seed=None,
    scale=None,
    use_qk_l2norm=True,
    update_state=True,
    check_duplicate_writes=False,
    o_dtype=None,
    stream=None,
):
    """One Gated DeltaNet decode call; returns ``o`` [B, T, HV, V].

    q, k [B, T, H, K] and v [B, T, HV, V] (bf16, fp16 or fp32, one dtype); gates either raw
    (``a``, ``b`` [B, T, HV], ``A_log``, ``dt_bias`` [HV]) or precomputed (``g``, ``beta``
    [B, T, HV]). ``state`` is [B, HV, ...] (dense) or a pool [P, HV, ...] addressed by
    ``read_slots``/``write_slots`` [B] or ``token_slots`` [B, T] (+ ``num_accepted`` [B]).
    ``layout`` is required: "VK" = [.., V, K] (K contiguous) or "KV" = [.., K, V] (V
    contiguous). The state and ``inter`` [B, T, HV, <layout>] are updated in place. ``o`` is
    allocated with q's framework when None (dtype ``o_dtype`` or q's). ``stream``: a CUDA
    stream (int, or an object with ``.ptr`` / ``.cuda_stream``); default torch's current
    stream for torch tensors, else the legacy default stream. Bad arguments raise TypeError
    (a wrong Python type) or ValueError (a bad value), naming the argument; a failed CUDA
    launch raises RuntimeError. See docs/python.md.

    ``rounding_seed``: an int64 [1] tensor on the state's device; given, bf16 / fp16 state
    stores (the pool and ``inter``) round stochastically, with bits drawn from its value (plus
    slot, head, token, element), reproducible bit for bit; no effect on an fp32 state or on o.
    Advance it in place between steps (``seed += 1``; inside a captured CUDA graph too, which
    reads the value at replay). A Python int is refused (TypeError): it could not change
    between replays of a captured graph, and would cost a host-to-device copy per call.
    """
    if o is None:
        o = _new_output(q, v, o_dtype)
    t = _torch_api if _torch_api is not None else _load_torch()
    if t is not None and t.compiling():
        # Under torch.compile the call must be an op the graph can hold. The op's schema
        # would refuse a missing layout with a message about types; this one says what to pass.
        if not _is_layout(layout):
            raise _layout_error(layout)
        use_qk_l2norm, update_state, check_duplicate_writes = _flags(use_qk_l2norm, update_state,
                                                                     check_duplicate_writes)
        t.op(q, k, v, state, o, a=a, b=b, A_log=A_log, dt_bias=dt_bias, g=g, beta=beta,
             read_slots=read_slots, write_slots=write_slots, token_slots=token_slots,
             num_accepted=num_accepted, inter=inter, error_count=error_count,
             rounding_seed=_seed_tensor(t, rounding_seed), layout=layout, scale=scale,
             use_qk_l2norm=use_qk_l2norm, update_state=update_state,
             check_duplicate_writes=check_duplicate_writes)
        return o
    _run(q, k, v, state, o, a, b, A_log, dt_bias, g, beta, read_slots, write_slots, token_slots,
         num_accepted, inter, error_count, rounding_seed, layout, scale, use_qk_l2norm, update_state,
         check_duplicate_writes, stream)
    return o


def reference_decode(
    q,
    k,
    v,
    state,
    o=None,
    *,
    a=None,
    b=None,
    A_log=None,
    dt_bias=None,
    g=None,
    beta=None,
    layout=None,
    read_slots=None,
    write_slots=None,
    token_slots=None,
    num_accepted=None,
    inter=None,
    error_count=None,
    rounding_seed=None,
    scale=None,
    use_qk_l2norm=True,
    update_state=True,
    check_duplicate_writes=False,
    o_dtype=None,
    stream=None,
):
    """:func:`decode` computed by the float64 oracle (host tensors only, single thread, slow).

    Follows docs/semantics.md literally and rounds o, inter and the state to their
    dtypes only where they are stored (stochastically with ``rounding_seed``, drawing the
    same random bits as decode); the yardstick the tests measure decode against. ``stream`` is
    type-checked like decode's and otherwise ignored.
    """
    if o is None:
        o = _new_output(q, v, o_dtype)
    _run_reference(q, k, v, state, o, a, b, A_log, dt_bias, g, beta, read_slots, write_slots,
                   token_slots, num_accepted, inter, error_count, rounding_seed, layout, scale,
                   use_qk_l2norm, update_state, check_duplicate_writes, stream)
    return o


def fused_decode(
    mixed_qkv,
    conv_weight,
    conv_state,
    state,
    o=None,
    *,
    conv_bias=None,
    conv_inter=None,
    norm_weight=None,
    z=None,
    norm_eps=1e-6,
    a=None,
    b=None,
    A_log=None,
    dt_bias=None,
    g=None,
    beta=None,
    layout=None,
    read_slots=None,
    write_slots=None,
    token_slots=None,
    num_accepted=None,
    inter=None,
    error_count=None,
    rounding_seed=None,
    scale=None,
    use_qk_l2norm=True,
    update_state=True,
    check_duplicate_writes=False,
    o_dtype=None,
    stream=None,
):
    """One fused GDN layer step (docs/semantics.md section 6); returns ``o`` [B, T, HV, V].

    ``mixed_qkv`` [B, T, D] (D = 2*H*K + HV*V, order q | k | v) goes through the causal
    depthwise conv (``conv_weight`` [D, W], optional ``conv_bias`` [D]) over the conv pool
    ``conv_state`` [P, D, L] (L >= W - 1, column L - 1 the newest input; any strides), SiLU,
    the split into q, k, v, the recurrence of :func:`decode` (gates, ``state``, ``layout``,
    slots, ``inter``, flags exactly as there; the conv pool follows the state's slots), and,
    with ``norm_weight`` [V], the gated RMSNorm ``o * rsqrt(mean(o^2) + norm_eps) *
    norm_weight * silu(z)`` (``z`` [B, T, HV, V] optional). ``conv_inter`` [B, T, D, L]
    receives the conv state after every token. Both pools are updated in place unless
    ``update_state`` is False. ``o`` is allocated with mixed_qkv's framework when None (dtype
    ``o_dtype`` or mixed_qkv's). ``rounding_seed``, errors, streams and devices as in
    :func:`decode` (the seed rounds the recurrent state's stores, never the conv state's).
    """
    if o is None:
        o = _new_fused_output(mixed_qkv, state, layout, o_dtype)
    t = _torch_api if _torch_api is not None else _load_torch()
    if t is not None and t.compiling():
        if not _is_layout(layout):
            raise _layout_error(layout)
        use_qk_l2norm, update_state, check_duplicate_writes = _flags(use_qk_l2norm, update_state,
                                                                     check_duplicate_writes)
        t.fused_op(mixed_qkv, conv_weight, conv_state, state, o, conv_bias=conv_bias, conv_inter=conv_inter,
                   norm_weight=norm_weight, z=z, norm_eps=norm_eps, a=a, b=b, A_log=A_log, dt_bias=dt_bias, g=g,
                   beta=beta, read_slots=read_slots, write_slots=write_slots, token_slots=token_slots,
                   num_accepted=num_accepted, inter=inter, error_count=error_count,
                   rounding_seed=_seed_tensor(t, rounding_seed), layout=layout, scale=scale,
                   use_qk_l2norm=use_qk_l2norm, update_state=update_state,
                   check_duplicate_writes=check_duplicate_writes)
        return o
    _run_fused(mixed_qkv, conv_weight, conv_state, conv_bias, conv_inter, norm_weight, z, state, o, a, b, A_log,
               dt_bias, g, beta, read_slots, write_slots, token_slots, num_accepted, inter, error_count,
               rounding_seed, layout, scale, use_qk_l2norm, update_state, check_duplicate_writes, stream, norm_eps)
    return o


def reference_fused_decode(
    mixed_qkv,
    conv_weight,
    conv_state,
    state,
    o=None,
    *,
    conv_bias=None,
    conv_inter=None,
    norm_weight=None,
    z=None,
    norm_eps=1e-6,
    a=None,
    b=None,
    A_log=None,
    dt_bias=None,
    g=None,
    beta=None,
    layout=None,
    read_slots=None,
    write_slots=None,
    token_slots=None,
    num_accepted=None,
    inter=None,
    error_count=None,
    rounding_seed=None,
    scale=None,
    use_qk_l2norm=True,
    update_state=True,
    check_duplicate_writes=False,
    o_dtype=None,
    stream=None,
):
    """:func:`fused_decode` computed by the float64 oracle (host tensors only, single thread, slow).

    Rounds o, inter, the state, conv_inter and the conv state to their dtypes only where they
    are stored; the yardstick the tests measure fused_decode against. ``stream`` is
    type-checked like fused_decode's and otherwise ignored.
    """
    if o is None:
        o = _new_fused_output(mixed_qkv, state, layout, o_dtype)
    _run_reference_fused(mixed_qkv, conv_weight, conv_state, conv_bias, conv_inter, norm_weight, z, state, o, a, b,
                         A_log, dt_bias, g, beta, read_slots, write_slots, token_slots, num_accepted, inter,
                         error_count, rounding_seed, layout, scale, use_qk_l2norm, update_state,
                         check_duplicate_writes, stream, norm_eps)
    return o


class Status:
    """Result of :func:`can_implement` and :func:`can_implement_fused`: truthy when the call is valid.

    ``code`` is "ok", "invalid_argument", "not_supported" or "cuda_error"; ``message``
    names the argument, what was expected and what was given.
    """

    __slots__ = ("code", "message")
    _NAMES = {0: "ok", 1: "invalid_argument", 2: "not_supported", 3: "cuda_error"}

    def __init__(self, code="ok", message=""):
        self.code = code
        self.message = message

    def __bool__(self):
        return self.code == "ok"

    @property
    def ok(self):
        return self.code == "ok"

    def __repr__(self):
        return f"gdn.Status({self.code!r}, {self.message!r})" if self.message else f"gdn.Status({self.code!r})"


_OK = Status()


def can_implement(
    q,
    k,
    v,
    state,
    o=None,
    *,
    a=None,
    b=None,
    A_log=None,
    dt_bias=None,
    g=None,
    beta=None,
    layout=None,
    read_slots=None,
    write_slots=None,
    token_slots=None,
    num_accepted=None,
    inter=None,
    error_count=None,
    rounding_seed=None,
    scale=None,
    use_qk_l2norm=True,
    update_state=True,
    check_duplicate_writes=False,
    o_dtype=None,
    stream=None,
):
    """Runs :func:`decode`'s checks without touching tensor data; returns a :class:`Status`.

    Arguments the C++ checks never see (a non-tensor, a bad ``layout``, a mistyped scalar,
    a torch tensor that requires grad) still raise TypeError or ValueError. When ``o`` is
    None one is allocated (uninitialised) to check against.
    """
    if o is None:
        o = _new_output(q, v, o_dtype)
    r = _check(q, k, v, state, o, a, b, A_log, dt_bias, g, beta, read_slots, write_slots,
               token_slots, num_accepted, inter, error_count, rounding_seed, layout, scale, use_qk_l2norm,
               update_state, check_duplicate_writes, stream)
    if r is None:
        return _OK
    return Status(Status._NAMES.get(r[0], str(r[0])), r[1])


def can_implement_fused(
    mixed_qkv,
    conv_weight,
    conv_state,
    state,
    o=None,
    *,
    conv_bias=None,
    conv_inter=None,
    norm_weight=None,
    z=None,
    norm_eps=1e-6,
    a=None,
    b=None,
    A_log=None,
    dt_bias=None,
    g=None,
    beta=None,
    layout=None,
    read_slots=None,
    write_slots=None,
    token_slots=None,
    num_accepted=None,
    inter=None,
    error_count=None,
    rounding_seed=None,
    scale=None,
    use_qk_l2norm=True,
    update_state=True,
    check_duplicate_writes=False,
    o_dtype=None,
    stream=None,
):
    """Runs :func:`fused_decode`'s checks without touching tensor data; returns a :class:`Status`.

    A function of its own rather than a mode of :func:`can_implement`: the two calls differ
    in their leading tensors (q, k, v against mixed_qkv, conv_weight, conv_state), and guessing
    which call was meant from ranks would turn a caller's mistake into a confusing message.
    What the binding checks itself raises as in fused_decode.
    """
    if o is None:
        o = _new_fused_output(mixed_qkv, state, layout, o_dtype)
    r = _check_fused(mixed_qkv, conv_weight, conv_state, conv_bias, conv_inter, norm_weight, z, state, o, a, b, A_log,
                     dt_bias, g, beta, read_slots, write_slots, token_slots, num_accepted, inter, error_count,
                     rounding_seed, layout, scale, use_qk_l2norm, update_state, check_duplicate_writes, stream,
                     norm_eps)
    if r is None:
        return _OK
    return Status(Status._NAMES.get(r[0], str(r[0])), r[1])


class _TorchImportHook:
    """Binds the torch integration right after torch's own import, when gdn came first.

    Without it, a gdn imported before torch would register torch.ops.gdn.decode only on
    its first eager call, and a first call inside torch.compile would have to import a
    module mid-trace: a graph break. The hook finds torch's spec through the other finders,
    in their order (so it never changes which torch is imported), wraps the loader's
    exec_module, and removes itself once torch has loaded. It never fails torch's import.
    """

    def find_spec(self, name, path=None, target=None):
        if name != "torch" or name in _modules:
            return None
        try:
            spec = None
            for finder in list(_sys.meta_path):
                find = getattr(finder, "find_spec", None)
                if finder is self or find is None:
                    continue
                spec = find(name, path, target)
                if spec is not None:
                    break
            loader = getattr(spec, "loader", None)
            exec_module = getattr(loader, "exec_module", None)
            if exec_module is None:
                return spec
            hook = self

            def exec_then_bind(module):
                try:
                    _sys.meta_path.remove(hook)
                except ValueError:
                    pass
                exec_module(module)
                try:
                    _load_torch()
                except Exception:  # noqa: BLE001 - retried on the first eager call instead
                    pass

            loader.exec_module = exec_then_bind
            return spec
        except Exception:  # noqa: BLE001 - fall back to the normal import machinery
            return None


if "torch" in _modules:
    _load_torch()
else:
    _sys.meta_path.insert(0, _TorchImportHook())
