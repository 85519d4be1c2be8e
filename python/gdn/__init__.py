"""gdn: Gated DeltaNet decode steps over a pool of recurrent states, on the CPU or CUDA.

One entry point, :func:`decode`, runs every addressing mode (dense, pool, split pool,
per-token slots, accepted-token continuation) on any DLPack tensors (torch, numpy,
cupy, jax) without copying them. :func:`reference_decode` runs the float64 oracle with
the same signature; :func:`can_implement` runs only the checks. ``gdn.flashinfer`` has
drop-in functions with FlashInfer's names and parameters. See docs/python.md.

torch is optional and never imported by gdn: once the caller has imported it, torch
tensors take a fast path, ``torch.ops.gdn.decode`` is registered, and calls made under
``torch.compile`` go through that custom op.
"""

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

# The module gdn._torch once the caller has imported torch; None until then. (Not named
# _torch: `from . import _torch` would find this attribute instead of the submodule.)
_torch_api = None


def _load_torch():
    """Binds the torch integration if the caller has imported torch; else returns None."""
    global _torch_api, _run
    if "torch" not in _modules:
        return None
    from . import _torch as t  # registers torch.ops.gdn.decode

    _run = t._run  # gdn._C_torch where available: it reads torch tensors natively
    _torch_api = t
    return t


def _stream_handle(stream):
    # cupy streams expose .ptr, torch streams .cuda_stream; anything else must be an int.
    for attr in ("ptr", "cuda_stream"):
        h = getattr(stream, attr, None)
        if h is not None:
            return int(h)
    return int(stream)


def _out_shape(q, v):
    try:
        return (q.shape[0], q.shape[1], v.shape[2], v.shape[3])
    except (IndexError, AttributeError, TypeError):
        raise ValueError(
            "cannot infer o's shape [B, T, HV, V]: q must be [B, T, H, K] and v [B, T, HV, V], got q "
            f"{tuple(getattr(q, 'shape', ()))} and v {tuple(getattr(v, 'shape', ()))}"
        ) from None


def _new_output(q, v, o_dtype):
    """Allocates o [B, T, HV, V] with q's framework and device (dtype: o_dtype or q's)."""
    shape = _out_shape(q, v)
    t = _torch_api if _torch_api is not None else _load_torch()
    if t is not None and isinstance(q, t.Tensor):
        return t.new_output(shape, q, o_dtype)
    np = _modules.get("numpy")
    if np is not None and isinstance(q, np.ndarray):
        return np.empty(shape, dtype=q.dtype if o_dtype is None else o_dtype)
    dtype = q.dtype if o_dtype is None else o_dtype
    namespace = getattr(q, "__array_namespace__", None)
    if namespace is not None:
        return namespace().empty(shape, dtype=dtype, device=q.device)
    # Frameworks without the array API (cupy): their own empty() allocates on the
    # current device, the convention those frameworks use.
    mod = _modules.get(type(q).__module__.partition(".")[0])
    empty = getattr(mod, "empty", None)
    if empty is None:
        raise ValueError(f"o: cannot allocate an output for q of type {type(q).__name__}; pass o")
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
    layout="VK",
    read_slots=None,
    write_slots=None,
    token_slots=None,
    num_accepted=None,
    inter=None,
    error_count=None,
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
    ``read_slots``/``write_slots`` [B] or ``token_slots`` [B, T] (+ ``num_accepted`` [B]);
    ``layout`` "VK" = [.., V, K] (K contiguous) or "KV" = [.., K, V]. The state and
    ``inter`` [B, T, HV, <layout>] are updated in place. ``o`` is allocated with q's
    framework when None (dtype ``o_dtype`` or q's). ``stream``: a CUDA stream (int, or an
    object with ``.ptr`` / ``.cuda_stream``); default torch's current stream for torch
    tensors, else the legacy default stream. Bad arguments raise ValueError naming the
    argument; a failed CUDA launch raises RuntimeError. See docs/python.md.
    """
    if o is None:
        o = _new_output(q, v, o_dtype)
    t = _torch_api if _torch_api is not None else _load_torch()
    if t is not None and t.compiling():
        # Under torch.compile the call must be an op the graph can hold.
        t.op(q, k, v, state, o, a, b, A_log, dt_bias, g, beta, read_slots, write_slots, token_slots,
             num_accepted, inter, error_count, layout, scale, use_qk_l2norm, update_state,
             check_duplicate_writes)
        return o
    if stream is not None and type(stream) is not int:
        stream = _stream_handle(stream)
    _run(q, k, v, state, o, a, b, A_log, dt_bias, g, beta, read_slots, write_slots, token_slots,
         num_accepted, inter, error_count, layout, scale, use_qk_l2norm, update_state,
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
    layout="VK",
    read_slots=None,
    write_slots=None,
    token_slots=None,
    num_accepted=None,
    inter=None,
    error_count=None,
    scale=None,
    use_qk_l2norm=True,
    update_state=True,
    check_duplicate_writes=False,
    o_dtype=None,
    stream=None,
):
    """:func:`decode` computed by the float64 oracle (host tensors only, single thread, slow).

    Follows docs/semantics.md literally and rounds o, inter and the state to their
    dtypes only where they are stored; the yardstick the tests measure decode against.
    ``stream`` is accepted for signature parity and ignored.
    """
    if o is None:
        o = _new_output(q, v, o_dtype)
    _run_reference(q, k, v, state, o, a, b, A_log, dt_bias, g, beta, read_slots, write_slots,
                   token_slots, num_accepted, inter, error_count, layout, scale, use_qk_l2norm,
                   update_state, check_duplicate_writes, None)
    return o


class Status:
    """Result of :func:`can_implement`: truthy when the call is valid.

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
    layout="VK",
    read_slots=None,
    write_slots=None,
    token_slots=None,
    num_accepted=None,
    inter=None,
    error_count=None,
    scale=None,
    use_qk_l2norm=True,
    update_state=True,
    check_duplicate_writes=False,
    o_dtype=None,
    stream=None,
):
    """Runs :func:`decode`'s checks without touching tensor data; returns a :class:`Status`.

    Arguments the C++ checks never see (a non-tensor, a bad ``layout``) still raise
    ValueError. When ``o`` is None one is allocated (uninitialised) to check against.
    """
    if o is None:
        o = _new_output(q, v, o_dtype)
    r = _check(q, k, v, state, o, a, b, A_log, dt_bias, g, beta, read_slots, write_slots,
               token_slots, num_accepted, inter, error_count, layout, scale, use_qk_l2norm,
               update_state, check_duplicate_writes, None)
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
