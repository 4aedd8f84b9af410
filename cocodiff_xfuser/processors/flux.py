"""FLUX.1 attention (double- and single-stream blocks), V-First."""

from __future__ import annotations

import torch

from cocodiff_xfuser import compat
from cocodiff_xfuser.processors import ulysses


class FluxVFirstProcessor(ulysses.VFirst):
    """``xFuserFluxAttnProcessor`` with V projected and exchanged before Q/K projection, norm and RoPE."""

    def __init__(self, stock=None) -> None:
        from xfuser.model_executor.models.transformers.transformer_flux import xFuserFluxAttnProcessor

        self.stock = stock if stock is not None else xFuserFluxAttnProcessor()

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        if ulysses.fallback_reason(self, lambda: compat.fused_qk_kernel_reason("flux"), (hidden_states, encoder_hidden_states)) is not None:
            return self.stock(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        from diffusers.models.embeddings import apply_rotary_emb

        joint = attn.added_kv_proj_dim is not None and encoder_hidden_states is not None
        heads = attn.heads
        value = ulysses.project(attn, hidden_states, "v").unflatten(-1, (heads, -1))
        if joint:
            value = torch.cat([ulysses.project(attn, encoder_hidden_states, "v", added=True).unflatten(-1, (heads, -1)), value], dim=1)
        pending_v = ulysses.start_input_exchange(self, value.transpose(1, 2), label="flux.double.v" if joint else "flux.single.v")

        query = attn.norm_q(ulysses.project(attn, hidden_states, "q").unflatten(-1, (heads, -1)))
        key = attn.norm_k(ulysses.project(attn, hidden_states, "k").unflatten(-1, (heads, -1)))
        if joint:
            encoder_query = attn.norm_added_q(ulysses.project(attn, encoder_hidden_states, "q", added=True).unflatten(-1, (heads, -1)))
            encoder_key = attn.norm_added_k(ulysses.project(attn, encoder_hidden_states, "k", added=True).unflatten(-1, (heads, -1)))
            query = torch.cat([encoder_query, query], dim=1)
            key = torch.cat([encoder_key, key], dim=1)
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)

        out = ulysses.attention(query.transpose(1, 2), key.transpose(1, 2), pending_v)
        out = out.transpose(1, 2).flatten(2, 3).to(query.dtype)
        if not joint:
            return out
        encoder_out, out = out.split_with_sizes([encoder_hidden_states.shape[1], out.shape[1] - encoder_hidden_states.shape[1]], dim=1)
        return attn.to_out[1](attn.to_out[0](out)), attn.to_add_out(encoder_out)
