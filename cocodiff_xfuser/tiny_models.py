"""Tiny, seeded, random-weight versions of real DiT families, registered in xfuser's model registry.

Each is built from a small diffusers config (no hub access), written with ``save_pretrained``
to a local fixture directory and loaded back through xfuser's own runner loading code, so
``xdit --model cocodiff/tiny-flux ...`` exercises the real path. There are no text encoders:
the prompt embeddings are a seeded function of the prompt (:func:`prompt_embeddings`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

FIXTURE_VERSION = "1"
DTYPE = torch.float32  # bitwise comparisons on CPU; bf16 matmuls are slow there


@dataclass(frozen=True)
class TinySpec:
    """One tiny model: how to build it, how to run its pipeline, which xfuser wrapper loads it."""

    name: str
    pipeline: str  # diffusers pipeline class
    wrapper: str  # "module:Class" of the xfuser transformer wrapper
    heads: int
    text_len: int
    text_dim: int
    build: Callable[[], dict]  # component name -> module or scheduler
    call_kwargs: Callable[[dict], dict]  # input args -> pipeline kwargs besides generator
    pooled_dim: int | None = None
    height: int = 64
    width: int = 64
    steps: int = 4
    guidance_scale: float = 3.5
    extra_capabilities: dict = field(default_factory=dict)

    @property
    def model_id(self) -> str:
        return f"cocodiff/{self.name}"


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


def _small_vae(latent_channels: int):
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
        "vae": _small_vae(16),
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=False),
    }


def _flux_call(args: dict) -> dict:
    embeds, pooled = prompt_embeddings(args["prompt"], 32, 32, 32)
    return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}


SPECS: dict[str, TinySpec] = {
    spec.name: spec
    for spec in (
        TinySpec(
            name="tiny-flux",
            pipeline="FluxPipeline",
            wrapper="xfuser.model_executor.models.transformers.transformer_flux:xFuserFlux1Transformer2DWrapper",
            heads=8,
            text_len=32,
            text_dim=32,
            pooled_dim=32,
            build=_flux,
            call_kwargs=_flux_call,
        ),
    )
}


def cache_dir() -> Path:
    return Path(os.environ.get("COCODIFF_CACHE", Path.home() / ".cache" / "cocodiff_xfuser"))


def fixture_path(name: str) -> Path:
    return cache_dir() / f"{name}-v{FIXTURE_VERSION}"


def ensure_fixture(name: str) -> Path:
    """Build and save the tiny model once; concurrent ranks race safely via an atomic rename."""
    spec = SPECS[name]
    path = fixture_path(name)
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
    pipe = pipeline_cls(**{**optional, **none_components, **components})
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{name}-"))
    try:
        pipe.save_pretrained(tmp)
        os.rename(tmp, path)
    except OSError:
        if not (path / "model_index.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _absent_components(path: str) -> dict:
    """Components saved as absent (text encoders, tokenizers): diffusers wants them passed as None."""
    index = json.loads((Path(path) / "model_index.json").read_text())
    return {k: None for k, v in index.items() if isinstance(v, list) and v == [None, None]}


def check_heads(name: str, ulysses_degree: int) -> None:
    """Fail before launching when the model's heads cannot be split over the Ulysses ranks."""
    spec = SPECS[name]
    if spec.heads % ulysses_degree:
        raise ValueError(
            f"{spec.model_id} has {spec.heads} attention heads, not divisible by ulysses degree {ulysses_degree}"
        )


def _runner_class(spec: TinySpec, base_model) -> type:
    """An xfuser runner model (``xFuserModel`` subclass) for one tiny spec."""

    class TinyRunner(base_model.xFuserModel):
        capabilities = base_model.ModelCapabilities(use_cfg_parallel=True, **spec.extra_capabilities)
        default_input_values = base_model.DefaultInputValues(
            height=spec.height,
            width=spec.width,
            num_inference_steps=spec.steps,
            guidance_scale=spec.guidance_scale,
            max_sequence_length=spec.text_len,
        )
        settings = base_model.ModelSettings(
            model_name=str(fixture_path(spec.name)),
            output_name=spec.name.replace("-", "_"),
            model_output_type="image",
        )

        def _load_model(self):
            import importlib

            import diffusers

            ensure_fixture(spec.name)
            module_name, cls_name = spec.wrapper.split(":")
            wrapper = getattr(importlib.import_module(module_name), cls_name)
            # xfuser's loader materializes transformers in bf16; the tiny models compute in DTYPE.
            transformer = self.loader.load_transformer(wrapper).to(DTYPE)
            return getattr(diffusers, spec.pipeline).from_pretrained(
                self.settings.model_name, transformer=transformer, dtype=DTYPE, **_absent_components(self.settings.model_name)
            )

        def _run_pipe(self, input_args: dict):
            from xfuser.core.distributed import get_pipeline_parallel_world_size, get_runtime_state

            get_runtime_state().set_input_parameters(
                batch_size=1,
                num_inference_steps=input_args["num_inference_steps"],
                max_condition_sequence_length=spec.text_len,
                split_text_embed_in_sp=get_pipeline_parallel_world_size() == 1,
            )
            output = self.pipe(
                height=input_args["height"],
                width=input_args["width"],
                num_inference_steps=input_args["num_inference_steps"],
                guidance_scale=input_args["guidance_scale"],
                generator=self._make_generator(input_args["seed"]),
                output_type=input_args.get("output_type") or "pil",
                **spec.call_kwargs(input_args),
            )
            return base_model.DiffusionOutput(images=list(output.images), pipe_args=input_args)

    TinyRunner.__name__ = TinyRunner.__qualname__ = "Tiny" + "".join(p.title() for p in spec.name.split("-")[1:])
    return TinyRunner


def register(base_model) -> None:
    """Add every tiny model to xfuser's runner registry (``base_model`` is that module)."""
    for spec in SPECS.values():
        base_model.register_model(spec.model_id)(_runner_class(spec, base_model))
