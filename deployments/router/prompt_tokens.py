"""A chat prompt's length in the LLM's tokens, counted in the router before any image is encoded.

The LLM replica tokenizes the chat template's text, with one placeholder token per image, after
expanding each placeholder to the image's vision tokens (InternVL: between `<img>` and `</img>`),
as `llm.LLMReplica._inputs` does. The placeholder and the wrap are special tokens, which the
tokenizer splits out before anything else: so the prompt's length is the text's with one
placeholder each, plus each image's vision tokens less its placeholder, plus its wrap.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..config import LLMSettings


@functools.cache
def llm_tokenizer(family: str, preset: str, path: str | None):
    """The LLM replica's tokenizer (a checkpoint's, or the preset's own), loaded once per process."""
    if path is not None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    from models import resolve_preset
    from models.tiny_checkpoint import build_preset_tokenizer

    return build_preset_tokenizer(resolve_preset(family, preset))


@dataclass(frozen=True)
class PromptText:
    """A chat prompt's tokens before its images' vision tokens are known."""

    text_tokens: int
    """The chat template's text, with one placeholder token per image."""
    tokens_per_image: int
    """Tokens each image adds besides its vision tokens (its wrap, less its placeholder)."""

    def total(self, vision_tokens: list[int]) -> int:
        """The prompt's tokens once its images' vision tokens are known."""
        return self.text_tokens + sum(vision_tokens) + self.tokens_per_image * len(vision_tokens)


def count_text(settings: LLMSettings, messages: list[dict]) -> PromptText:
    """Tokenize the chat template's text as the LLM replica does (blocking: run it off the event loop)."""
    tokenizer = llm_tokenizer(settings.family, settings.preset, settings.path)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    wrap = 0
    if settings.family == "internvl":
        wrapped = tokenizer.start_image_token + tokenizer.end_image_token
        wrap = len(tokenizer(wrapped, add_special_tokens=False)["input_ids"])
    return PromptText(len(tokenizer(text)["input_ids"]), wrap - 1)
