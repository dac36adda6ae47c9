"""random_layer.py — random layers for the binding's tests (test_binding.py, test_fp8_functional.py): per-rank
x, dy, topk_ids, router_w and experts, and one copy of the shared expert, as numpy arrays (bf16 as
uint16)."""
import numpy as np

from mok.bf16 import from_float32 as bf


def make_layer(run_seed, P, tokens, H, I, E, k, Is, seed=0, holes=False, signed=False, even_only=False,
               router="softmax"):
    """A layer drawn from (run_seed, seed). topk_ids: the top-k of random logits; router_w: their
    softmax over the k ("softmax") or uniform in [0.1, 1) ("uniform"). holes: about a quarter of the
    slots -1 with a NaN router weight (the library must not read it). signed: some router weights 0
    or negative. even_only: only even experts get rows. Weights uniform with variance 1 / fan_in."""
    rng = np.random.default_rng([run_seed, seed])
    E_local = E // P
    L = {"P": P, "H": H, "I": I, "E": E, "k": k, "Is": Is, "tokens": list(tokens)}
    L["x"] = [bf(rng.uniform(-1, 1, (t, H))) for t in tokens]
    L["dy"] = [bf(rng.uniform(-1, 1, (t, H))) for t in tokens]
    ids, rws = [], []
    for t in tokens:
        logits = rng.normal(size=(t, E))
        if even_only:
            logits[:, 1::2] = -np.inf
        top = np.argsort(-logits, axis=1, kind="stable")[:, :k]
        if router == "softmax":
            p = np.exp(np.take_along_axis(logits, top, 1))
            w = (p / p.sum(1, keepdims=True)).astype(np.float32)
        else:
            w = rng.uniform(0.1, 1.0, (t, k)).astype(np.float32)
        top = top.astype(np.int32)
        if signed:
            w[rng.random(w.shape) < 0.25] = 0.0
            w[rng.random(w.shape) < 0.25] *= -1
        if holes:
            empty = rng.random(top.shape) < 0.25
            top[empty] = -1
            w[empty] = np.nan
        ids.append(np.ascontiguousarray(top))
        rws.append(np.ascontiguousarray(w))
    L["topk_ids"], L["router_w"] = ids, rws

    def weight(shape, fan_in):
        return bf(rng.uniform(-1, 1, shape) * np.sqrt(3.0 / fan_in))

    L["w_gate"] = [weight((E_local, I, H), H) for _ in range(P)]
    L["w_up"] = [weight((E_local, I, H), H) for _ in range(P)]
    L["w_down"] = [weight((E_local, H, I), I) for _ in range(P)]
    if Is:
        L["s_gate"], L["s_up"], L["s_down"] = weight((Is, H), H), weight((Is, H), H), weight((H, Is), Is)
    else:
        L["s_gate"] = L["s_up"] = L["s_down"] = None
    return L


def weights(L):
    """The six weight arrays of a layer, in the library's argument order."""
    return (L["w_gate"], L["w_up"], L["w_down"], L["s_gate"], L["s_up"], L["s_down"])
