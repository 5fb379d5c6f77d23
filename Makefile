# Training recipes: `make train` then `make test` on a fresh machine; `make help` for the rest.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

RECIPE ?= pretrain_clm
RUN_CONFIG ?= recipes/configs/pretrain_tiny.yaml
# The launcher config: DDP on every GPU when there is one, else 2 CPU processes.
ACCEL_CONFIG ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo accelerate_configs/ddp.yaml || echo accelerate_configs/cpu.yaml)
ARGS ?=
PORT ?= 5000
EXPERIMENT ?= pretrain_clm
MLFLOW_DB := sqlite:///$(CURDIR)/mlflow.db

.DEFAULT_GOAL := help
.PHONY: help setup data train doctor test test-all ui compare plan bench lint format clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

setup: $(STAMP)  ## create .venv with the pinned requirements and infra installed (editable)

$(STAMP): requirements.txt pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -r requirements.txt
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $@

data: setup  ## tokenize and pack the default corpus (the Python standard library) into data/stdlib
	$(BIN)/python -m infra.data.prepare --output_dir data/stdlib --num_proc 2

train: data  ## pretrain the default model (RECIPE=, RUN_CONFIG=, ACCEL_CONFIG=, ARGS= to change)
	$(BIN)/accelerate launch --config_file $(ACCEL_CONFIG) recipes/$(RECIPE).py --config $(RUN_CONFIG) $(ARGS)

doctor: data  ## preflight of the train job without training: devices, a collective, data checksums, a checkpoint round trip, disk, MLflow
	$(BIN)/accelerate launch --config_file $(ACCEL_CONFIG) recipes/$(RECIPE).py --config $(RUN_CONFIG) --preflight_only true $(ARGS)

test: setup  ## run the test suite (multi-process tests included, slow ones not)
	$(BIN)/python -m pytest -m "not slow"

test-all: setup  ## run every test, slow ones too
	$(BIN)/python -m pytest

ui: setup  ## serve the MLflow UI for this repository's runs on http://127.0.0.1:5000 (PORT= to change)
	$(BIN)/mlflow ui --backend-store-uri $(MLFLOW_DB) --default-artifact-root $(CURDIR)/mlruns --host 127.0.0.1 --port $(PORT)

compare: setup  ## table of an experiment's runs and a PNG of their loss curves (EXPERIMENT=pretrain_clm)
	MLFLOW_TRACKING_URI=$(MLFLOW_DB) $(BIN)/python -m infra.compare --experiment $(EXPERIMENT) --output runs/compare_$(EXPERIMENT).png

plan: setup  ## capacity and checkpoint-interval plan (ARGS="--gpus 64 --per_gpu_batch 32 --step_seconds 1.2 --checkpoint_minutes 2 --simulate")
	$(BIN)/python -m infra.plan $(ARGS)

bench: data  ## benchmarks, as ratios to anchors measured in the same run (data, checkpoints, recipe overhead)
	$(BIN)/python benchmarks/data_pipeline.py
	$(BIN)/python benchmarks/checkpoint_cost.py
	$(BIN)/python benchmarks/recipe_overhead.py

lint: setup  ## ruff: lint and format check over the whole tree
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup  ## ruff: fix what can be fixed and format the tree
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:  ## remove runs, prepared data and the local MLflow store (not .venv)
	rm -rf runs data mlflow.db mlruns
