"""Incremental detokenisation for streaming: text deltas that never split a UTF-8 character or an
emoji sequence, and never show any part of a stop string."""

from __future__ import annotations

REPLACEMENT = "\ufffd"


def _is_emoji_part(ch: str) -> bool:
    """Code points that can start or continue an emoji sequence (ZWJ sequences, flags, skin-tone
    modifiers, keycaps, tags), per Unicode TR #51."""
    cp = ord(ch)
    return (
        0x1F000 <= cp <= 0x1FAFF  # pictographs, emoticons, regional indicators, modifiers
        or 0x2600 <= cp <= 0x27BF  # misc symbols, dingbats
        or cp in (0x200D, 0xFE0F, 0x20E3)  # ZWJ, variation selector 16, keycap
        or 0xE0020 <= cp <= 0xE007F  # tag characters (subdivision flags)
        # text-default pictographs that become emoji with VS16 (arrows, technical, shapes, ...)
        or 0x2190 <= cp <= 0x21FF
        or 0x2300 <= cp <= 0x23FF
        or 0x25A0 <= cp <= 0x25FF
        or 0x2900 <= cp <= 0x297F
        or 0x2B00 <= cp <= 0x2BFF
        or cp in _PICTOGRAPHS
    )


#: Other code points that can start an emoji sequence: (c), (r), !!, !?, TM, (i), circled M, wavy
#: dash, part alternation mark, circled ideographs "congratulation" and "secret".
_PICTOGRAPHS = frozenset((0xA9, 0xAE, 0x203C, 0x2049, 0x2122, 0x2139, 0x24C2, 0x3030, 0x303D, 0x3297, 0x3299))

#: Keycap bases: "1" may still become the keycap "1\ufe0f\u20e3" when the next token arrives.
_KEYCAP_BASES = frozenset("0123456789#*")


class TextStream:
    """Turns generated token ids into text deltas.

    ``push(token_id)`` returns the text that is safe to show now; :meth:`finish` returns the rest.
    Joined, the deltas equal :attr:`text`. When a stop string appears, :attr:`stopped` becomes True
    and :attr:`text` ends just before it.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        # the fast tokenizer's Rust decoder directly: the same text without transformers' per-call
        # argument conversion, which every generated token pays
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._decode = (
            (lambda ids: backend.decode(ids, skip_special_tokens=True)) if backend is not None
            else (lambda ids: tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False))
        )
        self.stop = tuple(stop)
        self._pending: list[int] = []
        self._text = ""
        self._emitted = 0
        self.stopped = False

    @property
    def text(self) -> str:
        """All text decoded so far (final once the stream finished or stopped)."""
        return self._text

    def push(self, token_id: int) -> str:
        if self.stopped:
            return ""
        self._pending.append(token_id)
        piece = self._decode(self._pending)
        if piece.endswith(REPLACEMENT):
            return ""  # an incomplete UTF-8 character: wait for the next byte-level token
        self._pending = []
        self._text += piece
        if self._cut_at_stop(len(piece)):
            return self._emit(len(self._text))
        return self._emit(len(self._text) - self._holdback())

    def finish(self) -> str:
        """Flush everything held back (the stream has ended)."""
        if self._pending and not self.stopped:
            self._text += self._decode(self._pending)
            self._pending = []
            self._cut_at_stop(len(self._text))
        return self._emit(len(self._text))

    def _cut_at_stop(self, new_chars: int) -> bool:
        if not self.stop:
            return False
        longest = max(len(s) for s in self.stop)
        start = max(0, len(self._text) - new_chars - longest + 1)
        hits = [i for i in (self._text.find(s, start) for s in self.stop) if i >= 0]
        if not hits:
            return False
        self._text = self._text[: min(hits)]
        self.stopped = True
        return True

    def _holdback(self) -> int:
        text = self._text
        hold = 0
        for s in self.stop:  # the longest tail that could still grow into a stop string
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        emoji = 0
        while emoji < len(text) and _is_emoji_part(text[len(text) - 1 - emoji]):
            emoji += 1
        if emoji < len(text) and text[len(text) - 1 - emoji] in _KEYCAP_BASES:
            emoji += 1
        return max(hold, emoji)

    def _emit(self, upto: int) -> str:
        upto = max(upto, self._emitted)
        delta = self._text[self._emitted : upto]
        self._emitted = upto
        return delta
