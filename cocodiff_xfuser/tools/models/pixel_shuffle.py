"""An exact autoencoder for FLUX-style pipelines on gray images (``cocodiff/digits-flux``).

Its own module so that loading it needs diffusers but listing the models does not: the
checkpoint's ``model_index.json`` names this module, which diffusers resolves from
``sys.modules`` (import it before ``from_pretrained``).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin


class PixelShuffleAutoencoder(ModelMixin, ConfigMixin):
    """An exact autoencoder for gray images: latents are the image's 2x2 pixel blocks as channels.

    ``encode`` takes (B, 1 or 3, H, W) images in [-1, 1] (3 equal channels) and returns
    (B, 4, H/2, W/2) latents; ``decode`` inverts it and repeats the gray channel as RGB.
    ``block_out_channels`` only declares the spatial factor 2 the way diffusers pipelines read
    it (``2 ** (len(block_out_channels) - 1)``); ``scaling_factor`` and ``shift_factor``
    normalize the latents, as in FLUX's VAE, and are set from the training data.
    Text-to-image only: image-to-image pipelines expect a ``latent_dist``.
    """

    @register_to_config
    def __init__(
        self,
        latent_channels: int = 4,
        block_out_channels: tuple[int, ...] = (1, 1),
        scaling_factor: float = 1.0,
        shift_factor: float = 0.0,
    ):
        super().__init__()
        if latent_channels != 4 or len(block_out_channels) != 2:
            raise ValueError("PixelShuffleAutoencoder is a 2x2 pixel (un)shuffle: 4 latent channels, scale factor 2")
        # Pipelines read a component's device and dtype from its tensors, and diffusers' loader
        # wants a weights file: one saved scalar serves both (the transform has no weights).
        self.register_buffer("anchor", torch.zeros(()))

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        return F.pixel_unshuffle(images[:, :1], 2)  # gray: the channels are equal

    def decode(self, latents: torch.Tensor, return_dict: bool = True):
        from diffusers.models.autoencoders.vae import DecoderOutput

        sample = F.pixel_shuffle(latents, 2).repeat(1, 3, 1, 1)
        return DecoderOutput(sample=sample) if return_dict else (sample,)


class _KnownSubstitute(logging.Filter):
    """diffusers warns when a pipeline gets a VAE that is not an ``AutoencoderKL``; this one is meant."""

    def filter(self, record: logging.LogRecord) -> bool:
        return PixelShuffleAutoencoder.__name__ not in record.getMessage()


logging.getLogger("diffusers.pipelines.pipeline_utils").addFilter(_KnownSubstitute())
