"""Train the project's byte-level BPE tokenizer on the corpus it ships.

    .venv/bin/python scripts/train_tokenizer.py            # rewrites models/assets/tokenizer/
    .venv/bin/python scripts/train_tokenizer.py --check    # exit 1 if the committed files differ

Input: models/assets/corpus/*.txt (sorted by name). Output: tokenizer.json,
tokenizer_config.json (with Granite's chat template) and special_tokens_map.json.
Training is deterministic: the same corpus gives the same bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "models" / "assets" / "corpus"
OUT = ROOT / "models" / "assets" / "tokenizer"
VOCAB_SIZE = 8192

# Granite's special tokens; <|end_of_text|> is id 0 and serves as bos, eos and pad, as in Granite 3.x.
END_OF_TEXT = "<|end_of_text|>"
SPECIAL_TOKENS = [END_OF_TEXT, "<|start_of_role|>", "<|end_of_role|>", "<|tool_call|>"]

# Granite 3.x chat template (roles between <|start_of_role|> and <|end_of_role|>, each turn
# closed by <|end_of_text|> and a newline; a default system turn when none is given).
CHAT_TEMPLATE = (
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}"
    "{%- else %}"
    "{%- set system_message = 'You are Granite, developed by IBM. You are a helpful AI assistant.' %}"
    "{%- set loop_messages = messages %}"
    "{%- endif %}"
    "{{- '<|start_of_role|>system<|end_of_role|>' + system_message + '<|end_of_text|>\\n' }}"
    "{%- for message in loop_messages %}"
    "{{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' + message['content'] + '<|end_of_text|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_of_role|>assistant<|end_of_role|>' }}"
    "{%- endif %}"
)


def corpus_files() -> list[Path]:
    files = sorted(CORPUS.glob("*.txt"))
    if not files:
        raise SystemExit(f"no corpus files in {CORPUS}")
    return files


def train() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, min_frequency=2, show_progress=False,
        special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(f) for f in corpus_files()], trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != i:
            raise SystemExit(f"special token {t} has id {tok.token_to_id(t)}, expected {i}")
    return tok


def tokenizer_files(tok: Tokenizer) -> dict[str, str]:
    """File name -> exact text to write."""
    added = {
        str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": True}
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": END_OF_TEXT,
        "eos_token": END_OF_TEXT,
        "pad_token": END_OF_TEXT,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "padding_side": "left",
        "added_tokens_decoder": added,
        "additional_special_tokens": SPECIAL_TOKENS[1:],
        "chat_template": CHAT_TEMPLATE,
    }
    special_map = {"bos_token": END_OF_TEXT, "eos_token": END_OF_TEXT, "pad_token": END_OF_TEXT,
                   "additional_special_tokens": SPECIAL_TOKENS[1:]}
    return {
        "tokenizer.json": tok.to_str(pretty=True) + "\n",
        "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False) + "\n",
        "special_tokens_map.json": json.dumps(special_map, indent=2) + "\n",
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--check", action="store_true", help="compare with the files in --out")
    args = ap.parse_args()
    files = tokenizer_files(train())
    if args.check:
        differ = [n for n, text in files.items()
                  if not (args.out / n).is_file() or (args.out / n).read_text() != text]
        print("differ: " + ", ".join(differ) if differ else "up to date")
        return 1 if differ else 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (args.out / name).write_text(text)
    print(f"wrote {', '.join(files)} to {args.out} (vocab {VOCAB_SIZE})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
