"""The reference KernelOps against straightforward formulas, on random inputs."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import build_forward_batch

from deepinfer_core.platform.conformance import kernel_op_names
from deepinfer_core.platform.kernel_ops import KernelOps, MlpWeights
from deepinfer_core.platform.op_cases import OP_CASES
from deepinfer_core.quantization import dequantize_fp4, dequantize_fp8_block, quantize_fp4, quantize_fp8_block

OPS = KernelOps()
MODEL_OPS = [
    "rms_norm", "latent_norms", "linear", "grouped_linear", "logits", "embedding", "hc_embedding", "rope", "hc_pre",
    "hc_pre_norm", "hc_update_mix", "hc_collapse_norm", "hc_post", "hc_head", "compress_kv", "indexer_topk",
    "top_entries", "sparse_attention", "store_window", "route", "fused_moe",
]


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g)


def test_every_model_op_has_a_conformance_case() -> None:
    covered = {case.op for case in OP_CASES}
    assert set(MODEL_OPS) <= set(kernel_op_names())
    assert set(MODEL_OPS) <= covered


def test_paged_rows_find_each_entry_in_its_block() -> None:
    """Entry e of sequence s lies at offset e % 4 of block tables[s, e // 4]: its vector of a [blocks, 4] pool."""
    tables = torch.tensor([[5, 2, -1], [0, 7, 3]], dtype=torch.int32)
    ids = torch.tensor([[0, 5, 7, -1], [11, 4, 1, 8]])
    assert OPS.paged_rows(tables, ids, 4).tolist() == [[20, 9, 11, 20], [15, 28, 1, 12]]
    assert OPS.paged_rows(tables, torch.tensor([[9]]).expand(2, 1), 4).tolist() == [[1], [13]]  # block -1: 0


def test_selection_tables_send_picks_to_their_rows() -> None:
    """Sequence 1's picks 4 and 0 are rows 2 and 3 of the picked entries; the rest, and -1's column, row 4."""
    tables = OPS.selection_tables(torch.tensor([[2, -1], [4, 0]]), 5)
    assert tables.dtype == torch.int32 and tables.tolist() == [[4, 4, 0, 4, 4, 4], [3, 4, 4, 4, 2, 4]]


def test_rope_is_a_complex_rotation_of_the_trailing_pairs() -> None:
    g = gen()
    x, positions = randn(g, 5, 3, 20), torch.tensor([0, 3, 17, 250, 9999])
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8)
    got = OPS.rope(x, positions, inv_freq)
    pairs = torch.view_as_complex(x[..., -8:].reshape(5, 3, 4, 2).contiguous())
    turn = torch.polar(torch.ones(5, 4), positions[:, None].float() * inv_freq)[:, None, :]
    want = torch.cat([x[..., :-8], torch.view_as_real(pairs * turn).flatten(-2)], dim=-1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(OPS.rope(got, positions, inv_freq, inverse=True), x, rtol=1e-5, atol=1e-5)


def test_hc_pre_post_follow_the_mhc_formulas() -> None:
    g, n, d, eps = gen(1), 3, 16, 1e-6
    streams, fn = randn(g, 2, n, d), randn(g, (2 + n) * n, n * d) * 0.2
    base, scale = randn(g, (2 + n) * n), torch.rand(3, generator=g) + 0.5
    collapsed, post, comb = OPS.hc_pre(streams, fn, base, scale, eps, eps, 20)
    for t in range(2):
        x = streams[t].flatten()
        mix = fn @ (x / math.sqrt(float((x * x).mean()) + eps))
        pre = torch.sigmoid(mix[:n] * scale[0] + base[:n]) + eps
        torch.testing.assert_close(post[t], 2 * torch.sigmoid(mix[n:2 * n] * scale[1] + base[n:2 * n]))
        m = torch.softmax((mix[2 * n:] * scale[2] + base[2 * n:]).view(n, n), dim=-1) + eps
        m = m / (m.sum(0) + eps)
        for _ in range(19):
            m = m / (m.sum(1, keepdim=True) + eps)
            m = m / (m.sum(0) + eps)
        torch.testing.assert_close(comb[t], m)
        torch.testing.assert_close(collapsed[t], sum(pre[i] * streams[t, i] for i in range(n)))
    # Sinkhorn ends on a column step: columns sum to one, rows nearly so.
    torch.testing.assert_close(comb.sum(-2), torch.ones(2, n), rtol=0, atol=1e-5)
    torch.testing.assert_close(comb.sum(-1), torch.ones(2, n), rtol=0, atol=1e-2)
    y = randn(g, 2, d)
    got = OPS.hc_post(y, streams, post, comb)
    want = torch.stack([
        torch.stack([post[t, j] * y[t] + sum(comb[t, i, j] * streams[t, i] for i in range(n)) for j in range(n)])
        for t in range(2)
    ])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def pooled_entry(kv, gate, ape, w, ratio, overlap, width):
    """Entry w by the definition of MODEL_SPEC §4.2, one channel vector at a time."""
    slots_kv, slots_gate = [], []
    if overlap and w > 0:
        for s in range((w - 1) * ratio, w * ratio):
            slots_kv.append(kv[s, :width])
            slots_gate.append(gate[s, :width] + ape[s % ratio, :width])
    for s in range(w * ratio, (w + 1) * ratio):
        part = slice(width, None) if overlap else slice(None)
        slots_kv.append(kv[s, part])
        slots_gate.append(gate[s, part] + ape[s % ratio, part])
    weights = torch.softmax(torch.stack(slots_gate), dim=0)
    return (weights * torch.stack(slots_kv)).sum(0)


@pytest.mark.parametrize("ratio, overlap", [(4, True), (8, False)])
def test_compress_kv_by_definition_and_across_chunks(ratio: int, overlap: bool) -> None:
    g, width, length, block_size = gen(2), 8, 37, 16
    proj = 2 * width if overlap else width
    kv, gate, ape = randn(g, length, proj), randn(g, length, proj), randn(g, ratio, proj)
    norm_weight, inv_freq = torch.rand(width, generator=g) + 0.5, torch.tensor([1.0, 0.01])
    span = 2 * ratio if overlap else ratio

    def run(chunks):
        state_kv, state_gate = randn(g, 2, span, proj), randn(g, 2, span, proj)
        entries = randn(g, 6, block_size // ratio, width)
        done = 0
        for size in chunks:
            batch = build_forward_batch([(torch.zeros(size, dtype=torch.long), done, 1, [4, 0, 2])])
            OPS.compress_kv(kv[done:done + size], gate[done:done + size], ape, norm_weight, 1e-6, inv_freq, ratio,
                            overlap, state_kv, state_gate, entries, batch)
            done += size
        per_block = block_size // ratio
        table = [4, 0, 2]
        return torch.stack([entries[table[w // per_block], w % per_block] for w in range(length // ratio)])

    whole = run([length])
    for w in range(length // ratio):
        pooled = pooled_entry(kv, gate, ape, w, ratio, overlap, width)
        normed = OPS.rms_norm(pooled, norm_weight, 1e-6)
        want = OPS.rope(normed[None], torch.tensor([w * ratio]), inv_freq)[0]
        torch.testing.assert_close(whole[w], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(run([5, 1, 1, 9, 3, 18]), whole, rtol=1e-6, atol=1e-6)


def test_indexer_topk_brute_force_and_ties_to_lowest_index() -> None:
    g, ratio, heads, dim = gen(3), 4, 8, 16
    table = [1, 0, 2]
    batch = build_forward_batch([(torch.zeros(22, dtype=torch.long), 0, 0, table)])
    q, weights, keys = randn(g, 22, heads, dim), randn(g, 22, heads), randn(g, 3, 2, dim)
    got = OPS.indexer_topk(q, weights, keys, ratio, 3, batch)
    flat_keys = torch.stack([keys[table[w // 2], w % 2] for w in range(5)])
    for t in range(22):
        visible = (t + 1) // ratio
        scores = [float(sum(weights[t, h] / math.sqrt(heads) * torch.relu(q[t, h] @ flat_keys[w]) / math.sqrt(dim)
                            for h in range(heads))) for w in range(visible)]
        want = sorted(range(visible), key=lambda w: -scores[w])[:3]
        assert got[t].tolist() == want + [-1] * (3 - len(want))
    # All-equal scores (every ReLU zero): the lowest entry indices win.
    tied = OPS.indexer_topk(-q.abs(), weights.abs(), keys.abs(), ratio, 3, batch)
    assert tied[21].tolist() == [0, 1, 2]


def test_sparse_attention_equals_dense_softmax_over_allowed_keys() -> None:
    g, heads, dim, window, ratio = gen(4), 2, 8, 5, 4
    context, length = 9, 6
    kv_all, q = randn(g, context + length, dim), randn(g, length, heads, dim)
    ring = randn(g, 1, window, dim)
    for p in range(context - window, context):
        ring[0, p % window] = kv_all[p]
    entries = randn(g, 3, 2, dim)
    table = [2, 0]
    selected = torch.tensor([[1, -1], [0, 2], [2, 0], [3, 1], [1, -1], [0, 3]])
    sinks = randn(g, heads)
    batch = build_forward_batch([(torch.zeros(length, dtype=torch.long), context, 0, table)])
    got = OPS.sparse_attention(q, kv_all[context:], ring, sinks, 0.3, batch, entries=entries, ratio=ratio,
                               selected=selected)
    for j in range(length):
        t = context + j
        keys = [kv_all[s] for s in range(max(0, t - window + 1), t + 1)]
        keys += [entries[table[w // 2], w % 2] for w in selected[j].tolist() if 0 <= w < (t + 1) // ratio]
        keys = torch.stack(keys)
        for h in range(heads):
            logits = torch.cat([keys @ q[j, h] * 0.3, sinks[h:h + 1]])
            probs = torch.softmax(logits, dim=0)[:-1]
            torch.testing.assert_close(got[j, h], probs @ keys, rtol=1e-5, atol=1e-5)


def test_store_window_keeps_the_last_positions() -> None:
    g = gen(5)
    ring, kv = randn(g, 2, 4, 3), randn(g, 7, 3)
    steps = [(torch.zeros(6, dtype=torch.long), 3, 1, [0]), (torch.zeros(1, dtype=torch.long), 10, 0, [1])]
    batch = build_forward_batch(steps)
    before = ring.clone()
    OPS.store_window(kv, ring, batch)
    for p in range(5, 9):
        torch.testing.assert_close(ring[1, p % 4], kv[p - 3])
    torch.testing.assert_close(ring[0, 10 % 4], kv[6])
    keep = [i for i in range(4) if i != 10 % 4]
    torch.testing.assert_close(ring[0, keep], before[0, keep])


def test_route_score_and_hash() -> None:
    g, experts, k = gen(6), 8, 3
    x, w, bias = randn(g, 5, 16), randn(g, experts, 16), randn(g, experts)
    weights, ids = OPS.route(x, w, k, 2.5, bias=bias)
    scores = torch.nn.functional.softplus(x @ w.T).sqrt()
    for t in range(5):
        want = sorted(range(experts), key=lambda e: -(scores[t, e] + bias[e]).item())[:k]
        assert sorted(ids[t].tolist()) == sorted(want)
        picked = scores[t, ids[t]]
        torch.testing.assert_close(weights[t], picked / picked.sum() * 2.5)
    table = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(11)])
    tokens = torch.tensor([3, 10, 0, 3, 7])
    weights, ids = OPS.route(x, w, k, 1.5, tid2eid=table, input_ids=tokens)
    assert torch.equal(ids, table[tokens])
    torch.testing.assert_close(weights.sum(-1), torch.full((5,), 1.5))


def swiglu(x, w1, w3, w2, limit):
    return w2 @ (torch.nn.functional.silu((w1 @ x).clamp(max=limit)) * (w3 @ x).clamp(-limit, limit))


@pytest.mark.parametrize("fmt", ["dense", "fp8", "fp4"])
def test_fused_moe_is_the_weighted_sum_of_clamped_swiglu_experts(fmt: str) -> None:
    g, experts, hidden, inter, limit = gen(7), 4, 64, 32, 1.0
    dense = [[randn(g, inter, hidden) * 0.3, randn(g, inter, hidden) * 0.3, randn(g, hidden, inter) * 0.3]
             for _ in range(experts + 1)]
    if fmt == "fp8":
        quantised = [[quantize_fp8_block(m, (16, 32)) for m in mats] for mats in dense]
        dense = [[dequantize_fp8_block(w, s, (16, 32), torch.float32) for w, s in mats] for mats in quantised]
        mlps = [MlpWeights(m[0][0], m[1][0], m[2][0], m[0][1], m[1][1], m[2][1], (16, 32)) for m in quantised]
    elif fmt == "fp4":
        quantised = [[quantize_fp4(m) for m in mats] for mats in dense]
        dense = [[dequantize_fp4(w, s, torch.float32) for w, s in mats] for mats in quantised]
        mlps = [MlpWeights(m[0][0], m[1][0], m[2][0], m[0][1], m[1][1], m[2][1]) for m in quantised]
    else:
        mlps = [MlpWeights(*mats) for mats in dense]
    x = randn(g, 6, hidden) * 3
    ids = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(6)])
    weights = torch.rand(6, 2, generator=g)
    got = OPS.fused_moe(x, weights, ids, mlps[:experts], mlps[experts], limit)
    for t in range(6):
        want = swiglu(x[t], *dense[experts], limit)
        want = want + sum(weights[t, k] * swiglu(x[t], *dense[ids[t, k]], limit) for k in range(2))
        torch.testing.assert_close(got[t], want, rtol=1e-4, atol=1e-4)


def test_linear_dequantises_and_grouped_linear_is_block_diagonal() -> None:
    g = gen(8)
    x, w = randn(g, 3, 64), randn(g, 40, 64)
    weight, scale = quantize_fp8_block(w, (16, 32))
    want = x @ dequantize_fp8_block(weight, scale, (16, 32), torch.float32).T
    torch.testing.assert_close(OPS.linear(x, weight, scale, (16, 32)), want, rtol=1e-5, atol=1e-5)
    packed, scale = quantize_fp4(w)
    torch.testing.assert_close(OPS.linear(x, packed, scale), x @ dequantize_fp4(packed, scale, torch.float32).T,
                               rtol=1e-5, atol=1e-5)
    xg, wg = randn(g, 3, 2, 10), randn(g, 2 * 6, 10)
    got = OPS.grouped_linear(xg, wg)
    torch.testing.assert_close(got[:, 1], xg[:, 1] @ wg[6:].T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[:, 0], xg[:, 0] @ wg[:6].T, rtol=1e-5, atol=1e-5)


def test_ngram_hash_pads_from_the_first_dead_shift_and_hashes_each_row_by_definition() -> None:
    """The release's layout (2 layers, 4-grams, 8 heads, 16M-bucket primes); rows DEAD at the first shift,
    in the middle with live tokens after it (padded too: the n-gram reaches past the start), nowhere, everywhere."""
    from deepinfer_core.models.deepseek_v41.engram_layout import engram_multipliers, engram_offsets, engram_primes

    n, heads, pad, compressed_vocab = 4, 8, 2, 99092
    primes = engram_primes((1, 3), n, heads, 16000000)
    multipliers = engram_multipliers((1, 3), n, compressed_vocab).tolist()
    offsets = engram_offsets(primes)
    tokens = torch.randint(0, compressed_vocab, (6, n), generator=gen(9))
    tokens[0, 0] = tokens[1, 2] = tokens[3, 1] = -1
    tokens[4] = -1
    got = OPS.ngram_hash(tokens, pad, torch.tensor(multipliers), torch.tensor(primes), torch.tensor(offsets))
    want = []
    for row in tokens.tolist():
        dead_from = row.index(-1) if -1 in row else n
        padded = row[:dead_from] + [pad] * (n - dead_from)
        per_layer = []
        for layer_multipliers, layer_primes, layer_offsets in zip(multipliers, primes, offsets):
            rolling, ids = padded[0] * layer_multipliers[0], []
            for shift in range(1, n):
                rolling ^= padded[shift] * layer_multipliers[shift]
                ids += [rolling % prime for prime in layer_primes[shift - 1]]
            per_layer.append([i + offset for i, offset in zip(ids, layer_offsets)])
        want.append(per_layer)
    assert got.dtype == torch.int64
    assert torch.equal(got, torch.tensor(want))
