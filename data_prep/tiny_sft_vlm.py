"""The tiny fine-tuned VLMs the GRPO and distillation recipes start from: `vlm_finetune.py` on the embedded
conversations (seed 42), stopped early or made wider.

    python data_prep/tiny_sft_vlm.py                          # data/tiny_sft_vlm (about 15 s on 2 CPU cores)
    python data_prep/tiny_sft_vlm.py --name tiny_teacher_vlm  # data/tiny_teacher_vlm (about 2 min)
    python data_prep/tiny_sft_vlm.py --name tiny_zoom_vlm     # data/tiny_zoom_vlm (about 5 min)

- tiny_sft_vlm: `vlm_finetune.py` with no arguments (the tiny Llava from scratch), stopped after 60 of its 500
  steps (held-out generated accuracy 0.14: it answers sometimes), so that reinforcement learning and distillation
  have room to raise it. GRPO's policy and distillation's student.
- tiny_teacher_vlm: the same recipe on a wider Llava of the same tokenizer and processor (language model width 192,
  3 layers: 2.1M parameters against 0.78M), all 500 steps. Distillation's teacher.
- tiny_zoom_vlm: tiny_sft_vlm fine-tuned 1000 steps on the zoom task's conversations (data_prep/make_zoom.py: half
  call the zoom tool, half answer at once). The multi-turn GRPO tests' and the zoom task's policy.

Their model cards and training logs are left out; the model and processor files are what `from_pretrained` reads.
"""

import argparse
import importlib.util
import shutil
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRESETS = {  # vlm_finetune.py's flags for each
    "tiny_sft_vlm": ["--max_steps", "60", "--eval_steps", "60"],
    "tiny_teacher_vlm": ["--text_hidden_size", "192", "--text_layers", "3", "--eval_steps", "500"],
    "tiny_zoom_vlm": ["--model_name_or_path", "embedded:tiny_sft_vlm", "--dataset_name", "embedded:vlm_zoom/sft",
                      "--eval_dataset_name", "embedded:vlm_zoom/sft", "--max_length", "512", "--max_steps", "1000",
                      "--eval_steps", "1000"],
}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", choices=PRESETS, default="tiny_sft_vlm")
    parser.add_argument("--output_dir", default=None, help="default: data/<name>")
    args = parser.parse_args()
    spec = importlib.util.spec_from_file_location("vlm_finetune", ROOT / "recipes" / "vlm_finetune.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    with tempfile.TemporaryDirectory() as scratch:
        recipe.main([*PRESETS[args.name], "--report_to", "none", "--output_dir", scratch])
        output = Path(args.output_dir or ROOT / "data" / args.name)
        shutil.rmtree(output, ignore_errors=True)
        output.mkdir(parents=True)
        for path in Path(scratch).iterdir():
            if path.is_file() and path.suffix in (".json", ".safetensors", ".jinja"):
                shutil.copy(path, output / path.name)
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
