"""mok's forward and backward on GPUs beside the PyTorch baseline, measured in the same run.

    python3 bench/bench.py --ranks 1 --out build/bench        # one H200: both layers, sweeps
    python3 bench/bench.py --ranks 2 --out build/bench        # two H200s, one process drives both
    python3 bench/bench.py --ranks 1 --no-sweep --compare-env MOK_CUDA_RASTER=8   # an A/B in one run (repeatable)
    python3 bench/bench.py --ranks 2 --no-sweep --compare-config fwd_dispatch=push,fwd_combine=pull  # config A/B
    python3 bench/bench.py --ranks 1 --no-sweep --precision fp8   # each case in FP8 beside bf16

For one GPU the baseline (routing, torch._grouped_mm, weighted index_add_) runs in this process
on the same inputs, and mok's y is checked against it first. For several GPUs the NCCL
all-to-all baseline runs under torchrun (bench/torch_baseline.py, see bench/run.sh). Times are
CUDA-event medians, each measurement after --preheat seconds of its own work back to back (the
clock under sustained work, as in training: bench/baselines.py, ready()), each call started on
idle GPUs (time_ranks), and mok's forward also as a
training step runs it, queued behind the previous step's backward (forward_in_step_ms,
time_in_step: the time LigerCute's training forward is compared with); every configuration gets a
fresh workspace; inputs are random, never zeros.
Prints a table, writes JSON and a PNG of the sweeps.

--precision fp8 adds a row per case beside its bf16 row: the same inputs through an FP8 workspace
(include/mok.h, FP8), its weights quantized once before the timed passes (quantize_ms, apart from
them), and its times against the bf16 row's (fp8_vs_bf16). Where the backend refuses FP8 workspaces,
the row says "skipped: " and the library's reason.
"""
import argparse
import gc
import json
import os
import sys
import time

import torch

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, here)
sys.path.insert(0, os.path.join(here, "..", "python"))
import baselines as B  # noqa: E402
import clocks as C  # noqa: E402
import layers as LY  # noqa: E402
import memory as M  # noqa: E402
import peers as PEERS  # noqa: E402
import mok  # noqa: E402
from mok import functional as F  # noqa: E402

LAYERS = LY.LAYERS
# MOK_BENCH_SMOKE=1: the whole harness on the cpu backend with tiny layers (no GPU), to check it.
SMOKE = os.environ.get("MOK_BENCH_SMOKE") == "1"
if SMOKE:  # H, I and I_s multiples of 128, as FP8 needs
    LAYERS = {"deepseek-v3": dict(hidden=128, inter=128, topk=4, shared=128),
              "qwen3-30b-a3b": dict(hidden=128, inter=128, topk=4, shared=0)}


def device_of(r):
    return torch.device("cpu") if SMOKE else torch.device("cuda", r)


def make_inputs(layer, experts, tokens, ranks, skew, seed):
    return B.make_inputs(layer, experts, tokens, [device_of(r) for r in range(ranks)], skew, seed)


def sync_all(ranks):
    if not SMOKE:
        for r in range(ranks):
            torch.cuda.synchronize(r)


# --clocks: the nvidia-smi sampler (bench/clocks.py); a row keeps the clock window of each time it
# takes (bench/baselines.py, LAST_WINDOW) beside it (keep_window)
CLOCKS = None


def keep_window(row, key, window=None):
    """--clocks: the window of the measurement just taken (or `window`), for row[key]'s clocks once
    sampling ends."""
    if CLOCKS is not None:
        row.setdefault("clock_windows", {})[key] = window or B.LAST_WINDOW[0]


def timed_median(fn, ranks, reps, after=None):
    """Median over reps of the slowest rank's time of fn(), then after() (when given) launched before
    the wait: CUDA events around fn() on every rank's current stream (SMOKE: the host's clock)."""
    times = []
    B.window_start()
    for _ in range(reps):
        if SMOKE:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
            if after:
                after()
            continue
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(ranks)]
        for r in range(ranks):
            ev[r][0].record(torch.cuda.current_stream(r))
        fn()
        for r in range(ranks):
            ev[r][1].record(torch.cuda.current_stream(r))
        if after:
            after()
        for r in range(ranks):
            ev[r][1].synchronize()
        times.append(max(a.elapsed_time(b) for a, b in ev))
    B.window_end()
    times.sort()
    return times[len(times) // 2]


def time_ranks(fn, ranks, reps):
    """Median over reps of the slowest rank's CUDA-event time of fn(), after B.ready(); each call
    starts on idle GPUs (the wait for its end event comes before the next call)."""
    if not SMOKE:
        B.ready(fn, lambda: sync_all(ranks), 2)
    return timed_median(fn, ranks, reps)


def time_in_step(forward, backward, ranks, reps):
    """Median over reps of the slowest rank's CUDA-event time of forward() as a training step runs it:
    each forward queued behind the previous step's backward, which the host has launched and the
    GPU may still be running, so the forward's host work (Python, launches) overlaps GPU work and
    its events hold GPU time (bench/liger_peer.py times LigerCute's training forward so). time_ranks
    starts every call on idle GPUs instead, so there the host's time shows wherever it outlasts
    the GPU work queued before it."""
    if not SMOKE:
        B.ready(lambda: (forward(), backward()), lambda: sync_all(ranks), 1)
        forward()  # the last backward is left running: the first timed forward queues behind it
        backward()
    t = timed_median(forward, ranks, reps, after=backward)
    sync_all(ranks)
    return t


def baseline_step(i):
    """PyTorch's forward + backward under autograd on one rank's inputs: every gradient mok's
    backward gives (x, router weights, all expert and shared-expert weights)."""
    params = {k: v.detach().clone().requires_grad_(True) for k, v in i["w"].items() if v is not None}
    x = i["x"].detach().clone().requires_grad_(True)
    rw = i["rw"].detach().clone().requires_grad_(True)
    leaves = [x, rw] + list(params.values())

    def step():
        y = B.forward_single(x, i["ids"], rw, params)
        torch.autograd.grad(y, leaves, i["dy"])

    return step


class MokRun:
    """mok's passes on a case's inputs, in a workspace of its own. precision "fp8": an FP8 workspace
    (mok.UnsupportedError where the backend has none), its weights quantized here, once."""

    def __init__(self, group, layer, experts, tokens, inputs, config, precision="bf16"):
        self.inputs = inputs
        self.ws = F.Workspace(group, layer["hidden"], layer["inter"], experts, layer["topk"], layer["shared"],
                              max_tokens=tokens, config=config, precision=precision)
        self.ids = [i["ids"] for i in inputs]
        self.args = lambda k: [i[k] for i in inputs]
        self.wts = lambda k: [i["w"].get(k) for i in inputs]
        self.fp8 = None
        if precision == "fp8":
            self.fp8 = self.quantize()

    def quantize(self):
        return F.quantize_weights(self.ws, self.wts("w_gate"), self.wts("w_up"), self.wts("w_down"), *self._shared())

    def forward(self):
        self.schedules = F.build_schedule(self.ws, self.ids)
        self.y, self.contexts = F.forward(self.ws, self.schedules, self.args("x"), self.args("rw"), self.wts("w_gate"),
                                          self.wts("w_up"), self.wts("w_down"), *self._shared(), fp8_weights=self.fp8)
        return self.y

    def backward(self):
        return F.backward(self.ws, self.schedules, self.contexts, self.args("dy"), self.args("x"), self.args("rw"),
                          self.wts("w_gate"), self.wts("w_up"), self.wts("w_down"), *self._shared(),
                          fp8_weights=self.fp8)

    def _shared(self):
        if self.inputs[0]["w"].get("s_gate") is None:
            return (None, None, None)
        return (self.wts("s_gate"), self.wts("s_up"), self.wts("s_down"))

    def close(self):
        self.ws.close()


def unsupported_reason(err):
    """The library's message of a refused workspace without the field it names ("shape.precision: ")."""
    message = err.message or str(err)
    return message.split(": ", 1)[1] if message.startswith("shape.precision: ") else message


def run_case(group, ranks, name, experts, tokens, skew, config, reps, check, baseline=None, layer=None,
             precision="bf16", in_step=True):
    """One case: mok's forward and backward times and the device memory they held (and, with check
    on one rank, the error against PyTorch and PyTorch's times, or those of `baseline`, an earlier
    row of the same case). layer: the layer's dimensions when not LAYERS[name]'s (a routed-only
    variant). precision "fp8": an FP8 workspace (the row then says "skipped" and why where the
    backend refuses one), its quantization timed apart (quantize_ms). in_step: the forward also timed
    as in a training step (forward_in_step_ms, time_in_step; the sweeps leave it out)."""
    layer = layer or LAYERS[name]
    inputs = make_inputs(layer, experts, tokens, ranks, skew, seed=1234)
    row = dict(layer=name, experts=experts, tokens=tokens, ranks=ranks, skew=skew,
               comm_sms=config.fwd_comm_sms, minibatch=config.minibatch_rows, precision=precision)
    y_ref = None
    if check and ranks == 1:  # the baselines first, so that mok's memory below counts none of theirs
        i = inputs[0]
        y_ref = B.forward_single(i["x"], i["ids"], i["rw"], i["w"])
        if baseline:
            for key in ("baseline_forward_ms", "baseline_forward_backward_ms", "cublas_forward_ms",
                        "cublas_backward_ms"):
                if key in baseline:
                    row[key] = baseline[key]
        else:
            row["baseline_forward_ms"] = time_ranks(
                lambda: B.forward_single(i["x"], i["ids"], i["rw"], i["w"]), 1, reps)
            keep_window(row, "baseline_forward_ms")
            row["baseline_forward_backward_ms"] = time_ranks(baseline_step(i), 1, max(3, reps // 2))
            keep_window(row, "baseline_forward_backward_ms")
            if not SMOKE:
                windows = {}
                row["cublas_forward_ms"], row["cublas_backward_ms"] = B.cublas_experts(
                    layer, experts, tokens, device_of(0), windows=windows)
                for key, window in windows.items():
                    keep_window(row, key, window)
    before = None if SMOKE else M.snapshot()
    if not SMOKE:
        M.reset_peak()
    try:
        run = MokRun(group, layer, experts, tokens, inputs, config, precision)
    except mok.UnsupportedError as e:
        row["skipped"] = unsupported_reason(e)
        return row
    row["workspace_bytes"] = run.ws.sizes.workspace_bytes
    if run.fp8 is not None:
        row["fp8_weight_bytes"] = run.ws.fp8_layout.bytes
        row["quantize_ms"] = time_ranks(run.quantize, ranks, max(3, reps // 2))
    row["context_bytes"] = run.ws.sizes.context_bytes
    # rows that cross a link: (rank p, token, slot) whose expert lives on another rank
    E_local = experts // ranks
    remote = [int(((i["ids"].long() // E_local) != r).sum().item()) for r, i in enumerate(inputs)]
    row["remote_rows"] = remote
    try:
        y = run.forward()
        if y_ref is not None:
            y0 = y[0] if isinstance(y, list) else y
            row["max_rel_err_vs_torch"] = ((y0.float() - y_ref.float()).abs().max() / y_ref.float().abs().max()).item()
        row["forward_ms"] = time_ranks(run.forward, ranks, reps)
        keep_window(row, "forward_ms")
        try:
            row["backward_ms"] = time_ranks(run.backward, ranks, max(3, reps // 2))
            keep_window(row, "backward_ms")
            if in_step:
                row["forward_in_step_ms"] = time_in_step(run.forward, run.backward, ranks, reps)
                keep_window(row, "forward_in_step_ms")
        except mok.MokError as e:
            row["backward_ms"] = None
            row["backward_error"] = str(e)
        if before is not None:
            row["memory_bytes"] = M.held_since(before)
    finally:
        run.close()
    flops = B.flops_forward(tokens, layer["topk"], layer["hidden"], layer["inter"], layer["shared"])
    row["forward_tflops"] = flops / row["forward_ms"] / 1e9
    if row.get("backward_ms"):
        row["backward_tflops"] = 2 * flops / row["backward_ms"] / 1e9
    if row.get("cublas_forward_ms"):  # the rate of the routed experts' products alone, per expert through cuBLAS
        routed = B.flops_forward(tokens, layer["topk"], layer["hidden"], layer["inter"], 0)
        row["cublas_forward_tflops"] = routed / row["cublas_forward_ms"] / 1e9
        row["cublas_backward_tflops"] = 2 * routed / row["cublas_backward_ms"] / 1e9
        row["forward_vs_cublas"] = row["forward_tflops"] / row["cublas_forward_tflops"]
        if row.get("backward_tflops"):
            row["backward_vs_cublas"] = row["backward_tflops"] / row["cublas_backward_tflops"]
    if ranks > 1:
        # dispatch and combine each move a remote row once; per rank, both directions of its links
        moved = max(remote) * layer["hidden"] * 2 * 2
        row["forward_link_GBps"] = moved / (row["forward_ms"] * 1e-3) / 1e9
    if row.get("baseline_forward_ms"):
        row["speedup"] = row["baseline_forward_ms"] / row["forward_ms"]
    if row.get("baseline_forward_backward_ms") and row.get("backward_ms"):
        row["speedup_forward_backward"] = row["baseline_forward_backward_ms"] / (row["forward_ms"] + row["backward_ms"])
    return row


def fp8_row(group, ranks, name, experts, tokens, skew, config, reps, bf16_row, label=""):
    """The FP8 row of a case beside its bf16 row of the same settings (whose baseline times it
    shares), with the ratios of their times; printed as it comes, or its reason when the backend
    has no FP8 path. `label`: the variant's (--compare-env / --compare-config), "" for the defaults."""
    t0 = time.time()
    row = run_case(group, ranks, name, experts, tokens, skew, config, reps, check=True, baseline=bf16_row,
                   precision="fp8")
    row["wall_s"] = time.time() - t0
    row["env"] = f"fp8 {label}".strip()
    if "skipped" in row:
        print(f"{name} E {experts} T {tokens} EP{ranks} fp8: skipped: {row['skipped']}", flush=True)
    else:
        row["fp8_vs_bf16_forward"] = bf16_row["forward_ms"] / row["forward_ms"]
        if row.get("backward_ms") and bf16_row.get("backward_ms"):
            row["fp8_vs_bf16_forward_backward"] = ((bf16_row["forward_ms"] + bf16_row["backward_ms"]) /
                                                   (row["forward_ms"] + row["backward_ms"]))
        print(json.dumps(row), flush=True)
    return row


def peer_rows(group, ranks, name, experts, tokens, skew, config, reps, row, peer_site):
    """The peers of a case: LigerCute (routed experts only) in a process of its own per GPU, beside
    mok's routed-only layer on the same inputs (the case's own row when it has no shared expert).
    Returns the rows to print; the ratios go into `row`."""
    # the peer shares the GPUs with this process: what PyTorch's allocator keeps cached from the
    # baselines (tens of GB on the widest layers) may leave it too little memory (the likely, not
    # confirmed, cause of LigerCute's failure on DeepSeek-V4-Pro: docs/log.md)
    gc.collect()
    torch.cuda.empty_cache()
    peer = PEERS.run_liger(peer_site, name, experts, tokens, skew, reps, ranks, B.PREHEAT_S, B.SETTLE_S)
    if "skipped" in peer:
        print(f"peer ligercute {name} EP{ranks} T {tokens}: skipped ({peer['skipped']})", flush=True)
        return []
    layer = LAYERS[name]
    if layer["shared"]:
        mine = run_case(group, ranks, name, experts, tokens, skew, config, reps, check=False,
                        layer=dict(layer, shared=0))
    else:
        mine = row
    # Each ratio compares times taken the same way: the training-step forwards queued behind the
    # previous step's backward (time_in_step, as liger_peer.py times LigerCute's), and each forward
    # alone, its calls not queued behind other work (time_ranks; LigerCute's under no_grad, timed
    # so too), after a preheat on itself. In step a forward runs at the clock its own backward
    # leaves (--clocks shows it): a backward that draws less power leaves a higher clock.
    peer["mok_forward_ms"] = mine["forward_ms"]
    peer["mok_forward_in_step_ms"] = mine.get("forward_in_step_ms", float("nan"))
    peer["mok_forward_backward_ms"] = mine["forward_ms"] + (mine.get("backward_ms") or float("nan"))
    peer["mok_memory_bytes"] = mine.get("memory_bytes")
    peer["mok_forward_vs_peer"] = peer["mok_forward_in_step_ms"] / peer["forward_ms"]
    peer["mok_forward_alone_vs_peer_nograd"] = mine["forward_ms"] / peer["forward_nograd_ms"]
    peer["mok_forward_backward_vs_peer"] = peer["mok_forward_backward_ms"] / peer["forward_backward_ms"]
    for key, window in (peer.pop("clock_windows", None) or {}).items():
        keep_window(row, "ligercute_" + key, tuple(window))
    if mine is not row and "forward_in_step_ms" in mine.get("clock_windows", {}):
        keep_window(row, "routed_forward_in_step_ms", mine["clock_windows"]["forward_in_step_ms"])
    row["ligercute"] = peer
    return [peer]


def kind_flops(layer, experts, tokens, ranks):
    """FLOPs of each GEMM kind over a whole pass on one rank (routed rows: tokens * topk per rank on
    average), to turn a trace's busy time per kind into TFLOP/s per SM."""
    H, I, Is, k = layer["hidden"], layer["inter"], layer["shared"], layer["topk"]
    rows = tokens * k
    return {"gateup": 2 * rows * H * 2 * I, "down": 2 * rows * I * H, "shared_up": 2 * tokens * H * 2 * Is,
            "shared_down": 2 * tokens * Is * H, "dh": 2 * rows * H * I, "dx": 2 * rows * 2 * I * H,
            "wgrad": 2 * rows * 3 * I * H, "shared_dh": 2 * tokens * H * Is, "shared_dx": 2 * tokens * 2 * Is * H,
            "shared_wgrad": 2 * tokens * 3 * Is * H}


def host_and_queued(fn, ranks, reps):
    """(median host time of one fn() call started on idle GPUs, GPU time per call with reps calls
    queued back to back). time_ranks times each call from idle GPUs, so a call whose host work
    (Python, the binding, launches) outlasts the GPU work queued before it shows that host time
    as GPU idle; queued back to back, the host runs ahead and only GPU time is left."""
    fn()
    host = []
    for _ in range(reps):
        sync_all(ranks)
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
    sync_all(ranks)
    host.sort()
    if SMOKE:
        return host[len(host) // 2], float("nan")
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(ranks)]
    for r in range(ranks):
        ev[r][0].record(torch.cuda.current_stream(r))
    for _ in range(reps):
        fn()
    for r in range(ranks):
        ev[r][1].record(torch.cuda.current_stream(r))
    sync_all(ranks)
    return host[len(host) // 2], max(a.elapsed_time(b) for a, b in ev) / reps


def host_case(group, ranks, name, experts, tokens, skew, config, reps):
    """A line per case: mok's and (one rank) PyTorch's host time per call and GPU time per call
    queued back to back, beside the per-call times of the table."""
    layer = LAYERS[name]
    inputs = make_inputs(layer, experts, tokens, ranks, skew, seed=1234)
    run = MokRun(group, layer, experts, tokens, inputs, config)
    out = dict(layer=name, experts=experts, tokens=tokens, ranks=ranks, skew=skew)
    try:
        run.forward()
        out["forward_host_ms"], out["forward_queued_ms"] = host_and_queued(run.forward, ranks, reps)
        out["backward_host_ms"], out["backward_queued_ms"] = host_and_queued(run.backward, ranks, reps)
        if ranks == 1:
            i = inputs[0]
            out["baseline_forward_host_ms"], out["baseline_forward_queued_ms"] = host_and_queued(
                lambda: B.forward_single(i["x"], i["ids"], i["rw"], i["w"]), 1, reps)
            out["baseline_forward_backward_host_ms"], out["baseline_forward_backward_queued_ms"] = host_and_queued(
                baseline_step(i), 1, reps)
    finally:
        run.close()
    parts = [f"{label} host {out[k + '_host_ms']:.3f} queued {out[k + '_queued_ms']:.3f}"
             for label, k in (("fwd", "forward"), ("bwd", "backward"), ("torch fwd", "baseline_forward"),
                              ("torch f+b", "baseline_forward_backward")) if k + "_host_ms" in out]
    print(f"host {name} EP{ranks} skew {skew} (ms per call): " + "; ".join(parts), flush=True)
    return out


def profile_case(group, ranks, name, experts, tokens, skew, config):
    """Every kernel's GPU time (and the host's) over 3 forwards and 3 backwards, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    layer = LAYERS[name]
    inputs = make_inputs(layer, experts, tokens, ranks, skew, seed=1234)
    run = MokRun(group, layer, experts, tokens, inputs, config)
    activities = [ProfilerActivity.CPU] + ([] if SMOKE else [ProfilerActivity.CUDA])
    try:
        run.forward()
        run.backward()
        sync_all(ranks)
        with profile(activities=activities) as prof:
            for _ in range(3):
                run.forward()
            sync_all(ranks)
            for _ in range(3):
                run.backward()
            sync_all(ranks)
        key = "self_cpu_time_total" if SMOKE else "self_cuda_time_total"
        print(f"profile {name} EP{ranks} {tokens} tokens/GPU skew {skew}: 3 forwards + 3 backwards", flush=True)
        print(prof.key_averages().table(sort_by=key, row_limit=25), flush=True)
    finally:
        run.close()


def trace_case(group, ranks, name, experts, tokens, skew, config, out, precision="bf16"):
    """One traced forward and backward: Chrome JSON, a Gantt PNG and a per-kind summary each (a pass
    the backend refuses is skipped with its reason)."""
    import timeline

    layer = LAYERS[name]
    inputs = make_inputs(layer, experts, tokens, ranks, skew, seed=1234)
    try:
        run = MokRun(group, layer, experts, tokens, inputs, config, precision)
    except mok.UnsupportedError as e:
        print(f"trace {name} {precision}: skipped: {unsupported_reason(e)}", flush=True)
        return
    flops = kind_flops(layer, experts, tokens, ranks)
    tag = "" if precision == "bf16" else f"_{precision}"
    try:
        for phase, fn in (("fwd", run.forward), ("bwd", run.backward)):
            try:
                fn()
            except mok.UnsupportedError as e:
                print(f"trace {name} {precision} {phase}: skipped: {unsupported_reason(e)}", flush=True)
                break
            sync_all(ranks)
            path = os.path.join(out, f"trace_{name}{tag}_ep{ranks}_skew{skew}_{phase}.json")
            run.ws.trace_write(path)
            pass_name = "forward" if phase == "fwd" else "backward"  # the file holds both after the backward
            ev = timeline.load(path, pass_name=pass_name)
            timeline.draw(ev, path[:-5] + ".png", title=f"{name}, EP{ranks}, {tokens} tokens/GPU: {phase}")
            residents = timeline.load(path, resident=True, pass_name=pass_name)
            for line in timeline.report(ev, residents, f"trace {name} EP{ranks} skew {skew} {phase}", flops):
                print(line, flush=True)
    finally:
        run.close()


def print_clocks(rows, sampler):
    """--clocks: per case the median SM clock (MHz), power (W) and power-capped share of each time's
    repetitions, or why nothing was sampled."""
    if sampler.reason:
        print(f"\nclocks: not sampled: {sampler.reason}")
        return
    print("\nclocks during each time (median SM MHz / W / share of samples held by the power cap)")
    names = (("mok", "mok's passes"), ("forward_ms", "fwd"), ("backward_ms", "bwd"),
             ("forward_in_step_ms", "fwd in step"), ("baseline_forward_ms", "torch fwd"),
             ("baseline_forward_backward_ms", "torch f+b"), ("cublas_forward_ms", "cuBLAS fwd"),
             ("cublas_backward_ms", "cuBLAS bwd"), ("routed_forward_in_step_ms", "routed fwd in step"),
             ("ligercute_forward_ms", "LC fwd in step"), ("ligercute_forward_nograd_ms", "LC no_grad"),
             ("ligercute_forward_backward_ms", "LC f+b"))
    for r in rows:
        c = r.get("clocks") or {}
        parts = [f"{label} {c[k]['mhz']:.0f} / {c[k]['watts']:.0f} / {c[k]['capped']:.0%}" if c.get(k) else
                 f"{label} no samples" for k, label in names if k in c]
        env = f" ({r['env']})" if r.get("env") else ""
        print(f"clocks {r['layer']:<14} E {r['experts']:>4} T {r['tokens']:>6} {r['precision']}{env}: " + "; ".join(parts))


def print_peers(peered):
    """The table of the cases run beside LigerCute (rows with a "ligercute" entry, peer_rows)."""
    print("\nrouted experts only, beside LigerCute (ms per GPU, the slowest; ratio = mok / LigerCute; memory GiB "
          "held beyond the inputs, per GPU). In step: each forward queued behind the previous step's backward, "
          "both; alone: each forward by itself after its preheat, LigerCute's under no_grad")
    print(f"{'layer':<14} {'E':>4} {'T/GPU':>6} | {'in step: mok':>12} {'LC':>7} {'ratio':>6} | "
          f"{'alone: mok':>10} {'LC nograd':>9} {'ratio':>6} | "
          f"{'mok f+b':>8} {'LC f+b':>8} {'ratio':>6} | {'mok GiB':>7} {'LC GiB':>7} | LC err")
    for r in peered:
        p = r["ligercute"]
        gib = lambda v: (v or float("nan")) / 2**30
        print(f"{r['layer']:<14} {r['experts']:>4} {r['tokens']:>6} | {p['mok_forward_in_step_ms']:>12.3f} "
              f"{p['forward_ms']:>7.3f} {p['mok_forward_vs_peer']:>6.2f} | {p['mok_forward_ms']:>10.3f} "
              f"{p['forward_nograd_ms']:>9.3f} {p['mok_forward_alone_vs_peer_nograd']:>6.2f} | "
              f"{p['mok_forward_backward_ms']:>8.3f} "
              f"{p['forward_backward_ms']:>8.3f} {p['mok_forward_backward_vs_peer']:>6.2f} | "
              f"{gib(p['mok_memory_bytes']):>7.2f} {gib(p['memory_bytes']):>7.2f} | {p['max_rel_err_vs_torch']:.1e}")


def plot_peers(rows, path):
    """Bars per case: forward and forward+backward ms, and memory, of mok and LigerCute."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print("peer plot skipped:", e)
        return
    labels = [f"{r['layer']}\nT {r['tokens']}" for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = (("forward ms (in a training step)", "mok_forward_in_step_ms", "forward_ms"),
              ("forward + backward ms", "mok_forward_backward_ms", "forward_backward_ms"),
              ("memory GiB beyond the inputs", "mok_memory_bytes", "memory_bytes"))
    for ax, (title, mine, theirs) in zip(axes, panels):
        scale = 2**30 if "memory" in mine else 1
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [(r["ligercute"][mine] or 0) / scale for r in rows], 0.4, label="mok")
        ax.bar([x + 0.2 for x in xs], [(r["ligercute"][theirs] or 0) / scale for r in rows], 0.4, label="LigerCute")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_title(title)
        ax.legend()
    fig.suptitle("routed experts only, one H200")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    global CLOCKS
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default="build/bench")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated layer names: run only their cases")
    ap.add_argument("--compare-env", action="append", default=[],
                    help="VAR=VALUE[,VAR=VALUE...] (repeatable): each case runs again with this in the environment (the library "
                         "reads its MOK_CUDA_* switches when a workspace is created, and each variant creates "
                         "its own), an A/B in one process; the table shows a "
                         "row per variant, and the variants reuse the first row's baseline times")
    ap.add_argument("--variants-first", action="store_true",
                    help="run each case's --compare-env / --compare-config rows before its defaults' row instead of "
                         "after it: the row timed second has come out a few %% faster whichever setting it had "
                         "(docs/log.md), so an A/B takes both orders")
    ap.add_argument("--compare-config", action="append", default=[],
                    help="FIELD=VALUE[,...] of the config (e.g. fwd_dispatch=push,fwd_combine=pull): a row per "
                         "case with those fields, beside the defaults' row (repeatable)")
    ap.add_argument("--sweep-comm", default="4,8,16,32", help="comm CTAs the sweep tries (comma-separated)")
    ap.add_argument("--sweep-mb", default="512,1024,2048", help="minibatch rows the sweep tries (comma-separated)")
    ap.add_argument("--trace", action="store_true",
                    help="per case, trace one forward and one backward (Config(trace=True)): JSON, a Gantt PNG "
                         "and a per-kind summary (task count, busy time, TFLOP/s of the GEMM kinds)")
    ap.add_argument("--trace-dir", default="build/traces", help="where --trace writes its JSON and PNG files")
    ap.add_argument("--profile", action="store_true",
                    help="per case, every kernel's GPU time over 3 forwards and 3 backwards (torch.profiler): "
                         "what the passes spend outside the megakernel (schedule, barriers, epilogue, memsets)")
    B.add_state_args(ap)
    ap.add_argument("--liger", default=os.environ.get("MOK_BENCH_LIGER", ""), metavar="SITE",
                    help="LigerCute installed in SITE (bench/liger-setup.sh): every case also runs it as a peer "
                         "(routed experts only), in processes of its own per case, one per GPU (bench/liger_peer.py)")
    ap.add_argument("--precision", choices=("bf16", "fp8"), default="bf16",
                    help="fp8: each case (and each --compare-env / --compare-config variant of it) also runs in "
                         "FP8 (include/mok.h, FP8), a row beside its bf16 row, or a "
                         "'skipped' row saying why where the backend has no FP8 path")
    ap.add_argument("--clocks", action="store_true",
                    help="sample the GPUs' SM clock and power with nvidia-smi (bench/clocks.py): each time in the "
                         "JSON gets the median clock, power and power-capped share of its repetitions, and the "
                         "table a line per case (nvidia-smi's GPU i taken for rank i)")
    ap.add_argument("--host", action="store_true",
                    help="per case, mok's and PyTorch's host time per call and GPU time per call queued back to "
                         "back (the table times each call from idle GPUs, so host time shows as GPU idle there)")
    a = ap.parse_args()
    if a.clocks:
        CLOCKS = C.Sampler().start()
    # the cpu smoke run times nothing that matters
    B.PREHEAT_S, B.SETTLE_S = (0.0, 0.0) if SMOKE else (a.preheat, a.settle)
    os.makedirs(a.out, exist_ok=True)
    group = F.Group.create_local(a.ranks, backend="cpu" if SMOKE else "cuda")
    rows = []
    cases = LY.cases(a.ranks)
    if SMOKE:
        cases = [("deepseek-v3", 8, 200, 0.0), ("qwen3-30b-a3b", 16, 300, 1.5 if a.ranks > 1 else 0.0)]
    if a.only:
        cases = [c for c in cases if c[0] in a.only.split(",")]
    base = F.Config()
    # each variant: (label, environment variables, config) for a row per case beside the defaults
    variants = [("", [], base)]
    for flag, specs in (("--compare-env", a.compare_env), ("--compare-config", a.compare_config)):
        for spec in specs:
            pairs = [kv.split("=", 1) for kv in spec.split(",")]
            if any(len(kv) != 2 for kv in pairs):
                ap.error(f"{flag} takes NAME=VALUE[,NAME=VALUE...]")
            if flag == "--compare-env":
                variants.append((spec, [tuple(kv) for kv in pairs], base))
                continue
            try:
                cfg = base.replace(**{k: (int(v) if v.lstrip("-").isdigit() else v) for k, v in pairs})
            except (TypeError, ValueError) as e:
                ap.error(f"--compare-config {spec}: {e}")
            variants.append((spec, [], cfg))
    order = variants[1:] + variants[:1] if a.variants_first else variants
    for name, experts, tokens, skew in cases:
        first = None  # the case's first row: it times the baselines, which the later rows reuse
        for label, env, cfg in order:
            saved = {}
            for var, value in env:
                saved[var] = os.environ.get(var)
                os.environ[var] = value
            try:
                t0 = time.time()
                row = run_case(group, a.ranks, name, experts, tokens, skew, cfg, a.reps, check=True,
                               baseline=first)
                row["wall_s"] = time.time() - t0
                row["env"] = label
                rows.append(row)
                if label == "" and not SMOKE:  # the peers beside the defaults' row
                    peer_rows(group, a.ranks, name, experts, tokens, skew, cfg, a.reps, row, a.liger)
                first = first or row
                print(json.dumps(row), flush=True)
                if a.precision == "fp8":  # each variant's FP8 row beside its bf16 row, same settings
                    rows.append(fp8_row(group, a.ranks, name, experts, tokens, skew, cfg, a.reps, row, label))
            finally:
                for var, value in saved.items():
                    if value is None:
                        del os.environ[var]
                    else:
                        os.environ[var] = value
    hosts = []
    if a.host:
        for name, experts, tokens, skew in cases:
            hosts.append(host_case(group, a.ranks, name, experts, tokens, skew, base, a.reps))
    if a.profile:
        for name, experts, tokens, skew in cases:
            profile_case(group, a.ranks, name, experts, tokens, skew, base)
    if a.trace:
        for name, experts, tokens, skew in cases:
            os.makedirs(a.trace_dir, exist_ok=True)
            trace_case(group, a.ranks, name, experts, tokens, skew, base.replace(trace=True), a.trace_dir)
            if a.precision == "fp8":
                trace_case(group, a.ranks, name, experts, tokens, skew, base.replace(trace=True), a.trace_dir, "fp8")
    sweeps = []
    if not a.no_sweep:
        comms = [int(c) for c in a.sweep_comm.split(",")]
        mbs = [int(m) for m in a.sweep_mb.split(",")]
        grid = [(case, comm, mb) for case in cases[:1] + cases[-1:] for comm in comms for mb in mbs]
        try:  # a progress bar on stderr: tqdm when importable, else a counter line per configuration
            from tqdm import tqdm
            bar = tqdm(total=len(grid), desc="sweep", unit="config", file=sys.stderr)
        except ImportError:
            bar = None
        for i, ((name, experts, tokens, skew), comm, mb) in enumerate(grid):
            if bar is None:
                print(f"[sweep {i + 1}/{len(grid)}] {name} comm {comm} minibatch {mb}", file=sys.stderr, flush=True)
            cfg = base.replace(fwd_comm_sms=comm, bwd_comm_sms=comm, minibatch_rows=mb)
            row = run_case(group, a.ranks, name, experts, tokens, skew, cfg, max(3, a.reps // 2), check=False,
                           in_step=False)
            sweeps.append(row)
            if bar is None:
                print(json.dumps(row), flush=True)
            else:
                bar.write(json.dumps(row), file=sys.stdout)
                bar.update(1)
        if bar is not None:
            bar.close()
    if CLOCKS is not None:  # every sample has arrived once sampling stops
        CLOCKS.stop()
        gpus = set(range(a.ranks))
        for r in rows + sweeps:
            windows = r.pop("clock_windows", {})
            r["clocks"] = {k: CLOCKS.window([w], gpus) for k, w in windows.items()}
            # mok's passes together: a short pass's window may fall between two samples
            passes = [windows[k] for k in ("forward_ms", "backward_ms", "forward_in_step_ms") if k in windows]
            if passes:
                r["clocks"]["mok"] = CLOCKS.window(passes, gpus)
    with open(os.path.join(a.out, f"bench_ep{a.ranks}.json"), "w") as f:
        json.dump(dict(cases=rows, sweeps=sweeps, host=hosts), f, indent=1)
    print()
    print(f"{'layer':<14} {'E':>4} {'T/GPU':>6} {'skew':>4} {'prec':>4} | {'mok fwd ms':>10} {'TFLOP/s':>7} | "
          f"{'torch ms':>8} {'speedup':>7} | {'mok bwd ms':>10} {'TFLOP/s':>7} | {'torch f+b':>9} {'speedup':>7} | "
          f"err | env | ws GiB | link GB/s")
    for r in rows:
        head = f"{r['layer']:<14} {r['experts']:>4} {r['tokens']:>6} {r['skew']:>4} {r['precision']:>4} |"
        if "skipped" in r:
            print(f"{head} skipped: {r['skipped']}")
            continue
        print(f"{head} {r['forward_ms']:>10.3f} "
              f"{r['forward_tflops']:>7.1f} | {r.get('baseline_forward_ms', float('nan')):>8.3f} "
              f"{r.get('speedup', float('nan')):>7.2f} | {r.get('backward_ms') or float('nan'):>10.3f} "
              f"{r.get('backward_tflops', float('nan')):>7.1f} | "
              f"{r.get('baseline_forward_backward_ms', float('nan')):>9.3f} {r.get('speedup_forward_backward', float('nan')):>7.2f} | "
              f"{r.get('max_rel_err_vs_torch', float('nan')):.2e} | "
              f"{r.get('env', '')} | "
              f"{r['workspace_bytes'] / 2**30:6.2f} | {r.get('forward_link_GBps', float('nan')):9.1f}")
    if CLOCKS is not None:
        print_clocks(rows, CLOCKS)
    fp8 = [r for r in rows if r["precision"] == "fp8" and "skipped" not in r]
    if fp8:
        print("\nFP8 beside bf16 (ratio = bf16 ms / fp8 ms; quantize: the weights, once per optimizer step, not in "
              "the passes)")
        for r in fp8:
            print(f"  {r['layer']:<14} E {r['experts']:>4} T {r['tokens']:>6} skew {r['skew']}: forward "
                  f"{r['fp8_vs_bf16_forward']:.2f}x, forward+backward "
                  f"{r.get('fp8_vs_bf16_forward_backward', float('nan')):.2f}x; "
                  f"quantize {r['quantize_ms']:.3f} ms; FP8 weights {r['fp8_weight_bytes'] / 2**20:.1f} MiB per rank"
                  f"{' (' + r['env'][4:] + ')' if r['env'] != 'fp8' else ''}")
    peered = [r for r in rows if "ligercute" in r]
    if peered:
        print_peers(peered)
        plot_peers(peered, os.path.join(a.out, f"peers_ep{a.ranks}.png"))
    ceil = [r for r in rows if "cublas_forward_tflops" in r]
    if ceil:
        print("\nagainst cuBLAS (batched GEMM) on every expert's own GEMM shapes (TFLOP/s; ratio = mok / cuBLAS)")
        for r in ceil:
            print(f"  {r['layer']:<14} E {r['experts']:>4} T {r['tokens']:>6} {r['precision']}: forward mok "
                  f"{r['forward_tflops']:6.1f} "
                  f"cuBLAS {r['cublas_forward_tflops']:6.1f} ({r['forward_vs_cublas']:.2f}); backward mok "
                  f"{r.get('backward_tflops', float('nan')):6.1f} cuBLAS {r['cublas_backward_tflops']:6.1f} "
                  f"({r.get('backward_vs_cublas', float('nan')):.2f})")
    if sweeps:
        print("\nsweep (forward ms): layer, comm SMs x minibatch rows")
        for r in sweeps:
            print(f"  {r['layer']:<14} comm {r['comm_sms']:>3} mb {r['minibatch']:>5}: fwd {r['forward_ms']:8.3f} ms"
                  f"  bwd {r.get('backward_ms') or float('nan'):8.3f} ms")
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, axes = plt.subplots(1, 2, figsize=(11, 4))
            for ax, name in zip(axes, sorted({r["layer"] for r in sweeps})):
                for mb in mbs:
                    pts = [(r["comm_sms"], r["forward_ms"]) for r in sweeps if r["layer"] == name and r["minibatch"] == mb]
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"minibatch {mb}")
                ax.set_title(f"{name}, EP{a.ranks}: forward")
                ax.set_xlabel("comm SMs")
                ax.set_ylabel("ms")
                ax.legend()
            fig.tight_layout()
            fig.savefig(os.path.join(a.out, f"sweep_ep{a.ranks}.png"), dpi=110)
        except Exception as e:  # the plot is a convenience; the JSON and the table are the record
            print("plot skipped:", e)


if __name__ == "__main__":
    main()
