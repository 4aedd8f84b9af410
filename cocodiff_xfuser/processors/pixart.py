"""PixArt self-attention (``xFuserAttnProcessor2_0``), V-First.

Only the self-attention ``attn1`` runs under sequence parallelism (xfuser wraps it); the
text cross-attention keeps diffusers' processor and is not touched. ``xFuserAttnProcessor2_0``
is xfuser's generic processor (Latte uses it too); the same ops are reproduced for any user.
"""

from __future__ import annotations

from cocodiff_xfuser.processors import ulysses


class PixArtVFirstProcessor(ulysses.VFirst):
    """``xFuserAttnProcessor2_0`` self-attention with V projected and exchanged before Q/K.

    Delegated to the stock processor: cross-attention, attention masks (which the stock
    Ulysses path ignores), spatial/group norms, 4-D inputs and xfuser's fast attention.
    """

    def __init__(self, stock=None) -> None:
        from xfuser.model_executor.layers.attention_processor import xFuserAttnProcessor2_0

        self.stock = stock if stock is not None else xFuserAttnProcessor2_0()

    def _unsupported(self, attn, hidden_states, encoder_hidden_states, attention_mask) -> str | None:
        from xfuser.core.fast_attention import get_fast_attn_enable

        if encoder_hidden_states is not None:
            return "cross-attention through xFuserAttnProcessor2_0"
        if attention_mask is not None:
            return "an attention mask"
        if get_fast_attn_enable():
            return "xfuser fast attention"
        if attn.spatial_norm is not None or attn.group_norm is not None or hidden_states.ndim != 3:
            return "spatial/group norm or 4-D attention inputs"
        if not self.stock.use_long_ctx_attn_kvcache:
            return "attention without long-context attention"
        return None

    def __call__(
        self,
        attn,
        hidden_states,
        encoder_hidden_states=None,
        attention_mask=None,
        temb=None,
        latte_temporal_attention=False,
        *args,
        **kwargs,
    ):
        reason = ulysses.fallback_reason(
            self,
            lambda: self._unsupported(attn, hidden_states, encoder_hidden_states, attention_mask),
            (hidden_states, encoder_hidden_states),
        )
        if reason is not None:
            return self.stock(
                attn, hidden_states, encoder_hidden_states, attention_mask, temb, latte_temporal_attention, *args, **kwargs
            )
        residual = hidden_states
        batch, heads = hidden_states.shape[0], attn.heads
        head_dim = attn.to_k.out_features // heads
        value = attn.to_v(hidden_states).view(batch, -1, heads, head_dim).transpose(1, 2)
        pending_v = ulysses.start_input_exchange(self, value, label="pixart.self.v")

        query = attn.to_q(hidden_states).view(batch, -1, heads, head_dim).transpose(1, 2)
        key = attn.to_k(hidden_states).view(batch, -1, heads, head_dim).transpose(1, 2)
        query, key = ulysses.norm_qk(attn, query, key)

        out = ulysses.attention(query, key, pending_v)
        out = out.transpose(1, 2).reshape(batch, -1, heads * head_dim).to(query.dtype)
        out = attn.to_out[1](attn.to_out[0](out))
        if attn.residual_connection:
            out = out + residual
        return out / attn.rescale_output_factor
