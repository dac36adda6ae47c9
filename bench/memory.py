"""Device memory a benchmarked layer holds beyond its inputs, measured the same way for mok and its
peers: the caching allocator's peak over what it held before, plus what the process holds outside the
allocator (mok's workspace, a peer's NVSHMEM heap) over what it held outside it before."""
import torch


def snapshot():
    """The device's use now: (bytes in use on the device, bytes the allocator reserves, bytes it has
    allocated)."""
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return (total - free, torch.cuda.memory_reserved(), torch.cuda.memory_allocated())


def reset_peak():
    torch.cuda.reset_peak_memory_stats()


def held_since(before):
    """Bytes held since `before` (a snapshot taken before the layer's state was created; call
    reset_peak between the two so the allocator's peak is this layer's)."""
    used, reserved, _ = snapshot()
    outside = (used - reserved) - (before[0] - before[1])
    allocated_peak = torch.cuda.max_memory_allocated() - before[2]
    return max(0, outside) + max(0, allocated_peak)
