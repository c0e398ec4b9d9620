"""What LoRA saves against full fine-tuning, as ratios measured in one run on the same model and batches.

    python bench/lora_memory.py              # a 50M-parameter Llava from config, CPU (a GPU when there is one)
    python bench/lora_memory.py --quick

Each variant trains a few steps of `vlm_finetune.py`'s step (`VLMForTraining`, the recipe's param
groups, AdamW) on the embedded conversations in a fresh process, and reports: trainable
parameters, optimizer-state bytes (AdamW's two moments), gradient bytes, and the peak memory of
the training steps above the memory the loaded model already held (CUDA: `max_memory_allocated`;
CPU: the process's peak resident set). Variants: full fine-tuning of projector + LM (the recipe's
default), and LoRA r=16 on the LM's linear layers with the projector in full.
"""

import argparse
import json
import platform
import resource
import time
from pathlib import Path

import torch

from fresh_process import resident_bytes, run_in_fresh_process

RESULTS = Path(__file__).resolve().parent / "results" / "lora_memory.jsonl"


def _variant(use_peft, sizes, steps, batch_size, queue):
    from mmrecipes.distributed import Ranks
    from mmrecipes.images import to_device
    from mmrecipes.vlm.arguments import ChatDataArgs, LoraArgs, VLMModelArgs
    from mmrecipes.vlm.model.families import dummy_image_inputs
    from mmrecipes.vlm.model.loading import stop_token_ids
    from mmrecipes.vlm.model.lora import add_lora
    from mmrecipes.vlm.model.module_groups import apply_train_modules, module_groups
    from mmrecipes.vlm.model.outputs import LossSum
    from mmrecipes.vlm.model.parts import load_vlm
    from mmrecipes.vlm.model.step import VLMForTraining
    from mmrecipes.vlm.rows.chat_data import build_chat_dataloader
    from mmrecipes.vlm.rows.collate import ChatCollator
    from mmrecipes.vlm.rows.labels import AnswerLabeller

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, processor = load_vlm(VLMModelArgs(**sizes))
    dummy_inputs = dummy_image_inputs(model, processor)
    groups = module_groups(model, dummy_inputs)
    trainable = apply_train_modules(groups, "projector,language_model")
    if use_peft:
        _, trainable = add_lora(model, groups, "projector,language_model", LoraArgs(lora_dropout=0.0))
        model.enable_input_require_grads()
    params = [p for group in trainable.values() for p in group if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    wrapper = VLMForTraining(model).to(device)
    args = ChatDataArgs(dataloader_num_workers=0, eval_dataset_name=None)
    loader = build_chat_dataloader(args, AnswerLabeller(processor, stop_token_ids(model, processor)),
                                   ChatCollator(processor.tokenizer.pad_token_id, dummy_inputs),
                                   batch_size=batch_size, ranks=Ranks(), shuffle_seed=0)
    batches = [to_device(batch, device) for _, batch in zip(range(steps), loader)]
    before = torch.cuda.memory_allocated() if device == "cuda" else resident_bytes()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for batch in batches:
        wrapper(batch, LossSum()).summed.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # keep the gradients allocated: they count
    seconds = (time.perf_counter() - start) / len(batches)
    peak = (torch.cuda.max_memory_allocated() if device == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                if torch.is_tensor(t))
    queue.put({"trainable_params": sum(p.numel() for p in params),
               "total_params": sum(p.numel() for p in model.parameters()),
               "optimizer_state_bytes": state, "gradient_bytes": sum(p.numel() * p.element_size() for p in params),
               "peak_training_bytes": peak - before, "seconds_per_step": seconds, "device": device})


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--results", default=str(RESULTS), help="the JSON-lines file to append to")
    args = parser.parse_args()
    if args.quick:
        sizes, steps = {}, 3
    else:  # about 50M parameters, mostly LM: where LoRA's savings show
        sizes, steps = dict(vision_hidden_size=256, vision_layers=4, text_hidden_size=768, text_layers=6), 10
    full = run_in_fresh_process(_variant, False, sizes, steps, args.batch_size, fresh=not args.quick)
    lora = run_in_fresh_process(_variant, True, sizes, steps, args.batch_size, fresh=not args.quick)
    print(f"{'':<24} {'full FT':>14} {'LoRA':>14} {'LoRA / full':>12}")
    ratios = {}
    for key in ("trainable_params", "optimizer_state_bytes", "gradient_bytes", "peak_training_bytes",
                "seconds_per_step"):
        ratios[key] = lora[key] / full[key]
        print(f"{key:<24} {full[key]:>14,.6g} {lora[key]:>14,.6g} {ratios[key]:>12.3f}")
    print(f"model: {full['total_params']:,} parameters on {full['device']}, batch {args.batch_size}, {steps} steps")
    record = {"bench": "lora_memory", "quick": args.quick, "machine": platform.node(),
              "time": time.strftime("%Y-%m-%d %H:%M"), "device": full["device"], "sizes": sizes,
              "batch_size": args.batch_size, "full": full, "lora": lora, "lora_over_full": ratios}
    with open(args.results, "a") as results:
        results.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
