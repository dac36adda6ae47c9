"""bf16.py — bf16 for numpy callers, carried as np.uint16 bit patterns (numpy has no bf16 type).

from_float32 rounds as mok does (mok_bf16_from_float): to nearest, ties to even, NaN stays NaN
(its quiet bit set, so that cutting the low bits cannot turn it into inf), overflow becomes inf.
"""
import numpy as np


def from_float32(a):
    """fp32 values (anything np.asarray turns into float32) -> bf16 bit patterns (np.uint16)."""
    f = np.ascontiguousarray(np.asarray(a, dtype=np.float32))
    bits = f.view(np.uint32)
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    # Non-NaN bit patterns are at most 0xff800000, so the rounding add cannot wrap.
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    quiet = (bits >> np.uint32(16)) | np.uint32(0x0040)
    return np.where(nan, quiet, rounded).astype(np.uint16)


def to_float32(a):
    """bf16 bit patterns (np.uint16) -> fp32 values (exact)."""
    b = np.asarray(a)
    if b.dtype != np.uint16:
        if b.dtype.itemsize == 2 and b.dtype.name == "bfloat16":  # ml_dtypes' bfloat16
            b = b.view(np.uint16)
        else:
            raise ValueError(f"to_float32: expected np.uint16 bf16 bit patterns, got dtype {b.dtype}")
    return (b.astype(np.uint32) << np.uint32(16)).view(np.float32)


def round(a):
    """fp32 values rounded to the nearest bf16 value, as fp32."""
    return to_float32(from_float32(a))
