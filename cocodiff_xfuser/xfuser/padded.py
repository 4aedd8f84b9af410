"""Any head and token count under cocodiff (:mod:`cocodiff_xfuser.padding`), wired in.

Heads: a model whose head count the Ulysses degree does not divide runs with cocodiff's
processors, which pad the exchanged heads (stock ``USP`` asserts divisibility). Tokens (FLUX):
the transformer wrapper pads the text and image streams to the degree and trims the image
afterwards, where xfuser 0.7.0 would keep the text whole on every rank (so each rank attends to
it once per rank) and attend to zero image padding.
"""

from __future__ import annotations

import logging
import types

import torch

from cocodiff_xfuser import compat, padding
from cocodiff_xfuser.xfuser import job

logger = logging.getLogger("cocodiff_xfuser")


def uneven_heads(transformers, world: int) -> str | None:
    """``"38 attention heads over ulysses degree 4"`` when the degree does not divide a model's heads."""
    for transformer in transformers:
        config = getattr(transformer, "config", None)
        heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_heads", None)
        if isinstance(heads, int) and world > 1 and heads % world:
            return f"{heads} attention heads over ulysses degree {world}"
    return None


def patch_runtime_state(rs: types.ModuleType) -> None:
    """xfuser refuses head counts the Ulysses degree does not divide before the model runs; with
    the exchanger started (it starts earlier, in ``_check_distributed_env``) they are padded."""
    cls = compat.target(rs, "DiTRuntimeState")

    def make(original):
        def _check_model_and_parallel_config(self, pipeline, parallel_config):
            if job.exchanger() is None:
                return original(self, pipeline, parallel_config)
            return None

        return _check_model_and_parallel_config

    compat.wrap(cls, "_check_model_and_parallel_config", make)
    compat.wrap(cls, "_calc_patches_metadata", _rounding_height)


def mark_padded_tokens(transformers) -> None:
    """After a model loads: a FLUX transformer wrapper pads its own tokens (below)."""
    from xfuser.core.distributed import get_runtime_state

    flux = "xFuserFlux1Transformer2DWrapper"  # by name: importing FLUX's module for every model costs a load
    get_runtime_state()._cocodiff_pads_tokens = any(flux in {c.__name__ for c in type(t).__mro__} for t in transformers)


def _rounding_height(original):
    """xfuser computes PipeFusion's patch metadata on every input size and refuses latent heights the
    SP degree does not divide. Without PipeFusion, a model that pads its own tokens reads none of
    it: it is computed for the height rounded up, so that xfuser's check passes."""

    def _calc_patches_metadata(self):
        if not getattr(self, "_cocodiff_pads_tokens", False) or job.exchanger() is None or self.parallel_config.pp_degree > 1:
            return original(self)
        from xfuser.core.distributed import get_sequence_parallel_world_size

        height = self.input_config.height
        step = self.vae_scale_factor * self.backbone_patch_size * get_sequence_parallel_world_size()
        self.input_config.height = -(-height // step) * step
        try:
            return original(self)
        finally:
            self.input_config.height = height

    return _calc_patches_metadata


def patch_transformer_flux(module: types.ModuleType) -> None:
    cls = compat.target(module, "xFuserFlux1Transformer2DWrapper")
    compat.switch(cls, "forward", _padding_forward, compat.When.COCODIFF)


def _padding_forward(original):
    def forward(self, hidden_states, encoder_hidden_states=None, *args, img_ids=None, txt_ids=None, **kwargs):
        exchanger = job.exchanger()
        layout = None
        if exchanger is not None and encoder_hidden_states is not None:
            from xfuser.core.distributed import get_ring_parallel_world_size, get_sequence_parallel_world_size

            # Ring attention passes K/V blocks between ranks: padded keys cannot be dropped there, so
            # with ring degree > 1 xfuser's own layout runs (and refuses uneven image tokens).
            if get_ring_parallel_world_size() == 1:
                layout = padding.streams((encoder_hidden_states.shape[1], hidden_states.shape[1]), get_sequence_parallel_world_size())
        if layout is None:
            return original(self, hidden_states, encoder_hidden_states, *args, img_ids=img_ids, txt_ids=txt_ids, **kwargs)
        if self.__dict__.get("_cocodiff_padding") is not exchanger:
            _first_use(self, exchanger, layout)
        (text, text_to), (image, image_to) = layout.lengths
        encoder_hidden_states = padding.pad_tokens(encoder_hidden_states, text_to, 1)
        hidden_states = padding.pad_tokens(hidden_states, image_to, 1)
        if txt_ids is not None:
            txt_ids = padding.pad_tokens(txt_ids, text_to, txt_ids.ndim - 2)
        if img_ids is not None:
            img_ids = padding.pad_tokens(img_ids, image_to, img_ids.ndim - 2)
        with exchanger.padding.tokens(layout):
            output = original(self, hidden_states, encoder_hidden_states, *args, img_ids=img_ids, txt_ids=txt_ids, **kwargs)
        if isinstance(output, tuple):
            return (output[0][:, :image], *output[1:])
        return output.__class__(output[0][:, :image], *output[1:])

    return forward


@torch.compiler.disable  # host work and a collective, once per transformer: never traced
def _first_use(transformer, exchanger, layout: padding.Streams) -> None:
    """A transformer's first forward with padded tokens in this job (``exchanger``'s): said (once:
    what traced code reads of the host's state is guarded, and a set of the sizes seen would trace
    every size again as it grew), and the transformer given cocodiff's processors, which padding
    needs (V-First may be off), with this job's exchanger (a transformer reused by a later job gets
    the later one's)."""
    from cocodiff_xfuser.processors import families

    (text, text_to), (image, image_to) = layout.lengths
    logger.info("cocodiff: %d text and %d image tokens padded to %d and %d for ulysses degree %d (other sizes "
                "likewise, where the degree does not divide them)", text, image, text_to, image_to, layout.world)
    families.install(transformer, exchanger)
    # Agreed as where xfuser's model loading installs them (every rank's first padded call is here).
    families.agree_fused_kernels()
    transformer._cocodiff_padding = exchanger
