"""Wan 2.x self-attention, V-First (cross-attention has no Ulysses exchange: stock processor)."""

from __future__ import annotations

import torch

from cocodiff_xfuser import compat
from cocodiff_xfuser.processors import ulysses


def _rope(hidden_states: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """The RoPE of ``xFuserWanAttnProcessor._qk_norm_rope_reference``, op for op."""
    x1, x2 = hidden_states.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(hidden_states)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(hidden_states)


class WanVFirstProcessor(ulysses.VFirst):
    """``xFuserWanAttnProcessor`` self-attention with V projected and exchanged before Q/K norm and RoPE.

    A fused ``to_qkv`` is sliced at call time. Cross-attention (no sequence parallelism) is
    not accepted: it keeps the stock processor. Delegated to the stock processor: the I2V
    image context, the fused FlyDSL QK-norm/RoPE kernel and attention kwargs that add
    per-head inputs to the exchange.
    """

    def __init__(self, stock=None) -> None:
        from xfuser.model_executor.models.transformers.transformer_wan import xFuserWanAttnProcessor

        self.stock = stock if stock is not None else xFuserWanAttnProcessor()

    @staticmethod
    def accepts(stock) -> bool:
        """Self-attention only: cross-attention has no Ulysses exchange and keeps the stock processor."""
        from xfuser.model_executor.models.transformers import transformer_wan

        return not stock.is_cross_attention and stock.attention_function is transformer_wan.USP

    def _unsupported(self, attn, rotary_emb) -> str | None:
        if attn.add_k_proj is not None:
            return "Wan image-to-video image context"
        if rotary_emb is not None and compat.fused_qk_kernel_reason("wan"):
            return compat.fused_qk_kernel_reason("wan")
        return ulysses.attention_kwargs_reason(self.stock.attention_kwargs)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        stock = self.stock
        if (
            not self.accepts(stock)
            or encoder_hidden_states is not None
            or ulysses.fallback_reason(self, lambda: self._unsupported(attn, rotary_emb), (hidden_states,)) is not None
        ):
            return stock(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)

        activation_dtype = hidden_states.dtype
        value = ulysses.project(attn, hidden_states, "v").unflatten(2, (attn.heads, -1))
        pending_v = ulysses.start_input_exchange(self, value.transpose(1, 2), label="wan.self.v")

        query = attn.norm_q(ulysses.project(attn, hidden_states, "q"))
        key = attn.norm_k(ulysses.project(attn, hidden_states, "k"))
        query = query.unflatten(2, (attn.heads, -1))
        key = key.unflatten(2, (attn.heads, -1))
        if rotary_emb is not None:
            query = _rope(query, *rotary_emb)
            key = _rope(key, *rotary_emb)

        out = ulysses.attention(
            query.transpose(1, 2), key.transpose(1, 2), pending_v, attention_kwargs=stock.attention_kwargs
        ).transpose(1, 2)
        out = out.flatten(2, 3).to(activation_dtype)
        return attn.to_out[1](attn.to_out[0](out))
