"""mok.integrations.megatron — Megatron-Core's MoE layer with mok doing dispatch, experts and combine.

What the PyPI package offers (read in its source: megatron-core 0.16.1, the newest for Python 3.11,
and 0.19.2, the newest for Python >= 3.12): no megakernel backend boundary. There is no
`moe_megakernel_backend` field in TransformerConfig (transformer/transformer_config.py) and no
MegakernelBackend class anywhere in the package. That boundary lives in a fork of Megatron-LM
(its megatron/core/transformer/moe/moe_layer.py and mok_backend.py), and even there it is
closed: MoELayer.__init__ raises ValueError("moe_megakernel_backend must be None or 'mok', ...")
for any other name and imports its backend from inside the package, so nothing outside can
register there. The token dispatcher is closed too: MoELayer.__init__ picks it from
config.moe_token_dispatcher_type among 'allgather', 'alltoall' and 'flex' and raises ValueError
("Unsupported token dispatcher type") otherwise; the experts (MoESubmodules.experts) are
pluggable but receive tokens already dispatched, while mok dispatches itself.

So mok plugs in at the MoE layer: MokMoELayer is MoELayer (same constructor, same submodules,
same parameters and state dict: MCore keeps owning them) with a forward that runs MCore's router
(its top-k, score function, scaling, aux losses) and hands (topk ids, probabilities) to mok, which
dispatches over the layer's own expert-parallel process group (pg_collection.ep, not the world
group), runs the experts and combines. The routed experts' weights are read from MCore's experts
module each call (SequentialMLP / TEGroupedMLP: one [2I, H] and one [H, I] weight per expert;
GroupedMLP: [H, E·2I] and [E·I, H]) into mok's [E_local, I, H] layouts: a transient copy per call.
A shared expert without a gate is fused into mok's pass over its own weights (views: fc1's halves
and fc2 are mok's s_gate, s_up, s_down layouts); a gated one runs as MCore's module. With
recompute_modules containing "moe", MCore would checkpoint the whole layer; MokMoELayer instead
keeps x, the router weights and the schedule and rebuilds mok's context with
recompute_forward_context in the backward.

    from mok.integrations import megatron as mok_megatron
    mok_megatron.apply(model)                      # a built model: its MoELayers become MokMoELayers
    spec = mok_megatron.mok_moe_spec(layer_spec)   # or a layer spec whose MoE is built as MokMoELayer

Needs CUDA for MCore itself (its router moves its weight to the GPU); mok's cpu backend runs it
where MCore's pieces run on the CPU (the tests).
"""
import torch

from mok import DIM_TILE
from mok.torch import MoEExperts
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe import experts as mcore_experts

__all__ = ["MokMoELayer", "apply", "mok_moe_spec", "mok_shape", "check_config", "boundary"]


def boundary():
    """What this installed Megatron-Core offers mok, read from its classes: whether TransformerConfig
    has a moe_megakernel_backend field, whether a MegakernelBackend class exists in its MoE package,
    and the token dispatcher types MoELayer accepts."""
    import dataclasses
    import typing
    import megatron.core
    from megatron.core.transformer import moe as moe_package
    from megatron.core.transformer.transformer_config import TransformerConfig
    fields = {f.name: f for f in dataclasses.fields(TransformerConfig)}
    names = set()
    for module_name in ("moe_layer", "experts", "token_dispatcher", "router"):
        module = getattr(moe_package, module_name, None)
        names.update(dir(module) if module is not None else ())
    dispatcher = fields.get("moe_token_dispatcher_type")
    dispatchers = typing.get_args(dispatcher.type) if dispatcher is not None else ()
    return {
        "version": getattr(megatron.core, "__version__", "unknown"),
        "moe_megakernel_backend": "moe_megakernel_backend" in fields,
        "MegakernelBackend": "MegakernelBackend" in names,
        "token_dispatchers": tuple(dispatchers),
    }


def _refuse(rule):
    raise ValueError(f"mok.integrations.megatron: {rule}")


def check_config(config, tp_size=1, expert_tp_size=1):
    """Raises ValueError naming the TransformerConfig field when mok cannot run the MoE it describes."""
    if not config.num_moe_experts:
        _refuse("num_moe_experts is not set: the layer has no experts")
    if not config.gated_linear_unit:
        _refuse("gated_linear_unit is False; mok's experts are SwiGLU (gated_linear_unit=True, activation_func=silu)")
    if config.activation_func is not torch.nn.functional.silu:
        _refuse(f"activation_func is {getattr(config.activation_func, '__name__', config.activation_func)}; "
                "mok's experts are SwiGLU (torch.nn.functional.silu)")
    if config.add_bias_linear:
        _refuse("add_bias_linear is True; mok's experts have no biases")
    if getattr(config, "moe_apply_probs_on_input", False):
        _refuse("moe_apply_probs_on_input is True; mok scales the experts' outputs by the router weights")
    if getattr(config, "moe_latent_size", None):
        _refuse("moe_latent_size is set; mok runs the experts on the hidden size")
    if getattr(config, "moe_shared_expert_overlap", False):
        _refuse("moe_shared_expert_overlap is True; mok overlaps its transfers itself (set it False)")
    if config.params_dtype != torch.bfloat16:
        _refuse(f"params_dtype is {config.params_dtype}; mok computes in bf16 (params_dtype=torch.bfloat16)")
    if tp_size != 1 or expert_tp_size != 1:
        _refuse(f"tensor parallel size {tp_size} / expert tensor parallel size {expert_tp_size}; mok runs the "
                "experts whole on each expert-parallel rank (both 1)")
    ffn = config.moe_ffn_hidden_size or config.ffn_hidden_size
    shared = config.moe_shared_expert_intermediate_size or 0
    for field, value in (("hidden_size", config.hidden_size), ("moe_ffn_hidden_size", ffn),
                         ("moe_shared_expert_intermediate_size", shared)):
        if value % DIM_TILE:
            _refuse(f"{field} = {value} is not a multiple of {DIM_TILE} (mok's tile)")


def mok_shape(config):
    """The mok layer a TransformerConfig describes: hidden, intermediate, num_experts, topk, and the
    shared expert's intermediate size mok fuses (0 when there is none or when it has a gate, which
    then runs as MCore's module)."""
    shared = config.moe_shared_expert_intermediate_size or 0
    fused = 0 if getattr(config, "moe_shared_expert_gate", False) else shared
    return {"hidden": config.hidden_size, "intermediate": config.moe_ffn_hidden_size or config.ffn_hidden_size,
            "num_experts": config.num_moe_experts, "topk": config.moe_router_topk, "shared_intermediate": fused}


def _size(group):
    return torch.distributed.get_world_size(group) if group is not None else 1


def _routed_weights(experts, num_local, I, H):
    """(w_gate, w_up [E_local, I, H], w_down [E_local, H, I]) of MCore's experts module."""
    if isinstance(experts, mcore_experts.GroupedMLP):
        w1 = experts.weight1.view(num_local, H, 2 * I)      # per expert [H, 2I]: gate columns, then up
        w2 = experts.weight2.view(num_local, I, H)
        return (w1[..., :I].transpose(1, 2).contiguous(), w1[..., I:].transpose(1, 2).contiguous(),
                w2.transpose(1, 2).contiguous())
    if isinstance(experts, mcore_experts.SequentialMLP):
        fc1 = [e.linear_fc1.weight for e in experts.local_experts]
        fc2 = [e.linear_fc2.weight for e in experts.local_experts]
    elif type(experts).__name__ == "TEGroupedMLP":
        fc1 = [getattr(experts.linear_fc1, f"weight{i}") for i in range(num_local)]
        fc2 = [getattr(experts.linear_fc2, f"weight{i}") for i in range(num_local)]
    else:
        _refuse(f"experts module {type(experts).__name__} is not SequentialMLP, TEGroupedMLP or GroupedMLP")
    # NOTE: each expert's fc1 is [2I, H], gate rows then up rows (MCore's MLP chunks it that way)
    return (torch.stack([w[:I] for w in fc1]), torch.stack([w[I:] for w in fc1]), torch.stack(fc2))


def _check_layer(layer):
    """The mok shape of an MoELayer after every rule mok needs (ValueError naming the rule)."""
    config = layer.config
    expert_tp = getattr(layer.experts, "tp_group", None)
    check_config(config, _size(getattr(layer, "tp_group", None)), _size(expert_tp))
    shape = mok_shape(config)
    ep_size = _size(layer.ep_group)
    if shape["num_experts"] % ep_size:
        _refuse(f"num_moe_experts = {shape['num_experts']} is not a multiple of the expert-parallel size {ep_size}")
    for name, p in layer.experts.named_parameters():
        if p.dtype != torch.bfloat16:
            _refuse(f"experts.{name} is {p.dtype}; mok computes in bf16")
    return shape


def _attach(layer, shape, mok_config, backend, max_tokens):
    """The mok state of an MoELayer: its EP group is the layer's own (pg_collection.ep)."""
    ep = layer.ep_group
    layer._mok_args = dict(shape, group=ep if _size(ep) > 1 else None, config=mok_config, backend=backend)
    layer._mok_max_tokens = max_tokens
    layer._mok = None
    layer._mok_recompute = bool(getattr(layer, "moe_layer_recompute", False))


class MokMoELayer(MoELayer):
    """MoELayer whose dispatch, experts and combine run as mok's passes. Constructed like MoELayer
    (plus mok_config, backend, max_tokens: the most tokens per call, or None for the first call's
    count); apply() turns a built MoELayer into one."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, *, mok_config=None,
                 backend="auto", max_tokens=None, **mcore_kwargs):
        # mcore_kwargs: what newer MoELayers also take (is_mtp_layer, name), passed through
        super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                         pg_collection=pg_collection, **mcore_kwargs)
        _attach(self, _check_layer(self), mok_config, backend, max_tokens)

    def _mok_experts(self, num_tokens):
        if self._mok is None:
            max_tokens = self._mok_max_tokens or num_tokens
            recompute = True if self._mok_recompute else "auto"
            self._mok = MoEExperts(max_tokens=max_tokens, recompute_context=recompute, **self._mok_args)
        return self._mok

    def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
        if intermediate_tensors is not None:
            _refuse("intermediate_tensors (partial CUDA-graph capture of the MoE layer) is not supported")
        if padding_mask is not None:
            padding_mask = padding_mask.transpose(0, 1).bool()
        shape = hidden_states.shape
        H = self.config.hidden_size
        flat = hidden_states.reshape(-1, H)
        kernel = self._mok_experts(flat.shape[0])
        shared_output = None
        s_gate = s_up = s_down = None
        if self.use_shared_expert:
            if kernel.shared_intermediate:
                Is = kernel.shared_intermediate
                fc1 = self.shared_experts.linear_fc1.weight
                s_gate, s_up, s_down = fc1[:Is], fc1[Is:], self.shared_experts.linear_fc2.weight
            else:
                shared_output = self.shared_experts_compute(hidden_states)
        probs, routing_map = self.route(hidden_states, padding_mask)
        topk_ids, router_w = _topk_of(probs, routing_map, kernel.topk)
        I = kernel.intermediate
        w_gate, w_up, w_down = _routed_weights(self.experts, kernel.num_local_experts, I, H)
        y = kernel(flat, topk_ids, router_w, w_gate, w_up, w_down, s_gate, s_up, s_down)
        output = y.to(hidden_states.dtype).reshape(shape)
        if shared_output is not None:
            output = output + shared_output
        return output, None


def _topk_of(probs, routing_map, k):
    """MCore's router output ([T, E] probabilities, zero off the map, and the [T, E] boolean map) as
    mok's (topk_ids [T, k] int32, router_w [T, k] fp32): each token's selected experts in ascending
    id order; a token with fewer than k (capacity dropping) gets -1 slots of weight 0."""
    T, E = routing_map.shape
    order = routing_map.to(torch.int32) * (E - torch.arange(E, device=routing_map.device, dtype=torch.int32))
    score, ids = torch.topk(order, k, dim=-1)
    ids = torch.where(score > 0, ids, torch.full_like(ids, -1))
    weights = probs.float().gather(1, ids.clamp(min=0)) * (ids >= 0)
    return ids.to(torch.int32), weights


def apply(model, *, mok_config=None, backend="auto", max_tokens=None):
    """Turns every MoELayer of a built model into a MokMoELayer in place (the same parameters,
    state dict and process groups); returns their qualified names. Raises ValueError naming the
    rule when mok cannot run a layer, before any layer is changed."""
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, MoELayer)]
    if not layers:
        raise ValueError(f"mok.integrations.megatron.apply: {type(model).__name__} holds no MoELayer")
    shapes = [_check_layer(layer) for _, layer in layers]  # every layer checked before any changes
    for (_, layer), shape in zip(layers, shapes):
        _attach(layer, shape, mok_config, backend, max_tokens)
        layer.__class__ = MokMoELayer  # the same attributes and parameters; only forward changes
    return [name for name, _ in layers]


def mok_moe_spec(spec, *, mok_config=None, backend="auto", max_tokens=None):
    """A copy of a transformer-layer ModuleSpec (or of its MoE ModuleSpec) whose MoE is built as a
    MokMoELayer."""
    import copy
    from megatron.core.transformer.spec_utils import ModuleSpec
    spec = copy.deepcopy(spec)
    target = spec
    if not (isinstance(target.module, type) and issubclass(target.module, MoELayer)):
        target = getattr(spec.submodules, "mlp", None)
        if not (isinstance(target, ModuleSpec) and isinstance(target.module, type)
                and issubclass(target.module, MoELayer)):
            raise ValueError("mok.integrations.megatron.mok_moe_spec: the spec builds no MoELayer "
                             "(neither the spec nor its submodules.mlp)")
    target.module = MokMoELayer
    target.params = dict(target.params or {}, mok_config=mok_config, backend=backend, max_tokens=max_tokens)
    return spec

