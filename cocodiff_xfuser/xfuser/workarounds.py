"""Workarounds of xfuser 0.7.0 bugs: while cocodiff runs the job's exchanges, and on hosts without CUDA.

On a CUDA host without the flag (or after a logged fall-back to stock) the stock code runs unchanged (and fails as it would without
this package). On XPU and CPU hosts, where stock xfuser cannot run at all without the platform
enablement (:mod:`.devices`), they are part of that enablement, so that stock Ulysses there is the
reference cocodiff is compared with.
"""

from __future__ import annotations

import importlib.metadata
import types

from cocodiff_xfuser import compat
from cocodiff_xfuser.platform import detect
from cocodiff_xfuser.xfuser import flags, job


def _on() -> bool:
    return job.exchanger() is not None or not detect().is_cuda


def patch_transformer_flux(module: types.ModuleType) -> None:
    """xfuser 0.7.0 calls ``self._pad_to_sp_divisible`` (an AttributeError: the method is
    ``pad_to_sp_divisible``) when image tokens % SP != 0. Calling the real method is no fix:
    the zero padding is attended and the image changes, so say so clearly instead."""
    cls = compat.target(module, "xFuserFlux1Transformer2DWrapper")
    compat.target(cls, "pad_to_sp_divisible")
    if getattr(cls, "_pad_to_sp_divisible", None) is not None:
        return

    def _pad_to_sp_divisible(self, tensor, padding_length: int, dim: int):
        if not _on():  # stock: the misspelled method does not exist
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '_pad_to_sp_divisible'")
        from xfuser.core.distributed import get_sequence_parallel_world_size

        # Under cocodiff this is only reached under ring attention (padded.py pads otherwise).
        fix = "cocodiff pads them with ring degree 1 only" if job.exchanger() else "--sp-backend cocodiff pads them exactly"
        raise ValueError(
            f"FLUX under sequence parallelism: {tensor.shape[dim]} image tokens are not divisible by the SP degree "
            f"{get_sequence_parallel_world_size()}; xfuser 0.7.0 would attend to its zero padding and change the "
            f"image. Choose a resolution whose image token count is divisible by the SP degree ({fix})."
        )

    cls._pad_to_sp_divisible = _pad_to_sp_divisible


def patch_attention_processor(module: types.ModuleType) -> None:
    """SD3.5's ``attn2`` (no text stream) hits ``UnboundLocalError: joint_strategy`` under SP."""
    cls = compat.target(module, "xFuserJointAttnProcessor2_0")

    def make(original):
        def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, *args, **kwargs):
            if encoder_hidden_states is None and _on():
                from cocodiff_xfuser.processors.sd3 import image_only_joint_attention

                return image_only_joint_attention(attn, hidden_states)
            return original(self, attn, hidden_states, encoder_hidden_states, attention_mask, *args, **kwargs)

        return __call__

    compat.switch(cls, "__call__", make, compat.When.ENABLEMENT)


def patch_transformer_qwen(module: types.ModuleType) -> None:
    """xfuser 0.7.0 pads Qwen-Image sequences to the SP degree but its attention ignores the mask,
    so the padding is attended and the image silently changes: refuse those lengths instead."""
    cls = compat.target(module, "xFuserQwenImageTransformerWrapper")

    def make(original):
        def forward(self, hidden_states, encoder_hidden_states=None, *args, **kwargs):
            if _on():
                _refuse_padding(hidden_states, encoder_hidden_states)
            return original(self, hidden_states, encoder_hidden_states, *args, **kwargs)

        return forward

    compat.switch(cls, "forward", make, compat.When.ENABLEMENT)


def _refuse_padding(hidden_states, encoder_hidden_states) -> None:
    from xfuser.core.distributed import get_sequence_parallel_world_size

    sp = get_sequence_parallel_world_size()
    for stream, tensor in (("image", hidden_states), ("text", encoder_hidden_states)):
        if sp > 1 and tensor is not None and tensor.shape[1] % sp:
            raise ValueError(
                f"Qwen-Image under sequence parallelism: {tensor.shape[1]} {stream} tokens are not divisible "
                f"by the SP degree {sp}; xfuser 0.7.0 would attend to its zero padding and change the image. "
                f"Choose a resolution / max_sequence_length divisible by {sp}."
            )


def supply_update_npu_out(module: types.ModuleType) -> None:
    """xfuser 0.7.0's NPU ring attention imports ``yunchang.ring.utils.update_npu_out``, which no
    yunchang release has (0.6.4, the latest, lacks it), and ``xFuserLongContextAttention`` imports
    that module on construction: Sana's linear attention and StepVideo could not run on any device.
    Where yunchang lacks it, a stand-in that refuses in one line: the NPU ring is its only caller.

    Before the module's body runs; decided at import, before cocodiff starts, so by the flag.
    """
    if detect().is_cuda and not flags.cocodiff_requested():
        return
    import yunchang.ring.utils as utils

    if hasattr(utils, "update_npu_out"):
        return

    def update_npu_out(*args, **kwargs):
        raise NotImplementedError(
            f"xfuser {compat.xfuser_version()}'s ring attention on NPU needs yunchang's update_npu_out, which "
            f"yunchang {importlib.metadata.version('yunchang')} lacks; install a yunchang that has it"
        )

    utils.update_npu_out = update_npu_out
