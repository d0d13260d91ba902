"""Fine-tune a vision-language model (Qwen3.5, Qwen2.5-VL or Qwen2-VL) on images and a video with Ulysses SP.

The model is a tiny vision-language model built from a config (nothing is downloaded): Qwen3.5 by default (a
decoder of gated delta nets and gated attention, a vision tower with learned position embeddings), Qwen2.5-VL or
Qwen2-VL. The data are synthetic: random images run through the model family's own image processor (its PIL
backend), and a short random video given in the vision tower's patch layout, each between random text tokens. Qwen3.5
reads a video the way its processor writes it: per temporal patch (two frames) a timestamp in text, then
``<vision_start>``, the placeholders and ``<vision_end>``; the Qwen2 families read one run of placeholders per video.
The LightningModule is what you would write for one device (``self.model(**batch).loss``); only the strategy argument
differs. Under SP every rank holds ``S / sp_size`` tokens, encodes its share of the images and video frames, and
receives the image-feature rows of the placeholder tokens in its shard (see docs/vision-language.md).

    python examples/finetune_vlm.py                      # CPU: 2 processes, sp_size=2, about 10 seconds
    python examples/finetune_vlm.py --family qwen2_5_vl --frames 8
    torchrun --nproc_per_node=2 examples/finetune_vlm.py
"""

import argparse
import os
import warnings

import numpy as np
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is imported anywhere

from lightning.pytorch import LightningModule, Trainer, seed_everything
from torch.utils.data import DataLoader, Dataset

from lightning_ulysses import StepProgressBar, UlyssesDeepSpeedStrategy

IMAGE, VIDEO, START, END = 120, 121, 122, 123  # placeholder and delimiter token ids; text tokens are 0..99
PATCH, MERGE, TEMPORAL = 4, 2, 2  # vision patch size, spatial merge, temporal patch size
FPS = 2.0  # the synthetic videos' frame rate (Qwen3.5's timestamps)
FAMILIES = ("qwen2_5_vl", "qwen2_vl", "qwen3_5")

for _noise in (".*does not have many workers.*", ".*LeafSpec.*", ".*all_gather_into_tensor.*"):
    warnings.filterwarnings("ignore", _noise)


def build_model(family: str) -> torch.nn.Module:
    from transformers import AutoModelForImageTextToText, Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3_5Config

    text = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 2, 4], "rope_theta": 10000.0})
    vision = dict(depth=2, hidden_size=64, num_heads=4, patch_size=PATCH, spatial_merge_size=MERGE,
                  temporal_patch_size=TEMPORAL, in_channels=3)
    tokens = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    if family == "qwen2_vl":
        config = Qwen2VLConfig(text_config=text, vision_config=dict(vision, embed_dim=32, mlp_ratio=2), **tokens)
    elif family == "qwen3_5":
        # layer 0 a gated delta net, layer 1 gated attention; interleaved M-RoPE on half of each 16-wide head
        rope = {"rope_type": "default", "mrope_section": [2, 1, 1], "mrope_interleaved": True,
                "partial_rotary_factor": 0.5, "rope_theta": 10000.0}
        mixers = dict(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                      linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                      linear_conv_kernel_dim=4)
        config = Qwen3_5Config(text_config=dict(text, head_dim=16, rope_parameters=rope, **mixers),
                               vision_config=dict(vision, intermediate_size=96, out_hidden_size=64,
                                                  num_position_embeddings=64), **tokens)
    else:
        config = Qwen2_5_VLConfig(text_config=text, vision_config=dict(vision, intermediate_size=96, out_hidden_size=64,
                                                                       window_size=16, fullatt_block_indexes=[1]),
                                  **tokens)
    return AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa")


def video_tokens(family: str, grid: torch.Tensor) -> list[int]:
    """A video's tokens: Qwen3.5 writes ``<t seconds> <start> placeholders <end>`` per temporal patch (the timestamp
    one text token per character here, as there is no tokenizer), the Qwen2 families one run of placeholders."""
    frames, height, width = grid[0].tolist()
    per_patch = height * width // MERGE ** 2
    if family != "qwen3_5":
        return [START] + [VIDEO] * (frames * per_patch) + [END]
    ids = []
    for patch in range(frames):
        seconds = (patch * TEMPORAL + (TEMPORAL - 1) / 2) / FPS  # the mean time of the patch's frames
        ids += [ord(c) % 100 for c in f"<{seconds:.1f} seconds>"] + [START] + [VIDEO] * per_patch + [END]
    return ids


class SyntheticVisionText(Dataset):
    """Samples of text, one image of a random size and (every other sample) a video of ``frames`` frames."""

    def __init__(self, samples: int, frames: int, seed: int = 0, family: str = "qwen2_5_vl") -> None:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.processor = Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=TEMPORAL,
                                                  min_pixels=8 * 8, max_pixels=64 * 64)
        self.samples, self.frames, self.seed, self.family = samples, frames, seed, family

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> dict:
        rng = np.random.default_rng(self.seed + index)
        height, width = (int(x) * 8 for x in rng.integers(2, 7, 2))
        image = self.processor(images=[(rng.random((height, width, 3)) * 255).astype(np.uint8)], return_tensors="pt")
        ids = rng.integers(0, 100, 20).tolist()
        ids += [START] + [IMAGE] * int(image["image_grid_thw"].prod() // MERGE ** 2) + [END]
        sample = {"pixel_values": image["pixel_values"], "image_grid_thw": image["image_grid_thw"]}
        if index % 2 == 0:
            grid = torch.tensor([[self.frames // TEMPORAL, 4, 4]])
            sample["pixel_values_videos"] = torch.randn(int(grid.prod()), 3 * TEMPORAL * PATCH * PATCH,
                                                        generator=torch.Generator().manual_seed(self.seed + index))
            sample["video_grid_thw"] = grid
            ids += rng.integers(0, 100, 8).tolist() + video_tokens(self.family, grid)
        ids += rng.integers(0, 100, 40).tolist()
        sample["input_ids"] = torch.tensor(ids)
        return sample


def collate(samples: list[dict]) -> dict:
    """Right-padded rows; labels -100 on padding and vision tokens; the vision tensors concatenated in row order."""
    length = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, s in enumerate(samples):
        ids[row, :len(s["input_ids"])], mask[row, :len(s["input_ids"])] = s["input_ids"], 1
    types = torch.zeros_like(ids, dtype=torch.int32)
    types[ids == IMAGE], types[ids == VIDEO] = 1, 2
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill((mask == 0) | (ids >= 100), -100),
             "mm_token_type_ids": types}
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
        if any(key in s for s in samples):
            batch[key] = torch.cat([s[key] for s in samples if key in s])
    return batch


class VisionLanguageFinetune(LightningModule):
    def __init__(self, family: str, samples: int, frames: int, batch_size: int, lr: float) -> None:
        super().__init__()
        self.model = build_model(family)
        self.data = SyntheticVisionText(samples, frames, family=family)
        self.batch_size, self.lr = batch_size, lr

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True, collate_fn=collate)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=FAMILIES, default="qwen3_5")
    parser.add_argument("--sp-size", type=int, default=2)
    parser.add_argument("--frames", type=int, default=8, help="frames of each synthetic video (even)")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    seed_everything(0, verbose=False)
    module = VisionLanguageFinetune(args.family, args.samples, args.frames, args.batch_size, args.lr)
    gpu = torch.cuda.is_available()
    trainer = Trainer(accelerator="gpu" if gpu else "cpu", devices=torch.cuda.device_count() if gpu else args.sp_size,
                      strategy=UlyssesDeepSpeedStrategy(sp_size=args.sp_size, stage=2), max_steps=args.steps,
                      callbacks=[StepProgressBar()], logger=False, enable_checkpointing=False,
                      enable_model_summary=False)
    trainer.fit(module)
    if trainer.is_global_zero:
        print(f"{args.family}: {args.steps} steps under sp_size={args.sp_size}, final"
              f" train_loss={trainer.callback_metrics['train_loss'].item():.3f}")


if __name__ == "__main__":
    main()
