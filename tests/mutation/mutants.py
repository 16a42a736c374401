"""The curated planted bugs of the mutation check (run by ``tests/mutation/run.py``, see docs/TESTING.md).

Each :class:`Mutant` is one bug a test must catch: a text replacement in one file of a temporary copy
of the repository (``old`` must occur there exactly once), the tests that must then fail, and any
environment the run needs. Entries whose ``path`` is a test file or whose change is only ``env`` check
the test fixtures themselves (a missing tokenizer or browser must fail, not skip).

When a change to the code makes an ``old`` text stale, ``run.py`` reports the entry as not applied:
update the entry to plant the same bug in the new code.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Mutant:
    """One planted bug.

    Attributes:
        name: short id (``--only NAME``).
        bug: what is wrong, in words (and what a user would see).
        path: file to change, relative to the repository root; None for an environment-only entry.
        old: exact text in ``path`` (occurs exactly once), replaced by ``new``.
        new: the planted bug.
        tests: pytest node ids (``file`` or ``file::test``) that must fail; they must pass unchanged.
        env: extra environment variables for the mutant's run.
    """

    name: str
    bug: str
    path: str | None
    old: str
    new: str
    tests: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)


PREFIX = "tests/test_prefix_cache.py::"
DEFERRED = "tests/test_deferred_images.py::"
HOST = "tests/test_host_tier.py::"
WARM = "tests/test_warm_scheduler.py::"
BUDGET = "tests/test_warm_budget.py::"
KERNELS = "tests/test_triton_kernels.py::"
REFERENCE = "tests/test_ops_reference.py::"

MUTANTS: list[Mutant] = [
    # ---------------------------------------------------------------- engine: prefix cache, compaction
    Mutant(
        "prefix-key-ignores-salt",
        "the prefix key leaves out the cache salt: one session's question hits another's cached images",
        "engine/cache/prefix_cache.py",
        "for part in (namespace, salt, *image_hashes, compaction, str(len(prefix_ids)), ids):",
        "for part in (namespace, *image_hashes, compaction, str(len(prefix_ids)), ids):",
        (PREFIX + "test_same_image_under_another_salt_is_a_miss_with_no_shared_work",),
    ),
    Mutant(
        "kept-count-round-half-up",
        "compaction rounds the kept count half up (2.5 -> 3) instead of to even",
        "engine/cache/compaction.py",
        "return min(n, max(min_keep, round(keep_ratio * n)))",
        "return min(n, max(min_keep, int(keep_ratio * n + 0.5)))",
        ("tests/test_compaction.py",),
    ),
    Mutant(
        "kept-count-ceil",
        "compaction rounds the kept count up (38.4 -> 39)",
        "engine/cache/compaction.py",
        "return min(n, max(min_keep, round(keep_ratio * n)))",
        "return min(n, max(min_keep, -int(-keep_ratio * n // 1)))",
        (PREFIX + "test_hit_and_miss_telemetry_and_stats",),
    ),
    Mutant(
        "kept-count-one-more",
        "compaction keeps one visual token more per span than round(keep_ratio * n)",
        "engine/cache/compaction.py",
        "return min(n, max(min_keep, round(keep_ratio * n)))",
        "return min(n, max(min_keep, round(keep_ratio * n) + 1))",
        ("tests/test_selectors.py::test_kept_positions_keep_the_count_per_span_and_drop_the_rest",
         "tests/test_selectors.py::test_kept_positions_follow_each_spans_own_stored_scores",
         "tests/test_selectors.py::test_compaction_really_drops_tokens_and_pages",
         "tests/test_prefix_info.py::test_reported_bitmap_is_the_selectors_output"),
    ),
    Mutant(
        "evict-most-recent-on-tie",
        "among prefix entries of equal value the most recently used is evicted first (not the least)",
        "engine/cache/prefix_cache.py",
        "return (entry.value(), entry.last_used)",
        "return (entry.value(), -entry.last_used)",
        (PREFIX + "test_prefixes_of_equal_value_are_evicted_least_recently_used_first",),
    ),
    Mutant(
        "hit-runs-vision-encoder",
        "a prefix hit still feeds every image of the prompt through the vision path (no skip)",
        "engine/serving/scheduler.py",
        "tuple(req.visual_items_in(start, start + n))",
        "tuple(req.visual_items_in(0, start + n))",
        (PREFIX + "test_hit_and_miss_telemetry_and_stats",
         PREFIX + "test_video_prefix_is_cached_but_not_compacted_by_default"),
    ),
    # ---------------------------------------------------------------- FP8 store: reference
    Mutant(
        "ref-store-v-scale-from-k",
        "the reference FP8 store quantises V with K's scale (K's amax)",
        "ops/reference.py",
        "        vq, vs = quantize_fp8(v)\n",
        "        vs = ks\n        vq = (v.float() / vs.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)\n",
        (REFERENCE + "test_paged_attention_matches_oracle",),
    ),
    Mutant(
        "ref-store-v-scale-from-k-error-bound",
        "the same bug, seen by the FP8 error bounds against unquantised K/V (not by the oracle)",
        "ops/reference.py",
        "        vq, vs = quantize_fp8(v)\n",
        "        vs = ks\n        vq = (v.float() / vs.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)\n",
        (REFERENCE + "test_fp8_error_versus_unquantised",),
    ),
    Mutant(
        "ref-store-k-scale-from-v",
        "the reference FP8 store quantises K with V's scale (V's amax)",
        "ops/reference.py",
        "        kq, ks = quantize_fp8(k)\n        vq, vs = quantize_fp8(v)\n",
        "        vq, vs = quantize_fp8(v)\n"
        "        ks = vs\n        kq = (k.float() / ks.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)\n",
        (REFERENCE + "test_paged_attention_matches_oracle",),
    ),
    Mutant(
        "ref-quantize-one-scale-per-token",
        "FP8 quantisation takes one scale per token for all KV heads instead of one per (token, head)",
        "ops/reference.py",
        "    amax = xf.abs().amax(dim=-1).clamp(min=AMAX_FLOOR)\n",
        "    amax = xf.abs().amax(dim=-1).amax(dim=-1, keepdim=True).expand(xf.shape[:-1]).clamp(min=AMAX_FLOOR)\n",
        ("tests/test_fp8_engine.py::test_fp8_logits_are_finite_and_first_tokens_agree",),
    ),
    # ---------------------------------------------------------------- FP8 store: Triton (interpreter on CPU)
    Mutant(
        "triton-store-v-scale-from-k",
        "the Triton FP8 store computes V's scale from K's amax",
        "ops/triton_kernels/kv_store.py",
        "vs = tl.math.div_rn(tl.maximum(tl.max(tl.abs(v), axis=0), amax_floor), fp8_max)",
        "vs = tl.math.div_rn(tl.maximum(tl.max(tl.abs(k), axis=0), amax_floor), fp8_max)",
        (KERNELS + "test_store_kv_matches_reference",),
        {"TRITON_INTERPRET": "1"},
    ),
    Mutant(
        "triton-store-k-scale-from-v",
        "the Triton FP8 store computes K's scale from V's amax",
        "ops/triton_kernels/kv_store.py",
        "ks = tl.math.div_rn(tl.maximum(tl.max(tl.abs(k), axis=0), amax_floor), fp8_max)",
        "ks = tl.math.div_rn(tl.maximum(tl.max(tl.abs(v), axis=0), amax_floor), fp8_max)",
        (KERNELS + "test_store_kv_matches_reference",),
        {"TRITON_INTERPRET": "1"},
    ),
    Mutant(
        "triton-store-out-v-with-k-scale",
        "the Triton store's out= hands back V dequantised with K's scale",
        "ops/triton_kernels/kv_store.py",
        "tl.store(vo_ptr + out, (vq.to(tl.float32) * vs).to(vo_ptr.dtype.element_ty), mask=m)",
        "tl.store(vo_ptr + out, (vq.to(tl.float32) * ks).to(vo_ptr.dtype.element_ty), mask=m)",
        (KERNELS + "test_store_kv_hands_back_what_the_pages_hold",),
        {"TRITON_INTERPRET": "1"},
    ),
    # ---------------------------------------------------------------- sessions and the app
    Mutant(
        "revoked-share-still-resolves",
        "a revoked share link still opens the shared session",
        "sessions/shares.py",
        '"WHERE token_hash = ? AND revoked_at IS NULL",',
        '"WHERE token_hash = ?",',
        ("tests/test_sessions.py::test_share_tokens",
         "tests/test_app_routes.py::test_revoked_and_unknown_tokens_reveal_nothing"),
    ),
    Mutant(
        "revoked-share-still-forks",
        "a share revoked after the visitor resolved it can still be forked",
        "sessions/shares.py",
        "if current is None or current.revoked_at is not None:",
        "if current is None:",
        ("tests/test_sessions.py::test_fork_session",),
    ),
    Mutant(
        "chat-sends-no-salt",
        "the chat asks every session's questions under no cache salt (one shared cache for everyone)",
        "app/chat.py",
        "history), sampling,\n                                   cache_salt=session.cache_salt)",
        "history), sampling,\n                                   cache_salt=None)",
        ("tests/test_app_chat.py::test_each_session_asks_under_its_own_cache_salt",),
    ),
    Mutant(
        "store-one-salt-for-all-sessions",
        "every new session gets the same cache salt",
        "sessions/store.py",
        "[session_id, owner_hash(owner), title, secrets.token_hex(16), now, now],",
        '[session_id, owner_hash(owner), title, "0" * 32, now, now],',
        ("tests/test_app_chat.py::test_each_session_asks_under_its_own_cache_salt",),
    ),
    Mutant(
        "chat-keeps-only-the-last-delta",
        "the streamed answer keeps only the newest delta instead of the text so far",
        "app/chat.py",
        "                self.text += item\n",
        "                self.text = item\n",
        ("tests/test_app_chat.py::test_questions_about_images_miss_then_hit",),
    ),
    Mutant(
        "api-ignores-disconnect",
        "the OpenAI API keeps generating for a client that has gone away",
        "app/openai_api.py",
        "            await _until_disconnected(request)\n",
        "            await asyncio.Event().wait()\n",
        ("tests/test_app_openai.py::test_client_disconnect_cancels_the_request",
         "tests/test_app_openai.py::test_a_client_that_disconnects_before_a_whole_answer_over_http_cancels_its_request"),
    ),
    Mutant(
        "image-route-normalises-dot-segments",
        "/images/ normalises the path before checking it, so /images/<sha>/../<sha> serves a file",
        "app/server.py",
        "        if not (_SHA_RE.fullmatch(sha) and store.owner_has_image(owner_from(request), sha)):\n",
        '        sha = __import__("posixpath").normpath(sha)\n'
        "        if not (_SHA_RE.fullmatch(sha) and store.owner_has_image(owner_from(request), sha)):\n",
        ("tests/test_app_routes.py::test_image_route_refuses_paths_of_stored_files",),
    ),
    Mutant(
        "api-reports-prompt-as-cached",
        "the OpenAI usage reports every prompt token as cached (prompt_tokens, not the reused prefix)",
        "app/openai_api.py",
        '"prompt_tokens_details": {"cached_tokens": tel.cached_tokens}}',
        '"prompt_tokens_details": {"cached_tokens": prompt if tel.cached_tokens else 0}}',
        ("tests/test_app_openai.py::test_completion_with_an_image",),
    ),
    Mutant(
        "body-of-exactly-the-cap-refused",
        "a request body of exactly its route's cap is refused 413 (the cap is treated as exclusive)",
        "app/guards.py",
        "        if size > cap:",
        "        if size >= cap:",
        ("tests/test_app_security.py::test_a_body_of_exactly_the_cap_is_read_and_one_byte_more_is_refused",),
    ),
    Mutant(
        "gradio-guard-refuses-exactly-its-limit",
        "the Gradio guard gives up on a body of exactly its limit (reads it as one byte too many)",
        "app/gradio_guard.py",
        "        if size > limit:",
        "        if size >= limit:",
        ("tests/test_app_security.py::test_the_gradio_guard_reads_a_body_of_exactly_its_limit",),
    ),
    Mutant(
        "api-abort-looks-finished",
        "an API answer cut short (shutdown, cancel) ends with finish_reason \"stop\", like a finished one",
        "app/openai_api.py",
        'return {"stop": "stop", "length": "length"}.get(completion.finish_reason, "abort")',
        'return "length" if completion.finish_reason == "length" else "stop"',
        ("tests/test_app_openai.py::test_a_stream_cut_short_by_a_shutdown_does_not_end_like_a_finished_answer",
         "tests/test_app_openai.py::test_non_streaming_answers_cut_short_get_an_error_status"),
    ),
    Mutant(
        "store-drops-turns-of-another-chat",
        "editing from a turn id of another chat deletes this chat's later turns",
        "sessions/store.py",
        'if not rows or rows[0]["id"] != turn_id:',
        "if not rows:",
        ("tests/test_sessions.py::test_delete_turns_from_drops_that_turn_and_later_ones_only",),
    ),
    Mutant(
        "edit-trusts-a-stale-tab",
        "an edit from a tab showing an older chat replaces whichever question is now at that position",
        "app/ui.py",
        "if isinstance(previous_value, str) and previous_value != view.question:",
        "if False:",
        ("tests/test_app_chat.py::test_page_edit_maps_the_chat_position_to_the_turn_and_checks_it",),
    ),
    Mutant(
        "cancelled-delete-deletes",
        "Delete ignores the browser's confirm() answer: Cancel deletes the chat",
        "app/ui.py",
        "if confirmed is not True or self.chat.session(session_id, owner) is None:",
        "if self.chat.session(session_id, owner) is None:",
        ("tests/test_app_chat.py::test_handlers_open_rename_new_and_delete",),
    ),
    Mutant(
        "busy-chat-takes-edits",
        "a chat whose answer is streaming takes a regenerate or edit (from any tab) and races it",
        "app/chat.py",
        """        turn = self._turn_of(session, turn_id)
        self._refuse_if_busy(session.id)""",
        """        turn = self._turn_of(session, turn_id)""",
        ("tests/test_app_chat.py::test_a_chat_with_a_streaming_answer_refuses_every_change_from_any_tab",),
    ),
    # ---------------------------------------------------------------- images, vision graphs, loading, sampling
    Mutant(
        "bomb-decoded-before-size-check",
        "an image's pixels are decoded before its claimed size is checked (a decompression bomb is decoded)",
        "engine/inputs/images.py",
        "    _check_geometry(image.size, options)\n    try:\n        image.load()\n",
        "    try:\n        image.load()\n        _check_geometry(image.size, options)\n",
        ("tests/test_images.py::test_bomb_check_does_not_rely_on_pillow_global",),
    ),
    Mutant(
        "vision-graph-replays-stale-pixels",
        "a vision-graph replay does not copy the new pixels in: it answers for the captured ones",
        "engine/graphs/vision.py",
        "        entry.pixels.copy_(pixels)\n",
        "",
        ("tests/test_vision_graphs.py::test_replay_answers_for_its_own_pixels_in_fresh_tensors",),
    ),
    Mutant(
        "vision-graph-returns-its-buffers",
        "a vision-graph replay returns the graph's own output buffers (the next replay overwrites them)",
        "engine/graphs/vision.py",
        "return VisionFeatures(entry.out.embeds.clone(), [d.clone() for d in entry.out.deepstack])",
        "return VisionFeatures(entry.out.embeds, list(entry.out.deepstack))",
        ("tests/test_vision_graphs.py::test_replay_answers_for_its_own_pixels_in_fresh_tensors",),
    ),
    Mutant(
        "default-dtype-bfloat16-on-cpu",
        "Engine.from_pretrained(dtype=None) picks bfloat16 on the CPU",
        "engine/options.py",
        'return torch.bfloat16 if device.type == "cuda" else torch.float32',
        "return torch.bfloat16",
        ("tests/test_engine_api.py::test_from_pretrained_device_and_dtype",),
    ),
    Mutant(
        "sampler-returns-a-tensor",
        "the sampler returns a one-element tensor instead of an int token id",
        "engine/serving/sampling.py",
        "return int(torch.multinomial(probs, 1, generator=self.generator))",
        "return torch.multinomial(probs, 1, generator=self.generator)",
        ("tests/test_sampling.py::test_half_precision_logits",),
    ),
    # ---------------------------------------------------------------- the fixtures themselves
    Mutant(
        "tiny-checkpoint-unbuildable",
        "the tiny checkpoint cannot be built (its tokenizer ranks are missing): its tests must fail, not skip",
        "engine/model/qwen_tokenizer.py",
        'spec = importlib.util.find_spec("dashscope")',
        'spec = importlib.util.find_spec("no_such_dashscope")',
        ("tests/test_compaction.py::test_engine_turns_bad_compaction_options_into_invalid_request",),
    ),
    Mutant(
        "chromium-missing-under-ci",
        "under .ci/run (PRISM_CI=1) a missing Chromium fails the browser test instead of skipping it",
        "tests/test_e2e_browser.py",
        'CHROMIUM = "/usr/bin/chromium"',
        'CHROMIUM = "/nonexistent/chromium"',
        ("tests/test_e2e_browser.py",),
        {"PRISM_CI": "1"},
    ),
    Mutant(
        "stray-skip-under-ci",
        "under .ci/run (PRISM_CI=1) a test that skips for a reason other than needing a GPU fails the run",
        "tests/test_compaction.py",
        "def test_selectors_registry():\n",
        'def test_selectors_registry():\n    pytest.skip("flaky on this machine")\n',
        ("tests/test_compaction.py::test_selectors_registry",),
        {"PRISM_CI": "1"},
    ),
    Mutant(
        "module-skip-under-ci",
        "under .ci/run (PRISM_CI=1) a test module that skips as a whole at import (Triton missing) fails the run",
        "tests/test_linear.py",
        'pytest.importorskip("triton")',
        'pytest.importorskip("triton_is_not_installed")',
        ("tests/test_linear.py",),
        {"PRISM_CI": "1"},
    ),
    Mutant(
        "resume-resamples-last-token",
        "a preempted request drops its last generated token and samples it again on resuming: the ids "
        "come out right, but that token's text is streamed twice",
        "engine/serving/scheduler.py",
        "        req.num_computed = 0\n        req.status = Status.WAITING\n",
        "        req.num_computed = 0\n        if len(req.tokens) > req.num_prompt:\n"
        "            req.tokens.pop()\n        req.status = Status.WAITING\n",
        ("tests/test_scheduler.py::test_a_preempted_stream_sends_each_token_once",),
    ),
    Mutant(
        "cow-copy-not-ordered",
        "copy-on-write takes a fresh page but orders no copy of the shared page's K/V: a prefix hit's "
        "question attends to an uninitialised last page",
        "engine/cache/kv_pool.py",
        "        self.orders.append(PageCopy(block_table[-1], fresh))\n",
        "",
        ("tests/test_scheduler_core.py::test_prefix_attach_and_copy_on_write",
         "tests/test_kv_pool.py::test_fork_last_copies_a_shared_partly_filled_page"),
    ),
    # ---------------------------------------------------------------- engine: the merging compaction (issue 35.3)
    Mutant(
        "merged-v-keeps-old-scale",
        "a merging compaction on FP8 pages writes the merged V's new payload but keeps the kept token's old "
        "V scale (not requantised with a fresh per-token, per-head scale): merged values come out rescaled",
        "engine/cache/kv_pool.py",
        "                vs_all[base + dp, :, do] = scale.view(merged.shape[:-1])\n",
        "",
        ("tests/test_merge_values.py::test_value_merge_rewrites_only_the_kept_values",),
    ),
    Mutant(
        "merge-neighbour-in-row-major-order",
        "a dropped token is merged into the kept token nearest in row-major order, not in the image's 2D grid: "
        "the token below a kept one goes to the end of the row above",
        "engine/cache/compaction.py",
        "    return torch.argmin(dr * dr + dc * dc, dim=1)",
        "    return torch.argmin((tokens[:, None] - kept[None, :]).abs(), dim=1)",
        ("tests/test_merge_values.py::test_nearest_kept_is_the_grid_neighbour_ties_to_the_lower_offset",
         "tests/test_merge_values.py::test_merged_hit_equals_cold_run_and_the_merged_masked_oracle"),
    ),
    Mutant(
        "merge-recorded-not-ordered",
        "a merging compaction when the prefix is cached records the merged groups but never orders the V "
        "rewrite: the engine answers drop-only while claiming to merge",
        "engine/cache/prefix_reuse.py",
        "                self.pool.merge_values(table, kept[plan.into].tolist(), plan.weight.tolist())\n",
        "",
        ("tests/test_merge_values.py::test_merged_hit_equals_cold_run_and_the_merged_masked_oracle",),
    ),
    Mutant(
        "plan-orders-out-of-order",
        "the step plan carries the pool's data moves in reverse: a copy-on-write copy of a page runs before "
        "the compaction move that fills it",
        "engine/serving/scheduler.py",
        "plan.kv_orders = fold_page_copies(self.pool.take_orders())",
        "plan.kv_orders = fold_page_copies(self.pool.take_orders()[::-1])",
        ("tests/test_scheduler_core.py::test_compaction_orders_the_kept_slots_before_the_next_copy_on_write",),
    ),
    Mutant(
        "detokenise-under-the-loop-lock",
        "the loop pushes sampled tokens through the detokeniser while it holds its lock: stats() and the "
        "web server's reads wait for every step's text",
        "engine/serving/loop.py",
        "        ends = [(req, reason) for req, token in sampled if (reason := self._deliver(req, token))]\n"
        "        with self._cv:\n",
        "        with self._cv:\n"
        "            ends = [(req, reason) for req, token in sampled if (reason := self._deliver(req, token))]\n",
        ("tests/test_scheduler_core.py::test_detokenisation_runs_outside_the_loop_lock",),
    ),
    Mutant(
        "on-pressure-compacts-when-cached",
        "compaction_mode='on_pressure' still compacts a prefix as soon as it is computed",
        "engine/cache/prefix_reuse.py",
        'dense = self.mode == "on_pressure" or self.compaction.method is None',
        "dense = self.compaction.method is None",
        ("tests/test_on_pressure.py",),
    ),
    Mutant(
        "keep-one-refused-on-pressure",
        "under compaction_mode='on_pressure' a keep ratio of 1.0 is refused as a pressure step: "
        "launch.py --keep-ratio 1.0 never loads its model (/healthz stays 503)",
        "engine/cache/compaction.py",
        "if not all(0 < r <= 1 for r in ratios)",
        "if not all(0 < r < 1 for r in ratios)",
        ("tests/test_on_pressure.py::test_keep_ratio_one_under_on_pressure_is_no_step",
         "tests/test_app_routes.py::test_keep_ratio_one_loads_and_keeps_every_visual_token"),
    ),
    # ---------------------------------------------------------------- benchmarks measure what they name
    Mutant(
        "quality-harness-default-mode",
        "bench_quality.py's engines keep the default compaction_mode (on_pressure): their pools never "
        "run short, so every 'compacted' row is the dense model's (kept 100%)",
        "benchmarks/bench_quality.py",
        "compaction_mode=COMPACTION_MODE, min_keep=args.min_keep",
        "min_keep=args.min_keep",
        ("tests/test_bench_modes.py::test_quality_rows_keep_what_their_ratio_says",),
    ),
    Mutant(
        "prefix-bench-default-mode",
        "bench_prefix.py's engine keeps the default compaction_mode: its 'compact' pages column is the dense prefix's",
        "benchmarks/bench_prefix.py",
        '"keep_ratio": args.keep_ratio, "compaction_mode": args.compaction_mode}',
        '"keep_ratio": args.keep_ratio}',
        ("tests/test_bench_modes.py::test_prefix_bench_compact_column_is_the_mode_it_prints",),
    ),
    Mutant(
        "gpu-bench-default-mode",
        "bench_gpu.py's engines keep the default compaction_mode: its prefix hits and pages are the dense prefix's",
        "benchmarks/bench_gpu.py",
        '"keep_ratio": 0.6,\n            "compaction_mode": args.compaction_mode}',
        '"keep_ratio": 0.6}',
        ("tests/test_bench_modes.py::test_gpu_bench_options_measure_the_mode_they_name",),
    ),
    Mutant(
        "later-step-ignores-earlier-kept",
        "a later compaction step chooses among all of a span's tokens, not the ones the earlier step kept",
        "engine/cache/compaction.py",
        "chosen = select(span, k, own, None if len(left) == span.length else left)",
        "chosen = select(span, k, own, None)",
        ("tests/test_compaction.py", "tests/test_on_pressure.py"),
    ),
    Mutant(
        "selector-ignores-its-scores",
        "a score-based selector ranks a span's tokens by position instead of by its stored scores",
        "engine/cache/compaction.py",
        "own = None if scores is None else {name: t[span.start : span.end] for name, t in scores.items()}",
        "own = None if scores is None else {name: torch.arange(span.length, 0, -1).float() for name in scores}",
        ("tests/test_selectors.py",),
    ),
    Mutant(
        "forget-does-not-wait",
        "Engine.forget drops at once: a request of the salt still queued or running caches its prefix after it",
        "engine/engine.py",
        "            self.loop.wait_for_salt(cache_salt)\n",
        "",
        ("tests/test_forget.py::test_forget_waits_for_the_salts_queued_and_running_requests",),
    ),
    Mutant(
        "forget-keeps-vision-features",
        "Engine.forget leaves the salt's vision features: its next question skips the vision encoder",
        "engine/inputs/vision_features.py",
        "return self.cache.forget(salt), graphs",
        "return 0, graphs",
        ("tests/test_forget.py::test_a_forgotten_session_starts_from_scratch_and_another_keeps_its_caches",),
    ),
    Mutant(
        "gradio-session-any-owner",
        "a Gradio session id is served to any owner cookie, not only the one that opened it",
        "app/gradio_guard.py",
        "return hmac.compare_digest(bound, digest)",
        "return True",
        ("tests/test_app_security.py::test_a_gradio_session_id_reads_nothing_without_its_owners_cookie",),
    ),
    # ---------------------------------------------------------------- issue 32.6: media, eviction index
    Mutant(
        "upload-handoff-any-salt",
        "an upload's decoded pixels are handed to any session's question about the same bytes: "
        "another session's first question is faster when someone else uploaded the image",
        "engine/inputs/uploads.py",
        "found = self._items.pop((salt, key, namespace))",
        "found = self._items.pop(next((k for k in list(self._items._items) if k[1:] == (key, namespace)), None))",
        ("tests/test_media.py::test_another_session_never_takes_an_upload",),
    ),
    Mutant(
        "upload-handoff-skips-engine-limits",
        "the engine takes an image the store decoded under looser limits without checking its own",
        "engine/inputs/processed_images.py",
        "                check_image_size(image.size, self.image_options)\n",
        "",
        ("tests/test_media.py::test_the_engine_checks_its_own_limits_on_a_handed_over_image",),
    ),
    Mutant(
        "upload-decoded-twice",
        "the engine decodes an uploaded clip again instead of taking what the store's validation decoded",
        "engine/inputs/video.py",
        "video = UPLOADS.take(salt, key[1], self.sampling.namespace())",
        "video = None",
        ("tests/test_media.py::test_an_uploaded_clip_is_decoded_once",),
    ),
    Mutant(
        "eviction-index-evicts-a-read-entry",
        "the eviction index hands make_room an entry a request has pinned (it reads pages being freed)",
        "engine/cache/prefix_cache.py",
        "            if entry.users:\n                held.append",
        "            if False:\n                held.append",
        ("tests/test_eviction_index.py::test_make_room_evicts_what_the_full_sort_would_in_its_order",),
    ),
    Mutant(
        "eviction-index-stale-key",
        "the eviction index trusts an entry's key as queued: an entry hit (or compacted) since goes too early",
        "engine/cache/prefix_cache.py",
        "            if (value, used) != eviction_order(entry):",
        "            if False:",
        ("tests/test_eviction_index.py::test_make_room_evicts_what_the_full_sort_would_in_its_order",),
    ),
    # ---------------------------------------------------------------- the core in a child process
    Mutant(
        "core-resends-known-images",
        "the engine process is sent an image's bytes with every request, not once per content key",
        "engine/client.py",
        "            keys.touch(key)\n            if not resend:\n                return\n",
        "            keys.touch(key)\n",
        ("tests/test_engine_process.py::test_an_image_is_sent_once_then_named_by_its_key_and_the_second_question_hits",),
    ),
    Mutant(
        "core-blob-keys-across-sessions",
        "the engine process keeps image bytes by content alone: a session asking about an image another "
        "session sent skips sending it (its request is faster: it learns the other uploaded that image)",
        "engine/client.py",
        "                        key = blob_key(salt, bytes(data))",
        "                        key = hashlib.sha256(data).hexdigest()",
        ("tests/test_engine_process.py::test_another_session_sends_the_same_image_again",),
    ),
    Mutant(
        "core-keys-not-touched",
        "the engine process does not refresh an image key a request names: its LRU and the parent's "
        "part, and a request names bytes the child has dropped",
        "engine/client.py",
        "        if key in seen or key not in new:\n            if key in keys:\n                keys.touch(key)\n",
        "        if key in seen or key not in new:\n            pass\n",
        ("tests/test_engine_process.py::test_both_sides_keep_the_same_keys_and_every_reference_resolves",),
    ),
    Mutant(
        "healthz-ok-while-restarting",
        "/healthz answers ok (200) while the engine process is being restarted after a crash",
        "app/model_loader.py",
        '"restarting": "restarting", "failed": "error"}',
        '"restarting": "ok", "failed": "error"}',
        ("tests/test_app_engine_process.py",),
    ),
    Mutant(
        "core-crash-is-a-500",
        "a /v1 request whose engine process died answers 500 like an engine bug, not 503 aborted",
        "app/openai_api.py",
        "    if isinstance(exc, EngineAbortedError):\n",
        "    if False:\n",
        ("tests/test_app_engine_process.py",),
    ),
    Mutant(
        "handle-async-exit-keeps-running",
        "an event loop that stops reading a request's handle early leaves the request running (its pages held)",
        "engine/serving/handle.py",
        "                self.cancel(wait=False)\n",
        "                pass\n",
        ("tests/test_handle.py::test_closing_an_event_loops_iteration_early_cancels_without_blocking",
         "tests/test_handle.py::test_an_event_loop_leaving_an_engine_stream_early_frees_its_pages"),
    ),
    Mutant(
        "headless-mounts-pages",
        "--ui off still serves the web UI's page routes (share links, images, static files)",
        "app/server.py",
        'headless = settings.ui == "off"',
        "headless = False",
        ("tests/test_app_routes.py::test_ui_off_serves_only_the_api_metrics_and_health_without_importing_gradio",),
    ),
    # ---------------------------------------------------------------- issue 33: the host tier
    Mutant(
        "compaction-before-offload",
        "under offload_first the cache compacts a prefix (losing visual tokens) while the host tier has room",
        "engine/cache/reclaim.py",
        'if unit is not None and not (cache.reclaim_order == "compact_first" and lossy is not None):',
        "if unit is not None and lossy is None:",
        (HOST + "test_offload_comes_before_any_compaction_and_frees_the_pages_once_the_copy_lands",),
    ),
    Mutant(
        "offload-frees-pages-before-the-copy",
        "an offload's GPU pages go back to the free list before its copy has read them (a later step overwrites them)",
        "engine/cache/prefix_cache.py",
        "        self.pool.incref(pages)  # the copy's, until it lands\n",
        "",
        (HOST + "test_offload_comes_before_any_compaction_and_frees_the_pages_once_the_copy_lands",),
    ),
    Mutant(
        "attach-while-restoring",
        "a request attaches an entry whose host-to-GPU copy has not landed (it would read pages not yet written)",
        "engine/cache/prefix_cache.py",
        'return match.entry.alive and match.entry.base.tier == "restoring"',
        "return False",
        (HOST + "test_a_round_trip_keeps_key_kept_tokens_scores_and_every_value",
         HOST + "test_a_slow_restore_holds_only_its_own_request"),
    ),
    Mutant(
        "restore-not-awaited",
        "the plan that carries a host hit's restore does not tell the runner its runs read it (the forward "
        "may read pages the copy has not written)",
        "engine/serving/scheduler.py",
        "                plan.transfers_awaited.append(req.awaits)\n",
        "                pass\n",
        (HOST + "test_a_host_hit_prefills_in_the_plan_that_carries_its_restore",),
    ),
    Mutant(
        "restore-read-before-its-copy",
        "the runner starts a restore its runs read but does not wait for it before the next order (a "
        "copy-on-write of a restored page copies stale data)",
        "engine/serving/runner.py",
        "                if read:\n                    self.transfers.wait((order.xfer,))",
        "                if False:\n                    self.transfers.wait((order.xfer,))",
        (HOST + "test_the_runner_orders_a_read_restore_before_everything_after_it",),
    ),
    Mutant(
        "gated-restore-before-a-move",
        "a restore its runs read is started gated (the forward waits layer group by layer group) although a "
        "data move after it reads its pages whole: that copy-on-write copies pages still on the bus",
        "engine/serving/runner.py",
        "gated = read and self.gates is not None and i == len(orders) - 1",
        "gated = read and self.gates is not None",
        (HOST + "test_the_runner_orders_a_read_restore_before_everything_after_it",),
    ),
    Mutant(
        "gated-restore-never-waited",
        "after the forward the compute stream is not ordered after the step's gated restores: a page one of "
        "them writes, freed with a failed request, is reused by the next plan while the scatter still runs",
        "engine/serving/runner.py",
        "        if gated:\n            self.transfers.wait(gated)\n",
        "",
        (HOST + "test_after_the_forward_every_gated_restore_is_started_and_waited_for",),
    ),
    Mutant(
        "fork-folded-from-the-wrong-host-page",
        "a copy-on-write folded into its restore copies the restore's first host page, not the forked one's",
        "engine/cache/kv_transfer.py",
        "host = r.host_pages[r.pages.index(order.src)]",
        "host = r.host_pages[0]",
        (HOST + "test_a_fork_of_a_restored_page_rides_the_restore",
         HOST + "test_a_session_pushed_to_the_host_comes_back_dense_and_exact"),
    ),
    Mutant(
        "fork-folded-across-a-move",
        "a copy-on-write is folded into a restore although a data move between them may have written the page",
        "engine/cache/kv_transfer.py",
        "            restored.clear()",
        "            pass",
        (HOST + "test_a_fork_of_a_restored_page_rides_the_restore",),
    ),
    Mutant(
        "host-planes-mix-layer-groups",
        "the rows of a transfer are cut into layer groups without the page-major reorder: each host plane "
        "receives other groups' layers",
        "engine/cache/kv_transfer.py",
        "return rows.view(n, groups, -1).transpose(0, 1).reshape(groups, -1)",
        "return rows.view(groups, -1)",
        ("tests/test_host_tier_data.py::test_host_pages_hold_the_pages_page_major",),
    ),
    Mutant(
        "failed-restore-delivers-a-token",
        "a question that read a restore which failed still gets the token sampled from those pages",
        "engine/serving/scheduler.py",
        "            done = [req for req in done if req.id not in failed]\n",
        "",
        (HOST + "test_a_failed_restore_fails_only_the_request_that_needed_it",),
    ),
    Mutant(
        "host-loss-ignores-victims",
        "dropping host families to take an offload is priced as free: a hot host entry goes rather than a cold "
        "GPU prefix being compacted",
        "engine/cache/reclaim.py",
        "loss = sum(recompute_loss(cache, v) for v in victims) + restore_loss(cache, unit, len(pages))",
        "loss = restore_loss(cache, unit, len(pages))",
        (HOST + "test_host_full_compacts_when_the_host_holds_what_is_worth_more",),
    ),
    Mutant(
        "lossy-bound-skips-the-plan",
        "an offload priced against a compaction skips planning it even when the compaction could lose less "
        "(the host tier drops a hot family instead of compacting a cold GPU prefix)",
        "engine/cache/reclaim.py",
        "        if against <= bound:\n",
        "        if True:\n",
        (HOST + "test_the_lossy_move_looked_for_late_makes_the_moves_of_the_eager_one",),
    ),
    Mutant(
        "host-hit-restore-not-reported",
        "a hit restored from the host tier reports no restore time or pages, and is not counted as a host hit",
        "engine/cache/prefix_reuse.py",
        '        if tel.prefix_tier == "host" and not tel.preempted:  # counted once, when it attaches\n',
        "        if False:\n",
        (HOST + "test_a_session_pushed_to_the_host_comes_back_dense_and_exact",),
    ),
    Mutant(
        "second-request-computes-again",
        "a request for a prefix another request is computing computes it too instead of waiting and hitting it",
        "engine/cache/prefix_cache.py",
        "        return key in self._computing\n",
        "        return False\n",
        (PREFIX + "test_identical_concurrent_cold_pair",),
    ),
    Mutant(
        "no-free-page-watermark",
        "no offload ahead of demand: every host hit under pressure waits for an offload and then for its restore",
        "engine/cache/reclaim.py",
        "target = min(cache.pool.num_pages // 8, cache.largest_offload)",
        "target = 0",
        (HOST + "test_keep_free_offloads_ahead_of_demand_up_to_the_watermark",),
    ),
    Mutant(
        "host-pin-on-the-loop-thread",
        "host chunks are pinned on the caller's thread (the engine loop), stalling every stream ~0.17 s per 256 MiB",
        "engine/cache/host_pool.py",
        "        if (self.pin if prefetch is None else prefetch) and self._chunks:\n",
        "        if False:\n",
        ("tests/test_host_tier_data.py::test_prefetch_pins_one_chunk_ahead_on_a_background_thread",),
    ),
    Mutant(
        "host-pin-ahead-leaks",
        "close() keeps a chunk pinned ahead of need and never used registered: its pinned memory is never given back",
        "engine/cache/host_pool.py",
        "            for chunk in [*self._chunks, *ahead]:\n",
        "            for chunk in self._chunks:\n",
        ("tests/test_host_tier_data.py::test_pinned_chunks_are_touched_registered_and_unregistered_at_close",),
    ),
    Mutant(
        "host-pin-never-released",
        "close() unregisters no chunk: pinned host memory stays locked after the engine closed",
        "engine/cache/host_pool.py",
        "        if self.pin:\n            for chunk in",
        "        if False:\n            for chunk in",
        ("tests/test_host_tier_data.py::test_pinned_chunks_are_touched_registered_and_unregistered_at_close",),
    ),
    Mutant(
        "restore-to-the-wrong-rows",
        "a restore scatters a page's layers into the wrong rows of the pool (a restored hit reads another page's KV)",
        "engine/cache/kv_transfer.py",
        "        pool_buf.index_copy_(0, rows, pages.reshape(flat))\n",
        "        pool_buf.index_copy_(0, rows.flip(0), pages.reshape(flat))\n",
        ("tests/test_host_tier_data.py::test_offload_then_restore_elsewhere_is_bit_exact",),
    ),
    Mutant(
        "worker-keeps-every-copy",
        "a tensor-parallel worker never lets its finished host-tier copies go (events and index rows pile up)",
        "engine/parallel/worker.py",
        "                runner.transfers.poll()  # rank 0 reports copies; here finished ones are only let go\n",
        "                pass\n",
        ("tests/test_tensor_parallel.py::test_tp2_host_tier_every_rank_offloads_and_restores_its_shard",),
    ),
    Mutant(
        "worker-without-host-tier",
        "a tensor-parallel worker builds no host tier: rank 0's offload and restore orders are not run on its shard",
        "engine/parallel/worker.py",
        "transfers = KVTransfers(pool, HostPool(pool, host_pages)) if host_pages else None",
        "transfers = None",
        ("tests/test_tensor_parallel.py::test_tp2_host_tier_every_rank_offloads_and_restores_its_shard",),
    ),
    Mutant(
        "warm-ahead-of-a-waiting-question",
        "a warm is admitted while a question waits for pages (warms are not below every question)",
        "engine/serving/scheduler.py",
        "        if self.reuse is not None and not blocked and budget > 0:\n",
        "        if self.reuse is not None and budget > 0:\n",
        (WARM + "test_no_warm_is_admitted_while_a_question_waits_for_pages",),
    ),
    Mutant(
        "warm-keeps-its-pages",
        "a question waits for pages a running warm holds instead of taking them (the warm is not preempted)",
        "engine/serving/scheduler.py",
        "            warm = next((r for r in reversed(self.running) if r.warm), None)\n",
        "            warm = None\n",
        (WARM + "test_a_question_takes_a_running_warms_pages_and_the_warm_resumes_later",),
    ),
    Mutant(
        "warm-evicts-hit-entries",
        "a warm evicts idle entries that were hit (of more value than the warmed prefix)",
        "engine/cache/prefix_cache.py",
        "            if victim is None or victim.hits > 0:\n",
        "            if victim is None:\n",
        (WARM + "test_a_warm_evicts_only_entries_nobody_hit_and_is_dropped_when_nothing_frees_pages",),
    ),
    Mutant(
        "warmed-on-every-hit",
        "every question on a warmed prefix reports Telemetry.warmed, not only the first",
        "engine/cache/prefix_reuse.py",
        "            tel.warmed, base.warmed = True, False\n",
        "            tel.warmed = True\n",
        (WARM + "test_a_question_for_a_prefix_being_warmed_waits_and_hits_it_first_and_once",
         "tests/test_warm.py::test_a_warmed_prefix_makes_the_first_question_a_hit_equal_to_a_cold_run"),
    ),
    Mutant(
        "warm-chunk-unbounded-images",
        "a warm's chunk reaches any number of new images in one step (the encoder work per step is unbounded)",
        "engine/serving/scheduler.py",
        "            if len(new) > bound:\n",
        "            if False:\n",
        (WARM + "test_a_warms_chunk_reaches_one_new_image_a_step_while_a_question_runs",),
    ),
    Mutant(
        "warm-budget-ignored",
        "a step carries warm chunks whatever the warms' time budget holds (a warm beside a stream takes "
        "as much of the engine's time as the per-step bounds let it: the stream's TPOT grows)",
        "engine/serving/warm_budget.py",
        "        return self.credit >= need\n",
        "        return True\n",
        (BUDGET + "test_a_warm_beside_a_stream_takes_at_most_its_share_of_the_time_and_still_finishes",),
    ),
    Mutant(
        "warm-budget-banks-without-a-warm",
        "the warms' budget fills whenever the engine is contended, also with no warm waiting: a stream that "
        "ran alone banks a burst, and the next warm's first step runs inside the next stream at once",
        "engine/serving/scheduler.py",
        "        self.warm_budget.tick(warms_wait and self._contended())\n",
        "        self.warm_budget.tick(self._contended())\n",
        (BUDGET + "test_contention_before_a_warm_banks_nothing_and_the_bank_is_capped",),
    ),
    Mutant(
        "joined-warm-throttled",
        "a warm that a waiting question joined stays under the per-step bounds and the time budget (the "
        "person waits on a throttled warm)",
        "engine/serving/scheduler.py",
        "        promoted = [r for r in running if r.prefix_key in joined]\n",
        "        promoted = []\n",
        (BUDGET + "test_a_warm_a_waiting_question_joined_runs_unbounded_and_unbudgeted",),
    ),
    Mutant(
        "image-processed-per-request",
        "concurrent requests for one image of a session each process it (no in-flight sharing)",
        "engine/inputs/processed_images.py",
        "            running = self._in_flight.get(key)\n",
        "            running = None\n",
        ("tests/test_warm.py::test_eight_concurrent_first_questions_compute_the_prefix_once",),
    ),
    Mutant(
        "forget-keeps-warms",
        "forget leaves the salt's queued warms running: they cache the forgotten session's prefix afterwards",
        "engine/serving/loop.py",
        "                if req.warm and not req.cancelled:\n",
        "                if False:\n",
        ("tests/test_warm.py::test_forget_cancels_the_sessions_warms_and_nothing_of_them_stays_cached",),
    ),
    Mutant(
        "hit-processes-pixels",
        "a prompt about known images is never deferred: a prefix hit decodes and processes its photos again",
        "engine/engine.py",
        "        prompt = self.prompts.build(messages, salt, defer=True)\n        req = intake.request(",
        "        prompt = self.prompts.build(messages, salt)\n        req = intake.request(",
        (DEFERRED + "test_a_hit_processes_no_pixels_and_a_miss_processes_them_once",),
    ),
    Mutant(
        "deferred-never-processed",
        "a deferred prompt that misses is admitted without its patches (the vision encoder fails the request)",
        "engine/serving/scheduler.py",
        "        if not self._pixels_ready(req):\n            return _Admission.IN_FLIGHT\n",
        "",
        (DEFERRED + "test_a_hit_processes_no_pixels_and_a_miss_processes_them_once",
         DEFERRED + "test_a_failed_deferred_processing_fails_only_its_request"),
    ),
    Mutant(
        "deferred-warm-unprocessed",
        "a warm whose images were deferred computes without their patches",
        "engine/serving/scheduler.py",
        "            if not self._pixels_ready(req):\n                passed.append(req)\n                continue\n",
        "",
        (DEFERRED + "test_a_warm_after_its_pixels_left_the_cache_computes_the_prefix",),
    ),
    Mutant(
        "known-images-unsalted",
        "the index of known images ignores the salt: another session's prompt is built from it (and faster)",
        "engine/inputs/processed_images.py",
        "            item = self._known.get(key)\n",
        "            item = next((v for k, v in self._known.items() if k[1] == key[1]), None)\n",
        (DEFERRED + "test_defer_needs_the_same_session_and_a_known_image",),
    ),
    Mutant(
        "forget-keeps-known-images",
        "forget leaves the salt's index of known images",
        "engine/inputs/processed_images.py",
        "            for key in known:\n                del self._known[key]\n",
        "",
        (DEFERRED + "test_defer_needs_the_same_session_and_a_known_image",),
    ),
    Mutant(
        "early-restore-reclaims",
        "a host hit arriving while a step runs is admitted whatever the free pages (its restore takes pages "
        "the pool does not have, or room is made under the running forward)",
        "engine/serving/scheduler.py",
        "            else:\n                room = self.pool.num_free >= need\n",
        "            else:\n                room = True\n",
        ("tests/test_host_tier.py::test_an_early_restore_takes_free_pages_only_and_leaves_cancellations_to_the_next_step",),
    ),
    Mutant(
        "early-restore-takes-cancels",
        "the watch during a step applies cancellations too: a cancelled request's pages are freed (and may be "
        "restored into) while the step still writes them",
        "engine/serving/loop.py",
        "                if self._inbox:\n                    self._take_inbox()\n",
        "                if self._inbox or self._cancels:\n                    self._intake()\n",
        ("tests/test_host_tier.py::test_an_early_restore_takes_free_pages_only_and_leaves_cancellations_to_the_next_step",),
    ),
    Mutant(
        "no-early-restore",
        "a host hit arriving during a step waits for the next plan to order its copy (the copy is not hidden)",
        "engine/serving/loop.py",
        "                    orders = self.scheduler.restore_early()\n",
        "                    orders = []\n",
        ("tests/test_host_tier.py::test_a_host_hit_arriving_during_a_step_starts_its_restore_before_the_next_plan",),
    ),
    Mutant(
        "watch-outlasts-the-step",
        "the watch during a step lasts as long as the slowest recent step of its kind: short steps wait "
        "for the GPU longer than they run (TPOT up ~10% with a host tier)",
        "engine/serving/loop.py",
        "    return started + WATCH_SHARE * min(recent, default=0.0)\n",
        "    return started + WATCH_SHARE * max(recent, default=0.0)\n",
        ("tests/test_host_tier.py::test_the_watch_during_a_step_ends_before_the_shortest_recent_step_of_its_kind",),
    ),
]
