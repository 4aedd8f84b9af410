"""The DiT models the planner prices: what their attention layers exchange and compute.

A model is its attention layers per forward (and whether text tokens join them), its heads, the
pixels one token stands for and, for video, the frames one latent frame stands for; each from the
model's own transformer config (``source``). The planner (:mod:`.plan`, :mod:`.gpu_model`) reads
nothing else of a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple


@dataclass(frozen=True)
class ModelSpec:
    name: str
    heads: int
    head_dim: int
    attn: Tuple[Tuple[int, bool], ...]  # (attention calls per forward, text tokens joint?)
    text_tokens: int
    pixels_per_token: int  # image side per token side (VAE factor x patch)
    dtype_bytes: int = 2
    cfg: bool = False  # true classifier-free guidance (two transformer passes, batch 2)
    stacked_qkv: bool = True  # xfuser's processor sends Q/K/V as one message (FLUX) or three
    frames_per_token: int = 0  # video: frames per latent frame (0 = image model)
    flux: bool = False  # FLUX family: uneven text/image tokens only without ring (cocodiff pads them)
    vae: str = ""  # its VAE (what decodes the image once per run), where models share one
    pipefusion: bool = False  # xfuser 0.7.0's runner takes --pipefusion_parallel_degree for it (tiny: ours)
    source: str = ""

    @property
    def layers(self) -> int:
        return sum(n for n, _ in self.attn)

    def tokens(self, size: int, frames: int = 1, height: Optional[int] = None) -> Tuple[int, int]:
        """(image/video tokens, text tokens in joint attention) of a ``size`` wide (and ``height``
        high; square by default) image or video of ``frames`` frames."""
        side = size // self.pixels_per_token
        rows = side if height is None else height // self.pixels_per_token
        t = (frames - 1) // self.frames_per_token + 1 if self.frames_per_token else 1
        return side * rows * t, self.text_tokens


def layer_flops(spec: ModelSpec, s: float, s_local: float, head_pad: float = 1.0) -> float:
    """FLOPs of one DiT block per rank: QKV + out + 4x MLP projections on the local tokens (24 D^2
    per token), attention over the whole sequence (4 s D per local token, times ``head_pad``:
    padded zero heads are attended too, the projections are not padded)."""
    D = spec.heads * spec.head_dim
    return s_local * (24 * D * D + 4 * s * D * head_pad)


def forward_flops(spec: ModelSpec, img: float, txt: float, ranks: float, head_pad: float = 1.0) -> float:
    """FLOPs of one transformer forward of one batch element per rank: every attention layer over
    its sequence (the text joins where the layer is joint), its tokens split over ``ranks``."""
    return sum(n * layer_flops(spec, img + (txt if joint else 0), (img + (txt if joint else 0)) / ranks, head_pad)
               for n, joint in spec.attn)


_DIFFUSERS = "diffusers 0.42.1's defaults for"
MODELS: Dict[str, ModelSpec] = {m.name: m for m in (
    ModelSpec("flux-dev", 24, 128, ((57, True),), 512, 16, flux=True, vae="flux", pipefusion=True, source=(
        "black-forest-labs/FLUX.1-dev transformer/config.json: num_layers 19 + num_single_layers 38, "
        "24 heads x 128; VAE /8, patch 2; max_sequence_length 512; guidance-distilled (no true CFG)")),
    ModelSpec("flux-schnell", 24, 128, ((57, True),), 256, 16, flux=True, vae="flux", source=(
        "black-forest-labs/FLUX.1-schnell: FLUX.1-dev's transformer (19 + 38 blocks, 24 heads x 128); "
        "max_sequence_length 256; timestep-distilled (no CFG)")),
    ModelSpec("flux2-dev", 48, 128, ((56, True),), 512, 16, flux=True, vae="flux2", pipefusion=True, source=(
        f"{_DIFFUSERS} Flux2Transformer2DModel: num_layers 8 + num_single_layers 48, 48 heads x 128, "
        "patch 1 on the 32-channel VAE /8 latent packed 2x2; 512 text tokens assumed; guidance-distilled")),
    ModelSpec("sd3.5-large", 38, 64, ((38, True),), 333, 16, cfg=True, stacked_qkv=False, vae="sd3", pipefusion=True, source=(
        "stabilityai/stable-diffusion-3.5-large transformer/config.json: num_layers 38, 38 heads x 64, "
        "patch 2, VAE /8; 77 CLIP + 256 T5 text tokens")),
    ModelSpec("qwen-image", 24, 128, ((60, True),), 256, 16, cfg=True, vae="qwen-image", source=(
        "Qwen/Qwen-Image transformer/config.json: num_layers 60, 24 heads x 128, patch 2, VAE /8; "
        "text tokens depend on the prompt: 256 assumed")),
    ModelSpec("wan2.1-14b", 40, 128, ((40, False),), 0, 16, cfg=True, frames_per_token=4, vae="wan2.1", source=(
        "Wan-AI/Wan2.1-T2V-14B-Diffusers transformer/config.json: num_layers 40, 40 heads x 128, patch "
        "(1,2,2), VAE /8 spatial /4 temporal; text enters by cross-attention (not exchanged)")),
    ModelSpec("wan2.2-a14b", 40, 128, ((40, False),), 0, 16, cfg=True, frames_per_token=4, vae="wan2.1", source=(
        f"{_DIFFUSERS} WanTransformer3DModel (Wan2.2-T2V-A14B's two experts, one per denoising phase, "
        "each Wan 2.1 14B's shape): 40 layers, 40 heads x 128, patch (1,2,2), VAE /8 spatial /4 temporal")),
    ModelSpec("hunyuan-video", 24, 128, ((60, True),), 256, 16, frames_per_token=4, vae="hunyuan-video", source=(
        f"{_DIFFUSERS} HunyuanVideoTransformer3DModel: num_layers 20 + num_single_layers 40, 24 heads "
        "x 128, patch 2 (1 in time), VAE /8 spatial /4 temporal; max_sequence_length 256; "
        "guidance-distilled (no true CFG)")),
    ModelSpec("cogvideox-5b", 48, 64, ((42, True),), 226, 16, cfg=True, stacked_qkv=False, frames_per_token=4, vae="cogvideox",
              source=("THUDM/CogVideoX-5b transformer/config.json: num_layers 42, 48 heads x 64 (diffusers' "
                      "defaults are the 2B's: 30 x 30 x 64), patch 2, VAE /8 spatial /4 temporal, 226 text "
                      "tokens; ConsisID is this transformer")),
    ModelSpec("cogvideox-2b", 30, 64, ((30, True),), 226, 16, cfg=True, stacked_qkv=False, frames_per_token=4,
              vae="cogvideox",
              source=f"{_DIFFUSERS} CogVideoXTransformer3DModel: 30 layers, 30 heads x 64, patch 2, 226 text tokens"),
    # The project's tiny models (tools/models/tiny.py, digits.py): fp32, 4 pixels per token side.
    ModelSpec("tiny-flux", 8, 16, ((4, True),), 32, 4, 4, flux=True, pipefusion=True,
              source="tools/models/tiny.py: 2 double + 2 single"),
    ModelSpec("tiny-sd3", 8, 16, ((2, False), (3, True)), 32, 4, 4, cfg=True, stacked_qkv=False,
              source="tools/models/tiny.py: 3 joint blocks, 2 with a second image-only attention"),
    ModelSpec("digits-flux", 8, 16, ((6, True),), 16, 4, 4, flux=True, pipefusion=True,
              source="tools/models/digits.py: 2 double + 4 single"),
    ModelSpec("digits-sd3", 8, 16, ((1, False), (4, True)), 16, 4, 4, cfg=True, stacked_qkv=False,
              source="tools/models/digits.py: 4 joint blocks, the first with a second image-only attention"),
)}
