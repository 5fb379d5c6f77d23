# Training recipes: `make train` then `make test` on a fresh machine; `make help` for the rest.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

RECIPE ?= pretrain_clm
RECIPES := $(sort $(basename $(notdir $(wildcard recipes/*.py))))
ifeq ($(filter $(RECIPE),$(RECIPES)),)
$(error RECIPE=$(RECIPE) is not a recipe: expected one of $(RECIPES))
endif
RUN_CONFIG ?= recipes/configs/$(RECIPE).yaml
# The launcher config: DDP on every GPU when there is one, else 2 CPU processes.
ACCEL_CONFIG ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo accelerate_configs/ddp.yaml || echo accelerate_configs/cpu.yaml)
ARGS ?=
PORT ?= 5000
EXPERIMENT ?= $(RECIPE)
MLFLOW_DB := sqlite:///$(CURDIR)/mlflow.db

.DEFAULT_GOAL := help
.PHONY: help setup data train replicas doctor test test-matrix test-ci-slow test-slow test-all ui compare plan bench chaos gpu-check lint format clean

help:  ## list the targets and the recipes
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'
	@echo "recipes (make train RECIPE=<name>; each runs recipes/configs/<name>.yaml):"
	@for r in $(RECIPES); do printf "  %-24s %s\n" $$r "$$(sed -n 's/^\"\"\"\(.*\)/\1/p' recipes/$$r.py | head -1)"; done

setup: $(STAMP)  ## create .venv with the pinned requirements and infra installed (editable)

$(STAMP): requirements.txt pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -r requirements.txt
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $@

# What each recipe's default config needs before it starts: its prepared data (and for SFT the pretrained model, for DPO
# the SFT model).
NEEDS_pretrain_clm := data/stdlib/index.json
NEEDS_sft_clm := data/sft_stdlib/index.json runs/pretrain_tiny/final/model.safetensors
NEEDS_dpo_clm := data/dpo_stdlib/index.json runs/sft_clm/final/model.safetensors
NEEDS_finetune_classification := data/cls_stdlib/index.json
NEEDS_image_classification := data/digits/index.json

data: $(NEEDS_$(RECIPE))  ## prepare the default data of RECIPE (pretraining: the Python standard library, tokenized and packed)

data/stdlib/index.json: | $(STAMP)
	$(BIN)/python -m infra.data.prepare --output_dir data/stdlib --num_proc 2

data/sft_stdlib/index.json: data/stdlib/index.json
	$(BIN)/python -m infra.data.tasks --task sft --output_dir data/sft_stdlib --tokenizer data/stdlib/tokenizer

data/dpo_stdlib/index.json: data/stdlib/index.json
	$(BIN)/python -m infra.data.tasks --task dpo --output_dir data/dpo_stdlib --tokenizer data/stdlib/tokenizer

data/cls_stdlib/index.json: | $(STAMP)
	$(BIN)/python -m infra.data.tasks --task text_classification --output_dir data/cls_stdlib --seq_len 128

data/digits/index.json: | $(STAMP)
	$(BIN)/python -m infra.data.tasks --task image_classification --output_dir data/digits

runs/pretrain_tiny/final/model.safetensors: data/stdlib/index.json
	$(MAKE) train RECIPE=pretrain_clm RUN_CONFIG=recipes/configs/pretrain_clm.yaml ARGS=

runs/sft_clm/final/model.safetensors: data/sft_stdlib/index.json runs/pretrain_tiny/final/model.safetensors
	$(MAKE) train RECIPE=sft_clm RUN_CONFIG=recipes/configs/sft_clm.yaml ARGS=

train: setup data  ## train RECIPE (default pretrain_clm) with its config (RUN_CONFIG=, ACCEL_CONFIG=, ARGS= to change)
	$(BIN)/python -m infra.launch --config_file $(ACCEL_CONFIG) recipes/$(RECIPE).py --config $(RUN_CONFIG) $(ARGS)

GROUPS ?= 3
replicas: setup data  ## RECIPE as GROUPS replica groups and their lighthouse on this machine: kill one, start it again, training goes on (fault_tolerance: replicas)
	$(BIN)/python -m infra.replicas local --groups $(GROUPS) --recipe $(RECIPE) -- --config $(RUN_CONFIG) --global_batch_size 16 $(ARGS)

doctor: setup data  ## preflight of the train job without training: devices, a collective, data checksums, a checkpoint round trip, disk, MLflow
	$(BIN)/python -m infra.launch --config_file $(ACCEL_CONFIG) recipes/$(RECIPE).py --config $(RUN_CONFIG) --preflight_only true $(ARGS)

# The quick suite's tests in this many pytest processes, a file each at a time (its fixtures made once): a launch's
# start-up keeps one core of two busy, so two at a time finish sooner (measured: 9.4 -> 6.1 min on 2 cores)
TEST_WORKERS ?= 2
test: setup  ## run the test suite (multi-process tests included, slow ones not; TEST_WORKERS=1 for one at a time)
	$(BIN)/python -m pytest -m "not slow" --durations=25 $(if $(filter-out 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile)

test-matrix: setup  ## every pair of features in real runs (tests/test_matrix.py): print the array, then run it
	$(BIN)/python -m tests.test_matrix
	$(BIN)/python -m pytest -m matrix --durations=5

# Replica groups first: on a slow CPU CI's deadline (INFRA_TEST_DEADLINE) leaves the last ones unstarted
CI_FIRST := tests/test_replicas.py tests/test_dpo.py
test-ci-slow: setup  ## the slow tests CI runs after the matrix: faults over a network of namespaces, replica groups, SIGTERM, a tracking outage
	$(BIN)/python -m pytest -m "slow and ci" --durations=10 $(CI_FIRST)
	$(BIN)/python -m pytest -m "slow and ci" --durations=10 $(addprefix --ignore ,$(CI_FIRST))

test-slow: setup  ## run the slow tests but the matrix (ZeRO-3, FSDP2 and world-size phases, SLURM, restarts)
	$(BIN)/python -m pytest -m "slow and not matrix" --durations=10

test-all: setup  ## run every test, slow ones and the matrix too
	$(BIN)/python -m pytest

ui: setup  ## serve the MLflow UI for this repository's runs on http://127.0.0.1:5000 (PORT= to change)
	$(BIN)/mlflow ui --backend-store-uri $(MLFLOW_DB) --default-artifact-root $(CURDIR)/mlruns --host 127.0.0.1 --port $(PORT)

compare: setup  ## table of an experiment's runs and a PNG of their loss curves (EXPERIMENT=pretrain_clm)
	MLFLOW_TRACKING_URI=$(MLFLOW_DB) $(BIN)/python -m infra.compare --experiment $(EXPERIMENT) --output runs/compare_$(EXPERIMENT).png

plan: setup  ## capacity and checkpoint-interval plan (ARGS="--gpus 64 --per_gpu_batch 32 --step_seconds 1.2 --checkpoint_minutes 2 --simulate")
	$(BIN)/python -m infra.plan $(ARGS)

bench: data  ## benchmarks, as ratios to anchors measured in the same run (data, checkpoints, uploads, recipe overhead, packing, levers, bf16 against fp32, DDP's sum in rank order, a slow host, the copies' checks)
	$(BIN)/python benchmarks/data_pipeline.py
	$(BIN)/python benchmarks/checkpoint_cost.py
	$(BIN)/python benchmarks/checkpoint_remote.py
	$(BIN)/python benchmarks/recipe_overhead.py
	$(BIN)/python benchmarks/packing.py
	$(BIN)/python benchmarks/levers.py
	$(BIN)/python benchmarks/precision.py
	$(BIN)/python benchmarks/reduction.py
	$(BIN)/python benchmarks/stragglers.py --if_possible
	$(BIN)/python benchmarks/sdc.py

chaos: data  ## two hosts (network namespaces, root) under a fault every ~2 min for 15 min: measured goodput against the planner's (ARGS="--minutes 8")
	$(BIN)/python benchmarks/chaos.py $(ARGS)

gpu-check: setup  ## on a GPU machine: the 125m and 1b presets (compile, checkpointing), then every GPU config x every recipe: tokens/s, MFU (< 10 min)
	$(BIN)/python benchmarks/gpu_check.py $(ARGS)

lint: setup  ## ruff: lint and format check over the whole tree
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup  ## ruff: fix what can be fixed and format the tree
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:  ## remove runs, prepared data and the local MLflow store (not .venv)
	rm -rf runs data mlflow.db mlruns
