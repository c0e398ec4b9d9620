"""Distillation's teacher and divergence (mmrecipes.vlm.algorithms.distill, .teacher): the step over a window on 2 ranks
x 2 micro-batches equals one process holding the window (loss and gradient norm) under DDP, FSDP2 and ZeRO-3, the
teacher kept as the engine keeps the student (sharded, partitioned); a teacher whose vocabulary or processor differs
is refused before any step, with the reason."""

import re

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor
from trl.trainer.distillation_trainer import _chunked_divergence_loss

from helpers import chat_row, tiny
from launch import REPO, run_engine, run_recipe
from mmrecipes.images import to_device
from mmrecipes.paths import resolve_name
from mmrecipes.vlm.algorithms.distill import on_policy
from mmrecipes.vlm.algorithms.teacher import Teacher, mismatch, reads_own_rows
from mmrecipes.vlm.arguments import PromptDataArgs, VLMModelArgs
from mmrecipes.vlm.model.families import dummy_image_inputs
from mmrecipes.vlm.model.loading import stop_token_ids
from mmrecipes.vlm.model.outputs import GeneralizedJSD
from mmrecipes.vlm.model.parts import load_vlm
from mmrecipes.vlm.model.step import VLMForTraining
from mmrecipes.vlm.rows.collate import ChatCollator
from mmrecipes.vlm.rows.labels import IGNORE_INDEX, AnswerLabeller, count_target_tokens
from mmrecipes.vlm.rows.prompts import DistillCollator, DistillPreprocessor
from test_distill_loss import dense_jsd

TINY_SFT_VLM = resolve_name("embedded:tiny_sft_vlm")

WINDOW = REPO / "tests" / "distill_window.py"
LINE = re.compile(r"window loss ([\d.]+) \| grad_norm ([\d.]+) \| teacher: (.*)")


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A wider tiny Llava of the student's tokenizer and processor (the teacher of a smaller student)."""
    directory = tmp_path_factory.mktemp("teacher")
    model, processor = load_vlm(VLMModelArgs(text_hidden_size=192, text_layers=3))
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


def window_line(result):
    assert result.returncode == 0, result.log[-3000:]
    return LINE.search(result.log).groups()


@pytest.mark.launch
def test_two_ranks_by_two_micro_batches_equal_one_process_with_the_teacher_sharded(teacher_dir):
    truth = window_line(run_recipe(teacher_dir, 4, 2, recipe=WINDOW))
    for config in ("ddp.yaml", "fsdp2.yaml", "zero3.yaml"):
        loss, grad_norm, held = window_line(run_engine(config, teacher_dir, 2, 2, recipe=WINDOW))
        assert float(loss) == pytest.approx(float(truth[0]), rel=1e-5), config
        assert float(grad_norm) == pytest.approx(float(truth[1]), rel=1e-5), config
        values = [int(number.replace(",", "")) for number in re.findall(r"[\d,]+", held)[:2]]
        assert (values[0] < values[1]) == (config != "ddp.yaml"), (config, held)  # sharded, partitioned, whole


def test_a_teacher_of_another_vocabulary_or_template_is_refused_and_other_images_read_its_own_rows(tiny_vlms,
                                                                                                    tmp_path):
    student, processor, _ = tiny()
    other = AutoModelForImageTextToText.from_pretrained(tiny_vlms["qwen2_5_vl"])
    assert "output layer has" in mismatch(student, processor, other, AutoProcessor.from_pretrained(
        tiny_vlms["qwen2_5_vl"]))
    # the same tokenizer and template: rows of the student's, or (other image tokens, other pixels) its own
    wider, wider_processor = load_vlm(VLMModelArgs(text_hidden_size=192))
    assert mismatch(student, processor, wider, wider_processor) is None
    assert not reads_own_rows(processor, wider_processor)
    larger_images, larger_images_processor = load_vlm(VLMModelArgs(image_size=64))
    assert mismatch(student, processor, larger_images, larger_images_processor) is None
    assert reads_own_rows(processor, larger_images_processor)
    wider_processor.image_processor.image_mean = [0.0, 0.0, 0.0]  # the same tokens, other pixels
    assert mismatch(student, processor, wider, wider_processor) is None
    assert reads_own_rows(processor, wider_processor)
    # another chat template: other text tokens, which no alignment can pair
    wider_processor.chat_template = "{{ 'Be brief.' }}" + wider_processor.chat_template
    assert "write the same conversation as other text tokens" in mismatch(student, processor, wider, wider_processor)
    wider.save_pretrained(tmp_path)
    wider_processor.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="needs a teacher of the student's vocabulary and chat template"):
        Teacher.load(str(tmp_path), student, processor)
    # --chat_template_kwargs renders both models' templates: one that never reads a key is refused by name
    with pytest.raises(ValueError, match=r"--chat_template_kwargs \(the teacher's chat template\): the chat template "
                                         "never reads enable_thinking"):
        Teacher.load(str(tmp_path), student, processor, template_kwargs={"enable_thinking": False})
    # Qwen3.5-2B's template (no think block unless asked) and Qwen3.5-4B's (thinks unless told not to): the same
    # conversation text, but the student answers after a closed empty block where the teacher would open one; one
    # mode for both (their templates read enable_thinking) aligns them
    nothink, think = (AutoModelForImageTextToText.from_pretrained(tiny_vlms[name]) for name in ("qwen3_5",
                                                                                                "qwen3_5_think"))
    nothink_processor, think_processor = (AutoProcessor.from_pretrained(tiny_vlms[name]) for name in ("qwen3_5",
                                                                                                      "qwen3_5_think"))
    why = mismatch(nothink, nothink_processor, think, think_processor)
    closed = "\n</think>\n\n"  # what the student's prompt writes after the teacher's
    assert why.startswith(f"their chat templates end a prompt otherwise (the student's with {closed!r}, the "
                          "teacher's with ''"), why
    assert mismatch(nothink, nothink_processor, think, think_processor, {"enable_thinking": False}) is None


def test_prompt_rows_and_chat_rows_become_a_prompt_with_the_dataset_answer_after_it():
    """TRL's prompt rows (with a `solution`) and chat rows: the prompt as the processor writes it with the generation
    prompt, then the dataset's answer, its tokens the only targets (a chat row's earlier answers are context, as in a
    sample); a prompt row without a solution has no off-policy answer and is counted."""
    processor = AutoProcessor.from_pretrained(TINY_SFT_VLM)
    stops = [processor.tokenizer.convert_tokens_to_ids("<|end|>")]
    preprocess = DistillPreprocessor(PromptDataArgs(), AnswerLabeller(processor, stops), max_length=64)
    red = Image.new("RGB", (32, 32), (220, 40, 40))
    question = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is it?"}]}]
    earlier = chat_row("Name a colour.", "blue")["messages"]
    rows = [{"prompt": question, "images": [red], "solution": "red"},
            chat_row("What colour is it?", "red", red),
            {"messages": earlier + chat_row("What colour is it?", "red", red)["messages"], "images": [red]},
            {"prompt": "What colour is it?", "images": [red]},  # no solution
            {"prompt": "What colour is it? " * 40, "solution": "red"}]  # over max_length
    out = preprocess({key: [row.get(key) for row in rows] for key in {key for row in rows for key in row}})
    assert preprocess.drops.totals == {"no_target": 1, "too_long": 1}
    prompt = processor(text=processor.apply_chat_template(question, add_generation_prompt=True), images=[red])
    answer = processor.tokenizer("red<|end|>", add_special_tokens=False)["input_ids"]
    for input_ids, labels, length in zip(out["input_ids"][:2], out["labels"][:2], out["prompt_length"][:2]):
        assert list(input_ids[:length]) == list(prompt["input_ids"][0]) and length == len(prompt["input_ids"][0])
        assert [int(t) for t in labels if t != IGNORE_INDEX] == answer == list(input_ids[length:length + 2])
    input_ids, labels, length = out["input_ids"][2], out["labels"][2], out["prompt_length"][2]
    assert [int(t) for t in labels if t != IGNORE_INDEX] == answer  # "blue" is context
    assert processor.tokenizer.decode(input_ids[:length]).count("blue") == 1
    # the collator: the off-policy micro-batch, and each row's prompt for the samplers
    batch = DistillCollator(ChatCollator(processor.tokenizer.pad_token_id, {}))(
        [dict(zip(out, values)) for values in zip(*out.values())])
    assert batch["answers"]["target_tokens"] == 3 * len(answer) and batch["num_samples"] == 3
    assert [len(prompt["input_ids"]) for prompt in batch["prompts"]] == list(out["prompt_length"])


def test_a_step_is_on_policy_with_probability_lmbda_the_same_draw_on_every_rank():
    draws = [on_policy(42, step, 0.3) for step in range(2000)]
    assert sum(draws) / len(draws) == pytest.approx(0.3, abs=0.03)
    assert draws == [on_policy(42, step, 0.3) for step in range(2000)]  # a rank, a resume: the same
    assert draws != [on_policy(7, step, 0.3) for step in range(2000)]
    assert not any(on_policy(42, step, 0.0) for step in range(100)) and all(
        on_policy(42, step, 1.0) for step in range(100))


def other_image_tokens(case, tiny_vlms, directory):
    """(the student, its processor, the directory of a teacher whose processor writes more image tokens): the tiny
    Llava and a wider one of 64 px images (64 image tokens against 16); the tiny Qwen2.5-VL and itself with
    `min_pixels` raised (images upscaled: 4 times the tokens of a 64 px image); or a student of the tiny Qwen2.5-VL
    whose `max_pixels` is lowered to a 32 px image's, as users set it to save memory, and the teacher at its own
    (the same tokens and pixels at 32 px, fewer above: a probe image could not tell them apart)."""
    if case == "llava":
        student, processor, _ = tiny()
        teacher, teacher_processor = load_vlm(VLMModelArgs(image_size=64, text_hidden_size=192))
    elif case == "qwen2_5_vl":
        student, processor, _ = tiny(tiny_vlms[case])
        teacher = student
        teacher_processor = AutoProcessor.from_pretrained(tiny_vlms[case],
                                                          size={"shortest_edge": 16384, "longest_edge": 65536})
    else:
        teacher, teacher_processor, _ = tiny(tiny_vlms["qwen2_5_vl"])
        student = teacher
        processor = AutoProcessor.from_pretrained(tiny_vlms["qwen2_5_vl"],
                                                  size={"shortest_edge": 64, "longest_edge": 32 * 32})
        assert encoded(processor, 32) == encoded(teacher_processor, 32)  # alike at the probe's size
        assert encoded(processor, 64) != encoded(teacher_processor, 64)  # not at the data's
    teacher.save_pretrained(directory)
    teacher_processor.save_pretrained(directory)
    return student, processor, directory


def encoded(processor, side: int) -> dict:
    """What `processor` makes of one `side` px image (its tokens and pixels), as lists."""
    image = Image.new("RGB", (side, side), (220, 40, 40))
    outputs = processor(text=processor.image_token, images=[image], return_tensors="pt")
    return {name: value.tolist() for name, value in outputs.items()}


def recipe_micro_batch(student, processor, teacher, rows):
    """(`DistillPreprocessor`'s columns, the micro-batch of `rows` as the recipe forwards it: the dataset's answers
    through `DistillCollator`, on the device, with the teacher's hidden states at the student's positions)."""
    preprocess = DistillPreprocessor(PromptDataArgs(), AnswerLabeller(processor, stop_token_ids(student, processor)),
                                     max_length=512, teacher_processor=teacher.own_processor)
    out = preprocess({key: [row[key] for row in rows] for key in rows[0]})
    batch = DistillCollator(ChatCollator(processor.tokenizer.pad_token_id, dummy_image_inputs(student, processor)))(
        [dict(zip(out, values)) for values in zip(*out.values())])
    inputs = to_device(batch["answers"], "cpu")
    inputs["teacher_hidden"] = teacher.hidden(inputs, batch["prompts"])
    return out, inputs


@pytest.mark.parametrize("case", ["llava", "qwen2_5_vl", "student_max_pixels"])
def test_a_teacher_whose_processor_writes_other_image_tokens_reads_its_own_rows_aligned_on_the_text(
        case, tiny_vlms, tmp_path):
    """A teacher whose processor writes more image tokens (other pixels too) reads its own prompts, followed by the
    student row's text after the prompt: the divergence equals each model run on the whole conversation as its own
    processor writes it, their logits compared where both predict the answer's tokens (the dense formula). The old
    failure: judged from one 32 px probe, a student with a lower max_pixels fed the teacher its own pixels."""
    student, processor, teacher_dir = other_image_tokens(case, tiny_vlms, tmp_path)
    teacher = Teacher.load(str(teacher_dir), student, processor)
    assert teacher.own_processor is not None and "reading rows of its own" in teacher.describe()
    with pytest.raises(ValueError, match="--seq_kd with --teacher_model_name_or_path"):
        Teacher.load(str(teacher_dir), student, processor, seq_kd=True)
    rows = [chat_row("What colour is the shape?", "red", Image.new("RGB", (40, 40), (220, 40, 40))),
            chat_row("Which colour is grass?", "green, as a rule"),
            chat_row("How many shapes?", "two", Image.new("RGB", (64, 64), (30, 60, 200)))]
    out, inputs = recipe_micro_batch(student, processor, teacher, rows)
    got = VLMForTraining(student).eval()(inputs, GeneralizedJSD(teacher.head_logits, beta=0.5, temperature=0.8))

    expected, teacher_model = torch.zeros((), dtype=torch.float64), teacher.model.model
    for row, labels in zip(rows, out["labels"]):
        answer = int((labels != IGNORE_INDEX).sum())  # the answer's tokens, its end of turn included
        ids, logits = [], []
        for model, model_processor in ((student, processor), (teacher_model, teacher.processor)):
            text = model_processor.apply_chat_template(row["messages"], tokenize=False)
            encoded = model_processor(text=text, images=row["images"] or None, return_tensors="pt")
            assert model_processor.tokenizer.decode(encoded["input_ids"][0, -1]) == "\n"  # after the end of turn
            with torch.no_grad():
                logits.append(model(**encoded).logits[0, -answer - 2:-2])  # where each predicts the answer
            ids.append(encoded["input_ids"][0, -answer - 1:-1].tolist())
        assert ids[0] == ids[1]  # the same answer tokens, after prompts of other lengths
        expected += dense_jsd(logits[0].double(), logits[1].double(), torch.ones(answer), 0.5, 0.8)
    # Each answer token's term comes from float32 logits of a padded batch and of the row alone, which agree to float32
    # rounding; the term moves by less than that (its derivative in the logits is |p - q| < 1): one float32 epsilon a
    # token. rel=1e-5 alone held on one machine and failed by 1.07e-5 on another CPU (its sums round otherwise).
    answers = sum(int((labels != IGNORE_INDEX).sum()) for labels in out["labels"])
    assert float(got) == pytest.approx(float(expected), rel=1e-5, abs=torch.finfo(torch.float32).eps * answers)


TRL_MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "image_sizes",
                       "token_type_ids", "mm_token_type_ids", "image_position_ids")  # what TRL 1.16 passes on


def assert_equals_trls_loss(student, processor, teacher, rows, beta, temperature):
    """The recipe's step (`Teacher.hidden`, `GeneralizedJSD` through `VLMForTraining`) on `rows`, against TRL
    1.16's `DistillationTrainer` loss (`_chunked_divergence_loss`) on the hidden states TRL takes (each model's
    `base_model` on the same batch, the multimodal inputs TRL passes, the text config's softcap): the summed
    divergence and the student's output-layer gradient."""
    _, inputs = recipe_micro_batch(student, processor, teacher, rows)
    divergence = GeneralizedJSD(teacher.head_logits, beta=beta, temperature=temperature)
    ours = VLMForTraining(student).eval()(inputs, divergence)
    ours.backward()
    head = student.get_output_embeddings()
    our_grad = head.weight.grad.clone()
    student.zero_grad()

    def trl_hidden(model):  # as DistillationTrainer._get_last_hidden_state: the backbone, the last position dropped
        extra = {key: inputs[key] for key in TRL_MULTIMODAL_KEYS if key in inputs}
        return model.base_model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                                **extra).last_hidden_state[:, :-1]

    mask = inputs["labels"][:, 1:] != IGNORE_INDEX
    teacher_model = teacher.model.model
    with torch.no_grad():
        teacher_hidden = trl_hidden(teacher_model)
    tokens = int(mask.sum())
    softcaps = [getattr(model.config.get_text_config(), "final_logit_softcapping", None)
                for model in (student, teacher_model)]
    trl, _, counted = _chunked_divergence_loss(trl_hidden(student), teacher_hidden, head.weight,
                                               teacher_model.get_output_embeddings().weight, mask, beta,
                                               num_items_in_batch=tokens, temperature=temperature,
                                               student_final_logit_softcapping=softcaps[0],
                                               teacher_final_logit_softcapping=softcaps[1])
    (trl * tokens).backward()
    assert int(counted) == tokens == count_target_tokens(inputs["labels"]) > 0  # the collator's target_tokens
    assert ours.item() == pytest.approx(trl.item() * tokens, rel=1e-5)
    torch.testing.assert_close(our_grad, head.weight.grad, rtol=1e-4, atol=1e-6)


ROWS = [chat_row("What colour is the shape?", "red", Image.new("RGB", (32, 32), (220, 40, 40))),
        chat_row("Which colour is grass?", "green, as a rule"),
        chat_row("What colour is the shape?", "blue", Image.new("RGB", (32, 32), (30, 60, 200)))]


@pytest.mark.parametrize("beta, temperature", [(0.0, 1.0), (0.5, 0.7), (1.0, 1.0)])
def test_the_recipes_divergence_equals_trls_on_the_embedded_student_and_teacher(beta, temperature):
    """On the embedded student and teacher, a micro-batch of image and text-only rows, beta 0, 0.5 and 1."""
    student = AutoModelForImageTextToText.from_pretrained(TINY_SFT_VLM)
    processor = AutoProcessor.from_pretrained(TINY_SFT_VLM)
    teacher = Teacher.load(resolve_name("embedded:tiny_teacher_vlm"), student, processor)
    assert_equals_trls_loss(student, processor, teacher, ROWS, beta, temperature)


@pytest.mark.parametrize("family", ["gemma3", "llava_next", "qwen2_vl", "qwen2_5_vl", "qwen3_5"])
def test_the_recipes_divergence_equals_trls_on_the_families_trl_distils(family, tiny_vlms, tmp_path):
    """The VLM families TRL 1.16's DistillationTrainer names (Gemma 3, LLaVA-NeXT, Qwen2-VL, Qwen2.5-VL, Qwen3.5):
    the tiny checkpoint as the student, and as the teacher with its weights moved by seeded noise."""
    student, processor, _ = tiny(tiny_vlms[family])
    teacher = AutoModelForImageTextToText.from_pretrained(tiny_vlms[family])
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in teacher.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.02)
    teacher.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    assert_equals_trls_loss(student, processor, Teacher.load(str(tmp_path), student, processor), ROWS, 0.5, 0.7)
