"""Make the embedded benchmark fixture tasks: a few documents of each built-in task, in the columns of the hub
dataset lmms-eval reads, about the rendered shapes (data_prep/make_shapes.py).

    python data_prep/make_benchmarks.py        # writes data/benchmarks/<task>/test-00000-of-00001.parquet

Deterministic (fixed seed). The tiny models trained on the embedded conversations can answer some of them (colours,
shapes, counts); they are for running the harness end to end and for tests, not for comparing models.
"""

import argparse
import random
from pathlib import Path

import datasets

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


MAKERS = {"mmstar": mmstar, "chartqa": chartqa, "docvqa_val": docvqa, "infovqa_val": infovqa, "ai2d": ai2d,
          "scienceqa_img": scienceqa, "ocrbench": ocrbench, "textvqa_val": textvqa}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default=str(ROOT / "data" / "benchmarks"))
    args = parser.parse_args()
    for offset, (task, make) in enumerate(MAKERS.items()):
        rng = random.Random(100 + offset)
        docs = [make(rng, index) for index in range(DOCS + (task == "ai2d"))]
        table = datasets.Dataset.from_list(docs).cast_column("image", datasets.Image())
        folder = Path(args.output_dir) / task
        folder.mkdir(parents=True, exist_ok=True)
        table.to_parquet(folder / "test-00000-of-00001.parquet")
        print(f"{task}: {len(docs)} documents -> {folder}")


if __name__ == "__main__":
    main()
