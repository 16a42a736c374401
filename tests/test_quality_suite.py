"""The synthetic quality suite (benchmarks/quality): generator, renderer, patches, token ids, trainer.

What these tests prove:

- samples are a pure function of their seed key, the held-out split is fixed, balanced and never
  shares a key with training, and every answer follows from the scene objects as an independent
  checker reads them (not from the generator's own bookkeeping);
- the batched integer renderer paints exactly what a plain NumPy painter paints (and, on a GPU,
  the same bytes as on the CPU), and the pixels show every object;
- the patches built with torch equal the transformers processor's ``pixel_values`` and
  ``image_grid_thw`` bit for bit, and the token ids built from cached pieces equal the chat
  template + processor's ids (generation prompt included; the answer then ``<|im_end|>`` as the
  template renders an assistant turn);
- the trainable model computes transformers' Qwen3-VL logits on the same weights (padded batch
  included), greedy decoding gives transformers' tokens, a few training steps lower the loss, and
  checkpoints survive sharding and the split/join used for device transfer.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from benchmarks.quality import checkpoint as ckpt
from benchmarks.quality import scenes as sc
from benchmarks.quality.data import build_batch, device_pixels
from benchmarks.quality.font import LETTERS, glyph_table
from benchmarks.quality.model import ProbeVL
from benchmarks.quality.patches import check_unresized, patchify
from benchmarks.quality.render import pack_scenes, render, render_reference, render_scenes
from benchmarks.quality.tokens import PromptTokens
from engine.model import tiny
from engine.model.config import ModelConfig

# --------------------------------------------------------------------------------------------
# Generator
# --------------------------------------------------------------------------------------------


def _stage_samples(n_per_stage: int) -> list[sc.Sample]:
    """Training samples of every stage of every curriculum."""
    out = []
    for curriculum, stages in sc.CURRICULA.items():
        for name, _, dist in stages:
            out += [sc.train_sample(f"test:{curriculum}:{name}:{i}", dist) for i in range(n_per_stage)]
    return out


def test_samples_are_deterministic_and_keyed():
    """The same key gives the same sample; other keys give other samples."""
    assert sc.heldout(30) == sc.heldout(30)
    assert sc.make_sample("k:1") == sc.make_sample("k:1")
    assert sc.make_sample("k:1") != sc.make_sample("k:2")
    assert sc.heldout(5, start=10) == sc.heldout(15)[10:]


def test_heldout_split_is_fixed_balanced_and_disjoint_from_training():
    """Held-out keys are ``heldout:<i>`` with types cycling; training keys all start ``train:``."""
    held = sc.heldout(100)
    assert [s.uid for s in held[:3]] == ["heldout:0", "heldout:1", "heldout:2"]
    counts = {t: sum(s.qtype == t for s in held) for t in sc.QUESTION_TYPES}
    assert counts == dict.fromkeys(sc.QUESTION_TYPES, 20)
    assert all(s.uid.startswith("train:") for s in _stage_samples(5))
    assert sc.train_sample("heldout:0", sc.EVAL).uid == "train:heldout:0"
    # the first held-out samples are pinned: a change to the generator must be deliberate
    assert held[0].question == "What colour is the diamond in Image 1? Answer with one word."
    assert held[0].answer == "orange"
    # all image counts occur, and the target image is not always the first
    assert {len(s.scenes) for s in held} == {1, 2, 3, 4}
    assert len({s.target for s in held}) == 4


def _expected_answer(sample: sc.Sample) -> str:
    """The answer read off the scene objects by the question text alone."""
    q, scenes = sample.question, sample.scenes
    image = re.search(r"in Image (\d)\?", q) or re.search(r"shape in Image (\d) is", q)
    target = scenes[int(image.group(1)) - 1] if image else None
    if sample.qtype == "colour":
        kind = re.match(r"What colour is the (\w+) in", q).group(1)
        found = [s for s in target.shapes if s.kind == kind]
        assert len(found) == 1, q
        return found[0].colour
    if sample.qtype == "which_image":
        colour, kind = re.match(r"Which image has a (\w+) (\w+)\?", q).groups()
        holders = [i for i, scene in enumerate(scenes)
                   if any(s.kind == kind and s.colour == colour for s in scene.shapes)]
        assert len(holders) == 1, q
        return str(holders[0] + 1)
    if sample.qtype == "count":
        return str(len(target.shapes))
    if sample.qtype == "count_colour":
        colour = re.match(r"How many (\w+) shapes are in Image \d\?", q).group(1)
        return str(sum(s.colour == colour for s in target.shapes))
    if sample.qtype == "word":
        return target.word.text.lower()
    if sample.qtype == "shape":
        colour = re.match(r"Which shape in Image \d is (\w+)\?", q).group(1)
        found = [s for s in target.shapes if s.colour == colour]
        assert len(found) == 1, q
        return found[0].kind
    colour, first, second = re.match(r"Is the (\w+) (\w+) left or right of the (\w+) in", q).groups()
    a = [s for s in target.shapes if s.kind == first]
    b = [s for s in target.shapes if s.kind == second]
    assert len(a) == 1 and len(b) == 1 and a[0].colour == colour, q
    assert a[0].box[2] + 8 <= b[0].box[0] or b[0].box[2] + 8 <= a[0].box[0], "the two shapes overlap horizontally"
    return "left" if a[0].cx < b[0].cx else "right"


def test_answers_follow_from_the_scenes():
    """For held-out and every curriculum stage, the answer is what the objects say."""
    trained = _stage_samples(40)
    assert {s.qtype for s in trained} == set(sc.TRAINING_TYPES)
    for sample in sc.heldout(250) + trained:
        assert sample.answer == _expected_answer(sample), sample.uid
        assert 1 <= len(sample.scenes) <= 4
        if sample.qtype == "count":
            assert 1 <= int(sample.answer) <= 5


def test_transfer_split_is_its_own_and_no_training_stage_asks_it():
    """The transfer split (``count_colour``): keys ``transfer:<i>``, answers re-derived from the
    objects (1-3 of the colour), the target image always holds a shape of another colour (so
    counting every shape is never right); no curriculum stage nor the held-out split has the type,
    and the held-out split's ``i % 5`` types are unchanged."""
    split = sc.transfer(200)
    assert [s.uid for s in split[:2]] == ["transfer:0", "transfer:1"]
    assert {s.qtype for s in split} == {"count_colour"} == set(sc.TRANSFER_TYPES)
    for sample in split:
        assert sample.answer == _expected_answer(sample), sample.uid
        assert 1 <= int(sample.answer) <= 3
        assert len(sample.scenes[sample.target].shapes) > int(sample.answer)
    assert {s.answer for s in split} == {"1", "2", "3"}
    assert {len(s.scenes) for s in split} == {1, 2, 3, 4}
    for stages in sc.CURRICULA.values():
        assert all("count_colour" not in dist.types for _, _, dist in stages)
    assert [s.qtype for s in sc.heldout(10)] == list(sc.QUESTION_TYPES) * 2
    assert "count_colour" not in sc.QUESTION_TYPES + sc.TRAINING_TYPES
    report = sc.accuracy_by_type(split[:3], [s.answer for s in split[:3]])
    assert list(report) == ["count_colour", "all"] and report["count_colour"]["accuracy"] == 1.0


def test_objects_fit_without_overlap():
    """Every object lies inside its image and clear of the others (so none hides another)."""
    for sample in sc.heldout(100) + _stage_samples(20):
        height, width = sample.size
        for scene in sample.scenes:
            boxes = [s.box for s in scene.shapes] + ([scene.word.box] if scene.word else [])
            for i, (x0, y0, x1, y1) in enumerate(boxes):
                assert 0 <= x0 < x1 <= width and 0 <= y0 < y1 <= height
                for a0, b0, a1, b1 in boxes[i + 1:]:
                    assert x1 <= a0 or a1 <= x0 or y1 <= b0 or b1 <= y0


def test_small_objects_occur():
    """Shapes of about one patch (at most 18 px across) are part of the held-out split."""
    shapes = [s for sample in sc.heldout(50) for scene in sample.scenes for s in scene.shapes]
    assert any(2 * s.r <= 18 for s in shapes) and any(2 * s.r >= 36 for s in shapes)


def test_scoring_normalises_and_counts_per_type():
    held = sc.heldout(10)
    assert sc.normalise_answer("  Image 2. ") == "2" and sc.normalise_answer("Red!") == "red"
    preds = [s.answer for s in held]
    preds[0] = "blue" if held[0].answer != "blue" else "red"  # one wrong colour answer
    report = sc.accuracy_by_type(held, preds)
    assert report["colour"] == {"n": 2, "correct": 1, "accuracy": 0.5}
    assert report["all"]["correct"] == 9 and list(report)[-1] == "all"
    with pytest.raises(ValueError):
        sc.accuracy_by_type(held, preds[:-1])


def test_bad_requests_are_refused():
    with pytest.raises(ValueError, match="multiples of 32"):
        sc.make_sample("k", size=(250, 256))
    with pytest.raises(ValueError, match="at least 2 images"):
        sc.make_sample("k", sc.CURRICULUM[0][2], "which_image")
    with pytest.raises(ValueError, match="unknown question type"):
        sc.make_sample("k", qtype="size")


# --------------------------------------------------------------------------------------------
# Renderer
# --------------------------------------------------------------------------------------------


def test_font_glyphs_are_complete_and_distinct():
    table = glyph_table()
    assert LETTERS == "ABCDEFGHIJKLMNOPQRSTUVWXYZ" and table.shape == (26, 7, 5)
    flat = {tuple(g.flatten().tolist()) for g in table}
    assert len(flat) == 26 and all(g.any() for g in table)


def test_batched_renderer_equals_reference():
    """The windowed batch painter gives the NumPy painter's bytes for every image."""
    scenes = [scene for s in sc.heldout(30) + _stage_samples(3) for scene in s.scenes]
    pixels = render_scenes(scenes, sc.IMAGE_SIZE)
    assert pixels.dtype == torch.uint8 and pixels.shape == (len(scenes), 256, 256, 3)
    for i, scene in enumerate(scenes):
        np.testing.assert_array_equal(pixels[i].numpy(), render_reference(scene, sc.IMAGE_SIZE), err_msg=f"image {i}")


def test_rendered_pixels_show_each_object():
    """Each shape's centre pixel has its colour; each word puts its ink inside its box."""
    for sample in sc.heldout(20):
        pixels = render_scenes(sample.scenes, sample.size).numpy()
        for img, scene in zip(pixels, sample.scenes, strict=True):
            for s in scene.shapes:
                assert tuple(img[s.cy, s.cx]) == sc.COLOURS[s.colour]
            if scene.word is not None:
                x0, y0, x1, y1 = scene.word.box
                assert (img[y0:y1, x0:x1] == scene.word.ink).all(-1).sum() >= 20
                assert tuple(img[0, 0]) == scene.background


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_renderer_cuda_equals_cpu():
    """Integer-only painting: the GPU gives the CPU's bytes."""
    scenes = [scene for s in sc.heldout(60) for scene in s.scenes]
    packed = pack_scenes(scenes)
    cpu = render(packed, sc.IMAGE_SIZE)
    gpu = render(packed.to("cuda"), sc.IMAGE_SIZE).cpu()
    assert torch.equal(cpu, gpu)


# --------------------------------------------------------------------------------------------
# Patches and token ids against transformers
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def processor(tiny_ckpt):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(tiny_ckpt))


@pytest.fixture(scope="module")
def tokens(tiny_ckpt):
    return PromptTokens(tiny_ckpt / "tokenizer.json")


@pytest.mark.parametrize("size", [(256, 256), (256, 320), (320, 256)])
def test_patches_equal_processor(processor, size):
    """Normalisation, temporal duplication, merge-block order and grid equal the processor's."""
    sample = sc.make_sample(f"patches:{size}", size=size)
    check_unresized(*size, tiny.IMAGE_PROCESSOR_CONFIG)
    out = processor.image_processor(images=sample.images(), return_tensors="pt")
    values, grid = patchify(render_scenes(sample.scenes, size), tiny.IMAGE_PROCESSOR_CONFIG)
    assert torch.equal(grid, out["image_grid_thw"])
    assert values.dtype == out["pixel_values"].dtype and torch.equal(values, out["pixel_values"])


def test_check_unresized_refuses_sizes_the_processor_changes():
    for size in [(128, 128), (240, 256), (256, 250)]:
        with pytest.raises(ValueError, match="resized"):
            check_unresized(*size, tiny.IMAGE_PROCESSOR_CONFIG)


def test_prompt_ids_equal_chat_template(processor, tokens):
    """Ids from cached pieces == the processor's ids for Prism's media-first messages."""
    samples = sc.heldout(40) + _stage_samples(4)
    assert {len(s.scenes) for s in samples} == {1, 2, 3, 4}
    for sample in samples:
        messages = sample.messages()
        text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        out = processor(text=[text], images=sample.images(), return_tensors="pt")
        prompt = tokens.prompt(len(sample.scenes), sample.question, sample.size)
        assert prompt.ids == out["input_ids"][0].tolist(), sample.uid
        starts = [i for i, t in enumerate(prompt.ids) if t == tiny.IMAGE_PAD_ID and prompt.ids[i - 1] != t]
        assert [s.start for s in prompt.spans] == starts


def test_answer_ids_equal_template_with_assistant_turn(processor, tokens):
    """Prompt + target ids == the template rendering the answer as an assistant turn (whose
    trailing newline follows ``<|im_end|>``)."""
    for sample in sc.heldout(10):
        messages = sample.messages() + [{"role": "assistant", "content": [{"type": "text", "text": sample.answer}]}]
        text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
        out = processor(text=[text], images=sample.images(), return_tensors="pt")
        prompt = tokens.prompt(len(sample.scenes), sample.question, sample.size)
        assert prompt.ids + tokens.target(sample.answer) == out["input_ids"][0].tolist()[:-1]
        assert tokens.decode(tokens.target(sample.answer)) == sample.answer


def test_batch_targets_point_at_answer_tokens(tokens):
    samples = sc.heldout(6)
    batch = build_batch(samples, tokens)
    flat = batch.input_ids.reshape(-1)
    assert torch.equal(flat[batch.target_rows + 1], batch.target_ids)
    assert batch.first_rows.sum() == len(samples) and batch.target_ids[~batch.first_rows].eq(tiny.IM_END_ID).all()
    assert batch.n_images == sum(len(s.scenes) for s in samples)
    assert int((batch.input_ids == tiny.IMAGE_PAD_ID).sum()) == batch.n_images * 64


def check_stages(stages) -> None:
    """A curriculum's stages start in order from 0, each over the training types only with one
    weight per type, and its last stage has the held-out layout (EVAL's limits)."""
    starts = [start for _, start, _ in stages]
    assert starts[0] == 0.0 and starts == sorted(starts) and len(set(starts)) == len(starts)
    for _, _, dist in stages:
        assert set(dist.types) <= set(sc.TRAINING_TYPES) and len(dist.type_weights) == len(dist.types)
    last = stages[-1][2]
    assert (last.min_images, last.max_images, last.max_shapes, last.max_count, last.word_prob, last.min_gap) == (
        sc.EVAL.min_images, sc.EVAL.max_images, sc.EVAL.max_shapes, sc.EVAL.max_count, sc.EVAL.word_prob,
        sc.EVAL.min_gap)


def test_binding2_curriculum_is_valid_and_weights_shape_and_weak_types_up():
    """``binding2``: stages in order from 0 over the training types only, one weight per type, the
    last stage the held-out layout (EVAL's limits), and a larger share of ``shape`` and of colour,
    which_image and position than ``binding`` in the later stages; v1 and binding unchanged."""
    stages = sc.CURRICULA["binding2"]
    check_stages(stages)

    def share(dist, types):
        return sum(w for t, w in zip(dist.types, dist.type_weights, strict=True) if t in types) / sum(dist.type_weights)

    for (_, _, new), (_, _, old) in list(zip(stages, sc.CURRICULA["binding"], strict=True))[1:]:
        assert share(new, {"shape"}) > share(old, {"shape"})
        assert share(new, {"colour", "which_image", "position"}) > share(old, {"colour", "which_image", "position"})
    assert sc.CURRICULA["v1"] is sc.CURRICULUM and sc.CURRICULA["binding"] is sc.BINDING_CURRICULUM
    assert sc.heldout(5)[0].uid == "heldout:0" and {s.qtype for s in sc.heldout(5)} == set(sc.QUESTION_TYPES)


def test_place_curriculum_weights_position_up_and_leaves_the_heldout_split():
    """``place``: stages in order from 0 over the training types only, one weight per type, the last
    stage the held-out layout; position has a larger share than in ``binding`` (the committed
    probe's last curriculum) at every stage and at least a third of each, every other type of a
    stage keeps at least a tenth; the held-out split still goes by ``i % 5``."""
    stages = sc.CURRICULA["place"]
    check_stages(stages)

    def share(dist, qtype):
        return dict(zip(dist.types, dist.type_weights, strict=True)).get(qtype, 0) / sum(dist.type_weights)

    for (_, _, new), (_, _, old) in zip(stages, sc.CURRICULA["binding"], strict=True):
        assert share(new, "position") > max(1 / 3 - 1e-9, share(old, "position"))
        assert all(share(new, t) >= 0.1 for t in ("colour", "count", "word") + (("which_image",)
                                                                               if new.max_images > 1 else ()))
    assert [s.qtype for s in sc.heldout(10)] == list(sc.QUESTION_TYPES) * 2


def _token_pixels(values: torch.Tensor, token: int, rgb, config) -> int:
    """Pixels of colour ``rgb`` among the 4 processor patches merged into visual token ``token``
    (rows ``4 token .. 4 token + 3`` of ``pixel_values``, as the merger takes them)."""
    p, t = config["patch_size"], config["temporal_patch_size"]
    scale = 1.0 / config["rescale_factor"]
    norm = [(c - m * scale) / (sd * scale) for c, m, sd in zip(rgb, config["image_mean"], config["image_std"],
                                                                strict=True)]
    rows = values[4 * token:4 * token + 4].view(4, 3, t, p, p)[:, :, 0]  # [4, channel, row, col]
    target = torch.tensor(norm, dtype=torch.float32).view(1, 3, 1, 1)
    return int(((rows - target).abs() < 1e-3).all(1).sum())


def test_cell_labels_line_up_with_the_visual_tokens():
    """The aux labels of merged token ``t`` describe the pixels the model merges into token ``t``:
    a known scene (a square in cell (2, 5), a circle clipped at the top-left corner, a word) gets
    exactly the labels expected at the raster index of each cell, and for held-out scenes every
    cell labelled with a colour has at least ``CELL_MIN_PIXELS`` of it in the token's 4 patches."""
    from benchmarks.quality.data import CELL_MIN_PIXELS, cell_labels
    from benchmarks.quality.render import pack_scenes

    config = tiny.IMAGE_PROCESSOR_CONFIG
    word = sc.Word("CAT", 40, 200, 3, (20, 20, 20))  # letters at x 40, 58, 76 (15 px wide), y 200..220
    scene = sc.Scene((250, 250, 250), (sc.Shape("square", "blue", 176, 80, 10), sc.Shape("circle", "red", 10, 10, 9)),
                     word)
    labels = cell_labels(pack_scenes([scene]), (256, 256))
    assert labels.shape == (1, 64, 3) and labels.dtype == torch.long
    kind, colour, words = (labels[0, :, i].view(8, 8) for i in range(3))
    expected_kind = torch.zeros(8, 8, dtype=torch.long)
    expected_kind[2, 5] = 1 + sc.SHAPES.index("square")
    expected_kind[0, 0] = 1 + sc.SHAPES.index("circle")
    assert torch.equal(kind, expected_kind)
    assert colour[2, 5] == 1 + list(sc.COLOURS).index("blue") and colour[0, 0] == 1 + list(sc.COLOURS).index("red")
    assert int(colour.count_nonzero()) == 2
    assert words[6].tolist() == [0, 1, 1, 0, 0, 0, 0, 0] and int(words.sum()) == 2
    values, _ = patchify(render(pack_scenes([scene]), (256, 256)), config)
    assert _token_pixels(values, 2 * 8 + 5, sc.COLOURS["blue"], config) == 400  # the 20 x 20 square
    assert _token_pixels(values, 0, sc.COLOURS["red"], config) > 0
    assert _token_pixels(values, 5 * 8 + 2, sc.COLOURS["blue"], config) == 0  # the transposed cell is empty

    scenes = [scene for sample in sc.heldout(12) for scene in sample.scenes]
    packed = pack_scenes(scenes)
    labels = cell_labels(packed, (256, 256))
    values, _ = patchify(render(packed, (256, 256)), config)
    names = list(sc.COLOURS)
    labelled = 0
    for n in range(len(scenes)):
        for cell in range(64):
            c = int(labels[n, cell, 1])
            if c:
                labelled += 1
                assert _token_pixels(values, n * 64 + cell, sc.COLOURS[names[c - 1]], config) >= CELL_MIN_PIXELS
    assert labelled >= len(scenes)  # every scene has a shape


def test_size_overrides_and_projected_size():
    """Size options give a valid Qwen3-VL config (vision output width = text width); the projected
    folder size of the committed probe is within 1% of its files, and a width of 192 is over 50 MiB."""
    from benchmarks.quality import MODEL_DIR

    spec = ckpt.probe_spec(ckpt.size_overrides(vision_width=160, vision_mlp=640))
    vision = spec["vision_config"]
    assert (vision["hidden_size"], vision["num_heads"], vision["intermediate_size"]) == (160, 5, 640)
    assert vision["out_hidden_size"] == spec["text_config"]["hidden_size"] == 128
    assert ckpt.projected_bytes(spec) <= ckpt.PROBE_BUDGET_BYTES
    assert ckpt.probe_spec(ckpt.size_overrides()) == ckpt.probe_spec()
    on_disk = sum(p.stat().st_size for p in MODEL_DIR.iterdir() if p.is_file())
    assert abs(ckpt.projected_bytes(ckpt.probe_spec()) - on_disk) < 0.01 * on_disk
    wide = ckpt.probe_spec(ckpt.size_overrides(vision_width=192, vision_mlp=768))
    assert ckpt.projected_bytes(wide) > ckpt.PROBE_BUDGET_BYTES
    from engine.errors import CheckpointError

    with pytest.raises(CheckpointError):
        ckpt.probe_spec(ckpt.size_overrides(vision_depth=2))  # DeepStack tap 2 outside the tower


# --------------------------------------------------------------------------------------------
# Model, trainer, checkpoint
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def toy_checkpoint(tmp_path_factory):
    """A toy-sized probe checkpoint with lively random weights (std 0.2), float32."""
    spec = ckpt.probe_spec(ckpt.TOY_OVERRIDES)
    folder = ckpt.write_skeleton(tmp_path_factory.mktemp("toy-probe"), spec)
    model = ProbeVL(ModelConfig.from_dict(tiny.config_dict(spec)))
    model.init_weights(seed=1, std=0.2)
    ckpt.save_weights(model.state_dict(), folder, dtype=torch.float32)
    return folder, model.eval()


def _hf_model(folder):
    from transformers import Qwen3VLForConditionalGeneration

    return Qwen3VLForConditionalGeneration.from_pretrained(str(folder), dtype=torch.float32).eval()


def test_model_matches_transformers(toy_checkpoint, processor, tokens):
    """Logits of a padded batch (1, 2 and 4 images) == transformers' on each sample alone."""
    folder, model = toy_checkpoint
    hf = _hf_model(folder)
    held = sc.heldout(40)
    samples = [next(s for s in held if len(s.scenes) == n) for n in (2, 4, 1)]
    batch = build_batch(samples, tokens, with_targets=False)
    with torch.no_grad():
        pixels, grid = device_pixels(batch, tiny.IMAGE_PROCESSOR_CONFIG)
        embeds, deepstack = model.encode_images(pixels, grid, batch.n_images)
        logits = model.logits(model.hidden(batch.input_ids, batch.positions, embeds, deepstack))
        for i, sample in enumerate(samples):
            inputs = processor.apply_chat_template(sample.messages(), tokenize=True, add_generation_prompt=True,
                                                   return_dict=True, return_tensors="pt")
            ref = hf(**inputs).logits[0]
            n = int(batch.lengths[i])
            assert ref.shape[0] == n
            torch.testing.assert_close(logits[i, :n], ref, atol=2e-4, rtol=1e-4)
        # the images matter: another picture gives other answer logits (sample 2 has one image)
        alone = build_batch([samples[2]], tokens, with_targets=False)
        other = next(s for s in held if len(s.scenes) == 1 and s is not samples[2])
        px, _ = patchify(render_scenes(other.scenes, other.size), tiny.IMAGE_PROCESSOR_CONFIG)
        e2, d2 = model.encode_images(px, grid, 1)
        n = int(batch.lengths[2])
        changed = model.logits(model.hidden(alone.input_ids, alone.positions, e2, d2))[0, n - 1]
        assert (changed - logits[2, n - 1]).abs().max() > 1e-2


def test_greedy_answers_match_transformers_generate(toy_checkpoint, processor, tokens):
    from benchmarks.quality.train import greedy_answers

    folder, model = toy_checkpoint
    hf = _hf_model(folder)
    samples = sc.heldout(4)
    ours = greedy_answers(model, samples, tokens, "cpu", tiny.IMAGE_PROCESSOR_CONFIG, max_new_tokens=3)
    for sample, answer in zip(samples, ours, strict=True):
        inputs = processor.apply_chat_template(sample.messages(), tokenize=True, add_generation_prompt=True,
                                               return_dict=True, return_tensors="pt")
        out = hf.generate(**inputs, max_new_tokens=3, do_sample=False)
        text = processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        assert answer == text


def test_train_steps_reduce_loss_on_fixed_batch(tokens):
    """A few AdamW steps on one fixed batch of a toy model: the loss is finite and goes down."""
    from benchmarks.quality.train import batch_loss, build_model, make_optimizer

    torch.manual_seed(0)
    model = build_model(ckpt.probe_spec(ckpt.TOY_OVERRIDES), "cpu", seed=0)
    optimizer = make_optimizer(model, lr=3e-3)
    batch = build_batch(sc.heldout(4), tokens)
    losses = []
    for _ in range(6):
        loss, hits = batch_loss(model, batch, tiny.IMAGE_PROCESSOR_CONFIG)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert all(np.isfinite(losses)) and hits.shape == batch.target_ids.shape
    assert losses[-1] < losses[0] - 0.5 and all(b < a for a, b in zip(losses, losses[1:], strict=False))


def test_train_init_continues_from_a_checkpoint(toy_checkpoint):
    """``--init`` loads a checkpoint's weights over a fresh model (every tensor equal afterwards;
    a fresh model differs), and refuses a checkpoint of another shape."""
    from benchmarks.quality.train import build_model, load_init

    folder, saved = toy_checkpoint
    model = build_model(ckpt.probe_spec(ckpt.TOY_OVERRIDES), "cpu", seed=5)
    assert not all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), saved.state_dict().values(),
                                                         strict=True))
    load_init(model, folder)
    for name, tensor in saved.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    with pytest.raises(RuntimeError):
        load_init(build_model(ckpt.probe_spec(), "cpu"), folder)


def test_checkpoint_shards_transfer_and_load(tmp_path, toy_checkpoint):
    """Shards stay under the limit (a larger tensor alone), the split/join round trip is exact,
    and Prism's loader reads the sharded folder."""
    from engine.model.qwen3_vl import load_model

    folder, model = toy_checkpoint
    out = ckpt.copy_skeleton(folder, tmp_path / "ckpt")
    limit = 4 << 20
    shards = ckpt.save_weights(model.state_dict(), out, shard_bytes=limit)
    assert len(shards) >= 2 and (out / ckpt.INDEX_FILE).exists()
    from safetensors import safe_open

    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            tensors = len(list(f.keys()))
        assert shard.stat().st_size <= limit + (64 << 10) or tensors == 1
    parts = ckpt.split_for_transfer(out, tmp_path / "parts", part_bytes=3 << 20)
    assert all((tmp_path / "parts" / n).exists() or list((tmp_path / "parts").glob(n + ".part*")) for n in parts)
    assert max(p.stat().st_size for p in (tmp_path / "parts").iterdir()) <= 3 << 20
    joined = ckpt.join_parts(tmp_path / "parts", ckpt.copy_skeleton(folder, tmp_path / "joined"))
    loaded = load_model(joined, progress=False)
    state = ckpt.load_weights(joined)
    assert set(state) == set(model.state_dict())
    for name, tensor in model.state_dict().items():
        assert torch.equal(state[name].float(), tensor.to(torch.bfloat16).float())
    embed = state["model.language_model.embed_tokens.weight"].float()
    assert torch.equal(loaded.language_model.embed_tokens.weight, embed)
    bad = tmp_path / "parts" / next(iter(parts))
    victim = bad if bad.exists() else sorted((tmp_path / "parts").glob(bad.name + ".part*"))[0]
    victim.write_bytes(b"x" + victim.read_bytes()[1:])
    with pytest.raises(ValueError, match="sha256"):
        ckpt.join_parts(tmp_path / "parts", tmp_path / "joined2")


def test_aux_place_targets_are_each_tokens_cell_in_raster_order():
    """``--aux-place``: merged token ``t`` of an image of 8 x 8 cells is labelled ``(t // 8, t % 8)``,
    image after image (the order :func:`cell_labels` documents and the test above checks against
    the pixels); its loss adds the mean of the row and column cross-entropies over every cell and
    over the cells holding a shape to the cell loss, and reports that part and the column hits on
    shape cells; the cell heads start from the same weights as without place targets (a
    continuation finds its tower matched to them)."""
    from benchmarks.quality.train import AuxHeads

    torch.manual_seed(3)
    heads = AuxHeads(16, 1, grid=(8, 8))
    torch.manual_seed(3)
    plain = AuxHeads(16, 1)
    assert plain.places is None
    for a, b in zip(heads.heads.parameters(), plain.heads.parameters(), strict=True):
        assert torch.equal(a, b)
    place = heads.place_labels(128, "cpu")
    assert place[:64].tolist() == [[t // 8, t % 8] for t in range(64)] and torch.equal(place[64:], place[:64])
    with pytest.raises(ValueError, match="whole images"):
        heads.place_labels(100, "cpu")
    torch.manual_seed(0)
    tokens, labels = torch.randn(128, 16), torch.zeros(128, 3, dtype=torch.long)
    with torch.no_grad():  # loss values only
        heads.places[0].weight.zero_()  # uniform place logits: log 8 for the row and for the column
        heads.places[0].bias.zero_()
        without = plain.loss([tokens], labels)
        with_place = heads.loss([tokens], labels)
        assert without.column_hits is None and float(without.place) == 0.0
        assert abs(float(with_place.loss - without.loss) - math.log(8)) < 1e-5  # no shape cell: every cell only
        assert abs(float(with_place.place) - math.log(8)) < 1e-5
        labels[[3, 9, 70], 0], labels[[3, 9, 70], 1] = 1, 2  # three shape cells: their term adds log 8 again
        with_place, without = heads.loss([tokens], labels), plain.loss([tokens], labels)
        assert abs(float(with_place.loss - without.loss) - 2 * math.log(8)) < 1e-5
        assert with_place.column_hits[1] == 3 and 0 <= with_place.column_hits[0] <= 3
        heads.places[0].bias[8:] = 100 * torch.eye(8)[1]  # always column 1: of cells 3, 9 and 70 only 9 is there
        assert heads.loss([tokens], labels).column_hits.tolist() == [1.0, 3.0]


def test_toy_run_with_aux_loss_and_size_override_saves_a_plain_qwen3vl(tmp_path, tiny_ckpt, processor):
    """``train`` end to end on the CPU with ``--aux-weight`` (merger and DeepStack heads) and a
    wider vision tower: it trains a few steps (aux statistics in the history), saves a checkpoint
    whose config has the run's size and whose tensors are exactly the model's (no aux head), which
    Prism's engine and transformers both load and answer with; the transfer folder carries the
    config, so joining it over a default-size skeleton gives the same folder; an oversized model,
    and place targets without the aux loss, are refused before training."""
    import json

    from benchmarks.quality.train import parse_args, train
    from engine import Engine, SamplingParams

    out, parts = tmp_path / "ckpt", tmp_path / "parts"
    metrics = train(parse_args([
        "--out", str(out), "--toy", "--steps", "3", "--batch", "4", "--workers", "0", "--eval", "5",
        "--aux-weight", "0.5", "--aux-deepstack", "--aux-place", "--vision-width", "48", "--vision-mlp", "96",
        "--curriculum", "binding2", "--transfer", str(parts), "--metrics", str(tmp_path / "m.json"),
        "--device", "cpu", "--log-every", "1", "--ckpt-minutes", "0", "--lr", "3e-3", "--warmup", "1"]))
    assert metrics["steps"] == 3 and metrics["aux_weight"] == 0.5 and metrics["aux_levels"] == 2
    assert metrics["aux_place"] is True
    assert all(np.isfinite(h["aux_loss"]) and 0 <= h["aux_kind_accuracy"] <= 1 for h in metrics["history"])
    assert all(0 < h["aux_place_loss"] < h["aux_loss"] and 0 <= h["aux_column_accuracy"] <= 1
               for h in metrics["history"])
    assert metrics["vision_config"]["hidden_size"] == 48
    config = json.loads((out / "config.json").read_text())
    assert config["vision_config"]["hidden_size"] == 48 and config["vision_config"]["intermediate_size"] == 96
    spec = ckpt.probe_spec(ckpt.size_overrides(ckpt.TOY_OVERRIDES, vision_width=48, vision_mlp=96))
    state = ckpt.load_weights(out)
    shapes = tiny.tensor_shapes(spec)
    assert {k: tuple(v.shape) for k, v in state.items()} == {k: tuple(v) for k, v in shapes.items()}

    samples = sc.heldout(3)
    with Engine.from_pretrained(out, device="cpu", dtype=torch.float32, kv_cache_dtype="auto", compaction=None,
                                progress=False) as engine:
        prism = [engine.generate(s.messages(), SamplingParams(max_tokens=3, temperature=0.0),
                                 cache_salt=s.uid).text for s in samples]
    hf = _hf_model(out)
    for sample, theirs in zip(samples, prism, strict=True):
        inputs = processor.apply_chat_template(sample.messages(), tokenize=True, add_generation_prompt=True,
                                               return_dict=True, return_tensors="pt")
        generated = hf.generate(**inputs, max_new_tokens=3, do_sample=False)
        assert processor.tokenizer.decode(generated[0, inputs["input_ids"].shape[1]:],
                                          skip_special_tokens=True) == theirs

    skeleton = ckpt.write_skeleton(tmp_path / "joined", ckpt.probe_spec(ckpt.TOY_OVERRIDES))
    ckpt.join_parts(parts, skeleton)
    assert json.loads((skeleton / "config.json").read_text()) == config
    assert set(ckpt.load_weights(skeleton)) == set(state)

    with pytest.raises(SystemExit, match="refused"):
        train(parse_args(["--out", str(tmp_path / "big"), "--skeleton", str(tiny_ckpt), "--vision-width", "256",
                          "--vision-mlp", "1024", "--device", "cpu", "--workers", "0"]))
    with pytest.raises(SystemExit, match="aux-weight"):  # place targets without the aux loss would be ignored
        train(parse_args(["--out", str(tmp_path / "noaux"), "--toy", "--aux-place", "--device", "cpu",
                          "--workers", "0"]))


# --------------------------------------------------------------------------------------------
# The committed probe model
# --------------------------------------------------------------------------------------------


def test_committed_model_loads_in_transformers_and_prism():
    """transformers and Prism (float32, KV in the model dtype, no compaction) both load the committed
    checkpoint and give the trainer's own greedy answers; the answers to word and count questions,
    which the model learned, are right (random or misloaded weights would not read them)."""
    from transformers import AutoProcessor

    from benchmarks.quality import MODEL_DIR
    from benchmarks.quality.train import greedy_answers
    from engine import Engine, SamplingParams

    samples = sc.heldout(10)
    hf = _hf_model(MODEL_DIR)
    hf_proc = AutoProcessor.from_pretrained(str(MODEL_DIR))
    model = ProbeVL(ModelConfig.from_folder(MODEL_DIR))
    model.load_state_dict({k: v.float() for k, v in ckpt.load_weights(MODEL_DIR).items()})
    ours = greedy_answers(model, samples, PromptTokens(MODEL_DIR / "tokenizer.json"), "cpu",
                          tiny.IMAGE_PROCESSOR_CONFIG)
    with Engine.from_pretrained(MODEL_DIR, device="cpu", dtype=torch.float32, kv_cache_dtype="auto",
                                compaction=None, progress=False) as engine:
        prism = [engine.generate(s.messages(), SamplingParams(max_tokens=4, temperature=0.0),
                                 cache_salt=s.uid).text for s in samples]
    for sample, mine, theirs in zip(samples, ours, prism, strict=True):
        inputs = hf_proc.apply_chat_template(sample.messages(), tokenize=True, add_generation_prompt=True,
                                             return_dict=True, return_tensors="pt")
        out = hf.generate(**inputs, max_new_tokens=4, do_sample=False)
        text = hf_proc.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        assert mine == theirs == text, sample.uid
        if sample.qtype in ("word", "count"):
            assert sc.is_correct(mine, sample), sample.uid
