"""Qwen2-VL: full attention over each frame, 2D rotary positions."""

from __future__ import annotations

from transformers.models.qwen2_vl import image_processing_qwen2_vl, video_processing_qwen2_vl
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLConfig, Qwen2VLVisionConfig
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
from transformers.models.qwen2_vl.modeling_qwen2_vl import (
    Qwen2VisionTransformerPretrainedModel,
    Qwen2VLForConditionalGeneration,
)
from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

from .processing import ResizeRules
from .qwen import QwenVisionEncoder


def qwen2_video_rule(num_frames, height, width, factor, temporal_factor, min_pixels, max_pixels):
    """Qwen2-VL's video resize ignores the frame count (the uncapped rule)."""
    return video_processing_qwen2_vl.smart_resize(height, width, factor, min_pixels=min_pixels, max_pixels=max_pixels)


QWEN2_RESIZE_RULES = ResizeRules(image=image_processing_qwen2_vl.smart_resize, video=qwen2_video_rule)


class Qwen2VLEncoder(QwenVisionEncoder):
    family = "qwen2-vl"
    tower_class = Qwen2VisionTransformerPretrainedModel
    config_class = Qwen2VLVisionConfig
    vlm_config_class = Qwen2VLConfig
    vlm_class = Qwen2VLForConditionalGeneration
    image_processor_class = Qwen2VLImageProcessor
    video_processor_class = Qwen2VLVideoProcessor
    resize_rules = QWEN2_RESIZE_RULES
    checkpoint_model_types = ("qwen2_vl", "qwen2_vl_vision")

    @property
    def out_hidden(self) -> int:
        # Qwen2-VL's vision config calls the merger's output width `hidden_size`.
        return self.tower.config.hidden_size
