"""Small versions of real DiT families, registered in xfuser's model registry.

The ``tiny-*`` models have seeded random weights: each is built from a small diffusers config
(no hub access) and written with ``save_pretrained`` to a local fixture directory.
``digits-flux`` and ``digits-sd3`` are trained (:mod:`cocodiff_xfuser.tools.models.digits`) and
shipped as checkpoints. All are loaded through xfuser's own runner loading code, so
``xdit --model cocodiff/tiny-flux ...`` exercises the real path. There are no text encoders:
the prompt embeddings are a seeded function of the prompt (:func:`prompt_embeddings`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from cocodiff_xfuser.tools.models import digits

FIXTURE_VERSION = "2"  # 2: transformer weights rounded to bf16 values
DTYPE = torch.float32  # bitwise comparisons on CPU; bf16 matmuls are slow there


@dataclass(frozen=True)
class TinySpec:
    """One tiny model: how to build it, how to run its pipeline, which xfuser wrapper loads it."""

    name: str
    pipeline: str  # diffusers pipeline class
    # "module:Class" of the xfuser class that xfuser's own runner loads this family with: a
    # transformer wrapper (FLUX, Qwen-Image, Wan: ``loader.load_transformer``) or an
    # ``xFuser*Pipeline`` wrapper (SD3, PixArt: ``from_pretrained(..., engine_config=...)``).
    wrapper: str
    heads: int
    text_len: int
    text_dim: int
    build: Callable[[], dict] | None  # component name -> module or scheduler; None for a shipped checkpoint
    call_kwargs: Callable[["TinySpec", dict], dict]  # (spec, input args) -> text embeddings, guidance overrides
    pooled_dim: int | None = None
    height: int = 64
    width: int = 64
    steps: int = 4
    guidance_scale: float = 3.5
    frames: int | None = None  # video models: frames to generate, returned as the runner's images
    wrapper_kwargs: Callable[[object], dict] | None = None  # xFuserArgs -> transformer wrapper init kwargs
    runner_sets_input: bool = False  # the runner, not the pipeline, calls set_input_parameters (FLUX)
    checkpoint: Path | None = None  # a trained model shipped with the package (instead of ``build``)

    @property
    def model_id(self) -> str:
        return f"cocodiff/{self.name}"

    @property
    def cfg_parallel(self) -> bool:
        """Whether the pipeline batches two guidance halves that CFG parallel can split (the FLUX
        ones are guidance-distilled or unguided)."""
        return self.pipeline != "FluxPipeline"

    @property
    def pipefusion_absent(self) -> str | None:
        """Why stock PipeFusion does not run for this model here, or None: it runs, through xfuser's
        pipeline wrapper (FLUX's, as xfuser's FLUX runner loads FLUX for PipeFusion)."""
        if self.pipeline in ("FluxPipeline", "PixArtSigmaPipeline"):
            return None
        if self.pipeline == "StableDiffusion3Pipeline":
            return ("xfuser 0.7.0's SD3 pipeline wrapper stops in its first PipeFusion step (its K/V cache update "
                    "receives [b, s, h*d] keys for a [b, s, h, d] cache)")
        return "xfuser 0.7.0 has no PipeFusion pipeline for this model family"


def prompt_embeddings(
    prompt: str | list[str], length: int, dim: int, pooled_dim: int | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Deterministic stand-in for a text encoder: embeddings seeded by a hash of each prompt."""
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    embeds, pooled = [], []
    for text in prompts:
        gen = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little"))
        embeds.append(torch.randn(1, length, dim, generator=gen, dtype=DTYPE))
        if pooled_dim:
            pooled.append(torch.randn(1, pooled_dim, generator=gen, dtype=DTYPE))
    return torch.cat(embeds), torch.cat(pooled) if pooled_dim else None


def small_vae(latent_channels: int):
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(16, 32),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=8,
        sample_size=64,
        scaling_factor=1.0,
        shift_factor=0.0,
    )


def _flux() -> dict:
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

    return {
        "transformer": FluxTransformer2DModel(
            patch_size=1,
            in_channels=64,
            num_layers=2,
            num_single_layers=2,
            attention_head_dim=16,
            num_attention_heads=8,
            joint_attention_dim=32,
            pooled_projection_dim=32,
            guidance_embeds=True,
            axes_dims_rope=(4, 6, 6),
        ),
        "vae": small_vae(16),
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=False),
    }


def _sd3() -> dict:
    """SD3.5-medium layout: MMDiT blocks, the first with a second image-only attention, RMS QK-norm."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

    return {
        "transformer": SD3Transformer2DModel(
            sample_size=32,
            patch_size=2,
            in_channels=16,
            num_layers=3,
            attention_head_dim=16,
            num_attention_heads=8,
            joint_attention_dim=32,
            caption_projection_dim=128,
            pooled_projection_dim=32,
            out_channels=16,
            pos_embed_max_size=32,
            dual_attention_layers=(0, 1),
            qk_norm="rms_norm",
        ),
        "vae": small_vae(16),
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=3.0),
    }


def _qwen_image() -> dict:
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

    return {
        "transformer": QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=64,
            out_channels=16,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=8,
            joint_attention_dim=32,
            axes_dims_rope=(4, 6, 6),
        ),
        # One spatial downsampling: pipeline scale factor 2, as for the other tiny models.
        "vae": AutoencoderKLQwenImage(
            base_dim=16, z_dim=16, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[False]
        ),
        "scheduler": FlowMatchEulerDiscreteScheduler(
            base_shift=0.5, max_shift=0.9, base_image_seq_len=256, max_image_seq_len=8192, use_dynamic_shifting=True
        ),
    }


def _wan() -> dict:
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel

    return {
        "transformer": WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=8,
            attention_head_dim=16,
            in_channels=16,
            out_channels=16,
            text_dim=32,
            freq_dim=32,
            ffn_dim=256,
            num_layers=2,
            rope_max_seq_len=64,
        ),
        # One spatio-temporal downsampling: 5 frames -> 3 latent frames, 48x48 -> 24x24.
        "vae": AutoencoderKLWan(
            base_dim=16,
            z_dim=16,
            dim_mult=[1, 2],
            num_res_blocks=1,
            temperal_downsample=[True],
            scale_factor_temporal=2,
            scale_factor_spatial=2,
        ),
        "scheduler": UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0),
    }


def _pixart() -> dict:
    """PixArt-Sigma layout (no micro-conditions, learned sigma)."""
    from diffusers import DPMSolverMultistepScheduler, PixArtTransformer2DModel

    return {
        "transformer": PixArtTransformer2DModel(
            num_attention_heads=8,
            attention_head_dim=16,
            in_channels=4,
            out_channels=8,
            num_layers=2,
            cross_attention_dim=128,
            sample_size=32,
            patch_size=2,
            caption_channels=32,
            use_additional_conditions=False,
            interpolation_scale=1,
        ),
        "vae": small_vae(4),
        "scheduler": DPMSolverMultistepScheduler(),
    }


def _embeds(spec: TinySpec, args: dict, negative: bool = True) -> dict:
    """Prompt (and, for CFG, negative prompt) embeddings as the diffusers pipelines name them."""
    shape = (spec.text_len, spec.text_dim, spec.pooled_dim)
    embeds, pooled = prompt_embeddings(args["prompt"], *shape)
    kwargs = {"prompt_embeds": embeds}
    if pooled is not None:
        kwargs["pooled_prompt_embeds"] = pooled
    if negative:
        neg, neg_pooled = prompt_embeddings(args.get("negative_prompt") or "", *shape)
        kwargs["negative_prompt_embeds"] = neg
        if neg_pooled is not None:
            kwargs["negative_pooled_prompt_embeds"] = neg_pooled
    return kwargs


def _token_mask(prompt: str | list[str], length: int) -> torch.Tensor:
    """Attention mask of a padded tokenization: one token per word plus an end token."""
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    mask = torch.zeros(len(prompts), length, dtype=torch.long)
    for row, text in enumerate(prompts):
        mask[row, : min(length, len(text.split()) + 1)] = 1
    return mask


def _flux_call(spec: TinySpec, args: dict) -> dict:
    return _embeds(spec, args, negative=False)  # guidance-distilled: no CFG


def _qwen_image_call(spec: TinySpec, args: dict) -> dict:
    # Qwen-Image's CFG is "true CFG" (a second transformer call); guidance_scale is for
    # guidance-distilled checkpoints only. One prompt has no padding: the mask is all ones.
    kwargs = _embeds(spec, args)
    kwargs["prompt_embeds_mask"] = torch.ones(1, spec.text_len, dtype=torch.long)
    kwargs["negative_prompt_embeds_mask"] = torch.ones(1, spec.text_len, dtype=torch.long)
    return {**kwargs, "true_cfg_scale": args["guidance_scale"], "guidance_scale": None}


def _pixart_call(spec: TinySpec, args: dict) -> dict:
    kwargs = _embeds(spec, args)
    kwargs["prompt_attention_mask"] = _token_mask(args["prompt"], spec.text_len)
    kwargs["negative_prompt_attention_mask"] = _token_mask(args.get("negative_prompt") or "", spec.text_len)
    # negative_prompt defaults to "", which PixArt refuses next to negative_prompt_embeds.
    # Resolution binning would resize to a trained aspect-ratio bucket; tiny models have none.
    kwargs.update(negative_prompt=None, use_resolution_binning=False, max_sequence_length=spec.text_len)
    return kwargs


def _wan_wrapper_kwargs(config) -> dict:
    from cocodiff_xfuser import compat

    build = compat.private("xfuser.model_executor.models.runner_models.wan", "_build_attention_kwargs")
    return {"attention_kwargs": build(config)}


_XFUSER = "xfuser.model_executor"
_FLUX_WRAPPER = f"{_XFUSER}.models.transformers.transformer_flux:xFuserFlux1Transformer2DWrapper"

SPECS: dict[str, TinySpec] = {
    spec.name: spec
    for spec in (
        TinySpec(
            name="tiny-flux",
            pipeline="FluxPipeline",
            wrapper=_FLUX_WRAPPER,
            heads=8,
            text_len=32,
            text_dim=32,
            pooled_dim=32,
            build=_flux,
            call_kwargs=_flux_call,
            runner_sets_input=True,
        ),
        TinySpec(
            name="tiny-sd3",
            pipeline="StableDiffusion3Pipeline",
            wrapper=f"{_XFUSER}.pipelines.pipeline_stable_diffusion_3:xFuserStableDiffusion3Pipeline",
            heads=8,
            text_len=32,
            text_dim=32,
            pooled_dim=32,
            build=_sd3,
            call_kwargs=_embeds,
        ),
        TinySpec(
            name="tiny-qwen-image",
            pipeline="QwenImagePipeline",
            wrapper=f"{_XFUSER}.models.transformers.transformer_qwen:xFuserQwenImageTransformerWrapper",
            heads=8,
            text_len=32,
            text_dim=32,
            build=_qwen_image,
            call_kwargs=_qwen_image_call,
            guidance_scale=4.0,
        ),
        TinySpec(
            name="tiny-wan",
            pipeline="WanPipeline",
            wrapper=f"{_XFUSER}.models.transformers.transformer_wan:xFuserWanTransformer3DWrapper",
            heads=8,
            text_len=32,
            text_dim=32,
            build=_wan,
            call_kwargs=_embeds,
            height=48,
            width=48,
            frames=5,
            guidance_scale=5.0,
            wrapper_kwargs=_wan_wrapper_kwargs,
        ),
        TinySpec(
            name="tiny-pixart",
            pipeline="PixArtSigmaPipeline",
            wrapper=f"{_XFUSER}.pipelines.pipeline_pixart_sigma:xFuserPixArtSigmaPipeline",
            heads=8,
            text_len=32,
            text_dim=32,
            build=_pixart,
            call_kwargs=_pixart_call,
            guidance_scale=4.5,
        ),
        TinySpec(
            name=digits.NAME,
            pipeline="FluxPipeline",
            wrapper=_FLUX_WRAPPER,
            heads=digits.HEADS,
            text_len=digits.TEXT_LEN,
            text_dim=digits.TEXT_DIM,
            pooled_dim=digits.POOLED_DIM,
            build=None,
            call_kwargs=_flux_call,
            height=digits.SIZE,
            width=digits.SIZE,
            steps=digits.STEPS,
            guidance_scale=1.0,  # no guidance embedding, no CFG
            runner_sets_input=True,
            checkpoint=digits.CHECKPOINT,
        ),
        TinySpec(
            name=digits.SD3_NAME,
            pipeline="StableDiffusion3Pipeline",
            wrapper=f"{_XFUSER}.pipelines.pipeline_stable_diffusion_3:xFuserStableDiffusion3Pipeline",
            heads=digits.HEADS,
            text_len=digits.TEXT_LEN,
            text_dim=digits.TEXT_DIM,
            pooled_dim=digits.POOLED_DIM,
            build=None,
            call_kwargs=_embeds,  # true CFG against the unconditional prompt, batched by the pipeline
            height=digits.SIZE,
            width=digits.SIZE,
            steps=digits.STEPS,
            guidance_scale=digits.SD3_GUIDANCE,
            checkpoint=digits.SD3_CHECKPOINT,
        ),
    )
}


def cache_dir() -> Path:
    return Path(os.environ.get("COCODIFF_CACHE", Path.home() / ".cache" / "cocodiff_xfuser"))


def fixture_path(name: str) -> Path:
    spec = SPECS[name]
    return spec.checkpoint or cache_dir() / f"{name}-v{FIXTURE_VERSION}"


def ensure_fixture(name: str) -> Path:
    """The model's directory: a shipped checkpoint, or the tiny model built and saved once
    (concurrent ranks race safely via an atomic rename)."""
    spec = SPECS[name]
    path = fixture_path(name)
    if spec.checkpoint is not None:
        if not (path / "model_index.json").exists():
            raise ValueError(f"{spec.model_id}: no checkpoint at {path}; train it with scripts/train_tiny.py")
        # The checkpoint's model_index.json names this module; diffusers finds it in sys.modules.
        import cocodiff_xfuser.tools.models.pixel_shuffle  # noqa: F401

        return path
    if (path / "model_index.json").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    import diffusers

    torch.manual_seed(0)
    components = spec.build()
    pipeline_cls = getattr(diffusers, spec.pipeline)
    optional = {k: None for k in pipeline_cls._optional_components} if hasattr(pipeline_cls, "_optional_components") else {}
    expected = set(pipeline_cls._get_signature_keys(pipeline_cls)[0])
    none_components = {k: None for k in expected if k not in components}
    save_bf16_exact(pipeline_cls(**{**optional, **none_components, **components}), path)
    return path


def save_bf16_exact(pipe, path: Path) -> None:
    """Save ``pipe`` at ``path`` with its transformer's weights rounded to bf16 values, once:
    concurrent ranks race safely via an atomic rename. xfuser's loaders read transformers in bf16
    (then cast): bf16-exact weights make that round trip lossless, so every run computes with the
    weights plain diffusers does."""
    with torch.no_grad():
        for tensor in pipe.transformer.state_dict().values():
            if tensor.is_floating_point():
                tensor.copy_(tensor.to(torch.bfloat16))
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}-"))
    try:
        pipe.save_pretrained(tmp)
        os.rename(tmp, path)
    except OSError:
        if not (path / "model_index.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def transformer_blocks(path: str | Path) -> int:
    """The transformer blocks of the model saved at ``path`` (FLUX's double and single ones): the
    most PipeFusion stages it splits into."""
    config = json.loads((Path(path) / "transformer" / "config.json").read_text())
    return config["num_layers"] + config.get("num_single_layers", 0)


def pipefusion_stages(name: str, nodes: int, world: int) -> list[int]:
    """The PipeFusion stage counts of model ``name`` on ``nodes`` nodes of ``world`` ranks in all, as
    xDiT places PipeFusion where links are slow: from a stage per node to a stage per rank (or per
    transformer block), multiples of the node count, under Ulysses over the rest; none on one node
    or where xfuser runs no PipeFusion for the model (:attr:`TinySpec.pipefusion_absent`)."""
    if nodes == 1 or SPECS[name].pipefusion_absent is not None:
        return []
    most = min(world, transformer_blocks(ensure_fixture(name)))
    return [p for p in range(nodes, most + 1) if world % p == 0 and p % nodes == 0]


def _spread_stages(pp_config, path: str) -> None:
    """xfuser 0.7.0's FLUX.1 wrapper gives each PipeFusion stage ceil(blocks / stages) blocks; where
    that leaves the last stage none (digits-flux's 6 blocks over 4 stages), the stage before takes
    itself for the last and sends no text stream, and the pipeline fails. FLUX.2's wrapper asks
    ``is_pipeline_last_stage()`` instead. Such a split is given explicitly, as a user would with
    xfuser's ``attn_layer_num_for_pp``: the blocks spread evenly, the first stages one more."""
    blocks, stages = transformer_blocks(path), pp_config.pp_degree
    if pp_config.attn_layer_num_for_pp is None and (stages - 1) * -(-blocks // stages) >= blocks:
        pp_config.attn_layer_num_for_pp = [blocks // stages + (i < blocks % stages) for i in range(stages)]


def _absent_components(path: str) -> dict:
    """Components saved as absent (text encoders, tokenizers): diffusers wants them passed as None."""
    index = json.loads((Path(path) / "model_index.json").read_text())
    return {k: None for k, v in index.items() if isinstance(v, list) and v == [None, None]}


# Image pixels per FLUX token side: the tiny autoencoders halve (2x2 pixel shuffle for
# digits-flux), and FLUX packs 2x2 latents into one token.
FLUX_PIXELS_PER_TOKEN = 4


def uneven(name: str, ulysses_degree: int, ring_degree: int = 1, height: int | None = None, width: int | None = None) -> str | None:
    """What stock Ulysses cannot split on this layout (cocodiff pads it), or None.

    Heads must divide by the Ulysses degree; for FLUX, the text and image tokens by the SP degree.
    """
    spec = SPECS[name]
    uneven = [f"{spec.heads} attention heads"] if spec.heads % ulysses_degree else []
    sp = ulysses_degree * ring_degree
    if spec.pipeline == "FluxPipeline" and sp > 1:
        image = ((height or spec.height) // FLUX_PIXELS_PER_TOKEN) * ((width or spec.width) // FLUX_PIXELS_PER_TOKEN)
        tokens = [f"{n} {what} tokens" for n, what in ((spec.text_len, "text"), (image, "image")) if n % sp]
        if tokens and ring_degree > 1:
            raise ValueError(f"{spec.model_id}: {' and '.join(tokens)} not divisible by SP degree {sp}; "
                             f"cocodiff pads tokens with ring degree 1 only")
        uneven += tokens
    return f"{' and '.join(uneven)} not divisible by ulysses degree {ulysses_degree}" if uneven else None


def pipeline_kwargs(spec: TinySpec, input_args: dict, generator: torch.Generator) -> dict:
    """The pipeline call for one run: the runner's input args plus the spec's text embeddings."""
    kwargs = {
        "height": input_args["height"],
        "width": input_args["width"],
        "num_inference_steps": input_args["num_inference_steps"],
        "guidance_scale": input_args["guidance_scale"],
        "generator": generator,
        "output_type": input_args.get("output_type") or "pil",
    }
    if spec.frames:
        kwargs["num_frames"] = input_args["num_frames"]
    return {**kwargs, **spec.call_kwargs(spec, input_args)}


def _images(spec: TinySpec, output) -> list:
    """The pipeline's images; a video's frames (one prompt) instead, so savers treat them alike."""
    return list(output.frames[0] if spec.frames else output.images)


@functools.lru_cache(maxsize=None)
def _plain_pipeline(name: str):
    """The model as plain diffusers loads it, once per process (references run it per case)."""
    import diffusers

    path = str(ensure_fixture(name))
    pipe = getattr(diffusers, SPECS[name].pipeline).from_pretrained(path, dtype=DTYPE, **_absent_components(path))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def reference_images(
    name: str, prompt: str, seed: int = 42, height: int | None = None, width: int | None = None, steps: int | None = None
) -> np.ndarray:
    """The spec's run in one process with plain diffusers (no xfuser): float images in [0, 1]."""
    spec = SPECS[name]
    pipe = _plain_pipeline(name)
    input_args = {
        "prompt": prompt,
        "height": height or spec.height,
        "width": width or spec.width,
        "num_frames": spec.frames,
        "num_inference_steps": steps or spec.steps,
        "guidance_scale": spec.guidance_scale,
        "output_type": "np",
    }
    output = pipe(**pipeline_kwargs(spec, input_args, torch.Generator("cpu").manual_seed(seed)))
    return np.stack([np.asarray(image) for image in _images(spec, output)])


def _xfuser_flux() -> type:
    """xfuser's runner model of FLUX.1-dev."""
    from xfuser.model_executor.models.runner_models.flux import xFuserFluxModel

    assert xFuserFluxModel.capabilities.supports_step_caching and xFuserFluxModel.capabilities.use_fp8_comms
    return xFuserFluxModel


def _runner_class(spec: TinySpec, base_model) -> type:
    """An xfuser runner model (``xFuserModel`` subclass) for one tiny spec."""

    # The FLUX-architecture models declare what xfuser's own FLUX runner does: step caching (its
    # methods and presets) and fp8 communication.
    flux = _xfuser_flux() if spec.pipeline == "FluxPipeline" else None

    class TinyRunner(base_model.xFuserModel):
        capabilities = base_model.ModelCapabilities(
            use_cfg_parallel=True, pipefusion_parallel_degree=spec.pipefusion_absent is None,
            **({} if flux is None else {"supports_step_caching": True, "use_fp8_comms": True}),
        )
        default_input_values = base_model.DefaultInputValues(
            height=spec.height,
            width=spec.width,
            num_frames=spec.frames,
            num_inference_steps=spec.steps,
            guidance_scale=spec.guidance_scale,
            max_sequence_length=spec.text_len,
        )
        settings = base_model.ModelSettings(
            model_name=str(fixture_path(spec.name)),
            output_name=spec.name.replace("-", "_"),
            model_output_type="image",
            step_cache_config=None if flux is None else flux.settings.step_cache_config,
        )

        def _load_model(self):
            import importlib

            import diffusers
            from xfuser.model_executor.pipelines.base_pipeline import xFuserPipelineBaseWrapper

            path = str(ensure_fixture(spec.name))
            module_name, cls_name = spec.wrapper.split(":")
            wrapper = getattr(importlib.import_module(module_name), cls_name)
            absent = _absent_components(path)
            if spec.pipeline == "FluxPipeline" and self.config.pipefusion_parallel_degree > 1:
                # As xfuser's FLUX runner loads FLUX for PipeFusion: its pipeline wrapper.
                from xfuser.model_executor.pipelines.pipeline_flux import xFuserFluxPipeline

                wrapper = xFuserFluxPipeline
                _spread_stages(self.engine_config.parallel_config.pp_config, path)
            if issubclass(wrapper, xFuserPipelineBaseWrapper):
                # xfuser's SD3 runner path: the pipeline wrapper converts the transformer itself
                # (when any parallelism is on) and runs its own denoising loop.
                if self.config.pipefusion_parallel_degree > 1:  # its receive buffers: the runtime's dtype
                    self.engine_config.runtime_config.dtype = DTYPE
                return wrapper.from_pretrained(path, engine_config=self.engine_config, dtype=DTYPE, **absent)
            init_kwargs = spec.wrapper_kwargs(self.config) if spec.wrapper_kwargs else None
            # xfuser's loader materializes transformers in bf16; the tiny models compute in DTYPE.
            transformer = self.loader.load_transformer(wrapper, init_kwargs=init_kwargs).to(DTYPE)
            pipeline_cls = getattr(diffusers, spec.pipeline)
            return pipeline_cls.from_pretrained(path, transformer=transformer, dtype=DTYPE, **absent)

        def _run_pipe(self, input_args: dict):
            if spec.runner_sets_input:
                from xfuser.core.distributed import get_pipeline_parallel_world_size, get_runtime_state

                prompt = input_args["prompt"]
                get_runtime_state().set_input_parameters(
                    batch_size=len(prompt) if isinstance(prompt, list) else 1,
                    num_inference_steps=input_args["num_inference_steps"],
                    max_condition_sequence_length=spec.text_len,
                    split_text_embed_in_sp=get_pipeline_parallel_world_size() == 1,
                )
            kwargs = pipeline_kwargs(spec, input_args, self._make_generator(input_args["seed"]))
            if self.config.pipefusion_parallel_degree > 1:
                kwargs["max_sequence_length"] = spec.text_len  # where PipeFusion's wrappers split text from image
            output = self.pipe(**kwargs)
            # xfuser's pipeline wrappers return None on ranks that do not decode.
            images = [] if output is None else _images(spec, output)
            return base_model.DiffusionOutput(images=images, pipe_args=input_args)

    TinyRunner.__name__ = TinyRunner.__qualname__ = "Tiny" + "".join(p.title() for p in spec.name.split("-")[1:])
    return TinyRunner


def register(base_model) -> None:
    """Add every tiny model to xfuser's runner registry (``base_model`` is that module)."""
    for spec in SPECS.values():
        base_model.register_model(spec.model_id)(_runner_class(spec, base_model))
