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
from . import bf16
from ._lib import (ALIGN, DIM_TILE, MAX_RANKS, ROW_TILE, VERSION, BackendError, DeviceFaultError, InternalError,
                   InvalidArgumentError, MokError, OutOfMemoryError, PeerTimeoutError, StateError, Status,
                   UnsupportedError)
from ._lib import path as library_path
from .functional import (Config, Context, Group, Schedule, ScheduleInfo, Sizes, Workspace, backend_available, backward,
                         build_schedule, forward, recompute_forward_context, reference_backward, reference_forward)

__version__ = f"{VERSION // 10000}.{VERSION // 100 % 100}.{VERSION % 100}"


def version():
    """MOK_VERSION of the loaded library (major * 10000 + minor * 100 + patch)."""
    from ._lib import lib
    return lib.mok_version()


__all__ = [
    "bf16", "Config", "Group", "Workspace", "Sizes", "Schedule", "ScheduleInfo", "Context", "build_schedule",
    "forward", "backward", "recompute_forward_context", "reference_forward", "reference_backward",
    "backend_available", "version", "library_path", "MokError", "InvalidArgumentError", "UnsupportedError",
    "OutOfMemoryError", "BackendError", "PeerTimeoutError", "DeviceFaultError", "StateError", "InternalError",
    "Status", "VERSION", "DIM_TILE", "ROW_TILE", "MAX_RANKS", "ALIGN",
]
