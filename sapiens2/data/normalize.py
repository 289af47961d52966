"""Image normalisation of the Sapiens2 recipe: RGB on 0-255, ImageNet mean and std."""

import torch

IMAGE_MEAN = (123.675, 116.28, 103.53)
IMAGE_STD = (58.395, 57.12, 57.375)


def normalize(images: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) float RGB on 0-255 -> normalised."""
    mean = images.new_tensor(IMAGE_MEAN).view(1, 3, 1, 1)
    std = images.new_tensor(IMAGE_STD).view(1, 3, 1, 1)
    return (images - mean) / std


def normalize_images(images_uint8: torch.Tensor) -> torch.Tensor:
    """(B, H, W, 3) uint8 RGB -> (B, 3, H, W) float32 normalised."""
    return normalize(images_uint8.permute(0, 3, 1, 2).float())
