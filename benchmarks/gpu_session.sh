#!/usr/bin/env bash
# What a lent GPU machine should run, in order, one step per call (each fits the 10-minute
# limit of one call; a session has about 30 minutes of device time in all).
#
#   bash benchmarks/gpu_session.sh STEP [OUT]
#
# STEP: tests | zero | moe | offload | llama | gpt2 | calibrate | all-tests. OUT (default:
# $OUT, else benchmarks/gpu_results): where logs and result files go. The machine has torch with CUDA but not our pure-Python
# dependencies: wheels in .whl/ (pydantic, pydantic_core, annotated_types,
# typing_inspection, torchao; gitignored, carry them with the run) are installed into
# /tmp/site first. Results name the torch version and the device; copy them into
# benchmarks/gpu_results/ and docs/gpu.md by hand.
#
#   tests      the suites that have not passed on CUDA yet: the GPU-marked tests (selective
#              recomputation on CUDA among them) and, in the several-ranks-on-one-GPU mode,
#              the Llama and resharding parity suites, then benchmarks/gpu_memory.py on
#              the tiny config (the memory outside the allocator) (~7-10 min)
#   zero       in the several-ranks-on-one-GPU mode, ZeRO-3 compiled (dp2) and ZeRO-3 with
#              a pipeline (dp2 x pp2, flush and interleaved), new since the last GPU
#              session, then tests/test_ulysses.py: the all-to-all's layouts and fp8 under
#              cp2 (a2a and ring) with real float8 matmuls, its bounds measured on the CPU
#              (~5 min)
#   moe        in the same mode, the mixture-of-experts parity suite (ep, cp, ZeRO-3 x ep,
#              sequence parallelism with experts, the routing bias, Qwen2-MoE's gated shared
#              expert: F.grouped_mm in bf16 and our all-to-all on CUDA tensors) (~4 min)
#   offload    training.offload on CUDA (new: the side stream's copies): the parity suite
#              (tests/test_memory_knobs.py: ZeRO 0-3 and 3D with "optimizer", ZeRO-3 and
#              dp2 x tp2 x pp2 with "optimizer+params", resumes) in the several-ranks-on-one-
#              GPU mode, the placement check on CUDA (-m gpu, offload layouts), then the
#              peak allocated of a ~1B Llama at ZeRO-3 (one rank) without offload, with
#              "optimizer" and with "optimizer+params" (benchmarks/gpu_memory.py) (~6-8 min)
#   llama      the Llama-3.2-1B-shaped rows with 2 micro-batches of 8 sequences (larger
#              GEMMs than the 4 x 4 of the recorded run): bf16 and fp8 tensorwise (~4 min)
#   gpt2       GPT-2 small, the compiled row only, batch 64 in 4 micro-batches, then
#              sliding-window attention in query chunks against one masked call
#              (benchmarks/windowed_attention.py on CUDA, new since the last session), and
#              what a masked call's pair costs against is_causal (attention_pair_price.py:
#              the planner's FUSED_PAIR = 2) (~6 min)
#   calibrate  the kernel profiles the planner's GPU presets are to be priced from
#              (shardwise bench calibrate --device cuda: GEMMs, SDPA per kernel and length,
#              an element-wise op, fused AdamW) for GPT-2 small's and TinyLlama-1.1B's blocks
#              in bf16, written as kernels_cuda_MODEL.json; shardwise plan --kernels-profile
#              reads them (docs/planner.md, "Kernel profiles") (~2 min)
#   all-tests  tests/ whole in the several-ranks-on-one-GPU mode (longer than one call:
#              only with a machine to spare)
set -uo pipefail
step=${1:?usage: gpu_session.sh tests|zero|moe|offload|llama|gpt2|calibrate|all-tests [OUT]}
out=${2:-${OUT:-benchmarks/gpu_results}}
case $step in tests|zero|moe|offload|llama|gpt2|calibrate|all-tests) ;;
    *) echo "gpu_session.sh: STEP: expected tests, zero, moe, offload, llama, gpt2," \
            "calibrate or all-tests, got '$step'" >&2
       exit 2 ;;
esac
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))" \
    | tee "$out/device.txt"
case $step in
    tests)
        python3 -m pytest -q -m gpu tests/ 2>&1 | tee "$out/gpu_marked_tests.log" | tail -5
        SHARDWISE_TEST_DEVICE=cuda timeout 420 python3 -m pytest -q -x \
            tests/test_llama.py tests/test_reshard.py 2>&1 \
            | tee "$out/llama_reshard_cuda_gloo_one_gpu.log" | tail -5
        # the memory outside PyTorch's allocator (the planner's GPU_RESERVED margin)
        timeout 120 python3 benchmarks/gpu_memory.py --parallel.dp 1 --label tiny-outside \
            --dry 2>&1 | tee "$out/gpu_memory_tiny.log" | tail -3 ;;
    zero)
        SHARDWISE_TEST_DEVICE=cuda timeout 540 python3 -m pytest -q \
            tests/test_zero.py tests/test_pp_trainer.py -k "compiled or zero3" 2>&1 \
            | tee "$out/zero3_compiled_and_pp_cuda_gloo_one_gpu.log" | tail -5
        SHARDWISE_TEST_DEVICE=cuda timeout 240 python3 -m pytest -q -rs tests/test_ulysses.py \
            2>&1 | tee "$out/ulysses_fp8_cuda_gloo_one_gpu.log" | tail -5 ;;
    moe)
        SHARDWISE_TEST_DEVICE=cuda timeout 540 python3 -m pytest -q tests/test_moe.py 2>&1 \
            | tee "$out/moe_cuda_gloo_one_gpu.log" | tail -5 ;;
    offload)
        SHARDWISE_TEST_DEVICE=cuda timeout 300 python3 -m pytest -q -x \
            tests/test_memory_knobs.py 2>&1 | tee "$out/offload_cuda_gloo_one_gpu.log" | tail -5
        timeout 120 python3 -m pytest -q -m gpu tests/test_placement.py -k offload 2>&1 \
            | tee "$out/offload_placement_cuda.log" | tail -3
        for off in none optimizer optimizer+params; do
            timeout 100 python3 benchmarks/gpu_memory.py --parallel.dp 1 --parallel.zero 3 \
                --model.kind llama --model.n_layer 16 --model.n_embd 2048 --model.n_head 32 \
                --model.n_kv_heads 8 --model.vocab_size 32768 --model.block_size 2048 \
                --training.global_batch_size 4 --training.precision bf16 \
                --training.offload "$off" --steps 3 --label "llama-1b-z3-offload-$off" \
                2>&1 | tail -3
        done ;;
    llama)
        python3 benchmarks/gpu_llama.py --rows ours,ours-fp8-tensorwise --micro-batches 2 \
            --steps 5 --warmup 2 --tag cuda_llama1b_m2 --out "$out" ;;
    gpt2)
        python3 benchmarks/gpu_mfu.py --last-only --batch 64 --micro-batches 4 \
            --tag cuda_b64_m4_rerun --out "$out"
        timeout 240 python3 benchmarks/windowed_attention.py --device cuda \
            --lengths 4096,16384 --windows 1024,4096 --chunks 1024,4096 \
            --out "$out/windowed_attention" 2>&1 | tail -20
        timeout 120 python3 benchmarks/attention_pair_price.py --device cuda --dtype bf16 \
            --lengths 2048,4096,8192 --heads 16 --out "$out/attention_pair_price" | tail -8 ;;
    calibrate)
        for model in gpt2-124m tinyllama-1.1b; do
            timeout 240 python3 -m shardwise bench calibrate --device cuda --dtype bf16 \
                --model "$model" --out "$out/kernels_cuda_$model.json" 2>&1 | tail -2
        done ;;
    all-tests)
        SHARDWISE_TEST_DEVICE=cuda python3 -m pytest -q tests/ 2>&1 \
            | tee "$out/all_cuda_gloo_one_gpu.log" | tail -5 ;;
esac
