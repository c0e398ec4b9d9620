"""GRPO's two samplers on the same prompt: `generate` with a KV cache (a model whole on the rank) against the synced
loop of whole-sequence forwards (FSDP2, ZeRO-3 without --ds3_gather_for_generation), at growing completion lengths.

    python bench/grpo_sampling.py                  # the tiny SFT'd Llava, 8 completions of 16, 64 and 128 tokens
    python bench/grpo_sampling.py --quick          # a smoke run (CI): 8 tokens

No completion stops early (no stop token), so both run to the length; each pair must sample the same tokens.
Prints the seconds of each and their ratio, measured in one run, on this machine's CPU; appends a JSON line to
bench/results/.
"""

import argparse
import json
import time
from pathlib import Path

import datasets
import torch

from mmrecipes.paths import VLM_SHAPES
from mmrecipes.vlm.algorithms.sampling import generate_group, sample_group
from mmrecipes.vlm.algorithms.trajectory import prompt_seed
from mmrecipes.vlm.arguments import GRPOArgs, PromptDataArgs, VLMModelArgs
from mmrecipes.vlm.model.families import dummy_image_inputs, placeholder_token_ids
from mmrecipes.vlm.model.loading import stop_token_ids
from mmrecipes.vlm.model.parts import load_vlm
from mmrecipes.vlm.model.step import VLMForTraining
from mmrecipes.vlm.rows.collate import ChatCollator
from mmrecipes.vlm.rows.labels import AnswerLabeller
from mmrecipes.vlm.rows.prompts import PromptCollator, PromptPreprocessor

RESULTS = Path(__file__).resolve().parent / "results" / "grpo_sampling.jsonl"


@torch.no_grad()  # not torch.set_grad_enabled(False): tests/run_benches.py runs the next script in this process
def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--results", default=str(RESULTS), help="the JSON-lines file to append to")
    options = parser.parse_args()
    model, processor = load_vlm(VLMModelArgs(model_name_or_path="embedded:tiny_sft_vlm"))
    stops = stop_token_ids(model, processor)
    preprocess = PromptPreprocessor(PromptDataArgs(), AnswerLabeller(processor, stops), max_length=512)
    row = datasets.load_dataset(str(VLM_SHAPES / "image_chat"), split="test")[0]
    out = preprocess({key: [value] for key, value in row.items()})
    chat_collator = ChatCollator(processor.tokenizer.pad_token_id, dummy_image_inputs(model, processor))
    prompt = PromptCollator(chat_collator)([{key: values[0] for key, values in out.items()}])["prompts"][0]
    step = VLMForTraining(model.eval())
    record = {"bench": "grpo_sampling", "quick": options.quick, "prompt_tokens": len(prompt["input_ids"]),
              "num_generations": options.num_generations, "lengths": {}}
    print(f"{'tokens':>6} {'loop s':>8} {'generate s':>10} {'loop / generate':>15}")
    for length in [8] if options.quick else [16, 64, 128]:
        args = GRPOArgs(num_generations=options.num_generations, max_completion_length=length, temperature=1.0)
        seconds, sampled = [], []
        for sample in (sample_group, generate_group):
            started = time.perf_counter()
            sampled.append(sample(step, prompt, chat_collator, args, [], prompt_seed(0, prompt), "cpu",
                                  placeholder_token_ids(model, processor)))
            seconds.append(time.perf_counter() - started)
        if sampled[0] != sampled[1]:
            raise SystemExit(f"{length} tokens: the two samplers drew different completions")
        record["lengths"][length] = {"loop_s": seconds[0], "generate_s": seconds[1], "ratio": seconds[0] / seconds[1]}
        print(f"{length:>6} {seconds[0]:8.2f} {seconds[1]:10.2f} {seconds[0] / seconds[1]:15.1f}")
    with open(options.results, "a") as results:
        results.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
