"""The Triton kernels (gpu/triton_kernels/) against the repo's torch paths, which stay their references.

Without a GPU they run in triton's interpreter (TRITON_INTERPRET=1, set before triton's first import:
tests/gpu/triton_interpreter.py) on CPU tensors; with one, compiled on CUDA. References always run on the
CPU in float32. Shapes are tiny (the interpreter runs each program in numpy) but keep what matters: several
blocks per sequence in scattered order, uneven lengths, GQA with a group (3) that is not a power of two, a
head size (24) that is not one either, contexts long enough for split-K, chunks resuming at a nonzero
position, and several query and key tiles per chunk.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gpu.attention import PagedAttention
from gpu.attention.metadata import AttentionMetadata, PrefillChunk
from gpu.attention.prefill import plan_prefills, prefill_all
from gpu.cuda import attention as cuda_attention
from gpu.cuda.kernels import CudaKernels
from gpu.forward import rms_norm, rotate
from gpu.kv_cache import KVCache, KVShape
from tests.gpu.triton_interpreter import CUDA, DEVICE, import_kernels, interpreting

argmax_k, decode_k, prefill_k, rms_norm_k, rope_k, silu_k = import_kernels(
    "argmax", "decode", "prefill", "rms_norm", "rope_cache", "silu_mul"
)


@pytest.fixture(autouse=True, scope="module")
def interpreter():
    """Set while this module's tests run, whatever a test in between did to it."""
    with interpreting():
        yield


HEADS, KV_HEADS, DIM, BLOCK = 6, 2, 16, 4
REPO = Path(__file__).resolve().parents[2]
# float32 in float32 throughout; float16 inputs against a float32 reference of the same (rounded) values
TOLERANCE = {
    torch.float32: dict(rtol=2e-5, atol=2e-5),
    torch.float16: dict(rtol=3e-3, atol=3e-3),
    torch.bfloat16: dict(rtol=2e-2, atol=2e-2),  # 8 mantissa bits: one unit in the last place is 0.4-0.8%
}
# bfloat16 only compiled on a GPU: the interpreter runs kernels in numpy, which has no bfloat16
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])


def _cache(
    num_blocks: int, dtype: torch.dtype, dim: int = DIM, seed: int = 0, kv_heads: int = KV_HEADS
) -> KVCache:
    """A CPU float32 cache of random values, already rounded to dtype (so both sides see the same)."""
    torch.manual_seed(seed)
    cache = KVCache(KVShape(1, kv_heads, dim, BLOCK, torch.float32), num_blocks, torch.device("cpu"))
    cache.k.copy_(torch.randn(cache.k.shape).to(dtype))
    cache.v.copy_(torch.randn(cache.v.shape).to(dtype))
    return cache


def _on_device(cache: KVCache, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return cache.k[0].to(DEVICE, dtype), cache.v[0].to(DEVICE, dtype)


def _tables(lens: list[int], num_blocks: int, width: int) -> torch.Tensor:
    """Each row its own blocks in scattered order, then stale (valid, never read) ids up to width."""
    order = torch.randperm(num_blocks)
    rows, used = [], 0
    for length in lens:
        need = -(-length // BLOCK)
        stale = torch.randint(0, num_blocks, (width - need,))
        rows.append(torch.cat((order[used : used + need], stale)))
        used += need
    assert used <= num_blocks
    return torch.stack(rows)


# -- paged decode attention --------------------------------------------------------------------------------


def test_split_count_follows_context_length_and_occupancy():
    choose = decode_k.choose_num_splits
    assert choose(200, 1, 8) == 1  # short: one split
    assert choose(4096, 1, 8) == 16  # long, one row: up to MAX_SPLITS
    assert choose(1024, 1, 8) == 4
    assert choose(4096, 64, 8) == 1  # 512 programs already fill the GPU
    assert choose(4096, 8, 8) == 8


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_splits", [None, 1, 4, "longest"])
def test_decode_matches_sdpa_reference(dtype, num_splits):
    # Uneven lengths: 1 key, part of a block, many blocks, and a long row (150 blocks) that makes the
    # automatic choice split; each row divides its own keys over the splits, so the short rows' later
    # splits hold no keys at all. "longest": the split count from the longest row (an eager step's).
    lens = [1, 7, 45, 600]
    width = -(-max(lens) // BLOCK)
    cache = _cache(200, dtype)
    tables = _tables(lens, 200, width)
    q = torch.randn(len(lens), HEADS, DIM).to(dtype).float()
    lens_t = torch.tensor(lens)
    scale = DIM**-0.5
    want = cuda_attention.decode_attention(q, cache, 0, tables, lens_t, scale)
    if num_splits is None:
        assert decode_k.choose_num_splits(width * BLOCK, len(lens), KV_HEADS) == 3
    k, v = _on_device(cache, dtype)
    longest = max(lens) if num_splits == "longest" else None
    got = decode_k.paged_decode_attention(
        q.to(DEVICE, dtype),
        k,
        v,
        tables.to(DEVICE),
        lens_t.to(DEVICE),
        scale,
        num_splits=None if num_splits == "longest" else num_splits,
        max_context=longest,
    )
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.cpu().float(), want, **TOLERANCE[dtype])


def test_decode_reads_persistent_tables_by_seat_and_strided_queries():
    """The engine's own layout: rows pick their table by seat; q is the head slice of a wider qk row."""
    lens = [9, 70, 33]
    cache = _cache(64, torch.float32, seed=1)
    tables = _tables([33, 9, 1, 70], 64, 20)  # seats 0..3; row i uses seat seats[i]
    seats = torch.tensor([1, 3, 0])
    qk = torch.randn(len(lens), HEADS + KV_HEADS, DIM)
    q = qk[:, :HEADS]
    lens_t = torch.tensor(lens)
    want = cuda_attention.decode_attention(q, cache, 0, tables[seats], lens_t, 0.3)
    k, v = _on_device(cache, torch.float32)
    got = decode_k.paged_decode_attention(
        qk.to(DEVICE)[:, :HEADS], k, v, tables.to(DEVICE), lens_t.to(DEVICE), 0.3, seats=seats.to(DEVICE)
    )
    torch.testing.assert_close(got.cpu(), want, **TOLERANCE[torch.float32])


def test_decode_head_size_not_a_power_of_two():
    dim, lens = 24, [5, 130]
    cache = _cache(64, torch.float32, dim=dim, seed=2)
    tables = _tables(lens, 64, -(-130 // BLOCK))
    q, lens_t = torch.randn(2, HEADS, dim), torch.tensor(lens)
    want = cuda_attention.decode_attention(q, cache, 0, tables, lens_t, dim**-0.5)
    k, v = _on_device(cache, torch.float32)
    got = decode_k.paged_decode_attention(
        q.to(DEVICE), k, v, tables.to(DEVICE), lens_t.to(DEVICE), dim**-0.5, num_splits=2
    )
    torch.testing.assert_close(got.cpu(), want, **TOLERANCE[torch.float32])


@pytest.mark.parametrize(
    "kernels",
    [CudaKernels(decode=True), CudaKernels(varlen=True), CudaKernels(decode=True, varlen=True)],
    ids=str,
)
def test_eager_cuda_backend_with_triton_kernels_matches_torch_on_a_mixed_step(kernels):
    """The CUDA backend's eager (mixed-step) path with the Triton decode kernel (decode rows by seat from
    the persistent tables), with one varlen call for the whole step, or with both (the prefill chunks in
    the varlen call, the decode rows, not contiguous here, through the decode kernel), against its SDPA
    path."""
    cache, meta, q, new_k, new_v = _mixed_step(torch.float32, seed=4)
    reference = cuda_attention.CudaPagedAttention()
    want = reference(q, new_k, new_v, cache, 0, reference.plan(meta, cache), DIM**-0.5)
    cache.k, cache.v = cache.k.to(DEVICE), cache.v.to(DEVICE)
    moved = {
        f: getattr(meta, f).to(DEVICE) for f in ("block_tables", "decode_rows", "decode_seats", "decode_lens")
    }
    meta = dataclasses.replace(meta, **moved)
    backend = cuda_attention.CudaPagedAttention(kernels, group=HEADS // KV_HEADS)
    q, new_k, new_v = q.to(DEVICE), new_k.to(DEVICE), new_v.to(DEVICE)
    got = backend(q, new_k, new_v, cache, 0, backend.plan(meta, cache), DIM**-0.5)
    torch.testing.assert_close(got.cpu(), want, **TOLERANCE[torch.float32])


# -- varlen paged attention (prefill and mixed steps) --------------------------------------------------------


def _mixed_step(dtype: torch.dtype, seed: int = 0, kv_heads: int = KV_HEADS):
    """A mixed step in row order: a decode row, a fresh 19-token prefill, a 21-token chunk resuming at
    position 23 (chunked prefill or a prefix-cache hit), another decode row. K/V of every sequence, its
    prefix and its new tokens, are in the cache; new_k/new_v are the step's own rows."""
    specs = [(36, 1), (0, 19), (23, 21), (5, 1)]  # (start position, new tokens) per seat 0..3
    cache = _cache(64, dtype, seed=seed, kv_heads=kv_heads)
    tables = _tables([start + n for start, n in specs], 64, 16)
    slots = []
    for seat, (start, n) in enumerate(specs):
        positions = torch.arange(start, start + n)
        slots.append(tables[seat, positions // BLOCK] * BLOCK + positions % BLOCK)
    slots = torch.cat(slots)
    flat = (kv_heads, -1, DIM)
    new_k = cache.k[0].view(flat)[:, slots].transpose(0, 1)
    new_v = cache.v[0].view(flat)[:, slots].transpose(0, 1)
    rows = [0, 1, 20, 41]  # first row of each chunk
    meta = AttentionMetadata(
        block_tables=tables,
        decode_rows=torch.tensor([rows[0], rows[3]]),
        decode_seats=torch.tensor([0, 3]),
        decode_lens=torch.tensor([37, 6]),
        decode_first=None,
        max_decode_len=37,
        prefills=(PrefillChunk(rows[1], 19, 0, 1), PrefillChunk(rows[2], 21, 23, 2)),
    )
    q = torch.randn(len(slots), HEADS, DIM).to(dtype).float()
    return cache, meta, q, new_k, new_v


def test_varlen_tiles_hold_a_whole_group_and_the_work_list_no_empty_tile():
    assert prefill_k.tiles_for(64).tokens(1) == 64 and prefill_k.tiles_for(128).tokens(8) == 8
    assert prefill_k.tiles_for(128).tokens(3) == 16  # 3 heads padded to 4: 64 rows
    work = prefill_k.VarlenChunks.work_list([1, 19, 1, 21], 8)
    assert work.tolist() == [[0, 1, 1, 1, 2, 3, 3, 3], [0, 0, 1, 2, 0, 0, 1, 2]]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("tokens", "block_n"), [(4, 16), (16, None)], ids=["small-tiles", "default-tiles"])
def test_varlen_mixed_step_matches_paged_attention(dtype, tokens, block_n):
    """Tiles of `tokens` queries times the group's 3 heads (padded to 4): 16 and 64 rows."""
    cache, meta, q, new_k, new_v = _mixed_step(dtype)
    reference = PagedAttention("torch")  # torch decode buckets + SDPA prefill chunks
    want = reference(q, new_k, new_v, cache, 0, reference.plan(meta, cache), DIM**-0.5)
    chunks = prefill_k.VarlenChunks.from_metadata(
        AttentionMetadata(
            meta.block_tables.to(DEVICE),
            *(t.to(DEVICE) for t in (meta.decode_rows, meta.decode_seats, meta.decode_lens)),
            meta.decode_first,
            meta.max_decode_len,
            meta.prefills,
        ),
        tokens,
    )
    assert chunks.q_lens.tolist() == [1, 1, 19, 21]
    assert chunks.num_work == 2 + -(-19 // tokens) + -(-21 // tokens)  # no tile past a chunk's end
    k, v = _on_device(cache, dtype)
    got = prefill_k.varlen_paged_attention(
        q.to(DEVICE, dtype), k, v, meta.block_tables.to(DEVICE), chunks, DIM**-0.5, None, block_n
    )
    torch.testing.assert_close(got.cpu().float(), want, **TOLERANCE[dtype])


@pytest.mark.parametrize(("heads", "kv_heads"), [(2, 2), (4, 2), (10, 2), (8, 1)], ids=str)
def test_varlen_matches_the_reference_for_every_kind_of_group(heads, kv_heads):
    """GQA groups of 1, 2, 5 (padded to 8 rows a token) and 8 query heads per KV head: each program's
    tile holds its group's heads for several tokens, a decode row and chunks resuming mid-sequence."""
    cache, meta, _, new_k, new_v = _mixed_step(torch.float32, seed=9, kv_heads=kv_heads)
    torch.manual_seed(9)
    q = torch.randn(new_k.shape[0], heads, DIM)
    reference = PagedAttention("torch")
    want = reference(q, new_k, new_v, cache, 0, reference.plan(meta, cache), 0.25)
    group = heads // kv_heads
    tokens = max(1, 16 // decode_k.next_pow2(group))
    chunks = prefill_k.VarlenChunks.from_metadata(meta, tokens)
    k, v = _on_device(cache, torch.float32)
    got = prefill_k.varlen_paged_attention(q.to(DEVICE), k, v, meta.block_tables.to(DEVICE), chunks, 0.25)
    torch.testing.assert_close(got.cpu(), want, **TOLERANCE[torch.float32])


def test_varlen_prefill_only_from_cu_seqlens_matches_prefill_reference():
    """Packed chunks back to back (flash-attention's varlen form), GQA, writing into a given out."""
    cache, meta, q, new_k, new_v = _mixed_step(torch.float32, seed=3)
    plans = plan_prefills(meta, BLOCK)
    want = torch.zeros_like(q)
    prefill_all(q, new_k, new_v, cache, 0, plans, 0.2, want)
    first, end = meta.prefills[0].row_start, meta.prefills[1].row_start + meta.prefills[1].num_tokens
    chunks = prefill_k.VarlenChunks.from_cu_seqlens([0, 19, 40], [0, 23], [1, 2], DEVICE, tokens=4)
    out = torch.zeros(end - first, HEADS, DIM, device=DEVICE)
    k, v = _on_device(cache, torch.float32)
    got = prefill_k.varlen_paged_attention(
        q[first:end].to(DEVICE), k, v, meta.block_tables.to(DEVICE), chunks, 0.2, out, 16
    )
    assert got is out
    torch.testing.assert_close(got.cpu(), want[first:end], **TOLERANCE[torch.float32])


@pytest.mark.parametrize(("window", "softcap"), [(1, None), (5, None), (70, None), (None, 0.7), (5, 0.7)])
def test_sliding_window_decode_and_varlen_match_the_torch_paths(window, softcap):
    """A layer's sliding window: in the decode kernel (a window starting mid-block, splits wholly before
    it) and the varlen kernel (tiles whose first key tiles no row of theirs sees), against the torch
    decode and SDPA prefill paths, and the SDPA decode reference against the torch decode path; with
    Gemma 2's soft-capping too."""
    lens = [1, 7, 45, 600]
    cache = _cache(200, torch.float32)
    tables = _tables(lens, 200, -(-max(lens) // BLOCK))
    q, lens_t = torch.randn(len(lens), HEADS, DIM), torch.tensor(lens)
    want = cuda_attention.decode_attention(q, cache, 0, tables, lens_t, 0.3, window, softcap)
    meta = AttentionMetadata(tables, torch.arange(4), torch.arange(4), lens_t, 0, max(lens), ())
    torch_decode = PagedAttention("torch")
    same = torch_decode(
        q, q[:, :KV_HEADS], q[:, :KV_HEADS], cache, 0, torch_decode.plan(meta, cache), 0.3, window, softcap
    )
    torch.testing.assert_close(same, want, **TOLERANCE[torch.float32])
    k, v = _on_device(cache, torch.float32)
    for num_splits in (1, 4):
        got = decode_k.paged_decode_attention(
            q.to(DEVICE),
            k,
            v,
            tables.to(DEVICE),
            lens_t.to(DEVICE),
            0.3,
            None,
            num_splits,
            window=window,
            softcap=softcap,
        )
        torch.testing.assert_close(got.cpu(), want, **TOLERANCE[torch.float32])

    cache, meta, q, new_k, new_v = _mixed_step(torch.float32, seed=5)
    reference = PagedAttention("torch")
    want = reference(q, new_k, new_v, cache, 0, reference.plan(meta, cache), DIM**-0.5, window, softcap)
    chunks = prefill_k.VarlenChunks.from_metadata(meta, tokens=4)
    k, v = _on_device(cache, torch.float32)
    on_device = {f: getattr(meta, f).to(DEVICE) for f in ("block_tables",)}
    got = prefill_k.varlen_paged_attention(
        q.to(DEVICE),
        k,
        v,
        on_device["block_tables"],
        chunks,
        DIM**-0.5,
        None,
        16,
        window=window,
        softcap=softcap,
    )
    torch.testing.assert_close(got.cpu(), want, **TOLERANCE[torch.float32])


# -- fused residual add + RMSNorm, RoPE + cache write, SiLU * up, argmax ----------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_matches_forward(dtype, with_delta):
    torch.manual_seed(0)
    x, delta = torch.randn(5, 48).to(dtype), torch.randn(5, 48).to(dtype)
    weight = (1 + 0.1 * torch.randn(48)).to(dtype)
    residual = x + delta if with_delta else x
    want = rms_norm(residual, weight, 1e-5)
    got, got_residual = rms_norm_k.add_rms_norm(
        x.to(DEVICE), delta.to(DEVICE) if with_delta else None, weight.to(DEVICE), 1e-5
    )
    assert torch.equal(got_residual.cpu(), residual)  # one rounding of an exact sum, as torch's add
    torch.testing.assert_close(got.cpu(), want, **TOLERANCE[dtype])


def _rope_tables(max_positions: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's default RoPE tables: cos/sin of [positions, dim], the frequencies repeated in both halves."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.outer(torch.arange(max_positions).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_cache_write_matches_rotate_and_cache_write(dtype):
    torch.manual_seed(0)
    tokens, rows = 5, HEADS + KV_HEADS
    cos, sin = (t.to(dtype) for t in _rope_tables(64, DIM))
    positions = torch.tensor([0, 17, 3, 63, 40])
    slots = torch.tensor([13, 2, 30, 7, -1])  # flat slots of the 8-block cache; -1: rotate, do not cache
    qkv = torch.randn(tokens, (rows + KV_HEADS) * DIM).to(dtype)  # the fused projection's output
    qk_ref = qkv[:, : rows * DIM].view(tokens, rows, DIM)
    v_ref = qkv[:, rows * DIM :].view(tokens, KV_HEADS, DIM)
    want_cache = KVCache(KVShape(1, KV_HEADS, DIM, BLOCK, dtype), 8, torch.device("cpu"))
    want_qk = rotate(qk_ref, cos[positions][:, None], sin[positions][:, None])
    want_cache.write(0, slots[:-1], want_qk[:-1, HEADS:], v_ref[:-1])

    cache = KVCache(KVShape(1, KV_HEADS, DIM, BLOCK, dtype), 8, DEVICE)
    qkv_dev = qkv.to(DEVICE)
    qk = qkv_dev[:, : rows * DIM].view(tokens, rows, DIM)  # strided rows, as in the forward
    v = qkv_dev[:, rows * DIM :].view(tokens, KV_HEADS, DIM)
    rope_k.TritonRopeCacheWrite()(
        qk, v, positions.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE), cache, 0, slots.to(DEVICE)
    )
    # half precision: torch rounds after each product, the kernel once (one unit in the last place)
    tolerance = {torch.float32: TOLERANCE[torch.float32], torch.float16: dict(rtol=2e-3, atol=2e-3)}.get(
        dtype, TOLERANCE[dtype]
    )
    torch.testing.assert_close(qk.cpu(), want_qk, **tolerance)
    torch.testing.assert_close(cache.k.cpu(), want_cache.k, **tolerance)  # untouched slots still 0
    assert torch.equal(cache.v.cpu(), want_cache.v)
    assert torch.equal(qkv_dev[:, rows * DIM :].cpu(), qkv[:, rows * DIM :])  # v itself is not modified


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_mul_matches_torch(dtype):
    torch.manual_seed(0)
    gate_up = (3 * torch.randn(5, 2 * 40)).to(dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = silu_k.silu_mul(gate_up.to(DEVICE), block=16)  # 3 programs per row, the last one partial
    torch.testing.assert_close(got.cpu().float(), want, **TOLERANCE[dtype])


def test_greedy_argmax_matches_torch_on_ties_infinities_and_nan():
    torch.manual_seed(0)
    vocab = 1000
    logits = torch.randn(7, vocab)
    logits[1, [700, 90, 400]] = 9.0  # tie across tiles: the first (90) wins
    logits[2] = float("-inf")  # nothing finite: index 0
    logits[3, 950] = float("inf")
    logits[4, [600, 20]] = float("nan")  # NaN counts as the maximum; the first NaN
    logits[4, 10] = float("inf")
    logits[5, 999] = 50.0  # the last element, in a partial tile
    logits[6, 0] = 50.0
    want = logits.argmax(dim=-1)
    assert want.tolist()[1:] == [90, 0, 950, 20, 999, 0]
    got = argmax_k.greedy_argmax(logits.to(DEVICE), block=256)
    assert torch.equal(got.cpu(), want)
    half = logits[[0, 1, 5]].half()
    assert torch.equal(argmax_k.greedy_argmax(half.to(DEVICE), block=256).cpu(), half.float().argmax(-1))
    strided = torch.randn(3, 2 * vocab)[:, :vocab]  # a view of wider rows
    assert torch.equal(argmax_k.greedy_argmax(strided.to(DEVICE), block=256).cpu(), strided.argmax(-1))


# -- triton stays out of the CPU path ------------------------------------------------------------------------


def test_only_gpu_triton_kernels_imports_triton():
    offenders = []
    for path in (REPO / "gpu").rglob("*.py"):
        if "triton_kernels" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            offenders += [f"{path.relative_to(REPO)}: {n}" for n in names if n.split(".")[0] == "triton"]
    assert not offenders


def test_importing_the_engine_and_the_cuda_path_does_not_import_triton():
    code = (
        "import sys, gpu.forward, gpu.engine, gpu.cuda.step, gpu.cuda.attention, gpu.triton_kernels\n"
        "assert 'triton' not in sys.modules, 'triton imported'\n"
        "assert not gpu.triton_kernels.available('cpu')\n"
        "assert 'triton' not in sys.modules, 'triton imported'\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
