#!/usr/bin/env bash
# The first thing to run on real Ascend hardware (CANN 9.2, torch_npu): conformance of every op on
# the NPU, the tiny checkpoint end to end against the cpu backend, each fused operator timed against
# its reference, and a small prefill/decode run with the engine's diagnostics — all into one report.
#
#   source /usr/local/Ascend/ascend-toolkit/set_env.sh
#   DEEPINFER_ACCELERATOR=ascend ./build.sh --dev && scripts/ascend_smoke.sh [REPORT]
#
# Nothing of the ascend backend has run on Ascend hardware before this script.
set -uo pipefail
cd "$(dirname "$0")/.."
report=${1:-ascend_report.txt}
export DEEPINFER_ACCELERATOR=ascend
status=0
{
    echo "== deepinfer backends"; deepinfer backends
    echo "== deepinfer check-backend ascend"; deepinfer check-backend ascend
} > "$report" 2>&1 || status=1
python scripts/check_ascend.py --report "$report.check" || status=1
cat "$report.check" >> "$report" && rm -f "$report.check"
tiny=$(mktemp -d)/tiny
deepinfer make-tiny-checkpoint "$tiny" >> "$report" 2>&1 || status=1
for dtype in float32 bfloat16; do
    echo "== prefill/decode on the tiny checkpoint, $dtype" >> "$report"
    python examples/offline_inference.py --model_name "$tiny" --dtype "$dtype" --max_tokens 64 >> "$report" 2>&1 || status=1
done
echo "ascend_smoke: wrote $report (exit $status)"
exit "$status"
