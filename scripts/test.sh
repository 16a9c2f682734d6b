#!/usr/bin/env bash
# Every check CI runs, in order, each as its own step; the first that fails stops the script.
#   bash scripts/test.sh    # from any folder, in an active Python environment
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*"; }

step "install: fedpipe with the test, lint and docs tools"
bash scripts/setup.sh test,lint,docs

PATHS=(fedpipe tests benchmarks examples scripts)
step "ruff check"
ruff check "${PATHS[@]}"
step "ruff format --check"
ruff format --check "${PATHS[@]}"
step "mypy fedpipe"
mypy fedpipe
step "lint-imports (the layer contracts in pyproject.toml)"
lint-imports
step "mkdocs build --strict"
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
NO_MKDOCS_2_WARNING=1 mkdocs build --strict --site-dir "$site"
step "README's result matches its bench record"
python scripts/render_bench_docs.py --check-readme
step "pytest"
python -m pytest -q
