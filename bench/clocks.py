"""clocks.py — the GPUs' SM clock and power while the benchmark measures (bench.py --clocks).

nvidia-smi samples every GPU every `interval_ms` in a process beside the benchmark; each
measurement keeps its host-time window, and once sampling stops (so that every line has arrived)
a window gives the median SM clock and power of its samples and the share of them whose clock the
power cap held (clocks_event_reasons bit 0x4). The passes run at the power cap (docs/log.md: the
SM clock falls from 1980 MHz to ~1500 within ~0.2 s of sustained GEMMs), so two times a few %
apart may be two clocks: the clock beside each time says whether the work or the clock moved.
Samples carry nvidia-smi's own timestamps, so the pipe's buffering does not shift them.
"""
import datetime
import statistics
import subprocess
import threading

QUERY = "timestamp,index,clocks.sm,power.draw,clocks_event_reasons.active"
POWER_CAP = 0x4


def parse(line):
    """One line of `nvidia-smi --query-gpu=QUERY --format=csv,noheader,nounits`: (host time in s, GPU
    index, SM MHz, watts, reasons), or None for a line that is not one (a header, "[N/A]")."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 5:
        return None
    try:
        t = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        return t, int(parts[1]), float(parts[2]), float(parts[3]), int(parts[4], 16)
    except ValueError:
        return None


def summarize(samples, windows, gpus=None):
    """The samples in any of `windows` ((t0, t1) pairs) of the GPUs in `gpus` (all when None):
    {"mhz": median SM clock, "watts": median power, "capped": share held by the power cap,
    "samples": their count}, or None when there are none (a window shorter than the sampling
    interval may hold none: pool several)."""
    inside = [s for s in samples if any(t0 <= s[0] <= t1 for t0, t1 in windows) and (gpus is None or s[1] in gpus)]
    if not inside:
        return None
    return {"mhz": statistics.median(s[2] for s in inside), "watts": statistics.median(s[3] for s in inside),
            "capped": sum(1 for s in inside if s[4] & POWER_CAP) / len(inside), "samples": len(inside)}


class Sampler:
    """nvidia-smi in the background from start() to stop(); `reason` says why nothing was sampled."""

    def __init__(self, interval_ms=50, command="nvidia-smi"):
        self.interval_ms, self.command = interval_ms, command
        self.samples, self.reason = [], None
        self._proc = self._thread = None

    def start(self):
        try:
            self._proc = subprocess.Popen(
                [self.command, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", str(self.interval_ms)],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError as e:
            self.reason = f"{self.command} could not run ({e.strerror or e})"
            return self
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def _read(self):
        for line in self._proc.stdout:
            s = parse(line)
            if s is not None:
                self.samples.append(s)

    def stop(self):
        """Ends sampling and reads every line written so far; then window() is final."""
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._thread.join(timeout=10)
        if not self.samples and self.reason is None:
            self.reason = f"{self.command} gave no samples"
        self._proc = None

    def window(self, windows, gpus=None):
        """summarize() of the samples so far: final once stop() has returned."""
        return summarize(self.samples, windows, gpus)
