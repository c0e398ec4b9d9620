"""Make the embedded benchmark fixture tasks: a few documents of each built-in task, in the columns of the hub
dataset lmms-eval reads, about the rendered shapes (data_prep/make_shapes.py) and, for LibriSpeech, the synthesised
beeps and tones (data_prep/make_audio.py) with LibriSpeech-style transcripts.

    python data_prep/make_benchmarks.py        # writes data/benchmarks/<task>/test-00000-of-00001.parquet
    python data_prep/make_benchmarks.py --tasks librispeech_test_clean

Deterministic (fixed seed). The tiny models trained on the embedded conversations can answer some of them (colours,
shapes, counts); they are for running the harness end to end and for tests, not for comparing models.
"""

import argparse
import random
import re
from pathlib import Path

import datasets

from make_audio import COUNTS, PITCHES, beeps, encode_flac, two_tones
from make_shapes import COLORS, SHAPES, encode, make_scene

ROOT = Path(__file__).resolve().parents[1]
DOCS = 12  # per task (13 for ai2d: uneven over 2 ranks)
LETTERS = "ABCD"


def image_feature(image) -> dict:
    return {"bytes": encode(image), "path": None}


def mmstar(rng, index):
    image, objects, _ = make_scene(rng)
    size, colour, shape = objects[0]
    if index % 2:
        options = [colour, *rng.sample([other for other in COLORS if other != colour], 3)]
        rng.shuffle(options)
        question, answer, category, l2 = "What colour is the first shape?", options.index(colour), \
            "coarse perception", "image scene and topic"
    else:
        options = list(SHAPES)
        rng.shuffle(options)
        question, answer, category, l2 = "Which shape is in the image?", options.index(shape), \
            "fine-grained perception", "recognition"
    listed = ", ".join(f"{letter}: {option}" for letter, option in zip(LETTERS, options))
    return {"index": index, "question": f"{question}\nOptions: {listed}", "image": image_feature(image),
            "answer": LETTERS[answer], "category": category, "l2_category": l2, "meta_info": {"source": "shapes"}}


def chartqa(rng, index):
    image, objects, _ = make_scene(rng)
    return {"type": "human_test" if index % 2 else "augmented_test", "question": "How many shapes are there?",
            "answer": str(len(objects)), "image": image_feature(image)}


def docvqa(rng, index):
    image, objects, _ = make_scene(rng)
    colour = objects[0][1]
    return {"questionId": str(1000 + index), "question": "What colour is the first shape?",
            "question_types": ["figure/diagram"], "image": image_feature(image), "docId": index,
            "ucsf_document_id": f"shapes{index}", "ucsf_document_page_no": "1", "answers": [colour, colour.title()],
            "data_split": "val"}


def infovqa(rng, index):
    image, objects, _ = make_scene(rng)
    shape = objects[0][2]
    return {"questionId": str(2000 + index), "question": "Which shape comes first?", "answer_type": ["single span"],
            "image": image_feature(image), "image_url": f"shapes{index}.png", "operation/reasoning": [""],
            "ocr": "", "question_type": ["visual/layout"], "answers": [shape, f"a {shape}"], "data_split": "val"}


def ai2d(rng, index):
    image, objects, _ = make_scene(rng)
    options = list(SHAPES)
    rng.shuffle(options)
    return {"question": "Which shape is shown first?", "options": options,
            "answer": str(options.index(objects[0][2])), "image": image_feature(image)}


def scienceqa(rng, index):
    image, objects, _ = make_scene(rng)
    choices = list(SHAPES)[:2 + index % 3]  # 2 to 4 choices
    if objects[0][2] not in choices:
        choices[-1] = objects[0][2]
    rng.shuffle(choices)
    return {"image": image_feature(image), "question": "Which shape is shown first?", "choices": choices,
            "answer": choices.index(objects[0][2]), "hint": "Shapes are drawn on a dark canvas." if index % 2 else "",
            "task": "closed choice", "grade": "grade2", "subject": "natural science", "topic": "shapes",
            "category": "Shapes", "skill": "Identify shapes", "lecture": "", "solution": ""}


def ocrbench(rng, index):
    image, objects, _ = make_scene(rng)
    kinds = [("Regular Text Recognition", "IIIT5K"), ("Scene Text-centric VQA", "textVQA"),
             ("Handwritten Mathematical Expression Recognition", "HME100k")]
    question_type, dataset = kinds[index % 3]
    return {"dataset": dataset, "question": "What colour is the first shape?", "question_type": question_type,
            "answer": [objects[0][1], objects[0][1].upper()] if index % 2 else [f"{objects[0][1]} shape"],
            "image": image_feature(image)}


def textvqa(rng, index):
    image, objects, _ = make_scene(rng)
    colour = objects[0][1]
    answers = [colour] * (4 + index % 5) + ["a " + colour] * 2 + [rng.choice(list(COLORS))] * (4 - index % 5 % 4)
    return {"image_id": f"shapes{index}", "question_id": 3000 + index, "question": "what colour is the first shape?",
            "answers": answers[:10], "image": image_feature(image), "image_classes": ["shape"],
            "flickr_original_url": "", "flickr_300k_url": "", "image_width": 64, "image_height": 64,
            "set_name": "val", "ocr_tokens": []}


MMMU_SUBJECTS = ("Art_Theory", "Biology", "Computer_Science", "Math")
# (question, options or None for an open question): image placeholders in every place MMMU puts them, the order and
# repetition quirks of lmms-eval's interleaving included
MMMU_FORMS = [
    ("<image 1> Which shape is shown first?", "shapes"),
    ("What colour is the first shape in <image 1>?", "colours"),
    ("Compare <image 1> and <image 2>. Which shape comes first in <image 1>?", "shapes"),
    ("Which image shows the same shape as <image 1>?", "images"),
    ("In <image 2>, and then in <image 1>, which shape comes first in <image 1>?", "shapes"),
    ("How many shapes are in <image 1>?", None),
    ("<image 1> <image 1> What colour is the first shape?", "colours"),
    ("What colour is the first shape of this picture <image 1>?", None),
]


def mmmu(rng, index):
    image, objects, _ = make_scene(rng)
    others = [make_scene(rng)[0] for _ in range(2)]
    question, kind = MMMU_FORMS[index % len(MMMU_FORMS)]
    size, colour, shape = objects[0]
    images = {"image_1": image, "image_2": others[0], "image_3": others[1]}
    if kind is None:
        options, answer = [], str(len(objects)) if "How many" in question else colour
    else:
        right = {"shapes": shape, "colours": colour, "images": "<image 2>"}[kind]
        pool = {"shapes": list(SHAPES), "colours": list(COLORS), "images": ["<image 2>", "<image 3>"]}[kind]
        options = [right, *rng.sample([other for other in pool if other != right], min(3, len(pool) - 1))]
        rng.shuffle(options)
        answer = LETTERS[options.index(right)]
        if kind == "images":
            images["image_2"] = image  # the same picture as <image 1>
    row = {"id": f"validation_{MMMU_SUBJECTS[index % 4]}_{index + 1}", "question": question, "options": str(options),
           "explanation": "", "img_type": "['Diagrams']", "answer": answer, "topic_difficulty": "Easy",
           "question_type": "multiple-choice" if options else "open", "subfield": "Shapes"}
    named = set(re.findall(r"<image \d+>", f"{question} {options}"))
    return row | {f"image_{n}": image_feature(images[f"image_{n}"]) if f"<image {n}>" in named else None
                  for n in range(1, 8)}


def mmbench(rng, index):
    """A question (index under 10^6) or a circular copy of it (its options rotated, index + k * 10^6)."""
    question, copy = index % 4, index // 4
    scene = random.Random(500 + question)  # the copies of a question show the same image
    image, objects, _ = make_scene(scene)
    options = [objects[0][2], *scene.sample([other for other in SHAPES if other != objects[0][2]], 1 + question % 3)]
    scene.shuffle(options)
    rotated = options[copy % len(options):] + options[:copy % len(options)]
    letters = {letter: (rotated[number] if number < len(rotated) else None) for number, letter in enumerate(LETTERS)}
    return {"index": question + copy * 1_000_000, "question": "Which shape is shown first?",
            "hint": "Shapes are drawn on a dark canvas." if question % 2 else None, **letters,
            "answer": LETTERS[rotated.index(objects[0][2])], "category": "object_localization",
            "image": image_feature(image), "source": "shapes", "L2-category": "finegrained_perception (instance-level)",
            "comment": None, "split": "dev"}


# LibriSpeech-style references (upper case, no punctuation) with what Whisper's normalisers rewrite: numbers,
# British spellings, contractions, titles
TRANSCRIPTS = ("THREE BEEPS IN ONE SECOND", "THE SECOND TONE IS HIGHER THAN THE FIRST",
               "TWO BEEPS AT FOUR HUNDRED AND FORTY HERTZ", "HE SAID THE COLOUR OF THE SOUND WAS GREY",
               "MISTER JONES COUNTED ONE BEEP", "IT'S THE FIRST TONE THAT'S HIGHER",
               "FOUR BEEPS TWENTY FIVE PERCENT LOUDER", "WE WON'T HEAR A FIFTH BEEP",
               "ONE OH ONE TONES IN NINETEEN SIXTY",
               "THEY ORGANISED TWO TONES", "THE BEEPS CAME AT THREE POINT FIVE SECONDS",
               "DOCTOR SMITH HEARD NO TONE AT ALL")


def librispeech(rng, index):
    if index % 2:
        clip = two_tones(*rng.sample(PITCHES, 2))
    else:
        clip = beeps(rng.randrange(len(COUNTS)) + 1, rng.choice(PITCHES), rng)
    return {"audio": {"bytes": encode_flac(clip), "path": None}, "gt": TRANSCRIPTS[index % len(TRANSCRIPTS)],
            "source": "librispeech_test_clean", "task": "asr_en"}


MAKERS = {"mmstar": mmstar, "chartqa": chartqa, "docvqa_val": docvqa, "infovqa_val": infovqa, "ai2d": ai2d,
          "scienceqa_img": scienceqa, "ocrbench": ocrbench, "textvqa_val": textvqa,
          "mmmu_val": mmmu, "mmbench_en_dev_static": mmbench, "librispeech_test_clean": librispeech}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default=str(ROOT / "data" / "benchmarks"))
    parser.add_argument("--tasks", default=",".join(MAKERS), help="the tasks to write, comma-separated")
    args = parser.parse_args()
    for offset, (task, make) in enumerate(MAKERS.items()):
        if task not in args.tasks.split(","):
            continue
        rng = random.Random(100 + offset)
        docs = [make(rng, index) for index in range(DOCS + (task == "ai2d"))]
        table = datasets.Dataset.from_list(docs)
        for column in [name for name in table.column_names if re.fullmatch(r"image(_\d)?", name)]:
            table = table.cast_column(column, datasets.Image())
        if "audio" in table.column_names:
            table = table.cast_column("audio", datasets.Audio())
        folder = Path(args.output_dir) / task
        folder.mkdir(parents=True, exist_ok=True)
        table.to_parquet(folder / "test-00000-of-00001.parquet")
        print(f"{task}: {len(docs)} documents -> {folder}")


if __name__ == "__main__":
    main()
