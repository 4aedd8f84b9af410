"""Whole tiny pipelines for xDiT's shipped example scripts, built offline.

The examples load everything from ``--model``: text encoders (``T5EncoderModel``, and CLIP for
FLUX), tokenizers, the transformer, the VAE and the scheduler, as a hub checkpoint would hold them.
Each is built here from a small config with seeded random weights; the tokenizers are word-level
vocabularies built in code (no sentencepiece or BPE files to fetch); the VAE and the saving
(transformer weights rounded to bf16 values) are the tiny models' own.
"""

from __future__ import annotations

from pathlib import Path

import torch

from cocodiff_xfuser.tools.models import tiny

#: Every word a test prompt uses, plus the specials; others map to ``<unk>``.
WORDS = "a an the of in on with and cat dog photo painting astronaut riding horse city at night red blue".split()
SPECIALS = ["<pad>", "</s>", "<unk>", "<|startoftext|>", "<|endoftext|>"]
TEXT_DIM = 32
#: Where the FLUX control example reads its control image from, relative to its working directory.
CONTROL_IMAGE = Path("test_imgs") / "016#.png"


def tokenizer(max_length: int):
    """A word-level fast tokenizer over :data:`WORDS` that pads to ``max_length`` with id 0."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   bos_token="<|startoftext|>", model_max_length=max_length)


def t5():
    from transformers import T5Config, T5EncoderModel

    config = T5Config(vocab_size=len(SPECIALS) + len(WORDS), d_model=TEXT_DIM, d_kv=8, d_ff=64, num_layers=1,
                      num_heads=4, relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1)
    return T5EncoderModel(config)


def clip():
    from transformers import CLIPTextConfig, CLIPTextModel

    config = CLIPTextConfig(vocab_size=len(SPECIALS) + len(WORDS), hidden_size=TEXT_DIM, intermediate_size=64,
                            num_hidden_layers=1, num_attention_heads=4, max_position_embeddings=77,
                            projection_dim=TEXT_DIM, pad_token_id=0, bos_token_id=3, eos_token_id=1)
    return CLIPTextModel(config)


def _pixart(pipeline: str):
    import diffusers
    from diffusers import DPMSolverMultistepScheduler, PixArtTransformer2DModel

    transformer = PixArtTransformer2DModel(
        num_attention_heads=8, attention_head_dim=16, in_channels=4, out_channels=8, num_layers=2,
        cross_attention_dim=128, sample_size=32, patch_size=2, caption_channels=TEXT_DIM, interpolation_scale=1)
    return getattr(diffusers, pipeline)(tokenizer=tokenizer(300), text_encoder=t5(), vae=tiny.small_vae(4), transformer=transformer,
                                        scheduler=DPMSolverMultistepScheduler())


def _flux_control():
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxControlPipeline, FluxTransformer2DModel

    # FLUX control: the transformer reads the packed latents and the packed control latents.
    transformer = FluxTransformer2DModel(patch_size=1, in_channels=32, out_channels=16, num_layers=2, num_single_layers=2,
                                         attention_head_dim=16, num_attention_heads=8, joint_attention_dim=TEXT_DIM,
                                         pooled_projection_dim=TEXT_DIM, guidance_embeds=True, axes_dims_rope=(4, 6, 6))
    return FluxControlPipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=False),
                               vae=tiny.small_vae(4), text_encoder=clip(), tokenizer=tokenizer(77), text_encoder_2=t5(),
                               tokenizer_2=tokenizer(512), transformer=transformer)


#: example script -> (the pipeline it loads, its builder)
BUILDERS = {
    "pixartalpha_example.py": lambda: _pixart("PixArtAlphaPipeline"),
    "pixartsigma_example.py": lambda: _pixart("PixArtSigmaPipeline"),
    "flux_control_example.py": _flux_control,
}


def ensure(example: str, cache: Path) -> Path:
    """The example's checkpoint directory under ``cache``, built and saved once (atomic rename)."""
    path = cache / f"xdit-example-{Path(example).stem}-v1"
    if (path / "model_index.json").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    tiny.save_bf16_exact(BUILDERS[example](), path)
    return path


def control_image(workdir: Path) -> None:
    """The control image the FLUX control example reads from its working directory."""
    from PIL import Image

    gen = torch.Generator().manual_seed(0)
    pixels = (torch.rand(64, 64, 3, generator=gen) * 255).to(torch.uint8).numpy()
    (workdir / CONTROL_IMAGE).parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(workdir / CONTROL_IMAGE)
