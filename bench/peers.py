"""Other MoE kernels benchmarked beside mok in the same run. Each runs in a process of its own
(its own runtime and heap, sized for one case) and reports one JSON line; a peer that is not
installed is skipped with a one-line reason."""
import json
import os
import subprocess

here = os.path.dirname(os.path.abspath(__file__))


def run_liger(site, layer, experts, tokens, skew, reps, ranks=1, preheat_s=None, settle_s=None, timeout_s=300):
    """LigerCute on one case (bench/liger_peer.py under bench/liger-env.sh; across `ranks` GPUs one
    process each, under torch.distributed.run): its JSON row, or {"skipped": reason}. preheat_s,
    settle_s: the GPU's state before each measurement (bench/baselines.py, ready()), its defaults
    when None."""
    if not site:
        return {"skipped": "LigerCute not set up (bench/liger-setup.sh BUNDLE SITE, then --liger SITE)"}
    if not os.path.isdir(os.path.join(site, "liger_cute_kernels")):
        return {"skipped": f"no liger_cute_kernels in {site}"}
    launch = ["python3"] if ranks == 1 else ["python3", "-m", "torch.distributed.run", "--standalone",
                                             "--nproc_per_node", str(ranks)]
    cmd = [os.path.join(here, "liger-env.sh"), site] + launch + [
        os.path.join(here, "liger_peer.py"), "--layer", layer, "--experts", str(experts), "--tokens", str(tokens),
        "--skew", str(skew), "--reps", str(reps), "--ranks", str(ranks)]
    for flag, value in (("--preheat", preheat_s), ("--settle", settle_s)):
        if value is not None:
            cmd += [flag, str(value)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"skipped": f"LigerCute did not finish within {timeout_s} s"}
    rows = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not rows:
        return {"skipped": f"LigerCute failed (exit {done.returncode}): {failure_line(done.stderr)[:200]}"}
    return json.loads(rows[-1])


def failure_line(stderr):
    """The line of a failed peer's stderr that says why: the last exception line ("...Error: ...",
    "...Exception: ..."), else the last line that is not a warning (torch.distributed prints one
    after the error when a process exits without destroying its group)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    for line in reversed(lines):
        head = line.split(":", 1)[0]
        if ":" in line and (head.endswith("Error") or head.endswith("Exception")):
            return line
    for line in reversed(lines):
        if "warning" not in line.lower():
            return line
    return lines[-1] if lines else "no output"
