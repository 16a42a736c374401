"""Video files in the engine: decoded with PyAV and sampled exactly as transformers' Qwen3-VL video
processor samples them with its PyAV backend.

The oracle is transformers itself: ``transformers.video_utils.load_video(..., backend="pyav")``
with the checkpoint's ``Qwen3VLVideoProcessor.sample_frames``, then the processor on those frames
and their metadata, then ``Qwen3VLForConditionalGeneration`` in float32 (K/V kept exact, no prefix
cache). Prompt ids (the ``<t seconds>`` timestamps included), pixel values, M-RoPE positions, all
logits and greedy tokens must agree. The clips are ``tests/media/pan.mp4`` (29.97 fps, 8 s,
96 x 64) and ``tests/media/pan.gif`` (10 fps, 2 s), written by ``tests/media/make_media.py``.
"""

from __future__ import annotations

import io
import pathlib
import re

import numpy as np
import pytest
import torch
from conftest import CI
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

if not CI:  # under PRISM_CI=1 a missing PyAV is a failure, not a skip
    pytest.importorskip("av")
import av  # noqa: E402
from test_parity import GEN_TOKENS, _load_pair, hf_greedy, our_all_logits  # noqa: E402
from transformers.video_utils import VideoMetadata, load_video  # noqa: E402

from engine import InvalidVideoError, SamplingParams  # noqa: E402
from engine.inputs.video import VideoOptions, VideoSampling, decode_video, sample_indices  # noqa: E402

MEDIA = pathlib.Path(__file__).resolve().parent / "media"
MP4, GIF = MEDIA / "pan.mp4", MEDIA / "pan.gif"


@pytest.fixture(scope="module")
def pair(tiny_ckpt):
    pair = _load_pair(tiny_ckpt)
    yield pair
    pair.engine.close()


def _messages(video, question="What happens in this clip?"):
    return [{"role": "user", "content": [{"type": "text", "text": "Video 1: "}, {"type": "video", "video": video},
                                         {"type": "text", "text": f"\nQuestion: {question}"}]}]


def hf_video_inputs(processor, messages, path: pathlib.Path) -> tuple[dict, VideoMetadata]:
    """transformers' own inputs for a one-video prompt: PyAV backend pinned, its sampler."""
    vp = processor.video_processor
    frames, metadata = load_video(str(path), backend="pyav",
                                  sample_indices_fn=lambda metadata, **kw: vp.sample_frames(metadata))
    template = [{"role": m["role"], "content": [{"type": p["type"], **({"text": p["text"]} if "text" in p else {})}
                                                for p in m["content"]]} for m in messages]
    text = processor.apply_chat_template(template, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], videos=[frames], return_tensors="pt",
                       videos_kwargs={"video_metadata": [metadata], "do_sample_frames": False})
    return dict(inputs), metadata


@pytest.mark.parametrize("path", [MP4, GIF], ids=["mp4-29.97fps", "gif"])
@pytest.mark.parametrize("as_bytes", [False, True], ids=["path", "bytes"])
def test_video_file_parity_with_transformers_pyav(pair, path, as_bytes):
    engine, hf, processor = pair.engine, pair.hf, pair.processor
    messages = _messages(path.read_bytes() if as_bytes else str(path))
    inputs, metadata = hf_video_inputs(processor, messages, path)
    prompt = engine.prompts.build(messages)

    assert prompt.input_ids == inputs["input_ids"][0].tolist()  # timestamps are text tokens
    assert torch.equal(prompt.pixel_values_videos, inputs["pixel_values_videos"])
    assert prompt.video_grids == [tuple(g) for g in inputs["video_grid_thw"].tolist()]

    # the timestamps the prompt reads: each temporal patch's two frames averaged, index / rate
    stamps = re.findall(r"<([0-9.]+) seconds>", processor.tokenizer.decode(prompt.input_ids))
    idx = list(metadata.frames_indices)
    want = [f"{(idx[i] + idx[i + 1]) / 2 / metadata.fps:.1f}" for i in range(0, len(idx), 2)]
    assert stamps == want and len(stamps) == prompt.video_grids[0][0]

    positions, delta = hf.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"], None,
                                               inputs["video_grid_thw"])
    assert torch.equal(prompt.positions, positions[:, 0]) and prompt.rope_delta == int(delta)

    with torch.no_grad():
        theirs = hf(**inputs).logits[0].float()
    torch.testing.assert_close(our_all_logits(engine, prompt), theirs, rtol=0, atol=1e-3)
    done = engine.generate(messages, SamplingParams(max_tokens=GEN_TOKENS, ignore_eos=True))
    assert done.prompt_token_ids == prompt.input_ids
    assert done.token_ids == hf_greedy(hf, inputs, GEN_TOKENS)


def test_the_committed_clip_is_what_the_tests_say():
    """29.97 fps, 240 frames (8.008 s), 96 x 64; sampled at 2 fps: 16 frames, the last the last."""
    with av.open(str(MP4)) as c:
        s = c.streams.video[0]
        assert (s.frames, float(s.average_rate), s.width, s.height) == (240, 30000 / 1001, 96, 64)
    video = decode_video(MP4)
    assert video.frames.shape == (16, 64, 96, 3) and video.frames.dtype == np.uint8
    assert video.total_frames == 240 and video.indices[0] == 0 and video.indices[-1] == 239
    assert abs(video.duration_s - 8.008) < 1e-9
    assert MP4.stat().st_size < 300_000 and GIF.stat().st_size < 300_000


def test_later_questions_in_a_session_reuse_the_decoded_clip(pair):
    """The decoded clip is kept per salt: the same bytes again under that salt are not decoded
    again (and give the same prompt); under another salt they are."""
    builder = pair.engine.prompts
    first = builder.build(_messages(str(MP4)), salt="video-a")
    hits = builder.videos.hits
    again = builder.build(_messages(MP4.read_bytes(), "Another question?"), salt="video-a")
    assert builder.videos.hits == hits + 1
    assert torch.equal(again.pixel_values_videos, first.pixel_values_videos)
    assert again.video_hashes == first.video_hashes
    builder.build(_messages(str(MP4)), salt="video-b")
    assert builder.videos.hits == hits + 1


def test_sampling_equals_transformers_sampler(pair):
    """Our index rule against ``Qwen3VLVideoProcessor.sample_frames`` on many (frames, rate)."""
    vp = pair.processor.video_processor
    sampling = VideoSampling.of(vp)
    assert (sampling.fps, sampling.min_frames, sampling.max_frames) == (2.0, 4, 768)
    for total in (2, 3, 4, 5, 17, 60, 240, 241, 600, 9000, 30000):
        for fps in (1.0, 10.0, 24.0, 30000 / 1001, 30.0, 60.0):
            want = vp.sample_frames(VideoMetadata(total_num_frames=total, fps=fps)).tolist()
            assert sample_indices(total, fps, sampling) == want, (total, fps)


def test_a_frame_list_keeps_working_with_index_over_fps_timestamps(pair):
    """Frames given as a list are taken one for one: frame i at i / fps seconds."""
    from PIL import Image

    video = decode_video(MP4)
    frames = [Image.fromarray(f) for f in video.frames[:6]]
    prompt = pair.engine.prompts.build(
        [{"role": "user", "content": [{"type": "video", "video": frames, "fps": 4.0}, {"type": "text", "text": "?"}]}])
    stamps = re.findall(r"<([0-9.]+) seconds>", pair.processor.tokenizer.decode(prompt.input_ids))
    assert stamps == ["0.1", "0.6", "1.1"]  # (0+1)/2/4, (2+3)/2/4, (4+5)/2/4
    assert prompt.video_grids == [(3, 4, 6)]


def _encode(fmt: str, codec: str, n: int, rate, size=(32, 32)) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as out:
        s = out.add_stream(codec, rate=rate)
        s.width, s.height, s.pix_fmt = size[1], size[0], "yuv420p"
        for i in range(n):
            img = np.full((*size, 3), (i * 7) % 256, np.uint8)
            for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                out.mux(p)
        for p in s.encode():
            out.mux(p)
    return buf.getvalue()


WEBM = _encode("webm", "libvpx", 30, 10)


def test_webm_without_a_frame_count_is_counted_and_sampled():
    """WebM does not record its frame count (transformers' PyAV loader cannot sample it): the
    packets are counted, then sampled by the same rule."""
    data = WEBM
    with av.open(io.BytesIO(data)) as c:
        assert c.streams.video[0].frames == 0
    video = decode_video(data)
    assert video.total_frames == 30 and video.indices == sample_indices(30, 10.0, VideoSampling())
    assert video.frames.shape == (6, 32, 32, 3)


# ------------------------------------------------------------------------------------------------
# what a client sending a bad file sees
# ------------------------------------------------------------------------------------------------


def test_a_truncated_file_is_refused_clearly(pair):
    data = MP4.read_bytes()
    for cut in (len(data) // 2, len(data) // 5, 40):
        with pytest.raises(InvalidVideoError, match="truncated"):
            pair.engine.prompts.build(_messages(data[:cut]))


def test_a_zero_frame_file_is_refused_clearly(pair):
    buf = io.BytesIO()
    out = av.open(buf, "w", format="mp4")
    s = out.add_stream("libx264", rate=30)
    s.width, s.height, s.pix_fmt = 32, 32, "yuv420p"
    out.start_encoding()
    out.close()
    with pytest.raises(InvalidVideoError, match="no video frames"):
        pair.engine.prompts.build(_messages(buf.getvalue()))
    with pytest.raises(InvalidVideoError, match="empty"):
        pair.engine.prompts.build(_messages(b""))


def test_an_over_long_clip_is_refused_before_decoding(pair, monkeypatch):
    """121 s at 1 fps: over the 120 s default, refused from the header (nothing decoded)."""
    data = _encode("mp4", "libx264", 121, 1)
    decoded = []
    real = av.container.InputContainer.decode
    monkeypatch.setattr(av.container.InputContainer, "decode", lambda *a, **k: decoded.append(1) or real(*a, **k))
    with pytest.raises(InvalidVideoError, match=r"121\.0 s long .* up to 120 s"):
        pair.engine.prompts.build(_messages(data))
    assert not decoded


@pytest.mark.parametrize("limit, match", [
    ({"max_bytes": 10_000}, "MiB"),
    ({"max_frames": 200}, "240 frames"),
    ({"max_duration_s": 5.0}, "8.0 s long"),
    ({"max_frame_pixels": 96 * 63}, "96x64"),
    ({"max_decode_pixels": 96 * 64 * 239}, "too large to decode"),
    ({"max_sampled_bytes": 96 * 64 * 3 * 15}, "too large to decode"),
])
def test_limits_refuse_with_a_message(limit, match):
    with pytest.raises(InvalidVideoError, match=match):
        decode_video(MP4, options=VideoOptions(**limit))
    decode_video(MP4, options=VideoOptions(**{k: v * 2 for k, v in limit.items()}))  # inside: decodes


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_damaged_files_raise_only_invalid_video_error(data):
    """Whatever a client does to a clip's bytes (cut it, overwrite a run of bytes, splice in
    garbage), decoding either works or says why with InvalidVideoError, never another exception."""
    clip = bytearray(data.draw(st.sampled_from([MP4.read_bytes(), GIF.read_bytes(), WEBM])))
    cut = data.draw(st.integers(0, len(clip)))
    start = data.draw(st.integers(0, len(clip) - 1))
    junk = data.draw(st.binary(min_size=1, max_size=64))
    mode = data.draw(st.sampled_from(["cut", "overwrite", "insert"]))
    if mode == "cut":
        clip = clip[:cut]
    elif mode == "overwrite":
        clip[start : start + len(junk)] = junk
    else:
        clip[start:start] = junk
    try:
        video = decode_video(bytes(clip), options=VideoOptions(max_decode_s=10))
    except InvalidVideoError as exc:
        assert str(exc)
    else:
        assert video.frames.ndim == 4 and len(video.frames) == len(video.indices) >= 2


def test_decoding_stops_at_its_deadline():
    with pytest.raises(InvalidVideoError, match="took over"):
        decode_video(MP4, options=VideoOptions(max_decode_s=1e-9))


def test_not_a_video_and_one_frame(pair, media_path):
    with pytest.raises(InvalidVideoError, match="not a video"):
        pair.engine.prompts.build(_messages(media_path("chelsea.png").read_bytes()))
    with pytest.raises(InvalidVideoError, match="not a video"):
        pair.engine.prompts.build(_messages(bytes(range(256)) * 8))
    with pytest.raises(InvalidVideoError, match="not a video"):  # a codec we do not decode (MPEG-2)
        decode_video(_encode("matroska", "mpeg2video", 8, 10))
    with pytest.raises(InvalidVideoError, match="single frame"):
        decode_video(_encode("mp4", "libx264", 1, 30))
    with pytest.raises(InvalidVideoError, match="could not read"):
        decode_video("/nonexistent/clip.mp4")


def test_webm_cut_inside_its_clusters_is_refused_not_a_500():
    """Found by the fuzz test above: a WebM cut after its first clusters made FFmpeg's rewind
    (after counting packets) fail with EPERM, which escaped as av.error.PermissionError (a 500 in
    the app). The client now sees the damaged-file message."""
    with pytest.raises(InvalidVideoError, match="damaged or truncated"):
        decode_video(WEBM[:428], options=VideoOptions(max_decode_s=10))
