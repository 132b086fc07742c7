"""Compile every Triton kernel of `deepinfer_kernels` for sm_90 and sm_100 without a GPU (ptxas ships
with triton), at the block shapes the ops launch, and report shared memory, whether the matrix products
became wgmma (Hopper) and whether anything spilled to local memory. Proves the SM100 path compiles.

python3 scripts/compile_kernels.py        (exit status 1 if any kernel fails to compile)
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "kernels")]

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.compiler import compile as triton_compile  # noqa: E402

from deepinfer_kernels import fused_moe, linear, rms_norm, sparse_attention  # noqa: E402

WEIGHT_TYPES = {0: "*bf16", 1: "*fp8e4nv", 2: "*u8"}


def _variants():
    yield "rms_norm", rms_norm._rms_norm_kernel, dict(
        x_ptr="*bf16", w_ptr="*fp32", y_ptr="*bf16", stride_x="i32", stride_y="i32", D="i32", eps="fp32",
    ), dict(HAS_WEIGHT=True, BLOCK=4096), 8
    for fmt, wt in WEIGHT_TYPES.items():
        scale = dict(FORMAT=fmt, SCALE_BN=128 if fmt == 1 else 1, SCALE_BK=128 if fmt == 1 else 1, IEEE=False)
        block_k = 128 if fmt == 1 else 64
        yield f"linear[{wt[1:]}]", linear._linear_kernel, dict(
            x_ptr="*bf16", w_ptr=wt, s_ptr="*u8", y_ptr="*bf16", M="i32", N="i32", K="i32",
            stride_xm="i32", stride_wn="i32", stride_sn="i32", stride_ym="i32",
        ), dict(scale, BLOCK_M=128, BLOCK_N=128, BLOCK_K=block_k), 8
        moe_blocks = dict(scale, BLOCK_M=64, BLOCK_N=64, BLOCK_K=block_k)
        yield f"moe_gate_up[{wt[1:]}]", fused_moe._gate_up_kernel, dict(
            x_ptr="*bf16", w1_ptr=wt, w3_ptr=wt, s1_ptr="*u8", s3_ptr="*u8", act_ptr="*bf16", row_entry_ptr="*i32",
            block_expert_ptr="*i32", N="i32", K="i32", TOP_K="i32", NUM_HELD="i32", limit="fp32", stride_xm="i32",
            stride_we="i64", stride_wn="i32", stride_se="i32", stride_sn="i32", stride_am="i32",
        ), moe_blocks, 4
        yield f"moe_down[{wt[1:]}]", fused_moe._down_kernel, dict(
            act_ptr="*bf16", w2_ptr=wt, s2_ptr="*u8", y_ptr="*bf16", route_w_ptr="*fp32", row_entry_ptr="*i32",
            block_expert_ptr="*i32", N="i32", K="i32", NUM_HELD="i32", stride_am="i32", stride_we="i64",
            stride_wn="i32", stride_se="i32", stride_sn="i32", stride_ym="i32",
        ), moe_blocks, 4
    names = ("q_ptr kv_ptr window_ptr sinks_ptr entries_ptr selected_ptr out_ptr token_seq_ptr query_start_ptr "
             "context_lens_ptr slot_ids_ptr block_tables_ptr positions_ptr").split()
    types = dict(zip(names, "*bf16 *bf16 *bf16 *fp32 *bf16 *i64 *bf16 *i32 *i32 *i32 *i32 *i32 *i64".split()))
    types.update({n: "i32" for n in "H D RING ratio per_block top_k".split()}, scale="fp32")
    types.update({n: "i32" for n in sparse_attention._sparse_attention_kernel.arg_names if n.startswith("stride_")})
    for layer, entries, selected in (("sliding", False, False), ("hca", True, False), ("csa", True, True)):
        yield f"sparse_attention[{layer}]", sparse_attention._sparse_attention_kernel, types, dict(
            HAS_ENTRIES=entries, HAS_SELECTED=selected, ROUND=True, IEEE=False, BLOCK_H=16, BLOCK_N=32, BLOCK_D=512,
        ), 4


def main() -> None:
    failed = 0
    for capability in (90, 100):
        target = GPUTarget("cuda", capability, 32)
        for name, fn, types, consts, warps in _variants():
            signature = {n: "constexpr" if n in consts else types[n] for n in fn.arg_names}
            source = ASTSource(fn=fn, signature=signature,
                               constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
            try:
                kernel = triton_compile(source, target=target, options={"num_warps": warps, "num_stages": 3})
            except Exception as err:  # report every kernel, not only the first failure
                failed += 1
                print(f"FAIL sm_{capability} {name}: {type(err).__name__}: {str(err)[:2000]}")
                continue
            ptx = kernel.asm.get("ptx", "")
            print(f"ok   sm_{capability} {name:<28} shared {kernel.metadata.shared:>6} B  "
                  f"wgmma {len(re.findall('wgmma.mma_async', ptx)):>3}  mma.sync {len(re.findall('mma.sync', ptx)):>3}  "
                  f"local ld/st {len(re.findall(r'(ld|st)[.]local', ptx)):>3}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
