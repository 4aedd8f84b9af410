"""SD3 / SD3.5 attention."""

from __future__ import annotations

import torch

from cocodiff_xfuser import compat
from cocodiff_xfuser.processors import ulysses


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
    query, key = ulysses.norm_qk(attn, query, key)
    out = USP(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_layer=attn)
    out = out.transpose(1, 2).reshape(batch, -1, attn.heads * head_dim).to(query.dtype)
    return attn.to_out[1](attn.to_out[0](out))


def _heads(attn, x: torch.Tensor, head_dim: int) -> torch.Tensor:
    return x.view(x.shape[0], -1, attn.heads, head_dim)


class SD3VFirstProcessor(ulysses.VFirst):
    """``xFuserJointAttnProcessor2_0`` (SD3 / SD3.5 joint attention), V-First.

    Reproduced: the text stream split over the Ulysses ranks (``split_text_embed_in_sp``,
    image and text Q/K/V concatenated), the text kept whole (``"rear"`` joint strategy) and
    SD3.5's image-only ``attn2`` (as :func:`image_only_joint_attention`). 4-D inputs and the
    no-long-context-attention path take the stock processor.
    """

    def __init__(self, stock=None) -> None:
        from xfuser.model_executor.layers.attention_processor import xFuserJointAttnProcessor2_0

        self.stock = stock if stock is not None else xFuserJointAttnProcessor2_0()
        # Looked up here, not per call: a compiled transformer traces the call.
        self._padding_kwargs = compat.private(
            "xfuser.model_executor.layers.attention_processor", "_joint_sp_padding_attention_kwargs"
        )

    def _unsupported(self, hidden_states, encoder_hidden_states) -> str | None:
        if hidden_states.ndim != 3 or (encoder_hidden_states is not None and encoder_hidden_states.ndim != 3):
            return "4-D (image-shaped) attention inputs"
        if not self.stock.use_long_ctx_attn_kvcache:
            return "SD3 attention without long-context attention"
        return None

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, *args, **kwargs):
        if ulysses.fallback_reason(
            self, lambda: self._unsupported(hidden_states, encoder_hidden_states), (hidden_states, encoder_hidden_states)
        ) is not None:
            return self.stock(attn, hidden_states, encoder_hidden_states, attention_mask, *args, **kwargs)
        if encoder_hidden_states is None:
            return _image_only_v_first(self, attn, hidden_states)
        from xfuser.core.distributed import get_runtime_state

        split_text = get_runtime_state().split_text_embed_in_sp
        head_dim = attn.to_k.out_features // attn.heads
        value = _heads(attn, attn.to_v(hidden_states), head_dim)
        encoder_value = _heads(attn, attn.add_v_proj(encoder_hidden_states), head_dim)
        if split_text:
            value = torch.cat([value, encoder_value], dim=1)
        pending_v = ulysses.start_input_exchange(self, value.transpose(1, 2), label="sd3.joint.v")

        query = _heads(attn, attn.to_q(hidden_states), head_dim)
        key = _heads(attn, attn.to_k(hidden_states), head_dim)
        encoder_query = _heads(attn, attn.add_q_proj(encoder_hidden_states), head_dim)
        encoder_key = _heads(attn, attn.add_k_proj(encoder_hidden_states), head_dim)
        encoder_query, encoder_key = ulysses.norm_qk(attn, encoder_query, encoder_key, added=True)
        query, key = ulysses.norm_qk(attn, query, key)

        if split_text:
            attention_kwargs = self._padding_kwargs(query, encoder_query)
            query = torch.cat([query, encoder_query], dim=1)
            key = torch.cat([key, encoder_key], dim=1)
            out = ulysses.attention(query.transpose(1, 2), key.transpose(1, 2), pending_v, attention_kwargs=attention_kwargs)
        else:
            out = ulysses.attention(
                query.transpose(1, 2),
                key.transpose(1, 2),
                pending_v,
                joint_query=encoder_query.transpose(1, 2),
                joint_key=encoder_key.transpose(1, 2),
                joint_value=encoder_value.transpose(1, 2),
                joint_strategy="rear",
            )
        out = out.transpose(1, 2).reshape(hidden_states.shape[0], -1, attn.heads * head_dim).to(query.dtype)

        out, encoder_out = out[:, : hidden_states.shape[1]], out[:, hidden_states.shape[1] :]
        if not attn.context_pre_only:
            encoder_out = attn.to_add_out(encoder_out)
        return attn.to_out[1](attn.to_out[0](out)), encoder_out


def _image_only_v_first(processor: ulysses.VFirst, attn, hidden_states: torch.Tensor) -> torch.Tensor:
    """:func:`image_only_joint_attention` (SD3.5's ``attn2``), V-First (with ``processor``'s exchanger and V-Major layer)."""
    batch = hidden_states.shape[0]
    head_dim = attn.to_k.out_features // attn.heads
    value = attn.to_v(hidden_states).view(batch, -1, attn.heads, head_dim)
    pending_v = ulysses.start_input_exchange(processor, value.transpose(1, 2), label="sd3.image.v")
    query = attn.to_q(hidden_states).view(batch, -1, attn.heads, head_dim)
    key = attn.to_k(hidden_states).view(batch, -1, attn.heads, head_dim)
    query, key = ulysses.norm_qk(attn, query, key)
    out = ulysses.attention(query.transpose(1, 2), key.transpose(1, 2), pending_v)
    out = out.transpose(1, 2).reshape(batch, -1, attn.heads * head_dim).to(query.dtype)
    return attn.to_out[1](attn.to_out[0](out))
