"""Streaming: :class:`engine.serving.detokenize.TextStream` with the real Qwen byte-level BPE, and
``Engine.stream`` end to end (deltas, ``max_tokens``, stop strings, end-of-sequence tokens).

A delta boundary must never fall inside a UTF-8 character or a grapheme cluster holding an emoji
(skin tones, ZWJ sequences, flags, keycaps; other clusters, e.g. Devanagari, may be split), and
must never expose text that a stop string later removes: every prefix of the stream is a prefix
of the final text.
"""

from __future__ import annotations

import json

import pytest
import regex
from conftest import TEST_DEVICE

from engine import Completion, Engine, SamplingParams
from engine.serving.detokenize import TextStream

ZWJ, VS16, KEYCAP = "\u200d", "\ufe0f", "\u20e3"

TEXTS = [
    "你好，世界！今天天气很好。",
    "Nice 👍🏽 job",
    "Family: 👨‍👩‍👧‍👦!",
    "Flags 🇯🇵🇫🇷 ok",
    "Press 1️⃣ now",
    "Café ☕️ costs €3 — 日本語 🇯🇵 and 👩🏽‍💻 coding ❤️ ✨ done",
    "Ends with an emoji 👍🏽",
    "👨‍👩‍👧‍👦👨‍👩‍👧‍👦🇯🇵🇫🇷🇩🇪1️⃣#️⃣",
    "Rare CJK 𠮷野家 and 🏳️‍🌈 flag, ▶️ play, 2024 © ™️",
    "Mixed: naïve café, Ελληνικά, русский, עברית, हिन्दी — 🤖 says hi.",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_ckpt):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(tiny_ckpt)).tokenizer


def encode(tokenizer, text: str) -> list[int]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text, "the tokenizer should round-trip the sample text"
    return ids


def run_stream(tokenizer, ids, stop=()):
    """Push ``ids`` one by one; return (deltas incl. the final flush, stream)."""
    stream = TextStream(tokenizer, tuple(stop))
    deltas = []
    for i in ids:
        deltas.append(stream.push(i))
        if stream.stopped:
            break
    deltas.append(stream.finish())
    return deltas, stream


EMOJI = regex.compile(r"[\p{Extended_Pictographic}\p{Regional_Indicator}\u20e3]")


def emoji_clusters(text: str) -> list[tuple[int, int]]:
    """(start, end) of each grapheme cluster of ``text`` that holds an emoji."""
    return [m.span() for m in regex.finditer(r"\X", text) if EMOJI.search(m.group())]


def is_regional(ch: str) -> bool:
    return 0x1F1E6 <= ord(ch) <= 0x1F1FF


def continues_emoji(ch: str) -> bool:
    """Code points that never start a grapheme: they continue the emoji before them."""
    cp = ord(ch)
    return ch in (ZWJ, VS16, KEYCAP) or 0x1F3FB <= cp <= 0x1F3FF or 0xE0020 <= cp <= 0xE007F


def check_boundaries(text: str, deltas: list[str]) -> None:
    """No delta boundary lies inside a UTF-8 character or an emoji sequence."""
    clusters = emoji_clusters(text)
    at = 0
    for n, delta in enumerate(deltas):
        assert "\ufffd" not in delta, f"delta {n} {delta!r} holds a broken UTF-8 character"
        at += len(delta)
        if not delta or at == len(text):
            continue
        before, after = text[at - 1], text[at]
        where = f"delta {n} {delta!r} ends inside {text[max(0, at - 4) : at + 4]!r}"
        assert not any(start < at < end for start, end in clusters), where
        assert before != ZWJ, where
        assert not continues_emoji(after), where
        run = 0  # regional indicators pair up into flags: never end after an odd number of them
        while run < at and is_regional(text[at - 1 - run]):
            run += 1
        assert run % 2 == 0 or not is_regional(after), where


# --------------------------------------------------------------------------------------------
# TextStream with the real tokenizer
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_join_to_the_text(tokenizer, text):
    ids = encode(tokenizer, text)
    deltas, stream = run_stream(tokenizer, ids)
    assert "".join(deltas) == stream.text == text
    assert not stream.stopped
    check_boundaries(text, deltas)


def test_samples_really_split_characters(tokenizer):
    """The samples exercise the hard cases: tokens holding part of a UTF-8 character and emoji
    sequences spread over several tokens."""
    broken = sum(
        "\ufffd" in tokenizer.decode([i]) for text in TEXTS for i in encode(tokenizer, text)
    )
    assert broken > 20
    for seq in ("👍🏽", "👨‍👩‍👧‍👦", "🇯🇵🇫🇷", "1️⃣"):
        assert len(encode(tokenizer, seq)) > 1


def test_tokens_one_byte_at_a_time(tokenizer):
    """Each byte of a character as its own token (a model may generate any token sequence)."""
    from engine.model.qwen_tokenizer import _byte_alphabet

    text = "a👨‍👩‍👧‍👦b你c1️⃣d🇯🇵e👍🏽"
    alphabet = _byte_alphabet()  # byte-level BPE: every byte has a token of its own
    ids = [tokenizer.convert_tokens_to_ids(alphabet[b]) for b in text.encode()]
    assert len(ids) == len(text.encode()) and tokenizer.decode(ids) == text
    deltas, stream = run_stream(tokenizer, ids)
    assert "".join(deltas) == stream.text == text
    check_boundaries(text, deltas)


def test_push_returns_progress(tokenizer):
    """Plain text is streamed as it comes, not only at the end."""
    text = "The quick brown fox jumps over the lazy dog and keeps on running."
    deltas, _ = run_stream(tokenizer, encode(tokenizer, text))
    assert sum(1 for d in deltas[:-1] if d) >= len(deltas) // 2
    assert deltas[-1] == "" or len(deltas[-1]) < 10


def test_special_tokens_are_not_shown(tokenizer):
    ids = encode(tokenizer, "Hello") + [151645] + encode(tokenizer, " world")  # <|im_end|>
    deltas, stream = run_stream(tokenizer, ids)
    assert "".join(deltas) == stream.text == "Hello world"


# --------------------------------------------------------------------------------------------
# Stop strings in TextStream
# --------------------------------------------------------------------------------------------


def check_stop(tokenizer, text: str, stop, expected: str | None = None):
    ids = encode(tokenizer, text)
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    if expected is None:
        expected = text[: min(i for i in (text.find(s) for s in stops) if i >= 0)]
    stream = TextStream(tokenizer, stops)
    shown = ""
    for i in ids:
        shown += stream.push(i)
        assert expected.startswith(shown), f"{shown!r} shows text beyond the final {expected!r}"
        if stream.stopped:
            break
    shown += stream.finish()
    assert stream.stopped
    assert shown == stream.text == expected
    return stream


def test_stop_string_spanning_several_tokens(tokenizer):
    stop = "<<END-OF-ANSWER>>"
    assert len(encode(tokenizer, stop)) >= 4
    text = "The answer is 42. <<END-OF-ANSWER>> and then some more"
    check_stop(tokenizer, text, stop)


def test_stop_prefix_that_does_not_complete_is_released(tokenizer):
    stop = "STOP!"
    text = "STOP? no, ST, STO and STOP. STOP!!! trailing"
    check_stop(tokenizer, text, stop, expected="STOP? no, ST, STO and STOP. ")
    # never completed: everything is shown in the end
    deltas, stream = run_stream(tokenizer, encode(tokenizer, "ending with STOP"), stop=("STOP!",))
    assert "".join(deltas) == stream.text == "ending with STOP"
    assert not stream.stopped


def test_stop_string_at_the_very_start(tokenizer):
    stream = check_stop(tokenizer, "STOP right away, please", "STOP", expected="")
    assert stream.text == ""


def test_earliest_of_two_stop_strings_wins(tokenizer):
    text = "alpha beta gamma delta"
    check_stop(tokenizer, text, ("delta", "beta"), expected="alpha ")
    check_stop(tokenizer, text, ("beta", "delta"), expected="alpha ")
    # both complete in the same token: the one that starts first wins
    check_stop(tokenizer, "xx a long stop here", ("stop", "a long stop"), expected="xx ")


@pytest.mark.parametrize(
    ("text", "stop"),
    [
        ("你好，世界！再见", "世界"),
        ("Great 👍🏽 thanks", "👍🏽"),
        ("Great 👍🏽 thanks", "🏽 thanks"),  # the stop string starts inside an emoji sequence
        ("Family 👨‍👩‍👧‍👦 time", "‍👧"),
        ("line one\nline two\n\nline three", "\n\n"),
    ],
)
def test_stop_strings_with_unicode(tokenizer, text, stop):
    check_stop(tokenizer, text, stop)


def test_pushes_after_stop_are_ignored(tokenizer):
    stream = TextStream(tokenizer, ("cut",))
    out = "".join(stream.push(i) for i in encode(tokenizer, "before cut after"))
    out += stream.push(encode(tokenizer, "more")[0]) + stream.finish()
    assert stream.stopped and out == stream.text == "before "


# --------------------------------------------------------------------------------------------
# Engine.stream end to end
# --------------------------------------------------------------------------------------------

QUESTION = [{"role": "user", "content": "Tell me a long story about a robot."}]


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    with Engine.from_pretrained(tiny_ckpt, device=TEST_DEVICE, progress=False) as eng:
        yield eng


@pytest.fixture(scope="module")
def free_run(engine):
    """A greedy run of 40 tokens with no stop condition: (deltas, completion)."""
    items = list(engine.stream(QUESTION, SamplingParams(max_tokens=40, ignore_eos=True)))
    return items[:-1], items[-1]


def test_stream_yields_deltas_then_one_completion(free_run):
    deltas, done = free_run
    assert isinstance(done, Completion)
    assert deltas and all(isinstance(d, str) and d for d in deltas)
    assert "".join(deltas) == done.text
    assert len(done.token_ids) == 40
    assert done.finish_reason == "length"
    assert done.telemetry.generated_tokens == 40


@pytest.mark.parametrize("max_tokens", [1, 2, 7])
def test_max_tokens_counts_generated_tokens_only(engine, free_run, max_tokens):
    items = list(engine.stream(QUESTION, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    done = items[-1]
    assert isinstance(done, Completion) and all(isinstance(d, str) for d in items[:-1])
    assert len(done.token_ids) == max_tokens
    assert done.finish_reason == "length"
    assert len(done.prompt_token_ids) > max_tokens
    assert done.token_ids == free_run[1].token_ids[:max_tokens], "greedy decoding is deterministic"
    assert "".join(items[:-1]) == done.text


def test_generate_equals_stream(engine, free_run):
    done = engine.generate(QUESTION, SamplingParams(max_tokens=40, ignore_eos=True))
    assert done.token_ids == free_run[1].token_ids
    assert done.text == free_run[1].text


def _stop_from(text: str) -> str:
    """A short substring of ``text`` from its middle, free of replacement characters."""
    for length in (4, 3, 2):
        for start in range(len(text) // 3, len(text) - length):
            piece = text[start : start + length]
            if "\ufffd" not in piece and piece.strip() and text.find(piece) >= len(text) // 4:
                return piece
    pytest.skip(f"no usable stop string in {text!r}")


def test_stop_string_from_an_earlier_run(engine, free_run, tokenizer):
    full = free_run[1]
    stop = _stop_from(full.text)
    expected = full.text[: full.text.find(stop)]
    items = list(engine.stream(QUESTION, SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop])))
    deltas, done = items[:-1], items[-1]
    assert done.finish_reason == "stop"
    assert done.text == expected, f"stop {stop!r}"
    assert "".join(deltas) == expected
    shown = ""
    for d in deltas:
        shown += d
        assert expected.startswith(shown)
    assert done.token_ids == full.token_ids[: len(done.token_ids)]
    assert len(done.token_ids) < 40
    # generation ended at the token that completed the stop string: the tokens before it do not hold it
    ids = full.token_ids
    n = len(done.token_ids)
    assert stop in tokenizer.decode(ids[:n]) and stop not in tokenizer.decode(ids[: n - 1])


def test_stop_string_not_in_output_runs_to_length(engine, free_run):
    done = engine.generate(QUESTION, SamplingParams(max_tokens=40, ignore_eos=True, stop=["\u2603never\u2603"]))
    assert done.finish_reason == "length"
    assert done.text == free_run[1].text


@pytest.fixture(scope="module")
def eos_setup(tiny_ckpt, free_run, tmp_path_factory):
    """An engine on a copy of the tiny checkpoint whose EOS id is the free run's 3rd token."""
    tokens = free_run[1].token_ids
    eos = tokens[2]
    folder = tmp_path_factory.mktemp("tiny-eos")
    for f in tiny_ckpt.iterdir():
        if f.name != "generation_config.json":
            (folder / f.name).symlink_to(f)
    gen = json.loads((tiny_ckpt / "generation_config.json").read_text())
    gen["eos_token_id"] = [eos]
    (folder / "generation_config.json").write_text(json.dumps(gen))
    with Engine.from_pretrained(folder, device=TEST_DEVICE, progress=False) as eng:
        yield eng, eos, tokens.index(eos)


def test_eos_ends_generation(eos_setup, free_run, tokenizer):
    engine, eos, at = eos_setup
    assert eos in engine.eos_token_ids
    items = list(engine.stream(QUESTION, SamplingParams(max_tokens=40)))
    deltas, done = items[:-1], items[-1]
    assert done.finish_reason == "stop"
    assert done.token_ids == free_run[1].token_ids[: at + 1], "generation ends at the EOS token, which is included"
    assert done.token_ids[-1] == eos
    expected = tokenizer.decode(done.token_ids[:-1], skip_special_tokens=True)
    assert done.text == expected == "".join(deltas), "the EOS token is not part of the text"
    # ignore_eos keeps going
    done = engine.generate(QUESTION, SamplingParams(max_tokens=10, ignore_eos=True))
    assert done.finish_reason == "length" and len(done.token_ids) == 10
    assert done.token_ids == free_run[1].token_ids[:10]
