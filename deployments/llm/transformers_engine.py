"""The LLM replica of encoder disaggregation (E/PD): prefill/decode on precomputed embeddings.

The model is transformers' own VLM class (`...ForConditionalGeneration`), so prompt
splicing, multimodal rotary positions (from the grids) and Qwen3-VL's deepstack injection
are transformers' code. Qwen: only its vision tower is replaced, by `PrecomputedVision`: a
module that returns the embeddings the encoder replicas computed for this request. InternVL:
its tower and projector are dropped and the embeddings go in as `mm_encoder_outputs`,
transformers' own input for pre-encoded images (used on the prefill step only). The
embeddings arrive as Ray object references, fetched here straight from the encoder
replica that produced them (the router only forwards the references).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time
from collections.abc import AsyncIterator

import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.modeling_outputs import BaseModelOutputWithPooling

from models import family_class, resolve_preset, vlm_config
from models.protocol import ItemOutput
from models.tiny_checkpoint import build_preset_tokenizer

from ..config import AppConfig, LLMSettings
from ..errors import RequestError, log_refusals_in_one_line
from ..process import before_constructor
from ..wire import GenerateRequest, GenerateResult, item_from_wire, resolve_dtype

logger = logging.getLogger("ray.serve")
IMPORTED = time.monotonic()
"""The end of this module's imports, for the replica's ready line."""


class StopWhenSet(StoppingCriteria):
    """Stops generation once the request is cancelled (its client went away)."""

    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


class PrecomputedVision(torch.nn.Module):
    """Stands in for the vision tower: returns the embeddings set for the current request."""

    def __init__(self, spatial_merge_size: int, dtype: torch.dtype, with_deepstack: bool):
        super().__init__()
        self.spatial_merge_size = spatial_merge_size
        self._dtype = dtype
        self.with_deepstack = with_deepstack
        self.current: list[ItemOutput] = []

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def forward(self, pixel_values, grid_thw=None, **kwargs):
        tokens = torch.cat([item.tokens for item in self.current])
        if not self.with_deepstack:
            return BaseModelOutputWithPooling(pooler_output=tokens)
        from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

        layers = torch.cat([item.deepstack for item in self.current], dim=1)
        return BaseModelOutputWithDeepstackFeatures(pooler_output=tokens, deepstack_features=list(layers.unbind(0)))


def load_language_model(settings: LLMSettings, device: str, dtype: torch.dtype):
    """(VLM with its vision tower replaced, tokenizer). Presets get random weights (seeded)."""
    cls = family_class(settings.family)
    if settings.path is not None:
        from transformers import AutoTokenizer

        # from_pretrained reads the whole checkpoint; the tower is dropped right after loading.
        model = cls.vlm_class.from_pretrained(settings.path, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(settings.path)
    else:
        preset = resolve_preset(settings.family, settings.preset)
        torch.manual_seed(settings.seed)
        with torch.device(device):
            model = cls.vlm_class._from_config(vlm_config(preset), dtype=dtype)
        tokenizer = build_preset_tokenizer(preset)
    if settings.family == "internvl":
        model.model.vision_tower = model.model.multi_modal_projector = None
        return model.to(device).eval(), tokenizer
    vision = model.model.visual
    model.model.visual = PrecomputedVision(
        vision.spatial_merge_size, dtype, with_deepstack=hasattr(vision, "deepstack_merger_list")
    )
    del vision
    return model.to(device).eval(), tokenizer


def expand_image_pads(text: str, pad: str, counts: list[int], start: str = "", end: str = "") -> str:
    """Replace the i-th image placeholder with `counts[i]` copies (what the processor does from grids),
    between `start` and `end` (InternVL's `<img>`, `</img>`)."""
    pieces = text.split(pad)
    if len(pieces) - 1 != len(counts):
        raise ValueError(f"prompt has {len(pieces) - 1} image placeholders for {len(counts)} images")
    out = [pieces[0]]
    for count, piece in zip(counts, pieces[1:]):
        out += [start + pad * count + end, piece]
    return "".join(out)


async def fetch_embeddings(refs: list, totals: dict) -> tuple[list[ItemOutput], dict]:
    """(the encoder outputs behind `refs`, this handoff's images, bytes and ms), added to `totals`."""
    start = time.perf_counter()
    # views of the encoder replicas' object stores: moved to the device (copied) before use, never written
    items = [item_from_wire(value) for value in await asyncio.gather(*refs)] if refs else []
    moved = sum(i.nbytes for i in items)
    handoff = {"images": len(items), "bytes": moved, "ms": (time.perf_counter() - start) * 1e3}
    for key in totals:
        totals[key] += handoff[key]
    return items, handoff


class LLMReplica:
    def __init__(self, config: AppConfig):
        start = time.perf_counter()
        before = before_constructor(IMPORTED)
        log_refusals_in_one_line()
        settings = config.llm
        self.device = settings.device
        self.model, self.tokenizer = load_language_model(
            settings, settings.device, resolve_dtype(settings.dtype, settings.device)
        )
        loaded_s = time.perf_counter() - start
        model_config = self.model.config
        self.image_token_id = model_config.image_token_id
        self.video_token_id = getattr(model_config, "video_token_id", None)
        self.pad = self.tokenizer.convert_ids_to_tokens(self.image_token_id)
        self.precomputed = settings.family == "internvl"
        """Embeddings go in as `mm_encoder_outputs` (InternVL), not through a stand-in tower (Qwen)."""
        if self.precomputed:
            self.merge_unit = round(1 / model_config.downsample_ratio) ** 2
            self.image_wrap = (self.tokenizer.start_image_token, self.tokenizer.end_image_token)
            self.embedding_dtype = self.model.dtype
        else:
            self.merge_unit = self.model.model.visual.spatial_merge_size**2
            self.image_wrap = ("", "")
            self.embedding_dtype = self.model.model.visual.dtype
        self._lock = threading.Lock()
        self.handoff_totals = {"images": 0, "bytes": 0, "ms": 0.0}
        self.max_prompt_tokens = settings.max_prompt_tokens
        self.cancelled = 0
        """Generations stopped because their request went away (timed out or disconnected)."""
        logger.info(
            "LLM replica ready in %.1f s (%s on %s, weights %.1f s; before it: imports %.1f s, Serve's setup %.1f s, "
            "%.1f s since its worker process started)",
            time.perf_counter() - start,
            settings.model_id,
            settings.device,
            loaded_s,
            before.imports_s,
            before.setup_s,
            before.process_s,
        )

    async def _fetch(self, request: GenerateRequest) -> tuple[list[ItemOutput], dict]:
        return await fetch_embeddings(request.embeddings, self.handoff_totals)

    def _inputs(self, request: GenerateRequest) -> dict:
        text = self.tokenizer.apply_chat_template(request.messages, tokenize=False, add_generation_prompt=True)
        counts = [t * h * w // self.merge_unit for t, h, w in request.grids]
        ids = torch.tensor([self.tokenizer(expand_image_pads(text, self.pad, counts, *self.image_wrap))["input_ids"]])
        if ids.shape[1] > self.max_prompt_tokens:
            raise RequestError(
                413,
                f"prompt of {ids.shape[1]} tokens (vision tokens included) exceeds "
                f"llm.max_prompt_tokens={self.max_prompt_tokens}",
                param="messages",
            )
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if self.precomputed:
            return {k: v.to(self.device) for k, v in inputs.items()}
        types = (ids == self.image_token_id).long() + 2 * (ids == self.video_token_id).long()
        inputs["mm_token_type_ids"] = types
        if request.grids:
            inputs["pixel_values"] = torch.zeros(1)  # a marker: the stub vision returns the real embeddings
            inputs["image_grid_thw"] = torch.tensor([list(g) for g in request.grids])
        return {k: v.to(self.device) for k, v in inputs.items()}

    def _generate(
        self, request: GenerateRequest, items: list[ItemOutput], streamer=None, cancelled: threading.Event | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompt ids, new ids) for one request; generation runs one request at a time."""
        with self._lock, torch.inference_mode():
            items = [self._to_device(i) for i in items]
            inputs = self._inputs(request)
            if self.precomputed and items:
                tokens = torch.cat([item.tokens for item in items])
                inputs["mm_encoder_outputs"] = {"image": BaseModelOutputWithPooling(pooler_output=tokens)}
            elif not self.precomputed:
                self.model.model.visual.current = items
            sampling = {"do_sample": False}
            if request.temperature > 0:
                if request.seed is not None:
                    torch.manual_seed(request.seed)
                sampling = {"do_sample": True, "temperature": request.temperature, "top_p": request.top_p}
            if request.ignore_eos:  # vLLM's meaning: an end-of-sequence token is generated like any other, not a stop
                sampling["generation_config"] = copy.deepcopy(self.model.generation_config)
                sampling["generation_config"].eos_token_id = []  # not None: generate fills None from the model's
            try:
                out = self.model.generate(
                    **inputs,
                    max_new_tokens=request.max_tokens,
                    streamer=streamer,
                    pad_token_id=self.tokenizer.pad_token_id,
                    stopping_criteria=StoppingCriteriaList([StopWhenSet(cancelled or threading.Event())]),
                    **sampling,
                )
            finally:
                if not self.precomputed:
                    self.model.model.visual.current = []
            return inputs["input_ids"], out[0, inputs["input_ids"].shape[1] :].cpu()

    def _to_device(self, item: ItemOutput) -> ItemOutput:
        dtype = self.embedding_dtype
        # always a copy: the item views the object store's pages, shared with every other reader
        deepstack = None if item.deepstack is None else item.deepstack.to(self.device, dtype, copy=True)
        return ItemOutput(item.tokens.to(self.device, dtype, copy=True), deepstack)

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        items, handoff = await self._fetch(request)
        cancelled = threading.Event()
        try:
            prompt, new = await asyncio.to_thread(self._generate, request, items, None, cancelled)
        except asyncio.CancelledError:  # the caller went away: stop generating, free the model
            cancelled.set()
            self.cancelled += 1
            raise
        ids = new.tolist()
        eos = self.tokenizer.convert_tokens_to_ids(self.tokenizer.eos_token)
        finish = "stop" if ids and ids[-1] == eos and not request.ignore_eos else "length"
        return GenerateResult(
            token_ids=ids,
            text=self.tokenizer.decode(ids, skip_special_tokens=True),
            prompt_tokens=prompt.shape[1],
            vision_tokens=sum(t * h * w // self.merge_unit for t, h, w in request.grids),
            finish_reason=finish,
            handoff=handoff,
        )

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[dict]:
        """Yields {"token_ids": [...], "text": ...} per new token, then a final dict with the result."""
        from transformers.generation.streamers import BaseStreamer

        items, handoff = await self._fetch(request)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        class ToQueue(BaseStreamer):
            first = True

            def put(self, value):
                if self.first:  # the prompt
                    self.first = False
                    return
                loop.call_soon_threadsafe(queue.put_nowait, value.flatten().tolist())

            def end(self):
                pass  # the end is signalled once generation returns or fails (below)

        cancelled = threading.Event()

        def run():
            try:
                return self._generate(request, items, ToQueue(), cancelled)
            finally:  # also when generation raises: the loop below must not wait forever
                loop.call_soon_threadsafe(queue.put_nowait, None)

        task = asyncio.ensure_future(asyncio.to_thread(run))
        generated, emitted = [], ""
        try:
            while (ids := await queue.get()) is not None:
                generated += ids
                text = self.tokenizer.decode(generated, skip_special_tokens=True)
                delta = "" if text.endswith("\ufffd") else text[len(emitted) :]  # wait for whole characters
                emitted += delta
                yield {"token_ids": ids, "text": delta}
        finally:  # the client closed the stream: stop generating
            if not task.done():
                cancelled.set()
        prompt, new = await task
        ids = new.tolist()
        eos = self.tokenizer.convert_tokens_to_ids(self.tokenizer.eos_token)
        yield {
            "done": True,
            "prompt_tokens": prompt.shape[1],
            "completion_tokens": len(ids),
            "vision_tokens": sum(t * h * w // self.merge_unit for t, h, w in request.grids),
            "finish_reason": "stop" if ids and ids[-1] == eos and not request.ignore_eos else "length",
            "handoff": handoff,
        }

    def describe(self) -> dict:
        images = max(1, self.handoff_totals["images"])
        return {
            "family": self.model.config.model_type,
            "handoff_images": self.handoff_totals["images"],
            "handoff_bytes_per_image": self.handoff_totals["bytes"] / images,
            "handoff_ms_per_image": self.handoff_totals["ms"] / images,
            "cancelled_generations": self.cancelled,
        }
