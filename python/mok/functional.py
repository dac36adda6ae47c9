"""functional.py — mok's functional API in the shape of MoK's: Config, Group, Workspace, and the
passes build_schedule / forward / backward / recompute_forward_context, plus the reference.

Every pass argument is per local rank: a list with one entry per rank this process drives (a bare
array is accepted when it drives one, and the results then come back bare too). Arrays are numpy
arrays (cpu backend; bf16 carried as np.uint16 bit patterns, see mok.bf16) or torch tensors
(torch.bfloat16 / float32 / int32, contiguous, on the CPU for the cpu backend or on the rank's GPU
for cuda). Shapes, dtypes, devices and contiguity are checked here with a ValueError that names
the argument; ranges (T <= max_tokens, expert ids) are the library's to check, and it raises
MokError with its own message. Outputs are allocated here, of the inputs' kind.

Precision: a Workspace is bf16 (the default) or precision="fp8" (include/mok.h, FP8: block-scaled
E4M3 GEMM operands). An FP8 workspace's passes take the FP8 weights beside the bf16 ones:
quantize_weights(ws, weights...) writes them (FP8Weights, one per local rank) once per change of
the weights, and forward / backward / recompute_forward_context take them as fp8_weights=.
"""
import ctypes
import dataclasses
import sys
from ctypes import POINTER, byref, c_float, c_int, c_int32, c_int64, c_void_p

import numpy as np

from . import _lib
from ._lib import CONTEXT_TAG_BYTES, ROW_TILE, Backend, Direction, FP8Matrix, Precision

__all__ = [
    "Config", "Group", "Workspace", "Sizes", "Schedule", "ScheduleInfo", "Context", "backend_available", "device_count",
    "build_schedule", "forward", "backward", "recompute_forward_context", "reference_forward",
    "reference_backward", "FP8Layout", "FP8Weights", "quantize_weights",
]

# ---- config --------------------------------------------------------------------------------------------

# MoK's names for the knobs mok shares (MoK's "macrobatch" is mok's ring of rows).
_ALIASES = {
    "fwd_num_comm_sms": "fwd_comm_sms",
    "bwd_num_comm_sms": "bwd_comm_sms",
    "minibatch_size": "minibatch_rows",
    "macrobatch_size": "ring_rows",
}
_DIRECTIONS = ("fwd_dispatch", "fwd_combine", "bwd_combine", "bwd_dispatch")


def _direction_name(value, field):
    if isinstance(value, str) and value.lower() in ("pull", "push"):
        return value.lower()
    if not isinstance(value, str) and value in (Direction.PULL, Direction.PUSH):
        return Direction(int(value)).name.lower()
    raise ValueError(f"Config.{field}: {value!r} is not 'pull' or 'push'")


@dataclasses.dataclass(frozen=True, init=False)
class Config:
    """mok_config. Keyword arguments only; MoK's names are accepted too (fwd_num_comm_sms,
    bwd_num_comm_sms, minibatch_size, macrobatch_size) and read back as properties. The defaults
    are MOK_CONFIG_INIT's. The library checks the values (Config.validate, or any call taking it)."""
    fwd_comm_sms: int = 0  # 0: the backend's choice, from the layer's bytes per FLOP (docs/design.md §2.4)
    bwd_comm_sms: int = 0
    minibatch_rows: int = 4096
    ring_rows: int = 32768
    context_rows: int = 0
    swiglu_limit: float = 0.0
    peer_timeout_ms: float = 10000.0
    cpu_threads: int = 0
    cpu_comm_threads: int = 1
    fwd_dispatch: str = "pull"
    fwd_combine: str = "push"
    bwd_combine: str = "pull"
    bwd_dispatch: str = "push"
    trace: bool = False

    def __init__(self, **kwargs):
        names = {f.name: f for f in dataclasses.fields(self)}
        for f in names.values():
            object.__setattr__(self, f.name, f.default)
        for key, value in kwargs.items():
            name = _ALIASES.get(key, key)
            if name not in names:
                raise TypeError(f"Config: unknown field {key!r}")
            if name != key and name in kwargs:
                raise TypeError(f"Config: both {key!r} and its mok name {name!r} given")
            object.__setattr__(self, name, value)
        for name in _DIRECTIONS:
            object.__setattr__(self, name, _direction_name(getattr(self, name), name))
        object.__setattr__(self, "trace", bool(self.trace))

    # MoK's names, read-only.
    fwd_num_comm_sms = property(lambda self: self.fwd_comm_sms)
    bwd_num_comm_sms = property(lambda self: self.bwd_comm_sms)
    minibatch_size = property(lambda self: self.minibatch_rows)
    macrobatch_size = property(lambda self: self.ring_rows)

    def replace(self, **changes):
        """A copy with some fields changed (MoK's names accepted)."""
        values = dataclasses.asdict(self)
        for key, value in changes.items():
            values.pop(_ALIASES.get(key, key), None)
        values.update(changes)
        return Config(**values)

    def to_struct(self):
        c = _lib.lib.mok_config_default()
        c.size = ctypes.sizeof(_lib.Config)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in _DIRECTIONS:
                value = int(Direction.PULL if value == "pull" else Direction.PUSH)
            elif f.name == "trace":
                value = int(value)
            try:
                setattr(c, f.name, value)
            except TypeError as err:
                raise ValueError(f"Config.{f.name}: {value!r} does not fit the C field ({err})") from None
        return c

    @classmethod
    def from_struct(cls, c):
        values = {f.name: getattr(c, f.name) for f in dataclasses.fields(cls)}
        return cls(**values)

    @classmethod
    def default(cls):
        """The library's MOK_CONFIG_INIT (mok_config_default)."""
        return cls.from_struct(_lib.lib.mok_config_default())

    def validate(self):
        """Raises MokError with the library's message when a field breaks a rule."""
        c = self.to_struct()
        _lib.call("mok_config_validate", byref(c))
        return self


def _config_struct(config):
    if config is None:
        return None
    if isinstance(config, _lib.Config):
        return config
    if not isinstance(config, Config):
        raise TypeError(f"config: expected mok.Config, got {type(config).__name__}")
    return config.to_struct()


# ---- backends and groups -------------------------------------------------------------------------------

_BACKENDS = {"auto": Backend.AUTO, "cpu": Backend.CPU, "cuda": Backend.CUDA}


def _backend(value):
    if isinstance(value, str):
        if value.lower() not in _BACKENDS:
            raise ValueError(f"backend: {value!r} is not 'cpu', 'cuda' or 'auto'")
        return _BACKENDS[value.lower()]
    if value in (Backend.AUTO, Backend.CPU, Backend.CUDA):
        return Backend(int(value))
    raise ValueError(f"backend: {value!r} is not 'cpu', 'cuda' or 'auto'")


_PRECISIONS = {"bf16": Precision.BF16, "fp8": Precision.FP8}


def _precision(value, what="precision"):
    """The name ("bf16" or "fp8") of a precision given as a name (any case) or a mok Precision."""
    if isinstance(value, str) and value.lower() in _PRECISIONS:
        return value.lower()
    if not isinstance(value, str) and value in (Precision.BF16, Precision.FP8):
        return Precision(int(value)).name.lower()
    raise ValueError(f"{what}: {value!r} is not 'bf16' or 'fp8'")


def device_count(backend):
    """cpu and auto: 1; cuda: the number of usable GPUs (0 without a CUDA build or a GPU)."""
    return _lib.lib.mok_backend_available(int(_backend(backend)))


def backend_available(backend):
    """Whether this build and machine can run the backend: cpu and auto always, cuda with a GPU."""
    return device_count(backend) > 0


class _Closing:
    """`with` and garbage collection both end in close()."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class Group(_Closing):
    """An expert-parallel group (mok_group). Made by Group.create_local (one process drives every
    rank) or Group.create (one process or thread per rank; collective). close() it after every
    workspace made on it; closing the group closes them first."""

    def __init__(self, handle, devices, config):
        self._handle = handle
        # NOTE: the handle boxes of the live workspaces, not the workspaces: the group must destroy
        # them before itself even when the garbage collector finalizes the group first (it clears
        # weak references before it runs finalizers, so a WeakSet would already be empty then).
        self._workspaces = set()
        nranks, num_local, first, backend = c_int(), c_int(), c_int(), c_int()
        _lib.call("mok_group_info", handle, byref(nranks), byref(num_local), byref(first), byref(backend))
        self.nranks = nranks.value
        self.num_local_ranks = num_local.value
        self.first_rank = first.value
        self.backend = Backend(backend.value).name.lower()
        self.devices = list(devices) if self.backend == "cuda" else None  # GPU of each local rank
        self.config = config if config is not None else Config.default()

    @staticmethod
    def unique_id(backend="auto"):
        """A fresh id (128 bytes) for Group.create; rank 0 makes it and sends it to the others."""
        uid = _lib.UniqueId()
        _lib.call("mok_unique_id_create", int(_backend(backend)), byref(uid))
        return _lib.id_bytes(uid)

    @classmethod
    def create_local(cls, nranks, backend="auto", devices=None, config=None):
        """One process drives all nranks ranks. devices: GPU ordinals for cuda (default 0..nranks-1)."""
        b = _backend(backend)
        if devices is None and b != Backend.CPU and device_count("cuda") >= nranks:
            devices = list(range(nranks))
        if devices is not None:
            devices = [int(d) for d in devices]
            if len(devices) != nranks:
                raise ValueError(f"devices: expected {nranks} GPU ordinals, got {len(devices)}")
        handle = c_void_p()
        dev = (c_int * nranks)(*devices) if devices is not None else None
        cfg = _config_struct(config)
        _lib.call("mok_group_create_local", byref(handle), int(b), int(nranks), dev,
                  byref(cfg) if cfg is not None else None)
        return cls(handle, devices or [], config)

    @classmethod
    def create(cls, nranks, rank, unique_id, device=0, backend="auto", config=None):
        """This process (or thread, on cpu) is rank `rank` of nranks; every rank calls it with the same
        unique_id (from Group.unique_id on rank 0). device: this rank's GPU (cuda)."""
        uid = _lib.id_from_bytes(unique_id)
        handle = c_void_p()
        cfg = _config_struct(config)
        _lib.call("mok_group_create", byref(handle), int(_backend(backend)), int(nranks), int(rank), byref(uid),
                  int(device), byref(cfg) if cfg is not None else None)
        return cls(handle, [int(device)], config)

    @property
    def handle(self):
        if self._handle is None:
            raise ValueError("group: already closed")
        return self._handle

    def close(self):
        if self._handle is None:
            return
        for box in list(self._workspaces):
            _destroy_workspace(self, box)
        handle, self._handle = self._handle, None
        _lib.call("mok_group_destroy", handle)

    def __repr__(self):
        return (f"mok.Group(backend={self.backend!r}, nranks={self.nranks}, num_local_ranks={self.num_local_ranks}, "
                f"first_rank={self.first_rank})")


# ---- workspace ------------------------------------------------------------------------------------------

class _Box:
    """A workspace's handle cell, hashed by identity of the cell so the group's set can hold it."""
    __slots__ = ("cell",)

    def __init__(self, cell):
        self.cell = cell

    def __hash__(self):
        return id(self.cell)

    def __eq__(self, other):
        return isinstance(other, _Box) and other.cell is self.cell


def _destroy_workspace(group, box):
    """Destroys a workspace once, whichever of it and its group is closed first."""
    handle, box.cell[0] = box.cell[0], None
    group._workspaces.discard(box)
    if handle is not None:
        _lib.call("mok_workspace_destroy", handle)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """mok_sizes: bytes per local rank."""
    schedule_bytes: int
    context_bytes: int
    symmetric_bytes: int
    workspace_bytes: int
    max_routed_rows: int


@dataclasses.dataclass(frozen=True)
class ScheduleInfo:
    """mok_schedule_info of one local rank (num_tokens: T of every rank of the group)."""
    num_tokens: tuple
    routed_rows: int
    padded_rows: int
    num_minibatches: int
    num_macrobatches: int
    max_expert_rows: int


@dataclasses.dataclass(frozen=True)
class FP8Layout:
    """mok_fp8_layout of an FP8 workspace: the bytes of one rank's FP8 weights and, per matrix
    (FP8Matrix names in lower case: "w_gate", ..., "s_down_t"), the byte offsets of its E4M3 codes
    and of its fp32 block scales."""
    bytes: int
    codes: dict
    scales: dict


class Workspace(_Closing):
    """The buffers of one layer shape on one group (mok_workspace). Collective: every rank makes it
    with the same shape and config. config=None takes the group's. One workspace serves many layer
    calls of its shape; the schedule and context of each call are separate buffers. precision:
    "bf16" or "fp8" (H, I and I_s then multiples of 128; the passes take fp8_weights, and
    fp8_layout says their size)."""

    def __init__(self, group, hidden, intermediate, num_experts, topk, shared_intermediate=0, *, max_tokens,
                 config=None, precision="bf16"):
        if not isinstance(group, Group):
            raise TypeError(f"group: expected mok.Group, got {type(group).__name__}")
        self._box = [None]  # [mok_workspace *], shared with the group (see Group.__init__)
        self.group = group
        self.hidden, self.intermediate = int(hidden), int(intermediate)
        self.num_experts, self.topk = int(num_experts), int(topk)
        self.shared_intermediate, self.max_tokens = int(shared_intermediate), int(max_tokens)
        self.precision = _precision(precision, "Workspace: precision")
        self.config = config if config is not None else group.config
        shape = self._shape()
        cfg = _config_struct(config)
        handle = c_void_p()
        _lib.call("mok_workspace_create", byref(handle), group.handle, byref(shape),
                  byref(cfg) if cfg is not None else None)
        self._box = [handle]
        group._workspaces.add(_Box(self._box))
        s = _lib.Sizes()
        _lib.call("mok_workspace_sizes", handle, byref(s))
        self.sizes = Sizes(s.schedule_bytes, s.context_bytes, s.symmetric_bytes, s.workspace_bytes, s.max_routed_rows)
        self.num_local_experts = self.num_experts // group.nranks
        self.fp8_layout = None
        if self.precision == "fp8":
            layout = _lib.FP8Layout()
            _lib.call("mok_workspace_fp8_layout", handle, byref(layout))
            self.fp8_layout = FP8Layout(layout.bytes, {m.name.lower(): layout.codes[m] for m in FP8Matrix},
                                        {m.name.lower(): layout.scales[m] for m in FP8Matrix})

    def _shape(self):
        return _lib.Shape(self.hidden, self.intermediate, self.num_experts, self.topk, self.shared_intermediate,
                          self.max_tokens, int(_PRECISIONS[self.precision]))

    nranks = property(lambda self: self.group.nranks)
    num_local_ranks = property(lambda self: self.group.num_local_ranks)
    backend = property(lambda self: self.group.backend)

    @property
    def _handle(self):
        return self._box[0]

    @property
    def handle(self):
        if self._box[0] is None:
            raise ValueError("workspace: already closed")
        return self._box[0]

    def synchronize(self):
        """Waits for every pass on every local rank and reports errors the kernels recorded."""
        _lib.call("mok_synchronize", self.handle)

    def trace_write(self, path):
        """Chrome trace JSON of the last pass (needs Config(trace=True))."""
        _lib.call("mok_trace_write", self.handle, str(path).encode())

    def close(self):
        """Frees the workspace (on a group of one rank per process, a barrier with the peers)."""
        _destroy_workspace(self.group, _Box(self._box))

    def __repr__(self):
        return (f"mok.Workspace(hidden={self.hidden}, intermediate={self.intermediate}, num_experts={self.num_experts}, "
                f"topk={self.topk}, shared_intermediate={self.shared_intermediate}, max_tokens={self.max_tokens}, "
                f"precision={self.precision!r}, backend={self.backend!r}, nranks={self.nranks})")


# ---- arrays: numpy or torch --------------------------------------------------------------------------

_NUMPY = {"bf16": np.dtype(np.uint16), "f32": np.dtype(np.float32), "i32": np.dtype(np.int32), "u8": np.dtype(np.uint8)}
_NAMES = {"bf16": "bf16 (np.uint16 bit patterns or torch.bfloat16)", "f32": "float32", "i32": "int32", "u8": "uint8"}


def _torch():
    return sys.modules.get("torch")


def _is_torch(a):
    t = _torch()
    return t is not None and isinstance(a, t.Tensor)


def _torch_dtype(logical):
    t = _torch()
    return {"bf16": t.bfloat16, "f32": t.float32, "i32": t.int32, "u8": t.uint8}[logical]


def _kind(a):
    if isinstance(a, np.ndarray):
        return "numpy"
    if _is_torch(a):
        return "torch"
    return None


def _np_aligned(shape, dtype, zero=False):
    """A C-contiguous numpy array whose data starts on a 64-byte boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = (np.zeros if zero else np.empty)(nbytes + 64, np.uint8)
    offset = (-raw.ctypes.data) % 64
    return raw[offset:offset + nbytes].view(dtype).reshape(shape)


def _ptr(a):
    if a is None:
        return None
    if isinstance(a, np.ndarray):
        return a.ctypes.data
    return a.data_ptr()


class _Call:
    """The checks of one call: the array kind (numpy or torch) every array must share, and the device
    each local rank's arrays must live on."""

    def __init__(self, ws, what):
        self.ws = ws
        self.what = what
        self.kind = None

    def device_of(self, rank):
        if self.ws.backend == "cuda":
            return _torch().device("cuda", self.ws.group.devices[rank])
        return _torch().device("cpu") if self.kind == "torch" else None

    def check(self, a, name, logical, shape, rank, *, output=False, optional=False):
        """Checks one array and returns what to pass (an aligned copy of a misaligned input)."""
        if a is None:
            if optional:
                return None
            raise ValueError(f"{self.what}: {name} is required")
        kind = _kind(a)
        if kind is None:
            raise ValueError(f"{self.what}: {name} must be a numpy array or a torch tensor, got {type(a).__name__}")
        if self.kind is None:
            self.kind = kind
            if kind == "numpy" and self.ws.backend == "cuda":
                raise ValueError(f"{self.what}: the cuda backend takes torch tensors on each rank's GPU; "
                                 f"{name} is a numpy array (host memory): use torch tensors for cuda")
        elif kind != self.kind:
            raise ValueError(f"{self.what}: {name} is a {kind} array but the call's other arrays are {self.kind}; "
                             "use one kind throughout")
        if kind == "numpy":
            if logical == "bf16" and a.dtype.itemsize == 2 and a.dtype.name == "bfloat16":
                a = a.view(np.uint16)  # ml_dtypes' bfloat16
            if a.dtype != _NUMPY[logical]:
                raise ValueError(f"{self.what}: {name} has dtype {a.dtype}, expected {_NAMES[logical]}")
        else:
            if a.dtype != _torch_dtype(logical):
                raise ValueError(f"{self.what}: {name} has dtype {a.dtype}, expected {_NAMES[logical]}")
            want = self.device_of(rank)
            if a.device != want:
                raise ValueError(f"{self.what}: {name} is on {a.device}, but local rank {rank} of this "
                                 f"{self.ws.backend} workspace needs it on {want}")
            if a.requires_grad:
                a = a.detach()
        if tuple(a.shape) != tuple(shape):
            raise ValueError(f"{self.what}: {name} has shape {tuple(a.shape)}, expected {tuple(shape)}")
        contiguous = a.flags.c_contiguous if kind == "numpy" else a.is_contiguous()
        if not contiguous:
            raise ValueError(f"{self.what}: {name} must be contiguous (row-major)")
        count = a.size if kind == "numpy" else a.numel()
        if count and _ptr(a) % _lib.ALIGN != 0:
            if output:
                raise ValueError(f"{self.what}: {name} must start on a {_lib.ALIGN}-byte boundary")
            if kind == "numpy":
                copy = _np_aligned(a.shape, a.dtype)
                copy[...] = a
                a = copy
            else:
                a = a.clone()
        return a

    def empty(self, shape, logical, rank, zero=False):
        if self.kind == "torch":
            t = _torch()
            make = t.zeros if zero else t.empty
            return make(tuple(shape), dtype=_torch_dtype(logical), device=self.device_of(rank))
        return _np_aligned(shape, _NUMPY[logical], zero)

    def stream(self, rank, streams):
        if streams is not None:
            return streams[rank]
        if self.ws.backend == "cuda":
            t = _torch()
            return t.cuda.current_stream(self.device_of(rank)).cuda_stream
        return None


def _per_rank(ws, value, name, broadcast=False):
    """One entry per local rank. Returns (list, bare)."""
    n = ws.num_local_ranks
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name}: expected {n} entries (one per local rank), got {len(value)}")
        return list(value), False
    if n != 1 and not (broadcast and value is None):
        if broadcast:
            return [value] * n, True
        raise ValueError(f"{name}: this group drives {n} local ranks: pass a list of {n} entries")
    return [value] * n, True


def _unbare(values, bare):
    return values[0] if bare else values


def _nonempty(a):
    """NULL for an empty array (T = 0), which the library accepts; its pointer otherwise."""
    if a is None:
        return None
    n = a.size if isinstance(a, np.ndarray) else a.numel()
    return _ptr(a) if n else None


def _cast(p, ctype):
    return ctypes.cast(c_void_p(p), POINTER(ctype)) if p else None


# ---- schedule, context ----------------------------------------------------------------------------------

class Schedule:
    """One local rank's schedule (caller memory of sizes.schedule_bytes), built by build_schedule."""

    def __init__(self, workspace, local_rank, buffer, num_tokens):
        self.workspace = workspace
        self.local_rank = local_rank
        self.buffer = buffer
        self.num_tokens = num_tokens

    @property
    def ptr(self):
        return _ptr(self.buffer)

    def info(self):
        """What the schedule says about its rank (on cuda this waits for the stream)."""
        i = _lib.ScheduleInfo()
        _lib.call("mok_schedule_read", self.workspace.handle, self.ptr, self.local_rank, byref(i))
        return ScheduleInfo(tuple(i.num_tokens[:self.workspace.nranks]), i.routed_rows, i.padded_rows,
                            i.num_minibatches, i.num_macrobatches, i.max_expert_rows)


class Context:
    """One local rank's forward context (caller memory of sizes.context_bytes): what the backward
    of the same layer call reads. Left by forward or recompute_forward_context. The buffer is not
    cleared: the pass writes the bytes the backward reads (to_bytes) and leaves the rest."""

    def __init__(self, workspace, local_rank, buffer, num_tokens, schedule):
        self.workspace = workspace
        self.local_rank = local_rank
        self.buffer = buffer
        self.num_tokens = num_tokens
        self.schedule = schedule

    @property
    def ptr(self):
        return _ptr(self.buffer)

    def to_bytes(self):
        """The activations the pass wrote (include/mok.h, mok_forward_args.context): the routed rows'
        g|u the context keeps, then the shared expert's of the T tokens. Not the context's tag
        (its first CONTEXT_TAG_BYTES), which names the workspace and schedule build that wrote it
        and so differs between contexts of equal activations. Reads the schedule back (on cuda this
        waits for the stream)."""
        ws = self.workspace
        cap = ws.sizes.max_routed_rows
        if 0 < ws.config.context_rows < cap:
            cap = -(-ws.config.context_rows // ROW_TILE) * ROW_TILE
        routed = min(self.schedule.info().padded_rows, cap) * 4 * ws.intermediate
        shared_at = CONTEXT_TAG_BYTES + -(-cap * 4 * ws.intermediate // 256) * 256
        b = self.buffer
        if not isinstance(b, np.ndarray):
            b = b.detach().cpu().numpy()
        b = b.view(np.uint8)
        return (b[CONTEXT_TAG_BYTES:CONTEXT_TAG_BYTES + routed].tobytes() +
                b[shared_at:shared_at + self.num_tokens * 4 * ws.shared_intermediate].tobytes())


def _schedules(ws, schedules):
    items, bare = _per_rank(ws, schedules, "schedules")
    for r, s in enumerate(items):
        if not isinstance(s, Schedule):
            raise ValueError(f"schedules[{r}]: expected a mok.Schedule from build_schedule, got {type(s).__name__}")
        if s.workspace is not ws or s.local_rank != r:
            raise ValueError(f"schedules[{r}]: built for another workspace or local rank")
    return items


def _contexts(ws, contexts, schedules):
    items, _ = _per_rank(ws, contexts, "contexts")
    for r, c in enumerate(items):
        if not isinstance(c, Context):
            raise ValueError(f"contexts[{r}]: expected a mok.Context from forward or recompute_forward_context, "
                             f"got {type(c).__name__}")
        if c.workspace is not ws or c.local_rank != r:
            raise ValueError(f"contexts[{r}]: made by another workspace or local rank")
        if c.num_tokens != schedules[r].num_tokens:
            raise ValueError(f"contexts[{r}]: made for {c.num_tokens} tokens but the schedule has {schedules[r].num_tokens}")
    return items


def build_schedule(ws, topk_ids_per_rank, *, streams=None, out=None):
    """Builds every local rank's schedule from its topk_ids [T, k] int32 (global expert ids, -1 =
    empty slot). Collective. Returns one Schedule per local rank (bare for a bare argument).
    out: caller buffers to build into (uint8 [sizes.schedule_bytes] per local rank, of the
    arrays' kind), for callers that own their memory (the custom ops of mok.ops)."""
    ids, bare = _per_rank(ws, topk_ids_per_rank, "topk_ids")
    outs, _ = _per_rank(ws, out, "out", broadcast=True)
    call = _Call(ws, "build_schedule")
    args = (_lib.ScheduleArgs * ws.num_local_ranks)()
    kept, out = [], []
    for r, a in enumerate(ids):
        if a is None or _kind(a) is None or len(a.shape) != 2:
            raise ValueError(f"build_schedule: topk_ids[{r}] must be a 2-d int32 array [T, k], got "
                             f"{getattr(a, 'shape', type(a).__name__)}")
        T = int(a.shape[0])
        a = call.check(a, f"topk_ids[{r}]", "i32", (T, ws.topk), r)
        buf = call.empty((ws.sizes.schedule_bytes,), "u8", r) if outs[r] is None else \
            call.check(outs[r], f"out[{r}]", "u8", (ws.sizes.schedule_bytes,), r, output=True)
        kept.append(a)
        out.append(Schedule(ws, r, buf, T))
        args[r].num_tokens = T
        args[r].topk_ids = _cast(_nonempty(a), c_int32)
        args[r].schedule = _ptr(buf)
        args[r].stream = call.stream(r, streams)
    _lib.call("mok_schedule_build", ws.handle, args)
    return _unbare(out, bare)


def _weights(call, ws, r, w_gate, w_up, w_down, s_gate, s_up, s_down, need_down=True):
    E, H, I, Is = ws.num_local_experts, ws.hidden, ws.intermediate, ws.shared_intermediate
    wg = call.check(w_gate[r], f"w_gate[{r}]", "bf16", (E, I, H), r)
    wu = call.check(w_up[r], f"w_up[{r}]", "bf16", (E, I, H), r)
    wd = call.check(w_down[r], f"w_down[{r}]", "bf16", (E, H, I), r, optional=not need_down)
    if Is > 0:
        sg = call.check(s_gate[r], f"s_gate[{r}]", "bf16", (Is, H), r)
        su = call.check(s_up[r], f"s_up[{r}]", "bf16", (Is, H), r)
        sd = call.check(s_down[r], f"s_down[{r}]", "bf16", (H, Is), r, optional=not need_down)
    else:
        for name, value in (("s_gate", s_gate[r]), ("s_up", s_up[r]), ("s_down", s_down[r])):
            if value is not None:
                raise ValueError(f"{call.what}: {name}[{r}] given but the workspace has no shared expert "
                                 "(shared_intermediate = 0)")
        sg = su = sd = None
    return wg, wu, wd, sg, su, sd


# ---- FP8 weights ----------------------------------------------------------------------------------------

def _fp8_layer(ws):
    """What one rank's FP8 weights depend on (the buffer's header, mok_fp8_layout): H, I, I_s and the
    experts per rank."""
    return (ws.hidden, ws.intermediate, ws.shared_intermediate, ws.num_local_experts)


def _fp8_matrix(matrix):
    if isinstance(matrix, str):
        try:
            return FP8Matrix[matrix.upper()]
        except KeyError:
            pass
    elif matrix in tuple(FP8Matrix):
        return FP8Matrix(int(matrix))
    names = ", ".join(m.name.lower() for m in FP8Matrix)
    raise ValueError(f"FP8Weights: {matrix!r} is not one of the FP8 matrices ({names})")


class FP8Weights:
    """One local rank's FP8 weights: caller memory of ws.fp8_layout.bytes (a uint8 array of the
    weights' kind, on their device) that mok_quantize_weights wrote from the bf16 weights: E4M3
    codes, one fp32 scale per 128 x 128 block, and the transposed copies the backward reads. Made by
    quantize_weights; the FP8 passes take it as fp8_weights=. It holds the weights of the moment it
    was made: after the bf16 weights change (an optimizer step), quantize again. Any FP8 workspace of
    the same layer (H, I, I_s, experts per rank) and local rank can use it."""

    def __init__(self, workspace, local_rank, buffer):
        self.workspace = workspace
        self.local_rank = local_rank
        self.buffer = buffer
        self.layer = _fp8_layer(workspace)
        self.layout = workspace.fp8_layout

    @property
    def ptr(self):
        return _ptr(self.buffer)

    @property
    def nbytes(self):
        return self.layout.bytes

    def _shape(self, m):
        """[E_local, rows, cols] of a routed matrix, [rows, cols] of a shared one (mok.h, mok_fp8_matrix)."""
        H, I, Is, E = self.layer
        shared = m >= FP8Matrix.S_GATE
        base = FP8Matrix(m - FP8Matrix.S_GATE if shared else m)
        inner = Is if shared else I
        rows, cols = (inner, H) if base in (FP8Matrix.W_GATE, FP8Matrix.W_UP, FP8Matrix.W_DOWN_T) else (H, inner)
        return (rows, cols) if shared else (E, rows, cols)

    def _bytes(self):
        b = self.buffer
        if not isinstance(b, np.ndarray):
            b = b.detach().cpu().numpy()
        return b.view(np.uint8)

    def codes(self, matrix):
        """A host copy of one matrix's E4M3 codes (uint8) in its shape: matrix is a name ("w_gate",
        "w_down_t", "s_up", ...) or an FP8Matrix. Shared matrices are empty without a shared expert."""
        m = _fp8_matrix(matrix)
        shape = self._shape(m)
        count = int(np.prod(shape, dtype=np.int64))
        start = self.layout.codes[m.name.lower()]
        return self._bytes()[start:start + count].copy().reshape(shape)

    def scales(self, matrix):
        """A host copy of one matrix's block scales (float32, powers of two): [..., rows / 128, cols / 128]."""
        m = _fp8_matrix(matrix)
        shape = self._shape(m)
        shape = shape[:-2] + (shape[-2] // _lib.FP8_BLOCK, shape[-1] // _lib.FP8_BLOCK)
        count = int(np.prod(shape, dtype=np.int64))
        start = self.layout.scales[m.name.lower()]
        return self._bytes()[start:start + 4 * count].copy().view(np.float32).reshape(shape)

    def __repr__(self):
        H, I, Is, E = self.layer
        return (f"mok.FP8Weights(local_rank={self.local_rank}, hidden={H}, intermediate={I}, "
                f"shared_intermediate={Is}, num_local_experts={E}, bytes={self.nbytes})")


def quantize_weights(ws, w_gate, w_up, w_down, s_gate=None, s_up=None, s_down=None, *, streams=None):
    """The FP8 weights of every local rank (mok_quantize_weights) from its bf16 weights, laid out as
    forward's: w_gate / w_up [E_local, I, H], w_down [E_local, H, I], the shared expert s_gate / s_up
    [I_s, H], s_down [H, I_s] (None without one). Returns one FP8Weights per local rank (bare for a
    bare w_gate), for the passes' fp8_weights=. Deterministic: the same weights give the same bits.
    Not collective. Call it again after every change of the weights (once per optimizer step)."""
    if not isinstance(ws, Workspace):
        raise TypeError(f"quantize_weights: expected mok.Workspace, got {type(ws).__name__}")
    if ws.precision != "fp8":
        raise ValueError(f"quantize_weights: the workspace's precision is {ws.precision}; FP8 weights belong to "
                         "a Workspace(..., precision='fp8')")
    w_gate, bare = _per_rank(ws, w_gate, "w_gate")
    w_up, _ = _per_rank(ws, w_up, "w_up")
    w_down, _ = _per_rank(ws, w_down, "w_down")
    s_gate, _ = _per_rank(ws, s_gate, "s_gate", broadcast=True)
    s_up, _ = _per_rank(ws, s_up, "s_up", broadcast=True)
    s_down, _ = _per_rank(ws, s_down, "s_down", broadcast=True)
    call = _Call(ws, "quantize_weights")
    args = (_lib.QuantizeArgs * ws.num_local_ranks)()
    kept, out = [], []
    for r in range(ws.num_local_ranks):
        weights = _weights(call, ws, r, w_gate, w_up, w_down, s_gate, s_up, s_down)
        buffer = call.empty((ws.fp8_layout.bytes,), "u8", r)
        kept.append(weights)
        out.append(FP8Weights(ws, r, buffer))
        a = args[r]
        a.w_gate, a.w_up, a.w_down, a.s_gate, a.s_up, a.s_down = (_ptr(w) for w in weights)
        a.fp8_weights = _ptr(buffer)
        a.stream = call.stream(r, streams)
    _lib.call("mok_quantize_weights", ws.handle, args)
    return _unbare(out, bare)


def _fp8_pointers(call, ws, fp8_weights):
    """The fp8_weights argument of a pass: None for a bf16 workspace, else one FP8Weights per local
    rank made for this layer and local rank; their buffers' pointers (checked like the arrays)."""
    if ws.precision != "fp8":
        if fp8_weights is not None:
            raise ValueError(f"{call.what}: fp8_weights given, but the workspace's precision is {ws.precision} "
                             "(FP8 weights belong to a Workspace(..., precision='fp8'))")
        return [None] * ws.num_local_ranks
    if fp8_weights is None:
        raise ValueError(f"{call.what}: fp8_weights is required: the workspace's precision is fp8 "
                         "(quantize_weights makes them from the bf16 weights)")
    items, _ = _per_rank(ws, fp8_weights, "fp8_weights")
    pointers = []
    for r, q in enumerate(items):
        if not isinstance(q, FP8Weights):
            raise ValueError(f"{call.what}: fp8_weights[{r}] must be the FP8Weights that quantize_weights returns, "
                             f"got {type(q).__name__}")
        if q.local_rank != r:
            raise ValueError(f"{call.what}: fp8_weights[{r}] was quantized for local rank {q.local_rank}")
        if q.layer != _fp8_layer(ws):
            raise ValueError(f"{call.what}: fp8_weights[{r}] was quantized for another layer (H, I, I_s, experts per "
                             f"rank = {q.layer}; this workspace's are {_fp8_layer(ws)})")
        buffer = call.check(q.buffer, f"fp8_weights[{r}]", "u8", (ws.fp8_layout.bytes,), r, output=True)
        pointers.append(_ptr(buffer))
    return pointers


def _forward_common(ws, schedules, x, router_w, w_gate, w_up, w_down, s_gate, s_up, s_down, recompute, streams,
                    what, out_contexts=None, fp8_weights=None):
    scheds = _schedules(ws, schedules)
    out_contexts, _ = _per_rank(ws, out_contexts, "out", broadcast=True)
    xs, bare = _per_rank(ws, x, "x")
    rws, _ = _per_rank(ws, router_w, "router_w")
    w_gate, _ = _per_rank(ws, w_gate, "w_gate")
    w_up, _ = _per_rank(ws, w_up, "w_up")
    w_down, _ = _per_rank(ws, w_down, "w_down", broadcast=recompute)
    s_gate, _ = _per_rank(ws, s_gate, "s_gate", broadcast=True)
    s_up, _ = _per_rank(ws, s_up, "s_up", broadcast=True)
    s_down, _ = _per_rank(ws, s_down, "s_down", broadcast=True)
    call = _Call(ws, what)
    H, k = ws.hidden, ws.topk
    args = (_lib.ForwardArgs * ws.num_local_ranks)()
    kept, ys, contexts = [], [], []
    for r in range(ws.num_local_ranks):
        T = scheds[r].num_tokens
        xr = call.check(xs[r], f"x[{r}]", "bf16", (T, H), r)
        rw = call.check(rws[r], f"router_w[{r}]", "f32", (T, k), r)
        weights = _weights(call, ws, r, w_gate, w_up, w_down, s_gate, s_up, s_down, need_down=not recompute)
        y = None if recompute else call.empty((T, H), "bf16", r)
        ctx = call.empty((ws.sizes.context_bytes,), "u8", r) if out_contexts[r] is None else \
            call.check(out_contexts[r], f"out[{r}]", "u8", (ws.sizes.context_bytes,), r, output=True)
        kept.append((xr, rw, weights))
        ys.append(y)
        contexts.append(Context(ws, r, ctx, T, scheds[r]))
        a = args[r]
        a.num_tokens = T
        a.schedule = scheds[r].ptr
        a.x = _nonempty(xr)
        a.router_w = _cast(_nonempty(rw), c_float)
        a.w_gate, a.w_up, a.w_down, a.s_gate, a.s_up, a.s_down = (_ptr(w) for w in weights)
        a.y = _nonempty(y)
        a.context = _ptr(ctx)
        a.stream = call.stream(r, streams)
    for a, pointer in zip(args, _fp8_pointers(call, ws, fp8_weights)):
        a.fp8_weights = pointer
    _lib.call("mok_recompute_context" if recompute else "mok_forward", ws.handle, args)
    return _unbare(ys, bare), _unbare(contexts, bare)


def forward(ws, schedules, x, router_w, w_gate, w_up, w_down, s_gate=None, s_up=None, s_down=None, *,
            streams=None, fp8_weights=None):
    """y = the MoE layer of x. Collective. Per local rank: x [T, H] bf16, router_w [T, k] fp32,
    w_gate / w_up [E_local, I, H], w_down [E_local, H, I], the shared expert s_gate / s_up [I_s, H],
    s_down [H, I_s] (None without one; a bare shared array is used by every local rank);
    fp8_weights: an FP8 workspace's FP8Weights per local rank (quantize_weights), None for bf16.
    Returns (y, contexts): y [T, H] bf16 and the contexts the backward needs."""
    return _forward_common(ws, schedules, x, router_w, w_gate, w_up, w_down, s_gate, s_up, s_down, False, streams,
                           "forward", fp8_weights=fp8_weights)


def recompute_forward_context(ws, schedules, x, router_w, w_gate, w_up, s_gate=None, s_up=None, *, streams=None,
                              out=None, fp8_weights=None):
    """Rebuilds the contexts forward returned (activation checkpointing), bitwise equal to them.
    Collective. The down projections are not needed. out: caller buffers to write the contexts
    into (uint8 [sizes.context_bytes] per local rank, of the arrays' kind). fp8_weights: as
    forward's (the FP8 forward's gate and up GEMMs read them)."""
    _, contexts = _forward_common(ws, schedules, x, router_w, w_gate, w_up, None, s_gate, s_up, None, True, streams,
                                  "recompute_forward_context", out, fp8_weights)
    return contexts


_GRAD_KEYS = ("dw_gate", "dw_up", "dw_down", "ds_gate", "ds_up", "ds_down")


def backward(ws, schedules, contexts, dy, x, router_w, w_gate, w_up, w_down, s_gate=None, s_up=None, s_down=None,
             *, accumulate=False, grads=None, streams=None, fp8_weights=None):
    """Gradients of the layer call that left `contexts`. Collective. fp8_weights: as forward's (the
    same FP8Weights the forward took). Returns a dict: dx [T, H] bf16,
    d_router_w [T, k] fp32, and the weight gradients dw_gate, dw_up, dw_down, ds_gate, ds_up, ds_down
    in the weights' layouts (ds_* None without a shared expert); each value per local rank (bare for
    a bare x). accumulate=False: weight gradients are bf16, overwritten. accumulate=True: they are
    fp32 and added in place into the buffers given in `grads` (same keys, per local rank); missing
    ones start from zeros. `grads` may also hold dx / d_router_w output buffers."""
    scheds = _schedules(ws, schedules)
    ctxs = _contexts(ws, contexts, scheds)
    dys, _ = _per_rank(ws, dy, "dy")
    xs, bare = _per_rank(ws, x, "x")
    rws, _ = _per_rank(ws, router_w, "router_w")
    w_gate, _ = _per_rank(ws, w_gate, "w_gate")
    w_up, _ = _per_rank(ws, w_up, "w_up")
    w_down, _ = _per_rank(ws, w_down, "w_down")
    s_gate, _ = _per_rank(ws, s_gate, "s_gate", broadcast=True)
    s_up, _ = _per_rank(ws, s_up, "s_up", broadcast=True)
    s_down, _ = _per_rank(ws, s_down, "s_down", broadcast=True)
    grads = dict(grads or {})
    unknown = set(grads) - set(_GRAD_KEYS) - {"dx", "d_router_w"}
    if unknown:
        raise ValueError(f"backward: grads has unknown keys {sorted(unknown)}")
    given = {key: _per_rank(ws, grads.get(key), f"grads[{key!r}]", broadcast=True)[0] for key in
             ("dx", "d_router_w") + _GRAD_KEYS}
    if accumulate not in (True, False, 0, 1):
        raise ValueError(f"backward: accumulate must be True or False, got {accumulate!r}")
    call = _Call(ws, "backward")
    H, k, I, E, Is = ws.hidden, ws.topk, ws.intermediate, ws.num_local_experts, ws.shared_intermediate
    grad_dtype = "f32" if accumulate else "bf16"
    shapes = {"dw_gate": (E, I, H), "dw_up": (E, I, H), "dw_down": (E, H, I),
              "ds_gate": (Is, H), "ds_up": (Is, H), "ds_down": (H, Is)}
    args = (_lib.BackwardArgs * ws.num_local_ranks)()
    out = {key: [] for key in ("dx", "d_router_w") + _GRAD_KEYS}
    kept = []
    for r in range(ws.num_local_ranks):
        T = scheds[r].num_tokens
        dyr = call.check(dys[r], f"dy[{r}]", "bf16", (T, H), r)
        xr = call.check(xs[r], f"x[{r}]", "bf16", (T, H), r)
        rw = call.check(rws[r], f"router_w[{r}]", "f32", (T, k), r)
        weights = _weights(call, ws, r, w_gate, w_up, w_down, s_gate, s_up, s_down)
        res = {}
        for key, logical, shape in (("dx", "bf16", (T, H)), ("d_router_w", "f32", (T, k))):
            g = given[key][r]
            res[key] = (call.check(g, f"grads[{key!r}][{r}]", logical, shape, r, output=True) if g is not None
                        else call.empty(shape, logical, r))
        for key in _GRAD_KEYS:
            g = given[key][r]
            if key.startswith("ds") and Is == 0:
                if g is not None:
                    raise ValueError(f"backward: grads[{key!r}] given but the workspace has no shared expert")
                res[key] = None
            elif g is not None:
                res[key] = call.check(g, f"grads[{key!r}][{r}]", grad_dtype, shapes[key], r, output=True)
            else:
                res[key] = call.empty(shapes[key], grad_dtype, r, zero=bool(accumulate))
        for key, value in res.items():
            out[key].append(value)
        kept.append((dyr, xr, rw, weights))
        a = args[r]
        a.num_tokens = T
        a.schedule = scheds[r].ptr
        a.context = ctxs[r].ptr
        a.dy = _nonempty(dyr)
        a.x = _nonempty(xr)
        a.router_w = _cast(_nonempty(rw), c_float)
        a.w_gate, a.w_up, a.w_down, a.s_gate, a.s_up, a.s_down = (_ptr(w) for w in weights)
        a.dx = _nonempty(res["dx"])
        a.d_router_w = _cast(_nonempty(res["d_router_w"]), c_float)
        a.accumulate = int(bool(accumulate))
        a.dw_gate, a.dw_up, a.dw_down = _ptr(res["dw_gate"]), _ptr(res["dw_up"]), _ptr(res["dw_down"])
        a.ds_gate, a.ds_up, a.ds_down = _ptr(res["ds_gate"]), _ptr(res["ds_up"]), _ptr(res["ds_down"])
        a.stream = call.stream(r, streams)
    for a, pointer in zip(args, _fp8_pointers(call, ws, fp8_weights)):
        a.fp8_weights = pointer
    _lib.call("mok_backward", ws.handle, args)
    return {key: _unbare(values, bare) for key, values in out.items()}


# ---- the reference (host memory, every rank at once) ---------------------------------------------------

def _host(a, name, logical, shape=None):
    """A C-contiguous, aligned numpy array of the logical dtype from numpy or a torch tensor."""
    if a is None:
        return None
    if _is_torch(a):
        t = _torch()
        a = a.detach().cpu().contiguous()
        if a.dtype != _torch_dtype(logical):
            raise ValueError(f"reference: {name} has dtype {a.dtype}, expected {_NAMES[logical]}")
        a = a.view(t.int16).numpy().view(np.uint16) if logical == "bf16" else a.numpy()
    if not isinstance(a, np.ndarray):
        raise ValueError(f"reference: {name} must be a numpy array or a torch tensor, got {type(a).__name__}")
    if logical == "bf16" and a.dtype.itemsize == 2 and a.dtype.name == "bfloat16":
        a = a.view(np.uint16)
    if a.dtype != _NUMPY[logical]:
        raise ValueError(f"reference: {name} has dtype {a.dtype}, expected {_NAMES[logical]}")
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise ValueError(f"reference: {name} has shape {tuple(a.shape)}, expected {tuple(shape)}")
    if not a.flags.c_contiguous or a.ctypes.data % _lib.ALIGN:
        copy = _np_aligned(a.shape, a.dtype)
        copy[...] = a
        a = copy
    return a


def _ranks(value, name):
    if isinstance(value, (list, tuple)):
        return list(value), False
    return [value], True


class _RefLayer:
    """The mok_ref_layer of per-rank numpy arrays, with the arrays it points into kept alive."""

    def __init__(self, x, topk_ids, router_w, w_gate, w_up, w_down, s_gate, s_up, s_down, swiglu_limit, max_tokens,
                 precision):
        xs, self.bare = _ranks(x, "x")
        P = len(xs)
        ids, _ = _ranks(topk_ids, "topk_ids")
        rws, _ = _ranks(router_w, "router_w")
        wgs, _ = _ranks(w_gate, "w_gate")
        wus, _ = _ranks(w_up, "w_up")
        wds, _ = _ranks(w_down, "w_down")
        for name, v in (("topk_ids", ids), ("router_w", rws), ("w_gate", wgs), ("w_up", wus), ("w_down", wds)):
            if len(v) != P:
                raise ValueError(f"reference: {name} has {len(v)} ranks, x has {P}")
        if P < 1 or P > _lib.MAX_RANKS:
            raise ValueError(f"reference: {P} ranks is not in [1, {_lib.MAX_RANKS}]")
        wg0 = _host(wgs[0], "w_gate[0]", "bf16")
        if wg0.ndim != 3:
            raise ValueError(f"reference: w_gate[0] must be [E_local, I, H], got shape {wg0.shape}")
        E_local, I, H = wg0.shape
        ids0 = _host(ids[0], "topk_ids[0]", "i32")
        if ids0.ndim != 2:
            raise ValueError(f"reference: topk_ids[0] must be [T, k], got shape {ids0.shape}")
        k = ids0.shape[1]
        Is = 0 if s_gate is None else int(np.shape(s_gate)[0])
        self.P, self.H, self.k, self.Is = P, H, k, Is
        self.x, self.ids, self.rw, self.wg, self.wu, self.wd = [], [], [], [], [], []
        self.num_tokens = []
        for p in range(P):
            xp = _host(xs[p], f"x[{p}]", "bf16")
            if xp.ndim != 2 or xp.shape[1] != H:
                raise ValueError(f"reference: x[{p}] must be [T, {H}], got shape {xp.shape}")
            T = xp.shape[0]
            self.num_tokens.append(T)
            self.x.append(xp)
            self.ids.append(_host(ids[p], f"topk_ids[{p}]", "i32", (T, k)))
            self.rw.append(_host(rws[p], f"router_w[{p}]", "f32", (T, k)))
            self.wg.append(_host(wgs[p], f"w_gate[{p}]", "bf16", (E_local, I, H)))
            self.wu.append(_host(wus[p], f"w_up[{p}]", "bf16", (E_local, I, H)))
            self.wd.append(_host(wds[p], f"w_down[{p}]", "bf16", (E_local, H, I)))
        if Is:
            self.sg = _host(s_gate, "s_gate", "bf16", (Is, H))
            self.su = _host(s_up, "s_up", "bf16", (Is, H))
            self.sd = _host(s_down, "s_down", "bf16", (H, Is))
        else:
            if s_up is not None or s_down is not None:
                raise ValueError("reference: s_up / s_down given without s_gate")
            self.sg = self.su = self.sd = None
        T_max = max(max(self.num_tokens), 1) if max_tokens is None else int(max_tokens)
        self.shape = _lib.Shape(H, I, E_local * P, k, Is, T_max, int(_PRECISIONS[_precision(precision)]))
        self.E_local, self.I = E_local, I
        self.c_tokens = (c_int64 * P)(*self.num_tokens)
        self.c_x = (c_void_p * P)(*[_nonempty(a) for a in self.x])
        self.c_ids = (POINTER(c_int32) * P)(*[_cast(_nonempty(a), c_int32) for a in self.ids])
        self.c_rw = (POINTER(c_float) * P)(*[_cast(_nonempty(a), c_float) for a in self.rw])
        self.c_wg = (c_void_p * P)(*[_ptr(a) for a in self.wg])
        self.c_wu = (c_void_p * P)(*[_ptr(a) for a in self.wu])
        self.c_wd = (c_void_p * P)(*[_ptr(a) for a in self.wd])
        self.layer = _lib.RefLayer(ctypes.pointer(self.shape), P, float(swiglu_limit), self.c_tokens, self.c_x,
                                   self.c_ids, self.c_rw, self.c_wg, self.c_wu, self.c_wd, _ptr(self.sg),
                                   _ptr(self.su), _ptr(self.sd))


def reference_forward(x, topk_ids, router_w, w_gate, w_up, w_down, s_gate=None, s_up=None, s_down=None, *,
                      swiglu_limit=0.0, max_tokens=None, precision="bf16"):
    """The naive fp64 reference (mok_ref_forward) of every rank at once: per-rank lists of x,
    topk_ids, router_w and each rank's experts, one copy of the shared expert. Returns y per rank
    (np.uint16 bf16; bare for bare arguments). precision="fp8": the FP8 function, the reference
    quantizing the bf16 weights and activations itself at the FP8 points."""
    L = _RefLayer(x, topk_ids, router_w, w_gate, w_up, w_down, s_gate, s_up, s_down, swiglu_limit, max_tokens,
                  precision)
    ys = [_np_aligned((T, L.H), np.uint16) for T in L.num_tokens]
    c_y = (c_void_p * L.P)(*[_nonempty(a) for a in ys])
    _lib.call("mok_ref_forward", byref(L.layer), c_y)
    return _unbare(ys, L.bare)


def reference_backward(dy, x, topk_ids, router_w, w_gate, w_up, w_down, s_gate=None, s_up=None, s_down=None, *,
                       swiglu_limit=0.0, max_tokens=None, precision="bf16"):
    """The reference backward (mok_ref_backward). Returns a dict like backward's: dx (bf16), and
    d_router_w and every weight gradient as fp32 before the last rounding; the shared expert's
    gradients are per rank (each rank's own tokens). precision: as reference_forward's."""
    L = _RefLayer(x, topk_ids, router_w, w_gate, w_up, w_down, s_gate, s_up, s_down, swiglu_limit, max_tokens,
                  precision)
    dys, _ = _ranks(dy, "dy")
    if len(dys) != L.P:
        raise ValueError(f"reference: dy has {len(dys)} ranks, x has {L.P}")
    dys = [_host(d, f"dy[{p}]", "bf16", (T, L.H)) for p, (d, T) in enumerate(zip(dys, L.num_tokens))]
    E, I, H, Is = L.E_local, L.I, L.H, L.Is
    out = {
        "dx": [_np_aligned((T, H), np.uint16) for T in L.num_tokens],
        "d_router_w": [_np_aligned((T, L.k), np.float32) for T in L.num_tokens],
        "dw_gate": [_np_aligned((E, I, H), np.float32) for _ in range(L.P)],
        "dw_up": [_np_aligned((E, I, H), np.float32) for _ in range(L.P)],
        "dw_down": [_np_aligned((E, H, I), np.float32) for _ in range(L.P)],
    }
    for key, shape in (("ds_gate", (Is, H)), ("ds_up", (Is, H)), ("ds_down", (H, Is))):
        out[key] = [_np_aligned(shape, np.float32) for _ in range(L.P)] if Is else [None] * L.P

    def voids(arrays, empty_ok):
        return (c_void_p * L.P)(*[_nonempty(a) if empty_ok else _ptr(a) for a in arrays])

    def floats(arrays, empty_ok=False):
        if arrays[0] is None:
            return None
        return (POINTER(c_float) * L.P)(*[_cast(_nonempty(a) if empty_ok else _ptr(a), c_float) for a in arrays])

    _lib.call("mok_ref_backward", byref(L.layer), voids(dys, True), voids(out["dx"], True),
              floats(out["d_router_w"], True), floats(out["dw_gate"]), floats(out["dw_up"]), floats(out["dw_down"]),
              floats(out["ds_gate"]), floats(out["ds_up"]), floats(out["ds_down"]))
    return {key: _unbare(values, L.bare) for key, values in out.items()}
