"""The vision encoder's CUDA graphs (engine/graphs/vision.py).

On the CPU a captured graph is replaced by a stand-in with a graph's semantics (``FakeGraph``:
fixed input and output buffers, each replay recomputing the outputs from whatever the input buffer
holds), while :class:`VisionGraphs`' own replay (copy the pixels in, replay, clone the outputs) runs
as on the GPU. So the CPU tests check the policy (a combination of image sizes runs eagerly when
first seen, is captured when seen again, replays after that; the least recently used graph is
dropped; combinations too large never capture) and that a replay answers for the pixels it was
given, in tensors a later replay does not overwrite. The GPU tests (skipped without CUDA) check real
graphs against the eager encoder, an engine's answers through them, and that one session's graphs
never serve another (tests/test_isolation.py has the same property on the CPU).
"""

from __future__ import annotations

import pytest
import torch
from conftest import TEST_DEVICE
from PIL import Image

from engine import SamplingParams, media_first_messages
from engine.graphs.vision import VisionGraphs, _Captured


class FakeGraph:
    """Stands in for ``torch.cuda.CUDAGraph``: ``replay()`` recomputes the encoder from the captured
    input buffer into the captured output buffers, as a real replay overwrites them."""

    def __init__(self, model, grids, pixels: torch.Tensor, out):
        self.model, self.grids, self.pixels, self.out = model, grids, pixels, out

    def replay(self) -> None:
        fresh = self.model.visual(self.pixels, list(self.grids))
        for buffer, value in zip((self.out.embeds, *self.out.deepstack), (fresh.embeds, *fresh.deepstack),
                                 strict=True):
            buffer.copy_(value)


class EagerStandIn(VisionGraphs):
    """"Captures" a :class:`FakeGraph` (static input and output buffers like a real capture);
    replays go through :meth:`VisionGraphs._replay` itself."""

    @torch.inference_mode()
    def _capture(self, grids, pixels):
        static = pixels.to(self.model.device, self.model.dtype).clone()
        result = self.model.visual(static, list(grids))
        out = self.model.visual(static, list(grids))
        return _Captured(FakeGraph(self.model, grids, static, out), static, out), result


@pytest.fixture(scope="module")
def model(tiny_engine_factory):
    return tiny_engine_factory().model


@pytest.fixture(scope="module")
def photo_inputs(tiny_engine_factory, media_path):
    """``{name: (pixels, grids)}`` for one photo at three sizes (three grids)."""
    engine = tiny_engine_factory(max_pixels=128 * 128)
    out = {}
    with Image.open(media_path("astronaut.png")) as im:
        for name, size in (("square", (96, 96)), ("wide", (128, 64)), ("tall", (64, 128))):
            prompt = engine.prompts.build(media_first_messages([im.convert("RGB").resize(size)], "?"))
            out[name] = (prompt.pixel_values, prompt.image_grids)
    return out


def assert_same(a, b, atol=0.0):
    torch.testing.assert_close(a.embeds, b.embeds, rtol=0, atol=atol)
    for x, y in zip(a.deepstack, b.deepstack, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=atol)


def test_first_sighting_is_eager_second_captures_third_replays(model, photo_inputs):
    graphs = EagerStandIn(model)
    pixels, grids = photo_inputs["square"]
    ref = model.encode_vision(pixels, grids)
    counts = []
    for _ in range(4):
        assert_same(graphs(pixels, grids), ref)
        counts.append((graphs.captures, graphs.replays))
    assert counts == [(0, 0), (1, 0), (1, 1), (1, 2)]


def test_least_recently_used_graph_is_dropped(model, photo_inputs):
    graphs = EagerStandIn(model, max_graphs=2)
    for name in ("square", "wide", "square", "wide"):  # both captured
        graphs(*photo_inputs[name])
    graphs(*photo_inputs["square"])  # replayed: "wide" is now the least recently used
    graphs(*photo_inputs["tall"])
    graphs(*photo_inputs["tall"])  # a third capture drops "wide"
    kept = [("", tuple(photo_inputs[n][1])) for n in ("square", "tall")]  # (scope, grids): the default scope
    assert graphs.captures == 3 and list(graphs._graphs) == kept
    replays = graphs.replays
    graphs(*photo_inputs["wide"])  # seen before: captured again, not replayed
    assert (graphs.captures, graphs.replays) == (4, replays)


def test_combinations_over_the_patch_bound_always_run_eagerly(model, photo_inputs):
    pixels, grids = photo_inputs["square"]
    graphs = EagerStandIn(model, max_patches=pixels.shape[0] - 1)
    for _ in range(3):
        assert_same(graphs(pixels, grids), model.encode_vision(pixels, grids))
    assert (graphs.captures, graphs.replays) == (0, 0)


def test_a_failed_capture_answers_eagerly_and_is_not_retried(model, photo_inputs, caplog):
    class FailingCapture(EagerStandIn):
        attempts = 0

        def _capture(self, grids, pixels):
            self.attempts += 1
            raise RuntimeError("operation not permitted when stream is capturing")

    graphs = FailingCapture(model)
    pixels, grids = photo_inputs["tall"]
    ref = model.encode_vision(pixels, grids)
    for _ in range(4):
        assert_same(graphs(pixels, grids), ref)
    assert graphs.attempts == 1 and (graphs.captures, graphs.replays) == (0, 0)
    assert "capture failed" in caplog.text


def test_out_of_memory_while_capturing_is_retried_later(model, photo_inputs, caplog):
    class OutOfMemoryOnce(EagerStandIn):
        attempts = 0

        def _capture(self, grids, pixels):
            self.attempts += 1
            if self.attempts == 1:
                raise torch.OutOfMemoryError("CUDA out of memory")
            return super()._capture(grids, pixels)

    graphs = OutOfMemoryOnce(model)
    pixels, grids = photo_inputs["wide"]
    ref = model.encode_vision(pixels, grids)
    counts = []
    for _ in range(5):  # seen, capture runs out of memory, seen again, captured, replayed
        assert_same(graphs(pixels, grids), ref)
        counts.append((graphs.attempts, graphs.captures, graphs.replays))
    assert counts == [(0, 0, 0), (1, 0, 0), (1, 0, 0), (2, 1, 0), (2, 1, 1)]
    assert "out of memory" in caplog.text


def test_replay_answers_for_its_own_pixels_in_fresh_tensors(model, photo_inputs):
    """Other pixels with the same grids replay the same graph and get their own features (the
    pixels are copied into the graph's input); an earlier replay's result is not overwritten (the
    outputs are cloned out of the graph's buffers)."""
    graphs = EagerStandIn(model)
    pixels, grids = photo_inputs["wide"]
    ref = model.encode_vision(pixels, grids)
    graphs(pixels, grids)
    graphs(pixels, grids)  # captured
    replayed = graphs(pixels, grids)
    assert (graphs.captures, graphs.replays) == (1, 1)
    assert_same(replayed, ref, atol=1e-5)
    other = pixels.flip(0).contiguous()
    other_ref = model.encode_vision(other, grids)
    assert not torch.allclose(other_ref.embeds, ref.embeds)
    assert_same(graphs(other, grids), other_ref, atol=1e-5)
    assert graphs.replays == 2
    assert_same(replayed, ref, atol=1e-5)


def test_engines_encode_through_graphs_exactly_where_decode_uses_them(tiny_engine_factory):
    """On CUDA (graphs on by default) the engine's vision encoder is a :class:`VisionGraphs`; with
    ``cuda_graphs=False``, or on the CPU, it is the eager encoder."""
    engine = tiny_engine_factory()
    if engine.device.type == "cuda":
        assert isinstance(engine.vision.encoder, VisionGraphs) and engine.vision.encoder.model is engine.model
        eager = tiny_engine_factory(cuda_graphs=False)
        assert eager.vision.encoder == eager.model.encode_vision
    else:
        assert engine.vision.encoder == engine.model.encode_vision


needs_gpu = pytest.mark.skipif(TEST_DEVICE != "cuda", reason="CUDA graphs need the engines on a GPU")


@needs_gpu
def test_graph_replay_equals_the_eager_encoder(tiny_engine_factory, photo_inputs):
    engine = tiny_engine_factory()
    graphs = engine.vision.encoder
    assert isinstance(graphs, VisionGraphs)
    pixels, grids = photo_inputs["wide"]
    ref = engine.model.encode_vision(pixels, grids)
    eager, captured, replayed = (graphs(pixels, grids) for _ in range(3))
    assert (graphs.captures, graphs.replays) == (1, 1)
    for out in (eager, captured, replayed):
        assert_same(out, ref, atol=1e-5)
    # other pixels with the same grid replay the same graph; earlier results are not overwritten
    other = pixels.flip(0).contiguous()
    assert_same(graphs(other, grids), engine.model.encode_vision(other, grids), atol=1e-5)
    assert graphs.replays == 2
    assert_same(replayed, ref, atol=1e-5)


@needs_gpu
def test_answers_through_the_vision_graphs_equal_eager_ones(tiny_engine_factory, media_path):
    """One session asks about three pairs of photos of the same two sizes (other pixels each time,
    so the vision-feature cache never answers): the first pair is encoded eagerly, the second
    captures, the third replays. Each answer equals that of an engine without graphs."""
    with Image.open(media_path("coffee.png")) as a, Image.open(media_path("chelsea.png")) as b:
        base = [a.convert("RGB").resize((96, 64)), b.convert("RGB").resize((64, 96))]
    pairs = [[im.rotate(180 * (i % 2)).point(lambda v, i=i: (v + 17 * i) % 256) for im in base] for i in range(3)]
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    with_graphs = tiny_engine_factory(prefix_cache=False)
    without = tiny_engine_factory(prefix_cache=False, cuda_graphs=False)
    for pair in pairs:
        messages = media_first_messages(pair, "What is in the photos?")
        expected = without.generate(messages, sampling, cache_salt="s").token_ids
        assert with_graphs.generate(messages, sampling, cache_salt="s").token_ids == expected
    assert (with_graphs.vision.encoder.captures, with_graphs.vision.encoder.replays) == (1, 1)


@needs_gpu
def test_a_graph_one_session_earned_is_not_replayed_for_another(tiny_engine_factory, media_path):
    """The GPU check of issue 16: with real CUDA graphs, a session's first photo of a size that
    another session has had captured and replayed runs eagerly (a replay would be several times
    faster and tell the attacker which sizes others sent), then captures and replays on its own;
    every answer equals the eager engine's. Run by hand on a GPU:
    ``PRISM_TEST_DEVICE=cuda python -m pytest -q tests/test_vision_graphs.py tests/test_isolation.py``."""
    with Image.open(media_path("coffee.png")) as a:
        base = a.convert("RGB").resize((96, 64))
    photos = [base.point(lambda v, i=i: (v + 29 * i) % 256) for i in range(6)]
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    engine = tiny_engine_factory(prefix_cache=False)
    without = tiny_engine_factory(prefix_cache=False, cuda_graphs=False)
    graphs = engine.vision.encoder
    steps = []
    for salt, photo in zip(["victim"] * 3 + ["attacker"] * 3, photos, strict=True):
        messages = media_first_messages([photo], "What is this?")
        assert engine.generate(messages, sampling, cache_salt=salt).token_ids == \
            without.generate(messages, sampling, cache_salt=salt).token_ids
        steps.append((graphs.eager_runs, graphs.captures, graphs.replays))
    assert steps == [(1, 0, 0), (1, 1, 0), (1, 1, 1), (2, 1, 1), (2, 2, 1), (2, 2, 2)]
    stats = engine.stats()
    assert (stats["vision_graph_captures"], stats["vision_graph_replays"]) == (2, 2)


def test_a_forgotten_scope_starts_eager_again_and_other_scopes_keep_their_graphs(model, photo_inputs):
    """Engine.forget (issue 30.1): a forgotten session's graphs and sightings go, so its next call
    of the same images runs eagerly as a first sighting; another scope's graph still replays."""
    graphs = EagerStandIn(model)
    pixels, grids = photo_inputs["square"]
    for scope in ("victim", "other"):
        graphs(pixels, grids, scope)
        graphs(pixels, grids, scope)  # captured
    assert graphs.captures == 2
    assert graphs.forget("victim") == 1
    eager, replays = graphs.eager_runs, graphs.replays
    graphs(pixels, grids, "victim")
    assert (graphs.eager_runs, graphs.replays, graphs.captures) == (eager + 1, replays, 2)  # a first sighting
    graphs(pixels, grids, "other")
    assert graphs.replays == replays + 1
