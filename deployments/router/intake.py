"""The router's intake: request items -> checked, decoded, resized items, through the decode pool.

Every item is inspected (headers only) in parallel; then the request as a whole is checked
(tokens, room in the queue); only then are the items decoded, again in parallel. Nothing of
an item's bytes is parsed in the router process itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import torch
from PIL import Image

from models.protocol import ItemSpec

from ..config import AppConfig
from ..decode import media
from ..decode.pool import SMALL_BYTES, SMALL_PIXELS, DecodePool, Template, WorkerSetup
from ..errors import RequestError, item_error
from .schemas import ImageItem

IMAGE_TYPES = (bytes, bytearray, memoryview, Image.Image)


def raw_from_http(index: int, item) -> media.RawItem:
    """A `/v1/encode` item (base64 text; decoded in a worker)."""
    if isinstance(item, ImageItem):
        return media.RawItem(index, "image", item.image)
    if (item.frames is None) == (item.video is None):
        raise item_error(index, 400, "a video item needs exactly one of 'frames' or 'video'")
    if item.video is not None:
        return media.RawItem(index, "video", item.video)
    return media.RawItem(index, "frames", item.frames)


def raw_from_python(index: int, item) -> media.RawItem:
    """A handle item: a PIL image, encoded image bytes, or a video dict of frames or file bytes."""
    if isinstance(item, dict) and item.get("type") == "image":
        item = item.get("image")
    if isinstance(item, IMAGE_TYPES):
        return media.RawItem(index, "image", item)
    if isinstance(item, dict) and item.get("type") == "video":
        frames, video = item.get("frames"), item.get("video")
        if isinstance(frames, list) and all(isinstance(f, IMAGE_TYPES) for f in frames):
            return media.RawItem(index, "frames", frames)
        if isinstance(video, (bytes, bytearray, memoryview)):
            return media.RawItem(index, "video", bytes(video))
    raise item_error(
        index,
        400,
        f"unsupported item {type(item).__name__}; pass a PIL image, encoded image bytes, "
        '{"type": "video", "frames": [...]} or {"type": "video", "video": <file bytes>}',
    )


def _size(raw: media.RawItem) -> int:
    data = raw.data if raw.kind != "frames" else None
    if isinstance(data, (str, bytes, bytearray)):
        return len(data)
    return SMALL_BYTES + 1  # frames and PIL images: not the reserved worker's work


class Intake:
    def __init__(self, config: AppConfig):
        self.config = config
        self.limits = config.limits
        router = config.router
        self.pool = DecodePool(
            WorkerSetup(config.model, config.limits),
            router.decode_workers,
            router.decode_timeout_s,
            router.max_decode_queue,
        )

    def start(self, template: Template | None = None) -> None:
        self.pool.start(template)

    def check_item_count(self, count: int) -> None:
        limit = self.limits.max_items_per_request
        if count > limit:
            raise RequestError(413, f"{count} items exceeds max_items_per_request={limit}", "items")

    def from_python(self, items) -> list[media.RawItem]:
        """The handle's `items` argument as raw items: a list (or tuple), within the item limit."""
        if not isinstance(items, (list, tuple)):
            raise RequestError(
                400,
                f"items must be a list of items, not {type(items).__name__}: PIL images, encoded image bytes "
                'or {"type": "video", ...} dicts (one item: [item])',
                "items",
            )
        self.check_item_count(len(items))
        return [raw_from_python(index, item) for index, item in enumerate(items)]

    async def decode(
        self,
        raws: list[media.RawItem],
        check_room: Callable[[int], None],
        key_prefix: str | None,
        check_specs: Callable[[list[ItemSpec]], None] | None = None,
    ) -> list[media.DecodedItem]:
        """Inspect every item, check the request (`check_specs(specs)`, the caller's own check, and
        `check_room(tokens)` may refuse it), decode. `key_prefix` None: no content keys (the request
        opted out of the cache)."""
        self.check_item_count(len(raws))
        found = await self._all(
            self.pool.run("inspect", (raw,), raw.index, small=_size(raw) <= SMALL_BYTES) for raw in raws
        )
        specs = [f.spec for f in found]
        if check_specs is not None:
            check_specs(specs)
        media.check_request_tokens(specs, self.limits)
        check_room(sum(spec.output_tokens for spec in specs))
        decoded = await self._all(
            self.pool.run(
                "decode",
                (raw, f, key_prefix),
                raw.index,
                pixels=f.source_pixels,
                small=f.source_pixels <= SMALL_PIXELS,
            )
            for raw, f in zip(raws, found)
        )
        return [media.DecodedItem(torch.from_numpy(d.pixels), d.spec, d.key) for d in decoded]

    @staticmethod
    async def _all(jobs) -> list[Any]:
        """Run jobs together; on the first failure cancel the rest (they are dropped if still queued)
        and raise the error of the lowest item index among those that failed."""
        tasks = [asyncio.ensure_future(job) for job in jobs]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException as error:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            failed = [t.exception() for t in tasks if t.done() and not t.cancelled() and t.exception() is not None]
            raise (failed[0] if failed else error) from None

    def describe(self) -> dict:
        return self.pool.describe()

    def close(self) -> None:
        self.pool.close()
