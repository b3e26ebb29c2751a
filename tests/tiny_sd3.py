"""Tiny random SD3 pipeline and CLIP reward, saved to a folder: the full-scale classes at toy size,
offline.

Shapes follow diffusers' own SD3 tests (diffusers' own SD3 tests). The tokenizers are a
CLIPTokenizer over single letters written on the spot, so nothing is fetched from the hub.
"""

from pathlib import Path

import torch

from utils.models import letter_clip_tokenizer


def save_tiny_sd3(folder, seed=0):
    """Write folder/sd3 (a StableDiffusion3Pipeline) and folder/clip (a CLIPModel + tokenizer)."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import (
        CLIPConfig,
        CLIPModel,
        CLIPTextConfig,
        CLIPTextModelWithProjection,
        T5Config,
        T5EncoderModel,
    )

    folder = Path(folder)
    tokenizer = letter_clip_tokenizer(folder / "tokenizer")
    torch.manual_seed(seed)
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=1,
        num_attention_heads=4,
        max_position_embeddings=77,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    pipe = StableDiffusion3Pipeline(
        transformer=SD3Transformer2DModel(
            sample_size=32,
            patch_size=1,
            in_channels=4,
            num_layers=1,
            attention_head_dim=8,
            num_attention_heads=4,
            caption_projection_dim=32,
            joint_attention_dim=32,
            pooled_projection_dim=64,
            out_channels=4,
        ),
        vae=AutoencoderKL(
            block_out_channels=(4,),
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",),
            up_block_types=("UpDecoderBlock2D",),
            latent_channels=4,
            norm_num_groups=1,
            sample_size=32,
            shift_factor=0.0609,
            scaling_factor=1.5035,
        ),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        text_encoder=CLIPTextModelWithProjection(CLIPTextConfig(projection_dim=32, **text)),
        tokenizer=tokenizer,
        text_encoder_2=CLIPTextModelWithProjection(CLIPTextConfig(projection_dim=32, **text)),
        tokenizer_2=tokenizer,
        text_encoder_3=T5EncoderModel(
            T5Config(
                vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=37, num_layers=1, num_heads=4
            )
        ),
        tokenizer_3=tokenizer,
    )
    pipe.save_pretrained(folder / "sd3")
    clip = CLIPModel(
        CLIPConfig(
            text_config=text,
            vision_config=dict(
                image_size=32,
                patch_size=8,
                hidden_size=32,
                intermediate_size=37,
                num_hidden_layers=1,
                num_attention_heads=4,
            ),
            projection_dim=16,
        )
    )
    clip.save_pretrained(folder / "clip")
    tokenizer.save_pretrained(folder / "clip")
    return folder / "sd3", folder / "clip"
