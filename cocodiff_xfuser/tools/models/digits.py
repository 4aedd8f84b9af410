"""``cocodiff/digits-flux`` and ``cocodiff/digits-sd3``: small FLUX- and SD3-architecture
transformers trained on scikit-learn's digits.

A model that has learned something, so that lossy mechanisms can be judged (random weights
understate the error of reusing a step's tensors). It is trained by ``scripts/train_tiny.py``
and shipped as a fixture (``fixtures/digits-flux``); xfuser's runner loads it like the tiny
models (``xdit --model cocodiff/digits-flux --prompt "digit 7"``).

- **Data**: the 1,797 8x8 digits of ``sklearn.datasets.load_digits``, intensity 0..16 scaled
  to [0, 1] (white strokes on black), upsampled bicubically to 64x64 gray images.
- **Conditioning**: the prompt embeddings of ``"digit 0"`` ... ``"digit 9"`` from the
  project's deterministic stand-in text encoder (:func:`tiny.prompt_embeddings`), so the
  prompt selects the class with no text model. Other prompts give no particular digit.
- **Autoencoder**: :class:`~.pixel_shuffle.PixelShuffleAutoencoder`, an exact pixel
  (un)shuffle: the 2x2 pixels of the gray image become 4 latent channels at 32x32
  (FluxPipeline packs them again into 256 image tokens of 16 channels). Nothing is learned or lost there, so the decoded
  images are exactly what the transformer generated.
- **Transformer**: ``FluxTransformer2DModel``, 2 double and 4 single blocks, 8 heads of 16,
  no guidance embedding (FLUX-schnell style), trained with rectified flow as FLUX uses it.

``digits-sd3`` is the other family on the same data, conditioning and autoencoder: an
``SD3Transformer2DModel`` (MMDiT: joint attention of text and image in every block, SD3.5's
image-only second attention in the first, RMS QK-norm), 2x2 patches over the 32x32 latents (256
image tokens), trained with the prompt dropped one time in ten so that it samples with true
classifier-free guidance (``SD3_GUIDANCE``; the pipeline batches the two branches).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

NAME = "digits-flux"
CHECKPOINT = Path(__file__).parent / "fixtures" / NAME
SIZE = 64  # image height and width: 32x32 latents, 256 image tokens
STEPS = 16  # the sampling step count the model was validated at (scripts/train_tiny.py)
HEADS = 8
TEXT_LEN = 16
TEXT_DIM = 32
POOLED_DIM = 32
SHIFT = 3.0  # FlowMatchEulerDiscreteScheduler(shift=...); training samples noise levels alike
CLASSES = tuple(f"digit {d}" for d in range(10))

SD3_NAME = "digits-sd3"
SD3_CHECKPOINT = Path(__file__).parent / "fixtures" / SD3_NAME
SD3_GUIDANCE = 3.0  # classifier-free guidance scale the model was validated at
UNCONDITIONAL = ""  # the prompt of the dropped condition (the pipelines' default negative prompt)
TRAINED = (NAME, SD3_NAME)  # the models the classifier can judge


def transformer_config() -> dict:
    return {
        "patch_size": 1,
        "in_channels": 16,  # 4 latent channels, packed 2x2 by FluxPipeline
        "num_layers": 2,
        "num_single_layers": 4,
        "attention_head_dim": 16,
        "num_attention_heads": HEADS,
        "joint_attention_dim": TEXT_DIM,
        "pooled_projection_dim": POOLED_DIM,
        "guidance_embeds": False,
        "axes_dims_rope": (4, 6, 6),
    }


def sd3_transformer_config() -> dict:
    return {
        "sample_size": SIZE // 2,  # 32x32 latents
        "patch_size": 2,
        "in_channels": 4,
        "out_channels": 4,
        "num_layers": 4,
        "attention_head_dim": 16,
        "num_attention_heads": HEADS,
        "joint_attention_dim": TEXT_DIM,
        "caption_projection_dim": 128,
        "pooled_projection_dim": POOLED_DIM,
        "pos_embed_max_size": SIZE // 4,
        "dual_attention_layers": (0,),
        "qk_norm": "rms_norm",
    }


def load_images() -> tuple[np.ndarray, np.ndarray]:
    """The digits as (N, SIZE, SIZE) float32 gray images in [0, 1], and their labels."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    small = torch.from_numpy(digits.images / 16.0).float()[:, None]
    images = F.interpolate(small, size=(SIZE, SIZE), mode="bicubic", align_corners=False).clamp(0, 1)
    return images[:, 0].numpy(), digits.target.astype(np.int64)


def _features(gray: np.ndarray) -> np.ndarray:
    """8x8 block means of (N, SIZE, SIZE) gray images: the resolution the digits were drawn at."""
    n, h, w = gray.shape
    return gray.reshape(n, 8, h // 8, 8, w // 8).mean(axis=(2, 4)).reshape(n, 64)


class Classifier:
    """An SVM fitted on the real digits (as the model sees them), to label generated images."""

    def __init__(self, seed: int = 0):
        from sklearn.model_selection import train_test_split
        from sklearn.svm import SVC

        images, labels = load_images()
        x_train, x_test, y_train, y_test = train_test_split(
            _features(images), labels, test_size=0.25, random_state=seed, stratify=labels
        )
        self.model = SVC(gamma="scale").fit(x_train, y_train)
        self.held_out_accuracy = float(self.model.score(x_test, y_test))

    def predict(self, images: np.ndarray) -> np.ndarray:
        """Labels of (N, SIZE, SIZE, 3) RGB or (N, SIZE, SIZE) gray images in [0, 1]."""
        gray = images.mean(axis=-1) if images.ndim == 4 else images
        if gray.shape[1:] != (SIZE, SIZE):
            raise ValueError(f"the classifier labels {SIZE}x{SIZE} images, got {gray.shape[1:]}")
        return self.model.predict(_features(gray.astype(np.float64)))


def label(prompt: str) -> int | None:
    """The class a prompt asks for, or None for prompts the model was not trained on."""
    return CLASSES.index(prompt) if prompt in CLASSES else None
