"""The real Qwen2/Qwen3 byte-level BPE tokenizer, rebuilt offline for the tiny checkpoints
(:mod:`engine.model.tiny`), with Qwen3-VL's added tokens and chat template.

The 151,643 BPE ranks come from the ``qwen.tiktoken`` file shipped inside the PyPI package
``dashscope`` (Apache-2.0); install it with ``pip install --no-deps dashscope==2.0.2``.  The BPE
merges are recovered by replaying BPE over the ranks, and the result is cached (see
:func:`tokenizer_cache_dir`) so that later builds only copy files.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import os
import pathlib
import shutil
import tempfile
from typing import Any

from ..errors import CheckpointError

# --------------------------------------------------------------------------------------------
# Token ids, the split pattern and the chat template
# --------------------------------------------------------------------------------------------

#: Number of ordinary (byte-level BPE) tokens: ids 0 .. 151642.
NUM_BPE_TOKENS = 151643

#: The added tokens of Qwen3-VL, as (content, id, special).  ``special`` tokens are dropped by
#: ``decode(skip_special_tokens=True)``; the tool/FIM/think tokens are not special in Qwen3.
ADDED_TOKENS: tuple[tuple[str, int, bool], ...] = (
    ("<|endoftext|>", 151643, True),
    ("<|im_start|>", 151644, True),
    ("<|im_end|>", 151645, True),
    ("<|object_ref_start|>", 151646, True),
    ("<|object_ref_end|>", 151647, True),
    ("<|box_start|>", 151648, True),
    ("<|box_end|>", 151649, True),
    ("<|quad_start|>", 151650, True),
    ("<|quad_end|>", 151651, True),
    ("<|vision_start|>", 151652, True),
    ("<|vision_end|>", 151653, True),
    ("<|vision_pad|>", 151654, True),
    ("<|image_pad|>", 151655, True),
    ("<|video_pad|>", 151656, True),
    ("<tool_call>", 151657, False),
    ("</tool_call>", 151658, False),
    ("<|fim_prefix|>", 151659, False),
    ("<|fim_middle|>", 151660, False),
    ("<|fim_suffix|>", 151661, False),
    ("<|fim_pad|>", 151662, False),
    ("<|repo_name|>", 151663, False),
    ("<|file_sep|>", 151664, False),
    ("<tool_response>", 151665, False),
    ("</tool_response>", 151666, False),
    ("<think>", 151667, False),
    ("</think>", 151668, False),
)

ENDOFTEXT_ID = 151643
IM_START_ID = 151644
IM_END_ID = 151645
VISION_START_ID = 151652
VISION_END_ID = 151653
IMAGE_PAD_ID = 151655
VIDEO_PAD_ID = 151656

#: The pre-tokenizer split pattern of Qwen2/Qwen3 (single digits, unlike GPT-4's 1-3 digits).
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

#: Bump when the tokenizer files written by :func:`_build_tokenizer_files` change, so that stale
#: caches are not reused.
_TOKENIZER_FORMAT = 1
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt")

#: Chat template rendering what Qwen3-VL's instruct template renders for plain conversations:
#: ``<|im_start|>{role}\n{content}<|im_end|>\n`` per turn, image and video parts replaced by
#: their vision placeholders, no default system prompt.  ``add_vision_id`` prefixes each image
#: with ``Picture N: `` and each video with ``Video N: `` (counting across the conversation).
CHAT_TEMPLATE = (
    "{%- set counts = namespace(image=0, video=0) -%}\n"
    "{%- for message in messages -%}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}\n"
    "{%- if message['content'] is string -%}\n"
    "{{- message['content'] -}}\n"
    "{%- elif message['content'] is not none -%}\n"
    "{%- for part in message['content'] -%}\n"
    "{%- if part['type'] == 'image' or 'image' in part or 'image_url' in part -%}\n"
    "{%- set counts.image = counts.image + 1 -%}\n"
    "{%- if add_vision_id -%}{{- 'Picture ' + counts.image|string + ': ' -}}{%- endif -%}\n"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}\n"
    "{%- elif part['type'] == 'video' or 'video' in part -%}\n"
    "{%- set counts.video = counts.video + 1 -%}\n"
    "{%- if add_vision_id -%}{{- 'Video ' + counts.video|string + ': ' -}}{%- endif -%}\n"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}\n"
    "{%- elif 'text' in part -%}\n"
    "{{- part['text'] -}}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- endif -%}\n"
    "{{- '<|im_end|>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "{{- '<|im_start|>assistant\\n' -}}\n"
    "{%- endif -%}\n"
)


# --------------------------------------------------------------------------------------------
# Rebuilding the tokenizer files
# --------------------------------------------------------------------------------------------


def qwen_tiktoken_path() -> pathlib.Path:
    """Return the path of ``qwen.tiktoken`` inside the installed ``dashscope`` package.

    The package is located without importing it (its dependencies need not be installed).
    Raises :class:`CheckpointError` with install instructions if it is missing.
    """
    spec = importlib.util.find_spec("dashscope")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = pathlib.Path(location) / "resources" / "qwen.tiktoken"
        if path.is_file():
            return path
    raise CheckpointError(
        "the Qwen tokenizer ranks (dashscope/resources/qwen.tiktoken) were not found; "
        "install them with: pip install --no-deps dashscope==2.0.2"
    )


def _read_ranks(path: pathlib.Path) -> list[bytes]:
    tokens: list[bytes | None] = [None] * NUM_BPE_TOKENS
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token_b64, rank_text = line.split()
                rank = int(rank_text)
                tokens[rank] = base64.b64decode(token_b64, validate=True)
            except (ValueError, IndexError) as exc:
                raise CheckpointError(f"{path}:{line_no}: not a 'base64 rank' line of {NUM_BPE_TOKENS} ranks") from exc
    if any(t is None for t in tokens):
        raise CheckpointError(f"{path}: expected ranks 0..{NUM_BPE_TOKENS - 1}, some are missing")
    return tokens  # type: ignore[return-value]


def _byte_alphabet() -> list[str]:
    """The printable stand-in character of each byte value, as used by byte-level BPE (GPT-2).

    Bytes that are printable Latin-1 characters stand for themselves; the others (controls,
    space, soft hyphen, ...) are given the code points from 256 upwards, in byte order.
    """
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    alphabet, extra = [], 0
    for b in range(256):
        if b in keep:
            alphabet.append(chr(b))
        else:
            alphabet.append(chr(256 + extra))
            extra += 1
    return alphabet


def _recover_merges(tokens: list[bytes]) -> list[tuple[bytes, bytes]]:
    """Recover the ordered BPE merges from token ranks.

    A token of rank r was created by merging two lower-ranked tokens.  Running BPE over its bytes
    with only the ranks below r must stop at exactly two parts: that pair is its merge.  Merges are
    returned in rank order, which is the priority order a BPE merge list uses.
    """
    rank = {tok: r for r, tok in enumerate(tokens)}
    merges = []
    for r, tok in enumerate(tokens):
        if len(tok) == 1:
            continue
        parts = [tok[i : i + 1] for i in range(len(tok))]
        while len(parts) > 2:
            best, at = r, -1
            for i in range(len(parts) - 1):
                pr = rank.get(parts[i] + parts[i + 1], r)
                if pr < best:
                    best, at = pr, i
            if at < 0:
                break
            parts[at : at + 2] = [parts[at] + parts[at + 1]]
        if len(parts) != 2:
            raise CheckpointError(f"token rank {r} ({tok!r}) cannot be formed by merging lower-ranked tokens")
        merges.append((parts[0], parts[1]))
    return merges


def _build_tokenizer_files(tiktoken_path: pathlib.Path, out_dir: pathlib.Path) -> None:
    """Write tokenizer.json, vocab.json and merges.txt for the Qwen BPE into ``out_dir``."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    tokens = _read_ranks(tiktoken_path)
    alphabet = _byte_alphabet()

    def show(b: bytes) -> str:
        return "".join(alphabet[x] for x in b)

    vocab = {show(tok): r for r, tok in enumerate(tokens)}
    if len(vocab) != NUM_BPE_TOKENS:
        raise CheckpointError(f"{tiktoken_path}: duplicate tokens in the ranks")
    merges = [(show(a), show(b)) for a, b in _recover_merges(tokens)]

    tok = Tokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    for content, token_id, special in ADDED_TOKENS:
        added = AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=special)
        if special:
            tok.add_special_tokens([added])
        else:
            tok.add_tokens([added])
        if tok.token_to_id(content) != token_id:
            raise CheckpointError(f"added token {content} got id {tok.token_to_id(content)}, expected {token_id}")

    tok.save(str(out_dir / "tokenizer.json"), pretty=False)
    (out_dir / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    with open(out_dir / "merges.txt", "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
        for a, b in merges:
            f.write(f"{a} {b}\n")


def tokenizer_cache_dir() -> pathlib.Path:
    """Return the folder where rebuilt tokenizer files are cached.

    ``$PRISM_CACHE_DIR/tokenizer`` if that variable is set, else ``platformdirs``' user cache
    folder for ``prism`` (``~/.cache/prism/tokenizer`` on Linux).
    """
    root = os.environ.get("PRISM_CACHE_DIR")
    if root:
        return pathlib.Path(root) / "tokenizer"
    try:
        import platformdirs

        return pathlib.Path(platformdirs.user_cache_dir("prism")) / "tokenizer"
    except ImportError:
        return pathlib.Path.home() / ".cache" / "prism" / "tokenizer"


def cached_tokenizer_files() -> pathlib.Path:
    """Return a folder holding tokenizer.json, vocab.json and merges.txt for the Qwen BPE.

    The folder lies under :func:`tokenizer_cache_dir`, keyed by the sha256 of ``qwen.tiktoken``;
    it is built on first use (a few seconds) and written atomically, so concurrent builders are
    safe.  Raises :class:`CheckpointError` when ``qwen.tiktoken`` is missing or malformed.
    """
    source = qwen_tiktoken_path()
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    target = tokenizer_cache_dir() / f"qwen-bpe-v{_TOKENIZER_FORMAT}-{digest}"
    if all((target / name).is_file() for name in TOKENIZER_FILES):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        _build_tokenizer_files(source, staging)
        try:
            os.replace(staging, target)
        except OSError:
            # Another process won the race (keep theirs), or a damaged folder is in the way.
            if not all((target / name).is_file() for name in TOKENIZER_FILES):
                shutil.rmtree(target, ignore_errors=True)
                os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def tokenizer_config() -> dict[str, Any]:
    """Return the ``tokenizer_config.json`` contents (Qwen3-VL's, with our chat template)."""
    specials = [content for content, _, special in ADDED_TOKENS if special and content != "<|endoftext|>"]
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(token_id): {
                "content": content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": special,
            }
            for content, token_id, special in ADDED_TOKENS
        },
        "additional_special_tokens": specials,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "processor_class": "Qwen3VLProcessor",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
