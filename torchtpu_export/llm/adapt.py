"""Where a transformers family computes something a step cannot capture or a step's inputs do not fit, its
module is given another form of the same computation while a step is traced (:func:`adapted`), by class
name: data-dependent expert loops as transformers' own grouped matmul (``transformers::grouped_mm_fallback``,
lowered on both targets), and an ALiBi bias built from the step's 4-D mask. Nothing of the model is changed
outside the ``with``."""
from __future__ import annotations

import contextlib
import functools
import importlib
import types

import torch


def _grouped_mm(x, w, offs):
    """``x [S, in]`` rows sorted by expert, ``w [E, in, out]``, ``offs`` the cumulative row count per expert."""
    importlib.import_module("transformers.integrations.moe")  # registers the op
    return torch.ops.transformers.grouped_mm_fallback(x, w, offs)


def _counts(expert_ids, experts: int):
    """The cumulative rows per expert (int32), as transformers' grouped experts count them."""
    return torch.cumsum(torch.histc(expert_ids.float(), bins=experts, min=0, max=experts - 1), 0, dtype=torch.int32)


def _jetmoe_gating(self, hidden_states):
    """JetMoE's router with the group sizes as a tensor (its own makes them a Python list, which a capture
    cannot)."""
    logits = self.layer(hidden_states).float()
    top_k_logits, top_k_indices = logits.topk(self.top_k, dim=1)
    top_k_gates = torch.softmax(top_k_logits, dim=1).type_as(hidden_states)
    experts = top_k_indices.flatten()
    _, index_sorted_experts = experts.sort(0)
    batch_index = index_sorted_experts.div(self.top_k, rounding_mode="trunc")
    batch_gates = top_k_gates.flatten()[index_sorted_experts]
    return index_sorted_experts, batch_index, batch_gates, _counts(experts, self.num_experts), logits


def _jetmoe_experts(self, inputs, expert_size):
    """JetMoE's experts (``weight [E, out, in]``) over rows sorted by expert: one grouped matmul."""
    return _grouped_mm(inputs, self.weight.transpose(1, 2), expert_size)


def _dbrx_experts(self, hidden_states, top_k_index, top_k_weights):
    """DBRX's experts (a loop over the experts hit, data-dependent) as three grouped matmuls over the
    (token, expert) pairs sorted by expert, summed back per token with their router weights."""
    batch = hidden_states.shape[0]
    x = hidden_states.reshape(-1, self.hidden_size)
    experts, ffn, hidden = self.num_experts, self.ffn_hidden_size, self.hidden_size
    k = top_k_index.shape[-1]
    ids = top_k_index.reshape(-1)
    ids_sorted, order = torch.sort(ids)
    token = order // k  # each sorted pair's token
    rows = x[token]
    offs = _counts(ids_sorted, experts)
    mlp = self.mlp
    gate = _grouped_mm(rows, mlp.w1.view(experts, ffn, hidden).transpose(1, 2), offs)
    up = _grouped_mm(rows, mlp.v1.view(experts, ffn, hidden).transpose(1, 2), offs)
    down = _grouped_mm(mlp.activation_fn(gate) * up, mlp.w2.view(experts, ffn, hidden), offs)
    down = down * top_k_weights.reshape(-1)[order][:, None].to(down.dtype)
    out = torch.zeros_like(x).index_add(0, token, down)
    return out.view(batch, -1, self.hidden_size)


def _alibi_of_cache(build, attention_mask, num_heads, dtype):
    """ALiBi (BLOOM's ``build_alibi_tensor``) from the step's 4-D mask ``[B, 1, N, C]``: the bias of every
    cache position (slope x position), as transformers builds it from a 2-D mask of ones. A query row's bias
    differs from the relative one by a constant, so the softmax is the same."""
    if attention_mask.dim() == 4:
        attention_mask = torch.ones(attention_mask.shape[0], attention_mask.shape[-1], dtype=torch.int64,
                                    device=attention_mask.device)
    return build(attention_mask, num_heads, dtype)


# class name -> (attribute, the replacement given the module)
ADAPTERS = {
    "JetMoeTopKGating": ("forward", lambda m: types.MethodType(_jetmoe_gating, m)),
    "JetMoeParallelExperts": ("forward", lambda m: types.MethodType(_jetmoe_experts, m)),
    "DbrxExperts": ("forward", lambda m: types.MethodType(_dbrx_experts, m)),
    "BloomModel": ("build_alibi_tensor", lambda m: functools.partial(_alibi_of_cache, m.build_alibi_tensor)),
}


@contextlib.contextmanager
def adapted(model):
    """Within it, the modules of ``model`` that :data:`ADAPTERS` names compute in their adapted form."""
    found = [(m, *ADAPTERS[type(m).__name__]) for m in model.modules() if type(m).__name__ in ADAPTERS]
    for m, attr, make in found:
        setattr(m, attr, make(m))
    try:
        yield
    finally:
        for m, attr, _ in found:
            m.__dict__.pop(attr, None)
