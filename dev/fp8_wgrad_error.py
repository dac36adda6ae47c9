#!/usr/bin/env python3
"""fp8_wgrad_error.py — how much error FP8 weight gradients would add: the weight gradients of one
expert's rows, with their operands as the FP8 backward takes them today (bf16 dg, du and w·dy; x^ and
h^ of the forward, exact in bf16: include/mok.h, FP8) and with both operands quantized along the
tokens as well (E4M3, one power-of-two scale per column per 128-row tile: the form a K-major FP8
weight-gradient tile would read), each against the unquantized function's (bf16 x, h, dg, du, w·dy),
summed in fp64. Random data: x and the gate/up outputs normal, optionally with outlier channels or
outlier tokens; dg, du and dy small, the router weights in (0, 1).

First it checks its E4M3 rounding against the library's (mok_e4m3_from_float, mok_e4m3_to_float:
build/libmok.so, or MOK_LIBRARY) on random and boundary values, and that a quantized block's values
are its codes times its power-of-two scale; then it prints a line per case with the relative
Frobenius errors. Ends with `N passed, N failed`; exit code 0 only if every check passed.

    python3 dev/fp8_wgrad_error.py [--rows 2048] [--hidden 1024] [--inter 512] [--seed 0]
"""
import argparse
import ctypes
import os
import sys

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
BLOCK = 128  # MOK_FP8_BLOCK


def bf16(a):
    """Round to bf16 (nearest, ties to even), as fp64."""
    b = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
    return b.astype(np.uint32).view(np.float32).astype(np.float64)


def e4m3(v):
    """E4M3 rounding of values within +-448 (nearest, ties to the even mantissa), as fp64: normals
    (1 + m/8) 2^(E-7), subnormals m 2^-9."""
    a = np.abs(v)
    e = np.maximum(np.floor(np.log2(np.maximum(a, 2.0**-30))), -6)
    step = 2.0 ** (e - 3)
    return np.sign(v) * np.minimum(np.round(a / step) * step, 448.0)


def quantize(blocks, axis):
    """v^ of each block along `axis`: e = max(ceil(log2(amax / 448)), -124) (0 for amax 0), codes
    E4M3(v / 2^e), values codes * 2^e (mok.h's Q)."""
    amax = np.max(np.abs(blocks), axis=axis, keepdims=True)
    e = np.where(amax > 0, np.maximum(np.ceil(np.log2(np.where(amax > 0, amax, 1.0) / 448.0)), -124), 0)
    return e4m3(blocks / 2.0**e) * 2.0**e


def q_along_cols(m):
    """1 x 128 blocks along each row (the forward's x^, h^)."""
    r, c = m.shape
    return quantize(m.reshape(r, c // BLOCK, BLOCK), 2).reshape(r, c)


def q_along_rows(m):
    """128 x 1 blocks along each column, per 128-row tile (an FP8 weight gradient's operands)."""
    r, c = m.shape
    return quantize(m.reshape(r // BLOCK, BLOCK, c), 1).reshape(r, c)


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def silu(v):
    return v / (1.0 + np.exp(-v))


def library():
    path = os.environ.get("MOK_LIBRARY") or os.path.join(ROOT, "build", "libmok.so")
    lib = ctypes.CDLL(path)
    lib.mok_e4m3_from_float.restype, lib.mok_e4m3_from_float.argtypes = ctypes.c_uint8, [ctypes.c_float]
    lib.mok_e4m3_to_float.restype, lib.mok_e4m3_to_float.argtypes = ctypes.c_float, [ctypes.c_uint8]
    return lib


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=2048, help="the expert's rows (K of its weight gradients)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    R, H, I = a.rows, a.hidden, a.inter
    if R % BLOCK or H % BLOCK or I % BLOCK:
        sys.exit("fp8_wgrad_error: rows, hidden and inter are multiples of 128")
    rng = np.random.default_rng(a.seed)
    passed = failed = 0

    def check(ok, what):
        nonlocal passed, failed
        print(("PASS " if ok else "FAIL ") + what)
        passed, failed = passed + ok, failed + (not ok)

    lib = library()
    v = rng.standard_normal(20000) * 10.0 ** rng.uniform(-4.5, 2.6, 20000)
    edges = [448.0, 0.0, 2.0**-9, 1.5 * 2.0**-9, 2.0**-10, 2.0**-6, 1.0625 * 2.0**-6, 1.0 + 1.0 / 16, 1.0 + 3.0 / 16]
    v = np.concatenate([v, edges, [-x for x in edges]]).astype(np.float32).astype(np.float64)
    v = v[np.abs(v) <= 448]
    theirs = np.array([lib.mok_e4m3_to_float(lib.mok_e4m3_from_float(float(x))) for x in v])
    check(bool(np.all(e4m3(v) == theirs)), f"E4M3 rounding equals the library's on {len(v)} values")
    m = rng.standard_normal((2 * BLOCK, BLOCK)) * 10.0 ** rng.uniform(-3, 3, (2 * BLOCK, 1))
    qm = q_along_cols(m)
    scales = 2.0 ** np.maximum(np.ceil(np.log2(np.abs(m).max(axis=1, keepdims=True) / 448.0)), -124)
    check(bool(np.all(e4m3(qm / scales) == qm / scales)) and bool(np.all(np.abs(qm / scales) <= 448)),
          "a quantized block's values are E4M3 codes times its power-of-two scale")

    print(f"relative Frobenius error against the unquantized weight gradients, {R} rows, H {H}, I {I} "
          "(today: bf16 dg, du, w.dy with the forward's x^, h^; FP8: both operands also quantized along the "
          "tokens)")
    for case in ("plain", "outlier channels", "outlier tokens"):
        x = rng.standard_normal((R, H))
        g, u = rng.standard_normal((R, I)), rng.standard_normal((R, I))
        if case == "outlier channels":
            x[:, rng.choice(H, 8, replace=False)] *= 30.0
            g[:, rng.choice(I, 4, replace=False)] *= 10.0
        if case == "outlier tokens":
            x[rng.choice(R, 16, replace=False)] *= 30.0
        x = bf16(x)
        h = bf16(silu(bf16(g)) * bf16(u))
        w = rng.uniform(0.0, 1.0, (R, 1))
        dy = bf16(rng.standard_normal((R, H)) * 1e-3 * (1.0 + 4.0 * rng.random((R, 1))))
        dyw = bf16(w * dy)
        dg = bf16(rng.standard_normal((R, I)) * 1e-3 * (1.0 + 4.0 * rng.random((R, 1))))
        xq, hq = q_along_cols(x), q_along_cols(h)
        exact = {"gate": dg.T @ x, "down": dyw.T @ h}
        today = {"gate": dg.T @ xq, "down": dyw.T @ hq}
        fp8 = {"gate": q_along_rows(dg).T @ q_along_rows(xq), "down": q_along_rows(dyw).T @ q_along_rows(hq)}
        parts = [f"dW_{k} today {rel(today[k], exact[k]):.4f}, FP8 {rel(fp8[k], exact[k]):.4f}" for k in exact]
        print(f"  {case:17s} " + "; ".join(parts))
        ok = all(np.isfinite(fp8[k]).all() and rel(fp8[k], exact[k]) < 0.2 for k in exact)
        check(ok, f"{case}: FP8 weight gradients finite and within 20% of the unquantized ones")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
