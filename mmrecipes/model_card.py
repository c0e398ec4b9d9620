"""What a recipe leaves beside its weights: a Hugging Face model card and the training curves.

`History` collects what the recipe logs (the same dicts it passes to `accelerator.log`); at the
final save, `write_model_card` writes `output_dir/README.md`, a model card that
`huggingface_hub.ModelCard` parses (library, pipeline tag, base model, datasets, tags; then the
command, the engine, what the run saw, the final metrics and how to load it), and
`output_dir/training_curves.png`, the loss and the evaluation metric against steps, which the card
shows. Main process only: no collectives.
"""

import json
import shlex
import sys
from pathlib import Path

from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES
from huggingface_hub import ModelCard, ModelCardData

CURVES = "training_curves.png"
CURVES_SIZE = (1200, 450)  # pixels: 8 x 3 inches at 150 dpi


class History:
    """Every logged value by name: {name: [(step, value), ...]}; which names came from
    evaluations."""

    def __init__(self):
        self.values, self.evaluated = {}, []

    def add(self, step: int, metrics: dict, *, evaluation: bool = False):
        for name, value in metrics.items():
            if isinstance(value, (int, float)):
                self.values.setdefault(name, []).append((step, float(value)))
                if evaluation and name not in self.evaluated:
                    self.evaluated.append(name)

    def last(self, name):
        return self.values[name][-1][1] if self.values.get(name) else None


def plot_curves(history: History, path, eval_metrics: list[str]):
    """Training loss (left) and the evaluation metrics (right) against steps, a PNG of CURVES_SIZE
    pixels."""
    from matplotlib.figure import Figure  # no pyplot: no display needed

    figure = Figure(figsize=(CURVES_SIZE[0] / 150, CURVES_SIZE[1] / 150), dpi=150)
    for axes, names in zip(figure.subplots(1, 2), (["loss"], eval_metrics)):
        drawn = [name for name in names if history.values.get(name)]
        for name in drawn:
            points = history.values[name]
            axes.plot(*zip(*points), marker="o" if len(points) < 30 else None, markersize=3, label=name)
        if not drawn:
            axes.text(0.5, 0.5, "not evaluated", ha="center", va="center", transform=axes.transAxes)
        elif len(drawn) > 1:
            axes.legend(fontsize="small")
        axes.set_xlabel("step")
        axes.set_title(" / ".join(names) if len(names) < 3 else "evaluation")
        axes.grid(alpha=0.3)
    figure.subplots_adjust(left=0.08, right=0.98, bottom=0.15, top=0.9, wspace=0.22)  # tight_layout: 2x the time
    figure.savefig(path, dpi=150)


# How to load the output, by pipeline tag ({output_dir}: where it was saved)
LOAD_EXAMPLES = {
    "zero-shot-image-classification": """from transformers import pipeline
classify = pipeline("zero-shot-image-classification", model="{output_dir}")
classify(image, candidate_labels=["a red circle", "a blue square"])""",
    "zero-shot-audio-classification": """from transformers import pipeline
classify = pipeline("zero-shot-audio-classification", model="{output_dir}")
classify(clip, candidate_labels=["beeps", "noise"])  # clip: samples at classify.feature_extractor.sampling_rate""",
    "image-text-to-text": """from transformers import pipeline
answer = pipeline("image-text-to-text", model="{output_dir}")
answer(text=[{{"role": "user", "content": [{{"type": "image", "image": image}},
             {{"type": "text", "text": "What colour is the shape?"}}]}}], max_new_tokens=16)""",
}


def write_model_card(output_dir, report, *, pipeline_tag: str, base_model: str | None, datasets: list[str],
                     evaluated: str, tags: list[str], engine: str, seen: str, resumed_at: int,
                     template_kwargs: dict | None = None):
    """`output_dir/README.md` (a model card) and `output_dir/training_curves.png`, from the run's
    `reporting.Report`: its history, its evaluations' curves and their own lines (the benchmarks').
    `engine`: the `[engine]` line; `seen`: what the run trained on, before a resume at `resumed_at`
    too (0: not resumed); `evaluated`: what the evaluation metrics measured (the recipe's
    evaluation line); `template_kwargs`: --chat_template_kwargs, what its chat template was rendered with
    (the model is served the same way)."""
    history, eval_metrics, benchmarks = report.history, report.curves(), report.card_lines()
    output_dir = Path(output_dir)
    plot_curves(history, output_dir / CURVES, eval_metrics)
    # hub ids only: not local paths, embedded names, or builders such as parquet (their files are
    # the data)
    hub_datasets = [name for name in datasets if name and not Path(name).exists() and ":" not in name
                    and name not in _PACKAGED_DATASETS_MODULES]
    data = ModelCardData(library_name="transformers", pipeline_tag=pipeline_tag, base_model=base_model,
                         datasets=hub_datasets or None, tags=["mmrecipes", *tags])
    final = {name: history.last(name) for name in ("loss", "grad_norm", *history.evaluated) if name in history.values}
    steps = max((points[-1][0] for points in history.values.values()), default=0)
    lines = [
        f"# {output_dir.name}",
        "",
        f"Trained with mmrecipes ({', '.join(tags)}), {steps} optimizer steps:",
        "",
        "```bash",
        "accelerate launch " + shlex.join(sys.argv),
        "```",
        "",
        f"- engine: {engine.removeprefix('[engine] ')}",
        f"- seen: {seen}" + (f" (resumed at step {resumed_at})" if resumed_at else ""),
        f"- base model: {base_model or 'built from a config (random initialisation)'}",
        f"- data: {', '.join(name for name in datasets if name) or '-'}",
        f"- evaluated: {evaluated}",
        *([f"- chat template rendered with: `{json.dumps(template_kwargs, sort_keys=True)}` (--chat_template_kwargs; "
           "pass the same to `apply_chat_template`)"] if template_kwargs else []),
        "",
        "## Final metrics",
        "",
        "| metric | value |",
        "|---|---|",
        *[f"| {name} | {value:.6g} |" for name, value in final.items()],
        "",
        f"![training curves]({CURVES})",
        "",
        *(["## Benchmarks", "", *benchmarks, ""] if benchmarks else []),
        "## How to load",
        "",
        "```python",
        LOAD_EXAMPLES[pipeline_tag].format(output_dir=output_dir),
        "```",
    ]
    ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines) + "\n").save(output_dir / "README.md")
