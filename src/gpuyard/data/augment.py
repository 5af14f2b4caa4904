"""Seeded image augmentation on whole batches in torch: flips, rotation, crop, brightness, contrast.

Applied by the loader on the fly. Every batch gets its own generator seeded from (seed, epoch, rank,
worker, batch index), so a resumed run sees exactly the augmentations it would have seen.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from gpuyard.data.recipe import Augment


def batch_generator(*keys: int) -> torch.Generator:
    """A torch generator seeded from integers (stable across processes and runs)."""
    seed = int(np.random.SeedSequence([k & 0xFFFFFFFF for k in keys]).generate_state(1)[0])
    return torch.Generator().manual_seed(seed)


def augment(images: torch.Tensor, spec: Augment, gen: torch.Generator) -> torch.Tensor:
    """Augment a ``(N, H, W)`` or ``(N, H, W, C)`` batch; returns the same shape and dtype.

    Args:
        images: the batch (uint8 images are rounded and clamped back to 0..255).
        spec: which augmentations and how strong.
        gen: the batch's generator.
    """
    if images.numel() == 0:
        return images
    dtype, channels_last = images.dtype, images.dim() == 4
    x = images.float()
    x = x.permute(0, 3, 1, 2) if channels_last else x.unsqueeze(1)  # -> (N, C, H, W)
    n = x.shape[0]
    if spec.hflip > 0:
        flip = torch.rand(n, generator=gen) < spec.hflip
        x[flip] = x[flip].flip(-1)
    if spec.vflip > 0:
        flip = torch.rand(n, generator=gen) < spec.vflip
        x[flip] = x[flip].flip(-2)
    if spec.rotate > 0 or spec.crop_padding > 0:
        x = _affine(x, spec, gen)
    if spec.brightness > 0:
        x = x * (1 + (torch.rand(n, 1, 1, 1, generator=gen) * 2 - 1) * spec.brightness)
    if spec.contrast > 0:
        mean = x.mean(dim=(1, 2, 3), keepdim=True)
        x = (x - mean) * (1 + (torch.rand(n, 1, 1, 1, generator=gen) * 2 - 1) * spec.contrast) + mean
    x = x.permute(0, 2, 3, 1) if channels_last else x.squeeze(1)
    if not dtype.is_floating_point:
        x = x.round().clamp(0, 255)
    return x.to(dtype).contiguous()


def _affine(x: torch.Tensor, spec: Augment, gen: torch.Generator) -> torch.Tensor:
    # One batched grid_sample: rotation about the centre plus a random shift of up to crop_padding
    # pixels (the same as padding and cropping back at random), zeros where the image moved away.
    n, _, h, w = x.shape
    angle = (torch.rand(n, generator=gen) * 2 - 1) * math.radians(spec.rotate)
    shift = torch.randint(-spec.crop_padding, spec.crop_padding + 1, (n, 2), generator=gen).float()
    cos, sin = torch.cos(angle), torch.sin(angle)
    theta = torch.zeros(n, 2, 3)
    theta[:, 0, 0], theta[:, 0, 1], theta[:, 1, 0], theta[:, 1, 1] = cos, -sin, sin, cos
    theta[:, 0, 2] = shift[:, 0] * 2 / w
    theta[:, 1, 2] = shift[:, 1] * 2 / h
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
