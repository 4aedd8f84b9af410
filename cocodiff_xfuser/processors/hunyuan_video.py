"""HunyuanVideo attention (dual- and single-stream blocks), V-First."""

from __future__ import annotations

import torch

from cocodiff_xfuser.processors import ulysses


def _heads(attn, x: torch.Tensor) -> torch.Tensor:
    return x.unflatten(2, (attn.heads, -1)).transpose(1, 2)


def _query_key(attn, hidden_states, encoder_hidden_states, image_rotary_emb, dual: bool, text: int):
    """Q and K as the stock processor makes them (after V's exchange started): normed, RoPE on the
    latent tokens only, the text stream's own projections appended in dual-stream blocks."""
    from diffusers.models.embeddings import apply_rotary_emb

    query = _heads(attn, attn.to_q(hidden_states))
    key = _heads(attn, attn.to_k(hidden_states))
    query, key = ulysses.norm_qk(attn, query, key)
    if image_rotary_emb is not None:
        if not dual:
            query = torch.cat([apply_rotary_emb(query[:, :, :-text], image_rotary_emb), query[:, :, -text:]], dim=2)
            key = torch.cat([apply_rotary_emb(key[:, :, :-text], image_rotary_emb), key[:, :, -text:]], dim=2)
        else:
            query = apply_rotary_emb(query, image_rotary_emb)
            key = apply_rotary_emb(key, image_rotary_emb)
    if dual:
        encoder_query = _heads(attn, attn.add_q_proj(encoder_hidden_states))
        encoder_key = _heads(attn, attn.add_k_proj(encoder_hidden_states))
        encoder_query, encoder_key = ulysses.norm_qk(attn, encoder_query, encoder_key, added=True)
        query = torch.cat([query, encoder_query], dim=2)
        key = torch.cat([key, encoder_key], dim=2)
    return query, key


class HunyuanVideoVFirstProcessor(ulysses.VFirst):
    """``xFuserHunyuanVideoAttnProcessor`` with V projected and exchanged before Q/K norm and RoPE.

    Both text layouts are reproduced: text split over the Ulysses ranks
    (``split_text_embed_in_sp``: one joint sequence) and text kept whole (``"rear"`` joint
    strategy). Pipeline parallelism and calls without a text stream take the stock processor.
    """

    def __init__(self, stock=None) -> None:
        from xfuser.model_executor.models.transformers.transformer_hunyuan_video import (
            xFuserHunyuanVideoAttnProcessor,
        )

        self.stock = stock if stock is not None else xFuserHunyuanVideoAttnProcessor()

    def __call__(self, attn, hidden_states, encoder_hidden_states, attention_mask=None, image_rotary_emb=None, *args, **kwargs):
        from xfuser.core.distributed import get_pipeline_parallel_world_size, get_runtime_state

        def unsupported():
            if encoder_hidden_states is None:
                return "HunyuanVideo attention without a text stream"
            if get_pipeline_parallel_world_size() > 1:
                return "pipeline parallelism"
            return None

        if ulysses.fallback_reason(self, unsupported, (hidden_states, encoder_hidden_states)) is not None:
            return self.stock(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb, *args, **kwargs)

        split_text = get_runtime_state().split_text_embed_in_sp
        dual = attn.add_q_proj is not None  # dual-stream block; single-stream ones project [latent, text] together
        text = encoder_hidden_states.shape[1]
        if not dual:
            hidden_states = torch.cat([hidden_states, encoder_hidden_states], dim=1)

        value = _heads(attn, attn.to_v(hidden_states))
        if dual:
            value = torch.cat([value, _heads(attn, attn.add_v_proj(encoder_hidden_states))], dim=2)
        latent = value.shape[2] - text
        joint_value = None
        if not split_text:
            value, joint_value = value.split([latent, text], dim=2)
        pending_v = ulysses.start_input_exchange(self, value, label="hunyuan_video.dual.v" if dual else "hunyuan_video.single.v")

        query, key = _query_key(attn, hidden_states, encoder_hidden_states, image_rotary_emb, dual, text)

        if split_text:
            out = ulysses.attention(query, key, pending_v)
        else:
            query, joint_query = query.split([latent, text], dim=2)
            key, joint_key = key.split([latent, text], dim=2)
            out = ulysses.attention(
                query, key, pending_v, joint_query=joint_query, joint_key=joint_key, joint_value=joint_value, joint_strategy="rear"
            )
        out = out.transpose(1, 2).flatten(2, 3).to(query.dtype)

        out, encoder_out = out[:, :-text], out[:, -text:]
        if getattr(attn, "to_out", None) is not None:
            out = attn.to_out[1](attn.to_out[0](out))
        if getattr(attn, "to_add_out", None) is not None:
            encoder_out = attn.to_add_out(encoder_out)
        return out, encoder_out
