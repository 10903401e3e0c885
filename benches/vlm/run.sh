#!/usr/bin/env bash
# Vision-language speed (issue #49), one family per call (FAMILY): its shape at random init in
# bf16 (built by make_model.py from the config below, LAYERS text layers), rows of ROW tokens
# each with two images, against the same model on text-only rows of ROW tokens, in one call:
#
#   FAMILY      config                      images (tokens each)              ROW   LAYERS
#   qwen2_5_vl  configs/qwen2.5-vl-7b       448x448 (256)                     1024  28 (all)
#   qwen3_vl    configs/qwen3-vl-8b         448x448 (196)                     1024  36 (all)
#   qwen3_5     configs/qwen3.5-27b         448x448 (196)                     1024  64 (all: set 8)
#   gemma3      configs/gemma3-27b          896x896 (256 + boi, eoi, 4 \n)    1024  62 (all: set 8)
#   llava_next  configs/llava-next-7b       336x336 (1176: 576 base + 24x25)  3072  32 (all)
#
# LLaVA-NeXT's rows are 3072 tokens: no image of it takes under ~1,160 tokens (the base tile's
# 576 and at least two tiles, unpadded), so two images do not fit 1024 (make_data.py).
# Qwen3.5-27B and Gemma 3 27B at full depth need ~380 GB of host RAM at 14 B/param (bf16
# gradients, split master weights, as below); at LAYERS=8 they are 5.6 B and 4.7 B trained
# parameters (the embeddings are most of it), 82 and 70 GB (`mt-launch plan`, below).
#
# What is measured. Model TFLOPS = the language model's 6 x trained params x tokens +
# attention (the trained parameters: the text model; a random init's tower is frozen) plus the
# frozen tower's forward over the step's images (TowerSpec::forward_flops in
# src/config/vision.rs: VisionSpec's there for the Qwen towers, SiglipSpec's in vision/siglip.rs,
# ClipSpec's in vision/clip.rs; each held equal to torch's FlopCounterMode over transformers'
# tower on the test fixtures: src/config/vision/tests.rs, siglip.rs, clip/tests.rs), which per
# family counts (per image at the bench's size):
#   qwen2_5_vl  1.4 TFLOP: the patch embedding, every block's qkv / proj / gated MLP (3
#               matmuls), attention within each window (over the image at
#               fullatt_block_indexes), the merger;
#   qwen3_vl    0.79 TFLOP: the patch embedding, every block's qkv / proj / MLP (2 matmuls),
#               attention over the image, the merger and the 3 deepstack mergers (not: the
#               learned positions' resampling, a weighted gather);
#   qwen3_5     0.74 TFLOP: as qwen3_vl with no deepstack merger;
#   gemma3      5.5 TFLOP: the SigLIP patch embedding, every layer over the 4096 patches of
#               896x896 (attention over all of them), the projector's projection (its
#               average pool and RMSNorm not);
#   llava_next  1.2 TFLOP: the CLIP tower over the 3 tiles (577 tokens each) through the 23
#               layers vision_feature_layer -2 reads (the last layer and post_layernorm do
#               not run), the projector over the tiles' 3 x 576 features (the unpadding and
#               image_newline placement not);
# norms, activations, softmax and the features' placement are not counted in any family, nor
# is anything of the decode, resize and upload (`images_s`, shown beside). MegaTrain's formula
# counts the trained parameters only (no tower). Writes a table with the command to
# $RESULTS/vlm_<name><-NL>_b<B>_<machine>_<date>.md (name: qwen2.5-vl-7b, qwen3-vl-8b,
# qwen3.5-27b, gemma3-27b, llava-next-7b; -NL where LAYERS is not the config's).
#
# On the GPU (no network there: make the data here, ~35 s each, 65 s for LLaVA-NeXT's longer
# rows; it travels in `carry`: 3.3 MB for each Qwen family, 11 MB for Gemma 3's 896x896 PNGs,
# 3.0 MB for LLaVA-NeXT):
#   for f in qwen3_vl qwen3_5 gemma3 llava_next; do
#     .venv/bin/python benches/vlm/make_data.py --family $f --out target/bench-vlm-$f; done
# then three calls, the binaries built there (BIN [target/release]), RESULTS=$OUT so the tables
# come back:
#   1. carry [target/bench-vlm-qwen3_vl]:
#      FAMILY=qwen3_vl BATCH=64 RESULTS=$OUT benches/vlm/run.sh
#   2. carry [target/bench-vlm-llava_next] (21 x 3072 tokens: 64 x 1024's tokens within 2%):
#      FAMILY=llava_next BATCH=21 RESULTS=$OUT benches/vlm/run.sh
#   3. carry [target/bench-vlm-qwen3_5, target/bench-vlm-gemma3]:
#      FAMILY=qwen3_5 LAYERS=8 BATCH=64 RESULTS=$OUT benches/vlm/run.sh;
#      FAMILY=gemma3 LAYERS=8 BATCH=64 RESULTS=$OUT benches/vlm/run.sh
# Model creation (make_model.py, in each call) took here on 2 cores: qwen3_vl 94 s (8.77 B
# parameters, 17 GB), llava_next 88 s (7.57 B, 15 GB), qwen3_5 at 8 layers 73 s (6.05 B, 12 GB),
# gemma3 at 8 layers 63 s (5.14 B, 9.6 GB): about 80 M parameters a second, one core filling
# and the disk writing. `mt-launch plan` of each (host 134 GB, 14 B/param): qwen3_vl 117.4 GB
# host (the Qwen2.5-VL-7B call's was 109.8, measured 109.9), llava_next 103.8, qwen3_5 82.2,
# gemma3 70.1 (at LAYERS=8); device at most 118 GB. Call 3 is the tightest in time (two models
# made, four launches); if it runs out, run the two families in calls of their own.
#
# Tried end to end on CPU workers (each family, 25-85 s here with its data made):
#   FAMILY=<f> SMALL=1 GPUS=0 LAYERS=1 BATCH=1 STEPS=2 PYTHON=.venv/bin/python RESULTS=/tmp/r benches/vlm/run.sh
#
# Environment [defaults]: FAMILY [qwen2_5_vl]  BIN [target/release]  DATA [target/bench-vlm for
#   qwen2_5_vl, else target/bench-vlm-<FAMILY>: make_data.py's output for that family, made here
#   first: .venv/bin/python benches/vlm/make_data.py --family FAMILY --out DATA]
#   BATCH [64]  STEPS [4] (the first is left out of the means)  LAYERS [the config's]  MODEL (a
#   model dir made earlier by make_model.py, else one is made under WORK)  WORK [a temporary
#   directory]  RESULTS [benches/results]  PYTHON [python3]  GPUS [1] (0: CPU workers, to try
#   the script)  SMALL [0] (1: make_model.py --small, a narrow text model and a 2-block tower,
#   to try the script on CPU; the result is named -small)
set -euo pipefail
cd "$(dirname "$0")/../.."
FAMILY=${FAMILY:-qwen2_5_vl}
case $FAMILY in
  qwen2_5_vl) NAME=qwen2.5-vl-7b; TITLE=Qwen2.5-VL-7B ;;
  qwen3_vl) NAME=qwen3-vl-8b; TITLE=Qwen3-VL-8B ;;
  qwen3_5) NAME=qwen3.5-27b; TITLE=Qwen3.5-27B ;;
  gemma3) NAME=gemma3-27b; TITLE="Gemma 3 27B" ;;
  llava_next) NAME=llava-next-7b; TITLE=LLaVA-NeXT-7B ;;
  *) echo "run.sh: FAMILY=$FAMILY: expected qwen2_5_vl, qwen3_vl, qwen3_5, gemma3 or llava_next" >&2; exit 2 ;;
esac
CONFIG=configs/$NAME/config.json
FULL=$("${PYTHON:-python3}" -c 'import json,sys; c=json.load(open(sys.argv[1])); print(c.get("text_config", c)["num_hidden_layers"])' "$CONFIG")
DEFAULT_DATA=target/bench-vlm$([ "$FAMILY" = qwen2_5_vl ] || echo "-$FAMILY")
BIN=${BIN:-target/release}; DATA=${DATA:-$DEFAULT_DATA}; BATCH=${BATCH:-64}; STEPS=${STEPS:-4}
LAYERS=${LAYERS:-$FULL}; GPUS=${GPUS:-1}; RESULTS=${RESULTS:-benches/results}; PYTHON=${PYTHON:-python3}
SMALL=${SMALL:-0}
MACHINE=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr ' ' '-' || echo cpu)
if [ -z "${WORK:-}" ]; then WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT; fi
DATA=$(cd "$DATA" && pwd)
[ -f "$DATA/mllm.json" ] || { echo "run.sh: no $DATA/mllm.json: run benches/vlm/make_data.py --family $FAMILY first" >&2; exit 2; }
# make_data.py's bench.json: the data's family, image side, tokens per image and row length (data
# made before it was written: Qwen2.5-VL's 448x448, 256 tokens, 1024).
read -r DFAMILY SIDE IMAGE_TOKENS ROW < <("$PYTHON" -c 'import json,os,sys
p = os.path.join(sys.argv[1], "bench.json")
b = json.load(open(p)) if os.path.exists(p) else {"family": "qwen2_5_vl", "side": 448, "tokens_per_image": 256, "row": 1024}
print(b["family"], b["side"], b["tokens_per_image"], b["row"])' "$DATA")
[ "$DFAMILY" = "$FAMILY" ] || { echo "run.sh: $DATA holds $DFAMILY data, not $FAMILY: make_data.py --family $FAMILY --out <dir>, then DATA=<dir>" >&2; exit 2; }
if [ -z "${MODEL:-}" ]; then
  MODEL=$WORK/model
  t0=$(date +%s)
  "$PYTHON" benches/vlm/make_model.py --config "$CONFIG" --tokenizer "$DATA/tokenizer" \
    --out "$MODEL" --layers "$LAYERS" $([ "$SMALL" != 1 ] || echo --small)
  echo "run.sh: $FAMILY model made in $(( $(date +%s) - t0 )) s" >&2
fi
cat > "$WORK/run.yaml" <<YAML
model: {path: $MODEL, init: pretrained, dtype: bfloat16}
dataset: {name: bench_mllm, dataset_dir: $DATA, max_seq_len: $ROW, packing: false, shuffle: false}
training: {save_model: false, batch_size: $BATCH, num_steps: $STEPS, learning_rate: 1.0e-5, max_grad_norm: 1.0}
memory: {num_grad_slabs: 4, ce_chunk_tokens: 8192, grad_dtype: bfloat16, master_weights: split}
logging: {log_every: 1}
YAML
for what in mllm text; do
  "$BIN/mt-launch" --config "$WORK/run.yaml" --gpus "$GPUS" --set "dataset.name=bench_$what" \
    --metrics-out "$WORK/$what.jsonl" > "$WORK/$what.log" 2>&1 || { tail -20 "$WORK/$what.log" >&2; exit 1; }
done
mkdir -p "$RESULTS"
out="$RESULTS/vlm_$NAME$([ "$LAYERS" = "$FULL" ] || echo "-${LAYERS}L")$([ "$SMALL" != 1 ] || echo -small)_b${BATCH}_${MACHINE}_$(date +%Y-%m-%d).md"
"$PYTHON" - "$WORK" "$out" "$BATCH" "$LAYERS" "$MACHINE" "$(git rev-parse --short HEAD 2>/dev/null || echo ?)" \
  "$FAMILY" "$TITLE" "$SIDE" "$IMAGE_TOKENS" "$ROW" "$SMALL" <<'PY'
import json, re, sys
work, out, batch, layers, machine, commit, family, title, side, image_tokens, row, small = sys.argv[1:]
def rows(what):
    r = [json.loads(l) for l in open(f"{work}/{what}.jsonl")]
    return [x for x in r if "step_time_s" in x][1:]  # the first step warms up
def mean(rs, k):
    return sum(r[k] for r in rs) / len(rs)
log = open(f"{work}/mllm.log").read()
tower = re.search(r"vision tower: .*", log)
shape = f"{title} shape ({layers} layers{', narrowed by make_model.py --small' if small == '1' else ''})"
lines = [f"# {shape}, batch {batch} x {row} tokens, two {side}x{side} images per row ({image_tokens} tokens each) vs text only, {machine}",
         "", f"Binaries of {commit}; FAMILY={family} benches/vlm/run.sh (BATCH={batch} LAYERS={layers}); random init, bf16, fp32 master and moments in host RAM, every block streamed.",
         f"{tower.group(0) if tower else ''}", "",
         "| rows | step s | model TFLOPS | MegaTrain-formula TFLOPS | tokens/s (labels) | forward s | backward s | peak GPU GB | launcher peak GB |",
         "|---|---|---|---|---|---|---|---|---|"]
res = {}
for what, name in (("mllm", "2 images + text"), ("text", "text only")):
    rs = rows(what)
    res[what] = rs
    lines.append(f"| {name} | {mean(rs, 'step_time_s'):.2f} | {mean(rs, 'tflops_model'):.1f} | {mean(rs, 'tflops_megatrain'):.1f} | "
                 f"{mean(rs, 'tokens_per_s'):.0f} | {mean(rs, 'forward_s'):.2f} | {mean(rs, 'backward_s'):.2f} | "
                 f"{max(r['peak_gpu_bytes'] for r in rs) / 1e9:.1f} | {max(r['launcher_peak_rss_bytes'] for r in rs) / 1e9:.1f} |")
ratio = mean(res["mllm"], "tflops_model") / mean(res["text"], "tflops_model")
lines += ["", "Images: " + ", ".join(f"{r.get('images_s', 0):.2f}" for r in res["mllm"]) + " s per step on the images before the forward (read, decoded, resized, uploaded; the tower launched).", "", f"Model TFLOPS with images / text only: {ratio:.3f} (steps {len(res['mllm'])} and {len(res['text'])} after the first)."]
open(out, "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
echo "run.sh: wrote $out" >&2
