#!/usr/bin/env bash
# The tiny-llm example end to end, offline: data -> tokens -> pre-train -> register -> LoRA -> serve -> chat.
set -euo pipefail
cd "$(dirname "$0")"
G=${GPUYARD:-gpuyard}
PY=${PYTHON:-python}
export GPUYARD_HOME=${GPUYARD_HOME:-$PWD/.home}
rm -rf runs
$PY make_data.py data
$G data ingest data/corpus.txt --name stories
$G data tokenize stories --tokenizer data/tokenizer --seq-len 128 --val-fraction 0.05
$G data ingest data/chat.jsonl --name chat --messages-field messages
$G data tokenize chat --tokenizer data/tokenizer --seq-len 128 --val-fraction 0.1
$G train pretrain.yaml --nproc 2
$G llm register tiny runs/pretrain/hf
$G llm eval tiny --data stories-tokens
rm -rf base && $G models export tiny:1 --out base
$G train finetune.yaml
$G llm register tiny runs/finetune/hf --base tiny:1
$G llm merge tiny:2
$G llm promote tiny:3 --data chat-tokens
PORT=${PORT:-8765}
$G serve tiny@production --port "$PORT" --max-batch 8 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
$PY stream_chat.py "http://127.0.0.1:$PORT/v1" tiny@production
