"""Qwen-Image attention (double-stream blocks), V-First."""

from __future__ import annotations

import torch

from cocodiff_xfuser import compat
from cocodiff_xfuser.processors import ulysses


class QwenImageVFirstProcessor(ulysses.VFirst):
    """``xFuserQwenDoubleStreamAttnProcessor`` with V projected and exchanged before Q/K work.

    Like the stock processor, the masks are not used (text is never padded in the joint sequence).
    """

    def __init__(self, stock=None) -> None:
        from xfuser.model_executor.models.transformers.transformer_qwen import xFuserQwenDoubleStreamAttnProcessor

        self.stock = stock if stock is not None else xFuserQwenDoubleStreamAttnProcessor()

    def __call__(
        self,
        attn,
        hidden_states,
        encoder_hidden_states=None,
        encoder_hidden_states_mask=None,
        attention_mask=None,
        image_rotary_emb=None,
    ):
        if ulysses.fallback_reason(self, lambda: compat.fused_qk_kernel_reason("qwen"), (hidden_states, encoder_hidden_states)) is not None:
            return self.stock(attn, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, attention_mask, image_rotary_emb)
        from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

        heads = attn.heads
        seq_txt = encoder_hidden_states.shape[1]
        img_value = attn.to_v(hidden_states).unflatten(-1, (heads, -1))
        txt_value = attn.add_v_proj(encoder_hidden_states).unflatten(-1, (heads, -1))
        joint_value = torch.cat([txt_value, img_value], dim=1)
        pending_v = ulysses.start_input_exchange(self, joint_value.transpose(1, 2), label="qwen_image.double.v")

        img_query = attn.to_q(hidden_states).unflatten(-1, (heads, -1))
        img_key = attn.to_k(hidden_states).unflatten(-1, (heads, -1))
        txt_query = attn.add_q_proj(encoder_hidden_states).unflatten(-1, (heads, -1))
        txt_key = attn.add_k_proj(encoder_hidden_states).unflatten(-1, (heads, -1))
        img_query, img_key = ulysses.norm_qk(attn, img_query, img_key)
        txt_query, txt_key = ulysses.norm_qk(attn, txt_query, txt_key, added=True)
        if image_rotary_emb is not None:
            img_freqs, txt_freqs = image_rotary_emb
            img_query = apply_rotary_emb_qwen(img_query, img_freqs, use_real=False)
            img_key = apply_rotary_emb_qwen(img_key, img_freqs, use_real=False)
            txt_query = apply_rotary_emb_qwen(txt_query, txt_freqs, use_real=False)
            txt_key = apply_rotary_emb_qwen(txt_key, txt_freqs, use_real=False)
        joint_query = torch.cat([txt_query, img_query], dim=1)
        joint_key = torch.cat([txt_key, img_key], dim=1)

        out = ulysses.attention(joint_query.transpose(1, 2), joint_key.transpose(1, 2), pending_v).transpose(1, 2)
        out = out.flatten(2, 3).to(joint_query.dtype)
        txt_out, img_out = out[:, :seq_txt, :], out[:, seq_txt:, :]
        img_out = attn.to_out[0](img_out.contiguous())
        if len(attn.to_out) > 1:
            img_out = attn.to_out[1](img_out)
        return img_out, attn.to_add_out(txt_out.contiguous())
