"""PyTorch baselines for mok's benchmark: the MoE layer as people run it today.

One GPU: routing (softmax top-k of the router's logits), tokens sorted by expert,
``torch._grouped_mm`` for gate/up and for down, SwiGLU in between, and a weighted
``index_add_`` back into the tokens' rows, plus the shared expert. Several GPUs: the same with
an NCCL all-to-all (``all_to_all_single``) to the experts' owners and back.

Layouts follow mok's: gate/up ``[E_local, I, H]``, down ``[E_local, H, I]``, bf16.
"""
import math
import time

import torch
import torch.nn.functional as F


def make_layer(hidden, inter, num_local_experts, shared_inter, device, seed=0):
    # Drawn on the device itself: a layer of 128 DeepSeek-V3 experts is 5.6 G values.
    g = torch.Generator(device=device).manual_seed(seed)

    def w(*shape, fan_in):
        t = torch.empty(*shape, device=device, dtype=torch.bfloat16)
        for i in range(shape[0]):  # one expert at a time keeps the fp32 temporary small
            t[i] = ((torch.rand(*shape[1:], generator=g, device=device) * 2 - 1) * math.sqrt(3.0 / fan_in)).to(
                torch.bfloat16)
        return t

    layer = {
        "w_gate": w(num_local_experts, inter, hidden, fan_in=hidden),
        "w_up": w(num_local_experts, inter, hidden, fan_in=hidden),
        "w_down": w(num_local_experts, hidden, inter, fan_in=inter),
    }
    if shared_inter:
        layer["s_gate"] = w(shared_inter, hidden, fan_in=hidden)
        layer["s_up"] = w(shared_inter, hidden, fan_in=hidden)
        layer["s_down"] = w(hidden, shared_inter, fan_in=shared_inter)
    return layer


def route(num_tokens, num_experts, topk, skew, device, seed=0):
    """Softmax top-k of random logits; skew > 0 makes low expert ids hot."""
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    if skew:
        logits += skew * (1 - torch.arange(num_experts) / max(num_experts - 1, 1))
    probs = logits.softmax(-1)
    w, ids = probs.topk(topk, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    return ids.to(torch.int32).to(device), w.to(torch.float32).to(device)


def make_inputs(layer, experts, tokens, devices, skew, seed):
    """One rank's inputs per device: its experts' weights (the shared expert's the same on every
    rank), its routing, x and dy; random, never zeros."""
    per_rank = []
    ranks = len(devices)
    for r, dev in enumerate(devices):
        w = make_layer(layer["hidden"], layer["inter"], experts // ranks, layer["shared"], dev, seed=seed + r)
        if layer["shared"]:  # the same shared expert on every rank
            w0 = make_layer(layer["hidden"], layer["inter"], 1, layer["shared"], dev, seed=seed)
            for k in ("s_gate", "s_up", "s_down"):
                w[k] = w0[k]
        ids, rw = route(tokens, experts, layer["topk"], skew, dev, seed=seed + 100 + r)
        g = torch.Generator(device=dev).manual_seed(seed + 200 + r)
        x = (torch.rand(tokens, layer["hidden"], device=dev, generator=g) * 2 - 1).to(torch.bfloat16)
        dy = (torch.rand(tokens, layer["hidden"], device=dev, generator=g) * 2 - 1).to(torch.bfloat16)
        per_rank.append(dict(w=w, ids=ids, rw=rw, x=x, dy=dy))
    return per_rank


def swiglu(gate, up, limit=0.0):
    if limit > 0:
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return F.silu(gate) * up


def shared_expert(x, layer):
    if "s_gate" not in layer:
        return None
    g = x @ layer["s_gate"].t()
    u = x @ layer["s_up"].t()
    return swiglu(g, u) @ layer["s_down"].t()


def experts_grouped(rows, counts, layer):
    """rows sorted by local expert, counts per expert: the routed FFN of every row (bf16)."""
    offs = torch.cumsum(counts, 0).to(torch.int32)
    w_gu = torch.cat([layer["w_gate"], layer["w_up"]], dim=1)  # [E, 2I, H]
    gu = torch._grouped_mm(rows, w_gu.transpose(1, 2), offs=offs)
    inter = layer["w_gate"].shape[1]
    h = swiglu(gu[:, :inter], gu[:, inter:])
    return torch._grouped_mm(h, layer["w_down"].transpose(1, 2), offs=offs)


def forward_single(x, ids, weights, layer):
    """One GPU, every expert local."""
    T, k = ids.shape
    E = layer["w_gate"].shape[0]
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E)
    token_of = order // k
    out = experts_grouped(x[token_of], counts, layer)
    y = torch.zeros(T, x.shape[1], device=x.device, dtype=torch.float32)
    y.index_add_(0, token_of, out.float() * weights.reshape(-1)[order, None])
    s = shared_expert(x, layer)
    if s is not None:
        y += s.float()
    return y.to(torch.bfloat16)


def forward_all_to_all(x, ids, weights, layer, group=None):
    """Expert parallel over the process group: NCCL all-to-all to the owners and back."""
    import torch.distributed as dist
    from torch.distributed.nn.functional import all_to_all_single as a2a  # differentiable

    group = group or dist.group.WORLD
    P = dist.get_world_size(group)
    T, k = ids.shape
    E_local = layer["w_gate"].shape[0]
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)  # by owner, then local expert
    owner = flat[order] // E_local
    send_counts = torch.bincount(owner, minlength=P)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    # expert id of each row travels with it
    send_rows = x[order // k]
    send_expert = (flat[order] % E_local).to(torch.int32)
    sc, rc = send_counts.tolist(), recv_counts.tolist()  # the host sync every such baseline has
    recv_rows = a2a(torch.empty(sum(rc), x.shape[1], device=x.device, dtype=x.dtype), send_rows, rc, sc,
                    group=group)
    recv_expert = torch.empty(sum(rc), device=x.device, dtype=torch.int32)
    dist.all_to_all_single(recv_expert, send_expert, rc, sc, group=group)
    local_order = torch.argsort(recv_expert.long(), stable=True)
    counts = torch.bincount(recv_expert.long(), minlength=E_local)
    out_sorted = experts_grouped(recv_rows[local_order], counts, layer)
    out = torch.empty_like(out_sorted).index_copy(0, local_order, out_sorted)
    back = a2a(torch.empty(sum(sc), x.shape[1], device=x.device, dtype=x.dtype), out, sc, rc, group=group)
    y = torch.zeros(T, x.shape[1], device=x.device, dtype=torch.float32)
    y.index_add_(0, order // k, back.float() * weights.reshape(-1)[order, None])
    s = shared_expert(x, layer)
    if s is not None:
        y += s.float()
    return y.to(torch.bfloat16)


# The state of the GPU when a measurement starts. Under sustained work, as in training, the power
# cap holds the SM clock well below the 1980 MHz of the first ~0.2 s after idle (docs/design.md
# §6), so a short measurement taken from idle runs faster per FLOP than a long one, and two
# layers' ratio would depend on how long each is timed. So each measurement first runs its own
# work back to back for PREHEAT_S seconds (bench.py --preheat): every time is then taken at the
# sustained clock. With PREHEAT_S = 0 a measurement starts after SETTLE_S seconds of idle and a
# few warm-up calls instead (bench.py --preheat 0 --settle S: the times from idle).
PREHEAT_S = 1.5
SETTLE_S = 0.5

# bench.py --clocks reads each time's SM clock and power from nvidia-smi samples in a host-time
# window: from halfway through the measurement's preheat (its own work back to back, so the clock
# of the timed reps) to its last rep, so that a time shorter than the sampling interval still has
# samples; from idle, the timed reps alone. window_start() and window_end() set it.
LAST_WINDOW = [None]
_window_start = [0.0]


def window_start():
    """Marks the start of the timed reps (or of the preheat's second half, when ready() preheated)."""
    if PREHEAT_S <= 0 or _window_start[0] <= 0:
        _window_start[0] = time.time()


def window_end():
    """Closes the window of the measurement just taken (LAST_WINDOW[0]) and returns it."""
    LAST_WINDOW[0] = (_window_start[0] or time.time(), time.time())
    _window_start[0] = 0.0
    return LAST_WINDOW[0]


def ready(fn, sync, warmup):
    """Before a measurement: SETTLE_S seconds idle when not preheating; fn() `warmup` times; then,
    preheating, fn() back to back for PREHEAT_S seconds. sync() after each call (so the host never
    runs ahead of the GPU by more than one call). The preheat's seconds start after the warm-up
    calls: a first call's one-time host work (allocations, a library's kernel choice) can take
    longer than the preheat with the GPU idle, and would leave the timed reps at the idle clock."""
    sync()
    if PREHEAT_S <= 0:
        time.sleep(SETTLE_S)
    for _ in range(warmup):
        fn()
        sync()
    t0 = time.perf_counter()
    while PREHEAT_S > 0 and time.perf_counter() - t0 < PREHEAT_S:
        fn()
        sync()
    _window_start[0] = time.time() - (time.perf_counter() - t0) / 2 if PREHEAT_S > 0 else 0.0


def add_state_args(ap):
    """--preheat and --settle, the GPU's state before each measurement, for every timing script."""
    ap.add_argument("--preheat", type=float, default=PREHEAT_S,
                    help="seconds of the measured work run back to back before each timed measurement, so that "
                         "every time is taken at the clock the power cap holds under sustained work, as in "
                         "training (default %(default)s); 0: each measurement starts from idle (--settle)")
    ap.add_argument("--settle", type=float, default=SETTLE_S,
                    help="with --preheat 0: seconds of idle GPU before each timed measurement (default %(default)s)")


def time_cuda(fn, warmup=3, reps=20):
    """Median milliseconds of fn() with CUDA events, after ready(); its clock window in LAST_WINDOW."""
    ready(fn, torch.cuda.synchronize, warmup)
    window_start()
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    window_end()
    times.sort()
    return times[len(times) // 2]


def cublas_experts(layer, experts, tokens, device, reps=10, seed=7, windows=None):
    """The ceiling of the routed experts' GEMMs: cuBLAS's batched GEMM (torch.bmm, one launch per
    product) on every local expert's own shapes, each expert receiving the average
    tokens * topk / experts rows. Returns (forward ms, backward ms): forward x·W_gate|up^T and
    h·W_down^T; backward dy·W_down, d(g|u)·W_gate|up and the three weight gradients. No routing,
    SwiGLU or data movement: only the matrix products, so their rate is what mok's tiles are
    measured against. `windows`: a dict that gets each time's clock window (LAST_WINDOW)."""
    H, I, k = layer["hidden"], layer["inter"], layer["topk"]
    m = max(1, tokens * k // experts)
    g = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s: (torch.rand(*s, device=device, generator=g) * 2 - 1).to(torch.bfloat16)
    w_gu, w_d = r(experts, 2 * I, H), r(experts, H, I)
    x, h, dy, dgu = r(experts, m, H), r(experts, m, I), r(experts, m, H), r(experts, m, 2 * I)

    def forward():
        torch.bmm(x, w_gu.transpose(1, 2))
        torch.bmm(h, w_d.transpose(1, 2))

    def backward():
        torch.bmm(dy, w_d)
        torch.bmm(dgu, w_gu)
        torch.bmm(dgu.transpose(1, 2), x)
        torch.bmm(dy.transpose(1, 2), h)

    times = []
    for name, fn in (("cublas_forward_ms", forward), ("cublas_backward_ms", backward)):
        times.append(time_cuda(fn, reps=reps))
        if windows is not None:
            windows[name] = LAST_WINDOW[0]
    return tuple(times)


def flops_forward(tokens, topk, hidden, inter, shared_inter):
    return 6.0 * tokens * hidden * (topk * inter + shared_inter)
