"""The CUDA path's logic, run on the CPU: SDPA decode attention, the eager mixed-step backend, and the
decode-graph buckets, padding rows and trash block (graphs replaced by eager runs of the same body), and
the order of lazy capture, input copies and replay (a recorder that replays by running the body again).
What needs a GPU (capture, pinned memory, bf16 kernels) is in tests/gpu/test_cuda_device.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu.cuda.attention import CudaPagedAttention, decode_attention
from gpu.cuda.graphs import IDS, LENS, POSITIONS, SLOTS, DecodeGraphs, DecodeOutput, block_buckets, bucket_of
from gpu.cuda.staging import PinnedStaging
from gpu.cuda.step import CudaStep
from gpu.cuda.tables import DeviceBlockTables
from gpu.forward import LlamaForward
from gpu.inputs import TableUpdates
from gpu.kv_cache import KVCache, KVShape
from gpu.lora.manager import LoraManager
from tests.gpu.factories import (
    assert_matches_hf,
    make_engine,
    make_model,
    make_prompts,
    make_requests,
    run_through_failures,
)
from tests.gpu.test_attention import BLOCK, DIM, HEADS, KV_HEADS, dense_reference, run_step
from tests.gpu.test_gold import OUTPUT_LENS, run_and_check


def test_buckets_cover_every_size_with_little_padding():
    assert block_buckets(10) == [1, 2, 4, 8, 10] and block_buckets(1) == [1]
    assert [bucket_of(n, [1, 2, 4, 8, 10]) for n in (1, 3, 5, 9, 10)] == [1, 4, 8, 10, 10]


def test_decode_attention_matches_dense_with_padded_tables():
    torch.manual_seed(0)
    cache = KVCache(
        KVShape(1, KV_HEADS, DIM, BLOCK, torch.float32),
        12,
        torch.device("cpu"),
    )
    cache.k.normal_()
    cache.v.normal_()
    tables = torch.tensor([[3, 7, 11, 0], [5, 0, 0, 0]])  # the second row's tail is padding (masked)
    lens = torch.tensor([14, 3])
    q = torch.randn(2, HEADS, DIM)
    got = decode_attention(q, cache, 0, tables, lens, DIM**-0.5)
    for row in range(2):
        blocks = tables[row, : -(-int(lens[row]) // BLOCK)]
        k = cache.k[0][:, blocks].reshape(KV_HEADS, -1, DIM)[:, : lens[row]].transpose(0, 1)
        v = cache.v[0][:, blocks].reshape(KV_HEADS, -1, DIM)[:, : lens[row]].transpose(0, 1)
        want = dense_reference(q[row : row + 1], k, v, int(lens[row]) - 1)
        torch.testing.assert_close(got[row : row + 1], want, rtol=1e-5, atol=1e-5)


def test_eager_cuda_backend_matches_dense_on_a_mixed_step(monkeypatch):
    import tests.gpu.test_attention as attention_tests

    monkeypatch.setattr(attention_tests, "PagedAttention", lambda kind, native: CudaPagedAttention())
    specs = {"d1": (6, 1, [7, 2]), "p1": (0, 9, [3, 8, 0]), "p2": (5, 6, [10, 5, 6]), "d2": (3, 1, [12])}
    run_step("torch", specs, num_blocks=13)


def cuda_path_engine(model, kernels=None, **config):
    """An engine on the CPU whose runner takes the CUDA step: a trash block, static decode buffers, and the
    given Triton kernels (None: the torch paths), all without graph capture; LoRA adapters in stacked
    device slots as on CUDA (applied with the torch reference: LoraKernels on CPU tensors are off)."""
    engine = make_engine(model, **config)
    runner = engine.runner
    runner.inputs.device_tables = True  # the block table kept on the device, as on CUDA
    cache = KVCache(runner.cache.shape, runner.num_blocks + 1, torch.device("cpu"))
    runner.cache = cache
    runner.forward = LlamaForward(model, engine.runner.config.max_model_len)  # the hooks unset: as on CUDA
    seqs, blocks = engine.config.max_num_seqs, runner.inputs.max_blocks
    slots = None
    if runner.lora is not None:
        c = engine.config
        runner.lora = LoraManager(model, c.max_loras, c.max_lora_rank, c.max_cpu_loras, stacked=True)
        slots = runner.lora.slots
    runner.cuda_step = CudaStep(runner.forward, cache, seqs, blocks, runner.num_blocks, False, kernels, slots)
    return engine


@pytest.mark.parametrize("max_num_seqs", [3, 64])
def test_cuda_step_logic_matches_hf(max_num_seqs):
    """Greedy through the CUDA step's decode buffers (batches padded to buckets, padding rows writing
    the trash block) equals HF; with 3 seats, sequences come and go so bucket sizes change mid-run."""
    model = make_model()
    engine = cuda_path_engine(model, max_num_seqs=max_num_seqs)
    graphs = engine.runner.cuda_step.graphs
    assert graphs is not None and not graphs.capture
    replays = []
    run = graphs.run
    graphs.run = lambda *args, **kw: replays.append(args[-2].shape) or run(*args, **kw)
    prompts = make_prompts(8, 1, 60)
    run_and_check(engine, model, prompts, OUTPUT_LENS)
    assert len(replays) > 10  # most steps were decode-only and went through the static buffers
    trash = graphs.trash_block
    assert engine.scheduler.kv.num_blocks == trash  # the scheduler never hands out the trash block


def test_cuda_step_logic_with_preemption_and_prefix_hits():
    model = make_model()
    engine = cuda_path_engine(model, block_size=4, num_blocks=14, max_num_batched_tokens=16)
    stats = run_and_check(engine, model, make_prompts(5, 10, 20, seed=5), [20, 25, 15, 22, 18])
    assert stats.preemptions > 0
    shared = make_prompts(1, 40, 40, seed=3)[0]
    engine = cuda_path_engine(model, block_size=8)
    run_and_check(engine, model, [shared + t for t in make_prompts(3, 1, 12, seed=4)], [10, 5, 8], prefix="a")
    run_and_check(engine, model, [shared + t for t in make_prompts(3, 1, 12, seed=6)], [6, 9, 4], prefix="b")
    assert engine.stats().prefix_cache_hits > 0


def test_the_device_table_gets_only_the_entries_each_step_changed():
    """The block table on the device is brought up to date by each step's updates, not copied: over a run
    every entry a sequence's table ever held is copied exactly once (the blocks it gained), and after each
    step's updates the device's rows of every live seat equal the host's."""
    model = make_model()
    engine = cuda_path_engine(model, block_size=4)
    step, builder = engine.runner.cuda_step, engine.runner.inputs
    held: dict[str, int] = {}  # the most blocks each sequence's table held
    seat_of = builder.seat_of

    def seat_recorded(chunk):
        held[chunk.seq_id] = max(held.get(chunk.seq_id, 0), len(chunk.block_table))
        return seat_of(chunk)

    builder.seat_of = seat_recorded
    copied, apply = [], step.tables.apply

    def apply_checked(updates, staging):
        copied.append(len(updates.index))
        table = apply(updates, staging)
        for seat in builder._seat.values():
            known = int(builder._known[seat])
            assert table[seat, :known].tolist() == builder.block_tables[seat, :known].tolist()
        return table

    step.tables.apply = apply_checked
    stats = run_and_check(engine, model, make_prompts(8, 1, 60), OUTPUT_LENS)
    assert stats.preemptions == 0 and len(held) == 8
    assert sum(copied) == sum(held.values())  # none twice, none missed
    assert copied.count(0) > 0  # decode steps where no sequence entered a new block copied nothing


def test_sdpa_graph_rows_read_the_trash_block_past_their_blocks():
    """The SDPA fallback's graphs read every entry of their block bucket, masked past each row's length: past
    the step's blocks those entries are the trash block, not a block some other sequence holds (whose
    values a masked read would still carry into the output were they NaN: 0 * NaN)."""
    model = make_model()
    engine = cuda_path_engine(model, max_num_seqs=5, block_size=4)
    graphs = engine.runner.cuda_step.graphs
    assert not graphs.paged
    checked, run = [], graphs.run

    def run_checked(staging, ids, positions, slots, lens, tables, seats, blocks, *args, **kwargs):
        out = run(staging, ids, positions, slots, lens, tables, seats, blocks, *args, **kwargs)
        b, nb = graphs.key(len(ids), blocks)
        assert (graphs.tables[:b, blocks:nb] == graphs.trash_block).all()
        checked.append(nb - blocks)
        return out

    graphs.run = run_checked
    run_and_check(engine, model, make_prompts(8, 1, 60), OUTPUT_LENS)
    assert sum(checked) > 0


def test_the_device_table_grows_with_the_hosts_and_keeps_an_all_trash_padding_row():
    staging = PinnedStaging(torch.device("cpu"))
    tables = DeviceBlockTables(2, 4, trash_block=9, device=torch.device("cpu"))
    assert tables.padding_seat == 2 and (tables.table == 9).all()
    staging.begin_step()
    # seat 0's block 1, seat 1's block 0; then the host's table has grown to 4 seats
    tables.apply(TableUpdates(2, 4, np.array([1, 4]), np.array([3, 5])), staging)
    grown = tables.apply(TableUpdates(4, 4, np.array([3 * 4]), np.array([7])), staging)
    assert grown.shape == (5, 4) and tables.padding_seat == 4
    assert grown[:2].tolist() == [[9, 3, 9, 9], [5, 9, 9, 9]] and grown[3].tolist() == [7, 9, 9, 9]
    assert (grown[2] == 9).all() and (grown[4] == 9).all()  # the old padding row is a seat like the others
    with pytest.raises(ValueError, match="device_tables"):
        tables.apply(None, staging)
    with pytest.raises(ValueError, match="8 blocks"):
        tables.apply(TableUpdates(4, 8, np.array([9]), np.array([1])), staging)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(("stage", "fail_at"), [("launch", 1), ("launch", 4), ("prepare", 3)])
def test_a_step_failing_before_its_table_updates_arrive_leaves_no_stale_row(
    stage, fail_at, async_scheduling, monkeypatch
):
    """A step built (its sequences' new blocks logged as written) that fails before the CUDA step copies
    them, in the CUDA step itself or in the rest of its preparation (its sampling settings): its sequences,
    retried, must write their rows again, or they read blocks the device never got (the first step: every
    block of every prompt). Greedy output still equals HF's."""
    import gpu.runner

    model = make_model()
    engine = cuda_path_engine(model, block_size=4, async_scheduling=async_scheduling)
    step, sampling = engine.runner.cuda_step, gpu.runner.SamplingBatch
    owner, name = (step, "run") if stage == "launch" else (sampling, "for_step")
    calls, call = 0, getattr(owner, name)

    def fail_once(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == fail_at:
            raise RuntimeError("injected")
        return call(*args, **kwargs)

    monkeypatch.setattr(owner, name, fail_once)
    prompts = make_prompts(6, 3, 30, seed=11)
    requests = make_requests(prompts, OUTPUT_LENS[:6])
    tokens, failures = run_through_failures(engine, requests)
    engine.close()
    assert len(failures) == 1  # a StepFailed, or (async, before the launch) the step's own error
    for request, prompt in zip(requests, prompts, strict=True):
        assert_matches_hf(model, prompt, tokens[request.request_id], request.sampling.max_tokens)


def test_a_graph_body_run_before_any_step_touches_only_the_trash_block():
    """What the warm-ups and captures at engine start run: every row a padding row."""
    engine = cuda_path_engine(make_model(), max_num_seqs=8)
    graphs, cache = engine.runner.cuda_step.graphs, engine.runner.cache
    graphs._pad(8)  # what _capture does before its warm-ups
    graphs.vectors(8)[0].fill_(7)  # ids: token 0 (the padding token) embeds to zeros here: K/V would not show
    out = graphs._body(8, graphs.blocks[-1])
    trash = graphs.trash_block
    assert torch.isfinite(out.logits).all() and out.greedy.shape == (8,)
    assert not cache.k[:, :, :trash].any() and not cache.v[:, :, :trash].any()
    assert cache.k[:, :, trash].any()


class RerunRecorder:
    """Capture and replay as a CUDA graph does them, on the CPU: warm-ups run the body on whatever the
    static inputs hold; each replay runs it again on the inputs as they are then, into the captured
    outputs. `seen` logs the static inputs each replay read."""

    def __init__(self, graphs_of: list[DecodeGraphs]) -> None:
        self.graphs_of, self.captures = graphs_of, 0
        self.seen: list[torch.Tensor] = []

    def capture(self, body, warm_ups):
        self.captures += 1
        for _ in range(warm_ups):
            body()
        out = body()

        def replay() -> None:
            fresh: DecodeOutput = body()
            rows = fresh.logits.shape[0]
            self.seen.append(self.graphs_of[0].vectors(rows).clone())
            out.logits.copy_(fresh.logits)
            out.greedy.copy_(fresh.greedy)

        return replay, out


def test_a_lazily_captured_graph_replays_the_step_that_needed_it():
    """The SDPA fallback's graphs are captured when a (batch, block) bucket first appears: the capture pads
    every row of the static inputs, so the step that triggers it must copy its inputs in after the capture.
    Copied before, that step decodes token 0 at position 0 in every row (into the trash block) and its
    sequences' cache slots stay stale: greedy output differs from HF's."""
    model = make_model()
    engine = cuda_path_engine(model, max_num_seqs=5, block_size=4)
    step, cache = engine.runner.cuda_step, engine.runner.cache
    holder: list[DecodeGraphs] = []
    recorder = RerunRecorder(holder)
    graphs = DecodeGraphs(
        step.forward, cache, 5, engine.runner.inputs.max_blocks, engine.runner.num_blocks, step.kernels,
        recorder=recorder,
    )  # fmt: skip
    holder.append(graphs)
    step.graphs = graphs
    assert not graphs.paged and graphs.capture  # the SDPA fallback: keyed by (batch, blocks), captured lazily
    assert graphs.capture_all() >= 0 and not graphs._graphs  # nothing captured up front on this path
    staged: list[tuple[int, ...]] = []
    run = graphs.run

    def recording(staging, ids, positions, slots, lens, *args, **kwargs):
        staged.append((ids.tolist(), positions.tolist(), slots.tolist(), lens.tolist()))
        return run(staging, ids, positions, slots, lens, *args, **kwargs)

    graphs.run = recording
    run_and_check(engine, model, make_prompts(8, 1, 60), OUTPUT_LENS)
    assert recorder.captures == len(graphs._graphs) > 3  # several batch and block buckets, each once
    assert len(recorder.seen) == len(staged) > 10
    for vectors, (ids, positions, slots, lens) in zip(recorder.seen, staged, strict=True):
        rows = len(ids)  # every replay read the step's own inputs, the capturing step's included
        assert vectors[IDS, :rows].tolist() == ids and vectors[POSITIONS, :rows].tolist() == positions
        assert vectors[SLOTS, :rows].tolist() == slots and vectors[LENS, :rows].tolist() == lens
