"""Train the byte-level BPE vocabulary that generated test models carry; run once, commit the JSON it writes.

    python -m strata.gguf.testmodels.train_vocab

Test models need a real tokenizer (HF transformers and the gateway must both tokenize with it), but training at run
time would make every model generation slow and tie the runtime to the `tokenizers` library. So the vocabulary and
merges are trained here, on the small corpus below, with the Llama-3 split regex ("llama-bpe"), and stored in
vocab.json beside this file. `tokenizers` is imported only here; it comes with transformers in the test extras.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB_PATH = Path(__file__).with_name("vocab.json")
VOCAB_SIZE = 1024
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# llama.cpp's "llama-bpe" pre-tokenizer: the split the merges are learned over.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CORPUS = """
A language model reads text as a sequence of tokens and predicts the next one. Each layer of the model mixes the
tokens it has seen through attention, then transforms every position with a feed-forward network. The keys and
values that attention computes are kept in a cache, so a new token only needs its own projections.
Strata splits the layers of a model across the graphics cards of a cluster. The first stage embeds the prompt, the
middle stages pass hidden states along, and the last stage applies the output head and samples a token.
When a node is lost, the operator plans again: it reads the model header, counts the free memory on every card,
and chooses the fewest stages that reach the longest context. The plan is stored in a config map.
Quantised weights store a scale for each block of thirty-two values and one small integer per value. Eight-bit
blocks keep almost all of the precision; four-bit blocks halve the size again and lose a little more.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. How vexingly quick daft zebras
jump! Sphinx of black quartz, judge my vow. The five boxing wizards jump quickly.
def forward(self, hidden_states, positions):
    query = self.q_proj(hidden_states)
    key = self.k_proj(hidden_states)
    value = self.v_proj(hidden_states)
    return self.o_proj(attention(query, key, value, positions))
for layer in range(0, 32):
    print(f"layer {layer}: {bytes_per_layer[layer] / 1024 / 1024:.1f} MiB")
{"model": "org/repo:Q4", "messages": [{"role": "user", "content": "Hello! How are you today?"}], "max_tokens": 128}
User: What is the capital of France?
Assistant: The capital of France is Paris. It has been the capital for more than a thousand years.
User: Can you count to twenty?
Assistant: One, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve, thirteen, fourteen, fifteen,
sixteen, seventeen, eighteen, nineteen, twenty. 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 100 256 1024 4096
Kubernetes schedules pods onto nodes. A deployment keeps a number of replicas running, a service gives them one
address, and a lease lets one replica act as the coordinator while the others wait their turn.
Weather report: cloudy in the morning, sunny in the afternoon, with a light breeze from the west and a high of 21 °C.
Café, naïve, façade, Zürich, São Paulo, Kraków, 東京, 北京, Москва — names that need more than one byte each.
"""


def train() -> dict[str, list[str]]:
    """The vocabulary in id order (special tokens last) and the merges, each as "left right"."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines() * 4, trainer=trainer)
    saved = json.loads(tokenizer.to_str())["model"]
    tokens = sorted(saved["vocab"], key=saved["vocab"].__getitem__)
    merges = [merge if isinstance(merge, str) else " ".join(merge) for merge in saved["merges"]]
    return {"tokens": [*tokens, *SPECIAL_TOKENS], "merges": merges}


def main() -> None:
    VOCAB_PATH.write_text(json.dumps(train(), ensure_ascii=False, indent=0) + "\n", encoding="utf-8")
    print(f"wrote {VOCAB_PATH}")


if __name__ == "__main__":
    main()
