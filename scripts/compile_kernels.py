"""Compile the heaviest Triton kernels of `deepinfer_kernels` for sm_90 and sm_100 (and Hopper's Gluon attention
for sm_90) without a GPU (ptxas and nvdisasm ship with triton), at the block shapes the ops launch, and report
per kernel: shared memory, registers and spills (ptxas -v), the matrix instructions in the machine code
(HGMMA / QGMMA are Hopper's bf16 / fp8 wgmma, HMMA the older mma.sync, UTC*MMA SM100's tcgen05), and the spill
loads and stores inside the loops that issue them (the K or key-block loops: a spill there costs every iteration,
elsewhere once).
Proves the SM100 path compiles; tells, before any GPU time is spent, whether a change spilled or asks for more
shared memory than a block may have (a failure: that launch would fail).

Integer arguments and pointers are declared 16-divisible, as the JIT specialises them at the real shapes
(without that, no load is vectorised and the report describes another kernel).

python3 scripts/compile_kernels.py [--only NAME]     (exit status 1 if any kernel fails to compile)

--recorded FILE compiles instead the variants in FILE, a JSON list of the launches Triton's interpreter made
(`tests/kernel_launches.py`, each with the JIT's specialisation of its arguments): the interpreter runs code
that the compiler refuses, so that every variant the CPU tests launch is also compiled (tests/test_kernels_compile.py).
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "kernels")]

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.compiler import compile as triton_compile  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402  (what gluon.jit compiles through)

from deepinfer_kernels import (  # noqa: E402
    fused_moe,
    hyper_connection,
    linear,
    rms_norm,
    sparse_attention,
    sparse_attention_wgmma,
    top_entries,
)

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
# shared memory a block may use on sm_90 and sm_100 alike (CUDA's per-block opt-in limit): past it the launch fails
SHARED_LIMIT = 227 * 1024
WEIGHT_TYPES = {0: "*bf16", 1: "*fp8e4nv", 2: "*i32"}  # fp4: int32 words of eight codes
FLOAT_SCALARS = {"scale", "q_eps", "eps", "limit"}
NOT_DIVISIBLE = {"ratio", "TOP_K", "SPLITS", "FN_ROWS"}  # small or odd at the real shapes
HOPPER_ONLY = {sparse_attention_wgmma._wgmma_attention_kernel}  # wgmma: SM100 runs the Triton kernel instead


def _types(fn, pointers: dict[str, str], default_pointer: str = "*bf16") -> dict[str, str]:
    """Each argument's type: pointers from `pointers` (else the default), floats by name, else i32."""
    types = {}
    for name in fn.arg_names:
        if name.endswith("_ptr"):
            types[name] = pointers.get(name, default_pointer)
        else:
            types[name] = "fp32" if name in FLOAT_SCALARS else "i32"
    return types


def _variants() -> Iterator[tuple[str, object, dict, dict, int, int]]:
    """(name, kernel, argument types, constexprs, warps, stages) at the ops' prefill tiles."""
    for fmt, weight in WEIGHT_TYPES.items():
        scale = dict(FORMAT=fmt, SCALE_BN=128 if fmt == 1 else 1, SCALE_BK=128 if fmt == 1 else 1, IEEE=False)
        a8 = fmt == 1
        block_m, block_n, block_k, warps, stages = fused_moe.tile_config(8192, fmt, False)
        byte_scales = {n: "*u8" for n in ("s_ptr", "s1_ptr", "s3_ptr", "ss1_ptr", "ss3_ptr", "s2_ptr", "ss2_ptr")}
        activations = "*fp8e4nv" if a8 else "*bf16"
        linear_pointers = {"x_ptr": activations, "xs_ptr": "*fp32", "w_ptr": weight, "part_ptr": "*fp32",
                           "counter_ptr": "*i32", "ys_ptr": "*fp32", **byte_scales}
        tile = dict(scale, A8=a8, VALUES="bfloat16", QUANT_OUT=False, BLOCK_M=128, BLOCK_N=128,
                    BLOCK_K=128 if fmt == 1 else 64)
        yield f"linear[{weight[1:]}{'-a8' if a8 else ''}]", linear._linear_kernel, \
            _types(linear._linear_kernel, linear_pointers), tile, 8, 3
        if a8:  # W8A8's grouped wo_a storing wo_b's fp8 codes (`linear.quantizes_in_epilogue`)
            yield f"linear[{weight[1:]}-a8, fp8 out]", linear._linear_kernel, \
                _types(linear._linear_kernel, dict(linear_pointers, y_ptr="*fp8e4nv")), dict(tile, QUANT_OUT=True), 8, 3
        # the MoE's fp4 stacks decode with one product (every real checkpoint's scales are at most 2); at
        # prefill sizes the fp4 checkpoints' fp8 shared expert runs apart (`fused_moe.shared_fusable`)
        moe_format = fused_moe.FP4_SMALL_SCALES if fmt == 2 else fmt
        tma = fused_moe.weights_through_tma(moe_format, block_m, ieee=False)  # weights: TMA descriptors
        moe = dict(scale, FORMAT=moe_format, A8=a8, SHARED=fmt != 2, SHARED_FORMAT=moe_format,
                   SHARED_SCALE_BN=scale["SCALE_BN"], SHARED_SCALE_BK=scale["SCALE_BK"], SHARED_BLOCK_K=block_k,
                   BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                   HALF_TAILS=fused_moe.half_tails(block_m, False), PRESCALED=False,
                   ROW_GROUP=fused_moe.row_group(moe_format, block_m), TMA=tma)
        moe_pointers = {"x_ptr": activations, "act_ptr": "*bf16", "xs_ptr": "*fp32", "as_ptr": "*fp32",
                        "row_entry_ptr": "*i32", "blocks_ptr": "*i32", "route_w_ptr": "*fp32", **byte_scales}

        def weight_arg(rows: int) -> str:  # a weight pointer, or with TMA a descriptor of rows x block_k tiles
            return f"tensordesc<{weight[1:]}[{rows}, {block_k}]>" if tma else weight

        moe_pointers.update({n: weight_arg(block_n) for n in ("w1_ptr", "w3_ptr", "sw1_ptr", "sw3_ptr")})
        # W8A8's gate/up launch stores the activation's fp8 codes (`fused_moe.act_quantized_in_gate_up`)
        quant_act = fused_moe.act_quantized_in_gate_up(a8, block_n, block_k)
        gate_up_pointers = dict(moe_pointers, act_ptr="*fp8e4nv" if quant_act else "*bf16")
        yield f"moe_gate_up[{weight[1:]}]", fused_moe._gate_up_kernel, \
            _types(fused_moe._gate_up_kernel, gate_up_pointers), dict(moe, ACT_DTYPE="bfloat16", QUANT_ACT=quant_act), \
            warps, stages
        down_n = fused_moe.down_columns(moe_format, block_m, block_n)
        down = dict(moe_pointers, act_ptr=activations, counter_ptr="*i32", w2_ptr=weight_arg(down_n),
                    sw2_ptr=weight_arg(down_n))
        yield f"moe_down[{weight[1:]}]", fused_moe._down_kernel, _types(fused_moe._down_kernel, down), \
            dict(moe, BLOCK_N=down_n, SUM_SLOTS=0), warps, stages
    # one row of x and an fp8 weight on CUDA cores (`linear.one_row_tiles`)
    block_m, block_n, block_k, warps, stages, _ = linear.tile_config(1, 1, one_row=True)
    yield "linear[fp8e4nv, one row]", linear._linear_kernel, _types(linear._linear_kernel, {
        "w_ptr": WEIGHT_TYPES[1], "xs_ptr": "*fp32", "ys_ptr": "*fp32", "part_ptr": "*fp32", "counter_ptr": "*i32",
        "s_ptr": "*u8"}), dict(FORMAT=1, SCALE_BN=128, SCALE_BK=128, IEEE=False, A8=False, VALUES="bfloat16",
                               QUANT_OUT=False, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k), warps, stages
    # decode-sized fp4 steps: the fp8 shared expert in its own K loop of the same launches
    block_m, block_n, block_k, warps, stages = fused_moe.tile_config(448, 2, False)
    decode_format = fused_moe.fp4_kernel_format(block_m)
    moe = dict(FORMAT=decode_format, SCALE_BN=1, SCALE_BK=1, IEEE=False, A8=False, SHARED=True,
               SHARED_FORMAT=1, SHARED_SCALE_BN=128, SHARED_SCALE_BK=128, SHARED_BLOCK_K=min(block_k, 128),
               BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
               HALF_TAILS=fused_moe.half_tails(block_m, False), PRESCALED=False,
               ROW_GROUP=fused_moe.row_group(decode_format, block_m), TMA=False)
    mixed = {"x_ptr": "*bf16", "act_ptr": "*bf16", "xs_ptr": "*fp32", "as_ptr": "*fp32", "row_entry_ptr": "*i32",
             "blocks_ptr": "*i32", "route_w_ptr": "*fp32", **byte_scales,
             **{n: WEIGHT_TYPES[2] for n in ("w1_ptr", "w3_ptr", "w2_ptr")},
             **{n: WEIGHT_TYPES[1] for n in ("sw1_ptr", "sw3_ptr", "sw2_ptr")}}
    gate_up, down = fused_moe._gate_up_kernel, fused_moe._down_kernel
    registers = fused_moe.gate_up_registers(moe["FORMAT"], 1)  # (a launch option: `_compile` takes it out)
    yield ("moe_gate_up[i32+fp8 shared, decode]", gate_up, _types(gate_up, mixed),
           dict(moe, ACT_DTYPE="bfloat16", QUANT_ACT=False, maxnreg=registers), warps, stages)
    # a decode step sums each token's 7 slots in the down launch (`fused_moe.slot_sum_in_down_launch`)
    yield "moe_down[i32+fp8 shared, decode]", down, _types(down, dict(mixed, counter_ptr="*i32")), \
        dict(moe, SUM_SLOTS=7), warps, stages
    kernel = sparse_attention._sparse_attention_kernel
    attention_pointers = {"sinks_ptr": "*fp32", "part_ptr": "*fp32", "stats_ptr": "*fp32", "freq_ptr": "*fp32",
                          **{n: "*i32" for n in ("selected_ptr", "token_seq_ptr", "query_start_ptr", "context_lens_ptr",
                                                 "slot_ids_ptr", "block_tables_ptr", "positions_ptr",
                                                 "window_starts_ptr")}}
    for tokens in (8192, 64):
        block_h, block_n, warps, stages = sparse_attention.tile_config(tokens, 512, torch.bfloat16, False)
        for layer, entries, selected in (("sliding", False, False), ("hca", True, False), ("csa", True, True)):
            for rotary in (False, True):
                yield (f"{'rotary' if rotary else 'sparse'}_attention[{layer}, {tokens} tokens]", kernel,
                       _types(kernel, attention_pointers), dict(
                           HAS_ENTRIES=entries, HAS_SELECTED=selected, ROUND=True, IEEE=False, FIXED_KEY_BLOCKS=False,
                           HAS_WINDOW_STARTS=False, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=512, SPLITS=1,
                           ROTARY=rotary, Q_NORM=rotary), warps, stages)
    # Hopper's prefill attention in Gluon (wgmma: sm_90 only, `HOPPER_ONLY`)
    kernel = sparse_attention_wgmma._wgmma_attention_kernel
    for layer, entries, selected, per_block in (("sliding", False, False, 1), ("hca", True, False, 1),
                                                ("csa", True, True, 32)):
        # W8A8 (V4's 128-column blocks): the rotary output stored as fp8 codes (`quantizes_output`)
        for rotary, group in ((False, 0), (True, 0), (True, 128)):
            pointers = dict(attention_pointers, out_ptr="*fp8e4nv", scales_ptr="*fp32") if group else \
                attention_pointers
            yield (f"{'rotary' if rotary else 'sparse'}_attention_wgmma[{layer}{', fp8 out' if group else ''}]",
                   kernel, _types(kernel, pointers), dict(
                       HAS_ENTRIES=entries, HAS_SELECTED=selected, HAS_WINDOW_STARTS=False, RING=128,
                       PER_BLOCK=per_block, ROTARY=rotary, Q_NORM=rotary, ROPE_BLOCK=64, QUANT_GROUP=group,
                       num_warps=sparse_attention_wgmma.WARPS),  # (a Gluon kernel's parameter)
                   sparse_attention_wgmma.WARPS, 1)
    # the attention's latent norms (V4-Flash: q rank 1,024, KV 512 rotated in its last 64)
    kernel = rms_norm._latent_norms_kernel
    yield "latent_norms", kernel, _types(kernel, {"q_w_ptr": "*fp32", "kv_w_ptr": "*fp32", "pos_ptr": "*i64",
                                                  "freq_ptr": "*fp32"}), \
        dict(HALF=32, BLOCK_Q=1024, BLOCK_KV=512), 4, 1
    # the indexer's top-k of a prefill step (`top_entries`): rows of 2,048 / 8,192 entries held whole, longer ones
    # streamed (`select_tiles`), k 512 (V4-Flash)
    kernel = top_entries._select_kernel
    for width in (2048, 8192, 16384):
        block_w, warps = top_entries.select_tiles(width)
        yield (f"top_entries_select[{width} entries]", kernel,
               _types(kernel, {"scores_ptr": "*fp32", "out_ptr": "*i64"}), dict(BLOCK_W=block_w, BLOCK_K=512), warps, 1)
    yield from _hc_variants()


def _hc_variants() -> Iterator[tuple[str, object, dict, dict, int, int]]:
    """The mHC stream update alone and with the next site's partial sums, and those sums alone, at V4-Flash's
    n = 4, D = 4096 (fn's 24 rows padded to 32) with bf16 streams, at decode and prefill tiles (the update's prefill
    tile loading fn's bf16 pieces, `hyper_connection.fn_pieces`, as it does at prefill sizes)."""
    n, stages = 4, 3  # stages: the launches leave Triton's default
    floats = {name: "*fp32" for name in ("post_ptr", "comb_ptr", "fn_ptr", "part_ptr")}
    update = hyper_connection._hc_update_kernel
    for round_terms in (True, False):  # `hc_update`'s 1024 columns a program and default 4 warps
        yield f"hc_update[{_hc_model(round_terms)}]", update, _types(update, floats), \
            dict(N=n, ROUND_TERMS=round_terms, BLOCK_D=1024), 4, stages
    fnp, width = 32, 33
    update_mix, mix = hyper_connection._hc_update_mix_partial_kernel, hyper_connection._hc_mix_partial_kernel
    for kind, tokens in (("decode", 1), ("prefill", 8192)):
        chunk, block_k, block_t, warps = hyper_connection.tile_config(tokens, False)
        yield f"hc_mix_partial[{kind}]", mix, _types(mix, floats), dict(
            FNP=fnp, WIDTH=width, CHUNK=chunk, BLOCK_T=block_t, BLOCK_K=block_k, SPLIT_BF16=True), warps, stages
        columns, block_d, block_t, warps = hyper_connection.update_mix_tiles(tokens, n, False)
        tiles = dict(N=n, FNP=fnp, WIDTH=width, COLUMNS=columns, BLOCK_T=block_t, BLOCK_D=block_d, SPLIT_BF16=True,
                     PIECES=hyper_connection.takes_fn_pieces(tokens, torch.bfloat16, False))
        yield f"hc_update_mix_partial[{kind}]", update_mix, _types(update_mix, floats), tiles, warps, stages


def _hc_model(round_terms: bool) -> str:
    """The model whose stream update rounds each term (V4's `hc_post`) or only the sum (V4.1's `hc_expand`)."""
    return "V4" if round_terms else "V4.1"


MMA = r"\b(HGMMA|QGMMA|HMMA|UTC\w*MMA)\b"


def _loop_spills(sass: str) -> int:
    """Spill loads and stores (LDL / STL) in loops (a backward branch back to its target) that issue matrix
    instructions; other loops (e.g. the slow path of sin / cos for huge angles) run rarely."""
    instructions, labels = [], {}
    for line in sass.splitlines():
        if label := re.match(r"\s*(\.L_x_\d+):", line):
            labels[label.group(1)] = len(instructions)
        elif op := re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?);", line):
            instructions.append(op.group(1))
    spills = 0
    for i, text in enumerate(instructions):
        branch = re.search(r"BRA\s+`?\(?(\.L_x_\d+)", text)
        if branch and labels.get(branch.group(1), i + 1) <= i:
            body = instructions[labels[branch.group(1)]:i + 1]
            if any(re.search(MMA, t) for t in body):
                spills += sum(bool(re.search(r"\b(LDL|STL)\b", t)) for t in body)
    return spills


def _recorded_variants(path: str) -> Iterator[tuple[str, object, dict, dict, int, int, list[str]]]:
    """`_variants`' tuples, and the arguments the JIT found 16-divisible, of the launches recorded in `path`."""
    for number, launch in enumerate(json.loads(Path(path).read_text())):
        module, name = launch["kernel"].rsplit(":", 1)
        fn = getattr(importlib.import_module(module), name)
        consts = dict(launch["constexprs"], maxnreg=launch["maxnreg"])
        yield (f"{name} #{number}", fn, launch["types"], consts, launch["num_warps"], launch["num_stages"],
               launch["divisible"])


def _compile(fn, types, consts, warps, stages, capability, divisible=None) -> str:
    """ptxas' report on `fn` compiled with these constexprs and options, down to the machine code; `divisible`:
    the 16-divisible arguments (by default every integer and pointer but NOT_DIVISIBLE's, as at the real shapes),
    given for the recorded launches, whose toy shapes make no report worth reading: theirs is "compiled"."""
    consts = dict(consts, PDL=True)  # the GPU path: each kernel waits for the previous one (`dependent_launch`)
    registers = consts.pop("maxnreg", None)  # a launch option, not a constexpr
    signature = {n: "constexpr" if n in consts else types[n] for n in fn.arg_names}
    given_divisible = divisible is not None
    if not given_divisible:
        divisible = [n for n in fn.arg_names if n not in consts and n not in NOT_DIVISIBLE and types[n] != "fp32"]
    source_type = GluonASTSource if fn.is_gluon() else ASTSource
    source = source_type(fn=fn, signature=signature,
                         constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                         attrs={(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible})
    kernel = triton_compile(source, target=GPUTarget("cuda", capability, 32),
                            options={"num_warps": warps, "num_stages": stages, "maxnreg": registers})
    if kernel.metadata.shared > SHARED_LIMIT:
        raise ValueError(f"{kernel.metadata.shared} bytes of shared memory, past the {SHARED_LIMIT} a block may use")
    if given_divisible:
        return "compiled"  # (Triton's own ptxas run made the cubin)
    arch = "sm_90a" if capability == 90 else "sm_100a"
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        ptx.write_text(kernel.asm["ptx"])
        ptxas = BIN / ("ptxas" if capability == 90 else "ptxas-blackwell")
        report = subprocess.run([str(ptxas), "-v", f"--gpu-name={arch}", str(ptx), "-o", str(cubin)],
                                capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([str(BIN / "nvdisasm"), "-c", str(cubin)], capture_output=True, text=True).stdout
    registers = re.search(r"Used (\d+) registers", report)
    spill = re.search(r"(\d+) bytes spill stores", report)
    found = re.findall(MMA, sass)
    mma_text = " ".join(f"{op} {found.count(op)}" for op in sorted(set(found))) or "no MMA"
    return (f"shared {kernel.metadata.shared:>6} B  regs {registers.group(1) if registers else '?':>3}  "
            f"spill stores {spill.group(1) if spill else '?':>5} B  in MMA loops {_loop_spills(sass):>3}  {mma_text}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="compile only kernels whose name contains this")
    parser.add_argument("--capabilities", default="90,100")
    parser.add_argument("--recorded", help="compile the launches recorded in this JSON file instead")
    args = parser.parse_args()
    failed = 0
    for capability in map(int, args.capabilities.split(",")):
        variants = _recorded_variants(args.recorded) if args.recorded else ((*v, None) for v in _variants())
        for name, fn, types, consts, warps, stages, divisible in variants:
            if args.only not in name or (fn in HOPPER_ONLY and capability != 90):
                continue
            try:
                report = _compile(fn, types, consts, warps, stages, capability, divisible)
                print(f"ok   sm_{capability} {name:<40} {report}", flush=True)
            except Exception as err:  # noqa: BLE001  (report every kernel, not only the first failure)
                failed += 1
                print(f"FAIL sm_{capability} {name} {consts}: {type(err).__name__}: {str(err)[:2000]}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
