"""FLUX.2 attention: double-stream (``xFuserFlux2AttnProcessor``) and single-stream
(``xFuserFlux2ParallelSelfAttnProcessor``, fused ``to_qkv_mlp_proj``) blocks, V-First."""

from __future__ import annotations

import torch

from cocodiff_xfuser import compat
from cocodiff_xfuser.processors import ulysses


class Flux2VFirstProcessor(ulysses.VFirst):
    """``xFuserFlux2AttnProcessor`` with V projected and exchanged before Q/K projection, norm and RoPE."""

    def __init__(self, stock=None) -> None:
        from xfuser.model_executor.models.transformers.transformer_flux2 import xFuserFlux2AttnProcessor

        self.stock = stock if stock is not None else xFuserFlux2AttnProcessor()

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        joint = attn.added_kv_proj_dim is not None

        def unsupported():
            if joint and encoder_hidden_states is None:
                return "FLUX.2 joint attention without a text stream"
            return compat.fused_qk_kernel_reason("flux2")

        if ulysses.fallback_reason(self, unsupported, (hidden_states, encoder_hidden_states)) is not None:
            return self.stock(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        from diffusers.models.embeddings import apply_rotary_emb

        heads = attn.heads
        value = ulysses.project(attn, hidden_states, "v").unflatten(-1, (heads, -1))
        if joint:
            encoder_value = ulysses.project(attn, encoder_hidden_states, "v", added=True).unflatten(-1, (heads, -1))
            value = torch.cat([encoder_value, value], dim=1)
        pending_v = ulysses.start_input_exchange(self, value.transpose(1, 2), label="flux2.double.v")

        query = attn.norm_q(ulysses.project(attn, hidden_states, "q").unflatten(-1, (heads, -1)))
        key = attn.norm_k(ulysses.project(attn, hidden_states, "k").unflatten(-1, (heads, -1)))
        if joint:
            encoder_query = ulysses.project(attn, encoder_hidden_states, "q", added=True).unflatten(-1, (heads, -1))
            encoder_key = ulysses.project(attn, encoder_hidden_states, "k", added=True).unflatten(-1, (heads, -1))
            query = torch.cat([attn.norm_added_q(encoder_query), query], dim=1)
            key = torch.cat([attn.norm_added_k(encoder_key), key], dim=1)
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)

        out = ulysses.attention(query.transpose(1, 2), key.transpose(1, 2), pending_v).transpose(1, 2)
        out = out.flatten(2, 3).to(query.dtype)
        encoder_out = None
        if encoder_hidden_states is not None:
            text = encoder_hidden_states.shape[1]
            encoder_out, out = out.split_with_sizes([text, out.shape[1] - text], dim=1)
            encoder_out = attn.to_add_out(encoder_out)
        out = attn.to_out[1](attn.to_out[0](out))
        return out if encoder_out is None else (out, encoder_out)


class Flux2SingleVFirstProcessor(ulysses.VFirst):
    """``xFuserFlux2ParallelSelfAttnProcessor`` (single-stream block), V-First.

    The fused ``to_qkv_mlp_proj`` is computed in row blocks: V's rows first (its exchange
    starts at once), then Q/K's and the MLP's, which go on exactly as in the stock processor.
    """

    def __init__(self, stock=None) -> None:
        from xfuser.model_executor.models.transformers.transformer_flux2 import (
            xFuserFlux2ParallelSelfAttnProcessor,
        )

        self.stock = stock if stock is not None else xFuserFlux2ParallelSelfAttnProcessor()

    def __call__(self, attn, hidden_states, attention_mask=None, image_rotary_emb=None, **kwargs):
        if ulysses.fallback_reason(self, lambda: compat.fused_qk_kernel_reason("flux2"), (hidden_states,)) is not None:
            return self.stock(attn, hidden_states, attention_mask, image_rotary_emb, **kwargs)
        from diffusers.models.embeddings import apply_rotary_emb

        proj, inner, heads = attn.to_qkv_mlp_proj, attn.inner_dim, attn.heads
        value = ulysses.linear_slice(proj, hidden_states, 2 * inner, 3 * inner).unflatten(-1, (heads, -1))
        pending_v = ulysses.start_input_exchange(self, value.transpose(1, 2), label="flux2.single.v")

        query, key = ulysses.linear_slice(proj, hidden_states, 0, 2 * inner).chunk(2, dim=-1)
        query = attn.norm_q(query.unflatten(-1, (heads, -1)))
        key = attn.norm_k(key.unflatten(-1, (heads, -1)))
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        mlp_hidden_states = ulysses.linear_slice(proj, hidden_states, 3 * inner, proj.out_features)

        out = ulysses.attention(query.transpose(1, 2), key.transpose(1, 2), pending_v).transpose(1, 2)
        out = out.flatten(2, 3).to(query.dtype)
        mlp_hidden_states = attn.mlp_act_fn(mlp_hidden_states)
        return attn.to_out(torch.cat([out, mlp_hidden_states], dim=-1))
