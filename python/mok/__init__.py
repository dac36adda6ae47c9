"""mok — Python binding of libmok, a Mixture-of-Experts layer run as one persistent kernel per pass
across an expert-parallel group.

    import mok
    group = mok.Group.create_local(2, backend="cpu")
    ws = mok.Workspace(group, hidden=128, intermediate=128, num_experts=8, topk=2, max_tokens=256)
    schedules = mok.build_schedule(ws, [topk_ids_0, topk_ids_1])
    y, contexts = mok.forward(ws, schedules, [x0, x1], [w0, w1], w_gate, w_up, w_down)
    grads = mok.backward(ws, schedules, contexts, [dy0, dy1], [x0, x1], [w0, w1], w_gate, w_up, w_down)

mok.functional has the API (in the shape of MoK's), mok.bf16 the bf16 helpers for numpy, and
mok.torch the autograd layer (import it explicitly; it needs PyTorch). The library is found through
MOK_LIBRARY, a copy inside this package, the repository's build/, or the system's search path.
"""
from . import _lib, bf16
from ._lib import (ALIGN, CONTEXT_TAG_BYTES, DIM_TILE, MAX_RANKS, ROW_TILE, BackendError, DeviceFaultError,
                   InternalError, InvalidArgumentError, MokError, OutOfMemoryError, PeerTimeoutError, StateError,
                   Status, UnsupportedError)
from ._lib import path as library_path
from ._lib import version_info
from .functional import (Config, Context, Group, Schedule, ScheduleInfo, Sizes, Workspace, backend_available, backward,
                         build_schedule, device_count, forward, recompute_forward_context, reference_backward,
                         reference_forward)

__version__ = _lib.version  # "0.1.0": include/mok.h's, as `mok --version` says it


def version():
    """The loaded library's version, "MAJOR.MINOR.PATCH" (version_info has it as a tuple of ints)."""
    return _lib.version


__all__ = [
    "bf16", "Config", "Group", "Workspace", "Sizes", "Schedule", "ScheduleInfo", "Context", "build_schedule",
    "forward", "backward", "recompute_forward_context", "reference_forward", "reference_backward",
    "backend_available", "device_count", "version", "version_info", "library_path", "MokError",
    "InvalidArgumentError", "UnsupportedError", "OutOfMemoryError", "BackendError", "PeerTimeoutError",
    "DeviceFaultError", "StateError", "InternalError", "Status", "DIM_TILE", "ROW_TILE", "MAX_RANKS", "ALIGN",
    "CONTEXT_TAG_BYTES",
]
