# Set-up and the commands. Every target creates .venv if it is missing and installs what it needs.
PYTHON ?= python3
VENV ?= .venv
# torch==2.13.0 installs the CPU build here; override for another build, e.g. TORCH_SPEC='torch==2.13.0+cu128'.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo bench-runtime tables bench-kernels bench-train bench-train-gpt-tiny bench-train-gpt-tiny-seeds bench-train-diloco bench-train-diloco-100mbit bench-train-diloco-gpt-tiny bench-train-torchft bench-train-fsdp bench-train-embed-lm bench-sparse bench-sim bench-fidelity bench-plan \
	bench-plan-train test test-all lint clean

# gpt-tiny on 4 ranks: plain DDP vs gradsync's default (int4) on the emulated 1 Gbit/s testbed (as
# root with iproute2; loopback with a warning otherwise). Prints the table and how much sooner
# gradsync reached DDP's held-out loss; plots go to runs/demo/.
demo: $(STAMP)
	$(BIN)/python -m gradsync demo

# The runtime benchmark behind README's table: a user's own DDP script (examples/train.py) run once
# per way of averaging gradients, 2 rounds in turn, on 4 testbed hosts at 1 Gbit/s and on loopback.
bench-runtime: $(STAMP)
	$(BIN)/python -m gradsync bench script --testbed --bandwidth 1gbit --repeats 2 --out docs/bench-runtime/1gbit
	$(BIN)/python -m gradsync bench script --loopback --repeats 2 --out docs/bench-runtime/loopback

# Rewrite every measured table in README.md and docs/ from the results file it comes from.
tables: $(STAMP)
	$(BIN)/python -m gradsync bench tables

# Time to DDP's held-out loss: mlp-wide (20.8M parameters) on 4 testbed hosts at 1 Gbit/s, DDP and
# torch's fp16 and PowerSGD (rank 4) hooks against gradsync's default (int4), int8, PowerSGD rank 4
# and 8 with error feedback, top-k 1% with momentum correction and plan="auto". About 90 minutes.
# (torch's bf16 hook refuses gloo: no CPU baseline.)
bench-train: $(STAMP)
	$(BIN)/python -m gradsync bench train --workload mlp-wide --world 4 --testbed \
		--strategies ddp,torch-fp16,torch-powersgd:rank=4,int4,int8,powersgd:rank=4,powersgd:rank=8,topk:ef=momentum,auto \
		--steps 400 --eval-every 25 --out docs/bench-train-mlp-wide

# The same for gpt-tiny (19.1M parameters, Adam): the default, the quality-preserving int8 and
# PowerSGD ranks 4 and 8, top-k with plain error feedback (momentum correction is for momentum SGD)
# and plan="auto", against DDP and torch's fp16 and PowerSGD (rank 4) hooks. About 40 minutes.
bench-train-gpt-tiny: $(STAMP)
	$(BIN)/python -m gradsync bench train --workload gpt-tiny --world 4 --testbed \
		--strategies ddp,torch-fp16,torch-powersgd:rank=4,int4,int8,powersgd:rank=4,powersgd:rank=8,topk,auto,auto:compressor=topk \
		--steps 200 --eval-every 25 --out docs/bench-train-gpt-tiny

# gpt-tiny's quality-preserving configurations under two more seeds (1 and 2; seed 0 is the run
# above), gathered with seed 0's: a step-200 comparison moves with the seed by more than one run's
# ± says (benchmarks.md). About 40 minutes.
SEEDS_STRATEGIES = ddp,int4,int8,powersgd:rank=4,powersgd:rank=8
bench-train-gpt-tiny-seeds: $(STAMP)
	for seed in 1 2; do \
		$(BIN)/python -m gradsync bench train --workload gpt-tiny --world 4 --testbed --seed $$seed \
			--strategies $(SEEDS_STRATEGIES) --steps 200 --eval-every 25 \
			--out docs/bench-train-gpt-tiny-seeds/seed-$$seed || exit 1; \
	done
	$(BIN)/python -m gradsync bench seeds docs/bench-train-gpt-tiny/results.json \
		docs/bench-train-gpt-tiny-seeds/seed-1/results.json docs/bench-train-gpt-tiny-seeds/seed-2/results.json \
		--out docs/bench-train-gpt-tiny-seeds

# Syncing rarely: DiLoCo every 25 inner steps (fp32 outer gradients), every 50 with int4 ones, and
# Streaming DiLoCo (5 fragments, each exchange overlapping 2 inner steps) against DDP and gradsync's
# default, on mlp-wide, 4 testbed hosts at 1 Gbit/s.
bench-train-diloco: $(STAMP)
	$(BIN)/python -m gradsync bench train --workload mlp-wide --world 4 --testbed \
		--strategies ddp,int4,diloco:sync_every=25,diloco:sync_every=50:compressor=int4,diloco:sync_every=50:compressor=int4:fragments=5:delay=2 \
		--steps 400 --eval-every 25 --out docs/bench-train-diloco

# The same at 100 Mbit/s, where syncing rarely matters most (DDP's 400 steps take over an hour).
bench-train-diloco-100mbit: $(STAMP)
	$(BIN)/python -m gradsync bench train --workload mlp-wide --world 4 --testbed --bandwidth 100mbit \
		--strategies ddp,int4,diloco:sync_every=50:compressor=int4,diloco:sync_every=50:compressor=int4:fragments=5:delay=2 \
		--steps 400 --eval-every 25 --timeout 7200 --out docs/bench-train-diloco-100mbit

# DiLoCo and Streaming DiLoCo on gpt-tiny (Adam inner steps), 4 testbed hosts at 1 Gbit/s.
bench-train-diloco-gpt-tiny: $(STAMP)
	$(BIN)/python -m gradsync bench train --workload gpt-tiny --world 4 --testbed \
		--strategies ddp,diloco:sync_every=25:compressor=int4,diloco:sync_every=25:compressor=int4:fragments=5:delay=2 \
		--steps 200 --eval-every 25 --out docs/bench-train-diloco-gpt-tiny

# gradsync's DiLoCo beside torchft's (its lighthouse, Managers and gloo group; fp32 outer gradients,
# as torchft quantizes only on CUDA) on mlp-wide, 4 testbed hosts at 1 Gbit/s.
bench-train-torchft: $(STAMP)
	$(BIN)/python -m gradsync bench train --workload mlp-wide --world 4 --testbed \
		--strategies ddp,diloco:sync_every=50,torchft-diloco:sync_every=50,diloco:sync_every=50:compressor=int4 \
		--steps 400 --eval-every 25 --out docs/bench-train-torchft

# FSDP2 on 2 ranks (loopback): a small gpt-tiny (3.2M parameters) sharded by fully_shard, its
# gradient reduce-scatter FSDP's own, or gradsync's with bf16 and with int4: bytes and held-out loss.
bench-train-fsdp: $(STAMP)
	$(BIN)/python -m gradsync bench train --workload gpt-tiny --option d_model=256 --option n_layers=4 \
		--option n_heads=4 --world 2 --strategies fsdp,fsdp:compressor=bf16,fsdp:compressor=int4 \
		--steps 200 --eval-every 25 --out docs/bench-train-fsdp

# embed-lm (a dense 32768-word embedding) on 4 testbed hosts at 1 Gbit/s: DDP vs gradsync without
# compression, whose hook sends the embedding's rows by gradsync.sparse (auto, or forced schemes).
bench-train-embed-lm: $(STAMP)
	$(BIN)/python -m gradsync bench train --workload embed-lm --world 4 --testbed \
		--strategies ddp,none,none:sparse=balanced,none:sparse=dense --steps 100 --eval-every 25 \
		--out docs/bench-train-embed-lm

# The sparse exchange benchmark behind docs/sparse.md's tables: dense, agsparse, balanced (Zen),
# recursive-doubling (SparCML) and an index-range partition on 8 testbed hosts at 1 Gbit/s, on embed-lm's
# embedding gradient and Zipf-skewed rows, with each scheme's traffic modelled for 2 to 128 workers.
bench-sparse: $(STAMP)
	$(BIN)/python -m gradsync bench sparse --hosts 8 --testbed --bandwidth 1gbit --reps 10 \
		--inputs embed-lm,zipf --out docs/bench-sparse

# The simulator's speed at 1,024 and 16,384 workers and its scaling factors for every model profile at
# 8 x 8 V100 with 25 and 100 Gbit/s between nodes (docs/simulator.md's tables).
bench-sim: $(STAMP)
	$(BIN)/python -m gradsync bench sim --out docs/bench-sim

# The planner on the simulator's model profiles: against brute force on coarsened models, against
# every uniform strategy and MergeComp's layer-wise and one-group baselines, and its decision time.
bench-plan: $(STAMP)
	$(BIN)/python -m gradsync bench plan --out docs/bench-plan

# plan="auto" against every fixed configuration of its space: gpt-tiny on 4 ranks on loopback and on
# testbed hosts at 10 and 1 Gbit/s (docs/planning.md's table).
bench-plan-train: $(STAMP)
	for net in loopback 10gbit 1gbit; do \
		if [ $$net = loopback ]; then where=""; else where="--testbed --bandwidth $$net"; fi; \
		$(BIN)/python -m gradsync bench train --workload gpt-tiny --world 4 \
			--strategies ddp,fp16,bf16,int4,auto --steps 46 --eval-every 46 $$where \
			--out docs/bench-plan-train/$$net || exit 1; \
	done

# The simulator's predicted step time vs the measured one on the testbed: gpt-tiny on 2 and 4 hosts at
# 1 Gbit/s and 300 Mbit/s, DDP vs gradsync fp16 and qsgd, each predicted from a profile of its ranks.
bench-fidelity: $(STAMP)
	$(BIN)/python -m gradsync bench fidelity --out docs/bench-fidelity

# Compress + decompress time of every compressor, and its encode alone as the hook runs it, vs a
# plain copy; writes docs/bench-kernels/results.json.
bench-kernels: $(STAMP)
	$(BIN)/python -m gradsync bench kernels

# The same on a GPU (2^26 elements: a clone of 2^24 takes tens of microseconds there); needs CUDA.
# GPU names the results' folder: make bench-kernels-gpu GPU=a100.
GPU ?= h200
bench-kernels-gpu: $(STAMP)
	$(BIN)/python -m gradsync bench kernels --device cuda --numel 67108864 \
		--json docs/bench-kernels/$(GPU)/results.json

test: $(STAMP)
	$(BIN)/ruff check gradsync tests
	$(BIN)/python -m pytest -q -m "not slow"

# Everything, long runs (convergence, benchmarks) included.
test-all: $(STAMP)
	$(BIN)/ruff check gradsync tests
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check gradsync tests

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
