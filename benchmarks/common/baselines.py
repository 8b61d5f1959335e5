"""What a user would deploy instead: the transformers vision tower behind a plain Ray Serve deployment.

`plain`: one request per call. `batched`: the same behind `@serve.batch` (requests concatenated
into one tower call). Both decode and preprocess in the replica with the model's own
processors, run transformers' own tower (sdpa attention, no graphs, no compile), and answer
`/v1/encode` in the same JSON format as the service, or tensors through the handle.
"""

from __future__ import annotations

import asyncio
import base64
import io

import torch
from PIL import Image
from ray import serve
from starlette.requests import Request
from starlette.responses import Response

from deployments.results import EncodeResult
from deployments.router.responses import encode_response_json
from deployments.wire import item_to_wire
from models import from_preset, load_preprocessor, transformers_tower
from models.protocol import ItemOutput

BATCH_SIZE = 32
BATCH_WAIT_S = 0.005


def _image(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data)).convert("RGB")


class TowerReplica:
    """The tower and its processors; `run` encodes a list of items (image bytes or frame lists)."""

    def __init__(self, preset: str, dtype: str = "bfloat16", device: str = "cuda"):
        torch_dtype = getattr(torch, dtype)
        encoder = from_preset(preset, dtype=torch_dtype, device=device)
        self.tower = transformers_tower(encoder)
        self.model_id = encoder.name
        del encoder
        _, self.preprocessor = load_preprocessor(preset)
        self.device = device

    @torch.inference_mode()
    def run(self, items: list) -> list[EncodeResult]:
        """One tower call for all items (images and videos given as frame lists)."""
        pixels, grids, kinds = [], [], []
        for item in items:
            if isinstance(item, list):
                out = self.preprocessor.video_processor(videos=[[_image(f) for f in item]], return_tensors="pt")
                pixels.append(out["pixel_values_videos"])
                grids.append(out["video_grid_thw"][0].tolist())
                kinds.append("video")
            else:
                out = self.preprocessor.image_processor(images=[_image(item)], return_tensors="pt")
                pixels.append(out["pixel_values"])
                grids.append(out["image_grid_thw"][0].tolist())
                kinds.append("image")
        values = torch.cat(pixels).to(self.device, self.tower.dtype)
        out = self.tower(values, grid_thw=torch.tensor(grids, device=self.device))
        deepstack = getattr(out, "deepstack_features", None)
        tokens = out.pooler_output.cpu()
        stacked = torch.stack(deepstack).cpu() if deepstack else None
        results, start = [], 0
        for index, (grid, kind) in enumerate(zip(grids, kinds)):
            count = grid[0] * grid[1] * grid[2] // self.preprocessor.merge_unit
            layers = None if stacked is None else stacked[:, start : start + count]
            output = ItemOutput(tokens[start : start + count], layers)
            results.append(EncodeResult(index, kind, tuple(grid), count, None, _output=output))
            start += count
        return results

    @staticmethod
    def items_from_json(body: dict) -> list:
        return [
            [base64.b64decode(f) for f in item["frames"]]
            if item["type"] == "video"
            else base64.b64decode(item["image"])
            for item in body["items"]
        ]

    def respond(self, results: list[EncodeResult]) -> Response:
        return Response(encode_response_json(self.model_id, results, "base64"), media_type="application/json")


@serve.deployment(max_ongoing_requests=64)
class PlainTower(TowerReplica):
    """One request per tower call."""

    async def __call__(self, request: Request) -> Response:
        items = self.items_from_json(await request.json())
        return self.respond(await asyncio.to_thread(self.run, items))

    async def encode(self, items: list) -> list[dict]:
        return [item_to_wire(r._output) for r in await asyncio.to_thread(self.run, items)]


@serve.deployment(max_ongoing_requests=256)
class BatchedTower(TowerReplica):
    """Requests batched by `@serve.batch` into one tower call."""

    @serve.batch(max_batch_size=BATCH_SIZE, batch_wait_timeout_s=BATCH_WAIT_S)
    async def _batch(self, requests: list[list]) -> list[list[EncodeResult]]:
        flat = [item for items in requests for item in items]
        results = await asyncio.to_thread(self.run, flat)
        out, start = [], 0
        for items in requests:
            mine = results[start : start + len(items)]
            for index, result in enumerate(mine):
                result.index = index
            out.append(mine)
            start += len(items)
        return out

    async def __call__(self, request: Request) -> Response:
        items = self.items_from_json(await request.json())
        return self.respond(await self._batch(items))

    async def encode(self, items: list) -> list[dict]:
        return [item_to_wire(r._output) for r in await self._batch(items)]
