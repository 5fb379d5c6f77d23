#!/usr/bin/env bash
# How docs/mlflow_ui_compare.png was made: two default runs, `mlflow ui` on 127.0.0.1, headless Chromium.
#   apt-get install chromium        (Debian; any Chromium or Chrome works)
#   bash docs/ui_screenshot.sh
set -euo pipefail
cd "$(dirname "$0")/.."
store=$(mktemp -d)
export MLFLOW_TRACKING_URI="sqlite:///$store/mlflow.db"
for lr in 2e-3 6e-3; do
  .venv/bin/accelerate launch --config_file accelerate_configs/cpu.yaml recipes/pretrain_clm.py \
    --config recipes/configs/pretrain_clm.yaml --output_dir "$store/lr$lr" --learning_rate "$lr" \
    --run_name "lr$lr" --experiment_name readme
done
.venv/bin/python -m infra.compare --experiment readme --output docs/compare_readme.png
.venv/bin/mlflow ui --backend-store-uri "$MLFLOW_TRACKING_URI" --host 127.0.0.1 --port 5055 --workers 1 &
ui=$!
trap 'kill $ui' EXIT
until curl -sf http://127.0.0.1:5055/health >/dev/null; do sleep 1; done
experiment=$(.venv/bin/python -c "import mlflow; print(mlflow.MlflowClient().get_experiment_by_name('readme').experiment_id)")
chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1800,1500 --virtual-time-budget=60000 \
  --screenshot="$store/ui.png" "http://127.0.0.1:5055/#/experiments/$experiment/runs?compareRunsMode=CHART"
.venv/bin/python -c "from PIL import Image; Image.open('$store/ui.png').crop((0, 0, 1335, 1500)).save('docs/mlflow_ui_compare.png', optimize=True)"
