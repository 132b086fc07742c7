"""The compute contract: every op the models call, with its plain-torch reference.

`KernelOps` *is* the reference implementation. It is correct on any device torch supports and
is the ground truth of the conformance suite (`deepinfer check-backend`). A backend subclasses it
and overrides the ops it accelerates; whatever it does not override keeps working.

Conventions for every op:
- Tensors arrive on the backend's device; outputs are new tensors unless the docstring says
  an argument is mutated.
- "T" is the number of tokens in the flat (unpadded) step batch, "D" the hidden size.
- Each op's docstring states the tolerance a backend must meet against this reference; the
  matching input generator and tolerance live in `op_cases.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cache, partial

import torch

from deepinfer_core.models.forward_batch import ForwardBatch
from deepinfer_core.platform.row_tiles import in_row_tiles, row_tiled

__all__ = ["KernelOps", "MlpWeights", "QuantizedActivations", "padded_ngrams", "pool_gated_windows"]


@dataclass(frozen=True, slots=True)
class MlpWeights:
    """One SwiGLU MLP's weights (an expert or the shared expert), each dense, fp8 or fp4 as in `linear`."""

    w1: torch.Tensor
    w3: torch.Tensor
    w2: torch.Tensor
    w1_scale: torch.Tensor | None = None
    w3_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    block: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class QuantizedActivations:
    """Activations as fp8 codes [..., K] and float32 scales [..., K / group]: `quantization.quantize_fp8_activations`
    of values in `dtype`. What a producer quantising its own output hands a projection that takes the codes as they
    are (`KernelOps.quantized_input_group`), in place of the values."""

    codes: torch.Tensor
    scales: torch.Tensor
    group: int
    dtype: torch.dtype

    @classmethod
    def of_rows(cls, values: torch.Tensor, group: int) -> QuantizedActivations:
        """values [T, ...] quantised as each token's row of values (`quantization.quantize_fp8_activations`): codes
        [T, K], scales [T, K / group]. The reference for what a producer quantising its own output hands over."""
        from deepinfer_core.quantization import quantize_fp8_activations

        rows = values.reshape(values.shape[0], -1)
        return cls(*quantize_fp8_activations(rows, group), group, values.dtype)

    def view(self, *shape: int) -> QuantizedActivations:
        """Both tensors viewed as `shape` (the scales' last dim a group's share of it): whole groups a row."""
        codes = self.codes.view(*shape)
        if codes.shape[-1] % self.group:
            raise ValueError(f"rows of {codes.shape[-1]} columns split the {self.group}-column groups")
        return QuantizedActivations(codes, self.scales.view(*codes.shape[:-1], -1), self.group, self.dtype)

    def dequantize(self) -> torch.Tensor:
        """The values, in `dtype` (exact)."""
        from deepinfer_core.quantization import dequantize_fp8_activations

        return dequantize_fp8_activations(self.codes, self.scales, self.group, self.dtype)


class KernelOps:
    """Reference ops in plain torch. Subclass and override to accelerate.

    `batch_invariant`: the engine sets it on the ops object it builds the model with
    (`LLM(batch_invariant=True)`). Every op then computes each row exactly as it would alone: per-row
    ops run on tiles of `row_tile` rows (`row_tiles.py`), attention and the indexer walk each query's
    keys in position order. Results stay within each op's tolerance of the default mode. A backend
    claiming the `batch_invariant` capability honours the flag in its overrides as well.

    `capturable_decode`: a decode step's ops size their work from the device tensors and
    `ForwardBatch.max_seq_len` only, never from the per-sequence host lists, and copy nothing from the
    host (a constant table is made once per device, before any capture), so the engine may capture the
    step in a device graph (engine/decode_graphs.py). The reference ops plan on the host: False.

    `fp8_activations`: the engine sets it too (`LLM(fp8_activations=True)`). Projections with fp8
    weights then quantise their input the way fp8 MMA kernels must (W8A8, as DeepSeek's inference
    runs): per row and per weight block of K columns, `quantization.fake_quantize_fp8_activations`.
    Off by default, so that fp8 checkpoints compute what the bf16 reference (transformers' dequantised
    path) computes. A backend honours it in every op that meets fp8 weights.
    """

    batch_invariant: bool = False
    row_tile: int = 16
    capturable_decode: bool = False
    fp8_activations: bool = False

    @row_tiled("x")
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        """RMSNorm over the last dim.

        x: [..., D] any float dtype, possibly a view with strided rows (the models pass column slices of one
        projection's output; `LinearGroup`); weight: [D] (float32 in the models) or None (unweighted).
        Computes in float32: x * rsqrt(mean(x^2) + eps) * weight, cast back to x.dtype.
        Tolerance: float32 1e-5 relative, bfloat16 one bf16 ulp (rtol 1e-2).
        """
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        if weight is not None:
            y = y * weight.float()
        return y.to(x.dtype)

    def linear(
        self,
        x: torch.Tensor | QuantizedActivations,
        weight: torch.Tensor,
        scale: torch.Tensor | None = None,
        block: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """y = x @ W.T, W dense or quantised.

        x: [..., K] float32/bfloat16, or its fp8 codes as in `grouped_linear`. weight: dense [N, K] in x.dtype; or
        float8_e4m3fn [N, K] with `scale` float8_e8m0fnu [ceil(N/bn), ceil(K/bk)] and `block` = (bn, bk); or int8
        [N, K/2] (packed fp4 e2m1, low nibble = even column) with `scale` float8_e8m0fnu [N, K/32].
        The reference dequantises to x.dtype per call; with `fp8_activations`, x meeting an fp8 weight
        is rounded to fp8 first (groups of bk columns). Returns [..., N] in x.dtype.
        Tolerance: float32 1e-5 relative, bfloat16 1e-2 relative (accumulation order).
        """
        return self._product(x.dequantize() if isinstance(x, QuantizedActivations) else x, weight, scale, block)

    @row_tiled("x")
    def _product(
        self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, block: tuple[int, int] | None
    ) -> torch.Tensor:
        w = self.dequantize_weight(weight, scale, block, x.dtype)
        return torch.nn.functional.linear(self.fake_quantize_activations(x, weight, block), w)

    def grouped_linear(
        self,
        x: torch.Tensor | QuantizedActivations,
        weight: torch.Tensor,
        scale: torch.Tensor | None = None,
        block: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """Block-diagonal projection: group g of x meets rows g*R:(g+1)*R of W.

        x: [T, G, K], or its fp8 codes (`QuantizedActivations`, when `quantized_input_group` names their group);
        weight [G*R, K] (dense or quantised as in `linear`). Returns [T, G, R] in x.dtype
        with out[t, g] = W[g*R:(g+1)*R] @ x[t, g]. Codes give the product of their values, which the rounding
        of `fake_quantize_activations` leaves as they are. Tolerance as `linear`.
        """
        return self._grouped_product(x.dequantize() if isinstance(x, QuantizedActivations) else x, weight, scale,
                                     block)

    def grouped_linear_quantized(
        self,
        x: torch.Tensor | QuantizedActivations,
        weight: torch.Tensor,
        scale: torch.Tensor | None,
        block: tuple[int, int] | None,
        group: int,
    ) -> QuantizedActivations:
        """`grouped_linear`'s output [T, G, R] as fp8 codes of each token's row of G * R values in groups of `group`
        columns (`quantization.quantize_fp8_activations`: codes [T, G * R], scales [T, G * R / group]), for a
        projection that takes them (`quantized_input_group`): one op so that a backend can quantise in the
        product's epilogue, the output then stored once, in fp8. Composed here. Exact against quantising
        `grouped_linear`'s output (the codes of a backend's output, whose values are within its tolerance)."""
        if weight.shape[0] % group:
            raise ValueError(f"a grouped output of {weight.shape[0]} columns a token splits {group}-column groups")
        return QuantizedActivations.of_rows(self.grouped_linear(x, weight, scale, block), group)

    def quantized_input_group(self, weight: torch.Tensor, block: tuple[int, int] | None) -> int | None:
        """The group of x's columns in which `linear` and `grouped_linear` take x as fp8 codes for `weight`
        (`QuantizedActivations`, from a producer that quantises its own output: `rotary_attention_quantized`,
        `grouped_linear_quantized`), or None where they take x's values. None here: the reference rounds x in the
        product's own op. A backend whose product reads the codes as they are returns the weight's K block, only
        under `fp8_activations` with an fp8 weight (the product would round x to those codes itself)."""
        return None

    @row_tiled("x")
    def _grouped_product(
        self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, block: tuple[int, int] | None
    ) -> torch.Tensor:
        groups = x.shape[1]
        w = self.dequantize_weight(weight, scale, block, x.dtype).view(groups, -1, x.shape[-1])
        x = self.fake_quantize_activations(x, weight, block)
        # The product written straight into [T, G, R] rows: a transposed [G, T, R] result would be copied by
        # every caller that flattens the groups (at 8,192 tokens of V4's wo_a, 0.18 ms a layer on an H100).
        out = x.new_empty(x.shape[0], groups, w.shape[1])
        torch.bmm(x.transpose(0, 1), w.transpose(1, 2), out=out.transpose(0, 1))
        return out

    def dequantize_weight(
        self, weight: torch.Tensor, scale: torch.Tensor | None, block: tuple[int, int] | None, dtype: torch.dtype
    ) -> torch.Tensor:
        """A projection's weight, stored as `linear` takes it, as `dtype` [N, K]: what `linear` and
        `grouped_linear` multiply by. Exact (an fp8 or fp4 code times a power of two is representable in
        float32 and bfloat16 alike); a backend's version must give the same bits."""
        if weight.dtype == torch.float8_e4m3fn:
            from deepinfer_core.quantization import dequantize_fp8_block

            return dequantize_fp8_block(weight, scale, block, dtype)
        if weight.dtype == torch.int8:
            from deepinfer_core.quantization import dequantize_fp4

            return dequantize_fp4(weight, scale, dtype)
        return weight.to(dtype)

    def fake_quantize_activations(
        self, x: torch.Tensor, weight: torch.Tensor, block: tuple[int, int] | None
    ) -> torch.Tensor:
        """x [..., K] as a projection by `weight` meets it (what `linear` and `grouped_linear` multiply): under
        `fp8_activations`, x meeting an fp8 weight of K blocks of `block[1]` columns is rounded to fp8,
        `quantization.fake_quantize_fp8_activations`, in x.dtype; otherwise x itself.
        Exact (e4m3 values times powers of two fit bfloat16 and float32); a backend's version must give the
        same bits."""
        if not (self.fp8_activations and weight.dtype == torch.float8_e4m3fn):
            return x
        from deepinfer_core.quantization import fake_quantize_fp8_activations

        return fake_quantize_fp8_activations(x, block[1])

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The LM head: `linear(hidden, weight)` (a dense weight [V, D]) as float32 [N, V], what sampling
        reads. The values are the product rounded to hidden.dtype, then widened: a backend may write them in
        the product's own pass instead of converting them after. Tolerance as `linear`."""
        return self.linear(hidden, weight).float()

    def embedding(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Rows of `weight` [V, D] for int64 `ids` [T]; returns [T, D] in weight.dtype. Exact."""
        return torch.nn.functional.embedding(ids, weight)

    def hc_embedding(self, ids: torch.Tensor, weight: torch.Tensor, streams: int) -> torch.Tensor:
        """The mHC residual streams a model starts from: each token's `embedding` row in every one of
        `streams` streams, [T, streams, D] in weight.dtype. Exact."""
        return self.embedding(ids, weight).unsqueeze(1).expand(-1, streams, -1).contiguous()

    def gather_rows(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Rows of `table` [R, W] (any dtype; it may live in host memory, as V4.1's ~100 GB engram
        tables do) for int64 `ids` [N] on the compute device; returns [N, W] in table.dtype on ids'
        device. Exact. This reference reads the ids back to the table's device, which waits for the
        stream when they differ: a backend whose device can read host memory overrides it with a
        zero-copy gather so that a step never waits on the host.
        """
        return table.index_select(0, ids.to(table.device)).to(ids.device)

    @row_tiled("x", "positions")
    def rope(
        self, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False,
        inplace: bool = False,
    ) -> torch.Tensor:
        """Interleaved partial RoPE on the trailing 2*len(inv_freq) channels of x.

        x: [T, ..., d] float32/bfloat16; positions: [T] int64; inv_freq: [r/2] float32.
        Pair i = channels (d-r+2i, d-r+2i+1) rotates by angle positions[t]*inv_freq[i]:
        (a, b) -> (a cos - b sin, b cos + a sin); `inverse` rotates by the negative angle.
        cos/sin are rounded to x.dtype first, the rotation runs in float32, the result is x.dtype.
        `inplace`: the caller gives x up, so a backend may rotate it in place and return it (a 512-wide
        head with 64 rotated channels then moves 1/8 of the bytes); this reference returns a new tensor
        either way. Tolerance: float32 1e-5, bfloat16 1e-2 relative.
        """
        rope_dim = 2 * inv_freq.shape[0]
        angles = positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]
        cos = angles.cos().to(x.dtype).float().repeat_interleave(2, dim=-1)
        sin = angles.sin().to(x.dtype).float().repeat_interleave(2, dim=-1)
        if inverse:
            sin = -sin
        view = (x.shape[0],) + (1,) * (x.dim() - 2) + (rope_dim,)
        cos, sin = cos.view(view), sin.view(view)
        rot = x[..., -rope_dim:].float()
        swapped = torch.stack((-rot[..., 1::2], rot[..., 0::2]), dim=-1).flatten(-2)
        rotated = (rot * cos + swapped * sin).to(x.dtype)
        return torch.cat([x[..., :-rope_dim], rotated], dim=-1)

    def latent_norms(
        self, q_lora: torch.Tensor, q_weight: torch.Tensor, kv_latent: torch.Tensor, kv_weight: torch.Tensor,
        eps: float, positions: torch.Tensor, inv_freq: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention's two latent norms: (rms_norm(q_lora, q_weight, eps), rope(rms_norm(kv_latent,
        kv_weight, eps), positions, inv_freq)), each rounded as those ops round it. q_lora [T, dq] and
        kv_latent [T, dkv] may be column views of one projection's output. A backend may run both in one
        launch. Tolerance: as rms_norm, then rope.
        """
        q_latent = self.rms_norm(q_lora, q_weight, eps)
        return q_latent, self.rope(self.rms_norm(kv_latent, kv_weight, eps), positions, inv_freq, inplace=True)

    @row_tiled("streams")
    def hc_pre(
        self,
        streams: torch.Tensor,
        fn: torch.Tensor,
        base: torch.Tensor,
        scale: torch.Tensor,
        norm_eps: float,
        hc_eps: float,
        sinkhorn_iters: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Hyper-connection weights (mHC) and the collapsed block input.

        streams: [T, n, D]; fn: [(2+n)*n, n*D], base: [(2+n)*n], scale: [3], all float32.
        x = unweighted RMSNorm (norm_eps) of the flattened streams in float32; mix = fn @ x;
        pre = sigmoid(mix[:n]*scale0 + base[:n]) + hc_eps; post = 2*sigmoid(mix[n:2n]*scale1 + base[n:2n]);
        comb = softmax_rows(mix[2n:]*scale2 + base[2n:] as [n, n]) + hc_eps, then Sinkhorn: columns, then
        (rows, columns) x (sinkhorn_iters-1), each dividing by (sum + hc_eps).
        Returns (collapsed [T, D] streams.dtype = sum_i pre_i*streams_i, post [T, n] f32, comb [T, n, n] f32).
        Tolerance: float32 1e-5, bfloat16 1e-2 relative.
        """
        pre, post, comb = self.hc_mix(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)
        return self.hc_collapse(streams, pre), post, comb

    def hc_pre_norm(
        self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
        hc_eps: float, sinkhorn_iters: int, input_weight: torch.Tensor, input_eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`hc_pre` followed by the block's input norm: (rms_norm(collapsed, input_weight, input_eps), post,
        comb). A backend may fuse the two (the collapsed input is rounded to streams.dtype before the norm
        either way). Tolerance: float32 1e-5, bfloat16 1.6e-2 relative.
        """
        pre, post, comb = self.hc_mix(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)
        return self.hc_collapse_norm(streams, pre, input_weight, input_eps), post, comb

    def hc_collapse_norm(
        self, streams: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """A block's input: rms_norm(hc_collapse(streams, pre), weight, eps), the collapse rounded to streams.dtype
        before the norm. streams [T, n, D]; pre [T, n] float32; weight [D] float32. Returns [T, D] streams.dtype.
        A backend may fuse the two. Tolerance: float32 1e-5, bfloat16 1.6e-2 relative.
        """
        return self.rms_norm(self.hc_collapse(streams, pre), weight, eps)

    @row_tiled("block_out", "streams", "post", "comb")
    def hc_post(
        self, block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        """New residual streams: out[t, j] = post[t, j]*block_out[t] + sum_i comb[t, i, j]*streams[t, i].

        block_out: [T, D]; streams: [T, n, D]; post [T, n], comb [T, n, n] float32 (cast to streams.dtype
        first, as the reference model does). Returns [T, n, D] streams.dtype.
        Tolerance: float32 1e-5, bfloat16 2e-2 relative.
        """
        dtype = streams.dtype
        mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
        return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + mixed

    @row_tiled("streams")
    def hc_head(
        self,
        streams: torch.Tensor,
        fn: torch.Tensor,
        base: torch.Tensor,
        scale: torch.Tensor,
        norm_eps: float,
        hc_eps: float,
    ) -> torch.Tensor:
        """Final stream collapse: pre = sigmoid((fn @ x)*scale + base) + hc_eps, out = sum_i pre_i*streams_i.

        streams [T, n, D]; fn [n, n*D], base [n], scale [1] float32; x = unweighted RMSNorm (norm_eps)
        of the flattened streams in float32. Returns [T, D] streams.dtype.
        Tolerance: float32 1e-5, bfloat16 1e-2 relative.
        """
        flat = streams.flatten(1).float()
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
        mix = torch.nn.functional.linear(flat, fn.float())
        pre = torch.sigmoid(mix * scale.float() + base.float()) + hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)

    def compress_kv(
        self,
        kv: torch.Tensor,
        gate: torch.Tensor,
        ape: torch.Tensor,
        norm_weight: torch.Tensor,
        norm_eps: float,
        inv_freq: torch.Tensor,
        ratio: int,
        overlap: bool,
        state_kv: torch.Tensor,
        state_gate: torch.Tensor,
        entries: torch.Tensor,
        batch: ForwardBatch,
    ) -> None:
        """Gated pooling compressor: emit every entry closed by this step's tokens into the paged cache.

        kv, gate: [T, P] raw projections of the step's tokens (P = 2c with overlap (CSA), else c), possibly
        column slices of one wider tensor (strided rows);
        ape: [ratio, P] float32; norm_weight [c] float32; inv_freq [r/2] float32.
        Entry w pools the tokens of window [w*ratio, (w+1)*ratio): per channel, a float32 softmax over the
        slots of (gate + ape[s % ratio]) weights the kv values. With overlap, the slots are the first halves
        (channels :c) of window w-1's tokens (absent for w=0) and the second halves (c:) of window w's.
        The pooled vector gets RMSNorm(norm_weight) and RoPE at position w*ratio, and is written to
        `entries` [num_blocks, block_size // ratio, c] at block_tables[i][(w*ratio)//block_size], offset
        ((w*ratio) % block_size) // ratio. Entries emitted: context_len//ratio .. (context_len+q)//ratio - 1.
        Mutates: `entries`, and `state_kv` / `state_gate` [num_slots, span, P] (span = 2*ratio with overlap,
        else ratio; position p at p % span), which keep the raw projections of recent tokens for windows
        still open after the step. Rows of a sequence with context_len 0 never read its slot.
        Tolerance: float32 1e-5, bfloat16 2e-2 relative.
        """
        span = state_kv.shape[1]
        block_size = ratio * entries.shape[1]
        width = entries.shape[-1]
        for i, (start, q, ctx) in enumerate(_sequences(batch)):
            slot, end = batch.slot_ids_cpu[i], ctx + q
            first, last = ctx // ratio, end // ratio
            if last > first:
                lo = max(0, (first - 1) * ratio) if overlap else first * ratio
                cached = torch.arange(lo, ctx, device=kv.device) % span
                seq_kv = torch.cat([state_kv[slot, cached], kv[start:start + q]])
                seq_gate = torch.cat([state_gate[slot, cached], gate[start:start + q]])
                windows = torch.arange(first, last, device=kv.device)
                pool = partial(_pool_windows, seq_kv, seq_gate, ape, first_pos=lo, ratio=ratio, overlap=overlap,
                               width=width)
                pooled = in_row_tiles(pool, [windows], self.row_tile) if self.batch_invariant else pool(windows)
                pooled = self.rms_norm(pooled, norm_weight, norm_eps)
                pooled = self.rope(pooled, windows * ratio, inv_freq)
                table = batch.block_tables[i].to(torch.long)
                blocks = table[(windows * ratio) // block_size]
                entries[blocks, ((windows * ratio) % block_size) // ratio] = pooled.to(entries.dtype)
            keep = torch.arange(max(ctx, end - span), end, device=kv.device)
            state_kv[slot, keep % span] = kv[start + keep - ctx].to(state_kv.dtype)
            state_gate[slot, keep % span] = gate[start + keep - ctx].to(state_gate.dtype)

    def indexer_topk(
        self,
        q: torch.Tensor,
        head_weights: torch.Tensor,
        index_keys: torch.Tensor,
        ratio: int,
        topk: int,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """Lightning indexer: per query, the compressed entries with the top scores.

        q: [T, Hi, di] (RoPE applied); head_weights: [T, Hi] (raw weights_proj output; its rows may be
        strided: the model passes columns of a wider projection output); index_keys: paged
        [num_blocks, block_size // ratio, di] holding entries 0 .. (context_len+q)//ratio - 1 of each sequence.
        Score(t, w) = sum_h (head_weights[t,h] * Hi^-0.5) * ReLU(q[t,h] . K[w]) * di^-0.5, in float32.
        Entries w >= (pos_t+1)//ratio are not visible. Returns int64 [T, topk]: the visible entries in
        descending score order, ties broken by the lowest entry index (stable sort), padded with -1.
        Exact on the returned set whenever scores do not tie at the boundary.
        """
        out = torch.full((q.shape[0], topk), -1, dtype=torch.long, device=q.device)
        if self.batch_invariant:
            _indexer_topk_per_query(out, q, head_weights, index_keys, ratio, batch)
            return out
        for i, (start, n_q, ctx) in enumerate(_sequences(batch)):
            n_entries = (ctx + n_q) // ratio
            if n_entries == 0:
                continue
            keys = _gather_entries(index_keys, batch.block_tables[i], n_entries, ratio).float()
            rows = slice(start, start + n_q)
            scores = torch.relu(torch.einsum("qhd,wd->qhw", q[rows].float(), keys)) * q.shape[-1] ** -0.5
            weights = head_weights[rows].float() * q.shape[1] ** -0.5
            scores = (scores * weights.unsqueeze(-1)).sum(dim=1)
            visible = _visible_entries(batch.positions[rows], n_entries, ratio)
            scores = scores.masked_fill(~visible, float("-inf"))
            order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :topk]
            picked = torch.where(visible.gather(1, order), order, torch.full_like(order, -1))
            out[rows, : picked.shape[1]] = picked
        return out

    def sparse_attention(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        window: torch.Tensor,
        sinks: torch.Tensor,
        scale: float,
        batch: ForwardBatch,
        entries: torch.Tensor | None = None,
        ratio: int = 0,
        selected: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Shared-KV multi-head attention over window + compressed entries, with a per-head sink.

        q: [T, H, d]; kv: [T, d], this step's K=V vectors; window: [num_slots, W, d] ring holding each
        sequence's positions < context_len at p % W (read only for positions in the window). Query at
        position t sees: kv of positions s with t-W < s <= t (ring, then this step's rows), and, when
        `entries` [num_blocks, block_size // ratio, d] is given, the compressed entries w < (t+1)//ratio
        (all of them if `selected` is None, else only those listed in `selected` [T, k], -1 = none).
        Window positions below `batch.window_starts_cpu[i]` (when given) are not seen.
        logits = (q . k) * scale, plus a sink logit sinks[h] (float32, unscaled) whose probability is
        dropped; softmax in float32; probabilities cast to kv.dtype for the value sum.
        Returns [T, H, d] in q.dtype. Tolerance: float32 1e-5, bfloat16 2e-2 relative.
        """
        out = torch.empty_like(q)
        if self.batch_invariant:
            _sparse_attention_per_query(out, q, kv, window, sinks, scale, batch, entries, ratio, selected)
            return out
        ring = window.shape[1]
        for i, (start, n_q, ctx) in enumerate(_sequences(batch)):
            slot, rows = batch.slot_ids_cpu[i], slice(start, start + n_q)
            key_pos = torch.arange(max(0, ctx - ring + 1, _window_start(batch, i)), ctx + n_q, device=q.device)
            keys = torch.cat([window[slot, key_pos[key_pos < ctx] % ring].to(kv.dtype), kv[rows]])
            pos = batch.positions[rows]
            mask = (key_pos[None, :] <= pos[:, None]) & (key_pos[None, :] > pos[:, None] - ring)
            if entries is not None:
                n_entries = (ctx + n_q) // ratio
                keys = torch.cat([keys, _gather_entries(entries, batch.block_tables[i], n_entries, ratio).to(kv.dtype)])
                visible = _visible_entries(pos, n_entries, ratio)
                if selected is not None:
                    chosen = torch.zeros(n_q, n_entries + 1, dtype=torch.bool, device=q.device)
                    picks = selected[rows].clamp(min=-1) % (n_entries + 1)
                    chosen.scatter_(1, picks, True)
                    visible = visible & chosen[:, :n_entries]
                mask = torch.cat([mask, visible], dim=1)
            logits = torch.einsum("qhd,kd->hqk", q[rows], keys) * scale
            logits = logits.float().masked_fill(~mask.unsqueeze(0), float("-inf"))
            sink = sinks.float().view(-1, 1, 1).expand(-1, n_q, 1)
            logits = torch.cat([logits, sink], dim=-1)
            logits = logits - logits.amax(dim=-1, keepdim=True)
            probs = torch.softmax(logits, dim=-1)[..., :-1].to(kv.dtype)
            out[rows] = torch.einsum("hqk,kd->qhd", probs, keys).to(q.dtype)
        return out

    def rotary_attention(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        window: torch.Tensor,
        sinks: torch.Tensor,
        scale: float,
        batch: ForwardBatch,
        inv_freq: torch.Tensor,
        q_norm_eps: float | None = None,
        entries: torch.Tensor | None = None,
        ratio: int = 0,
        selected: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`sparse_attention` with what a block does around it: each query head of q [T, H, d] (as
        projected; given up, a backend may overwrite it) is RMS-normalised without a weight when
        `q_norm_eps` is given (V4), then rotated at batch.positions (`rope` with `inv_freq`); the output
        is de-rotated at the same positions. Composed of those three ops here, each rounding to q.dtype;
        one op so that a backend can do the norm and both rotations in its attention kernel (q and the
        output then take no pass of their own). Tolerance: as sparse_attention.
        """
        if q_norm_eps is not None:
            q = self.rms_norm(q, None, q_norm_eps)
        q = self.rope(q, batch.positions, inv_freq, inplace=True)
        out = self.sparse_attention(q, kv, window, sinks, scale, batch, entries, ratio, selected)
        return self.rope(out, batch.positions, inv_freq, inverse=True, inplace=True)

    def rotary_attention_quantized(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        window: torch.Tensor,
        sinks: torch.Tensor,
        scale: float,
        batch: ForwardBatch,
        inv_freq: torch.Tensor,
        group: int,
        q_norm_eps: float | None = None,
        entries: torch.Tensor | None = None,
        ratio: int = 0,
        selected: torch.Tensor | None = None,
    ) -> QuantizedActivations:
        """`rotary_attention`'s output [T, H, d] as fp8 codes of each token's row of H * d values in groups of
        `group` columns (`quantization.quantize_fp8_activations`: codes [T, H * d], scales [T, H * d / group]), for
        a projection that takes them (`quantized_input_group`): one op so that a backend can quantise in the
        attention's epilogue, the output then stored once, in fp8. Composed here. Exact against quantising
        `rotary_attention`'s output (the codes of a backend's output, whose values are within its tolerance)."""
        _, heads, dim = q.shape
        if heads * dim % group:
            raise ValueError(f"an attention output of {heads} x {dim} columns a token splits {group}-column groups")
        out = self.rotary_attention(q, kv, window, sinks, scale, batch, inv_freq, q_norm_eps, entries, ratio, selected)
        return QuantizedActivations.of_rows(out, group)

    def store_window(self, kv: torch.Tensor, window: torch.Tensor, batch: ForwardBatch) -> None:
        """Write this step's K=V vectors into the sliding-window ring.

        kv: [T, d]; window: [num_slots, W, d] mutated: each sequence's last min(q, W) positions p of the
        step land at window[slot, p % W]. Exact.
        """
        ring = window.shape[1]
        for i, (start, n_q, ctx) in enumerate(_sequences(batch)):
            keep = torch.arange(max(ctx, ctx + n_q - ring), ctx + n_q, device=kv.device)
            window[batch.slot_ids_cpu[i], keep % ring] = kv[start + keep - ctx].to(window.dtype)

    @row_tiled("x", "input_ids")
    def route(
        self,
        x: torch.Tensor,
        gate_weight: torch.Tensor,
        top_k: int,
        routed_scaling_factor: float,
        scoring_func: str = "sqrtsoftplus",
        bias: torch.Tensor | None = None,
        tid2eid: torch.Tensor | None = None,
        input_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """MoE routing: which experts each token uses, and their weights.

        x: [T, D]; gate_weight: [E, D]. scores = f(x @ gate_weight.T) in float32 with f = sqrt(softplus)
        ("sqrtsoftplus"), sigmoid or softmax. Hash routing (tid2eid [V, k] int64 given): ids =
        tid2eid[input_ids]. Score routing: ids = top-k of scores + bias (bias [E] float32 or None), the
        bias only selects. weights = scores[ids] / (sum + 1e-20) * routed_scaling_factor.
        Returns (weights [T, k] float32, ids [T, k] int64). Tolerance: float32 1e-5, bfloat16 2e-2 on
        weights; ids exact when scores do not tie.
        """
        logits = torch.nn.functional.linear(x, gate_weight.to(x.dtype)).float()
        if scoring_func == "sqrtsoftplus":
            scores = torch.nn.functional.softplus(logits).sqrt()
        elif scoring_func == "sigmoid":
            scores = torch.sigmoid(logits)
        else:
            scores = torch.softmax(logits, dim=-1)
        if tid2eid is not None:
            ids = tid2eid[input_ids].long()
        else:
            biased = scores if bias is None else scores + bias.float()
            ids = torch.topk(biased, top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * routed_scaling_factor, ids

    @row_tiled("x", "weights", "ids")
    def fused_moe(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        experts: Sequence[MlpWeights | None],
        shared: MlpWeights | None,
        swiglu_limit: float,
    ) -> torch.Tensor:
        """Routed experts plus the shared expert, each a clamped SwiGLU MLP.

        x: [T, D]; weights [T, k] float32, ids [T, k] int64 from `route`; experts[e] holds expert e's
        w1, w3 [I, D] and w2 [D, I] (dense, fp8 or fp4 as in `linear`); None = not held by this rank
        (its rows contribute nothing). mlp(x) = w2 @ (silu(min(w1 x, L)) * clamp(w3 x, -L, L)), L = swiglu_limit.
        out = sum_k weights[t,k] * mlp_{ids[t,k]}(x[t]) + mlp_shared(x[t]), returned in x.dtype; each routed
        output is weighted after w2 and accumulated in x.dtype, in ascending expert order.
        Expert parallelism also calls it with shared None (no shared term: routed pairs computed for
        another rank) and with every expert None (the shared expert alone).
        Tolerance: float32 1e-5, bfloat16 3e-2 relative.
        """
        out = torch.zeros_like(x)
        for expert in torch.unique(ids).tolist():
            if experts[expert] is None:
                continue
            rows, slot = torch.where(ids == expert)
            y = self._swiglu(x[rows], experts[expert], swiglu_limit) * weights[rows, slot, None]
            out.index_add_(0, rows, y.to(out.dtype))
        return out if shared is None else out + self._swiglu(x, shared, swiglu_limit)

    def _swiglu(self, x: torch.Tensor, mlp: MlpWeights, limit: float) -> torch.Tensor:
        gate = self.linear(x, mlp.w1, mlp.w1_scale, mlp.block).clamp(max=limit)
        up = self.linear(x, mlp.w3, mlp.w3_scale, mlp.block).clamp(min=-limit, max=limit)
        return self.linear(torch.nn.functional.silu(gate) * up, mlp.w2, mlp.w2_scale, mlp.block)

    @row_tiled("logits", "temperature", "seeds", "positions", "top_k", "top_p", "min_p")
    def sample(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        seeds: torch.Tensor,
        positions: torch.Tensor,
        top_k: torch.Tensor | None = None,
        top_p: torch.Tensor | None = None,
        min_p: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Draw one token per row. Returns [N] int64 token ids; nothing is mutated.

        logits: [N, V] float32. temperature: [N] float32, 0 = greedy (argmax of the raw logits).
        seeds: [N] int64 in [0, 2**63); positions: [N] int64, the output index of the token drawn.
        top_k [N] int64 (0 = off), top_p [N] float32 (>= 1 = off), min_p [N] float32 (0 = off);
        a filter is None when no row uses it. Rows with temperature > 0 draw from
        softmax(logits / T) restricted by top_k, then top_p (on what top_k kept), then min_p
        (relative to the most likely token), via argmax(logits / T + Gumbel(u)) where u is the
        counter-based uniform `deepinfer_core.engine.sampler.counter_uniform(seeds, positions, V)`,
        a pure function of (seed, position, token id): a row's draw never depends on the batch.
        Tolerance: exact token ids (a backend must use the same uniforms; float rounding may only
        flip rows whose two best scores tie to within a few ulps).
        """
        from deepinfer_core.engine.sampler import sample_reference

        return sample_reference(logits, temperature, seeds, positions, top_k, top_p, min_p)

    # --- DeepSeek-V4.1 (MODEL_SPEC_V41) -------------------------------------------------------------

    @row_tiled("streams")
    def hc_mix(
        self,
        streams: torch.Tensor,
        fn: torch.Tensor,
        base: torch.Tensor,
        scale: torch.Tensor,
        norm_eps: float,
        hc_eps: float,
        sinkhorn_iters: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Single-pass mHC coefficients (V4.1): the (pre, post, comb) of `hc_pre`, without the collapse.

        streams: [T, n, D]; fn [(2+n)*n, n*D], base [(2+n)*n], scale [3] float32; formulas as `hc_pre`.
        Returns (pre [T, n], post [T, n], comb [T, n, n]) float32; V4.1 collapses with the *previous*
        site's pre (`hc_collapse`). Tolerance: float32 1e-5, bfloat16 1e-2 relative.
        """
        n = streams.shape[1]
        flat = streams.flatten(1).float()
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
        mix = torch.nn.functional.linear(flat, fn.float())
        pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = base.float().split([n, n, n * n])
        pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
        post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * scale[2] + comb_b.view(n, n), dim=-1) + hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
        for _ in range(sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
        return pre, post, comb

    @row_tiled("streams", "pre")
    def hc_collapse(self, streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """sum_i pre[t, i] * streams[t, i] in float32, cast to streams.dtype.

        streams [T, n, D]; pre [T, n] float32. Returns [T, D]. Tolerance: float32 1e-5, bfloat16 1e-2.
        """
        return (pre.float().unsqueeze(-1) * streams.float()).sum(dim=1).to(streams.dtype)

    @row_tiled("block_out", "streams", "post", "comb")
    def hc_expand(
        self, block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        """V4.1 stream update, all in float32: out[t, k] = post[t, k]*block_out[t] + sum_j comb[t, j, k]*streams[t, j].

        block_out [T, D]; streams [T, n, D]; post [T, n], comb [T, n, n] float32. Returns [T, n, D] in
        streams.dtype (one cast at the end, unlike `hc_post`). Tolerance: float32 1e-5, bfloat16 1e-2.
        """
        mixed = torch.matmul(comb.float().transpose(-1, -2), streams.float())
        return (post.float().unsqueeze(-1) * block_out.float().unsqueeze(-2) + mixed).to(streams.dtype)

    def hc_update_mix(
        self, block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
        fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float, hc_eps: float,
        sinkhorn_iters: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """A V4 site's stream update, then the next site's coefficients from the new streams: (new streams, pre,
        post, comb). The update is `hc_post` of (block_out, streams, post, comb); the coefficients are `hc_mix`
        of the new streams with (fn, base, scale, norm_eps, hc_eps, sinkhorn_iters). A backend may fuse the two
        (one pass over the streams). V4.1 calls `hc_expand` and `hc_mix` itself: its decode step measured
        faster that way than with the nvidia backend's fused launch (H100, BENCHMARKS.md, 2026-12-05).
        Tolerance: the streams as `hc_post`, the coefficients as `hc_mix`.
        """
        streams = self.hc_post(block_out, streams, post, comb)
        return streams, *self.hc_mix(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)

    @row_tiled("x")
    def route_fp32(
        self,
        x: torch.Tensor,
        gate_weight: torch.Tensor,
        bias: torch.Tensor,
        top_k: int,
        routed_scaling_factor: float,
        gate_temp: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """V4.1 router: everything in float32, logits divided by `gate_temp`.

        x [T, D]; gate_weight [E, D]; bias [E] float32 (selection only). scores = sqrt(softplus(
        (x32 @ W32.T) / gate_temp)); ids = top-k of scores + bias, in descending order; weights =
        scores[ids] / (sum + 1e-20) when top_k > 1, times routed_scaling_factor.
        Returns (weights [T, k] float32, ids [T, k] int64). Tolerance: weights float32 1e-5, bfloat16
        2e-2; ids exact unless scores tie.
        """
        logits = torch.nn.functional.linear(x.float(), gate_weight.float()) / gate_temp
        scores = torch.nn.functional.softplus(logits).sqrt()
        ids = torch.topk(scores + bias.float(), top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * routed_scaling_factor, ids

    @row_tiled("x", "weights", "ids")
    def fused_moe_prescaled(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        experts: Sequence[MlpWeights | None],
        shared: MlpWeights | None,
        swiglu_limit: float,
    ) -> torch.Tensor:
        """V4.1 MoE: the routing weight multiplies the activation before w2; float32 accumulation.

        x [T, D]; weights [T, k] float32 and ids [T, k] int64 from `route_fp32`; experts / shared as in
        `fused_moe`. Per expert: g = (w1 x) and u = (w3 x) in x.dtype, then float32: u = clamp(u, -L, L),
        g = min(g, L), a = silu(g) * u * weight, cast to x.dtype, y = w2 a; routed outputs are summed in
        float32 in ascending expert order, then the shared expert (no weight) is added in float32; the
        sum is cast to x.dtype. Tolerance: float32 1e-5, bfloat16 3e-2 relative.
        """
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for expert in torch.unique(ids).tolist():
            if experts[expert] is None:
                continue
            rows, slot = torch.where(ids == expert)
            y = self._swiglu_prescaled(x[rows], experts[expert], swiglu_limit, weights[rows, slot, None])
            out.index_add_(0, rows, y.float())
        if shared is not None:
            out += self._swiglu_prescaled(x, shared, swiglu_limit, None).float()
        return out.to(x.dtype)

    def _swiglu_prescaled(
        self, x: torch.Tensor, mlp: MlpWeights, limit: float, weight: torch.Tensor | None
    ) -> torch.Tensor:
        gate = self.linear(x, mlp.w1, mlp.w1_scale, mlp.block).float().clamp(max=limit)
        up = self.linear(x, mlp.w3, mlp.w3_scale, mlp.block).float().clamp(min=-limit, max=limit)
        act = torch.nn.functional.silu(gate) * up
        if weight is not None:
            act = act * weight
        return self.linear(act.to(x.dtype), mlp.w2, mlp.w2_scale, mlp.block)

    @row_tiled("kv", "gate")
    def gated_pool(self, kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Per-channel softmax pooling of non-overlapping groups (the V4.1 compressor, ratio > 1).

        kv, gate: [G, r, c] float32 raw projections of each group's r tokens. Returns [G, c] float32,
        out[g, c] = sum_s softmax_s(gate[g, :, c])[s] * kv[g, s, c]. Tolerance: float32 1e-5.
        """
        return (kv.float() * torch.softmax(gate.float(), dim=1)).sum(dim=1)

    def top_entries(self, scores: torch.Tensor, k: int) -> torch.Tensor:
        """Each row's entries of its k highest scores (k <= the row width) by descending score, ties to the lowest
        entry: int64 [T, k] for float scores [T, n], -1 where the score is -inf. Exact."""
        ordered = torch.sort(scores, dim=-1, descending=True, stable=True)
        return torch.where(ordered.values[:, :k] > float("-inf"), ordered.indices[:, :k], -1)

    def indexer_scores(
        self, q: torch.Tensor, keys: torch.Tensor, head_weights: torch.Tensor, visible: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Lightning-indexer scores of queries against index keys.

        q [S, Hi, di]; keys [N, di] (one sequence's, for all its queries) or [S, N, di] (each query its own
        keys: a decode step's sequences); head_weights [S, Hi] raw weights_proj output. In float32:
        I[s, w] = sum_h head_weights[s, h] * Hi^-0.5 * ReLU(q[s, h] . keys[(s,) w]) * di^-0.5. `visible` [S]
        (integer, optional): entries w >= visible[s] score -inf (those the query cannot see). Returns [S, N]
        float32. Tolerance: float32 1e-5 relative (the caller's top-k is tie-sensitive).
        """
        per_query = keys.dim() == 3
        if self.batch_invariant:
            # Keys broadcast per row and reduced over d: a row's dot products do not depend on S or N.
            def dots(rows: torch.Tensor, row_keys: torch.Tensor | None) -> torch.Tensor:
                k = row_keys.unsqueeze(1) if per_query else keys  # [s, 1, n, d] or [n, d]
                return (rows.float().unsqueeze(2) * k.float()).sum(-1)

            products = in_row_tiles(dots, [q, keys if per_query else None], self.row_tile)
        else:
            products = torch.einsum("shd,snd->shn" if per_query else "shd,nd->shn", q.float(), keys.float())
        scores = torch.relu(products) * q.shape[-1] ** -0.5
        weights = head_weights.float() * q.shape[1] ** -0.5
        scores = (scores * weights.unsqueeze(-1)).sum(dim=1)
        if visible is None:
            return scores
        hidden = torch.arange(scores.shape[-1], device=scores.device) >= visible[:, None]
        return scores.masked_fill(hidden, float("-inf"))

    @row_tiled("streams", "key", "value")
    def engram_gate(
        self, streams: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q_weight: torch.Tensor,
        k_weight: torch.Tensor, eps: float,
    ) -> torch.Tensor:
        """Engram injection: each stream adds the value, gated by its normalised match with its key.

        streams, key [T, n, D]; value [T, D]; q_weight, k_weight [n, D]. In float32, with weight = q_weight *
        k_weight: dot = sum_d X*weight*key * rsqrt(mean(X^2)+eps) * rsqrt(mean(key^2)+eps) * D^-0.5;
        g = sigmoid(sign(dot) * sqrt(max(|dot|, 1e-6))); out = X + g*value. Returns [T, n, D] streams.dtype.
        Tolerance: float32 1e-5, bfloat16 1e-2 relative.
        """
        h, k = streams.float(), key.float()
        rstd = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(k.square().mean(-1) + eps)
        weight = q_weight.float() * k_weight.float()
        dot = (h * weight * k).sum(-1) * rstd * h.shape[-1] ** -0.5
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
        return (h + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(streams.dtype)

    def ngram_hash(
        self, tokens: torch.Tensor, pad_id: int, multipliers: torch.Tensor, primes: torch.Tensor, offsets: torch.Tensor
    ) -> torch.Tensor:
        """Engram hash ids: each row's n-grams, padded, hashed into every engram layer's table of every head.

        tokens int64 [q, N] n-gram tokens, shift-major (column s: the token s positions back), -1 (DEAD) at
        a position before the sequence's start; from a row's first DEAD column on, every column is `pad_id`
        (`padded_ngrams`). multipliers int64 [L, N]; primes int64 [L, N-1, H]; offsets int64 [L, (N-1)*H].
        In int64 (the layout keeps every product non-negative and below 2^63): rolling_n = XOR over s <= n
        of padded[:, s] * multipliers[l, s]; the n-gram of length n+1 (n >= 1) gives rolling_n %
        primes[l, n-1, h] for each head h. Returns int64 [q, L, (N-1)*H]: those ids n-major then head, plus
        offsets. Exact.
        """
        products = padded_ngrams(tokens, pad_id)[:, None, :] * multipliers[None]  # [q, L, N]
        rolling, ids = products[..., 0], []
        for n in range(1, tokens.shape[1]):
            rolling = torch.bitwise_xor(rolling, products[..., n])
            ids.append(rolling.unsqueeze(-1) % primes[None, :, n - 1])
        return torch.cat(ids, dim=-1) + offsets[None]

    def paged_rows(self, block_tables: torch.Tensor, ids: torch.Tensor, per_block: int) -> torch.Tensor:
        """Where paged cache entries lie: entry ids[s, j] of sequence s is vector block * per_block + ids %
        per_block, block = block_tables[s, ids // per_block], of a pool [num_blocks, per_block, ...] flattened
        over its leading dims (the `rows` of a paged read or write). block_tables [S, W] int32 or int64, ids
        [S, k] int64 within the tables; negative ids and blocks count as 0 (readers mask what those give,
        writers write allocated entries only). Returns int64 [S, k]. Exact."""
        ids = ids.clamp(min=0)
        blocks = block_tables.to(torch.long).gather(1, ids // per_block).clamp(min=0)
        return blocks * per_block + ids % per_block

    def selection_tables(self, selected: torch.Tensor, n_entries: int) -> torch.Tensor:
        """Block tables of a decode step's picked entries, one entry a block (for `sparse_attention` over the picks
        alone): entry selected[s, j] of sequence s goes to row s * k + j; every other entry, and column n_entries
        (where -1 picks point), to row S * k. selected [S, k] int64, a row's ids distinct (-1 = none) and below
        n_entries. Returns int32 [S, n_entries + 1]. Exact."""
        n_seqs, k = selected.shape
        none = n_seqs * k
        tables = torch.full((n_seqs, n_entries + 1), none, dtype=torch.int32, device=selected.device)
        rows = torch.arange(none, dtype=torch.int32, device=selected.device).view(n_seqs, k)
        picked = selected >= 0
        return tables.scatter_(1, torch.where(picked, selected, n_entries), torch.where(picked, rows, none))

    def fp8_block_quantize(
        self, x: torch.Tensor, block: int = 32, out: tuple[torch.Tensor, ...] | None = None,
        rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """V4.1 window-KV format: e4m3 values with one power-of-two (ue8m0) scale per `block` channels.

        x [..., d] float (d % block == 0). Per block, in float32: s = 2^ceil(log2(max(amax, 1e-4) *
        fp32(1/448))) (exponent bits, +1 if the mantissa is non-zero); values = e4m3(clamp(x/s, +-448)).
        Returns (values float8_e4m3fn [..., d], exponents uint8 [..., d/block] = log2(s) + 127). Exact.

        With `out` (contiguous parts of that format, any leading dims) and distinct int64 `rows` [N] (x [N, d]),
        the codes go to those vectors of the parts flattened over their leading dims (a paged cache write) and
        `out` is returned.
        """
        blocks = x.float().unflatten(-1, (-1, block))
        amax = blocks.abs().amax(-1).clamp_min(1e-4)
        exponent = _ceil_log2(amax * (1.0 / 448.0))
        scale = torch.exp2(exponent.float()).unsqueeze(-1)
        values = (blocks / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        return _stored((values.flatten(-2), (exponent + 127).to(torch.uint8)), out, rows)

    def fp8_block_dequantize(
        self, values: torch.Tensor, exponents: torch.Tensor, dtype: torch.dtype, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Inverse of `fp8_block_quantize`: values * 2^(exponents - 127) per block, as `dtype`. Exact.

        With `rows` (int64, any shape), only those vectors of the parts flattened over their leading dims
        (a paged cache read): returns [*rows.shape, d].
        """
        if rows is not None:
            values, exponents = _vectors(values, rows), _vectors(exponents, rows)
        block = values.shape[-1] // exponents.shape[-1]
        scale = torch.exp2(exponents.float() - 127.0).unsqueeze(-1)
        return (values.float().unflatten(-1, (-1, block)) * scale).flatten(-2).to(dtype)

    def fp4_block_quantize(
        self, x: torch.Tensor, block: int, scale_format: str, out: tuple[torch.Tensor, ...] | None = None,
        rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """V4.1 fp4 formats: e2m1 codes, one scale per `block` channels.

        x [..., d] float (d % block == 0, d even). scale_format "e4m3" (compressed KV, block 16):
        s = e4m3(min(max(amax, 6*2^-9) / 6, 448)), round to nearest. "ue8m0" (indexer q/k, block 32):
        s = 2^ceil(log2(max(amax, 6*2^-126) * fp32(1/6))). codes = e2m1(clamp(x/s, +-6)): |q| against
        0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0; a tie at 0.25, 1.25, 2.5, 5.0 rounds down, at 0.75, 1.75,
        3.5 up (even code); sign bit (code bit 3) from signbit. Returns (codes uint8 [..., d/2] packed,
        channel 2j in the low nibble, and scales: float8_e4m3fn or uint8 exponent+127 [..., d/block]). Exact.
        `out` and `rows` as in `fp8_block_quantize`.
        """
        blocks = x.float().unflatten(-1, (-1, block))
        amax = blocks.abs().amax(-1)
        if scale_format == "e4m3":
            # clamped at e4m3's 448 (a block of amax past 2,688): torch's float8 cast saturates on the CPU, on
            # CUDA it gives NaN, a scale that would void the block
            scales = (amax.clamp_min(6.0 * 2.0**-9) / 6.0).clamp_max(448.0).to(torch.float8_e4m3fn)
            scale = scales.float()
        elif scale_format == "ue8m0":
            exponent = _ceil_log2(amax.clamp_min(6.0 * 2.0**-126) * (1.0 / 6.0))
            scales, scale = (exponent + 127).to(torch.uint8), torch.exp2(exponent.float())
        else:
            raise ValueError(f"fp4 scale_format must be 'e4m3' or 'ue8m0', got {scale_format!r}")
        q = (blocks / scale.unsqueeze(-1)).clamp(-6.0, 6.0)
        codes = (q.abs().unsqueeze(-1) >= _e2m1_thresholds(q.device)).sum(-1).to(torch.uint8)
        codes = (codes | (torch.signbit(q).to(torch.uint8) << 3)).flatten(-2)
        return _stored((codes[..., 0::2] | (codes[..., 1::2] << 4), scales), out, rows)

    def fp4_block_dequantize(
        self, packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Inverse of `fp4_block_quantize` (scale format read from scales.dtype), as `dtype`. Exact. `rows` as
        in `fp8_block_dequantize`."""
        if rows is not None:
            packed, scales = _vectors(packed, rows), _vectors(scales, rows)
        codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).long()
        values = _e2m1_values(packed.device)[codes]
        if scales.dtype == torch.uint8:
            scale = torch.exp2(scales.float() - 127.0)
        else:
            scale = scales.float()
        block = values.shape[-1] // scales.shape[-1]
        return (values.unflatten(-1, (-1, block)) * scale.unsqueeze(-1)).flatten(-2).to(dtype)


def _stored(
    codes: tuple[torch.Tensor, torch.Tensor], out: tuple[torch.Tensor, ...] | None, rows: torch.Tensor | None
) -> tuple[torch.Tensor, ...]:
    """A quantisation's `codes` as returned, or written to vectors `rows` of the parts `out`, then returned."""
    if (out is None) != (rows is None):
        raise ValueError("a quantisation writes into `out` at `rows`: give both or neither")
    if out is None:
        return codes
    for part, code in zip(out, codes):
        if not part.is_contiguous():
            raise ValueError("the parts a quantisation writes into must be contiguous")
        part.view(-1, part.shape[-1])[rows] = code.reshape(-1, code.shape[-1]).to(part.dtype)
    return out


def _vectors(parts: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Vectors `rows` of `parts` [..., w] flattened over its leading dims: [*rows.shape, w]."""
    return parts.reshape(-1, parts.shape[-1])[rows]


def _sequences(batch: ForwardBatch) -> Iterator[tuple[int, int, int]]:
    """(first row, query length, context length) of each sequence of the step."""
    start = 0
    for n_q, ctx in zip(batch.query_lens_cpu, batch.context_lens_cpu):
        yield start, n_q, ctx
        start += n_q


def _window_start(batch: ForwardBatch, i: int) -> int:
    """First position of sequence i with window KV (bounded prefix replay drops the ones below)."""
    return 0 if batch.window_starts_cpu is None else batch.window_starts_cpu[i]


def _gather_entries(paged: torch.Tensor, block_table: torch.Tensor, n_entries: int, ratio: int) -> torch.Tensor:
    """Entries 0..n_entries-1 of one sequence from a paged [num_blocks, block_size // ratio, c] pool."""
    per_block = paged.shape[1]
    w = torch.arange(n_entries, device=paged.device)
    return paged[block_table.to(torch.long)[w // per_block], w % per_block]


def _sparse_attention_per_query(
    out: torch.Tensor,
    q: torch.Tensor,
    kv: torch.Tensor,
    window: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    batch: ForwardBatch,
    entries: torch.Tensor | None,
    ratio: int,
    selected: torch.Tensor | None,
) -> None:
    """Batch-invariant `sparse_attention`: each query alone, over exactly the keys it sees in position
    order (window, then its visible entries), so neither the batch nor the chunking changes a shape."""
    ring = window.shape[1]
    for i, (start, n_q, ctx) in enumerate(_sequences(batch)):
        slot = batch.slot_ids_cpu[i]
        for row, pos in zip(range(start, start + n_q), batch.positions[start:start + n_q].tolist()):
            first = max(0, pos - ring + 1, _window_start(batch, i))
            ring_pos = torch.arange(first, max(first, min(ctx, pos + 1)), device=q.device)
            cached = window[slot, ring_pos % ring].to(kv.dtype)
            keys = torch.cat([cached, kv[start + max(first, ctx) - ctx:row + 1]])
            allowed = torch.ones(keys.shape[0], dtype=torch.bool, device=q.device)
            n_visible = min((pos + 1) // ratio, (ctx + n_q) // ratio) if entries is not None else 0
            if n_visible > 0:
                keys = torch.cat([keys, _gather_entries(entries, batch.block_tables[i], n_visible, ratio).to(kv.dtype)])
                chosen = torch.ones(n_visible, dtype=torch.bool, device=q.device)
                if selected is not None:
                    chosen = torch.zeros(n_visible + 1, dtype=torch.bool, device=q.device)
                    chosen.scatter_(0, selected[row].clamp(min=-1).clamp(max=n_visible) % (n_visible + 1), True)
                    chosen = chosen[:n_visible]
                allowed = torch.cat([allowed, chosen])
            logits = (torch.matmul(q[row], keys.transpose(0, 1)) * scale).float()
            logits = logits.masked_fill(~allowed, float("-inf"))
            logits = torch.cat([logits, sinks.float().view(-1, 1)], dim=-1)
            probs = torch.softmax(logits - logits.amax(dim=-1, keepdim=True), dim=-1)[:, :-1].to(kv.dtype)
            out[row] = torch.matmul(probs, keys).to(q.dtype)


def _indexer_topk_per_query(
    out: torch.Tensor,
    q: torch.Tensor,
    head_weights: torch.Tensor,
    index_keys: torch.Tensor,
    ratio: int,
    batch: ForwardBatch,
) -> None:
    """Batch-invariant `indexer_topk`: each query scores exactly its visible entries (a shape fixed by
    its position); the stable sort breaks ties by the lowest entry index."""
    topk = out.shape[1]
    for i, (start, n_q, ctx) in enumerate(_sequences(batch)):
        for row, pos in zip(range(start, start + n_q), batch.positions[start:start + n_q].tolist()):
            n_visible = min((pos + 1) // ratio, (ctx + n_q) // ratio)
            if n_visible == 0:
                continue
            keys = _gather_entries(index_keys, batch.block_tables[i], n_visible, ratio).float()
            scores = torch.relu(torch.matmul(q[row].float(), keys.transpose(0, 1))) * q.shape[-1] ** -0.5
            weights = head_weights[row].float() * q.shape[1] ** -0.5
            scores = (scores * weights.unsqueeze(-1)).sum(dim=0)
            order = torch.sort(scores, descending=True, stable=True).indices[:topk]
            out[row, : order.shape[0]] = order


def _visible_entries(positions: torch.Tensor, n_entries: int, ratio: int) -> torch.Tensor:
    """[q, n_entries] bool: entry w is complete for the query at position t iff w < (t+1) // ratio."""
    w = torch.arange(n_entries, device=positions.device)
    return w[None, :] < ((positions + 1) // ratio)[:, None]


def _pool_windows(
    kv: torch.Tensor,
    gate: torch.Tensor,
    ape: torch.Tensor,
    windows: torch.Tensor,
    first_pos: int,
    ratio: int,
    overlap: bool,
    width: int,
) -> torch.Tensor:
    """Softmax-gated pooling of windows `windows`; kv/gate rows are positions first_pos.. ."""
    own = windows[:, None] * ratio + torch.arange(ratio, device=kv.device)[None, :] - first_pos
    return pool_gated_windows(kv.__getitem__, gate.__getitem__, own, windows > 0, ape, ratio, overlap, width)


def padded_ngrams(tokens: torch.Tensor, pad_id: int) -> torch.Tensor:
    """n-gram tokens [q, N] (shift-major) with `pad_id` from each row's first DEAD (-1) column on: an n-gram
    that reaches before its sequence's start is padded from there (`KernelOps.ngram_hash`)."""
    dead = torch.cummax((tokens == -1).to(torch.int64), dim=1).values.bool()
    return tokens.masked_fill(dead, pad_id)


def pool_gated_windows(
    kv_at: Callable[[torch.Tensor], torch.Tensor],
    gate_at: Callable[[torch.Tensor], torch.Tensor],
    own: torch.Tensor,
    has_prev: torch.Tensor,
    ape: torch.Tensor,
    ratio: int,
    overlap: bool,
    width: int,
) -> torch.Tensor:
    """The compressor's pooling of W windows (see `KernelOps.compress_kv`). `own` [W, ratio] indexes each
    window's tokens and `kv_at` / `gate_at` gather their raw projections [W, ratio, P] at such indices
    (an index minus `ratio` is the same slot of the previous window); has_prev [W]: the window has one."""
    if not overlap:
        slots_kv, slots_gate = kv_at(own), gate_at(own) + ape
    else:
        prev = (own - ratio).clamp(min=0)
        has_prev = has_prev[:, None, None]
        prev_gate = torch.where(has_prev, gate_at(prev)[..., :width] + ape[:, :width], float("-inf"))
        prev_kv = torch.where(has_prev, kv_at(prev)[..., :width], 0.0)
        slots_kv = torch.cat([prev_kv, kv_at(own)[..., width:]], dim=1)
        slots_gate = torch.cat([prev_gate, gate_at(own)[..., width:] + ape[:, width:]], dim=1)
    probs = torch.softmax(slots_gate.float(), dim=1).to(slots_kv.dtype)
    return (slots_kv * probs).sum(dim=1)


_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _ceil_log2(t: torch.Tensor) -> torch.Tensor:
    """int32 ceil(log2(t)) of positive normal float32 t, from the bits: exponent - 127, +1 if mantissa != 0."""
    bits = t.float().contiguous().view(torch.int32)
    return ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)


# The e2m1 tables are made once per device: a decode step captured in a device graph may not copy from the host.
@cache
def _e2m1_values(device: torch.device) -> torch.Tensor:
    return torch.tensor(_E2M1_VALUES, dtype=torch.float32, device=device)


@cache
def _e2m1_thresholds(device: torch.device) -> torch.Tensor:
    """|q| >= threshold[i] moves the e2m1 code past i; ties round to the even code (MODEL_SPEC_V41 §5)."""
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32, device=device)
    tie_up = torch.tensor([False, True, False, True, False, True, False], device=device)
    return torch.where(tie_up, midpoints, torch.nextafter(midpoints, torch.full_like(midpoints, float("inf"))))
