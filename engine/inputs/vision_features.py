"""The vision-feature lookup for a prompt: each image's features from the session's vision-feature
cache, or from the vision encoder (eager, or through its CUDA graphs), videos always encoded."""

from __future__ import annotations

import torch

from ..cache.vision_cache import VisionCache
from ..errors import PrismError
from ..graphs.vision import VisionGraphs
from ..model.vision import VisionFeatures, span_features
from .prompts import Prompt


class VisionLookup:
    """Vision features of prompts' images and videos, keyed per session.

    Args:
        encoder: ``(pixels, grids) -> VisionFeatures`` (the model's eager ``encode_vision``), or a
            :class:`~engine.graphs.vision.VisionGraphs`, which also takes the request's salt.
        cache: the per-session LRU of per-image features.
        namespace: the model namespace (part of every cache key).
        merge_size: the vision tower's spatial merge (patches per feature row: its square).
        device: where the features are gathered.

    Attributes:
        encoder: as given; tests and benchmarks may replace it (same call signature).
        cache: as given.
    """

    def __init__(self, encoder, cache: VisionCache, namespace: str, merge_size: int, device: torch.device):
        self.encoder = encoder
        self.cache = cache
        self.namespace = namespace
        self.merge_size = merge_size
        self.device = device

    def encode_prompt(self, prompt: Prompt, salt: str = "") -> tuple[VisionFeatures, bool]:
        """Vision features of all of a prompt's visual tokens, in prompt order
        (``prompt.visual_rows()``), and whether the encoder had to run."""
        items = [("image", i) for i in range(len(prompt.image_grids))]
        items += [("video", i) for i in range(len(prompt.video_grids))]
        features, ran = self.encode_items(prompt, salt, items)
        return span_features(prompt.spans, features, 0, len(prompt.input_ids), self.device)[1], ran

    def encode_items(self, prompt: Prompt, salt: str, items: list[tuple[str, int]]) -> tuple[dict, bool]:
        """Vision features of some of a prompt's images and videos.

        Args:
            items: ``("image", i)`` / ``("video", i)`` keys.

        Returns:
            ``(features by key, whether the encoder ran)``: an image's features come from the
            session's (``salt``'s) vision-feature cache when present; videos are always encoded.
        """
        images = [i for kind, i in items if kind == "image"]
        out, ran = {}, False
        if images:
            features, ran = self._image_features(prompt, salt, images)
            out.update({("image", i): f for i, f in zip(images, features, strict=True)})
        patches = [t * h * w for t, h, w in prompt.video_grids]
        for kind, i in items:
            if kind == "video":
                start = sum(patches[:i])
                pixels = prompt.pixel_values_videos[start : start + patches[i]]
                out[("video", i)] = self._encode_pixels(pixels, [prompt.video_grids[i]], salt)
                ran = True
        return out, ran

    def forget(self, salt: str) -> tuple[int, int]:
        """Drop the salt's vision features and, with CUDA graphs, its graphs and sightings:
        ``(features dropped, graphs dropped)``."""
        graphs = self.encoder.forget(salt) if isinstance(self.encoder, VisionGraphs) else 0
        return self.cache.forget(salt), graphs

    def counters(self) -> dict:
        """The lookup's part of :meth:`Engine.stats() <engine.Engine.stats>`: the vision-feature
        cache's hits and entries; with the encoder's CUDA graphs, their eager runs, captures and
        replays."""
        out = {"vision_cache_hits": self.cache.hits, "vision_cache_entries": len(self.cache)}
        graphs = self.encoder
        if isinstance(graphs, VisionGraphs):
            out |= {"vision_graph_eager_runs": graphs.eager_runs, "vision_graph_captures": graphs.captures,
                    "vision_graph_replays": graphs.replays}
        return out

    def _image_features(self, prompt: Prompt, salt: str, indices: list[int]) -> tuple[list[VisionFeatures], bool]:
        """Features of the prompt's images ``indices``: from the session's vision-feature cache,
        the others encoded together. Returns them in order and whether the encoder ran."""
        merge2 = self.merge_size ** 2
        keys = [(salt, f"{self.namespace}|{prompt.image_hashes[i]}|{prompt.image_grids[i]}") for i in indices]
        found = [self.cache.get(k) for k in keys]
        missing = [j for j, f in enumerate(found) if f is None]
        if missing:
            if any(prompt.image_pixels[indices[j]] is None for j in missing):
                # the scheduler processes deferred images before it admits a prompt that computes
                raise PrismError("internal error: an image's patches were deferred and never processed")
            pixels = torch.cat([prompt.image_pixels[indices[j]] for j in missing])
            fresh = self._encode_pixels(pixels, [prompt.image_grids[indices[j]] for j in missing], salt)
            offset = 0
            for j in missing:
                n = prompt.image_pixels[indices[j]].shape[0] // merge2
                found[j] = fresh.select(torch.arange(offset, offset + n, device=self.device))
                self.cache.put(keys[j], found[j])
                offset += n
        return found, bool(missing)

    def _encode_pixels(self, pixels: torch.Tensor, grids: list, salt: str) -> VisionFeatures:
        """The vision encoder on ``pixels``; its CUDA graphs are the salt's own (a graph another
        session earned would replay faster and tell which image sizes it sent)."""
        encoder = self.encoder
        if isinstance(encoder, VisionGraphs):
            return encoder(pixels, grids, salt)
        return encoder(pixels, grids)
