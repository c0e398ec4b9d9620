"""Make the embedded preference pairs for `recipes/vlm_dpo.py` from the embedded VLM questions.

    python data_prep/make_vlm_preferences.py   # writes data/vlm_preferences/ (after make_vlm_data.py)

Deterministic (fixed seed). Each pair is the first question of a `data/vlm_shapes` conversation in TRL's
conversational preference format: `prompt` (the user turn, with its image part), `chosen` (the right answer)
and `rejected` (another answer to a question of the same kind: a wrong colour, shape, count, relation or yes/no),
with the `images` column as it was. Training: 2,048 image questions (the rows broken the way real data is
included: the recipe skips and counts them) and 512 text-only ones, for mixed image and text-only ranks; test: 256
image questions.
"""

import argparse
import random
from collections import defaultdict
from pathlib import Path

import datasets

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "data" / "vlm_shapes"


def first_question(messages):
    """(prompt turn, answer text, kind) of a conversation's first exchange; kind: the question's first two words."""
    prompt, answer = messages[0], messages[1]["content"][0]["text"]
    question = next(part["text"] for part in prompt["content"] if part["type"] == "text")
    return prompt, answer, " ".join(question.split()[:2])


def pairs(rows, answers_by_kind, rng):
    def pair(row):
        prompt, answer, kind = first_question(row["messages"])
        wrong = rng.choice(sorted(answers_by_kind[kind] - {answer}))
        return {"prompt": [prompt], "chosen": [{"role": "assistant", "content": [{"type": "text", "text": answer}]}],
                "rejected": [{"role": "assistant", "content": [{"type": "text", "text": wrong}]}]}

    return rows.map(pair, remove_columns=["messages"])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default=str(ROOT / "data" / "vlm_preferences"))
    args = parser.parse_args()
    rng = random.Random(0)
    # Images stay encoded bytes: the broken ones must not be decoded here.
    undecoded = datasets.Sequence(datasets.Image(decode=False))
    image_chat = datasets.load_dataset(str(SOURCE / "image_chat")).cast_column("images", undecoded)
    text_chat = datasets.load_dataset(str(SOURCE / "text_chat"))["train"].cast_column("images", undecoded)
    answers_by_kind = defaultdict(set)
    for rows in (image_chat["train"], text_chat):
        for messages in rows["messages"]:
            _, answer, kind = first_question(messages)
            answers_by_kind[kind].add(answer)
    train = datasets.concatenate_datasets([pairs(image_chat["train"].select(range(2048)), answers_by_kind, rng),
                                           pairs(text_chat.select(range(512)), answers_by_kind, rng)])
    test = pairs(image_chat["test"].select(range(256)), answers_by_kind, rng)
    splits = {"train": train.shuffle(seed=0), "test": test}
    for name, rows in splits.items():
        path = Path(args.output_dir) / f"{name}-00000-of-00001.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        rows.cast_column("images", datasets.Sequence(datasets.Image())).to_parquet(str(path))
        print(f"wrote {path}: {len(rows)} pairs ({path.stat().st_size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
