"""Image files of a `ps-bridge logprobs` batch as the checkpoint's own image processor turns them into
pixel values (its `preprocessor_config.json`), placed at each sample's image placeholders."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional, Sequence

from ps_bridge.images import SampleImage, attach_images


def image_processor(hf_path: str):
    """The checkpoint's image processor: transformers' `AutoImageProcessor`, or where that needs
    torchvision and it is absent (transformers 5 makes the auto class a placeholder then), the PIL
    form of the class `preprocessor_config.json` names (`<Name>Pil`, same preprocessing)."""
    # imported here: transformers is heavy
    import transformers

    config = Path(hf_path) / "preprocessor_config.json"
    if not config.is_file():
        raise ValueError(f"the batch has images but {hf_path} has no preprocessor_config.json (the checkpoint's image processor)")
    try:
        return transformers.AutoImageProcessor.from_pretrained(hf_path)
    except ImportError:
        name = json.loads(config.read_text()).get("image_processor_type", "")
        cls = getattr(transformers, f"{name.removesuffix('Fast')}Pil", None)
        if cls is None:
            raise ValueError(f"{hf_path}: image processor {name!r} needs torchvision, which is not installed") from None
        return cls.from_pretrained(hf_path)


def samples_with_image_files(samples: Sequence, image_paths: Sequence[Optional[List[str]]], hf_path: str,
                             hf_config: dict, base: Path) -> list:
    """`samples` with the images of `image_paths` (per sample, files relative to `base`) placed at
    their image placeholders; a missing file or a placeholder count that does not match is refused
    with one line naming the sample."""
    image_token = hf_config.get("image_token_id")
    vision = hf_config.get("vision_config") or {}
    if image_token is None or "spatial_merge_size" not in vision:
        raise ValueError(f"the batch has images but {hf_path} is not a vision-language checkpoint (no image_token_id)")
    processor = image_processor(hf_path) if any(image_paths) else None
    if processor is not None:
        try:
            # imported here: Pillow is optional (not a ps-bridge dependency); only image files need it
            from PIL import Image
        except ImportError:
            raise ValueError("the batch has image files: reading them needs Pillow (pip install pillow)") from None
    out = []
    for i, (sample, paths) in enumerate(zip(samples, image_paths)):
        images = []
        for name in paths or ():
            file = base / name
            if not file.is_file():
                raise ValueError(f"sample {i}: image file not found: {file}")
            with Image.open(file) as opened:
                values = processor(images=[opened.convert("RGB")], return_tensors="pt")
            images.append(SampleImage.of(values["pixel_values"], values["image_grid_thw"][0]))
        out.append(attach_images(sample, images, image_token_id=int(image_token), merge=int(vision["spatial_merge_size"]),
                                 video_token_id=hf_config.get("video_token_id"), index=i))
    return out
