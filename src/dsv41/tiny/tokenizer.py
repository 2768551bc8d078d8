"""A small byte-level BPE tokenizer with the V4.1 special tokens, for the built-in tiny model.

It is trained (deterministically) on the short English corpus below and laid out like the release's: ids
0/1/2 = BOS/EOS/pad inside the BPE range, the chat/task/image tokens as added tokens after the BPE vocabulary,
and unused placeholder tokens up to a total that every tensor-parallel degree (1/2/4/8) divides.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from dsv41.errors import TokenizerError
from dsv41.tokenizer import BOS_TEXT, EOS_TEXT, PAD_TEXT, SPECIAL_TOKENS

# Added after the BPE vocabulary, in this order. `special=False` ones stay in decoded text even with
# skip_special_tokens (the chat parser needs to see them).
ADDED_TOKENS: list[tuple[str, bool]] = [
    (SPECIAL_TOKENS["system"], True),
    (SPECIAL_TOKENS["user"], True),
    (SPECIAL_TOKENS["assistant"], True),
    (SPECIAL_TOKENS["eot"], True),
    (SPECIAL_TOKENS["think"], False),
    (SPECIAL_TOKENS["end_think"], False),
    (SPECIAL_TOKENS["dsml"], False),
    (SPECIAL_TOKENS["latest_reminder"], True),
    (SPECIAL_TOKENS["action"], True),
    (SPECIAL_TOKENS["query"], True),
    (SPECIAL_TOKENS["authority"], True),
    (SPECIAL_TOKENS["domain"], True),
    (SPECIAL_TOKENS["title"], True),
    (SPECIAL_TOKENS["read_url"], True),
    (SPECIAL_TOKENS["image"], True),
]

PLACEHOLDER = "<｜place▁holder▁no▁{}｜>"

# Pre-tokenizer in the release's shape (MODEL.md §12.1): digits in runs of at most three, CJK runs, then a
# word/punctuation/whitespace split of our own, then the byte-level mapping.
_DIGITS = r"\p{N}{1,3}"
_CJK = r"[\p{Han}\p{Hiragana}\p{Katakana}]+"
_WORDS = r" ?\p{L}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

TINY_CORPUS = """\
The lighthouse stood at the end of a narrow spit of rock, and every evening its keeper climbed the
ninety-one steps to light the lamp. He wrote the time, the wind and the state of the sea in a small
notebook. On calm nights the entries were short; on stormy ones they filled a whole page.

Ships passing the point saw the beam sweep across the water once every twelve seconds. Sailors counted
the flashes to know which light they were looking at: three short flashes and a long one meant the
northern cape, two long flashes the harbour mouth. A wrong count could put a vessel on the reef.

In the spring of 1987 a survey team arrived with new equipment. They measured the height of the tower
(42.5 metres), the range of the beam (about 18 nautical miles) and the power of the old lamp. Their
report recommended an automatic light, and the keeper spent his last summer teaching them how the
clockwork worked.

Markets open early in the old town. By six o'clock the bakers have sold their first loaves, the fish
stalls are covered in ice, and the flower sellers argue about the price of tulips. Visitors often ask
why the streets are so quiet by noon; the answer is simple: everyone who works there started at four.

A simple program reads numbers from a file and prints their sum:

    def total(path):
        values = []
        with open(path) as handle:
            for line in handle:
                line = line.strip()
                if line:
                    values.append(float(line))
        return sum(values)

    if __name__ == "__main__":
        print(total("numbers.txt"))  # e.g. 3 + 4.5 + 10 = 17.5

The function returns 0 for an empty file. For a list like [1, 2, 3, 4, 5, 6, 7, 8, 9, 10] the result
is 55, and for 100, 200 and 300 it is 600. A JSON record looks like {"id": 7, "name": "beacon", "on": true}.

Questions and answers. What is the capital of France? Paris. How many days are in a leap year? 366.
What is 12 times 12? 144. Who wrote the note every evening? The keeper did, in a careful hand, and the
note said the same thing most nights: the light is burning, the sea is calm, all is well.
"""


def build_tiny_tokenizer(out_dir: str | Path, vocab_size: int = 512, bpe_size: int = 448) -> Tokenizer:
    """Train the tiny tokenizer and write `tokenizer.json` + `tokenizer_config.json` into `out_dir`.

    `bpe_size` counts the byte alphabet, the merges and BOS/EOS/pad; the added tokens and placeholders fill
    the rest up to exactly `vocab_size`. The output is byte-identical across runs and machines.
    """
    n_fixed = bpe_size + len(ADDED_TOKENS)
    if n_fixed > vocab_size:
        raise TokenizerError(f"tiny tokenizer: bpe_size {bpe_size} + {len(ADDED_TOKENS)} added tokens exceed "
                             f"vocab_size {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_DIGITS), behavior="isolated"),
        pre_tokenizers.Split(Regex(_CJK), behavior="isolated"),
        pre_tokenizers.Split(Regex(_WORDS), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_size,
        min_frequency=1,
        show_progress=False,
        special_tokens=[BOS_TEXT, EOS_TEXT, PAD_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(TINY_CORPUS.splitlines(keepends=True), trainer=trainer)
    trained = tokenizer.get_vocab_size(with_added_tokens=True)
    if trained != bpe_size:
        raise TokenizerError(f"tiny tokenizer: the corpus only supports {trained} BPE tokens, not {bpe_size}")

    for text, special in ADDED_TOKENS:
        token = AddedToken(text, normalized=False, special=special)
        (tokenizer.add_special_tokens if special else tokenizer.add_tokens)([token])
    n_placeholders = vocab_size - tokenizer.get_vocab_size(with_added_tokens=True)
    tokenizer.add_special_tokens([AddedToken(PLACEHOLDER.format(k), normalized=False, special=True)
                                  for k in range(n_placeholders)])
    if tokenizer.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise TokenizerError(f"tiny tokenizer: built {tokenizer.get_vocab_size(True)} tokens, wanted {vocab_size}")

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    config = {
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": BOS_TEXT,
        "eos_token": EOS_TEXT,
        "pad_token": PAD_TEXT,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1048576,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                   encoding="utf-8")
    return tokenizer
