"""Token ids of media-first prompts, assembled from pieces tokenised once.

``engine.inputs.prompts.media_first_messages(images, question)`` renders, through the checkpoint's chat
template (``engine.tiny.CHAT_TEMPLATE``) with the generation prompt, as::

    <|im_start|>user\\nImage 1: <|vision_start|><|image_pad|><|vision_end|>\\nImage 2: <|vision_start|>...
    <|vision_end|>\\nQuestion: {question}<|im_end|>\\n<|im_start|>assistant\\n

and the processor repeats each ``<|image_pad|>`` once per merged visual token (64 for a 256x256
image). The tokenizer splits the text at special tokens before it applies BPE, so the ids are the
concatenation of the special ids and of the pieces between them, each tokenised on its own:
``user\\nImage 1: ``, ``\\nImage k: ``, ``\\nQuestion: {question}``, ``\\n`` and ``assistant\\n``.
:class:`PromptTokens` tokenises each distinct piece once and caches it; the tests check its ids
against the processor's for many samples. A training target is the answer's ids then ``<|im_end|>``,
what greedy decoding of a right answer produces.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from engine.model.qwen_tokenizer import IM_END_ID, IM_START_ID, IMAGE_PAD_ID, VISION_END_ID, VISION_START_ID
from engine.model.rope import VisualSpan, mrope_positions


@dataclass(frozen=True)
class PromptIds:
    """One prompt's ids and where its images sit.

    Attributes:
        ids: the token ids, generation prompt included.
        spans: one :class:`engine.model.rope.VisualSpan` per image (start index, merged grid).
    """

    ids: list[int]
    spans: list[VisualSpan]

    def positions(self, extra: int = 0) -> torch.Tensor:
        """int64 ``[3, len(ids) + extra]`` M-RoPE positions; the ``extra`` tokens after the prompt
        (the answer) continue as text."""
        return mrope_positions(len(self.ids) + extra, self.spans)[0]


class PromptTokens:
    """Builds prompt and answer ids without running the chat template or the processor.

    Args:
        tokenizer_file: the checkpoint's ``tokenizer.json``.
        merge_size: the vision spatial merge size (2).
        patch_size: the vision patch size (16).
    """

    def __init__(self, tokenizer_file: str | os.PathLike[str], *, merge_size: int = 2, patch_size: int = 16):
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(tokenizer_file))
        self.merge_size, self.patch_size = merge_size, patch_size
        self._pieces: dict[str, list[int]] = {}

    def piece(self, text: str) -> list[int]:
        """Ids of ``text`` (no special tokens in it), tokenised on first use and cached."""
        ids = self._pieces.get(text)
        if ids is None:
            ids = self._pieces[text] = self._tokenizer.encode(text, add_special_tokens=False).ids
        return ids

    def prompt(self, n_images: int, question: str, size: tuple[int, int]) -> PromptIds:
        """The media-first prompt for ``n_images`` images of ``size = (height, width)`` pixels."""
        height, width = size
        grid_h, grid_w = height // (self.patch_size * self.merge_size), width // (self.patch_size * self.merge_size)
        ids, spans = [IM_START_ID], []
        for i in range(n_images):
            ids += self.piece(("user\n" if i == 0 else "\n") + f"Image {i + 1}: ")
            ids.append(VISION_START_ID)
            spans.append(VisualSpan(len(ids), grid_h, grid_w, "image", i))
            ids += [IMAGE_PAD_ID] * (grid_h * grid_w)
            ids.append(VISION_END_ID)
        ids += self.piece(("\n" if n_images else "user\n") + f"Question: {question}")
        ids += [IM_END_ID, *self.piece("\n"), IM_START_ID, *self.piece("assistant\n")]
        return PromptIds(ids, spans)

    def target(self, answer: str) -> list[int]:
        """The ids a right answer is decoded as: the answer's tokens, then ``<|im_end|>``."""
        return [*self.piece(answer), IM_END_ID]

    def decode(self, ids: list[int]) -> str:
        """Text of generated ids, special tokens dropped."""
        return self._tokenizer.decode(ids, skip_special_tokens=True)
