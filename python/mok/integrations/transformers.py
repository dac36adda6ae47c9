"""mok.integrations.transformers — runs the sparse-MoE blocks of Hugging Face transformers models
through mok: `apply(model)` replaces each block it knows by a MokMoeBlock that keeps the block's own
submodules (router, experts, shared expert), so the parameters, the state-dict keys and the
checkpoint format stay exactly as they were, and only the routed experts' computation (and a
plain shared expert's) moves into mok.

    from mok.integrations.transformers import apply
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    apply(model)            # before making the optimizer: the parameters are the same objects

The one idea: the model's router runs unchanged (its top-k, norm_topk_prob, DeepSeek-V3's grouped
top-k and routed_scaling_factor, Mixtral's jitter), and its (top_k_index, top_k_weights) go to mok
as topk_ids and router_w, so the router's gradient flows back through mok's d_router_w.

Layouts (transformers 5 stores the experts as fused 3-D parameters): experts.down_proj
[E, H, I] is mok's w_down as it is (the same tensor, no copy); experts.gate_up_proj [E, 2I, H]
holds each expert's gate rows then its up rows, and mok takes w_gate and w_up as two contiguous
[E, I, H] arrays, which no view of the fused parameter can be: each call makes them as a
transient copy (E·2I·H bf16, freed after the call; autograd returns their gradients into
gate_up_proj). A plain shared expert (DeepSeek-V3's shared_experts: gate_proj, up_proj,
down_proj Linears) is fused into mok's pass over its own weights, which are mok's s_gate, s_up,
s_down layouts as they are; Qwen2-MoE's shared expert, scaled by sigmoid(shared_expert_gate(x)),
stays the model's own modules, added after mok's output as the model adds it.
"""
import importlib

import torch
from torch import nn

from mok import DIM_TILE
from mok.torch import MoEExperts

__all__ = ["apply", "mok_blocks", "MokMoeBlock", "SUPPORTED"]

# (transformers module, block class, family): the blocks apply() knows. family selects the forward.
SUPPORTED = (
    ("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeSparseMoeBlock", "qwen3_moe"),
    ("transformers.models.qwen2_moe.modeling_qwen2_moe", "Qwen2MoeSparseMoeBlock", "qwen2_moe"),
    ("transformers.models.mixtral.modeling_mixtral", "MixtralSparseMoeBlock", "mixtral"),
    ("transformers.models.olmoe.modeling_olmoe", "OlmoeSparseMoeBlock", "olmoe"),
    ("transformers.models.deepseek_v3.modeling_deepseek_v3", "DeepseekV3MoE", "deepseek_v3"),
)
_SUPPORTED_NAMES = ", ".join(f"{name} ({family})" for _, name, family in SUPPORTED)
# The submodules each family's block holds; the block must hold nothing else of its own.
_CHILDREN = {
    "qwen3_moe": ("gate", "experts"),
    "qwen2_moe": ("gate", "experts", "shared_expert", "shared_expert_gate"),
    "mixtral": ("gate", "experts"),
    "olmoe": ("gate", "experts"),
    "deepseek_v3": ("gate", "experts", "shared_experts"),
}


def _known_classes():
    """{class: family} of the supported blocks this transformers version has."""
    known = {}
    for module_name, class_name, family in SUPPORTED:
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            continue
        known[cls] = family
    return known


def _refuse(block_name, rule):
    raise ValueError(f"mok.integrations.transformers.apply: {block_name}: {rule}")


def _model_config(block, name):
    config = getattr(block, "config", None) or getattr(block.experts, "config", None)
    if config is None:
        _refuse(name, "neither the block nor its experts hold the model config")
    return config


def _check_block(block, family, name):
    """The block's sizes (H, I, E, k, I_s of a fused shared expert) after every rule mok needs."""
    experts = block.experts
    gate_up = getattr(experts, "gate_up_proj", None)
    down = getattr(experts, "down_proj", None)
    if not isinstance(gate_up, nn.Parameter) or not isinstance(down, nn.Parameter) or gate_up.dim() != 3:
        _refuse(name, f"experts {type(experts).__name__} do not hold fused 3-D parameters gate_up_proj [E, 2I, H] "
                      "and down_proj [E, H, I] (the layout of transformers 5); found "
                      f"{sorted(n for n, _ in experts.named_parameters(recurse=False))}")
    for flag, want in (("has_bias", False), ("is_transposed", False), ("is_concatenated", True), ("has_gate", True)):
        if getattr(experts, flag, want) != want:
            _refuse(name, f"experts.{flag} = {getattr(experts, flag)!r}; mok runs {flag} = {want} only")
    E, two_I, H = gate_up.shape
    I = two_I // 2
    if tuple(down.shape) != (E, H, I) or two_I % 2:
        _refuse(name, f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are not [E, 2I, H] "
                      "and [E, H, I]")
    config = _model_config(block, name)
    act = getattr(config, "hidden_act", None)
    if act not in ("silu", "swish"):
        _refuse(name, f"hidden_act = {act!r}; mok's experts are SwiGLU (silu)")
    k = getattr(block.gate, "top_k", None) or getattr(config, "num_experts_per_tok", None)
    if not isinstance(k, int) or not 1 <= k <= E:
        _refuse(name, f"top-k {k!r} is not in [1, {E}]")
    Is = 0
    if family == "deepseek_v3":
        shared = block.shared_experts
        Is = shared.gate_proj.weight.shape[0]
        if any(getattr(shared, p).bias is not None for p in ("gate_proj", "up_proj", "down_proj")):
            _refuse(name, "the shared expert has biases; mok's has none")
    for what, value in (("hidden_size", H), ("the experts' intermediate size", I),
                        ("the shared expert's intermediate size", Is)):
        if value % DIM_TILE:
            _refuse(name, f"{what} = {value} is not a multiple of {DIM_TILE} (mok's tile); pick sizes that are")
    tensors = [("experts.gate_up_proj", gate_up), ("experts.down_proj", down)]
    if Is:
        tensors += [(f"shared_experts.{p}.weight", getattr(block.shared_experts, p).weight)
                    for p in ("gate_proj", "up_proj", "down_proj")]
    for what, t in tensors:
        if t.dtype != torch.bfloat16:
            _refuse(name, f"{what} is {t.dtype}; mok computes in bf16: convert the model first "
                          "(model.to(torch.bfloat16)) or load it with torch_dtype=torch.bfloat16")
    own = [n for n, _ in block.named_parameters(recurse=False)] + [n for n, _ in block.named_buffers(recurse=False)]
    extra = sorted(set(n for n, _ in block.named_children()) - set(_CHILDREN[family]))
    if own or extra:
        _refuse(name, f"holds parameters, buffers or submodules that mok's block would not keep: {own + extra}")
    return H, I, E, k, Is


class MokMoeBlock(nn.Module):
    """A Hugging Face sparse-MoE block run through mok. It holds the original block's submodules
    under their names (so its state dict is the original's, key for key) and mok's experts call
    (`mok`, no parameters). forward(hidden_states [..., H]) -> [..., H] in hidden_states' dtype."""

    def __init__(self, block, family, sizes, *, group=None, config=None, backend="auto", max_tokens=8192,
                 recompute_context="auto"):
        super().__init__()
        H, I, E, k, Is = sizes
        self.family = family
        self.original_class = type(block).__name__
        self.hidden, self.intermediate = H, I
        for child_name, child in block.named_children():  # in the block's order: the state dict's key order
            setattr(self, child_name, child)
        self.jitter_noise = float(getattr(block, "jitter_noise", 0.0) or 0.0)
        self.mok = MoEExperts(H, I, E, k, Is, group=group, config=config, backend=backend, max_tokens=max_tokens,
                              recompute_context=recompute_context)
        if self.mok.nranks != 1:
            raise ValueError("mok.integrations.transformers.apply: a Hugging Face model holds every expert on every "
                             "rank; run it with group=None (one rank) or shard it with a stack that owns expert "
                             "parallelism (Megatron)")

    def forward(self, hidden_states):
        shape = hidden_states.shape
        flat = hidden_states.reshape(-1, self.hidden)
        if self.family == "mixtral" and self.training and self.jitter_noise > 0:
            # the model scales its input in place; the same values here, out of place
            flat = flat * torch.empty_like(flat).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        _, top_k_weights, top_k_index = self.gate(flat)
        gate_up = self.experts.gate_up_proj
        I = self.intermediate
        # NOTE: w_gate / w_up are transient contiguous copies of the halves of gate_up_proj (mok
        # takes them as two [E, I, H] arrays; see the module's note); down_proj is used as it is.
        w_gate, w_up = gate_up[:, :I].contiguous(), gate_up[:, I:].contiguous()
        s_gate = s_up = s_down = None
        if self.family == "deepseek_v3":
            s = self.shared_experts
            s_gate, s_up, s_down = s.gate_proj.weight, s.up_proj.weight, s.down_proj.weight
        y = self.mok(flat, top_k_index, top_k_weights, w_gate, w_up, self.experts.down_proj, s_gate, s_up, s_down)
        y = y.to(hidden_states.dtype)
        if self.family == "qwen2_moe":
            shared = self.shared_expert(flat)
            y = y + torch.sigmoid(self.shared_expert_gate(flat)) * shared
        return y.reshape(shape)

    def extra_repr(self):
        return f"replaces={self.original_class}, family={self.family}"


def apply(model, *, max_tokens=8192, config=None, backend="auto", group=None, recompute_context="auto"):
    """Replaces every sparse-MoE block of `model` that mok knows (SUPPORTED) by a MokMoeBlock over
    the same submodules; returns the qualified names of the blocks replaced. The parameters stay
    the same objects (call it before making the optimizer or not: nothing is reallocated).

    max_tokens: the most tokens (batch x sequence) one block call may take; it sizes the workspace,
    shared by the blocks of one shape. config: a mok.Config. backend: "auto" follows the tensors.
    recompute_context: see mok.torch.MoEExperts ("auto": inside HF gradient checkpointing the
    context is rebuilt by recompute_forward_context instead of kept).

    Raises ValueError for a model with no block mok knows (naming the model's class, the MoE-like
    blocks it found and the supported ones) and for a block mok cannot run (naming the rule)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"mok.integrations.transformers.apply: expected a torch.nn.Module, got {type(model).__name__}")
    known = _known_classes()
    found = []
    for name, module in model.named_modules():
        family = known.get(type(module))
        if family is not None:
            found.append((name, module, family))
    if not found:
        moe_like = sorted({type(m).__name__ for _, m in model.named_modules()
                           if any(w in type(m).__name__.lower() for w in ("moe", "sparse", "expert"))})
        seen = f"MoE-like modules found: {', '.join(moe_like)}" if moe_like else "no MoE-like module found"
        raise ValueError(f"mok.integrations.transformers.apply: {type(model).__name__} has no sparse-MoE block that "
                         f"mok knows ({seen}); supported blocks: {_SUPPORTED_NAMES}")
    checked = [(name, module, family, _check_block(module, family, name or type(module).__name__))
               for name, module, family in found]  # every block checked before any is replaced
    replaced = []
    for name, module, family, sizes in checked:
        block = MokMoeBlock(module, family, sizes, group=group, config=config, backend=backend, max_tokens=max_tokens,
                            recompute_context=recompute_context)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, block)
        replaced.append(name)
    return replaced


def mok_blocks(model):
    """The MokMoeBlocks of a model (after apply)."""
    return [m for m in model.modules() if isinstance(m, MokMoeBlock)]

