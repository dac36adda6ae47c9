"""_lib.py — the ctypes binding over libmok.so: the structs of include/mok.h, one table of every
exported function, and the error path (a failed call raises MokError with the library's message).

The one idea: nothing above this file touches ctypes signatures. Each C function is declared once
in FUNCTIONS; `call(name, *args)` runs it and turns a non-OK mok_status into an exception that
carries mok_status_string and mok_last_error, read on the same thread right after the call (the
message is thread-local in the library).
"""
import ctypes
import ctypes.util
import enum
import os
from ctypes import (POINTER, Structure, c_char, c_char_p, c_double, c_float, c_int, c_int32, c_int64,
                    c_size_t, c_uint8, c_uint16, c_void_p)
from pathlib import Path

DIM_TILE = 64     # MOK_DIM_TILE: H, I and I_s are multiples of it
ROW_TILE = 128    # MOK_ROW_TILE: per-expert row padding, minibatch granularity
MAX_RANKS = 72    # MOK_MAX_RANKS
ALIGN = 16        # MOK_ALIGN: every pointer handed to the library
CONTEXT_TAG_BYTES = 256  # MOK_CONTEXT_TAG_BYTES: a forward context's tag, at its start
FP8_BLOCK = 128   # MOK_FP8_BLOCK: FP8 scales cover 1 x 128 activations and 128 x 128 weights; H, I, I_s its multiples


class Status(enum.IntEnum):
    """mok_status."""
    OK = 0
    ERR_INVALID_ARGUMENT = 1
    ERR_UNSUPPORTED = 2
    ERR_OUT_OF_MEMORY = 3
    ERR_BACKEND = 4
    ERR_TIMEOUT = 5
    ERR_DEVICE_FAULT = 6
    ERR_STATE = 7
    ERR_INTERNAL = 8


class Backend(enum.IntEnum):
    """mok_backend."""
    AUTO = 0
    CPU = 1
    CUDA = 2


class Precision(enum.IntEnum):
    BF16 = 0
    FP8 = 1


class Direction(enum.IntEnum):
    PULL = 0
    PUSH = 1


class FP8Matrix(enum.IntEnum):
    """mok_fp8_matrix: the matrices of one rank's FP8 weights, in the order of their layout."""
    W_GATE = 0
    W_UP = 1
    W_DOWN = 2
    W_GATE_T = 3
    W_UP_T = 4
    W_DOWN_T = 5
    S_GATE = 6
    S_UP = 7
    S_DOWN = 8
    S_GATE_T = 9
    S_UP_T = 10
    S_DOWN_T = 11


FP8_NUM_MATRICES = len(FP8Matrix)  # MOK_FP8_NUM_MATRICES


class CopyKind(enum.IntEnum):
    HOST_TO_RANK = 0
    RANK_TO_HOST = 1
    RANK_TO_RANK = 2


# ---- structs, field for field as in include/mok.h ------------------------------------------------

class Config(Structure):
    """mok_config."""
    _fields_ = [
        ("size", c_size_t),
        ("fwd_comm_sms", c_int),
        ("bwd_comm_sms", c_int),
        ("minibatch_rows", c_int),
        ("ring_rows", c_int),
        ("context_rows", c_int64),
        ("swiglu_limit", c_float),
        ("peer_timeout_ms", c_double),
        ("cpu_threads", c_int),
        ("cpu_comm_threads", c_int),
        ("fwd_dispatch", c_int),
        ("fwd_combine", c_int),
        ("bwd_combine", c_int),
        ("bwd_dispatch", c_int),
        ("trace", c_int),
    ]


class Shape(Structure):
    """mok_shape."""
    _fields_ = [
        ("hidden", c_int64),
        ("intermediate", c_int64),
        ("num_experts", c_int64),
        ("topk", c_int64),
        ("shared_intermediate", c_int64),
        ("max_tokens", c_int64),
        ("precision", c_int),
    ]


class UniqueId(Structure):
    """mok_unique_id (128 opaque bytes; read and write them with id_bytes / id_from_bytes, since a
    c_char array field stops at the first NUL)."""
    _fields_ = [("bytes", c_char * 128)]


class Sizes(Structure):
    """mok_sizes."""
    _fields_ = [
        ("schedule_bytes", c_size_t),
        ("context_bytes", c_size_t),
        ("symmetric_bytes", c_size_t),
        ("workspace_bytes", c_size_t),
        ("max_routed_rows", c_int64),
    ]


class ScheduleInfo(Structure):
    """mok_schedule_info."""
    _fields_ = [
        ("num_tokens", c_int64 * MAX_RANKS),
        ("routed_rows", c_int64),
        ("padded_rows", c_int64),
        ("num_minibatches", c_int64),
        ("num_macrobatches", c_int64),
        ("max_expert_rows", c_int64),
    ]


class ScheduleArgs(Structure):
    """mok_schedule_args."""
    _fields_ = [
        ("num_tokens", c_int64),
        ("topk_ids", POINTER(c_int32)),
        ("schedule", c_void_p),
        ("stream", c_void_p),
    ]


class ForwardArgs(Structure):
    """mok_forward_args."""
    _fields_ = [
        ("num_tokens", c_int64),
        ("schedule", c_void_p),
        ("x", c_void_p),
        ("router_w", POINTER(c_float)),
        ("w_gate", c_void_p),
        ("w_up", c_void_p),
        ("w_down", c_void_p),
        ("s_gate", c_void_p),
        ("s_up", c_void_p),
        ("s_down", c_void_p),
        ("y", c_void_p),
        ("context", c_void_p),
        ("stream", c_void_p),
        ("fp8_weights", c_void_p),
    ]


class BackwardArgs(Structure):
    """mok_backward_args."""
    _fields_ = [
        ("num_tokens", c_int64),
        ("schedule", c_void_p),
        ("context", c_void_p),
        ("dy", c_void_p),
        ("x", c_void_p),
        ("router_w", POINTER(c_float)),
        ("w_gate", c_void_p),
        ("w_up", c_void_p),
        ("w_down", c_void_p),
        ("s_gate", c_void_p),
        ("s_up", c_void_p),
        ("s_down", c_void_p),
        ("dx", c_void_p),
        ("d_router_w", POINTER(c_float)),
        ("accumulate", c_int),
        ("dw_gate", c_void_p),
        ("dw_up", c_void_p),
        ("dw_down", c_void_p),
        ("ds_gate", c_void_p),
        ("ds_up", c_void_p),
        ("ds_down", c_void_p),
        ("stream", c_void_p),
        ("fp8_weights", c_void_p),
    ]


class FP8Layout(Structure):
    """mok_fp8_layout: byte offsets of each matrix's E4M3 codes and fp32 block scales in one rank's
    FP8 weights buffer of `bytes` bytes."""
    _fields_ = [
        ("bytes", c_size_t),
        ("codes", c_size_t * FP8_NUM_MATRICES),
        ("scales", c_size_t * FP8_NUM_MATRICES),
    ]


class QuantizeArgs(Structure):
    """mok_quantize_args."""
    _fields_ = [
        ("w_gate", c_void_p),
        ("w_up", c_void_p),
        ("w_down", c_void_p),
        ("s_gate", c_void_p),
        ("s_up", c_void_p),
        ("s_down", c_void_p),
        ("fp8_weights", c_void_p),
        ("stream", c_void_p),
    ]


class RefLayer(Structure):
    """mok_ref_layer."""
    _fields_ = [
        ("shape", POINTER(Shape)),
        ("nranks", c_int),
        ("swiglu_limit", c_float),
        ("num_tokens", POINTER(c_int64)),
        ("x", POINTER(c_void_p)),
        ("topk_ids", POINTER(POINTER(c_int32))),
        ("router_w", POINTER(POINTER(c_float))),
        ("w_gate", POINTER(c_void_p)),
        ("w_up", POINTER(c_void_p)),
        ("w_down", POINTER(c_void_p)),
        ("s_gate", c_void_p),
        ("s_up", c_void_p),
        ("s_down", c_void_p),
    ]


_group_p = c_void_p      # mok_group * (opaque)
_workspace_p = c_void_p  # mok_workspace * (opaque)
_status = c_int          # mok_status
_floats_pp = POINTER(POINTER(c_float))

# Every exported function: name -> (restype, argtypes). `status` marks the ones that return a
# mok_status, which call() checks.
FUNCTIONS = {
    # version, errors
    "mok_version": (c_int, []),
    "mok_config_struct_size": (c_size_t, []),
    "mok_status_string": (c_char_p, [c_int]),
    "mok_last_error": (c_char_p, []),
    "mok_config_default": (Config, []),
    "mok_config_validate": (_status, [POINTER(Config)]),
    "mok_shape_validate": (_status, [POINTER(Shape), c_int]),
    # backends and groups
    "mok_backend_available": (c_int, [c_int]),
    "mok_backend_name": (c_char_p, [c_int]),
    "mok_unique_id_create": (_status, [c_int, POINTER(UniqueId)]),
    "mok_group_create": (_status, [POINTER(_group_p), c_int, c_int, c_int, POINTER(UniqueId), c_int,
                                   POINTER(Config)]),
    "mok_group_create_local": (_status, [POINTER(_group_p), c_int, c_int, POINTER(c_int), POINTER(Config)]),
    "mok_group_destroy": (_status, [_group_p]),
    "mok_group_info": (_status, [_group_p, POINTER(c_int), POINTER(c_int), POINTER(c_int), POINTER(c_int)]),
    # workspace
    "mok_workspace_create": (_status, [POINTER(_workspace_p), _group_p, POINTER(Shape), POINTER(Config)]),
    "mok_workspace_destroy": (_status, [_workspace_p]),
    "mok_workspace_sizes": (_status, [_workspace_p, POINTER(Sizes)]),
    # passes
    "mok_schedule_build": (_status, [_workspace_p, POINTER(ScheduleArgs)]),
    "mok_schedule_read": (_status, [_workspace_p, c_void_p, c_int, POINTER(ScheduleInfo)]),
    "mok_forward": (_status, [_workspace_p, POINTER(ForwardArgs)]),
    "mok_backward": (_status, [_workspace_p, POINTER(BackwardArgs)]),
    "mok_recompute_context": (_status, [_workspace_p, POINTER(ForwardArgs)]),
    # FP8
    "mok_workspace_fp8_layout": (_status, [_workspace_p, POINTER(FP8Layout)]),
    "mok_quantize_weights": (_status, [_workspace_p, POINTER(QuantizeArgs)]),
    "mok_e4m3_from_float": (c_uint8, [c_float]),
    "mok_e4m3_to_float": (c_float, [c_uint8]),
    # memory and synchronisation
    "mok_memory_alloc": (_status, [_group_p, c_int, c_size_t, POINTER(c_void_p)]),
    "mok_memory_free": (_status, [_group_p, c_int, c_void_p]),
    "mok_memory_copy": (_status, [_group_p, c_int, c_void_p, c_void_p, c_size_t, c_int]),
    "mok_synchronize": (_status, [_workspace_p]),
    "mok_trace_write": (_status, [_workspace_p, c_char_p]),
    # reference
    "mok_ref_forward": (_status, [POINTER(RefLayer), POINTER(c_void_p)]),
    "mok_ref_backward": (_status, [POINTER(RefLayer), POINTER(c_void_p), POINTER(c_void_p), _floats_pp,
                                   _floats_pp, _floats_pp, _floats_pp, _floats_pp, _floats_pp, _floats_pp]),
    # bf16 helpers
    "mok_bf16_from_float": (c_uint16, [c_float]),
    "mok_bf16_to_float": (c_float, [c_uint16]),
}

_RETURNS_STATUS = {name for name, (restype, _) in FUNCTIONS.items() if restype is _status}


# ---- errors ----------------------------------------------------------------------------------------

class MokError(RuntimeError):
    """A mok call failed. `status` is the Status, `message` the library's mok_last_error (which
    names the argument and the rule it broke), `status_string` its mok_status_string."""

    def __init__(self, status, message, function=None, status_string=None):
        self.status = Status(status) if status in Status._value2member_map_ else status
        self.message = message
        self.function = function
        self.status_string = status_string
        where = f"{function}: " if function else ""
        what = status_string or str(self.status)
        super().__init__(f"{where}{what}: {message}" if message else f"{where}{what}")


class InvalidArgumentError(MokError):
    pass


class UnsupportedError(MokError):
    pass


class OutOfMemoryError(MokError):
    pass


class BackendError(MokError):
    pass


class PeerTimeoutError(MokError):
    pass


class DeviceFaultError(MokError):
    pass


class StateError(MokError):
    pass


class InternalError(MokError):
    pass


_ERROR_CLASSES = {
    Status.ERR_INVALID_ARGUMENT: InvalidArgumentError,
    Status.ERR_UNSUPPORTED: UnsupportedError,
    Status.ERR_OUT_OF_MEMORY: OutOfMemoryError,
    Status.ERR_BACKEND: BackendError,
    Status.ERR_TIMEOUT: PeerTimeoutError,
    Status.ERR_DEVICE_FAULT: DeviceFaultError,
    Status.ERR_STATE: StateError,
    Status.ERR_INTERNAL: InternalError,
}


# ---- loading -----------------------------------------------------------------------------------------

def _candidates():
    """Where the library may be, in the order tried: MOK_LIBRARY, a copy shipped inside the package,
    the repository's build/ (python/mok/_lib.py -> ../../build), then the system's search path."""
    env = os.environ.get("MOK_LIBRARY")
    if env:
        return [("MOK_LIBRARY", env)]
    here = Path(__file__).resolve().parent
    found = [("package", str(here / "libmok.so")), ("repository build", str(here.parent.parent / "build" / "libmok.so"))]
    system = ctypes.util.find_library("mok")
    if system:
        found.append(("system", system))
    return found


def _needed(path):
    """The DT_NEEDED names of an ELF64 little-endian shared library ([] when it is not one)."""
    import struct
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return []
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return []
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = []
    for _, sh_type, _, _, offset, size, link, _, _, _ in sections:
        if sh_type != 6:  # SHT_DYNAMIC
            continue
        strtab = sections[link][4]
        for pos in range(offset, offset + size, 16):
            tag, value = struct.unpack_from("<qQ", data, pos)
            if tag == 0:
                break
            if tag == 1:  # DT_NEEDED
                end = data.index(b"\0", strtab + value)
                names.append(data[strtab + value:end].decode())
    return names


def _torch_first(path):
    """A CUDA build of libmok links libnccl.so.2, and so does PyTorch; a process holds one library
    of that name, the first one loaded. When torch is installed but not imported yet, import it
    first, so that it gets the NCCL it was built with (and mok shares it): loaded the other way round,
    torch would find an NCCL without the symbols it needs and fail to import."""
    import importlib.util
    import sys
    if "torch" in sys.modules or not any(n.startswith("libnccl") for n in _needed(path)):
        return
    try:
        if importlib.util.find_spec("torch") is not None:
            import torch  # noqa: F401
    except Exception:
        pass


def _load():
    tried = []
    for origin, path in _candidates():
        if os.path.exists(path):
            _torch_first(path)
        if origin == "MOK_LIBRARY" and not os.path.exists(path):
            raise ImportError(f"mok: MOK_LIBRARY={path!r} does not exist (build it with `make` in the repository)")
        if origin not in ("MOK_LIBRARY", "system") and not os.path.exists(path):
            tried.append(path)
            continue
        try:
            return ctypes.CDLL(path), path
        except OSError as err:
            raise ImportError(f"mok: cannot load {path} ({origin}): {err}") from err
    raise ImportError("mok: libmok.so not found; set MOK_LIBRARY to its path or run `make` in the repository "
                      f"(looked in: {', '.join(tried) or 'nowhere'}, and the system's library path)")


lib, path = _load()

for _name, (_restype, _argtypes) in FUNCTIONS.items():
    try:
        _fn = getattr(lib, _name)
    except AttributeError as _err:
        raise ImportError(f"mok: {path} does not export {_name}; it is not the library this binding expects") from _err
    _fn.restype = _restype
    _fn.argtypes = _argtypes

def _version_info(number):
    """(major, minor, patch) of a MOK_VERSION number (major * 10000 + minor * 100 + patch)."""
    return (number // 10000, number // 100 % 100, number % 100)


def _installed_version():
    """The version pip installed this package with (setup.py takes it from include/mok.h), or None
    when this copy of the package is not the installed one (a source checkout on PYTHONPATH)."""
    try:
        from importlib import metadata
        dist = metadata.distribution("mok")
        if Path(dist.locate_file("mok")).resolve() != Path(__file__).resolve().parent:
            return None
        return dist.version
    except Exception:  # no metadata, or a distribution without files
        return None


# The loaded library's version, the one home of which is include/mok.h; an installed package must
# have been built with the same one.
version_info = _version_info(lib.mok_version())
version = ".".join(str(part) for part in version_info)
_package_version = _installed_version()
if _package_version is not None and _package_version != version:
    raise ImportError(f"mok: {path} is version {version} but this package was installed as {_package_version}; "
                      "rebuild the library or reinstall the package (pip install ./python)")
_library_config_size = lib.mok_config_struct_size()
if _library_config_size != ctypes.sizeof(Config):
    raise ImportError(f"mok: {path} has a {_library_config_size}-byte mok_config but this binding's is "
                      f"{ctypes.sizeof(Config)} bytes; the header and the binding disagree")


def last_error():
    """This thread's message for its last failed call."""
    message = lib.mok_last_error()
    return message.decode("utf-8", "replace") if message else ""


def status_string(status):
    text = lib.mok_status_string(int(status))
    return text.decode("utf-8", "replace") if text else ""


def error(status, function=None):
    """The exception for a failed call; read mok_last_error right after the call, on its thread."""
    cls = _ERROR_CLASSES.get(status, MokError)
    return cls(status, last_error(), function, status_string(status))


def call(name, *args):
    """Runs one mok function; a call that returns a status other than MOK_OK raises MokError."""
    result = getattr(lib, name)(*args)
    if name in _RETURNS_STATUS and result != Status.OK:
        raise error(result, name)
    return result


def id_bytes(uid):
    """The 128 bytes of a UniqueId."""
    return ctypes.string_at(ctypes.addressof(uid), ctypes.sizeof(UniqueId))


def id_from_bytes(data):
    data = bytes(data)
    if len(data) != ctypes.sizeof(UniqueId):
        raise ValueError(f"unique_id: must be {ctypes.sizeof(UniqueId)} bytes, got {len(data)}")
    uid = UniqueId()
    ctypes.memmove(ctypes.addressof(uid), data, len(data))
    return uid
