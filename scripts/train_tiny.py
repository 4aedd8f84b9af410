"""Train ``cocodiff/digits-flux`` or ``cocodiff/digits-sd3``: small FLUX- and SD3-architecture
transformers on scikit-learn's digits.

    python scripts/train_tiny.py                      # digits-flux: ~26 min on 2 idle CPU cores
    python scripts/train_tiny.py --model digits-sd3   # digits-sd3 (true CFG); both write the shipped fixture

Rectified flow as FLUX uses it: x_t = (1 - s) x_0 + s e with e ~ N(0, I), the transformer
predicts the velocity e - x_0 at timestep s (FluxPipeline passes s = t / 1000), and s is
drawn from a logit-normal shifted towards high noise like the sampler's schedule
(``digits.SHIFT``): the digit is decided at high noise (measured: without the shift, samples
at 750 steps matched their prompt 0.30 of the time instead of 0.80). The class
is the prompt "digit <d>" through the stand-in text encoder; the autoencoder is the exact
pixel (un)shuffle of :mod:`cocodiff_xfuser.tools.models.digits`, whose latent normalization
is set here from the data. Seeded: a rerun with the same thread count gives the same
weights. Weights are kept as an exponential moving average, rounded to bf16 values (xfuser's
loader reads transformers in bf16, so that round trip is exact) and saved in bf16.
Finally, samples of every class are labelled by a classifier fitted on the real digits; the
agreement and the loss curve are written to ``train_log.json`` beside the weights.

``digits-sd3`` learns the same velocity over unpacked 4x32x32 latents (2x2 patches in the
model), with the timestep as SD3's pipeline passes it (s x 1000), and the prompt replaced by the
unconditional one (``digits.UNCONDITIONAL``) one time in ten (``--drop``), so that it samples with
classifier-free guidance at ``digits.SD3_GUIDANCE``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from cocodiff_xfuser.tools.models import digits
from cocodiff_xfuser.tools.models.pixel_shuffle import PixelShuffleAutoencoder
from cocodiff_xfuser.tools.models.tiny import prompt_embeddings


def class_conditions() -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt and pooled embeddings of "digit 0" ... "digit 9", as the pipeline will get them."""
    return prompt_embeddings(list(digits.CLASSES), digits.TEXT_LEN, digits.TEXT_DIM, digits.POOLED_DIM)


def latents(autoencoder: PixelShuffleAutoencoder, gray: np.ndarray, sd3: bool) -> torch.Tensor:
    """Normalized latents of gray images in [0, 1]: (N, 4, 32, 32) for SD3, packed as FluxPipeline
    packs them (N, 256, 16) for FLUX."""
    from diffusers import FluxPipeline

    z = autoencoder.encode(torch.from_numpy(gray)[:, None] * 2 - 1)
    config = autoencoder.config
    z = (z - config.shift_factor) * config.scaling_factor
    if sd3:
        return z
    n, c, h, w = z.shape
    return FluxPipeline._pack_latents(z, n, c, h, w)


def pipeline(transformer, autoencoder, sd3: bool):
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, StableDiffusion3Pipeline

    scheduler = FlowMatchEulerDiscreteScheduler(shift=digits.SHIFT, use_dynamic_shifting=False)
    if sd3:
        pipe = StableDiffusion3Pipeline(
            scheduler=scheduler, vae=autoencoder, transformer=transformer, text_encoder=None, tokenizer=None,
            text_encoder_2=None, tokenizer_2=None, text_encoder_3=None, tokenizer_3=None,
        )
    else:
        pipe = FluxPipeline(
            scheduler=scheduler, vae=autoencoder, transformer=transformer,
            text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None,
        )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def sample(pipe, per_class: int, seed: int, sd3: bool) -> tuple[np.ndarray, np.ndarray]:
    """``per_class`` images of every class, (N, SIZE, SIZE, 3) in [0, 1], and the classes asked for."""
    embeds, pooled = class_conditions()
    classes = np.repeat(np.arange(10), per_class)
    kwargs = {"prompt_embeds": embeds[classes], "pooled_prompt_embeds": pooled[classes]}
    if sd3:
        null, null_pooled = unconditional()
        kwargs.update(negative_prompt_embeds=null.expand(len(classes), -1, -1),
                      negative_pooled_prompt_embeds=null_pooled.expand(len(classes), -1),
                      guidance_scale=digits.SD3_GUIDANCE)
    with torch.no_grad():
        out = pipe(
            **kwargs, height=digits.SIZE, width=digits.SIZE, num_inference_steps=digits.STEPS,
            generator=torch.Generator().manual_seed(seed), output_type="np",
        )
    return np.asarray(out.images), classes


def unconditional() -> tuple[torch.Tensor, torch.Tensor]:
    """The dropped condition: the unconditional prompt's embeddings, as the pipeline's negative prompt."""
    return prompt_embeddings(digits.UNCONDITIONAL, digits.TEXT_LEN, digits.TEXT_DIM, digits.POOLED_DIM)


def save_grid(images: np.ndarray, path: Path) -> None:
    """Class-major samples (as :func:`sample` returns them): one column per digit, one row per seed."""
    from PIL import Image

    n, h, w, _ = images.shape
    per_class = n // 10
    grid = images.reshape(10, per_class, h, w, 3).transpose(1, 2, 0, 3, 4).reshape(per_class * h, 10 * w, 3)
    Image.fromarray((grid * 255).round().astype(np.uint8)).save(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=digits.TRAINED, default=digits.NAME)
    parser.add_argument("--drop", type=float, default=0.1, help="digits-sd3: share of samples trained unconditionally")
    parser.add_argument("--steps", type=int, default=1400)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--ema", type=float, default=0.995)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--out", type=Path, default=None, help="default: the model's shipped fixture")
    parser.add_argument("--samples-png", type=Path, default=None, help="also write the final samples' grid here")
    args = parser.parse_args()
    sd3 = args.model == digits.SD3_NAME
    args.out = args.out or (digits.SD3_CHECKPOINT if sd3 else digits.CHECKPOINT)

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    from diffusers import FluxPipeline, FluxTransformer2DModel, SD3Transformer2DModel

    gray, labels = digits.load_images()
    centered = gray * 2 - 1
    autoencoder = PixelShuffleAutoencoder(
        shift_factor=float(centered.mean()), scaling_factor=float(1 / centered.std())
    )
    x0_all = latents(autoencoder, gray, sd3)
    embeds, pooled = class_conditions()
    null, null_pooled = unconditional()
    grid = digits.SIZE // 4  # latent tokens per side after FluxPipeline's 2x2 packing
    img_ids = FluxPipeline._prepare_latent_image_ids(1, grid, grid, "cpu", torch.float32)
    txt_ids = torch.zeros(digits.TEXT_LEN, 3)

    if sd3:
        model = SD3Transformer2DModel(**digits.sd3_transformer_config())
    else:
        model = FluxTransformer2DModel(**digits.transformer_config())
    ema = copy.deepcopy(model).requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    warmup = max(1, args.steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps)))
    )
    classifier = digits.Classifier()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{n_params / 1e6:.2f} M parameters; {len(gray)} images, {(digits.SIZE // 4) ** 2} image tokens each; "
          f"classifier held-out accuracy on real digits {classifier.held_out_accuracy:.3f}", flush=True)

    log = {"loss": [], "eval": []}
    gen = torch.Generator().manual_seed(args.seed)
    running = None
    for step in range(1, args.steps + 1):
        idx = torch.randint(len(x0_all), (args.batch,), generator=gen)
        x0, cls = x0_all[idx], torch.from_numpy(labels)[idx]
        noise = torch.randn(x0.shape, generator=gen)
        s = torch.sigmoid(torch.randn(args.batch, generator=gen))
        s = digits.SHIFT * s / (1 + (digits.SHIFT - 1) * s)
        at = s.view(-1, *[1] * (x0.dim() - 1))
        xt = (1 - at) * x0 + at * noise
        if sd3:
            dropped = (torch.rand(args.batch, generator=gen) < args.drop)[:, None]
            pred = model(
                hidden_states=xt, timestep=s * 1000,
                encoder_hidden_states=torch.where(dropped[:, :, None], null, embeds[cls]),
                pooled_projections=torch.where(dropped, null_pooled, pooled[cls]), return_dict=False,
            )[0]
        else:
            pred = model(
                hidden_states=xt, timestep=s, encoder_hidden_states=embeds[cls], pooled_projections=pooled[cls],
                txt_ids=txt_ids, img_ids=img_ids, return_dict=False,
            )[0]
        loss = torch.nn.functional.mse_loss(pred, noise - x0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        with torch.no_grad():
            for e, p in zip(ema.parameters(), model.parameters()):
                e.lerp_(p, 1 - args.ema)
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        if step % 50 == 0:
            log["loss"].append({"step": step, "loss": running})
            print(f"step {step}/{args.steps}  loss {running:.4f}  {time.perf_counter() - started:.0f} s", flush=True)
        if step % args.eval_every == 0 and step < args.steps:
            images, asked = sample(pipeline(ema, autoencoder, sd3), per_class=2, seed=1, sd3=sd3)
            agreement = float((classifier.predict(images) == asked).mean())
            log["eval"].append({"step": step, "classifier_agreement": agreement})
            print(f"  samples at step {step}: classifier agreement {agreement:.2f}", flush=True)

    with torch.no_grad():  # bf16 values: xfuser's loader reads transformers in bf16
        for tensor in ema.state_dict().values():
            tensor.copy_(tensor.to(torch.bfloat16))
    images, asked = sample(pipeline(ema, autoencoder, sd3), per_class=5, seed=2, sd3=sd3)
    agreement = float((classifier.predict(images) == asked).mean())
    elapsed = time.perf_counter() - started
    print(f"final: classifier agreement {agreement:.2f} on {len(asked)} samples; {elapsed / 60:.1f} min", flush=True)

    tmp = args.out.with_name(args.out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    pipeline(ema.to(torch.bfloat16), autoencoder, sd3).save_pretrained(tmp)
    log.update(
        final_classifier_agreement=agreement, samples=len(asked), minutes=elapsed / 60, threads=args.threads,
        parameters=n_params, classifier_held_out_accuracy=classifier.held_out_accuracy,
        args={k: str(v) for k, v in vars(args).items()},
    )
    (tmp / "train_log.json").write_text(json.dumps(log, indent=1))
    shutil.rmtree(args.out, ignore_errors=True)
    tmp.rename(args.out)
    if args.samples_png:
        save_grid(images, args.samples_png)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
