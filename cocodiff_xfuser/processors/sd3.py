"""SD3 / SD3.5 attention."""

from __future__ import annotations

import torch


def image_only_joint_attention(attn, hidden_states: torch.Tensor) -> torch.Tensor:
    """SD3.5's dual-attention ``attn2``: joint attention with no text stream, under Ulysses.

    xfuser 0.7.0's ``xFuserJointAttnProcessor2_0`` leaves ``joint_strategy`` unbound on this
    path; this is the same computation as diffusers' ``JointAttnProcessor2_0`` with
    ``encoder_hidden_states=None``, with attention through xfuser's ``USP``.
    """
    from xfuser.model_executor.layers.usp import USP

    batch = hidden_states.shape[0]
    query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
    head_dim = key.shape[-1] // attn.heads
    query = query.view(batch, -1, attn.heads, head_dim)
    key = key.view(batch, -1, attn.heads, head_dim)
    value = value.view(batch, -1, attn.heads, head_dim)
    if attn.norm_q is not None:
        query = attn.norm_q(query)
    if attn.norm_k is not None:
        key = attn.norm_k(key)
    out = USP(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_layer=attn)
    out = out.transpose(1, 2).reshape(batch, -1, attn.heads * head_dim).to(query.dtype)
    return attn.to_out[1](attn.to_out[0](out))
