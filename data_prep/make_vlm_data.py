"""Make the embedded VLM fine-tuning data and its chat tokenizer.

    python data_prep/make_vlm_data.py          # writes data/vlm_shapes/ and data/vlm_tokenizer/

Deterministic (fixed seed). Two sources in the chat format (`messages` with role/content parts,
`{"type": "image"}` where an image goes, and an `images` column), so the recipe mixes them with
weights like any two real datasets:

- `image_chat`: conversations about rendered shapes images (data_prep/make_shapes.py) with short
  checkable answers: colour, shape, size, count, relation. Training rows hold 1-3 question turns
  (multi-turn); test rows hold one, and the recipe scores its answer by exact match. About 1% of
  the training rows are broken the way real data is (undecodable image, an `<image>` placeholder
  without an image, a conversation far over the length limit): the recipe skips and counts them.
- `text_chat`: text-only conversations (facts about shapes, colours, numbers): no image at all.

The tokenizer is a byte-level BPE with `<image>`, `<|pad|>` and a chat template whose assistant
turns are wrapped in `{% generation %}`, so `apply_chat_template(..., return_assistant_tokens_mask=True)`
marks exactly the tokens to train on. Given `tools`, it lists their JSON schemas in a system turn and writes an
assistant's tool calls as `<tool_call>{"name": ..., "arguments": ...}</tool_call>`; a tool's turn is a turn like a
user's (`<|tool|>`, its images and text).
"""

import argparse
import random
from collections import Counter, defaultdict
from pathlib import Path

import datasets
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from make_shapes import encode, make_scene

ROOT = Path(__file__).resolve().parents[1]
IMAGE, PAD, END, USER, ASSISTANT = "<image>", "<|pad|>", "<|end|>", "<|user|>", "<|assistant|>"
# Role headers, one content part after another, <|end|> closing each turn. Assistant text and
# its <|end|> are the generation span: what the model learns to say, and where it learns to stop.
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|system|>\n' }}{% for tool in tools %}{{ tool | tojson }}{{ '\n' }}{% endfor %}"
    "{{ '<|end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' }}"
    "{% if message['content'] is string %}{% set parts = [{'type': 'text', 'text': message['content']}] %}"
    "{% else %}{% set parts = message['content'] %}{% endif %}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{% for part in parts %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% for call in message['tool_calls'] or [] %}{{ '<tool_call>{\"name\": \"' + call['function']['name'] + '\", "
    "\"arguments\": ' + (call['function']['arguments'] | tojson) + '}</tool_call>' }}{% endfor %}"
    "{{ '<|end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}"
    "{% for part in parts %}{% if part['type'] == 'image' %}{{ '<image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{{ '<|end|>\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
SIDE = {"above": ("top", "bottom"), "below": ("bottom", "top"), "left of": ("left", "right"),
        "right of": ("right", "left")}
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
TEXT_FACTS = (
    [(f"How many sides does a {shape} have?", sides) for shape, sides in
     (("triangle", "three"), ("square", "four"), ("diamond", "four"), ("circle", "zero"))]
    + [(f"What is the opposite of {word}?", opposite) for word, opposite in
       (("above", "below"), ("below", "above"), ("left", "right"), ("right", "left"), ("small", "large"),
        ("large", "small"), ("top", "bottom"), ("bottom", "top"))]
    + [(f"What number comes after {NUMBERS[i]}?", NUMBERS[i + 1]) for i in range(1, 8)]
    + [(f"What colour is {thing}?", colour) for thing, colour in
       (("the sky", "blue"), ("grass", "green"), ("snow", "white"), ("a lemon", "yellow"), ("a tomato", "red"),
        ("an orange", "orange"), ("a violet", "purple"))]
)


def questions_about(objects, relation):
    """Every (kind, question, answer) the image answers unambiguously."""
    if relation is None:
        size, color, shape = objects[0]
        return [("colour", "What colour is the shape?", color), ("shape", "What shape is it?", shape),
                ("size", "Is the shape small or large?", size), ("count", "How many shapes are there?", "one")]
    (size_a, color_a, shape_a), (size_b, color_b, shape_b) = objects
    side_a, side_b = SIDE[relation]
    triples = [("count", "How many shapes are there?", "two"),
               ("colour", f"What colour is the {side_a} shape?", color_a),
               ("colour", f"What colour is the {side_b} shape?", color_b),
               ("shape", f"What shape is on the {side_a}?", shape_a),
               ("shape", f"What shape is on the {side_b}?", shape_b)]
    if (color_a, shape_a) != (color_b, shape_b):
        triples.append(("relation", f"Where is the {color_a} {shape_a} relative to the {color_b} {shape_b}?", relation))
    return triples


def conversation(pairs, with_image=True):
    messages = []
    for turn, (question, answer) in enumerate(pairs):
        content = ([{"type": "image", "text": None}] if with_image and turn == 0 else []) + [{"type": "text",
                                                                                              "text": question}]
        messages += [{"role": "user", "content": content},
                     {"role": "assistant", "content": [{"type": "text", "text": answer}]}]
    return messages


def image_chat_split(num_rows, seed, max_turns, broken_fraction):
    rng = random.Random(seed)
    rows, kinds = [], []
    for _ in range(num_rows):
        image, objects, relation = make_scene(rng)
        triples = rng.sample(questions_about(objects, relation), rng.randint(1, max_turns))
        kinds.append(triples[0][0])
        pairs = [(question, answer) for _, question, answer in triples]
        images = [{"bytes": encode(image), "path": None}]
        messages = conversation(pairs)
        if rng.random() < broken_fraction:
            kind = rng.choice(["undecodable", "missing_image", "too_long"])
            if kind == "undecodable":
                images = [{"bytes": encode(image)[:40], "path": None}]
            elif kind == "missing_image":
                images = []
            else:
                messages = conversation(pairs * 40)
        rows.append({"messages": messages, "images": images})
    return rows, kinds


def text_chat_split(num_rows, seed):
    rng = random.Random(seed)
    return [{"messages": conversation(rng.sample(TEXT_FACTS, rng.randint(1, 2)), with_image=False), "images": []}
            for _ in range(num_rows)]


FEATURES = datasets.Features({
    "messages": [{"role": datasets.Value("string"),
                  "content": [{"type": datasets.Value("string"), "text": datasets.Value("string")}]}],
    "images": [datasets.Image()],
})


def write(rows, path):
    datasets.Dataset.from_list(rows, features=FEATURES).to_parquet(str(path))
    print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB, {len(rows)} rows)")


def majority_baseline(rows, kinds):
    """Exact match of always giving the most common answer of each question kind (colour, shape,
    size, count, relation): what a model that ignores the image reaches."""
    by_kind = defaultdict(Counter)
    for row, kind in zip(rows, kinds):
        by_kind[kind][row["messages"][1]["content"][0]["text"]] += 1
    return sum(counts.most_common(1)[0][1] for counts in by_kind.values()) / len(rows)


def make_tokenizer(texts, vocab_size):
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END, PAD, IMAGE, USER, ASSISTANT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=END, pad_token=PAD, extra_special_tokens={"image_token": IMAGE},
        chat_template=CHAT_TEMPLATE, model_max_length=512,
        padding_side="left",  # batched generation (the pipeline) pads on the left; training collators pad right
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default=str(ROOT / "data" / "vlm_shapes"))
    parser.add_argument("--tokenizer_dir", default=str(ROOT / "data" / "vlm_tokenizer"))
    parser.add_argument("--train_rows", type=int, default=4096)
    parser.add_argument("--test_rows", type=int, default=512)
    parser.add_argument("--text_rows", type=int, default=2048)
    parser.add_argument("--train_shards", type=int, default=4)
    parser.add_argument("--vocab_size", type=int, default=512)
    parser.add_argument("--seed", type=int, default=100)
    args = parser.parse_args()

    train, _ = image_chat_split(args.train_rows, args.seed, max_turns=3, broken_fraction=0.01)
    test, test_kinds = image_chat_split(args.test_rows, args.seed + 1, max_turns=1, broken_fraction=0.0)
    text = text_chat_split(args.text_rows, args.seed + 2)
    out = Path(args.output_dir)
    (out / "image_chat").mkdir(parents=True, exist_ok=True)
    (out / "text_chat").mkdir(parents=True, exist_ok=True)
    per_shard = -(-len(train) // args.train_shards)
    for index in range(args.train_shards):
        write(train[index * per_shard:(index + 1) * per_shard],
              out / "image_chat" / f"train-{index:05d}-of-{args.train_shards:05d}.parquet")
    write(test, out / "image_chat" / "test-00000-of-00001.parquet")
    write(text, out / "text_chat" / "train-00000-of-00001.parquet")
    print(f"test majority-answer baseline (exact match): {majority_baseline(test, test_kinds):.3f}")

    texts = [part["text"] for row in train + text for message in row["messages"] for part in message["content"]
             if part["text"]]
    tokenizer = make_tokenizer(texts, args.vocab_size)
    tokenizer.save_pretrained(args.tokenizer_dir)
    print(f"wrote {args.tokenizer_dir}: vocab {len(tokenizer)}, image token id "
          f"{tokenizer.convert_tokens_to_ids(IMAGE)}")


if __name__ == "__main__":
    main()
