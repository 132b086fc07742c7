#!/usr/bin/env bash
# Build DeepInfer's four wheels into dist/ and install deepinfer[$DEEPINFER_ACCELERATOR] from them.
#
#   DEEPINFER_ACCELERATOR=cpu|nvidia|ascend ./build.sh [--dev]
#
# --dev  also installs the `dev` extra (pytest...) and installs the four distributions editable,
#        so the tests and the `deepinfer` command run the source tree (the code the wheels hold).
#
# Checks the platform's prerequisites first and says what is missing. Downloads nothing but
# packages from the package index. Installs into the active Python environment.
set -euo pipefail

cd "$(dirname "$0")"
PYTHON=${PYTHON:-python}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
TORCH_VERSION=2.13.0
CUDA13_TORCH="pip install torch --index-url https://download.pytorch.org/whl/cu130"

die() { echo "build.sh: error: $*" >&2; exit 1; }
info() { echo "build.sh: $*"; }

DEV=0
for arg in "$@"; do
    case "$arg" in
        --dev) DEV=1 ;;
        -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
        *) die "unknown option '$arg' (expected --dev)" ;;
    esac
done

ACCELERATOR=${DEEPINFER_ACCELERATOR:-}
case "$ACCELERATOR" in
    cpu|nvidia|ascend) ;;
    "") die "set DEEPINFER_ACCELERATOR to cpu, nvidia or ascend, e.g. DEEPINFER_ACCELERATOR=cpu ./build.sh" ;;
    *) die "DEEPINFER_ACCELERATOR=$ACCELERATOR: build.sh installs cpu, nvidia or ascend (a third-party backend installs with its own package)" ;;
esac

"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
    || die "Python 3.10 or newer is required; found $("$PYTHON" -V 2>&1) at $(command -v "$PYTHON")"
info "Python: $("$PYTHON" -V 2>&1)"

torch_attr() { "$PYTHON" -c "import torch; print($1)" 2>/dev/null; }

have_torch() { "$PYTHON" -c 'import torch' >/dev/null 2>&1; }

check_nvidia() {
    have_torch || die "no torch is installed: install a CUDA 13 build of torch first ($CUDA13_TORCH)"
    local torch_cuda
    torch_cuda=$(torch_attr 'torch.version.cuda or ""')
    if [ -z "$torch_cuda" ] || [ "${torch_cuda%%.*}" -lt 13 ]; then
        local nvcc_note=""
        if command -v nvcc >/dev/null 2>&1; then
            nvcc_note=" (a CUDA toolkit is installed, but the backend runs on torch's own CUDA runtime)"
        fi
        local found="a CPU-only build"
        [ -n "$torch_cuda" ] && found="built for CUDA $torch_cuda"
        die "torch $(torch_attr 'torch.__version__') is $found; the nvidia backend needs a torch built for CUDA 13${nvcc_note}: $CUDA13_TORCH"
    fi
    info "torch $(torch_attr 'torch.__version__'), built for CUDA $torch_cuda"
    if command -v nvcc >/dev/null 2>&1; then
        info "CUDA toolkit: $(nvcc --version | grep -o 'release [0-9.]*')"
    fi
    command -v nvidia-smi >/dev/null 2>&1 || die "nvidia-smi not found: install the NVIDIA driver (R580 or newer for CUDA 13)"
    local gpus
    gpus=$(nvidia-smi -L 2>/dev/null || true)
    [ -n "$gpus" ] || die "nvidia-smi lists no GPU: check the driver and CUDA_VISIBLE_DEVICES"
    info "GPUs: $(echo "$gpus" | head -n 1)$( [ "$(echo "$gpus" | wc -l)" -gt 1 ] && echo " (+$(( $(echo "$gpus" | wc -l) - 1 )) more)")"
    # Triton compiles a small C launcher for its kernels at run time.
    command -v gcc >/dev/null 2>&1 || die "gcc not found: Triton needs a C compiler at run time (apt-get install gcc)"
    info "GCC: $(gcc -dumpfullversion)"
}

cann_version() {
    local file
    for file in "$ASCEND_TOOLKIT_HOME"/*/ascend_toolkit_install.info "$ASCEND_TOOLKIT_HOME"/compiler/version.info; do
        if [ -f "$file" ]; then
            grep -i -m 1 -o '^version=[0-9A-Za-z.]*' "$file" | cut -d= -f2
            return
        fi
    done
}

check_ascend() {
    [ -n "${ASCEND_TOOLKIT_HOME:-}" ] && [ -d "$ASCEND_TOOLKIT_HOME" ] \
        || die "the CANN environment is not set (ASCEND_TOOLKIT_HOME): install CANN 9.2 and run 'source /usr/local/Ascend/ascend-toolkit/set_env.sh'"
    local version
    version=$(cann_version)
    [ -n "$version" ] || die "cannot read the CANN version under $ASCEND_TOOLKIT_HOME: install CANN 9.2"
    case "$version" in
        9.2*|9.[3-9]*|[1-9][0-9].*) info "CANN $version" ;;
        *) die "CANN $version found under $ASCEND_TOOLKIT_HOME; the ascend backend needs CANN 9.2" ;;
    esac
    # torch_npu X.Y.Z is built against torch X.Y.Z: another torch fails at import or at the first op.
    local torch_version="" npu_version
    have_torch && torch_version=$(torch_attr 'torch.__version__.split("+")[0]')
    if npu_version=$("$PYTHON" -c 'import torch_npu; print(torch_npu.__version__)' 2>/dev/null | tail -n 1); then
        # torch_npu versions are torch's X.Y.Z, optionally followed by .postN or rcN.
        case "$npu_version" in
            "$torch_version"|"$torch_version".post*|"$torch_version"rc*) info "torch_npu $npu_version (torch $torch_version)" ;;
            *) die "torch_npu $npu_version does not match torch ${torch_version:-(not installed)}: install the pair of one release, e.g. pip install torch==$(echo "$npu_version" | grep -o '^[0-9]*\.[0-9]*\.[0-9]*') torch-npu==$npu_version" ;;
        esac
    elif [ -n "$torch_version" ]; then
        info "torch_npu is not installed: pip installs it with deepinfer[ascend]; it must be torch-npu==$torch_version (or a .postN of it) for torch $torch_version"
    else
        info "torch_npu is not installed: pip installs it with deepinfer[ascend]"
    fi
    command -v npu-smi >/dev/null 2>&1 \
        || die "npu-smi not found: install the Ascend NPU driver and firmware (they provide npu-smi), then check 'npu-smi info'"
    local npus
    npus=$(npu-smi info -l 2>/dev/null | grep -ci 'NPU ID' || true)
    [ "$npus" -gt 0 ] || die "npu-smi lists no NPU: check the driver with 'npu-smi info' and ASCEND_RT_VISIBLE_DEVICES"
    info "NPUs: $npus"
}

case "$ACCELERATOR" in
    nvidia) check_nvidia ;;
    ascend) check_ascend ;;
esac

if ! have_torch; then
    # A bare `torch` requirement would pull a multi-GB CUDA build: pin the release we test with.
    info "no torch installed: installing torch==$TORCH_VERSION"
    "$PYTHON" -m pip install "torch==$TORCH_VERSION"
fi
info "torch $(torch_attr 'torch.__version__')"

info "building wheels into dist/"
mkdir -p dist
rm -f dist/deepinfer-0.1.0-*.whl dist/deepinfer_kernels-0.1.0-*.whl \
      dist/deepinfer_nvidia-0.1.0-*.whl dist/deepinfer_ascend-0.1.0-*.whl
"$PYTHON" -m pip wheel --quiet --no-deps --wheel-dir dist ./ ./kernels ./backends/nvidia ./backends/ascend
ls dist/deepinfer*-0.1.0-*.whl

# Our wheels are installed by file name: PyPI carries an unrelated project named "deepinfer", so a
# bare name could resolve there instead of dist/.
CORE_WHEEL=$(ls dist/deepinfer-0.1.0-*.whl)
KERNELS_WHEEL=$(ls dist/deepinfer_kernels-0.1.0-*.whl)
EXTRAS=$ACCELERATOR
[ "$DEV" = 1 ] && EXTRAS="$ACCELERATOR,dev"
info "installing deepinfer[$EXTRAS] from dist/"
if [ "$DEV" = 1 ]; then
    # deepinfer-kernels brings Triton, whose interpreter runs the kernel tests without a GPU.
    "$PYTHON" -m pip install --find-links dist "$CORE_WHEEL[$EXTRAS]" "$KERNELS_WHEEL"
    # Editable, without dependencies: the nvidia and ascend packages are there so their checks are
    # tested (they explain why they are unavailable on a machine without their device).
    "$PYTHON" -m pip install --quiet --no-deps -e ./ -e ./kernels -e ./backends/nvidia -e ./backends/ascend
else
    "$PYTHON" -m pip install --find-links dist "$CORE_WHEEL[$EXTRAS]"
    # Same version number as an earlier build: reinstall our own wheels so the new code lands.
    OWN=("$CORE_WHEEL")
    case "$ACCELERATOR" in
        nvidia) OWN+=(dist/deepinfer_nvidia-0.1.0-*.whl "$KERNELS_WHEEL") ;;
        ascend) OWN+=(dist/deepinfer_ascend-0.1.0-*.whl) ;;
    esac
    "$PYTHON" -m pip install --quiet --no-deps --force-reinstall "${OWN[@]}"
fi
info "done: run 'deepinfer backends' to see the installed backends"
