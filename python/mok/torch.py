"""torch.py — the PyTorch layer: mok.torch.MoE, an nn.Module whose routed and shared experts run
through mok, with a plain PyTorch router (fp32 softmax, top-k, renormalised) in front, and
mok.torch.MoEExperts, the same experts over parameters another module owns (what the Hugging Face
and Megatron integrations use). Both run through the mok:: custom ops of mok.ops (schedule,
forward with autograd registered on it, backward), so torch.compile(fullgraph=True) traces them.

FP8 (precision="fp8", include/mok.h's FP8 section): MoE quantizes its bf16 master weights into
FP8 weights (mok.functional.quantize_weights) at the first forward after they change, which it
tells by the parameters' version counters and storage (an optimizer step, load_state_dict or any
in-place write through the parameter moves them; MoE.fp8_weights says what it cannot see): once
per optimizer step, however many forwards run between steps.
The FP8 layer runs eagerly through its own autograd function (torch.compile leaves it out of the
graph: the mok:: ops take no FP8 weights).

The one idea: the router stays ordinary autograd. The forward op takes the router weights as an
input and its backward returns mok's d_router_w as their gradient, so the gradient reaches the
router (and x) through softmax and top-k without mok knowing about the router.

PyTorch is imported on first use of MoE / MoEFunction / moe_function, so `import mok.torch`
works without it. Expert parallelism: pass a torch.distributed process group as `group`; each rank
then holds num_experts / P experts (experts rank * E_local .. (rank + 1) * E_local - 1), and the
gradients of those experts already include every rank's tokens (do not all-reduce them across the
EP group); the router and the shared expert are replicated and their gradients are this rank's own
(all-reduce them as data-parallel parameters).
"""
import itertools
import threading
import weakref

import mok

__all__ = ["MoE", "MoEExperts", "MoEFunction", "FP8Function", "moe_function", "mok_group_from_process_group",
           "inside_checkpoint"]

_lock = threading.Lock()
_built = {}
_groups = {}      # (process group key, backend, device) -> mok.Group
_workspaces = {}  # (group key, shape..., config) -> mok.Workspace
_experts = {}     # MoEExperts key -> weakref to it, for the workspace look-up under torch.compile
_next_key = itertools.count(1)


def _torch():
    import torch
    return torch


def _backend_for(device, backend):
    want = "cuda" if device.type == "cuda" else "cpu"
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"mok.torch: tensors on {device} are not supported (cpu or cuda)")
    if backend not in ("auto", want):
        raise ValueError(f"mok.torch: backend={backend!r} but the tensors are on {device}; "
                         f"{'cuda tensors need the cuda backend' if want == 'cuda' else 'the cuda backend needs cuda tensors'}")
    return want


def mok_group_from_process_group(process_group, backend, device, config=None):
    """The mok group of a torch.distributed process group (collective over it): its rank 0 makes the
    unique id, broadcast_object_list sends it to the others, every rank joins with its own rank.
    Cached per (process group, backend, device)."""
    torch = _torch()
    dist = torch.distributed
    nranks = dist.get_world_size(process_group)
    rank = dist.get_rank(process_group)
    if backend == "cpu" and nranks > 1:
        raise ValueError("mok.torch: the cpu backend emulates ranks as threads of one process; a torch.distributed "
                         f"group of {nranks} processes needs the cuda backend")
    key = (id(process_group), backend, str(device))
    with _lock:
        if key in _groups:
            return _groups[key]
    uid = [mok.Group.unique_id(backend) if rank == 0 else None]
    bcast_device = device if device.type == "cuda" else None
    try:
        dist.broadcast_object_list(uid, group_src=0, group=process_group, device=bcast_device)
    except TypeError:  # PyTorch before group_src
        dist.broadcast_object_list(uid, src=dist.get_global_rank(process_group, 0), group=process_group,
                                   device=bcast_device)
    ordinal = 0
    if device.type == "cuda":
        ordinal = device.index if device.index is not None else torch.cuda.current_device()
    group = mok.Group.create(nranks, rank, uid[0], device=ordinal, backend=backend, config=config)
    with _lock:
        _groups[key] = group
    return group


def _local_group(backend, device, config):
    key = ("local", backend, str(device), config)
    with _lock:
        group = _groups.get(key)
    if group is None:
        devices = [device.index if device.index is not None else _torch().cuda.current_device()] \
            if backend == "cuda" else None
        group = mok.Group.create_local(1, backend=backend, devices=devices, config=config)
        with _lock:
            group = _groups.setdefault(key, group)
    return group


def _workspace(group, hidden, intermediate, num_experts, topk, shared_intermediate, max_tokens, config,
               precision="bf16"):
    """One workspace per (group, shape, config), shared by every layer of that shape: a workspace
    serves one pass at a time, and each call keeps its own schedule and context (so a model of
    many MoE layers of one shape holds one workspace)."""
    key = (id(group), hidden, intermediate, num_experts, topk, shared_intermediate, max_tokens, config, precision)
    with _lock:  # NOTE: not held across the (collective) creation, which waits for the peers
        ws = _workspaces.get(key)
    if ws is None or ws._handle is None:
        ws = mok.Workspace(group, hidden, intermediate, num_experts, topk, shared_intermediate,
                           max_tokens=max_tokens, config=config, precision=precision)
        with _lock:
            _workspaces[key] = ws
    return ws


def _group_rank(who, group, num_experts, topk):
    """(nranks, rank) of a layer over `group` (a mok.Group driving one local rank, a torch.distributed
    group, or None: one rank), after the checks that the experts split over it and top-k fits."""
    if isinstance(group, mok.Group):
        if group.num_local_ranks != 1:
            raise ValueError(f"{who}: a mok.Group must drive one local rank (Group.create)")
        nranks, rank = group.nranks, group.first_rank
    elif group is not None:
        dist = _torch().distributed
        nranks, rank = dist.get_world_size(group), dist.get_rank(group)
    else:
        nranks, rank = 1, 0
    if num_experts % nranks != 0:
        raise ValueError(f"{who}: num_experts={num_experts} is not divisible by the group size {nranks}")
    if not 1 <= topk <= num_experts:
        raise ValueError(f"{who}: topk={topk} is not in [1, num_experts={num_experts}]")
    return nranks, rank


def inside_checkpoint():
    """Whether the caller runs inside torch.utils.checkpoint (non-reentrant: HF's gradient
    checkpointing, Megatron's and most stacks'), in its forward or its recomputation: the
    checkpoint's saved-tensor hooks are the innermost ones then."""
    top = getattr(_torch()._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:  # a PyTorch without the query: treated as outside (the context is kept)
        return False
    hooks = top(False)
    return hooks is not None and _is_checkpoint_pack_hook(hooks[0])


def _is_checkpoint_pack_hook(fn):
    """torch.utils.checkpoint marks its pack hooks with _checkpoint_internal; releases before that mark
    define them as closures in the __init__ of its two hook classes (the forward's, the recomputation's)."""
    if getattr(fn, "_checkpoint_internal", False):
        return True
    return (getattr(fn, "__module__", None) == "torch.utils.checkpoint" and
            getattr(fn, "__qualname__", "").startswith(("_checkpoint_hook.__init__.", "_recomputation_hook.__init__.")))


def _keep_saved(t):
    return t


def _build():
    torch = _torch()
    nn = torch.nn
    F = torch.nn.functional
    from . import ops  # registers the mok:: custom ops

    @torch._dynamo.assume_constant_result
    def workspace_entry(key, device_type, device_index):
        """(op id, schedule bytes) of the workspace of MoEExperts `key` for tensors on that device,
        made on first use (collective then). torch.compile calls this once while it traces and
        keeps the result as a constant, so that the traced graph holds the custom ops alone."""
        experts = _experts[key]()
        device = torch.device(device_type, device_index) if device_index >= 0 else torch.device(device_type)
        ws = experts.mok_workspace(device)
        return ops.register_workspace(ws), ws.sizes.schedule_bytes

    class MoEExperts(nn.Module):
        """mok's experts of one MoE layer over parameters that someone else owns (a model's own
        experts, Megatron's, mok.torch.MoE's): forward(x [T, H], topk_ids [T, k], router_w [T, k],
        w_gate, w_up [E_local, I, H], w_down [E_local, H, I], s_gate, s_up [I_s, H], s_down [H, I_s])
        -> y [T, H] bf16, through the mok:: custom ops (autograd, torch.compile and CUDA graphs
        included). No parameters: the state dict of the model around it does not change.

        The workspace is chosen by (group, shape, config) and shared with every layer of the same.
        recompute_context: False keeps the forward's context for the backward; True keeps only x,
        router_w and the schedule and rebuilds the context with recompute_forward_context in the
        backward; "auto" (the default) does so inside torch.utils.checkpoint, where the layer's
        saved tensors are then held outside the checkpoint (its recomputation stops before the
        layer when nothing after it in the checkpointed block saves tensors) so that the layer's
        forward runs once and its backward rebuilds only the context. Under torch.compile "auto"
        keeps the context (compile's own rematerialisation decides)."""

        def __init__(self, hidden, intermediate, num_experts, topk, shared_intermediate=0, group=None, config=None,
                     backend="auto", max_tokens=4096, recompute_context="auto"):
            super().__init__()
            if backend not in ("auto", "cpu", "cuda"):
                raise ValueError(f"MoEExperts: backend={backend!r} is not 'auto', 'cpu' or 'cuda'")
            if recompute_context not in ("auto", True, False):
                raise ValueError(f"MoEExperts: recompute_context={recompute_context!r} is not 'auto', True or False")
            nranks, rank = _group_rank("MoEExperts", group, num_experts, topk)
            for name, value in (("hidden", hidden), ("intermediate", intermediate),
                                ("shared_intermediate", shared_intermediate)):
                if value % mok.DIM_TILE or (value <= 0 and name != "shared_intermediate") or value < 0:
                    raise ValueError(f"MoEExperts: {name}={value} must be a positive multiple of {mok.DIM_TILE}"
                                     + (" (or 0: no shared expert)" if name == "shared_intermediate" else ""))
            self.hidden, self.intermediate = int(hidden), int(intermediate)
            self.num_experts, self.topk = int(num_experts), int(topk)
            self.shared_intermediate, self.max_tokens = int(shared_intermediate), int(max_tokens)
            self.config, self.backend, self.group = config, backend, group
            self.nranks, self.rank = nranks, rank
            self.num_local_experts = num_experts // nranks
            self.first_expert = rank * self.num_local_experts
            self.recompute_context = recompute_context
            self._key = next(_next_key)
            _experts[self._key] = weakref.ref(self)
            weakref.finalize(self, _experts.pop, self._key, None)

        def mok_workspace(self, device, precision="bf16"):
            """The mok workspace for tensors on `device` (made on first use; collective then), of
            the given precision ("bf16" for the mok:: ops this module runs; MoE's FP8 layer asks
            for "fp8")."""
            backend = _backend_for(device, self.backend)
            if isinstance(self.group, mok.Group):
                group = self.group
                if group.backend != backend:
                    raise ValueError(f"MoEExperts: the mok group is {group.backend} but the tensors are on {device}")
            elif self.group is not None:
                group = mok_group_from_process_group(self.group, backend, device, self.config)
            else:
                group = _local_group(backend, device, self.config)
            return _workspace(group, self.hidden, self.intermediate, self.num_experts, self.topk,
                              self.shared_intermediate, self.max_tokens, self.config, precision)

        def forward(self, x, topk_ids, router_w, w_gate, w_up, w_down, s_gate=None, s_up=None, s_down=None):
            device = x.device
            workspace, schedule_bytes = workspace_entry(self._key, device.type,
                                                        -1 if device.index is None else device.index)
            x = x.to(torch.bfloat16).contiguous()
            topk_ids = topk_ids.to(torch.int32).contiguous()
            router_w = router_w.to(torch.float32).contiguous()
            schedule = torch.empty((schedule_bytes,), dtype=torch.uint8, device=device)
            torch.ops.mok.build_schedule(workspace, topk_ids, schedule)
            if torch.compiler.is_compiling():
                keep = self.recompute_context is not True
                y, _ = torch.ops.mok.forward(workspace, schedule, x, router_w, w_gate, w_up, w_down, s_gate, s_up,
                                             s_down, keep)
                return y
            checkpointed = self.recompute_context == "auto" and torch.is_grad_enabled() and inside_checkpoint()
            keep = not (self.recompute_context is True or checkpointed)
            if not checkpointed:
                y, _ = torch.ops.mok.forward(workspace, schedule, x, router_w, w_gate, w_up, w_down, s_gate, s_up,
                                             s_down, keep)
                return y
            # NOTE: the identity hooks keep this layer's saved tensors (x, router_w, the schedule) out
            # of the checkpoint's bookkeeping in its forward and its recomputation alike, so both
            # count the same saved tensors and the recomputation need not reach this layer.
            with torch.autograd.graph.saved_tensors_hooks(_keep_saved, _keep_saved):
                y, _ = torch.ops.mok.forward(workspace, schedule, x, router_w, w_gate, w_up, w_down, s_gate, s_up,
                                             s_down, keep)
            return y

        def extra_repr(self):
            return (f"hidden={self.hidden}, intermediate={self.intermediate}, num_experts={self.num_experts}, "
                    f"topk={self.topk}, shared_intermediate={self.shared_intermediate}, nranks={self.nranks}, "
                    f"rank={self.rank}, max_tokens={self.max_tokens}, recompute_context={self.recompute_context!r}")

    class MoEFunction(torch.autograd.Function):
        """y = mok(x, router_w, experts) for this rank's tokens; backward through mok's backward.
        Inputs: the workspace, topk_ids [T, k] int32, x [T, H] bf16, router_w [T, k] fp32, w_gate,
        w_up [E_local, I, H], w_down [E_local, H, I], s_gate, s_up [I_s, H], s_down [H, I_s] (or None).
        Gradients: x, router_w, and every weight (bf16, overwritten: accumulate = 0)."""

        @staticmethod
        def forward(ctx, ws, topk_ids, x, router_w, w_gate, w_up, w_down, s_gate, s_up, s_down):
            schedule = mok.build_schedule(ws, topk_ids)
            y, context = mok.forward(ws, schedule, x, router_w, w_gate, w_up, w_down, s_gate, s_up, s_down)
            ctx.ws, ctx.schedule, ctx.context = ws, schedule, context
            ctx.save_for_backward(x, router_w, w_gate, w_up, w_down, s_gate, s_up, s_down)
            return y

        @staticmethod
        def backward(ctx, dy):
            x, router_w, w_gate, w_up, w_down, s_gate, s_up, s_down = ctx.saved_tensors
            dy = dy.to(torch.bfloat16).contiguous()
            g = mok.backward(ctx.ws, ctx.schedule, ctx.context, dy, x, router_w, w_gate, w_up, w_down,
                             s_gate, s_up, s_down, accumulate=False)
            ctx.schedule = ctx.context = None  # one backward per forward: free the buffers now
            return (None, None, g["dx"], g["d_router_w"], g["dw_gate"], g["dw_up"], g["dw_down"],
                    g["ds_gate"], g["ds_up"], g["ds_down"])

    class FP8Function(torch.autograd.Function):
        """MoE's FP8 layer on one local rank: schedule + FP8 forward, and the FP8 backward, every pass
        taking `fp8` (the FP8Weights quantized from w_gate .. s_down, which the passes also take).
        keep: keep the forward's context for the backward; else keep the schedule only and rebuild
        the context (recompute_forward_context) in the backward. Gradients as MoEFunction's."""

        @staticmethod
        def forward(ctx, ws, fp8, keep, topk_ids, x, router_w, w_gate, w_up, w_down, s_gate, s_up, s_down):
            schedule = mok.build_schedule(ws, topk_ids)
            y, context = mok.forward(ws, schedule, x, router_w, w_gate, w_up, w_down, s_gate, s_up, s_down,
                                     fp8_weights=fp8)
            ctx.ws, ctx.fp8, ctx.context = ws, fp8, context if keep else None
            ctx.save_for_backward(schedule.buffer, x, router_w, w_gate, w_up, w_down, s_gate, s_up, s_down)
            return y

        @staticmethod
        def backward(ctx, dy):
            schedule_buffer, x, router_w, w_gate, w_up, w_down, s_gate, s_up, s_down = ctx.saved_tensors
            ws, fp8 = ctx.ws, ctx.fp8
            schedule = mok.Schedule(ws, 0, schedule_buffer, x.shape[0])
            context = ctx.context
            if context is None:  # not kept: rebuilt bitwise as the forward left it
                context = mok.recompute_forward_context(ws, schedule, x, router_w, w_gate, w_up, s_gate, s_up,
                                                        fp8_weights=fp8)
            g = mok.backward(ws, schedule, context, dy.to(torch.bfloat16).contiguous(), x, router_w, w_gate, w_up,
                             w_down, s_gate, s_up, s_down, accumulate=False, fp8_weights=fp8)
            ctx.context = ctx.fp8 = None  # one backward per forward: free them now
            return (None, None, None, None, g["dx"], g["d_router_w"], g["dw_gate"], g["dw_up"], g["dw_down"],
                    g["ds_gate"], g["ds_up"], g["ds_down"])

    def moe_function(ws, topk_ids, x, router_w, w_gate, w_up, w_down, s_gate=None, s_up=None, s_down=None):
        """The autograd form of mok's schedule + forward (one local rank)."""
        return MoEFunction.apply(ws, topk_ids, x, router_w, w_gate, w_up, w_down, s_gate, s_up, s_down)

    class MoE(nn.Module):
        """A Mixture-of-Experts layer (SwiGLU experts, optional shared expert) computed by mok.

        hidden, intermediate (of a routed expert), num_experts (global), topk, shared_intermediate
        (0 = no shared expert). group: None (one rank), a torch.distributed process group (one rank
        per process, expert parallel across it) or a mok.Group of one local rank. backend: "auto"
        (follow the tensors: cpu tensors -> cpu backend, cuda tensors -> cuda), "cpu" or "cuda".
        max_tokens: the most tokens one forward may take on this rank (the workspace is sized by it).
        recompute_context: as MoEExperts's ("auto": rebuild the context in the backward inside
        torch.utils.checkpoint, keep it otherwise). precision: "bf16" or "fp8" (block-scaled E4M3
        GEMM operands: hidden, intermediate and shared_intermediate multiples of 128; the FP8
        weights are quantized from the bf16 parameters at the first forward after they change,
        counted in fp8_quantizations; fp8_weights(device) returns them).

        Parameters: router.weight [E, H] (fp32 by default), w_gate, w_up [E_local, I, H], w_down
        [E_local, H, I], and with a shared expert s_gate, s_up [I_s, H], s_down [H, I_s] (bf16).
        forward(x [..., H]) -> y [..., H] in x's dtype (computed in bf16)."""

        def __init__(self, hidden, intermediate, num_experts, topk, shared_intermediate=0, group=None, config=None,
                     backend="auto", max_tokens=4096, device=None, router_dtype=torch.float32,
                     recompute_context="auto", precision="bf16"):
            super().__init__()
            if backend not in ("auto", "cpu", "cuda"):
                raise ValueError(f"MoE: backend={backend!r} is not 'auto', 'cpu' or 'cuda'")
            if precision not in ("bf16", "fp8"):
                raise ValueError(f"MoE: precision={precision!r} is not 'bf16' or 'fp8'")
            if precision == "fp8":
                for name, value in (("hidden", hidden), ("intermediate", intermediate),
                                    ("shared_intermediate", shared_intermediate)):
                    if value % mok._lib.FP8_BLOCK:
                        raise ValueError(f"MoE: {name}={value} is not a multiple of {mok._lib.FP8_BLOCK}, which "
                                         "precision='fp8' needs (its scales cover blocks of that many)")
            nranks, rank = _group_rank("MoE", group, num_experts, topk)
            self.hidden, self.intermediate = int(hidden), int(intermediate)
            self.num_experts, self.topk = int(num_experts), int(topk)
            self.shared_intermediate, self.max_tokens = int(shared_intermediate), int(max_tokens)
            self.config = config
            self.backend = backend
            self.precision = precision
            self.fp8_quantizations = 0  # how many times the FP8 weights were quantized (fp8 only)
            self._fp8_cache = None      # (workspace, [(parameter's storage, version)], FP8Weights)
            self.group = group
            self.nranks, self.rank = nranks, rank
            self.num_local_experts = num_experts // nranks
            self.first_expert = rank * self.num_local_experts
            self.kernel = MoEExperts(hidden, intermediate, num_experts, topk, shared_intermediate, group, config,
                                     backend, max_tokens, recompute_context)
            E, H, I, Is = self.num_local_experts, self.hidden, self.intermediate, self.shared_intermediate
            bf = dict(dtype=torch.bfloat16, device=device)
            self.router = nn.Linear(H, num_experts, bias=False, device=device, dtype=router_dtype)
            self.w_gate = nn.Parameter(torch.empty(E, I, H, **bf))
            self.w_up = nn.Parameter(torch.empty(E, I, H, **bf))
            self.w_down = nn.Parameter(torch.empty(E, H, I, **bf))
            if Is > 0:
                self.s_gate = nn.Parameter(torch.empty(Is, H, **bf))
                self.s_up = nn.Parameter(torch.empty(Is, H, **bf))
                self.s_down = nn.Parameter(torch.empty(H, Is, **bf))
            else:
                self.register_parameter("s_gate", None)
                self.register_parameter("s_up", None)
                self.register_parameter("s_down", None)
            self.reset_parameters()

        @torch.no_grad()
        def reset_parameters(self):
            """nn.Linear's default: uniform in +-1/sqrt(fan_in)."""
            self.router.reset_parameters()
            for w, fan_in in ((self.w_gate, self.hidden), (self.w_up, self.hidden), (self.w_down, self.intermediate),
                              (self.s_gate, self.hidden), (self.s_up, self.hidden),
                              (self.s_down, self.shared_intermediate)):
                if w is not None:
                    bound = fan_in ** -0.5
                    w.copy_(torch.empty(w.shape, dtype=torch.float32, device=w.device).uniform_(-bound, bound))

        def mok_workspace(self, device):
            """The mok workspace for tensors on `device` (made on first use; collective then)."""
            return self.kernel.mok_workspace(device, self.precision)

        def _expert_weights(self):
            return (self.w_gate, self.w_up, self.w_down, self.s_gate, self.s_up, self.s_down)

        def fp8_weights(self, device):
            """precision="fp8": the FP8 weights of the current bf16 parameters for tensors on
            `device` (mok.functional.FP8Weights), quantized again only when a parameter changed
            since they were made: its version counter moved (every in-place write through the
            parameter does that: an optimizer step, load_state_dict, copy_ under no_grad) or its
            storage was replaced (a new .data). A write that autograd does not see either (through
            p.data, which has a version counter of its own, or from outside PyTorch) is not seen
            here: call invalidate_fp8_weights() after one."""
            if self.precision != "fp8":
                raise ValueError("MoE.fp8_weights: the layer's precision is bf16")
            ws = self.mok_workspace(device)
            params = [p for p in self._expert_weights() if p is not None]
            cache = self._fp8_cache
            if cache is not None and cache[0] is ws and len(cache[1]) == len(params) and all(
                    p.data_ptr() == held.data_ptr() and p._version == version
                    for p, (held, version) in zip(params, cache[1])):
                return cache[2]
            with torch.no_grad():
                fp8 = mok.functional.quantize_weights(ws, *(p.detach() if p is not None else None
                                                            for p in self._expert_weights()))
            # NOTE: the detached tensors held here keep the storage they were quantized from, so
            # that a replaced .data can never reuse its address and pass for it. A new FP8Weights
            # each time, never the cached buffer overwritten: a graph whose backward has not run
            # yet keeps the weights its forward ran with.
            self._fp8_cache = (ws, [(p.detach(), p._version) for p in params], fp8)
            self.fp8_quantizations += 1
            return fp8

        def invalidate_fp8_weights(self):
            """Forgets the cached FP8 weights: the next forward quantizes the parameters again."""
            self._fp8_cache = None

        def _forward_fp8(self, flat, ids, router_w):
            fp8 = self.fp8_weights(flat.device)
            ws = self.mok_workspace(flat.device)
            mode = self.kernel.recompute_context
            checkpointed = mode == "auto" and torch.is_grad_enabled() and inside_checkpoint()
            keep = not (mode is True or checkpointed)
            args = (ws, fp8, keep, ids, flat.to(torch.bfloat16).contiguous(), router_w.to(torch.float32).contiguous(),
                    *self._expert_weights())
            if not checkpointed:
                return FP8Function.apply(*args)
            # As MoEExperts.forward: the saved tensors stay outside the checkpoint's bookkeeping.
            with torch.autograd.graph.saved_tensors_hooks(_keep_saved, _keep_saved):
                return FP8Function.apply(*args)

        def route(self, x):
            """The router on x [T, H]: (topk_ids [T, k] int32, router_w [T, k] fp32, probs [T, E] fp32).
            Softmax in fp32 over all experts, the top k, renormalised to sum to 1."""
            logits = F.linear(x.to(self.router.weight.dtype), self.router.weight)
            probs = torch.softmax(logits.float(), dim=-1)
            weights, ids = torch.topk(probs, self.topk, dim=-1)
            weights = weights / weights.sum(dim=-1, keepdim=True)
            return ids.to(torch.int32).contiguous(), weights.contiguous(), probs

        def forward(self, x):
            if x.shape[-1] != self.hidden:
                raise ValueError(f"MoE: x has {x.shape[-1]} features, the layer's hidden size is {self.hidden}")
            lead = x.shape[:-1]
            flat = x.reshape(-1, self.hidden)
            ids, router_w, _ = self.route(flat)
            if self.precision == "fp8":
                y = _eager(self._forward_fp8)(flat, ids, router_w)
            else:
                y = self.kernel(flat, ids, router_w, self.w_gate, self.w_up, self.w_down, self.s_gate, self.s_up,
                                self.s_down)
            return y.to(x.dtype).reshape(*lead, self.hidden)

        def extra_repr(self):
            return (f"hidden={self.hidden}, intermediate={self.intermediate}, num_experts={self.num_experts}, "
                    f"topk={self.topk}, shared_intermediate={self.shared_intermediate}, nranks={self.nranks}, "
                    f"rank={self.rank}, max_tokens={self.max_tokens}, precision={self.precision!r}")

    _eager = getattr(torch.compiler, "disable", None) or torch._dynamo.disable

    return {"MoE": MoE, "MoEExperts": MoEExperts, "MoEFunction": MoEFunction, "moe_function": moe_function,
            "FP8Function": FP8Function}


def __getattr__(name):
    if name in ("MoE", "MoEExperts", "MoEFunction", "moe_function", "FP8Function"):
        with _lock:
            if not _built:
                _built.update(_build())
        return _built[name]
    raise AttributeError(f"module 'mok.torch' has no attribute {name!r}")
