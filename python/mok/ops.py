"""ops.py — mok's passes as torch.library custom ops in the namespace `mok::`, so that
torch.compile traces a model holding mok's layer without graph breaks (fake implementations give
the outputs' shapes, dtypes and devices without running anything) and CUDA graphs capture it.

    mok::build_schedule(workspace, topk_ids, schedule!)                    schedule written in place
    mok::forward(workspace, schedule, x, router_w, weights..., keep_context) -> (y, context)
    mok::recompute_forward_context(workspace, schedule, x, router_w, w_gate, w_up, s_gate, s_up, context!)
    mok::backward(workspace, schedule, context, dy, x, router_w, weights...) -> (dx, d_router_w, dw_*, ds_*)
    mok::backward_accumulate(..., dw_*!, ds_*!) -> (dx, d_router_w)       fp32 gradients added in place

The one idea: a custom op takes tensors and numbers, not Python objects, so a workspace travels as
an int, its id in this module's registry (register_workspace), and the schedule and the context,
which the functional API wraps in objects, travel as the uint8 tensors they are. mok::forward is
functional (it returns the context it fills) so that autograd can be registered on it: its
backward runs mok::backward on the saved schedule and context, or, with keep_context false,
rebuilds the context with mok::recompute_forward_context first (the context is then not kept
between the passes: activation checkpointing of mok's largest buffer).

The ops drive one local rank (a workspace of a group made with Group.create or create_local(1));
ds_* come back as empty tensors when the layer has no shared expert (an op returns no None).
"""
import itertools
import threading

import torch
from torch import Tensor

from . import functional

__all__ = ["register_workspace", "workspace_of", "workspace_id"]

_lock = threading.Lock()
_registry = {}            # id -> mok.Workspace
_next_id = itertools.count(1)


def register_workspace(ws):
    """The id under which the ops find `ws` (registered on first call; the same id after)."""
    if not isinstance(ws, functional.Workspace):
        raise TypeError(f"register_workspace: expected mok.Workspace, got {type(ws).__name__}")
    if ws.num_local_ranks != 1:
        raise ValueError(f"register_workspace: the ops drive one local rank; this workspace's group drives "
                         f"{ws.num_local_ranks} (make it with Group.create or Group.create_local(1))")
    with _lock:
        wid = getattr(ws, "_op_id", None)
        if wid is None:
            wid = next(_next_id)
            ws._op_id = wid
            _registry[wid] = ws
    return wid


def workspace_id(ws):
    """register_workspace's id of ws."""
    return register_workspace(ws)


def workspace_of(workspace):
    """The registered workspace of an id (ValueError naming the id when none or closed)."""
    ws = _registry.get(workspace)
    if ws is None:
        raise ValueError(f"mok ops: no workspace is registered as {workspace} (mok.ops.register_workspace)")
    if ws._handle is None:
        raise ValueError(f"mok ops: workspace {workspace} is closed")
    return ws


def _schedule(ws, buffer, num_tokens):
    return functional.Schedule(ws, 0, buffer, int(num_tokens))


def _context(ws, buffer, schedule):
    return functional.Context(ws, 0, buffer, schedule.num_tokens, schedule)


def _expect(cond, message):
    """A fake implementation's check: the real call would refuse the same input."""
    if not cond:
        raise ValueError(message)


def _fake_check(ws, what, x=None, schedule=None, context=None):
    if schedule is not None:
        _expect(tuple(schedule.shape) == (ws.sizes.schedule_bytes,) and schedule.dtype == torch.uint8,
                f"{what}: schedule must be uint8 [{ws.sizes.schedule_bytes}]")
    if context is not None:
        _expect(tuple(context.shape) == (ws.sizes.context_bytes,) and context.dtype == torch.uint8,
                f"{what}: context must be uint8 [{ws.sizes.context_bytes}]")
    if x is not None:
        _expect(x.dim() == 2 and x.shape[1] == ws.hidden and x.dtype == torch.bfloat16,
                f"{what}: x must be bf16 [T, {ws.hidden}]")


# ---- schedule ---------------------------------------------------------------------------------------

@torch.library.custom_op("mok::build_schedule", mutates_args=("schedule",),
                         schema="(int workspace, Tensor topk_ids, Tensor(a!) schedule) -> ()")
def build_schedule(workspace, topk_ids, schedule):
    """Builds the schedule of topk_ids [T, k] int32 into `schedule` (uint8 [schedule_bytes])."""
    functional.build_schedule(workspace_of(workspace), topk_ids, out=schedule)


@build_schedule.register_fake
def _(workspace, topk_ids, schedule):
    ws = workspace_of(workspace)
    _fake_check(ws, "mok::build_schedule", schedule=schedule)
    _expect(topk_ids.dim() == 2 and topk_ids.shape[1] == ws.topk and topk_ids.dtype == torch.int32,
            f"mok::build_schedule: topk_ids must be int32 [T, {ws.topk}]")


# ---- forward ----------------------------------------------------------------------------------------

_FORWARD_SCHEMA = ("(int workspace, Tensor schedule, Tensor x, Tensor router_w, Tensor w_gate, Tensor w_up, "
                   "Tensor w_down, Tensor? s_gate, Tensor? s_up, Tensor? s_down, bool keep_context) "
                   "-> (Tensor, Tensor)")


@torch.library.custom_op("mok::forward", mutates_args=(), schema=_FORWARD_SCHEMA)
def forward(workspace, schedule, x, router_w, w_gate, w_up, w_down, s_gate, s_up, s_down, keep_context):
    """(y [T, H] bf16, context uint8 [context_bytes]) of the layer call scheduled in `schedule`.
    keep_context only tells the backward whether the context was kept (see the module's note)."""
    ws = workspace_of(workspace)
    sched = _schedule(ws, schedule, x.shape[0])
    y, context = functional.forward(ws, sched, x, router_w, w_gate, w_up, w_down, s_gate, s_up, s_down)
    return y, context.buffer


@forward.register_fake
def _(workspace, schedule, x, router_w, w_gate, w_up, w_down, s_gate, s_up, s_down, keep_context):
    ws = workspace_of(workspace)
    _fake_check(ws, "mok::forward", x=x, schedule=schedule)
    return x.new_empty(x.shape), x.new_empty((ws.sizes.context_bytes,), dtype=torch.uint8)


@torch.library.custom_op(
    "mok::recompute_forward_context", mutates_args=("context",),
    schema="(int workspace, Tensor schedule, Tensor x, Tensor router_w, Tensor w_gate, Tensor w_up, Tensor? s_gate, "
           "Tensor? s_up, Tensor(a!) context) -> ()")
def recompute_forward_context(workspace, schedule, x, router_w, w_gate, w_up, s_gate, s_up, context):
    """Rewrites `context` bitwise as mok::forward left it (the down projections are not run)."""
    ws = workspace_of(workspace)
    sched = _schedule(ws, schedule, x.shape[0])
    functional.recompute_forward_context(ws, sched, x, router_w, w_gate, w_up, s_gate, s_up, out=context)


@recompute_forward_context.register_fake
def _(workspace, schedule, x, router_w, w_gate, w_up, s_gate, s_up, context):
    _fake_check(workspace_of(workspace), "mok::recompute_forward_context", x=x, schedule=schedule, context=context)


# ---- backward ---------------------------------------------------------------------------------------

_PASS_ARGS = ("int workspace, Tensor schedule, Tensor context, Tensor dy, Tensor x, Tensor router_w, Tensor w_gate, "
              "Tensor w_up, Tensor w_down, Tensor? s_gate, Tensor? s_up, Tensor? s_down")


def _backward_inputs(workspace, schedule, context, x):
    ws = workspace_of(workspace)
    sched = _schedule(ws, schedule, x.shape[0])
    return ws, sched, _context(ws, context, sched)


def _no_shared(like):
    return like.new_empty((0,), dtype=torch.bfloat16)


@torch.library.custom_op("mok::backward", mutates_args=(),
                         schema=f"({_PASS_ARGS}) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
def backward(workspace, schedule, context, dy, x, router_w, w_gate, w_up, w_down, s_gate, s_up, s_down):
    """(dx, d_router_w, dw_gate, dw_up, dw_down, ds_gate, ds_up, ds_down), weight gradients bf16."""
    ws, sched, ctx = _backward_inputs(workspace, schedule, context, x)
    g = functional.backward(ws, sched, ctx, dy, x, router_w, w_gate, w_up, w_down, s_gate, s_up, s_down)
    shared = [g[key] if g[key] is not None else _no_shared(x) for key in ("ds_gate", "ds_up", "ds_down")]
    return (g["dx"], g["d_router_w"], g["dw_gate"], g["dw_up"], g["dw_down"], *shared)


@backward.register_fake
def _(workspace, schedule, context, dy, x, router_w, w_gate, w_up, w_down, s_gate, s_up, s_down):
    ws = workspace_of(workspace)
    _fake_check(ws, "mok::backward", x=x, schedule=schedule, context=context)
    shared = [w.new_empty(w.shape) if w is not None else _no_shared(x) for w in (s_gate, s_up, s_down)]
    return (x.new_empty(x.shape), router_w.new_empty(router_w.shape), w_gate.new_empty(w_gate.shape),
            w_up.new_empty(w_up.shape), w_down.new_empty(w_down.shape), *shared)


@torch.library.custom_op(
    "mok::backward_accumulate", mutates_args=("dw_gate", "dw_up", "dw_down", "ds_gate", "ds_up", "ds_down"),
    schema=f"({_PASS_ARGS}, Tensor(a!) dw_gate, Tensor(b!) dw_up, Tensor(c!) dw_down, Tensor(d!)? ds_gate, "
           "Tensor(e!)? ds_up, Tensor(f!)? ds_down) -> (Tensor, Tensor)")
def backward_accumulate(workspace, schedule, context, dy, x, router_w, w_gate, w_up, w_down, s_gate, s_up, s_down,
                        dw_gate, dw_up, dw_down, ds_gate, ds_up, ds_down):
    """(dx, d_router_w); the weight gradients are added in place into the fp32 dw_* / ds_* (the
    "main grad" buffers of a training stack)."""
    ws, sched, ctx = _backward_inputs(workspace, schedule, context, x)
    grads = {"dw_gate": dw_gate, "dw_up": dw_up, "dw_down": dw_down}
    if s_gate is not None:
        grads.update(ds_gate=ds_gate, ds_up=ds_up, ds_down=ds_down)
    g = functional.backward(ws, sched, ctx, dy, x, router_w, w_gate, w_up, w_down, s_gate, s_up, s_down,
                            accumulate=True, grads=grads)
    return g["dx"], g["d_router_w"]


@backward_accumulate.register_fake
def _(workspace, schedule, context, dy, x, router_w, w_gate, w_up, w_down, s_gate, s_up, s_down,
      dw_gate, dw_up, dw_down, ds_gate, ds_up, ds_down):
    _fake_check(workspace_of(workspace), "mok::backward_accumulate", x=x, schedule=schedule, context=context)
    for name, g, w in (("dw_gate", dw_gate, w_gate), ("dw_up", dw_up, w_up), ("dw_down", dw_down, w_down),
                       ("ds_gate", ds_gate, s_gate), ("ds_up", ds_up, s_up), ("ds_down", ds_down, s_down)):
        _expect((g is None) == (w is None) and (g is None or (g.shape == w.shape and g.dtype == torch.float32)),
                f"mok::backward_accumulate: {name} must be fp32 in its weight's shape (None without the weight)")
    return x.new_empty(x.shape), router_w.new_empty(router_w.shape)


# ---- autograd of mok::forward -------------------------------------------------------------------------

def _setup_context(ctx, inputs, output):
    workspace, schedule, x, router_w, w_gate, w_up, w_down, s_gate, s_up, s_down, keep_context = inputs
    ctx.workspace = workspace
    context = output[1] if keep_context else None
    ctx.save_for_backward(schedule, x, router_w, w_gate, w_up, w_down, s_gate, s_up, s_down, context)


def _backward(ctx, dy, _d_context):
    schedule, x, router_w, w_gate, w_up, w_down, s_gate, s_up, s_down, context = ctx.saved_tensors
    if context is None:  # not kept: rebuild it (bitwise the forward's) just before it is read
        context = x.new_empty((workspace_of(ctx.workspace).sizes.context_bytes,), dtype=torch.uint8)
        torch.ops.mok.recompute_forward_context(ctx.workspace, schedule, x, router_w, w_gate, w_up, s_gate, s_up,
                                                context)
    dx, d_router_w, dw_gate, dw_up, dw_down, ds_gate, ds_up, ds_down = torch.ops.mok.backward(
        ctx.workspace, schedule, context, dy.to(torch.bfloat16).contiguous(), x, router_w, w_gate, w_up, w_down,
        s_gate, s_up, s_down)
    shared = (ds_gate, ds_up, ds_down) if s_gate is not None else (None, None, None)
    return (None, None, dx, d_router_w, dw_gate, dw_up, dw_down, *shared, None)


forward.register_autograd(_backward, setup_context=_setup_context)
