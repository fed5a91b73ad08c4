#!/usr/bin/env bash
# What the GPU benchmarks ran on the device machine (repo root; packages from source, plugin
# entry points from the dev venv's dist-info copied into .benchmeta/). Results land in $OUT.
set -u
export PYTHONPATH=".benchmeta:$(ls -d packages/*/src | tr '\n' ':')" LUMENRL_BENCH_OUT="${OUT:-benchmarks/results}" PYTHONUNBUFFERED=1
export TRANSFORMERS_VERBOSITY=error
run() { echo "== $*"; timeout "$@" 2>&1 | grep -v -E "Warning:|warnings\.warn\(" ; }  # warning lines only (pytest's "N passed, M warnings" stays)
case "${1:-all}" in
  tests) run 150 python3 -m pytest -q -p no:cacheprovider packages/lumenrl-backends/tests/test_backends_engine_speed.py packages/lumenrl-backends/tests/test_backends_engine_kernels.py packages/lumenrl-backends/tests/test_backends_engine_rope.py packages/lumenrl-backends/tests/test_backends_engine_native.py -k "cuda" ;;  # (kernel tests split off the speed file in session 7)
  decode) run 200 python3 benchmarks/gpu/bench_decode.py --models 1.7b,8b --batches 16,64,256 --modes graph --hf dynamic --hf-batches 64 --out decode.json
          "$0" decode-full ;;
  decode-full) run 200 python3 benchmarks/gpu/bench_decode.py --models 8b --batches 64 --modes full --hf dynamic --out decode_full.json ;;
  fp8) run 150 python3 benchmarks/gpu/bench_fp8_rollout.py --engines bf16,fp8,fp8+kv --out fp8_rollout.json ;;
  grpo) run 150 python3 benchmarks/gpu/bench_grpo_step.py --steps 3 --out grpo_step.json ;;
  # TRL side (carry .whl: trl 1.16.0, datasets 5.2.0, dill 0.4.0, multiprocess 0.70.18 wheels, ~1.8 MB)
  trl) python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
       PYTHONPATH="$PYTHONPATH:/tmp/site" run 200 python3 benchmarks/gpu/bench_grpo_trl.py --steps 3 --out grpo_trl.json ;;
  all) for part in tests decode fp8 grpo; do "$0" "$part"; done ;;
  call3) for part in grpo decode-full; do "$0" "$part"; done ;;
  grpo-vs-trl) for part in trl grpo; do "$0" "$part"; done ;;   # carry .benchmeta and .whl
  # session 2 (2026-11-29 evening): fused projections, overlapped sync, tuned quantize kernels, FP8 training fast path
  gpu-tests2) run 90 python3 -m pytest -q -p no:cacheprovider packages/lumenrl-backends/tests/test_backends_engine_fusion.py \
                packages/lumenrl-quant/tests/test_quant_fp8_training_fast.py packages/lumenrl-quant/tests/test_quant_triton.py ;;
  quant-tune) run 120 python3 benchmarks/quant/bench_quantize.py --tune ;;
  quant-final) run 60 python3 benchmarks/quant/bench_quantize.py ;;
  decode-fused) run 100 python3 benchmarks/gpu/bench_decode.py --models 8b --batches 64 --modes graph --fuse on,off --overlap on,off --hf none --out decode_fused_graph.json ;;
  decode-fused-full) run "${FULL_S:-140}" python3 benchmarks/gpu/bench_decode.py --models 8b --batches 64 --modes full --fuse "${FULL_FUSE:-on}" --hf none --out decode_fused_full.json ;;
  fp8-train) run 170 python3 benchmarks/quant/bench_fp8_training.py --variants bf16,fp8,bf16+compile,fp8+compile --budget-s 140 --out fp8_train_8b.json ;;
  s2call1) for part in gpu-tests2 quant-tune decode-fused fp8-train decode-fused-full; do "$0" "$part"; done ;;
  train-single) run 170 python3 benchmarks/gpu/bench_train.py --steps 4 --warmup 2 --budget-s 150 --variant-timeout-s 90 --profile 1.7b/bf16+compile+single --variants 1.7b/bf16+compile,1.7b/bf16+compile+single,1.7b/bf16+compile+single+16x1024 ;;
  fp8-graph) run 140 python3 benchmarks/gpu/bench_fp8_rollout.py --engines bf16,fp8_row,fp8_block --modes graph --out fp8_rollout2_graph.json ;;
  # compiled engines one process each (side by side in one job)
  fp8-full-bf16) run 100 python3 benchmarks/gpu/bench_fp8_rollout.py --engines bf16 --modes full --no-exact-kl --out fp8_rollout2_full_bf16.json ;;
  fp8-full-row) run 100 python3 benchmarks/gpu/bench_fp8_rollout.py --engines fp8_row --modes full --no-exact-kl --out fp8_rollout2_full_row.json ;;
  s2call2) for part in quant-tune train-single fp8-graph fp8-full-bf16 fp8-full-row; do "$0" "$part"; done ;;
  quant-tune2) run 90 python3 benchmarks/quant/bench_quantize.py --tune ;;
  fp8-full-row2) run 170 python3 benchmarks/gpu/bench_fp8_rollout.py --engines fp8_row --modes full --no-exact-kl --out fp8_rollout2_full_row.json ;;
  s2call3) for part in quant-tune2 fp8-train decode-fused-full fp8-full-row2 fp8-full-bf16; do "$0" "$part"; done ;;
  grpo-compiled) run 200 python3 benchmarks/gpu/bench_grpo_step.py --steps 3 --micro-batch 64 --out grpo_step_s2.json --override policy.rollout.compile=full --override policy.train.compile_layers=true ;;
  fp8-full-rowkv) run 170 python3 benchmarks/gpu/bench_fp8_rollout.py --engines fp8_row+kv --modes full --no-exact-kl --out fp8_rollout2_full_rowkv.json ;;
  s2call4) for part in quant-tune2 trl grpo-compiled fp8-full-bf16 fp8-full-rowkv; do "$0" "$part"; done ;;   # carry .whl too
  # next session, the three open goals first: MXFP4 packing options, a profile of the compiled 8B decode step
  # (where the last 3% to 70% goes), FP8 rollout (compiled, with FP8 KV) against bf16 in the same job
  decode-profile) run 200 python3 benchmarks/gpu/bench_decode.py --models 8b --batches 64 --modes full --fuse on --hf none --profile --out decode_profile.json ;;
  next) for part in quant-tune2 decode-profile fp8-full-bf16 fp8-full-rowkv; do "$0" "$part"; done ;;
  # session 3 (2026-11-29 night): profiles of the compiled engines as timed (bf16 and fp8_row + FP8 KV)
  fp8-profile-rowkv) run 170 python3 benchmarks/gpu/bench_fp8_rollout.py --engines fp8_row+kv --modes full --no-exact-kl --profile --out fp8_rollout3_profile_rowkv.json ;;
  s3call1) for part in quant-tune2 decode-profile fp8-profile-rowkv; do "$0" "$part"; done ;;
  attn-tune) run 170 python3 benchmarks/gpu/bench_attention.py --tune --out attention_tune.json ;;
  gemm-tune) run 200 python3 benchmarks/quant/bench_decode_gemm.py --tune ;;
  sampler) run 80 python3 benchmarks/gpu/bench_sampler.py --batches 16,64,256 --sweep ;;
  s3call2) for part in attn-tune gemm-tune quant-tune2 sampler; do "$0" "$part"; done ;;
  attn-fp8) run 90 python3 benchmarks/gpu/bench_attention.py --tune --dtypes fp8,bf16 --out attention_tune2.json ;;
  decode-s3) run 150 python3 benchmarks/gpu/bench_decode.py --models 8b --batches 64 --modes full --fuse on --hf none --profile --out decode_s3.json ;;
  fp8-s3-bf16) run 120 python3 benchmarks/gpu/bench_fp8_rollout.py --engines bf16 --modes full --no-exact-kl --profile --out fp8_rollout3_full_bf16.json ;;
  fp8-s3-rowkv) run 150 python3 benchmarks/gpu/bench_fp8_rollout.py --engines fp8_row+kv --modes full --no-exact-kl --profile --out fp8_rollout3_full_rowkv.json ;;
  s3call3) for part in attn-fp8 decode-s3 fp8-s3-bf16 fp8-s3-rowkv; do "$0" "$part"; done ;;
  quant-tune3) run 130 python3 benchmarks/quant/bench_quantize.py --tune ;;
  attn-tune3) run 120 python3 benchmarks/gpu/bench_attention.py --tune --dtypes fp8,bf16 --out attention_tune3.json ;;
  gpu-tests3) run 150 python3 -m pytest -q -p no:cacheprovider -k "cuda or gpu or triton or decode_path" \
                packages/lumenrl-quant/tests/test_quant_triton.py packages/lumenrl-quant/tests/test_quant_decode_path.py \
                packages/lumenrl-backends/tests/test_backends_engine_speed.py packages/lumenrl-backends/tests/test_backends_engine_fusion.py ;;
  kl-trained) run 120 python3 benchmarks/quant/bench_rollout_kl_trained.py --threads 8 --out rollout_kl_trained_h200.json
              run 150 python3 benchmarks/quant/bench_rollout_kl_trained.py --threads 8 --no-untrained --steps 600 --train-batch 16 \
                --dims '{"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 128}' \
                --out rollout_kl_trained_h200_1024x12.json ;;
  s3call4) for part in quant-tune3 attn-tune3 gpu-tests3 kl-trained; do "$0" "$part"; done ;;
  gemm-paths) run 60 python3 -m pytest -q -p no:cacheprovider -rA packages/lumenrl-quant/tests/test_quant_gemm_paths_gpu.py 2>&1 | tail -8 ;;
  quant-final3) run 60 python3 benchmarks/quant/bench_quantize.py ;;
  fp8-s3b-bf16) run 110 python3 benchmarks/gpu/bench_fp8_rollout.py --engines bf16 --modes full --no-exact-kl --out fp8_rollout3b_full_bf16.json ;;
  fp8-s3b-rowkv) run 140 python3 benchmarks/gpu/bench_fp8_rollout.py --engines fp8_row+kv --modes full --no-exact-kl --profile --out fp8_rollout3b_full_rowkv.json ;;
  s3call5) for part in gemm-paths quant-final3 fp8-s3b-bf16 fp8-s3b-rowkv; do "$0" "$part"; done ;;
  # next session first: the cuBLAS-blockwise fix on the GPU (test + the small trained model's fp8_block KL),
  # the opt-in E4M3 attention dots in the sweep, the GPU tests of the new kernels
  kl-block) run 120 python3 benchmarks/quant/bench_rollout_kl_trained.py --threads 8 --no-untrained --engines bf16,fp8_block,fp8_row --out rollout_kl_trained_h200_block.json ;;
  attn-tune4) run 150 python3 benchmarks/gpu/bench_attention.py --tune --dtypes fp8,bf16 --out attention_tune4.json ;;
  next4) for part in gemm-paths kl-block attn-tune4; do "$0" "$part"; done ;;
  # then: W8A16 vs W8A8 decode GEMMs, MX kernels re-timed after the int64 row offsets, the GPU tests
  next4b) for part in gemm-tune quant-tune3 gpu-tests3; do "$0" "$part"; done ;;
  # then the W8A16 scheme end to end against bf16 (compiled, FP8 KV), one process each
  fp8-w8a16kv) run 150 python3 benchmarks/gpu/bench_fp8_rollout.py --engines fp8_w8a16+kv --modes full --no-exact-kl --profile --out fp8_rollout4_full_w8a16kv.json ;;
  next4c) for part in fp8-s3b-bf16 fp8-w8a16kv fp8-s3b-rowkv; do "$0" "$part"; done ;;
  # session 4 (2026-11-29 night): W8A16 measured slower than bf16 (next4b), so next4c was not run.
  # FP8-cache attention: a wider sweep (small programs, splits); 128x128 quantize with a block-row-major
  # grid; the FP8 engine with the output head quantized and the sweep's best attention config, next to bf16
  attn-fp8wide) run 150 python3 benchmarks/gpu/bench_attention.py --tune --space fp8wide --dtypes fp8 --out attention_tune5.json ;;
  quant-128) run 100 python3 benchmarks/quant/bench_quantize.py --tune --kernels fp8_block_128x128 ;;
  fp8-s4-bf16) run 120 python3 benchmarks/gpu/bench_fp8_rollout.py --engines bf16 --modes full --no-exact-kl --out fp8_rollout4_full_bf16.json ;;
  fp8-s4-rowkvhead) run 170 python3 benchmarks/gpu/bench_fp8_rollout.py --engines fp8_row+kv+head --modes full --no-exact-kl --profile \
                      --attn-fp8-config "$LUMENRL_BENCH_OUT/attention_tune5.json" --out fp8_rollout4_full_rowkvhead.json ;;
  s4call3) for part in attn-fp8wide quant-128 fp8-s4-bf16 fp8-s4-rowkvhead; do "$0" "$part"; done ;;
  # the sweep's best (1 warp, 128-column splits) lost in the engine (merge kernel); instead V stored (D, L)
  attn-layouts) run 120 python3 benchmarks/gpu/bench_attention.py --tune --space layouts --v-layouts rows,columns --out attention_tune6.json ;;
  gpu-tests4) run 120 python3 -m pytest -q -p no:cacheprovider -k "cuda and (fp8 or triton)" \
                packages/lumenrl-backends/tests/test_backends_engine_speed.py packages/lumenrl-quant/tests/test_quant_gemm_paths_gpu.py ;;
  fp8-s4-rowkvhead-vcol) run 170 python3 benchmarks/gpu/bench_fp8_rollout.py --engines fp8_row+kv+head --modes full --no-exact-kl --profile \
                      --out fp8_rollout4_full_rowkvhead_vcol.json ;;
  s4call4) for part in attn-layouts gpu-tests4 fp8-s4-bf16 fp8-s4-rowkvhead-vcol; do "$0" "$part"; done ;;
  # V by columns measured 3x slower (reverted); last: 128x128 k_first default, and bf16 / fp8+head / fp8 side by side
  fp8-s4-rowkvhead2) run 170 python3 benchmarks/gpu/bench_fp8_rollout.py --engines fp8_row+kv+head --modes full --no-exact-kl --profile \
                      --out fp8_rollout4_full_rowkvhead2.json ;;
  fp8-s4-rowkv) run 150 python3 benchmarks/gpu/bench_fp8_rollout.py --engines fp8_row+kv --modes full --no-exact-kl --out fp8_rollout4_full_rowkv.json ;;
  s4call5) for part in quant-128 fp8-s4-bf16 fp8-s4-rowkvhead2 fp8-s4-rowkv; do "$0" "$part"; done ;;
  # session 5 (2026-11-29 late night): the fused FP8 SwiGLU MLP (SiLU * up + 1x64 group quantization in the
  # gate/up GEMM epilogue, group-scaled down GEMM): GPU tests, kernel sweep, then the engines side by side
  gpu-tests5) run 150 python3 -m pytest -q -p no:cacheprovider packages/lumenrl-quant/tests/test_quant_fused_mlp.py \
                packages/lumenrl-quant/tests/test_quant_gemm_paths_gpu.py packages/lumenrl-backends/tests/test_backends_engine_fusion.py ;;
  mlp-tune) run 200 python3 benchmarks/quant/bench_fused_mlp.py --models 8b --tune --out fused_mlp_tune.json ;;
  fp8-s5-fused) run 190 python3 benchmarks/gpu/bench_fp8_rollout.py --engines fp8_row+kv+head --modes full --profile \
                  --mlp-config "$LUMENRL_BENCH_OUT/fused_mlp_tune.json" --out fp8_rollout5_full_rowkvhead.json ;;
  fp8-s5-bf16) run 130 python3 benchmarks/gpu/bench_fp8_rollout.py --engines bf16 --modes full --no-exact-kl --out fp8_rollout5_full_bf16.json ;;
  s5call1) for part in gpu-tests5 mlp-tune fp8-s5-fused fp8-s5-bf16; do "$0" "$part"; done ;;
  # call 1: the group-scaled down GEMM ran 32 us (its per-K-block scale load, strided, was not pipelined) and
  # dynamo could not analyse the gate/up kernel (clone kernels); fixed: group-major scales loaded one block
  # ahead, no .to() on a scalar argument
  gpu-tests5b) run 100 python3 -m pytest -q -p no:cacheprovider packages/lumenrl-quant/tests/test_quant_fused_mlp.py \
                packages/lumenrl-quant/tests/test_quant_gemm_paths_gpu.py ;;
  fp8-s5b-fused) run 190 python3 benchmarks/gpu/bench_fp8_rollout.py --engines fp8_row+kv+head --modes full --profile \
                  --mlp-config "$LUMENRL_BENCH_OUT/fused_mlp_tune.json" --out fp8_rollout5b_full_rowkvhead.json ;;
  fp8-s5b-bf16) run 130 python3 benchmarks/gpu/bench_fp8_rollout.py --engines bf16 --modes full --no-exact-kl --out fp8_rollout5b_full_bf16.json ;;
  s5call2) for part in gpu-tests5b mlp-tune fp8-s5b-fused fp8-s5b-bf16; do "$0" "$part"; done ;;
  # call 2: 1.440x (tuned configs now in lumenrl_quant.fused_mlp). Call 3: inductor's programmatic dependent
  # launch (TORCHINDUCTOR_ENABLE_PDL=1: its kernels start while the previous kernel drains) for both engines,
  # and the unfused MLP (+tokmlp) for the A/B
  fp8-s5c-fused-pdl) run 190 env TORCHINDUCTOR_ENABLE_PDL=1 python3 benchmarks/gpu/bench_fp8_rollout.py --engines fp8_row+kv+head \
                       --modes full --no-exact-kl --profile --out fp8_rollout5c_full_rowkvhead_pdl.json ;;
  fp8-s5c-bf16-pdl) run 130 env TORCHINDUCTOR_ENABLE_PDL=1 python3 benchmarks/gpu/bench_fp8_rollout.py --engines bf16 --modes full \
                      --no-exact-kl --out fp8_rollout5c_full_bf16_pdl.json ;;
  fp8-s5c-tokmlp) run 170 python3 benchmarks/gpu/bench_fp8_rollout.py --engines fp8_row+kv+head+tokmlp --modes full --no-exact-kl \
                    --out fp8_rollout5c_full_rowkvhead_tokmlp.json ;;
  s5call3) for part in fp8-s5c-fused-pdl fp8-s5c-bf16-pdl fp8-s5c-tokmlp; do "$0" "$part"; done ;;
  # call 3 mixed PDL and non-PDL engines; call 4: the clean A/B, no PDL, all three in one job
  fp8-s5d-bf16) run 130 python3 benchmarks/gpu/bench_fp8_rollout.py --engines bf16 --modes full --no-exact-kl --out fp8_rollout5d_full_bf16.json ;;
  fp8-s5d-fused) run 180 python3 benchmarks/gpu/bench_fp8_rollout.py --engines fp8_row+kv+head --modes full --no-exact-kl --profile \
                   --out fp8_rollout5d_full_rowkvhead.json ;;
  fp8-s5d-tokmlp) run 180 python3 benchmarks/gpu/bench_fp8_rollout.py --engines fp8_row+kv+head+tokmlp --modes full --no-exact-kl \
                    --profile --out fp8_rollout5d_full_rowkvhead_tokmlp.json ;;
  s5call4) for part in fp8-s5d-bf16 fp8-s5d-fused fp8-s5d-tokmlp; do "$0" "$part"; done ;;
  # call 5 (a probe for next time): inductor multi-kernel (persistent reductions up to 16384 columns, the faster of
  # persistent / looped picked by timing) on both engines, profiled: the RMSNorm + quantize kernels of the FP8
  # engine are looped ("red") kernels of 3.6-4.1 us at 4096 columns
  fp8-s5e-bf16-mk) run 150 env TORCHINDUCTOR_MULTI_KERNEL=1 python3 benchmarks/gpu/bench_fp8_rollout.py --engines bf16 --modes full \
                     --no-exact-kl --profile --out fp8_rollout5e_full_bf16_multikernel.json ;;
  fp8-s5e-rowkvhead-mk) run 180 env TORCHINDUCTOR_MULTI_KERNEL=1 python3 benchmarks/gpu/bench_fp8_rollout.py --engines fp8_row+kv+head \
                          --modes full --no-exact-kl --profile --out fp8_rollout5e_full_rowkvhead_multikernel.json ;;
  s5call5) for part in fp8-s5e-rowkvhead-mk fp8-s5e-bf16-mk; do "$0" "$part"; done ;;
  # session 6: SiLU * up + per-token FP8 quantize as one lumenrl-quant kernel (the default per-token MLP now)
  gpu-tests6) run 150 python3 -m pytest -q -p no:cacheprovider packages/lumenrl-quant/tests/test_quant_fused_mlp.py \
                packages/lumenrl-backends/tests/test_backends_engine_fusion.py ;;
  mlp-s6) run 150 python3 benchmarks/quant/bench_fused_mlp.py --models 8b --m 64 --out fused_mlp_s6.json ;;
  fp8-s6-row) run 190 python3 benchmarks/gpu/bench_fp8_rollout.py --engines fp8_row+kv+head --modes full --no-exact-kl \
                --profile --out fp8_rollout6_full_rowkvhead.json ;;
  fp8-s6-bf16) run 150 python3 benchmarks/gpu/bench_fp8_rollout.py --engines bf16 --modes full --no-exact-kl \
                 --out fp8_rollout6_full_bf16.json ;;
  s6call1) for part in gpu-tests6 mlp-s6 fp8-s6-row fp8-s6-bf16; do "$0" "$part"; done ;;
  # call 2: the SiLU kernel split over several programs per row (barrier-shared amax), and inductor's
  # persistent reductions up to 16384 columns on both engines (the FP8 RMSNorm + quantize kernels loop at 4096)
  gpu-tests6b) run 120 python3 -m pytest -q -p no:cacheprovider packages/lumenrl-quant/tests/test_quant_fused_mlp.py ;;
  mlp-s6b) run 150 python3 benchmarks/quant/bench_fused_mlp.py --models 8b --m 64 --out fused_mlp_s6b.json ;;
  fp8-s6b-row-pr) run 180 python3 benchmarks/gpu/bench_fp8_rollout.py --engines fp8_row+kv+head --modes full --no-exact-kl \
                    --profile --persistent-rnumel 16384 --out fp8_rollout6b_full_rowkvhead_persistent.json ;;
  fp8-s6b-bf16-pr) run 140 python3 benchmarks/gpu/bench_fp8_rollout.py --engines bf16 --modes full --no-exact-kl \
                     --persistent-rnumel 16384 --out fp8_rollout6b_full_bf16_persistent.json ;;
  fp8-s6b-row) run 170 python3 benchmarks/gpu/bench_fp8_rollout.py --engines fp8_row+kv+head --modes full --no-exact-kl \
                 --profile --out fp8_rollout6b_full_rowkvhead.json ;;
  s6call2) for part in gpu-tests6b mlp-s6b fp8-s6b-row-pr fp8-s6b-bf16-pr fp8-s6b-row; do "$0" "$part"; done ;;
  # call 3: decode attention hands o_proj FP8 codes in V's units (fp8_attn_out); SiLU kernel one program per
  # row at M >= 32; each engine process with its own inductor cache (call 2's second FP8 run reused the
  # first one's compiled kernels)
  gpu-tests6c) run 150 python3 -m pytest -q -p no:cacheprovider packages/lumenrl-backends/tests/test_backends_engine_fusion.py \
                 packages/lumenrl-backends/tests/test_backends_engine_speed.py -k "fp8 or cuda" ;;
  fp8-s6c-row) run 180 env TORCHINDUCTOR_CACHE_DIR=/tmp/ind_s6c_row python3 benchmarks/gpu/bench_fp8_rollout.py \
                 --engines fp8_row+kv+head --modes full --no-exact-kl --profile --out fp8_rollout6c_full_rowkvhead.json ;;
  fp8-s6c-bf16) run 150 env TORCHINDUCTOR_CACHE_DIR=/tmp/ind_s6c_bf16 python3 benchmarks/gpu/bench_fp8_rollout.py \
                  --engines bf16 --modes full --no-exact-kl --out fp8_rollout6c_full_bf16.json ;;
  fp8-s6c-row-pr) run 180 env TORCHINDUCTOR_CACHE_DIR=/tmp/ind_s6c_row_pr python3 benchmarks/gpu/bench_fp8_rollout.py \
                    --engines fp8_row+kv+head --modes full --no-exact-kl --persistent-rnumel 16384 \
                    --out fp8_rollout6c_full_rowkvhead_persistent.json ;;
  s6call3) for part in gpu-tests6c fp8-s6c-row fp8-s6c-bf16 fp8-s6c-row-pr; do "$0" "$part"; done ;;
  # call 4: the RMSNorms emit per-token FP8 in one pass (fp8_norm_quant, default); both engines with and
  # without inductor's persistent reductions up to 16384 columns, each process with its own inductor cache
  gpu-tests6d) run 150 python3 -m pytest -q -p no:cacheprovider packages/lumenrl-backends/tests/test_backends_engine_fusion.py \
                 packages/lumenrl-quant/tests/test_quant_fused_mlp.py ;;
  fp8-s6d-row) run 180 env TORCHINDUCTOR_CACHE_DIR=/tmp/ind_s6d_row python3 benchmarks/gpu/bench_fp8_rollout.py \
                 --engines fp8_row+kv+head --modes full --no-exact-kl --profile --out fp8_rollout6d_full_rowkvhead.json ;;
  fp8-s6d-bf16) run 150 env TORCHINDUCTOR_CACHE_DIR=/tmp/ind_s6d_bf16 python3 benchmarks/gpu/bench_fp8_rollout.py \
                  --engines bf16 --modes full --no-exact-kl --out fp8_rollout6d_full_bf16.json ;;
  fp8-s6d-row-pr) run 180 env TORCHINDUCTOR_CACHE_DIR=/tmp/ind_s6d_row_pr python3 benchmarks/gpu/bench_fp8_rollout.py \
                    --engines fp8_row+kv+head --modes full --no-exact-kl --persistent-rnumel 16384 \
                    --out fp8_rollout6d_full_rowkvhead_persistent.json ;;
  fp8-s6d-bf16-pr) run 150 env TORCHINDUCTOR_CACHE_DIR=/tmp/ind_s6d_bf16_pr python3 benchmarks/gpu/bench_fp8_rollout.py \
                     --engines bf16 --modes full --no-exact-kl --persistent-rnumel 16384 --out fp8_rollout6d_full_bf16_persistent.json ;;
  s6call4) for part in gpu-tests6d fp8-s6d-row fp8-s6d-bf16 fp8-s6d-row-pr fp8-s6d-bf16-pr; do "$0" "$part"; done ;;
  # session 7 call 1: the SiLU kernel's GPU tests after its move to triton_swiglu.py; an 8B-shaped Qwen3 TRAINED in the
  # job (bf16 AdamW, synthetic language over 4096 ids) and the FP8 rollout/train KL on it, with a random-init contrast
  gpu-tests7a) run 120 python3 -m pytest -q -p no:cacheprovider packages/lumenrl-quant/tests/test_quant_fused_mlp.py ;;
  kl-8b) run 450 python3 benchmarks/quant/bench_rollout_kl_trained.py --preset qwen3-8b --cache '' --train-dtype bfloat16 \
           --lang-vocab 4096 --steps 300 --train-batch 16 --lr 2e-4 --engines bf16,fp8_row+kv+head,fp8_block \
           --untrained-engines fp8_row+kv+head --out rollout_kl_trained_8b.json ;;
  s7call1) for part in gpu-tests7a kl-8b; do "$0" "$part"; done ;;
  # call 2: plain bf16 AdamW stalled at the unigram loss in call 1 (updates under half an ulp are lost);
  # now float32 moments + stochastic rounding (AdamWBF16), a 1024-id language, lr 3e-4
  kl-8b-sr) run 540 python3 benchmarks/quant/bench_rollout_kl_trained.py --preset qwen3-8b --cache '' --train-dtype bfloat16 \
              --lang-vocab 1024 --steps 400 --train-budget-s 250 --train-batch 16 --lr 3e-4 \
              --engines bf16,fp8_row+kv+head,fp8_row,fp8_block --untrained-engines fp8_row+kv+head --out rollout_kl_trained_8b_sr.json ;;
  s7call2) for part in kl-8b-sr; do "$0" "$part"; done ;;
  # call 3: the fused decode q/k-norm + RoPE + KV-write kernel (fused_qk_rope), A/B on both engines, each process
  # with its own inductor cache
  gpu-tests7c) run 120 python3 -m pytest -q -p no:cacheprovider packages/lumenrl-backends/tests/test_backends_engine_rope.py -k cuda ;;
  fp8-s7c-row) run 180 env TORCHINDUCTOR_CACHE_DIR=/tmp/ind_s7c_row python3 benchmarks/gpu/bench_fp8_rollout.py \
                 --engines fp8_row+kv+head --modes full --no-exact-kl --out fp8_rollout7c_full_rowkvhead.json ;;
  fp8-s7c-rowq) run 180 env TORCHINDUCTOR_CACHE_DIR=/tmp/ind_s7c_rowq python3 benchmarks/gpu/bench_fp8_rollout.py \
                  --engines fp8_row+kv+head+qkrope --modes full --no-exact-kl --profile --out fp8_rollout7c_full_rowkvhead_qkrope.json ;;
  fp8-s7c-bf16) run 150 env TORCHINDUCTOR_CACHE_DIR=/tmp/ind_s7c_bf16 python3 benchmarks/gpu/bench_fp8_rollout.py \
                  --engines bf16 --modes full --no-exact-kl --out fp8_rollout7c_full_bf16.json ;;
  fp8-s7c-bf16q) run 150 env TORCHINDUCTOR_CACHE_DIR=/tmp/ind_s7c_bf16q python3 benchmarks/gpu/bench_fp8_rollout.py \
                   --engines bf16+qkrope --modes full --no-exact-kl --out fp8_rollout7c_full_bf16_qkrope.json ;;
  s7call3) for part in gpu-tests7c fp8-s7c-rowq fp8-s7c-row fp8-s7c-bf16 fp8-s7c-bf16q; do "$0" "$part"; done ;;
  # call 4: the rope kernel's bit-exactness tests failed on the GPU in call 3; where do kernel and reference part?
  s7call4) run 90 python3 benchmarks/gpu/diag_rope_numerics.py ;;
  # call 5: the same with the kernel compiled without mul + add -> fma contraction (enable_fp_fusion=False)
  s7call5) run 90 python3 benchmarks/gpu/diag_rope_numerics.py
           run 120 python3 -m pytest -q -p no:cacheprovider packages/lumenrl-backends/tests/test_backends_engine_rope.py -k cuda ;;
  # call 6: the final defaults (fused_qk_rope on, the kernel without fma contraction), FP8 and bf16 in one job
  fp8-s7f-row) run 170 env TORCHINDUCTOR_CACHE_DIR=/tmp/ind_s7f_row python3 benchmarks/gpu/bench_fp8_rollout.py \
                 --engines fp8_row+kv+head --modes full --no-exact-kl --profile --out fp8_rollout7f_full_rowkvhead.json ;;
  fp8-s7f-bf16) run 140 env TORCHINDUCTOR_CACHE_DIR=/tmp/ind_s7f_bf16 python3 benchmarks/gpu/bench_fp8_rollout.py \
                  --engines bf16 --modes full --no-exact-kl --out fp8_rollout7f_full_bf16.json ;;
  s7call6) for part in fp8-s7f-row fp8-s7f-bf16; do "$0" "$part"; done ;;
  # session 8: V stored in (D, T) tiles for the FP8 decode attention
  attn-vblocks) run 400 python3 benchmarks/gpu/bench_attention.py --tune --space vblocks --dtypes fp8 --v-layouts rows,blocks64,blocks128 --out attention_tune7.json ;;
  attn-ref8) run 90 python3 benchmarks/gpu/bench_attention.py --dtypes bf16,fp8 --out attention_default_s8.json ;;
  s8call1) for part in attn-ref8 attn-vblocks; do "$0" "$part"; done ;;
  # s8call2 ran commit 67eb8b6's `bench_attention.py --tune --space prefetch --v-layouts rows,blocks64 --out attention_tune8.json`
  # (a register prefetch of the next tile: slower, 33-35 vs 23.5 us FP8; removed after)
  attn-diag) run 200 python3 benchmarks/gpu/diag_attention_kernel.py --dump "${OUT:-/tmp}/ptx" --out attention_diag_s8.json ;;
  s8call3) for part in attn-diag; do "$0" "$part"; done ;;
  attn-structure) run 400 python3 benchmarks/gpu/bench_attention.py --tune --space structure --v-layouts rows,blocks128 --out attention_tune9.json ;;
  s8call4) for part in attn-structure; do "$0" "$part"; done ;;
  # call 5: the engines with the retuned attention (mask_ahead) and the FP8 cache's V tiles (the default until
  # call 7; `+vtiles` since), FP8 and bf16 in one job
  gpu-tests8) run 200 python3 -m pytest -q -p no:cacheprovider packages/lumenrl-backends/tests/test_backends_engine_speed.py packages/lumenrl-backends/tests/test_backends_engine_kernels.py packages/lumenrl-backends/tests/test_backends_engine_rope.py packages/lumenrl-backends/tests/test_backends_engine_native.py -k cuda ;;
  fp8-s8e-row) run 180 env TORCHINDUCTOR_CACHE_DIR=/tmp/ind_s8e_row python3 benchmarks/gpu/bench_fp8_rollout.py \
                 --engines fp8_row+kv+head --modes full --no-exact-kl --profile --out fp8_rollout8e_full_rowkvhead.json ;;
  fp8-s8e-bf16) run 150 env TORCHINDUCTOR_CACHE_DIR=/tmp/ind_s8e_bf16 python3 benchmarks/gpu/bench_fp8_rollout.py \
                  --engines bf16 --modes full --no-exact-kl --profile --out fp8_rollout8e_full_bf16.json ;;
  s8call5) for part in gpu-tests8 fp8-s8e-row fp8-s8e-bf16; do "$0" "$part"; done ;;
  # call 6: one-warp FP8 attention over tiles; the engines with the default and with the sweep's fastest FP8 config
  attn-warp1) run 150 python3 benchmarks/gpu/bench_attention.py --tune --space warp1 --dtypes fp8 --v-layouts blocks128 --out attention_tune10.json ;;
  fp8-s8f-row) run 180 env TORCHINDUCTOR_CACHE_DIR=/tmp/ind_s8f_row python3 benchmarks/gpu/bench_fp8_rollout.py \
                 --engines fp8_row+kv+head --modes full --no-exact-kl --out fp8_rollout8f_full_rowkvhead.json ;;
  fp8-s8f-rowbest) run 180 env TORCHINDUCTOR_CACHE_DIR=/tmp/ind_s8f_rowbest python3 benchmarks/gpu/bench_fp8_rollout.py \
                     --engines fp8_row+kv+head --modes full --no-exact-kl --attn-fp8-config "${LUMENRL_BENCH_OUT}/attention_tune10.json" \
                     --out fp8_rollout8f_full_rowkvhead_attnbest.json ;;
  fp8-s8f-bf16) run 150 env TORCHINDUCTOR_CACHE_DIR=/tmp/ind_s8f_bf16 python3 benchmarks/gpu/bench_fp8_rollout.py \
                  --engines bf16 --modes full --no-exact-kl --out fp8_rollout8f_full_bf16.json ;;
  s8call6) for part in attn-warp1 fp8-s8f-row fp8-s8f-rowbest fp8-s8f-bf16; do "$0" "$part"; done ;;
  # call 7: the GPU tests on the final code, then a third FP8 / bf16 pair, and the rows layout last (A/B of the tiles).
  # fp8-s8e-row, fp8-s8f-row(best) and fp8-s8g-row ran V tiles, the default then: rerun them with +vtiles
  fp8-s8g-row) run 180 env TORCHINDUCTOR_CACHE_DIR=/tmp/ind_s8g_row python3 benchmarks/gpu/bench_fp8_rollout.py \
                 --engines fp8_row+kv+head --modes full --no-exact-kl --out fp8_rollout8g_full_rowkvhead.json ;;
  fp8-s8g-bf16) run 150 env TORCHINDUCTOR_CACHE_DIR=/tmp/ind_s8g_bf16 python3 benchmarks/gpu/bench_fp8_rollout.py \
                  --engines bf16 --modes full --no-exact-kl --out fp8_rollout8g_full_bf16.json ;;
  fp8-s8g-vrows) run 150 env TORCHINDUCTOR_CACHE_DIR=/tmp/ind_s8g_vrows python3 benchmarks/gpu/bench_fp8_rollout.py \
                   --engines fp8_row+kv+head+vrows --modes full --no-exact-kl --out fp8_rollout8g_full_rowkvhead_vrows.json ;;
  s8call7) for part in gpu-tests8 fp8-s8g-row fp8-s8g-bf16 fp8-s8g-vrows; do "$0" "$part"; done ;;
  # call 8 (what was left of the device time): the tiles-vs-rows engine test with rows the default again
  s8call8) run 100 python3 -m pytest -q -p no:cacheprovider packages/lumenrl-backends/tests/test_backends_engine_speed.py -k "cuda_fp8_kv" ;;
esac
